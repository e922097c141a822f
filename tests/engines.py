"""One real vLLM server per (model, mode, options) for the whole session, shared by every module that asks for it.

A vLLM start costs 30-50 s on two cores, so the modules ask this registry (the ``engines`` session fixture in
tests/conftest.py) instead of starting their own: the same toy's plain or extraction server, asked for by two
modules, starts once. Starts run in the background (``submit``), so a module's fixtures train while its servers
come up. A server whose last user releases it stops at once when it serves a draft (the draft lives in that
module's temporary folder, no one else asks for it); one without a draft stays up, the most recent ``IDLE`` of
them, for the next module that asks (the engine modules run one after another in file order).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from eagle3nb.launch import ServerHandle
from eagle3nb.serve.vllm import start_vllm

IDLE = 2  # released draft-less servers kept up (each holds ~1.5 GB: the model and its 1 GiB KV cache)

# The vLLM model classes (module under vllm.model_executor.models, class) the suite's servers and vllm_drafts.py load.
# vLLM inspects a model class in a subprocess of its own (one more import of vLLM, ~8 CPU-s) unless its model-info cache
# has it: on a fresh machine the suite ran 16 such subprocesses, 140 CPU-s, several at once where servers start side by
# side (docs/testing.md). ``warm_model_info`` fills that cache in one process as the session starts; a class missing
# here costs its inspection once, never a failure.
SERVED_CLASSES = (("llama", "LlamaForCausalLM"), ("llama_eagle3", "Eagle3LlamaForCausalLM"),
                  ("deepseek_v2", "DeepseekV3ForCausalLM"), ("deepseek_eagle3", "Eagle3DeepseekV2ForCausalLM"),
                  ("qwen3_moe", "Qwen3MoeForCausalLM"), ("qwen3_dflash", "DFlashQwen3ForCausalLM"),
                  ("qwen3_dflash2", "DFlash2Qwen3ForCausalLM"), ("qwen3_dspark", "Qwen3DSparkForCausalLM"),
                  ("lilicorr", "LiLiCorrForCausalLM"), ("gpt_oss", "GptOssForCausalLM"),
                  ("glm4_moe", "Glm4MoeForCausalLM"), ("extract_hidden_states", "ExtractHiddenStatesModel"))
# vLLM's own inspection and cache (registry.py's inspect_model_cls), its subprocess run in this one process: the
# subprocess only keeps CUDA uninitialised, and these run on a CPU
WARM = r"""
import sys
from vllm.model_executor.models import registry
registry._run_in_subprocess = lambda fn: fn()
wanted = {tuple(c.split(":")) for c in sys.argv[1:]}
found = {(m.module_name.rsplit(".", 1)[-1], m.class_name): m for m in registry.ModelRegistry.models.values()
         if isinstance(m, registry._LazyRegisteredModel)}
assert wanted <= found.keys(), f"not in vLLM's registry: {sorted(wanted - found.keys())}"
for c in sorted(wanted):
    found[c].inspect_model_cls()
