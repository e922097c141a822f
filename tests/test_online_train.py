"""03 trained without 02's shards: the online source (the target computes each micro-batch from 01's records) and
the hybrid one (online in the first epoch, kept in 02's storage for later ones) against stored training, exact
resume after kill -9 for both, and the cost figures the notebook shows before training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eagle3nb.hidden.stage import run as extract
from eagle3nb.params import ParamsError, from_dict
from eagle3nb.train.checkpoint import checkpoints
from eagle3nb.train.report import read_metrics
from eagle3nb.train.sources import CACHE_DIR, source_costs
from eagle3nb.train.stage import run

from train_data import kill_after, make_hidden_states
from worlds import SEED

# Tiny: 24 toy dialogues (19 train / 5 held out), ~4 epochs in 20 steps of one micro-batch, 3 TTT steps.
BASE = dict(run_name="test", ttt_steps=3, max_length=256, batch_tokens=400, lr=3e-3, warmup_ratio=0.05,
            eval_every=10, save_every=100, holdout_fraction=0.2, seed=SEED, max_steps=20)
HIDDEN = dict(draft_vocab_size=96, storage="fp32")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory, toy_smoke) -> dict:
    """01's records and 02's fp32 shards of them (``root/01``, ``root/02``), and 02's bf16 shards of the same."""
    root = tmp_path_factory.mktemp("online")
    make_hidden_states(root, toy_smoke, n=24, draft_vocab_size=HIDDEN["draft_vocab_size"], seed=SEED)
    extract(from_dict("02_hidden_states", {**hidden_values(root, toy_smoke, storage="bf16"),
                                           "output_dir": str(root / "02-bf16")}))
    return {"root": root, "model": toy_smoke}


def hidden_values(root: Path, model: Path, **over) -> dict:
    return {"run_name": "test", "synth_dir": str(root / "01"), "model_path": str(model), **HIDDEN, **over}


def run_folder(folder: Path, world: dict, train: dict, **hidden) -> Path:
    """params/<run>/ as the runner holds it: 03's values and the 02 values the online source reads."""
    folder.mkdir(parents=True, exist_ok=True)
    hidden_yaml = yaml.safe_dump(hidden_values(world["root"], world["model"], **hidden))
    (folder / "02_hidden_states.yaml").write_text(hidden_yaml)
    (folder / "03_train.yaml").write_text(yaml.safe_dump(train))
    return folder


def train_values(out: Path, data_dir: Path, **over) -> dict:
    return {**BASE, "data_dir": str(data_dir), "output_dir": str(out), **over}


def curve(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out) if r["kind"] == "train"]


def evals(out: Path) -> list[dict]:
    return [r for r in read_metrics(out) if r["kind"] == "eval"]


