"""The tracking hook for real: a tiny toy pipeline run with report_to mlflow (03 also tensorboard) against the
run folder's sqlite store, read back with MLflow's own client and TensorBoard's EventAccumulator."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from worlds import write_run

RUN = "tracked"
SECRET_ENV = "EAGLE3NB_TRACK_TEST_KEY"
SECRET = "sk-track-test-0123456789abcdef"  # the key's value: it must reach no tracker
STAGES = ["01_synth", "02_hidden_states", "03_train", "04_acceptance"]
TRAIN_STEPS = 4


def leaves(value, prefix: str) -> dict[str, float]:
    """What the trackers must hold for one metrics.json: each number (not bool) by its path of keys and indices,
    a character MLflow's names do not take (``46+`` of a context bucket) written ``_``."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in leaves(item, f"{prefix}/{key}").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in leaves(item, f"{prefix}/{i}").items()}
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return {re.sub(r"[^\w./\- ]", "_", prefix): float(value)} if number else {}


def run_stage(run: Path, stage: str) -> None:
    import importlib

    from eagle3nb.params import STAGE_MODULES, from_dict
    from eagle3nb.params_yaml import run_params

    importlib.import_module(f"{STAGE_MODULES[stage]}.stage").run(from_dict(stage, run_params(run, stage)))


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, toy_smoke, embedded, one_thread):
    """The four stages on the toy at the smallest sizes that still train and measure; common.yaml switches MLflow
    on for all of them, as a user would."""
    out = tmp_path_factory.mktemp("track") / RUN
    run = write_run(out / "params", {
        "01_synth": {"model_path": toy_smoke, "vllm_url": embedded.url, "max_samples": 12,
                     "max_completion_tokens": 48, "api_key_env": SECRET_ENV, "output_dir": out / "01_synth"},
        "02_hidden_states": {"model_path": toy_smoke, "synth_dir": out / "01_synth", "max_length": 512,
                             "draft_vocab_size": 128, "output_dir": out / "02_hidden_states"},
        "03_train": {"data_dir": out / "02_hidden_states", "output_dir": out / "03_train", "max_length": 512,
                     "batch_tokens": 1024, "max_steps": TRAIN_STEPS, "eval_every": 2, "save_every": 2,
                     "holdout_fraction": 0.3, "report_to": ["mlflow", "tensorboard"]},
        "04_acceptance": {"model_path": toy_smoke, "draft_dir": out / "03_train" / "draft",
                          "data_dir": out / "02_hidden_states", "output_dir": out / "04_acceptance",
                          "offline_samples": 4, "local_prompts": 0, "k": 2, "max_k": 2, "num_prompts": 2,
                          "concurrency_levels": [1], "max_tokens": 8, "api_key_env": SECRET_ENV, "cost_ratio": 0.05,
                          "overhead": 0.1,
                          "endpoints": [{"label": "baseline", "url": embedded.url}]},
    })
    (run / "common.yaml").write_text(yaml.safe_dump({"run_name": RUN, "report_to": ["mlflow"]}))
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.setenv(SECRET_ENV, SECRET)
        for stage in STAGES:
            run_stage(run, stage)
    return {"run": run, "out": out, "uri": f"sqlite:///{out}/mlflow.db"}


def mlflow_runs(uri: str):
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("eagle3nb")
    return client, client.search_runs([exp.experiment_id])


