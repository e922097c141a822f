"""The whole smoke pipeline, for real: four notebooks executed by papermill through the orchestrator."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "outputs" / "smoke"


@pytest.fixture(scope="module")
def smoke_run(toy_smoke):
    shutil.rmtree(OUT, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, "-m", "eagle3nb", "run", str(ROOT / "params" / "smoke")],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"smoke run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.slow
def test_smoke_pipeline_produces_every_stage(smoke_run):
    status = json.loads((OUT / "status.json").read_text())
    for stage in ["01_synth", "02_hidden_states", "03_train", "04_acceptance"]:
        assert status["stages"][stage]["state"] == "done", stage
        assert (OUT / f"{stage}.ipynb").exists() and (OUT / f"{stage}.html").exists()
        html = (OUT / f"{stage}.html").read_text()
        assert "validate(" not in html, "reports are rendered without input cells"
    synth = json.loads((OUT / "01_synth" / "metrics.json").read_text())
    assert synth["counts"]["ok"] >= 1
    assert (OUT / "03_train" / "draft" / "config.json").exists()
    acc = json.loads((OUT / "04_acceptance" / "metrics.json").read_text())
    assert acc["local"]["identical_to_target"] is True
    assert len(acc["offline"]["per_position"]) == acc["offline"]["k"]
    # executed notebooks keep their plots
    nb = json.loads((OUT / "04_acceptance.ipynb").read_text())
    assert any("image/png" in o.get("data", {}) for c in nb["cells"] for o in c.get("outputs", []))


@pytest.mark.slow
def test_second_run_skips_done_stages(smoke_run):
    proc = subprocess.run([sys.executable, "-m", "eagle3nb", "run", str(ROOT / "params" / "smoke")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0
    assert "skip" in (proc.stdout + proc.stderr).lower()


@pytest.mark.slow
def test_doctor_passes_the_healthy_smoke_run(smoke_run):
    proc = subprocess.run([sys.executable, "-m", "eagle3nb", "doctor", str(ROOT / "params" / "smoke"), "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    results = json.loads(proc.stdout)
    bad = [r for r in results if r["status"] == "fail"]
    assert proc.returncode == 0 and not bad, bad
