"""tools/gpu_check.py on a machine without a GPU: it must import, name every CUDA path it checks (one SKIP line
each) and exit 0 at once, so the script is ready the day a GPU is lent; and its list of paths must cover every
package file whose code picks or follows a device, so a new CUDA path cannot go unchecked."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.py"
DEVICE_CODE = re.compile(r"cuda|autocast|\.device\b", re.IGNORECASE)


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run `make gpu-check` itself")
def test_without_a_gpu_every_path_is_skipped_at_once():
    names = [p.name for p in load_script().PATHS]
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    skipped = [line.split()[1] for line in lines if line.startswith("SKIP ")]
    assert skipped == names, lines
    assert all("no CUDA device" in line for line in lines[:-1]), lines
    assert lines[-1].startswith(f"gpu-check: 0 pass, 0 fail, {len(names)} skip"), lines


def test_every_file_with_device_code_is_covered_by_a_path():
    module = load_script()
    covered = {f for p in module.PATHS for f in p.covers}
    assert all((ROOT / f).is_file() for f in covered), sorted(f for f in covered if not (ROOT / f).is_file())
    # eagle3nb/serve/vllm_ext/ is run by vLLM's CPU build only (on a GPU the plugin leaves vLLM alone and vLLM's own
    # connector runs: vllm_hidden_states), so it has no CUDA path of ours to check
    with_device_code = {str(f.relative_to(ROOT)) for f in (ROOT / "eagle3nb").rglob("*.py")
                        if DEVICE_CODE.search(f.read_text()) and "vllm_ext" not in f.parts}
    missing = sorted(with_device_code - covered)
    assert not missing, f"add a check for the CUDA path in {missing} to tools/gpu_check.py (PATHS)"
    documented = module.__doc__
    assert all(f"``{p.name}``" in documented for p in module.PATHS), "list every path in the script's docstring"


def test_start_vllm_runs_block_verification_in_vllms_v2_runner(tmp_path, toy_smoke, monkeypatch):
    """``vllm_block_verification``'s server (launcher replaced, no server): the speculative config asks for block
    verification, and the environment pins vLLM's V2 model runner even where the caller's picks V1 (V1's rejection
    sampler ignores ``block`` and verifies token-wise); a token-wise server keeps the caller's runner."""
    import json

    import eagle3nb.serve.vllm as serve

    launched = {}
    monkeypatch.setattr(serve, "unavailable_reason", lambda: None)  # vLLM's environment is not needed
    monkeypatch.setattr(serve, "check_draft", lambda *a: None)  # no draft here (its checks: tests/test_misconfig.py)
    monkeypatch.setattr(serve, "launch", lambda cmd, host, port, name, timeout, env: launched.setdefault(
        json.loads(cmd[cmd.index("--speculative-config") + 1]).get("rejection_sample_method"), env))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    for method in ("block", "standard"):
        serve.start_vllm(toy_smoke, "eagle3", draft_dir=tmp_path, num_speculative_tokens=3, cpu=False,
                         speculative={"draft_sample_method": "probabilistic", "rejection_sample_method": method})
    assert launched["block"]["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert launched["standard"]["VLLM_USE_V2_MODEL_RUNNER"] == "0"
