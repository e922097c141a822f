"""GPU check: run every CUDA path of eagle3nb on the GPU against a CPU float32 reference, in under 10 minutes.

A GPU is at hand only now and then, for minutes, so this is prepared in advance: ``make gpu-check`` (or
``.venv/bin/python tools/gpu_check.py [--vllm]`` from the repository root) prints one line per path,

    PASS|FAIL|SKIP  <path>  <measured>  <what to do>

then a summary, and exits 1 on any FAIL. Without a CUDA device every path prints SKIP and it exits 0 at once.
Everything runs on the smoke toy (``toy:smoke``, built on CPU and cached in $EAGLE3NB_CACHE, default ./.cache);
the stages' own functions do the work. Library output and tracebacks go to ``outputs/gpu-check/gpu_check.log``.

The CUDA paths (where the code picks or follows a device), and what each check compares:

- ``cuda_device``: torch sees the GPU (nvidia-smi lists one but a CPU build of torch cannot use it: FAIL).
- ``ttt_attention``: ``cache.TTTCache.attend`` takes fused ``scaled_dot_product_attention`` with a block mask
  on CUDA (``dense=None`` -> ``q.is_cuda``): fused vs element-wise on cuda vs the CPU fp32 element-wise
  reference, fp32 (rel. error <= 1e-5) and bf16 (<= 2e-2: bf16 keeps 8 bits, one rounding is 3.9e-3).
- ``hidden_transformers``: 02 ``hidden.stage.run`` (``hf.load_target`` with ``device_map="auto"``, dtype
  ``auto`` = bf16 on CUDA, ``TargetHead`` on cuda for top-k storage) vs the same run on CPU in fp32: fp32 on
  cuda <= 1e-4, bf16 <= 3e-2 (relative norm of the aux and final states), target argmax agreeing >= 95% (bf16)
  / 99% (fp32, top-k storage).
- ``autocast_bf16``: ``train.distributed.autocast_for("auto")`` turns bf16 autocast on: 03 ``stage.run`` on cuda under
  autocast vs on CPU in fp32, same seed and data: initial held-out loss within 2e-2, final loss finite and
  within 10%.
- ``train_step``: 03 ``stage.run`` on cuda in fp32 (TTT objective with the fused attention, AdamW, clipping,
  ``DeviceTargets``, ``collate`` to cuda) vs on CPU: initial held-out loss within 1e-4, final within 1e-2.
- ``train_recipes``: 03 ``stage.run`` on cuda in fp32 vs on CPU for each of issue 24's recipes, one factor at a
  time on the EAGLE-3.0 baseline (``fc_norm: false, norm_output: false`` set explicitly): EAGLE-3.1 (``fc_norm``,
  ``norm_output``), ``num_layers: 2``, ``loss: lk_lambda`` and ``optimizer: muon``: initial held-out loss within
  1e-4, final within 1e-2 (Muon: 5e-2; ``torch.optim.Muon`` orthogonalises in bf16 on both devices, and the two
  devices round its matrix products differently).
- ``online_source``: 03 with ``data_source: online`` on cuda (``hidden.online.OnlineStates``: the target computes
  each micro-batch's states on the GPU, fp32) vs stored fp32 states trained on cuda: initial held-out loss within
  1e-4, final within 1e-3.
- ``export``: 03's export of a draft trained on cuda; ``drafts.load_draft(device="cuda")`` equals the last
  checkpoint's weights exactly, and the SGLang copy is written.
- ``offline_acceptance``: 04 ``accept.offline.offline_acceptance`` with the draft and the target head on cuda vs CPU:
  greedy alpha_i within 0.02 (argmax ties), expected sampled alpha_i (temperature 1) within 1e-3.
- ``draft_sanity``: the doctor's ``draft_sanity`` (loads the draft on cuda) equals CPU offline acceptance on
  the same held-out samples (alpha_i within 0.02).
- ``spec_decoding``: 04's local ``spec.compare_with_plain`` / ``measure_costs`` with target and draft on cuda
  (``accept.models.load_models``, ``hf.load_target``): greedy output identical to the target's, acceptance length
  within 5% of CPU's; sampling (temperature 0.8) runs; costs finite.
- ``embedded_server``: ``hf.load_target(use=DECODER)`` moves the embedded server's target to cuda: 01
  ``synth.run`` against it, greedy, gives the CPU target's greedy token ids (>= 90% of samples identical) and
  server ids == template ids.
- ``embedded_spec_server``: ``serve.spec_batcher`` (draft on the target's device and dtype): 04's
  ``bench_endpoint`` greedy and at temperature 0.8 without errors, acceptance length within 15% of CPU local.
- ``block_drafter``: seeded DFlash and DFlash2 drafts (``drafts.dflash``) on cuda vs the same weights on CPU fp32: one
  micro-batch's block loss within 1e-4 (relative), and greedy block decoding on cuda equal to the target's greedy
  output. (Its offline simulation, ``dflash/offline.py``, moves tensors the same way as the loss.)
- ``vllm_install``: vLLM's GPU build in ``.venv-vllm-gpu/`` (installed with ``--vllm``; bounded by the budget).
- ``vllm_hidden_states``: ``serve.vllm.start_vllm(mode="extract", cpu=False)`` (vLLM's own
  ``ExampleHiddenStatesConnector``) read by 02's vllm backend vs the CPU fp32 transformers states (<= 1e-3).
- ``vllm_eagle3``: ``start_vllm(mode="eagle3", cpu=False)`` serving the draft trained on cuda: vLLM's
  spec-decode counters count accepted tokens, acceptance length within 15% of CPU local decoding.
- ``vllm_block_verification``: ``start_vllm(mode="eagle3", cpu=False)`` serving the draft trained on cuda with
  block verification (``speculative``: ``rejection_sample_method: block``, ``draft_sample_method: probabilistic``;
  vLLM's V2 model runner only, pinned by ``serve.vllm.V2_SPECULATIVE``), sampled at T=1 on ``VERIFY_PROMPTS``
  held-out prompts: vLLM's acceptance length within 10% of our block verification's
  (``accept.verification.compare_verification``, CPU fp32, same draft and prompts; 64 prompts keep the two
  samplers' spread near 3%, as tests/test_vllm.py's T=1 check).
- ``vllm_recipes``: ``start_vllm(mode="eagle3", cpu=False)`` serving one draft in both recipe layouts vLLM builds
  differently (a 2-layer EAGLE-3.1 draft: ``fc_norm`` + ``norm_output`` and ``num_hidden_layers: 2``, one server
  start instead of two), trained on cuda: acceptance length within 15% of CPU local decoding of that draft.
- ``vllm_block_drafters``: each registered block drafter, DFlash, DSpark and DFlash2 (``BLOCK_DRAFTERS``: block 4,
  2 layers; 03 on cuda under autocast for the served draft's steps, on 02's reference data with the whole
  vocabulary) served by ``start_vllm(mode=<the method vLLM serves it as>, cpu=False)`` (DSpark and DFlash2 in vLLM's
  V2 model runner, the only one with DSpark's speculator and DFlash2's candidate walk: the CPU build has neither),
  greedy on the held-out prompts' ids (``MAX_TOKENS`` each, ``ignore_eos``), one line per method: >= 90% of the
  completions equal our CPU decoding of the same draft (``SpecDecoder``, itself checked equal to the CPU target's
  greedy output; 90% as ``embedded_server``: GPU kernels may break near-ties otherwise), vLLM's spec-decode counters
  give an acceptance length within 15% of that local decoding's.
- ``vllm_adaptive_verification``: the DSpark draft of ``vllm_block_drafters`` served with vLLM's adaptive verification
  (``speculative``: ``enable_adaptive_verification: true``; V2 runner, CUDA graphs), greedy at concurrency 4 on the
  held-out prompts, against 04's simulation of the rule (``accept.adaptive.simulate``, c=4) on the draft's blocks of
  03's held-out split of the reference data, priced at each width cost of ``WIDTH_COSTS`` (vLLM prices its own
  profiled step times, which the check cannot read): vLLM's acceptance length within 15% of the simulated range;
  its counters' drafted tokens per round equal to k (within 1%): vLLM's scheduler counts the scheduled drafts, not
  the trimmed budget (``v1/core/sched/scheduler.py``), so /metrics cannot give the verified count, and the line
  names the width cost whose simulated tau is nearest and the verify budget the rule gives there.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TextIO

from eagle3nb.drafts import block_methods, rules, served_as

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "outputs" / "gpu-check"
VLLM_GPU_VENV = ROOT / ".venv-vllm-gpu"
BUDGET_S = 600.0  # the 10 minutes a GPU is lent for
N_SAMPLES, MAX_NEW = 32, 96  # 01: the target's greedy answers to the first toy:train prompts
N_PROMPTS, MAX_TOKENS, K = 16, 64, 3  # speculative decoding: toy:heldout prompts, tokens each, drafted tokens
VERIFY_PROMPTS = 64  # vllm_block_verification: sampled T=1 prompts (16 spread our decoder's tau by +-7%)
SHORT_STEPS, LONG_STEPS = 20, 200  # 03: the device comparison runs; the draft that is served (tau ~4 at 200)
# Issue 24's recipes, each one factor on the EAGLE-3.0 baseline (whatever 03's defaults are), and the tolerance
# of its final loss on cuda vs CPU.
BASELINE = {"fc_norm": False, "norm_output": False}
RECIPES: dict[str, tuple[dict[str, Any], float]] = {
    "eagle3.1": ({"fc_norm": True, "norm_output": True}, 1e-2),
    "num_layers=2": ({**BASELINE, "num_layers": 2}, 1e-2),
    "loss=lk_lambda": ({**BASELINE, "loss": "lk_lambda"}, 1e-2),
    "muon": ({**BASELINE, "optimizer": "muon"}, 5e-2),
}
SERVED_RECIPE = {"fc_norm": True, "norm_output": True, "num_layers": 2}  # both layouts vLLM builds differently
# Every registered block drafter, as vLLM serves it (docs/block-drafters.md): block 4, 2 layers, k = the block's
# drafts (DFlash: the block less its anchor; DSpark: the block).
BLOCK_DRAFTERS: dict[str, dict[str, Any]] = {
    m: {"method": m, "block_size": 4, "num_layers": 2, "num_speculative_tokens": rules(m).drafts_per_block(4)}
    for m in block_methods()}
WIDTH_COSTS = (0.0, 0.02, 0.1, 0.5, 2.0)  # vllm_adaptive_verification: b of t(n) = 1 + b*n, plain steps per token
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
GPU = "cuda"  # the device under test; CPU float32 is the reference


class Mismatch(Exception):
    """A path ran but its result is outside the tolerance: ``measured`` and what to do."""

    def __init__(self, measured: str, fix: str):
        super().__init__(measured)
        self.measured, self.fix = measured, fix


class Skipped(Exception):
    """A path that cannot run here, with the reason and what to do."""

    def __init__(self, reason: str, fix: str):
        super().__init__(reason)
        self.reason, self.fix = reason, fix


def once(fn: Callable) -> Callable:
    """Compute a shared artifact on first use; keep a failure too, so dependent checks do not redo it."""

    @functools.wraps(fn)
    def wrapper(self):
        memo = self.__dict__.setdefault("_once", {}).setdefault(fn.__name__, {})
        if "error" in memo:
            raise RuntimeError(f"{fn.__name__} failed earlier: {memo['error']}")
        if "value" not in memo:
            try:
                memo["value"] = fn(self)
            except Exception as e:
                memo["error"] = f"{type(e).__name__}: {_first_line(e)}"
                raise
        return memo["value"]

    return wrapper


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def last_error(e: BaseException) -> str:
    """`` ... `` and the last error line of ``e``'s text after its first (a server that did not start carries its
    log's tail there, whose last error is the refusal), or nothing."""
    found = [x.strip() for x in str(e).strip().splitlines()[1:] if re.search(r"\w+Error:|Value error", x)]
    return f" ... {found[-1][:200]}" if found else ""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (float64), the one error measure of the tensor comparisons."""
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fmt(x: float | None) -> str:
    return "none" if x is None else f"{x:.3f}"


def within(name: str, value: float, limit: float) -> str:
    mark = "<=" if value <= limit else "> "
    return f"{name} {value:.2e} {mark} {limit:.0e}"


def expect(ok: bool, measured: str, fix: str) -> str:
    if not ok:
        raise Mismatch(measured, fix)
    return measured


class World:
    """The toy world on the GPU and its CPU reference, each artifact made once on first use."""

    def __init__(self, work: Path, log: TextIO, deadline: float, install_vllm: bool, vllm_spec: str):
        self.work, self.log, self.deadline = work, log, deadline
        self.install_vllm, self.vllm_spec = install_vllm, vllm_spec

    def left(self) -> float:
        return self.deadline - time.monotonic()

    @functools.cached_property
    def toy(self) -> Path:
        from eagle3nb.toy import shipped

        return shipped("smoke")

    def extract_values(self, name: str, dtype: str, storage: str) -> dict[str, Any]:
        """02's parameters for one extraction of the reference samples into ``02-<name>``."""
        return {"synth_dir": str(self.work / "data" / "01"), "model_path": str(self.toy), "dtype": dtype,
                "storage": storage, "output_dir": str(self.work / f"02-{name}"), "run_name": "gpu-check"}

    @once
    def data(self) -> dict[str, Path]:
        """The CPU reference, made in a process that sees no GPU: 01 = the target's greedy answers, 02 in fp32
        (stored exactly, with top-k storage, and with the whole vocabulary as the draft's, which a block drafter
        needs). Paths: ``synth``, ``cpu-fp32``, ``cpu-topk``, ``cpu-full``."""
        code = (f"import json, sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                "from testkit.heldout import greedy_hidden_states\nfrom eagle3nb.hidden.stage import run\n"
                "from eagle3nb.params import from_dict\na = json.loads(sys.argv[1])\n"
                "greedy_hidden_states(a['toy'], 'toy:train', a['n'], a['max_new'], a['out'])\n"
                "run(from_dict('02_hidden_states', a['topk']))\nrun(from_dict('02_hidden_states', a['full']))")
        vocab = json.loads((self.toy / "config.json").read_text())["vocab_size"]
        args = {"toy": str(self.toy), "n": N_SAMPLES, "max_new": MAX_NEW, "out": str(self.work / "data"),
                "topk": self.extract_values("cpu-topk", "float32", "topk"),
                "full": {**self.extract_values("cpu-full", "float32", "fp32"), "draft_vocab_size": vocab}}
        self.log.flush()
        subprocess.run([sys.executable, "-c", code, json.dumps(args)], check=True, stdout=self.log,
                       stderr=subprocess.STDOUT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
                       timeout=max(60.0, self.left()))
        return {"synth": self.work / "data" / "01", "cpu-fp32": self.work / "data" / "02",
                "cpu-topk": self.work / "02-cpu-topk", "cpu-full": self.work / "02-cpu-full"}

    def train(self, name: str, device: str, autocast: str, steps: int, **recipe: Any) -> dict[str, Any]:
        """03 on the CPU reference data (so only the training device differs between runs); ``recipe``: more 03
        values."""
        from eagle3nb.params import from_dict
        from eagle3nb.train.stage import run

        return run(from_dict("03_train", {
            "data_dir": str(self.data()["cpu-fp32"]), "output_dir": str(self.work / f"03-{name}"), "device": device,
            "autocast": autocast, "max_steps": steps, "ttt_steps": 3, "lr": 5e-3, "max_length": 512,
            "batch_tokens": 2048, "eval_every": 0, "save_every": 1000, "holdout_fraction": 0.2, "resume": False,
            "run_name": "gpu-check", **recipe}))

    def train_online(self) -> dict[str, Any]:
        """03 with ``data_source: online``: the target computes the states on the GPU for each micro-batch (02's
        transformers backend, fp32), on the reference samples and with the reference's draft vocabulary."""
        import yaml

        from eagle3nb.params import from_dict
        from eagle3nb.train.stage import run

        data = self.work / "02-online"
        data.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.data()["cpu-fp32"] / "draft_vocab.safetensors", data)  # the reference's vocabulary
        values = {**self.extract_values("online", "float32", "fp32"), "draft_vocab_size": 256}
        hp = self.work / "02-online.yaml"
        hp.write_text(yaml.safe_dump(values))
        return run(from_dict("03_train", {
            "data_dir": str(data), "data_source": "online", "hidden_params": str(hp),
            "output_dir": str(self.work / "03-online"), "device": GPU, "autocast": "off", "max_steps": SHORT_STEPS,
            "ttt_steps": 3, "lr": 5e-3, "max_length": 512, "batch_tokens": 2048, "eval_every": 0,
            "save_every": 1000, "holdout_fraction": 0.2, "resume": False, "run_name": "gpu-check"}))

    @once
    def short_runs(self) -> dict[str, dict[str, Any]]:
        return {"cuda-bf16": self.train("cuda-bf16", GPU, "auto", SHORT_STEPS),
                "cuda-fp32": self.train("cuda-fp32", GPU, "off", SHORT_STEPS),
                "cpu": self.train("cpu", "cpu", "auto", SHORT_STEPS)}

    @once
    def recipe_runs(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Each recipe trained on cuda in fp32 and on CPU: ``{recipe: {"cuda": metrics, "cpu": metrics}}``."""
        return {name: {dev: self.train(f"{name}-{dev}", GPU if dev == "cuda" else "cpu", "off", SHORT_STEPS,
                                       **values) for dev in ("cuda", "cpu")}
                for name, (values, _) in RECIPES.items()}

    @once
    def served_recipe(self) -> Path:
        """The 2-layer EAGLE-3.1 draft vLLM serves, trained on cuda under autocast, exported."""
        return Path(self.train("served-recipe", GPU, "auto", LONG_STEPS, **SERVED_RECIPE)["draft_dir"])

    def block_draft(self, name: str) -> Path:
        """The block drafter ``name`` of :data:`BLOCK_DRAFTERS`, trained on cuda under autocast on the
        full-vocabulary reference data for the served EAGLE-3 draft's steps, exported (one at a time: a failure
        leaves the other trainable)."""
        full = str(self.data()["cpu-full"])
        return Path(self.train(f"served-{name}", GPU, "auto", LONG_STEPS, data_dir=full, **BLOCK_DRAFTERS[name])
                    ["draft_dir"])

    @once
    def served(self) -> dict[str, Any]:
        """The draft every later path uses: trained on cuda under autocast, exported."""
        return self.train("served", GPU, "auto", LONG_STEPS)

    @property
    def draft_dir(self) -> Path:
        return Path(self.served()["draft_dir"])

    @functools.cached_property
    def prompts(self) -> tuple[list[dict], list[list[int]], list[int]]:
        """The held-out prompt rows, their chat-template ids and the end-of-turn ids."""
        from eagle3nb.data.prompts import load_prompts
        from eagle3nb.data.stream import Template

        tpl = Template(self.toy, True)
        rows = load_prompts("toy:heldout", N_PROMPTS)
        return rows, [tpl.prompt_ids(r["messages"]) for r in rows], [tpl.end_id]

    def local_cpu(self) -> dict[str, Any]:
        """04's local greedy speculative decoding of the served draft on CPU: the reference for its served
        acceptance."""
        return self.local_cpu_of(self.draft_dir)

    def local_cpu_of(self, draft_dir: Path) -> dict[str, Any]:
        """04's local greedy speculative decoding of ``draft_dir`` on CPU (each draft decoded once)."""
        memo = self.__dict__.setdefault("_local", {})
        if draft_dir not in memo:
            memo[draft_dir] = self._local_cpu(draft_dir)
        return memo[draft_dir]

    @functools.cached_property
    def cpu_target(self) -> Any:
        """The target on CPU in float32: the local decoding reference."""
        import torch
        from transformers import AutoModelForCausalLM

        from eagle3nb.hf import from_pretrained

        return from_pretrained(AutoModelForCausalLM, self.toy, trust_remote_code=False, dtype=torch.float32).eval()

    def _local_cpu(self, draft_dir: Path) -> dict[str, Any]:
        from eagle3nb.accept.local import compare_with_plain
        from eagle3nb.drafts import load_draft

        _, ids, eos = self.prompts
        return compare_with_plain(self.cpu_target, load_draft(draft_dir), ids, K, MAX_TOKENS, 0.0, eos)

    def local_block(self, draft_dir: Path) -> dict[str, Any]:
        """Our batched decoder (``SpecDecoder``, through 04's ``compare_with_plain``) with the block drafter in
        ``draft_dir`` on the CPU target, greedy, k = the block's drafts, ``MAX_TOKENS`` a prompt past any end of turn
        (as the served requests, with ``ignore_eos``): ``outputs``, ``identical_to_target``, ``acceptance_length``,
        ``k``."""
        from eagle3nb.accept.local import compare_with_plain
        from eagle3nb.drafts import load_draft

        target = self.cpu_target
        draft = load_draft(draft_dir, embed_tokens=target.get_input_embeddings().weight.detach(),
                           lm_head=target.get_output_embeddings().weight.detach())
        return compare_with_plain(target, draft, self.prompts[1], draft.config.drafts_per_block, MAX_TOKENS, 0.0)

    def within_local(self, tau: float, share: float, what: str, draft_dir: Path | None = None) -> str:
        local = self.local_cpu_of(draft_dir or self.draft_dir)["acceptance_length"]
        return expect(tau > 1.0 and abs(tau - local) <= share * local,
                      f"acceptance length {tau:.3f} vs CPU local decoding {local:.3f} (within {share:.0%})",
                      f"{what} reads the draft differently from eagle3nb.decoder on CPU (layer ids, norms, vocab map, "
                      "dtype); compare the two on one prompt")


