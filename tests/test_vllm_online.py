"""03's online data source against the real vLLM (CPU build) in extract_hidden_states mode: the same client 02's vllm
backend uses, nothing stored, and the same per-step losses as training on 02's fp32 shards of the same samples;
and 02 and 03 over three extraction servers at once (this vLLM and two embedded servers, one killed mid-run).

Skipped with the reason where vLLM cannot run (as tests/test_vllm.py); under any truthy CI it must run.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml

from eagle3nb.data.reader import HiddenStates
from eagle3nb.hidden.stage import run as extract
from eagle3nb.launch import start_server
from eagle3nb.params import from_dict
from eagle3nb.train.report import read_metrics
from eagle3nb.train.stage import run

from engines import Servers
from train_data import kill_when, make_hidden_states
from worlds import SEED, requires_vllm

pytestmark = requires_vllm()

LAYERS = [2, 4, 5, 8]  # the smoke toy's EAGLE-3 aux ids (2, L//2, L-3) plus L = 8 for the final state
TRAIN = dict(run_name="test", ttt_steps=3, max_length=256, batch_tokens=400, lr=3e-3, warmup_ratio=0.05,
             eval_every=0, save_every=100, holdout_fraction=0.2, seed=SEED, max_steps=8)
HIDDEN = dict(draft_vocab_size=96, storage="fp32", aux_layer_ids=LAYERS[:-1], backend="vllm", concurrency=4,
              max_retries=4, retry_backoff_s=0.05)


@pytest.fixture(scope="module")
def extract_server(toy_smoke, engines):
    """The session's extraction server on the smoke toy (tests/test_vllm.py's, when it ran just before)."""
    servers = Servers(engines, toy_smoke)
    try:
        servers.start(extract={"mode": "extract", "layer_ids": LAYERS})
        yield servers["extract"]
    finally:
        servers.stop()


@pytest.fixture(scope="module")
def stored(toy_smoke, tmp_path_factory) -> dict:
    """01's records and 02's fp32 shards of 16 toy dialogues, and 03 trained on those shards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        root = tmp_path_factory.mktemp("stored")
        make_hidden_states(root, toy_smoke, n=16, draft_vocab_size=96, seed=SEED)  # 01 records + 02's fp32 shards
        metrics = run(from_dict("03_train", {**TRAIN, "data_dir": str(root / "02"), "output_dir": str(root / "s")}))
    finally:
        torch.set_num_threads(n)
    return {"root": root, "metrics": metrics, "curve": curve(root / "s")}


def curve(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out) if r["kind"] == "train"]


def max_rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def online(stored: dict, toy_smoke: Path, tmp_path: Path, urls: list[str], **train) -> dict:
    """03 with data_source online over ``urls``, at one thread as the stored run."""
    folder = tmp_path / "params" / "test"
    folder.mkdir(parents=True)
    (folder / "02_hidden_states.yaml").write_text(yaml.safe_dump({
        "synth_dir": str(stored["root"] / "01"), "model_path": str(toy_smoke), "vllm_url": urls, **HIDDEN}))
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(from_dict("03_train", {**TRAIN, "data_source": "online", "hidden_params": str(folder),
                                          "data_dir": str(tmp_path / "no-02"), "output_dir": str(tmp_path / "o"),
                                          **train}))
    finally:
        torch.set_num_threads(n)


def test_online_training_through_vllm_extract_equals_stored(extract_server, stored, toy_smoke, tmp_path):
    m = online(stored, toy_smoke, tmp_path, [extract_server.url])
    a, b = curve(tmp_path / "o"), stored["curve"]
    assert len(a) == len(b) == TRAIN["max_steps"]
    # vLLM's CPU forward at fp32 computes what transformers does, up to summation order
    assert max_rel(a, b) < 1e-4
    assert m["data_source"] == "online" and m["target_forward"]["tokens"] > 0
    assert m["heldout"]["acceptance_length"] == pytest.approx(stored["metrics"]["heldout"]["acceptance_length"],
                                                              abs=1e-6)
    assert sorted(p.name for p in (tmp_path / "no-02").iterdir()) == ["draft_vocab.safetensors",
                                                                     "target_head.safetensors"]
    assert not list((tmp_path / "no-02").glob("shard-*"))


def test_02_and_online_03_over_vllm_and_two_embedded_servers_one_killed(extract_server, stored, toy_smoke,
                                                                        tmp_path):
    with ThreadPoolExecutor(2) as pool:
        embedded = list(pool.map(lambda k: start_server(toy_smoke, extra_args=["--hidden-states-dir",
                                                                               str(tmp_path / f"srv{k}")]), range(2)))
    try:
        urls = [extract_server.url, *(e.url for e in embedded)]
        # 02 over the three, the second embedded server killed once the first of several shards is written
        out = tmp_path / "02"
        watcher = kill_when((out, "shard-*.safetensors"), embedded[1])
        m = extract(from_dict("02_hidden_states", {
            "run_name": "test", "synth_dir": str(stored["root"] / "01"), "model_path": str(toy_smoke),
            "output_dir": str(out), "vllm_url": urls, "shard_tokens": 200, **HIDDEN}))
        watcher.join()
        assert embedded[1].proc.poll() is not None
        served = m["samples_per_server"]
        assert set(served) == set(urls) and all(served[u] > 0 for u in urls) and sum(served.values()) == 16
        assert served[urls[2]] < 16 and m["shards"] > 2
        # the states of 02 in-process, in the same order: exact where an embedded server answered (transformers
        # too), within fp32 summation order where vLLM did
        a, b = HiddenStates(out), HiddenStates(stored["root"] / "02")
        assert [s["id"] for s in a.meta["samples"]] == [s["id"] for s in b.meta["samples"]]
        for i in range(len(a)):
            x, y = a[i], b[i]
            assert x["id"] == y["id"] and torch.equal(x["input_ids"], y["input_ids"])
            torch.testing.assert_close(x["aux"], y["aux"], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(x["final"], y["final"], rtol=1e-4, atol=1e-4)
        # 03 online over the same list: the dead server is said and skipped, the first embedded one is killed
        # after step 2's checkpoint, vLLM answers the rest; the curve is the stored one's
        watcher = kill_when((tmp_path / "o" / "checkpoints", "step-*.pt"), embedded[0])
        m3 = online(stored, toy_smoke, tmp_path, urls, save_every=2)
        watcher.join()
        assert embedded[0].proc.poll() is not None
        assert max_rel(curve(tmp_path / "o"), stored["curve"]) < 1e-4
        assert m3["target_forward"]["tokens"] > 0
    finally:
        for e in embedded:
            e.stop()
