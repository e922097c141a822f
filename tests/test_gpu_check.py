"""The gpu tier (tests/gpu/, ``make gpu-check``) on a machine without a GPU: collected, marked ``gpu`` (so `make
test-fast` deselects it), every test skipped at once with the reason and nothing built; its tests cover every package
file whose code picks or follows a device, so a new CUDA path cannot go unchecked; and its block drafters' tests
follow the registry, so a method registered today is trained and served by the tier without an edit there.

The tier runs in a child pytest (the user's own command, ``make gpu-check``'s arguments) with a fake block drafter
registered in one line, and a plugin that writes down what it collected."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle3nb.drafts import block_methods, get

ROOT = Path(__file__).resolve().parents[1]
DEVICE_CODE = re.compile(r"cuda|autocast|\.device\b", re.IGNORECASE)
NO_GPU = "no CUDA device: run `make gpu-check` on a machine with an NVIDIA GPU"
FAKE = "fake"  # a block drafter whose draft estimates its acceptance (as DSpark's), registered in the child only
CHILD = """if True:
    import json, sys, types
    import pytest
    from eagle3nb import drafts
    fake = types.ModuleType("fake_draft")
    fake.NUM_LAYERS = 2
    fake.RULES = {%(fake)r: drafts.MethodRules(summary="a test's block drafter", block=True)}
    fake.method_named = lambda name: types.SimpleNamespace(name=name, confidences=lambda *a: {})
    drafts.PACKAGES[%(fake)r] = fake

    class Collected:
        def pytest_collection_finish(self, session):
            with open(sys.argv[1], "w") as out:
                json.dump([{"id": item.nodeid, "name": item.originalname,
                            "markers": sorted({m.name for m in item.iter_markers()}),
                            "covers": [f for m in item.iter_markers("covers") for f in m.args]}
                           for item in session.items], out)
    sys.exit(pytest.main(sys.argv[2:], plugins=[Collected()]))