# ---------------------------------------------------------------------------------------------- the checks


def check_cuda_device(w: World) -> str:
    import torch

    p = torch.cuda.get_device_properties(0)
    return (f"{torch.cuda.device_count()} x {p.name} ({p.total_memory / 2**30:.0f} GiB), torch {torch.__version__} "
            f"CUDA {torch.version.cuda}, bf16 {'yes' if torch.cuda.is_bf16_supported() else 'NO'}")


def check_ttt_attention(w: World) -> str:
    import torch

    from eagle3nb.drafts.eagle3.cache import TTTCache

    g = torch.Generator().manual_seed(0)
    B, nh, T, d, steps = 2, 4, 384, 32, 4
    qkv = [[torch.randn(B, nh, T, d, generator=g) for _ in range(3)] for _ in range(steps)]

    def unroll(dense: bool | None, device: str, dtype) -> torch.Tensor:
        cache = TTTCache(dense=dense)
        return torch.stack([cache.attend(*(x.to(device, dtype) for x in step), None).float().cpu() for step in qkv])

    ref = unroll(False, "cpu", torch.float32)
    fused32, elem32 = unroll(True, GPU, torch.float32), unroll(False, GPU, torch.float32)
    fused16, elem16 = unroll(True, GPU, torch.bfloat16), unroll(False, GPU, torch.bfloat16)
    default = unroll(None, GPU, torch.bfloat16)
    errs = [("fused fp32", rel(fused32, ref), 1e-5), ("element-wise fp32", rel(elem32, ref), 1e-5),
            ("fused bf16", rel(fused16, ref), 2e-2), ("element-wise bf16", rel(elem16, ref), 2e-2)]
    measured = ", ".join(within(n, e, lim) for n, e, lim in errs) + f" (vs CPU fp32, {steps} TTT steps, T={T})"
    expect(all(e <= lim for _, e, lim in errs), measured,
           "fix TTTCache.attend in eagle3nb/drafts/eagle3/cache.py: its fused (dense) path must equal the "
           "element-wise one")
    return expect(torch.equal(default, fused16), measured + "; the cuda default is NOT the fused path",
                  "TTTCache(dense=None) must take the fused path on CUDA (long sequences do not fit otherwise)")