def max_rel(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


def final_state(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoints(out / "checkpoints")[-1], weights_only=False)["model"]


@pytest.fixture(scope="module")
def stored(world, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("stored")
    return {"out": out, "metrics": run(from_dict("03_train", train_values(out, world["root"] / "02")))}


@pytest.fixture(scope="module")
def online(world, tmp_path_factory) -> dict:
    """Online training with no 02 output at all: data_dir is an empty folder's name."""
    tmp = tmp_path_factory.mktemp("online-run")
    values = train_values(tmp / "out", tmp / "no-02", data_source="online")
    folder = run_folder(tmp / "params" / "test", world, values)
    P = from_dict("03_train", {**values, "params_file": str(folder / "03_train.yaml")})
    return {"out": tmp / "out", "data_dir": tmp / "no-02", "folder": folder, "values": values, "metrics": run(P)}


@pytest.fixture(scope="module")
def hybrid(world, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("hybrid-run")
    values = train_values(tmp / "out", tmp / "no-02", data_source="hybrid")
    folder = run_folder(tmp / "params" / "test", world, values, storage="bf16")
    P = from_dict("03_train", {**values, "hidden_params": str(folder)})
    return {"out": tmp / "out", "folder": folder, "values": values, "metrics": run(P)}


def test_online_equals_stored_at_fp32_and_writes_only_the_vocab_and_head(world, stored, online):
    # measured: max relative per-step loss difference 1.1e-7 (the target runs over other batch shapes than 02's)
    assert max_rel(curve(online["out"]), curve(stored["out"])) < 1e-4
    got, want = evals(online["out"]), evals(stored["out"])
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 10, 20]
    for g, w in zip(got, want):
        assert g["acc"] == pytest.approx(w["acc"], abs=1e-9)
        assert g["acceptance_length"] == pytest.approx(w["acceptance_length"], abs=1e-9)
    # with no 02 output, the draft vocabulary and the target's head are written where 02 writes them, equal
    assert sorted(p.name for p in online["data_dir"].iterdir()) == ["draft_vocab.safetensors",
                                                                    "target_head.safetensors"]
    for name in ("draft_vocab.safetensors", "target_head.safetensors"):
        a, b = load_file(online["data_dir"] / name), load_file(world["root"] / "02" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    m = online["metrics"]
    assert m["data_source"] == "online" and stored["metrics"]["data_source"] == "stored"
    cost = m["source_cost"]
    # one target pass per training token per epoch, plus the held-out samples at each of the 3 evaluations
    assert m["target_forward"]["tokens"] == cost["sources"]["online"]["target_tokens"]
    assert cost["sources"]["online"]["target_tokens"] == round(cost["epochs"] * cost["train_tokens_per_epoch"]) \
        + 3 * cost["heldout_tokens"]
    assert cost["sources"]["online"]["disk_bytes"] == 0 and cost["tokens_per_s_from"] == "measured in this run"
    assert not (online["out"] / CACHE_DIR).exists()


def test_hybrid_equals_stored_with_its_storage_from_the_first_epoch(world, hybrid, tmp_path):
    ref = tmp_path / "stored-bf16"
    run(from_dict("03_train", train_values(ref, world["root"] / "02-bf16")))
    # measured: max relative difference 6.9e-8 (a few bf16 roundings of states 1e-7 apart differ)
    assert max_rel(curve(hybrid["out"]), curve(ref)) < 1e-4
    assert [r["acceptance_length"] for r in evals(hybrid["out"])] == pytest.approx(
        [r["acceptance_length"] for r in evals(ref)], abs=1e-9)
    cache = json.loads((hybrid["out"] / CACHE_DIR / "cache.json").read_text())
    assert cache["storage"] == "bf16"
    cached = [s for sh in cache["shards"] for s in sh["samples"]]
    assert len(cached) == len(set(cached)) == 24  # every sample computed once (19 train + 5 held out)
    m = hybrid["metrics"]
    assert m["hybrid_cache"]["bytes"] == sum(sh["bytes"] for sh in cache["shards"]) > 0
    assert m["target_forward"]["tokens"] == m["source_cost"]["sources"]["hybrid"]["target_tokens"]


def test_source_costs_before_training(world, stored, online):
    P = from_dict("03_train", train_values(Path(stored["out"]), world["root"] / "02"))
    c = source_costs(P)
    assert c["tokens_per_s_from"].startswith("02's metrics.json")
    assert c["sources"]["stored"]["disk_bytes"] == sum(
        s["bytes"] for s in json.loads((world["root"] / "02" / "index.json").read_text())["shards"])
    assert c["sources"]["online"]["target_tokens"] > 4 * c["sources"]["hybrid"]["target_tokens"]  # ~4.7 epochs
    # online, before any 02: the throughput is measured briefly with the target
    Po = from_dict("03_train", {**online["values"], "hidden_params": str(online["folder"])})
    co = source_costs(Po)
    assert co["tokens_per_s"] > 0 and co["tokens_per_s_from"].startswith("measured here")
    assert co["sources"]["online"]["target_tokens"] == c["sources"]["online"]["target_tokens"]


def kill_within(folder: Path, out: Path, step: int) -> int:
    """kill -9 once checkpoint ``step`` exists, before the run's last step."""
    killed_at = kill_after(folder, out, step)
    assert step <= killed_at < BASE["max_steps"]
    return killed_at


def test_online_resume_after_kill9_follows_the_uninterrupted_curve(world, online, tmp_path):
    out = tmp_path / "out"
    values = train_values(out, tmp_path / "no-02", data_source="online", save_every=1)
    folder = run_folder(tmp_path / "params" / "test", world, values)
    kill_within(folder, out, 4)
    run(from_dict("03_train", {**values, "params_file": str(folder / "03_train.yaml")}))
    assert curve(out) == curve(online["out"])  # exactly: same micro-batches, same target passes, same state
    want, got = final_state(online["out"]), final_state(out)
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_hybrid_resume_after_kill9_redoes_a_partial_shard(world, hybrid, tmp_path):
    out = tmp_path / "out"
    values = train_values(out, tmp_path / "no-02", data_source="hybrid", save_every=1)
    folder = run_folder(tmp_path / "params" / "test", world, values, storage="bf16")
    kill_within(folder, out, 3)  # inside the first epoch (~4 steps): part of the cache is written
    cache_dir = out / CACHE_DIR
    listed = json.loads((cache_dir / "cache.json").read_text())["shards"]
    assert 0 < len(listed)
    # a shard cut short (a crash mid-write on a filesystem without atomic rename), and one never listed
    damaged = cache_dir / listed[-1]["file"]
    damaged.write_bytes(damaged.read_bytes()[:-100])
    (cache_dir / "shard-00999.safetensors").write_bytes(b"partial")
    m = run(from_dict("03_train", {**values, "params_file": str(folder / "03_train.yaml")}))
    assert {damaged.name, "shard-00999.safetensors"} <= set(m["hybrid_cache"]["redone_shards"])
    assert curve(out) == curve(hybrid["out"])  # exactly, the redone samples included
    want, got = final_state(hybrid["out"]), final_state(out)
    assert all(torch.equal(want[k], got[k]) for k in want)
    cached = [s for sh in json.loads((cache_dir / "cache.json").read_text())["shards"] for s in sh["samples"]]
    assert len(cached) == len(set(cached)) == 24


def test_online_needs_02s_parameters(tmp_path):
    P = from_dict("03_train", {**BASE, "run_name": "no-such-run", "data_source": "online",
                               "output_dir": str(tmp_path / "o"), "data_dir": str(tmp_path / "d")})
    with pytest.raises(ParamsError, match="needs 02's parameters.*hidden_params"):
        run(P)


def test_doctor_disk_check_knows_online_stores_no_hidden_states(world, tmp_path):
    from eagle3nb.doctor.checks.data import check_disk
    from eagle3nb.doctor.context import Context

    def disk(source: str) -> dict:
        folder = tmp_path / source
        run_folder(folder, world, {"data_source": source, "output_dir": str(tmp_path / source / "03")},
                   output_dir=str(tmp_path / source / "02"))
        (folder / "01_synth.yaml").write_text(yaml.safe_dump({"model_path": str(world["model"]),
                                                              "output_dir": str(world["root"] / "01")}))
        return check_disk(Context.from_run_dir(folder))

    stored, online, hybrid = disk("stored"), disk("online"), disk("hybrid")
    assert stored.details["bytes_per_token"] > 0 and online.details["bytes_per_token"] == 0
    assert online.details["need"] < stored.details["need"] / 10  # the target's head only
    assert "no hidden states stored" in online.measured
    assert hybrid.details["need"] == stored.details["need"] and "hybrid cache" in hybrid.measured