"""
A_GPU_IS_HERE = torch.cuda.is_available() or shutil.which("nvidia-smi") is not None


@pytest.fixture(scope="module")
def tier(tmp_path_factory) -> dict:
    """The gpu tier run as ``make gpu-check`` runs it (tests/gpu, -m gpu, its basetemp), CUDA hidden: its exit
    code, output, what it collected and its basetemp."""
    tmp = tmp_path_factory.mktemp("gpu-tier")
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3NB_GPU_INSTALL_VLLM"}  # never install here
    env.update(CUDA_VISIBLE_DEVICES="", EAGLE3NB_TEST_BUDGET=str(tmp / "budget.md"))
    done = subprocess.run([sys.executable, "-c", CHILD % {"fake": FAKE}, str(tmp / "collected.json"), "tests/gpu",
                           "-m", "gpu", "-n", "0", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp / 'base'}",
                           "--tb=short"], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    collected = json.loads((tmp / "collected.json").read_text()) if (tmp / "collected.json").exists() else []
    return {"rc": done.returncode, "out": done.stdout + done.stderr, "items": collected, "base": tmp / "base"}


@pytest.mark.skipif(A_GPU_IS_HERE, reason="a GPU is here: run `make gpu-check` itself")
def test_without_a_gpu_every_test_of_the_tier_is_skipped_at_once_with_the_reason(tier):
    assert tier["rc"] == 0, tier["out"][-3000:]
    assert len(tier["items"]) >= 21, tier["out"][-3000:]
    lines = tier["out"].splitlines()
    skipped = [line for line in lines if line.startswith("SKIP ")]
    names = [item["id"].split("::")[-1].removeprefix("test_") for item in tier["items"]]
    assert [line.split()[1] for line in skipped] == names, lines  # one line per test, in the tier's order
    assert all(NO_GPU in line for line in skipped), skipped
    assert names[0] == "cuda_device" and names[-1].startswith("vllm_"), names  # the device first, vLLM last
    summary = [line for line in lines if line.startswith("gpu-check: ")]
    assert summary and summary[0].startswith(f"gpu-check: 0 pass, 0 fail, {len(names)} skip"), lines
    # no fixture was built: the log (opened by the tier's first test) and the runs' folder were never made
    assert not (tier["base"] / "gpu_check.log").exists() and not (tier["base"] / "runs").exists()


def test_the_tier_is_marked_gpu_and_make_test_fast_deselects_it(tier):
    assert tier["items"], tier["out"][-3000:]
    assert all("gpu" in item["markers"] for item in tier["items"]), [i["id"] for i in tier["items"]
                                                                     if "gpu" not in i["markers"]]
    fast = re.search(r"^test-fast:.*?-m \"([^\"]+)\"", (ROOT / "Makefile").read_text(), re.M | re.S)
    assert fast and "not gpu" in fast.group(1), "make test-fast must deselect the gpu tier (-m ... and not gpu)"


def test_the_block_drafters_tests_follow_the_registry(tier):
    """Every registered block drafter (and the fake one registered in the child's one line) is served by vLLM; every
    one whose draft estimates its own acceptance is run under vLLM's adaptive verification."""
    params = {}
    for item in tier["items"]:
        if "[" in item["id"]:
            params.setdefault(item["name"], []).append(item["id"].split("[", 1)[1].rstrip("]"))
    assert params.get("test_vllm_block_drafters") == [*block_methods(), FAKE], tier["out"][-3000:]
    adaptive = [m for m in block_methods() if get(m).confidences is not None]
    assert adaptive, "no registered block drafter estimates its acceptance: vllm_adaptive_verification runs none"
    assert params.get("test_vllm_adaptive_verification") == [*adaptive, FAKE], tier["out"][-3000:]


def test_every_file_with_device_code_is_covered_by_a_path(tier):
    """Each package file whose code picks or follows a device is named by some gpu test's ``covers`` mark; the files
    named exist; docs/gpu-check.md names every test."""
    covered = {f for item in tier["items"] for f in item["covers"]}
    assert covered, tier["out"][-3000:]
    assert all((ROOT / f).is_file() for f in covered), sorted(f for f in covered if not (ROOT / f).is_file())
    # eagle3nb/serve/vllm_ext/ is run by vLLM's CPU build only (on a GPU the plugin leaves vLLM alone and vLLM's own
    # connector runs: vllm_hidden_states), so it has no CUDA path of ours to check
    with_device_code = {str(f.relative_to(ROOT)) for f in (ROOT / "eagle3nb").rglob("*.py")
                        if DEVICE_CODE.search(f.read_text()) and "vllm_ext" not in f.parts}
    missing = sorted(with_device_code - covered)
    assert not missing, f"add a gpu test for the CUDA path in {missing} to tests/gpu/ (its covers mark names them)"
    doc = (ROOT / "docs" / "gpu-check.md").read_text()
    undocumented = sorted({n for n in (i["name"].removeprefix("test_") for i in tier["items"]) if f"`{n}`" not in doc})
    assert not undocumented, f"docs/gpu-check.md does not name {undocumented}"


def test_start_vllm_runs_block_verification_in_vllms_v2_runner(tmp_path, toy_smoke, monkeypatch):
    """``vllm_block_verification``'s server (launcher replaced, no server): the speculative config asks for block
    verification, and the environment pins vLLM's V2 model runner even where the caller's picks V1 (V1's rejection
    sampler ignores ``block`` and verifies token-wise); a token-wise server keeps the caller's runner."""
    import eagle3nb.serve.vllm as serve

    launched = {}
    (tmp_path / "config.json").write_text("{}")  # a draft of the registry's first method (EAGLE-3), read for its rules
    monkeypatch.setattr(serve, "unavailable_reason", lambda: None)  # vLLM's environment is not needed
    monkeypatch.setattr(serve, "check_draft", lambda *a: None)  # no weights here (its checks: tests/test_misconfig.py)
    monkeypatch.setattr(serve, "launch", lambda cmd, host, port, name, timeout, env: launched.setdefault(
        json.loads(cmd[cmd.index("--speculative-config") + 1]).get("rejection_sample_method"), env))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    for method in ("block", "standard"):
        serve.start_vllm(toy_smoke, "eagle3", draft_dir=tmp_path, num_speculative_tokens=3, cpu=False,
                         speculative={"draft_sample_method": "probabilistic", "rejection_sample_method": method})
    assert launched["block"]["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    assert launched["standard"]["VLLM_USE_V2_MODEL_RUNNER"] == "0"