def check_hidden_transformers(w: World) -> str:
    import torch

    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.hidden.stage import run as extract
    from eagle3nb.params import from_dict

    d = w.data()
    ref, ref_topk = HiddenStates(d["cpu-fp32"]), HiddenStates(d["cpu-topk"])
    runs = {"cuda-bf16": ("auto", "fp32"), "cuda-fp32": ("float32", "fp32"), "cuda-topk": ("float32", "topk")}
    for name, (dtype, storage) in runs.items():
        extract(from_dict("02_hidden_states", w.extract_values(name, dtype, storage)))

    def states(data) -> dict[str, torch.Tensor]:
        items = [data[i] for i in range(len(data))]
        return {"aux": torch.cat([x["aux"] for x in items]), "final": torch.cat([x["final"] for x in items]),
                "argmax": torch.cat([data.target_argmax(x) for x in items])}

    r = states(ref)
    parts, ok = [], True
    for name, limit, agree in (("cuda-fp32", 1e-4, 0.99), ("cuda-bf16", 3e-2, 0.95)):
        s = states(HiddenStates(w.work / f"02-{name}"))
        err = max(rel(s["aux"], r["aux"]), rel(s["final"], r["final"]))
        same = float((s["argmax"] == r["argmax"]).double().mean())
        ok &= err <= limit and same >= agree
        parts.append(f"{name} {within('states', err, limit)}, argmax {same:.1%} (>= {agree:.0%})")
    topk = HiddenStates(w.work / "02-cuda-topk")
    same = float(torch.cat([(topk.target_argmax(topk[i]) == ref_topk.target_argmax(ref_topk[i])).double()
                            for i in range(len(topk))]).mean())
    gap = max(float((topk.target_probs(topk[i]) - ref_topk.target_probs(ref_topk[i])).abs().max())
              for i in range(len(topk)))
    ok &= same >= 0.99 and gap <= 2e-2
    parts.append(f"cuda-topk argmax {same:.1%} (>= 99%), {within('max prob gap', gap, 2e-2)}")
    return expect(ok, "; ".join(parts) + f" vs CPU fp32 over {len(ref)} samples",
                  "02 on GPU differs from CPU: check eagle3nb/hidden/capture.py (device_map, input device, dtype) "
                  "and data/head.py (TargetHead on cuda)")