def test_every_stage_reaches_one_mlflow_run(tracked):
    client, runs = mlflow_runs(tracked["uri"])
    assert [r.info.run_name for r in runs] == [RUN], "one MLflow run for the whole pipeline"
    run = runs[0]
    for stage in STAGES:
        stage_dir = tracked["out"] / stage
        want = leaves(json.loads((stage_dir / "metrics.json").read_text()), stage)
        got = {k: v for k, v in run.data.metrics.items() if k in want}
        assert want and got == want, f"{stage}: {sorted(want.keys() - got.keys())[:5]}"
        figures = sorted(p.name for p in stage_dir.glob("*.png"))
        assert figures and sorted(Path(a.path).name for a in client.list_artifacts(run.info.run_id, stage)) == figures
    assert "01_synth/counts/ok" in run.data.metrics and "04_acceptance/offline/acceptance_length" in run.data.metrics
    # 03's curve, one point per optimizer step (and per evaluation), equal to metrics.jsonl
    rows = [json.loads(line) for line in (tracked["out"] / "03_train" / "metrics.jsonl").read_text().splitlines()]
    for kind in ("train", "eval"):
        mine = [r for r in rows if r["kind"] == kind]
        history = sorted(client.get_metric_history(run.info.run_id, f"03_train/{kind}/loss"), key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == [(r["step"], r["loss"]) for r in mine]
    assert len([r for r in rows if r["kind"] == "train"]) == TRAIN_STEPS


def test_no_secret_reaches_mlflow(tracked):
    _, runs = mlflow_runs(tracked["uri"])
    data = runs[0].data
    assert data.params["01_synth.api_key_env"] == SECRET_ENV  # the stage's parameters are there, by name
    texts = [*data.params.keys(), *data.params.values(), *data.tags.keys(), *data.tags.values()]
    assert not [t for t in texts if SECRET in t]


def test_tensorboard_reads_back_03s_curve_and_figures(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tracked["out"] / "03_train" / "tensorboard"), size_guidance={"images": 0})
    acc.Reload()
    rows = [json.loads(line) for line in (tracked["out"] / "03_train" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [(e.step, pytest.approx(e.value)) for e in acc.Scalars("03_train/train/loss")] == \
        [(r["step"], r["loss"]) for r in train]
    figures = {f"03_train/{p.stem}" for p in (tracked["out"] / "03_train").glob("*.png")}
    assert figures and figures <= set(acc.Tags()["images"])


def test_rerunning_a_stage_keeps_one_run_and_logs_nothing_twice(tracked, monkeypatch, capsys):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    client, runs = mlflow_runs(tracked["uri"])
    before = runs[0].data.metrics
    ckpts = sorted((tracked["out"] / "03_train" / "checkpoints").glob("step-*.pt"))
    ckpts[-1].unlink()  # as if killed before the last save: 03 resumes at step 2 and trains steps 3-4 again
    run_stage(tracked["run"], "03_train")
    assert "resuming at step 2" in capsys.readouterr().out
    client, runs = mlflow_runs(tracked["uri"])
    assert len(runs) == 1
    run_id = runs[0].info.run_id
    assert len(client.get_metric_history(run_id, "03_train/train/loss")) == TRAIN_STEPS
    after = leaves(json.loads((tracked["out"] / "03_train" / "metrics.json").read_text()), "03_train")
    for key, value in after.items():
        assert len(client.get_metric_history(run_id, key)) == (1 if before.get(key) == value else 2), key


def test_tracking_uri_default_and_environment(tmp_path, monkeypatch):
    from eagle3nb.params import from_dict
    from eagle3nb.track import tracking_uri

    P = from_dict("02_hidden_states", {"output_dir": str(tmp_path / "r" / "02"), "report_to": "mlflow"},
                  check_paths=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri(P) == f"sqlite:///{tmp_path}/r/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracking_uri(P) == "http://127.0.0.1:5000"


def test_a_missing_tracker_package_is_one_line_before_the_stage_starts(tmp_path, capsys):
    import importlib.util

    from eagle3nb.stage_cli import main

    absent = next((m for m in ("wandb", "trackio") if importlib.util.find_spec(m) is None), None)
    if absent is None:
        pytest.skip("wandb and trackio are both installed")
    out = tmp_path / "01"
    assert main("01_synth", [str(tmp_path), "--set", f"report_to=[{absent}]", "--set", f"output_dir={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"pip install {absent}" in err and "Traceback" not in err
    assert not out.exists()
