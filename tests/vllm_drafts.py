"""vLLM 0.32's own draft models, built in its environment (a subprocess of ``.venv-vllm``'s python, no server) from an
exported draft folder and loaded with their own ``load_weights``: the script's opening (``OPENING``: vLLM's imports,
its CPU build's V1-runner check set aside to report what it says, one gloo process group, and ``built``, the context
that yields each model), to which a test appends what it reads of the models, and ``run``, which runs it. Shared by
the block drafters' modules (test_lilicorr.py's ``VLLM_LILICORR``, test_dflash.py's ``VLLM_LOAD``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

OPENING = r"""
import contextlib, json, sys
import torch
from safetensors.torch import load_file, save_file
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.models.registry import ModelRegistry
from vllm.utils.network_utils import get_open_port

# The CPU build's V1 runner refuses some drafts at config time (what it says is reported as "v1"); the models and
# their loaders under test do not depend on the runner.
v1_check, VllmConfig._validate_v1_model_runner = VllmConfig._validate_v1_model_runner, lambda self: None
target, out, drafts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
report, ready = {}, False


@contextlib.contextmanager
def built(method, draft, k):
    # vLLM's model of the draft in folder `draft` served as `method` at k drafts a round, every parameter NaN and then
    # loaded by its own load_weights: yields (its config, the model, {name: parameter}, what V1 says or None), inside
    # vLLM's config context
    global ready
    cfg = EngineArgs(model=target, dtype="float32", max_model_len=256, enforce_eager=True, speculative_config={
        "method": method, "model": draft, "num_speculative_tokens": k}).create_engine_config()
    arch = cfg.speculative_config.draft_model_config.hf_config.architectures
    cls, _ = ModelRegistry.resolve_model_cls(arch, model_config=cfg.speculative_config.draft_model_config)
    try:
        v1_check(cfg)
        v1 = None
    except ValueError as e:
        v1 = str(e)
    with set_current_vllm_config(cfg):
        if not ready:
            init_distributed_environment(1, 0, f"tcp://127.0.0.1:{get_open_port()}", 0, backend="gloo")
            initialize_model_parallel(1, 1)
            ready = True
        model = cls(vllm_config=cfg)
        params = dict(model.named_parameters())
        for p in params.values():
            p.data.fill_(float("nan"))
        model.load_weights(load_file(f"{draft}/model.safetensors").items())
        yield cfg, model, params, v1
"""


def run(body: str, target: Path, out: Path, drafts: dict) -> dict:
    """``OPENING`` + ``body`` in vLLM's environment (argv: the target's folder, ``out``, ``drafts`` as JSON; cwd
    ``out``): the JSON the body prints after ``REPORT``."""
    from eagle3nb.serve.vllm import vllm_python

    done = subprocess.run([str(vllm_python()), "-c", OPENING + body, str(target), str(out), json.dumps(drafts)],
                          capture_output=True, text=True, timeout=900, cwd=out)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("REPORT", 1)[1])