def check_autocast_bf16(w: World) -> str:
    import torch

    from eagle3nb.train.distributed import autocast_for

    with autocast_for("auto", torch.device(GPU)):
        on = torch.is_autocast_enabled(GPU) and torch.get_autocast_dtype(GPU) == torch.bfloat16
    runs = w.short_runs()
    a, b = runs["cuda-bf16"], runs["cpu"]
    e0 = abs(a["initial_heldout"]["loss"] - b["initial_heldout"]["loss"]) / b["initial_heldout"]["loss"]
    e1 = abs(a["final_loss"] - b["final_loss"]) / b["final_loss"]
    measured = (f"autocast {'on (bf16)' if on else 'OFF'}; {within('initial held-out loss', e0, 2e-2)}, "
                f"final loss {a['final_loss']:.4f} vs CPU fp32 {b['final_loss']:.4f} ({within('rel', e1, 1e-1)}) "
                f"after {SHORT_STEPS} steps")
    return expect(on and math.isfinite(a["final_loss"]) and e0 <= 2e-2 and e1 <= 1e-1, measured,
                  "bf16 autocast training drifts from fp32: check autocast_for in eagle3nb/train/distributed.py "
                  "and the float() casts of the loss in eagle3nb/drafts/eagle3/objective.py")


def loss_gaps(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    """Relative gaps between two 03 runs' metrics: initial held-out loss, final training loss."""
    e0 = abs(a["initial_heldout"]["loss"] - b["initial_heldout"]["loss"]) / b["initial_heldout"]["loss"]
    return e0, abs(a["final_loss"] - b["final_loss"]) / b["final_loss"]


def check_train_step(w: World) -> str:
    runs = w.short_runs()
    a, b = runs["cuda-fp32"], runs["cpu"]
    e0, e1 = loss_gaps(a, b)
    measured = (f"fp32 on cuda vs CPU: {within('initial held-out loss', e0, 1e-4)}, "
                f"{within('final loss', e1, 1e-2)} after {SHORT_STEPS} steps ({a['tokens_per_s']:.0f} vs "
                f"{b['tokens_per_s']:.0f} tok/s)")
    return expect(e0 <= 1e-4 and e1 <= 1e-2, measured,
                  "03 on GPU differs from CPU: check the device moves in eagle3nb/train/data.py (collate, "
                  "DeviceTargets) and loop.py")


def check_train_recipes(w: World) -> str:
    gaps = {name: loss_gaps(runs["cuda"], runs["cpu"]) for name, runs in w.recipe_runs().items()}
    measured = f"fp32 on cuda vs CPU after {SHORT_STEPS} steps: " + "; ".join(
        f"{name} {within('initial', e0, 1e-4)}, {within('final', e1, RECIPES[name][1])}"
        for name, (e0, e1) in gaps.items())
    return expect(all(e0 <= 1e-4 and e1 <= RECIPES[name][1] for name, (e0, e1) in gaps.items()), measured,
                  "a recipe trains differently on GPU: see eagle3nb/drafts/eagle3/model.py (fc_norm, the deeper "
                  "layers), eagle3nb/drafts/eagle3/objective.py divergence and eagle3nb/train/optim.py")


def check_online_source(w: World) -> str:
    """03 online on the GPU (states computed per micro-batch) vs stored fp32 states, both trained on the GPU."""
    e0, e1 = loss_gaps(w.train_online(), w.short_runs()["cuda-fp32"])
    measured = (f"online vs stored (fp32, cuda): {within('initial held-out loss', e0, 1e-4)}, "
                f"{within('final loss', e1, 1e-3)} after {SHORT_STEPS} steps")
    return expect(e0 <= 1e-4 and e1 <= 1e-3, measured,
                  "03's online source on GPU differs from stored states: check the device moves in "
                  "eagle3nb/hidden/online.py (head, source) and eagle3nb/train/sources.py")


def check_export(w: World) -> str:
    import torch

    from eagle3nb.drafts import load_draft
    from eagle3nb.train.checkpoint import checkpoints

    res = w.served()
    last = checkpoints(w.work / "03-served" / "checkpoints")[-1]
    trained = torch.load(last, map_location="cpu", weights_only=False)["model"]
    loaded = load_draft(res["draft_dir"], device=GPU).state_dict()
    bad = [k for k, v in trained.items() if not torch.equal(loaded[k].cpu(), v.cpu())]
    sglang = (Path(res["sglang_draft_dir"]) / "config.json").exists()
    measured = (f"{len(trained)} tensors of {last.name} vs load_draft(device='cuda'): {len(bad)} differ; "
                f"SGLang copy {'written' if sglang else 'MISSING'}")
    return expect(not bad and sglang, measured + (f" ({bad[:3]})" if bad else ""),
                  "export in eagle3nb/train/export.py must write exactly the trained weights (draft.to('cpu') first)")


def check_offline_acceptance(w: World) -> str:
    from eagle3nb.accept.offline import offline_acceptance
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.drafts import load_draft

    data = HiddenStates(w.data()["cpu-fp32"])
    gpu, cpu = (offline_acceptance(load_draft(w.draft_dir, device=dev), data, K, K + 1, temperature=1.0)
                for dev in (GPU, "cpu"))
    g = max(abs(x - y) for x, y in zip(gpu["greedy"]["alpha_by_position"], cpu["greedy"]["alpha_by_position"]))
    s = max(abs(x - y) for x, y in zip(gpu["sampled"]["alpha_by_position"], cpu["sampled"]["alpha_by_position"]))
    measured = (f"{within('greedy alpha gap', g, 2e-2)}, {within('sampled alpha gap', s, 1e-3)}; greedy tau "
                f"{gpu['greedy']['acceptance_length']:.3f} (CPU {cpu['greedy']['acceptance_length']:.3f}) on "
                f"{gpu['samples']} samples")
    return expect(g <= 2e-2 and s <= 1e-3, measured,
                  "04 offline on GPU differs from CPU: check the .to(device) moves in "
                  "eagle3nb/drafts/eagle3/offline.py (chain_acceptance) and eagle3nb/accept/offline.py "
                  "(target_probs_for)")


def check_draft_sanity(w: World) -> str:
    import yaml

    from eagle3nb.accept.offline import offline_acceptance
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.data.split import split_holdout
    from eagle3nb.doctor import run_checks
    from eagle3nb.doctor.checks.draft import SANITY_K, SANITY_SAMPLES
    from eagle3nb.drafts import load_draft

    data_dir = w.data()["cpu-fp32"]
    run = w.work / "doctor-run"
    run.mkdir(exist_ok=True)
    (run / "03_train.yaml").write_text(yaml.safe_dump({"data_dir": str(data_dir), "holdout_fraction": 0.2,
                                                      "output_dir": str(w.work / "03-served")}))
    (run / "04_acceptance.yaml").write_text(yaml.safe_dump({"model_path": str(w.toy), "draft_dir": str(w.draft_dir),
                                                           "data_dir": str(data_dir)}))
    result = next(r for r in run_checks(run, "04") if r.name == "draft_sanity")
    if result.status not in ("pass", "warn"):
        raise Mismatch(f"draft_sanity {result.status}: {result.measured}", result.fix or "see the doctor's output")
    data = HiddenStates(data_dir)
    held = split_holdout([s["id"] for s in data.samples], 0.2)[1][:SANITY_SAMPLES]
    cpu = offline_acceptance(load_draft(w.draft_dir), data, SANITY_K, SANITY_K, indices=held)["per_position"]
    gap = max(abs(x - y) for x, y in zip(result.details["per_position"], cpu))
    return expect(gap <= 2e-2, f"doctor {result.status}, {within('alpha gap vs CPU', gap, 2e-2)}: {result.measured}",
                  "the doctor's draft_sanity on GPU differs from CPU offline acceptance: check "
                  "check_draft_sanity in eagle3nb/doctor/checks/draft.py")


def check_spec_decoding(w: World) -> str:
    from eagle3nb.accept.local import compare_with_plain, measure_costs
    from eagle3nb.accept.models import load_models
    from eagle3nb.params import from_dict

    target, draft, _ = load_models(from_dict("04_acceptance", {
        "model_path": str(w.toy), "draft_dir": str(w.draft_dir), "data_dir": str(w.data()["cpu-fp32"]),
        "output_dir": str(w.work / "04"), "run_name": "gpu-check"}))
    _, ids, eos = w.prompts
    greedy = compare_with_plain(target, draft, ids, K, MAX_TOKENS, 0.0, eos)
    expect(greedy["identical_to_target"], f"greedy speculative output differs from the target's on prompts "
           f"{greedy['mismatched_prompts']}", "SpecDecoder on CUDA is not lossless: check eagle3nb/decoder/batch.py")
    measured = "greedy lossless, " + w.within_local(greedy["acceptance_length"], 0.05, "eagle3nb.decoder on cuda")
    try:
        sampled = compare_with_plain(target, draft, ids[:4], K, MAX_TOKENS, 0.8, eos)
    except Exception as e:
        print(f"\n--- spec_decoding, temperature 0.8 ---\n{traceback.format_exc()}", file=w.log, flush=True)
        raise Mismatch(f"{measured}; but sampling (temperature 0.8) raised {type(e).__name__}: {_first_line(e)}",
                       "sampled speculative decoding fails on CUDA: fix eagle3nb/decoder/ and "
                       "eagle3nb/drafts/eagle3/drafting.py (traceback in gpu_check.log; e.g. a CPU "
                       "torch.Generator drawing from CUDA probabilities)") from e
    costs = measure_costs(target, draft, K)
    return expect(costs["cost_ratio"] > 0 and math.isfinite(costs["overhead"]),
                  f"{measured}; sampled tau {sampled['acceptance_length']:.3f}; "
                  f"c={costs['cost_ratio']:.3f}, overhead {costs['overhead']:.3f}",
                  "measure_costs in eagle3nb/accept/local.py gives no usable costs on CUDA")


def check_embedded_server(w: World) -> str:
    from eagle3nb.data.samples import load_samples
    from eagle3nb.launch import start_server
    from eagle3nb.params import from_dict
    from eagle3nb.synth.stage import run

    reference = {r["id"]: r["input_ids"] for r in load_samples(w.data()["synth"], statuses=None)}
    out = w.work / "01-served"
    with start_server(w.toy) as server:
        run(from_dict("01_synth", {"model_path": str(w.toy), "vllm_url": server.url, "prompts": "toy:train",
                                   "max_samples": N_SAMPLES, "max_completion_tokens": MAX_NEW, "temperature": 0.0,
                                   "output_dir": str(out), "run_name": "gpu-check"}))
    rows = load_samples(out, statuses=None)
    matched = sum(r["ids_match"] is True for r in rows)
    same = sum(r["input_ids"] == reference.get(r["id"]) for r in rows)
    measured = (f"{len(rows)} greedy samples from the server on cuda: {same} equal the CPU target's greedy ids "
                f"(>= 90%), server ids == template ids on {matched}")
    return expect(matched == len(rows) == N_SAMPLES and same >= 0.9 * len(rows), measured,
                  "the embedded server on GPU decodes differently: check BatchDecoder in eagle3nb/serve/batcher.py, "
                  "load_target in eagle3nb/hf.py")


def check_embedded_spec_server(w: World) -> str:
    from eagle3nb.accept.online import bench_endpoint
    from eagle3nb.launch import start_server

    rows, _, _ = w.prompts
    with start_server(w.toy, draft_dir=w.draft_dir, num_speculative_tokens=K) as server:
        greedy = bench_endpoint("embedded-eagle3", server.base_url, rows, [4], MAX_TOKENS, 0.0, warmup=0)[0]
        sampled = bench_endpoint("embedded-eagle3", server.base_url, rows[:4], [4], MAX_TOKENS, 0.8, warmup=0)[0]
    for r, how in ((greedy, "greedy"), (sampled, "temperature 0.8")):
        expect(r["errors"] == 0, f"{r['errors']} of {r['requests']} {how} requests failed: {r.get('first_error')}",
               "the speculative engine fails on GPU: see the server log named in gpu_check.log "
               "(eagle3nb/serve/spec_batcher.py, eagle3nb/decoder/)")
    return w.within_local(greedy["acceptance_length"] or 0.0, 0.15, "the embedded speculative server") + \
        f"; sampled acceptance length {fmt(sampled['acceptance_length'])}"


def check_block_drafter(w: World) -> str:
    """The block drafters on cuda vs CPU fp32 with the same weights (seeded, untrained DFlash and DFlash2 drafts, the
    latter's convolutions and selector drawn away from their identity start: the numbers compared do not need them
    trained): one micro-batch's block loss each, and greedy block decoding on cuda, which must be the target's own
    greedy output."""
    import copy
    import tempfile

    import torch

    from eagle3nb.decoder.reference import plain_generate
    from eagle3nb.drafts.dflash.drafting import generate
    from eagle3nb.drafts.dflash.layouts import load_draft, save_draft
    from eagle3nb.drafts.dflash.model import DFlashDraft, from_target
    from eagle3nb.drafts.dflash.objective import block_loss
    from eagle3nb.hf import DECODER, load_target

    _, ids, eos = w.prompts
    targets = {GPU: load_target(w.toy, trust_remote_code=False, use=DECODER).to(GPU)}
    targets["cpu"] = copy.deepcopy(targets[GPU]).to("cpu")
    answer = plain_generate(targets["cpu"], ids[0], MAX_TOKENS, 0.0, eos)
    seq, mask = ids[0] + answer, [0] * len(ids[0]) + [1] * len(answer)
    lines = []
    for heads in ({}, {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16, "selector_top_k": 8}):
        torch.manual_seed(0)
        cpu = DFlashDraft(from_target(json.loads((w.toy / "config.json").read_text()), num_layers=2, block_size=4,
                                      **heads))
        cpu.set_target(targets["cpu"].model.embed_tokens.weight, targets["cpu"].lm_head.weight)
        with torch.no_grad():
            for name, p in cpu.named_parameters():
                if "conv" in name or "selector" in name:
                    p.normal_(0.0, 0.1)
        with tempfile.TemporaryDirectory() as tmp:  # the GPU's copy through the export and its loader's device move
            drafts = {"cpu": cpu, GPU: load_draft(save_draft(cpu, tmp), targets[GPU].model.embed_tokens.weight,
                                                  device=GPU, lm_head=targets[GPU].lm_head.weight)}
        loss = {}
        with torch.no_grad():
            for dev, m in drafts.items():
                out = targets[dev](input_ids=torch.tensor([seq], device=dev), output_hidden_states=True)
                aux = torch.cat([out.hidden_states[i][0] for i in m.config.aux_layer_ids], -1)[None]
                loss[dev] = float(block_loss(m, aux, torch.tensor([seq], device=dev), torch.tensor([mask], device=dev),
                                             out.logits.softmax(-1), out.logits.argmax(-1), anchors_per_seq=16,
                                             generator=torch.Generator().manual_seed(0))["loss"])
        gap = abs(loss[GPU] - loss["cpu"]) / max(abs(loss["cpu"]), 1e-9)
        expect(gap <= 1e-4, f"{cpu.method}: {within('block loss relative gap', gap, 1e-4)}",
               f"{cpu.method}'s loss on GPU differs from CPU: check the .to(device) moves in "
               "eagle3nb/drafts/dflash/objective.py and dflash2.py")
        decoded = generate(targets[GPU], drafts[GPU], ids[0], MAX_TOKENS, eos).tokens
        expect(decoded == answer, f"{cpu.method}: greedy block decoding on cuda differs from the CPU target's",
               "block decoding on GPU is not lossless: check eagle3nb/drafts/dflash/drafting.py and model.py")
        lines.append(f"{cpu.method}: {within('block loss relative gap', gap, 1e-4)}; greedy block decoding on cuda is "
                     "the target's")
    return "; ".join(lines)


def check_vllm_install(w: World) -> str:
    py = VLLM_GPU_VENV / "bin" / "python"
    probe = [str(py), "-c", "import vllm; print(vllm.__version__)"]
    if py.exists():
        found = subprocess.run(probe, capture_output=True, text=True, timeout=120)
        if found.returncode == 0:
            return f"vLLM {found.stdout.strip().splitlines()[-1]} already in {VLLM_GPU_VENV.name}/"
    if not w.install_vllm:
        raise Skipped(f"vLLM's GPU build is not installed in {VLLM_GPU_VENV.name}/",
                      "rerun with --vllm (make gpu-check does) to install it (a few minutes)")
    if w.left() < 240:
        raise Mismatch(f"only {w.left():.0f} s left of the {BUDGET_S:.0f} s budget, too little to install vLLM",
                       "rerun `make gpu-check`: earlier paths are quicker the second time (toy cached)")
    t0 = time.monotonic()
    steps = [[sys.executable, "-m", "venv", str(VLLM_GPU_VENV)],
             [str(py), "-m", "pip", "install", "-q", w.vllm_spec], probe]
    for cmd in steps:
        w.log.flush()
        done = subprocess.run(cmd, stdout=w.log, stderr=subprocess.STDOUT, timeout=w.left() - 150)
        if done.returncode:
            raise Mismatch(f"`{' '.join(cmd[-3:])}` exited with {done.returncode} (output in gpu_check.log)",
                           f"install vLLM's GPU build by hand: {py} -m pip install '{w.vllm_spec}'")
    version = subprocess.run(probe, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    return f"installed {w.vllm_spec} (vLLM {version}) into {VLLM_GPU_VENV.name}/ in {time.monotonic() - t0:.0f} s"


def start_gpu_vllm(w: World, mode: str, **kw):
    """The project's launcher with the GPU flags (cpu=False: vLLM's own connector, compiled) and venv."""
    from eagle3nb.serve.vllm import VLLM_VENV_ENV, start_vllm

    if w.left() < 60:
        raise Mismatch(f"only {w.left():.0f} s left of the {BUDGET_S:.0f} s budget, too little to start vLLM",
                       "rerun `make gpu-check` (vLLM stays installed, so this part gets more time)")
    os.environ[VLLM_VENV_ENV] = str(VLLM_GPU_VENV)
    return start_vllm(w.toy, mode, cpu=False, timeout=w.left() - 30, **kw)


def check_vllm_hidden_states(w: World) -> str:
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.hidden.stage import run as extract
    from eagle3nb.layers import default_aux_layer_ids
    from eagle3nb.params import from_dict

    d = w.data()
    L = json.loads((w.toy / "config.json").read_text())["num_hidden_layers"]
    layer_ids = [*default_aux_layer_ids(L), L]
    with start_gpu_vllm(w, "extract", layer_ids=layer_ids, storage_dir=w.work / "vllm-hidden") as h:
        extract(from_dict("02_hidden_states", {"synth_dir": str(d["synth"]), "model_path": str(w.toy),
                                               "backend": "vllm", "vllm_url": h.url, "storage": "fp32",
                                               "output_dir": str(w.work / "02-vllm"), "run_name": "gpu-check"}))
    got = HiddenStates(w.work / "02-vllm")
    cpu = HiddenStates(d["cpu-fp32"])
    ref = {cpu[i]["id"]: cpu[i] for i in range(len(cpu))}
    a = [got[i] for i in range(len(got))]
    err = max(max(rel(x["aux"], ref[x["id"]]["aux"]), rel(x["final"], ref[x["id"]]["final"])) for x in a)
    return expect(len(a) == len(ref) and err <= 1e-3,
                  f"{len(a)} samples through ExampleHiddenStatesConnector, {within('worst state error', err, 1e-3)} "
                  "vs CPU fp32 transformers",
                  "vLLM's states differ from transformers': check the layer ids (aux ids + L) and the file layout "
                  "eagle3nb/data/reader.py expects")


def check_vllm_eagle3(w: World) -> str:
    from eagle3nb.accept.online import bench_endpoint

    rows, _, _ = w.prompts
    with start_gpu_vllm(w, "eagle3", draft_dir=w.draft_dir, num_speculative_tokens=K) as h:
        row = bench_endpoint("vllm-eagle3", h.base_url, rows, [4], MAX_TOKENS, 0.0, warmup=0)[0]
    expect(row["errors"] == 0 and row["metrics_engine"] == "vllm" and (row["acceptance_length"] or 0) > 1.0,
           f"errors {row['errors']}, counters from {row['metrics_engine']}, acceptance length "
           f"{fmt(row['acceptance_length'])}", "vLLM accepted no drafted token: check the draft's config.json "
           "(eagle_aux_hidden_state_layer_ids, draft_vocab_size) against `eagle3nb doctor`")
    return w.within_local(row["acceptance_length"], 0.15, "vLLM") + f", {row['output_tokens_per_s']:.0f} tok/s"


def check_vllm_block_verification(w: World) -> str:
    """vLLM's block verification (its V2 runner) against ours, at T=1 on the same draft and prompts."""
    from eagle3nb.accept.online import bench_endpoint
    from eagle3nb.accept.verification import compare_verification
    from eagle3nb.data.prompts import load_prompts
    from eagle3nb.data.stream import Template
    from eagle3nb.drafts import load_draft

    rows, tpl = load_prompts("toy:heldout", VERIFY_PROMPTS), Template(w.toy, True)
    local = compare_verification(w.cpu_target, load_draft(w.draft_dir), [tpl.prompt_ids(r["messages"]) for r in rows],
                                 K, MAX_TOKENS, [1.0], [tpl.end_id], seeds=1)["1"]
    ours, standard = local["block"][0], local["standard"][0]
    spec = {"draft_sample_method": "probabilistic", "rejection_sample_method": "block"}
    with start_gpu_vllm(w, "eagle3", draft_dir=w.draft_dir, num_speculative_tokens=K, speculative=spec) as h:
        row = bench_endpoint("vllm-block", h.base_url, rows, [4], MAX_TOKENS, 1.0, warmup=0, k=K)[0]
    tau = row["acceptance_length"] or 0.0
    return expect(row["errors"] == 0 and row["metrics_engine"] == "vllm" and abs(tau - ours) <= 0.1 * ours,
                  f"T=1, {len(rows)} prompts: vLLM block verification acceptance length {tau:.3f} vs ours "
                  f"{ours:.3f} (within 10%; our token-wise {standard:.3f}), errors {row['errors']}, "
                  f"{row['output_tokens_per_s']:.0f} tok/s",
                  "vLLM's block verification accepts differently from eagle3nb/verification/block.py: compare the two "
                  "rules on one round's probabilities (vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py)")


def check_vllm_recipes(w: World) -> str:
    from eagle3nb.accept.online import bench_endpoint

    rows, _, _ = w.prompts
    draft = w.served_recipe()
    with start_gpu_vllm(w, "eagle3", draft_dir=draft, num_speculative_tokens=K) as h:
        row = bench_endpoint("vllm-recipe", h.base_url, rows, [4], MAX_TOKENS, 0.0, warmup=0)[0]
    expect(row["errors"] == 0 and row["metrics_engine"] == "vllm" and (row["acceptance_length"] or 0) > 1.0,
           f"errors {row['errors']}, counters from {row['metrics_engine']}, acceptance length "
           f"{fmt(row['acceptance_length'])}", "vLLM accepted no drafted token of the 2-layer EAGLE-3.1 draft: "
           "check its config.json (num_hidden_layers, fc_norm, norm_output) and tensor names (layers.1.*, "
           "fc_norm.*) against vLLM's llama_eagle3.py")
    return w.within_local(row["acceptance_length"], 0.15, "vLLM (2-layer EAGLE-3.1 draft)", draft) + \
        f", {row['output_tokens_per_s']:.0f} tok/s"


def serve_greedy(w: World, mode: str, draft_dir: Path, k: int) -> tuple[list[list[int]], dict[str, Any], float]:
    """The held-out prompts' ids through vLLM on the GPU serving ``draft_dir`` (``mode``, ``k`` drafts a round),
    greedy, ``MAX_TOKENS`` each with ``ignore_eos``: (the completions' token ids, vLLM's spec-decode counters over
    them, output tokens/s)."""
    import httpx

    from eagle3nb.accept.online import first_model, metrics_url, scrape
    from eagle3nb.formulas import spec_counters, spec_delta

    with start_gpu_vllm(w, mode, draft_dir=draft_dir, num_speculative_tokens=k) as h:
        model, murl = first_model(h.base_url, "EMPTY"), metrics_url(h.base_url)
        before, t0 = spec_counters(scrape(murl)), time.monotonic()
        served = [httpx.post(h.base_url + "/completions", timeout=300, json={
            "model": model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}).raise_for_status().json()["choices"][0]["token_ids"] for ids in w.prompts[1]]
        seconds = time.monotonic() - t0
        return served, spec_delta(before, spec_counters(scrape(murl))), sum(map(len, served)) / seconds


def block_drafter_served(w: World, name: str) -> str:
    """One block drafter of :data:`BLOCK_DRAFTERS` served by vLLM on the GPU against our local decoding of it on CPU:
    its line, or Mismatch."""
    draft = w.block_draft(name)
    local = w.local_block(draft)
    expect(local["identical_to_target"], f"{name}: our CPU block decoding differs from the target's greedy output "
           f"on prompts {local['mismatched_prompts']}", "our block decoding is not lossless: see "
           "eagle3nb/drafts/dflash/drafting.py (BlockDrafting) and eagle3nb/decoder/batch.py")
    served, acc, tps = serve_greedy(w, served_as(name), draft, local["k"])  # DFlash2 is vLLM's dflash
    same = sum(a == b for a, b in zip(served, local["outputs"]))
    tau, ref = acc.get("acceptance_length") or 0.0, local["acceptance_length"]
    measured = (f"{name} (k={local['k']}): {same}/{len(served)} greedy completions the target's (>= 90%), acceptance "
                f"length {tau:.3f} vs CPU local {ref:.3f} (within 15%; {acc.get('accepted', 0):.0f} of "
                f"{acc.get('draft_tokens', 0):.0f} drafted), {tps:.0f} tok/s")
    expect(same >= 0.9 * len(served), measured,
           f"vLLM's {name} drafting is not lossless against the target: check the draft's config.json "
           "(dflash_config, target_layer_ids, mask_token_id, sample_from_anchor) from "
           "eagle3nb/drafts/dflash/layouts.py draft_config_json")
    return expect(acc.get("engine") == "vllm" and tau > 1.0 and abs(tau - ref) <= 0.15 * ref, measured,
                  f"vLLM reads the {name} draft differently from eagle3nb/drafts/dflash/drafting.py: compare the "
                  "tensor names and layer ids eagle3nb/drafts/dflash/layouts.py writes with vLLM's "
                  "qwen3_dflash.py / qwen3_dspark.py")


def check_vllm_block_drafters(w: World) -> str:
    """Each block drafter (DFlash, then DSpark, which only a GPU serves) served by vLLM on the GPU: one line each,
    every method tried even when an earlier one fails."""
    lines, fixes = [], []
    for name in BLOCK_DRAFTERS:
        try:
            lines.append(block_drafter_served(w, name))
        except Mismatch as e:
            lines.append(f"FAILED {e.measured}")
            fixes.append(e.fix)
        except Exception as e:  # vLLM refused or crashed: the next method still runs
            print(f"\n--- vllm_block_drafters {name} ---\n{traceback.format_exc()}", file=w.log, flush=True)
            lines.append(f"FAILED {name}: {type(e).__name__}: {_first_line(e)}{last_error(e)}")
            fixes.append(f"{name}: see the vLLM server log named in gpu_check.log (DSpark: vLLM's V2 model runner, "
                         "eagle3nb/serve/vllm.py MODE_ENV; training: eagle3nb/drafts/dflash/objective.py)")
    return expect(not fixes, "\n".join(lines), "; ".join(fixes))


def check_vllm_adaptive_verification(w: World) -> str:
    """vLLM's adaptive verification on the DSpark draft against 04's simulation of its budget rule, greedy, c=4."""
    from eagle3nb.accept.adaptive import simulate
    from eagle3nb.accept.online import bench_endpoint
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.data.split import split_holdout
    from eagle3nb.drafts import get, load_draft
    from eagle3nb.params import schema_for

    draft_dir, k = w.block_draft("dspark"), BLOCK_DRAFTERS["dspark"]["num_speculative_tokens"]
    data = HiddenStates(w.data()["cpu-full"])
    draft = load_draft(draft_dir, embed_tokens=data.embed_tokens(), lm_head=data.lm_head())
    _, held = split_holdout([s["id"] for s in data.meta["samples"]],
                           schema_for("03_train").model_fields["holdout_fraction"].default)
    blocks = [b for i in held if len((b := get("dspark").confidences(draft, data[i], data.target_argmax(data[i])))
                                     ["anchors"])]
    sims = {b: simulate(blocks, 4, (1.0, b), 0.0) for b in WIDTH_COSTS}
    lo, hi = min(s["tau"] for s in sims.values()), max(s["tau"] for s in sims.values())
    with start_gpu_vllm(w, "dspark", draft_dir=draft_dir, num_speculative_tokens=k,
                        speculative={"enable_adaptive_verification": True}) as h:
        row = bench_endpoint("vllm-adaptive", h.base_url, w.prompts[0], [4], MAX_TOKENS, 0.0, warmup=0, k=k)[0]
    tau, rate = row["acceptance_length"] or 0.0, row["acceptance_rate"] or 0.0
    drafted = (tau - 1) / rate if rate else 0.0
    near = min(sims, key=lambda b: abs(sims[b]["tau"] - tau))
    measured = (f"c=4, k={k}: vLLM acceptance length {tau:.3f} vs simulated {lo:.3f}..{hi:.3f} (within 15%; nearest "
                f"at width cost {near}: budget {sims[near]['verify_budget']:.2f} of {k}), {drafted:.2f} drafted per "
                f"round counted (k), errors {row['errors']}, {row['output_tokens_per_s']:.0f} tok/s")
    return expect(row["errors"] == 0 and row["metrics_engine"] == "vllm" and 0.85 * lo <= tau <= 1.15 * hi
                  and abs(drafted - k) <= 0.01 * k, measured,
                  "vLLM's adaptive verification accepts outside 04's simulation of its rule: compare "
                  "eagle3nb/accept/adaptive.py budget/admit with vllm/v1/worker/gpu/spec_decode/"
                  "adaptive_verification.py get_num_tokens; a drafted count below k means vLLM now counts the "
                  "trimmed budget: compare it with the simulated verify_budget instead")


@dataclass(frozen=True)
class CudaPath:
    """One CUDA path: its check, the package files whose device handling it covers, and the default fix."""

    name: str
    check: Callable[[World], str]
    covers: tuple[str, ...]
    fix: str
    needs: str | None = None  # a path that must pass first


PATHS: list[CudaPath] = [
    CudaPath("cuda_device", check_cuda_device, (), "install a CUDA build of torch in .venv"),
    CudaPath("ttt_attention", check_ttt_attention, ("eagle3nb/drafts/eagle3/cache.py",),
             "see eagle3nb/drafts/eagle3/cache.py TTTCache"),
    CudaPath("hidden_transformers", check_hidden_transformers,
             ("eagle3nb/hf.py", "eagle3nb/hidden/extract.py", "eagle3nb/hidden/capture.py", "eagle3nb/data/head.py",
              "eagle3nb/hidden/params.py"), "see eagle3nb/hf.py load_target and eagle3nb/hidden/extract.py"),
    CudaPath("autocast_bf16", check_autocast_bf16, ("eagle3nb/train/distributed.py", "eagle3nb/train/params.py"),
             "see eagle3nb/train/distributed.py autocast_for"),
    CudaPath("train_step", check_train_step,
             ("eagle3nb/train/stage.py", "eagle3nb/train/loop.py", "eagle3nb/train/distributed.py",
              "eagle3nb/drafts/eagle3/objective.py", "eagle3nb/train/data.py", "eagle3nb/train/checkpoint.py"),
             "see eagle3nb/train/loop.py Trainer"),
    CudaPath("train_recipes", check_train_recipes,
             ("eagle3nb/train/loop.py", "eagle3nb/drafts/eagle3/objective.py", "eagle3nb/train/optim.py",
              "eagle3nb/drafts/eagle3/model.py", "eagle3nb/drafts/eagle3/cache.py"),
             "see eagle3nb/train/loop.py Trainer"),
    CudaPath("online_source", check_online_source, ("eagle3nb/hidden/online.py", "eagle3nb/train/sources.py"),
             "see eagle3nb/hidden/online.py OnlineStates"),
    CudaPath("export", check_export, ("eagle3nb/train/export.py", "eagle3nb/drafts/eagle3/layouts.py"),
             "see eagle3nb/train/export.py export and eagle3nb/drafts/eagle3/layouts.py load_draft"),
    CudaPath("offline_acceptance", check_offline_acceptance,
             ("eagle3nb/accept/offline.py", "eagle3nb/drafts/eagle3/offline.py"),
             "see eagle3nb/accept/offline.py offline_acceptance"),
    CudaPath("draft_sanity", check_draft_sanity, ("eagle3nb/doctor/checks/draft.py",),
             "see eagle3nb/doctor/checks/draft.py check_draft_sanity"),
    CudaPath("spec_decoding", check_spec_decoding,
             ("eagle3nb/decoder/batch.py", "eagle3nb/verification/padded.py", "eagle3nb/decoder/reference.py",
              "eagle3nb/drafts/eagle3/drafting.py", "eagle3nb/accept/local.py", "eagle3nb/accept/models.py",
              "eagle3nb/hf.py"),
             "see eagle3nb/decoder/batch.py and eagle3nb/drafts/eagle3/drafting.py"),
    CudaPath("embedded_server", check_embedded_server, ("eagle3nb/serve/batcher.py", "eagle3nb/hf.py"),
             "see eagle3nb/serve/batcher.py and eagle3nb/hf.py load_target"),
    CudaPath("embedded_spec_server", check_embedded_spec_server,
             ("eagle3nb/serve/spec_batcher.py", "eagle3nb/decoder/batch.py"),
             "see eagle3nb/serve/spec_batcher.py and eagle3nb/decoder/batch.py"),
    CudaPath("block_drafter", check_block_drafter,
             ("eagle3nb/drafts/dflash/model.py", "eagle3nb/drafts/dflash/dflash2.py",
              "eagle3nb/drafts/dflash/objective.py", "eagle3nb/drafts/dflash/layouts.py",
              "eagle3nb/drafts/dflash/drafting.py", "eagle3nb/drafts/dflash/offline.py"),
             "see eagle3nb/drafts/dflash/"),
    CudaPath("vllm_install", check_vllm_install, (), "install vLLM's GPU build into .venv-vllm-gpu"),
    CudaPath("vllm_hidden_states", check_vllm_hidden_states, ("eagle3nb/serve/vllm.py", "eagle3nb/vllm_config.py"),
             "see eagle3nb/vllm_config.py connector_config", needs="vllm_install"),
    CudaPath("vllm_eagle3", check_vllm_eagle3, ("eagle3nb/serve/vllm.py", "eagle3nb/vllm_config.py"),
             "see eagle3nb/serve/vllm.py vllm_args", needs="vllm_install"),
    CudaPath("vllm_block_verification", check_vllm_block_verification,
             ("eagle3nb/serve/vllm.py", "eagle3nb/verification/block.py", "eagle3nb/accept/verification.py"),
             "see eagle3nb/serve/vllm.py V2_SPECULATIVE and eagle3nb/verification/block.py", needs="vllm_install"),
    CudaPath("vllm_recipes", check_vllm_recipes, ("eagle3nb/serve/vllm.py", "eagle3nb/drafts/eagle3/layouts.py"),
             "see eagle3nb/drafts/eagle3/layouts.py save_draft (the layers and fc_norm names)", needs="vllm_install"),
    CudaPath("vllm_block_drafters", check_vllm_block_drafters,
             ("eagle3nb/serve/vllm.py", "eagle3nb/drafts/dflash/layouts.py", "eagle3nb/drafts/dflash/drafting.py"),
             "see eagle3nb/drafts/dflash/layouts.py draft_config_json and eagle3nb/serve/vllm.py MODE_ENV",
             needs="vllm_install"),
    CudaPath("vllm_adaptive_verification", check_vllm_adaptive_verification,
             ("eagle3nb/accept/adaptive.py", "eagle3nb/drafts/dflash/offline.py"),
             "see eagle3nb/accept/adaptive.py and eagle3nb/drafts/dflash/offline.py block_confidences",
             needs="vllm_install"),
]


# ---------------------------------------------------------------------------------------------- running


def cuda_state() -> tuple[bool, str, str]:
    """(usable, why not, what to do): torch's view, and nvidia-smi's when torch sees no GPU (a CPU build of
    torch cannot use one)."""
    import torch

    if torch.cuda.is_available():
        return True, "", ""
    smi = shutil.which("nvidia-smi")
    listed = ""
    if smi:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout.strip()
    if listed:
        return False, (f"nvidia-smi lists {listed.splitlines()[0]!r} but torch {torch.__version__} "
                       f"(CUDA {torch.version.cuda}) cannot use it"), (
            "reinstall torch from PyPI, whose Linux x86-64 wheels carry CUDA: `.venv/bin/pip install "
            f"--force-reinstall torch=={torch.__version__.split('+')[0]}`, then rerun")
    return False, "no CUDA device", ""


def line(out: TextIO, status: str, name: str, measured: str, fix: str = "") -> None:
    """``status  name  measured  -> fix``; a path measuring several things (one per line) continues aligned."""
    measured = measured.replace("\n", "\n" + " " * 28)
    print(f"{status:4}  {name:20}  {measured}" + (f"  -> {fix}" if fix else ""), file=out, flush=True)


def run_one(p: CudaPath, w: World, out: TextIO, log: TextIO) -> str:
    """Run one check with the library's output in the log; print its line; return its status."""
    t0 = time.monotonic()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            measured = p.check(w)
        status, fix = PASS, ""
    except Skipped as e:
        status, measured, fix = SKIP, e.reason, e.fix
    except Mismatch as e:
        status, measured, fix = FAIL, e.measured, e.fix
    except Exception as e:  # a crash is a failed path too; the traceback is in the log
        print(f"\n--- {p.name} ---\n{traceback.format_exc()}", file=log, flush=True)
        status, measured, fix = FAIL, f"{type(e).__name__}: {_first_line(e)}", f"{p.fix} (traceback in {log.name})"
    finally:
        gc.collect()
        with contextlib.suppress(Exception):
            import torch

            torch.cuda.empty_cache()  # vLLM, started last, wants most of the GPU's memory
    line(out, status, p.name, f"{measured} [{time.monotonic() - t0:.0f} s]", fix)
    return status


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm", action="store_true", help="install vLLM's GPU build into .venv-vllm-gpu/ if missing")
    ap.add_argument("--vllm-spec", default=None, help="pip requirement for it (default: vllm==<the tested release>)")
    args = ap.parse_args(argv)
    out, t0 = sys.stdout, time.monotonic()
    os.environ.setdefault("EAGLE3NB_ROOT", str(ROOT))
    os.environ.setdefault("EAGLE3NB_CACHE", str(ROOT / ".cache"))
    usable, why, fix = cuda_state()
    statuses: list[str] = []
    if not usable:
        rest = PATHS
        if fix:  # a GPU is there but torch cannot use it
            line(out, FAIL, PATHS[0].name, why, fix)
            statuses.append(FAIL)
            rest = PATHS[1:]
        for p in rest:
            line(out, SKIP, p.name, why, f"see the {PATHS[0].name} line" if fix else
                 "run `make gpu-check` on a machine with an NVIDIA GPU")
            statuses.append(SKIP)
    else:
        from eagle3nb.vllm_config import TESTED_VERSION

        shutil.rmtree(WORK, ignore_errors=True)
        WORK.mkdir(parents=True)
        with open(WORK / "gpu_check.log", "w") as log:
            w = World(WORK, log, t0 + BUDGET_S, args.vllm, args.vllm_spec or f"vllm=={TESTED_VERSION}")
            done: dict[str, str] = {}
            for p in PATHS:
                if p.needs and done[p.needs] != PASS:
                    line(out, SKIP, p.name, f"needs {p.needs}, which did not pass", f"see the {p.needs} line")
                    done[p.name] = SKIP
                else:
                    done[p.name] = run_one(p, w, out, log)
            statuses = list(done.values())
    counts = {s: statuses.count(s) for s in (PASS, FAIL, SKIP)}
    print(f"gpu-check: {counts[PASS]} pass, {counts[FAIL]} fail, {counts[SKIP]} skip in "
          f"{time.monotonic() - t0:.0f} s" + (f"; details in {WORK / 'gpu_check.log'}" if usable else ""), file=out)
    return 1 if counts[FAIL] else 0


if __name__ == "__main__":
    sys.exit(main())