"""


def model_info_cache() -> Path:
    """vLLM's model-info cache (envs.py's VLLM_CACHE_ROOT, then XDG_CACHE_HOME, then ~/.cache; registry.py's
    ``modelinfos``)."""
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vllm"
    return Path(os.environ.get("VLLM_CACHE_ROOT") or default).expanduser() / "modelinfos"


def uncached_classes() -> list[tuple[str, str]]:
    """The ``SERVED_CLASSES`` without a file in vLLM's model-info cache (registry.py's name for it)."""
    return [(m, c) for m, c in SERVED_CLASSES
            if not (model_info_cache() / f"vllm-model_executor-models-{m}-{c}.json").is_file()]


def warm_model_info() -> subprocess.Popen | None:
    """Start filling vLLM's model-info cache with the uncached ``SERVED_CLASSES`` (None when none is missing)."""
    from eagle3nb.serve.vllm import vllm_python

    missing = uncached_classes()
    return subprocess.Popen([str(vllm_python()), "-c", WARM, *(f"{m}:{c}" for m, c in missing)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) if missing else None


class Engines:
    """The registry: ``submit`` starts (or joins) a server in the background, ``release`` gives it back."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.lock = threading.Lock()
        self.futures: dict[str, Future] = {}
        self.storage: dict[str, Path] = {}
        self.users: Counter = Counter()
        self.idle: list[str] = []  # released, still up, oldest first
        self.pool = ThreadPoolExecutor(8, thread_name_prefix="vllm-start")

    @staticmethod
    def key(model: Path, mode: str, kw: dict) -> str:
        return json.dumps({"model": str(model), "mode": mode, **{k: str(v) if isinstance(v, Path) else v
                                                                 for k, v in kw.items()}}, sort_keys=True)

    def submit(self, model: Path, mode: str = "plain", **kw) -> str:
        """Start ``start_vllm(model, mode, **kw)`` in the background unless that server is up or starting; one
        more user of it. An extraction server's ``storage_dir`` is the registry's (``storage``): its users share
        it, so none passes its own."""
        if "storage_dir" in kw:
            raise ValueError("the registry owns extraction servers' storage_dir: read it from Engines.storage")
        key = self.key(model, mode, kw)
        with self.lock:
            if key not in self.futures:
                if mode == "extract":
                    self.storage[key] = self.tmp / f"hidden-{len(self.futures)}"
                    kw = {**kw, "storage_dir": self.storage[key]}
                self.futures[key] = self.pool.submit(start_vllm, model, mode, **kw)
            self.users[key] += 1
            if key in self.idle:
                self.idle.remove(key)
        return key

    def handle(self, key: str) -> ServerHandle:
        """The server once up; its start's RuntimeError (vLLM's own words) if it failed, and the next submit of
        the same server tries again."""
        try:
            return self.futures[key].result()
        except RuntimeError:
            with self.lock:
                self.futures.pop(key, None)
                self.users[key] = 0
            raise

    def release(self, key: str) -> None:
        """One user fewer; at none, stop it (a draft's server) or keep it among the ``IDLE`` most recent."""
        with self.lock:
            if key not in self.futures:
                return
            self.users[key] -= 1
            if self.users[key] > 0:
                return
            if '"draft_dir"' not in key:
                self.idle.append(key)
            done = [key] if '"draft_dir"' in key else self.idle[:-IDLE]
            self.idle = self.idle[-IDLE:]
            futures = [self.futures.pop(k) for k in done]
        for f in futures:
            if f.exception() is None:
                f.result().stop()

    def close(self) -> None:
        """Stop every server (the session's end)."""
        with self.lock:
            futures, self.futures, self.idle = list(self.futures.values()), {}, []
        for f in futures:
            if f.exception() is None:
                f.result().stop()
        self.pool.shutdown()


class Servers:
    """One module's named servers on one model, drawn from the session's registry: ``start`` many at once to
    overlap their start-up, ``servers[name]`` for a handle, ``stop`` gives them back."""

    def __init__(self, engines: Engines, model: Path):
        self.engines, self.model, self.handles, self.keys, self.specs = engines, model, {}, {}, {}

    def submit(self, **specs: dict) -> None:
        """Start the ``name=spec`` servers not yet submitted (spec: ``start_vllm``'s mode and options) in the
        background and return at once: ``servers[name]`` waits for one, so their start-up overlaps the caller's
        work."""
        for name, spec in specs.items():
            if name not in self.keys:
                self.keys[name] = self.engines.submit(self.model, **spec)
                self.specs[name] = spec

    def start(self, **specs: dict) -> None:
        """``submit`` the ``name=spec`` servers side by side and wait for them; raises RuntimeError naming each that
        failed, keeping those that started (a failed one is submitted again by the next ``start``)."""
        self.submit(**specs)
        errors = []
        for name in specs:
            try:
                self[name]
            except RuntimeError as e:
                errors.append(f"{name}: {e}")
        if errors:
            raise RuntimeError("\n".join(errors))

    def __getitem__(self, name: str) -> ServerHandle:
        """Server ``name``, once up."""
        if name not in self.handles:
            try:
                self.handles[name] = self.engines.handle(self.keys[name])
            except RuntimeError:
                del self.keys[name]
                raise
        return self.handles[name]

    def storage(self, name: str) -> Path:
        """Where extraction server ``name`` writes its hidden-state files."""
        return self.engines.storage[self.keys[name]]

    def rounds(self, name: str) -> Path:
        """The profile of server ``name``'s rounds (started with ``rounds``: eagle3nb_vllm_fixes/rounds.py)."""
        return Path(self.specs[name]["rounds"])

    def stop(self) -> None:
        for key in self.keys.values():
            self.engines.release(key)
        self.handles, self.keys = {}, {}
