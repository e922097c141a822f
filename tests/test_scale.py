"""Past one server and one node (issue 25): 02 over two extraction servers (the embedded server's
extract_hidden_states mode), one killed mid-run, gives the states one server gives, bit for bit and in the same
order; 03 online under torchrun with 2 gloo ranks, each fed by its own share of the servers (the killed one's
rank by the other), resumes after kill -9 of the whole job exactly; the hybrid cache two processes share holds
each shard once.

The real vLLM among the servers: tests/test_vllm_online.py.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch
import yaml

from eagle3nb.data.reader import HiddenStates
from eagle3nb.hidden.online import OnlineStates, listing_name
from eagle3nb.hidden.stage import run as extract
from eagle3nb.launch import start_server
from eagle3nb.params import from_dict
from eagle3nb.train.checkpoint import checkpoints
from eagle3nb.train.report import read_metrics
from eagle3nb.train.sources import CACHE_DIR
from eagle3nb.train.stage import run

from train_data import child_env, kill_when, make_records, wait_for_checkpoint
from worlds import SEED

HIDDEN = dict(draft_vocab_size=96, storage="fp32", concurrency=2, max_retries=4, retry_backoff_s=0.05)
TRAIN = dict(run_name="test", ttt_steps=3, max_length=128, batch_tokens=200, lr=3e-3, warmup_ratio=0.05,
             eval_every=0, save_every=1, holdout_fraction=0.2, seed=SEED, max_steps=5)


@pytest.fixture(scope="module")
def servers(toy_smoke, tmp_path_factory):
    """Two embedded servers in extraction mode (the toy's default ids [2, 4, 5, 8]), started together."""
    tmp = tmp_path_factory.mktemp("extract-servers")
    with ThreadPoolExecutor(2) as pool:
        handles = list(pool.map(lambda k: start_server(toy_smoke, extra_args=["--hidden-states-dir",
                                                                              str(tmp / f"srv{k}")]), range(2)))
    try:
        yield handles
    finally:
        for h in handles:
            h.stop()


@pytest.fixture(scope="module")
def records(toy_smoke, tmp_path_factory) -> Path:
    """01's records of 16 toy dialogues."""
    return make_records(tmp_path_factory.mktemp("scale"), toy_smoke, n=16, seed=SEED)


def hidden_values(records: Path, model: Path, urls: list[str], **over) -> dict:
    return {"run_name": "test", "synth_dir": str(records), "model_path": str(model), "backend": "vllm",
            "vllm_url": urls, **HIDDEN, **over}


def test_02_over_two_servers_with_one_killed_gives_one_servers_states(servers, records, toy_smoke, tmp_path):
    urls = [s.url for s in servers]
    one = extract(from_dict("02_hidden_states", {**hidden_values(records, toy_smoke, [urls[0]]),
                                                 "output_dir": str(tmp_path / "one")}))
    out = tmp_path / "three"
    watcher = kill_when((out, "shard-*.safetensors"), servers[1])  # after the first of several shards
    many = extract(from_dict("02_hidden_states", {**hidden_values(records, toy_smoke, urls, shard_tokens=200),
                                                  "output_dir": str(out)}))
    watcher.join()
    assert servers[1].proc.poll() is not None, "the second server was killed during the run"
    served = many["samples_per_server"]
    assert sum(served.values()) == len(HiddenStates(out)) == 16
    assert set(served) == set(urls) and all(served[u] > 0 for u in urls)  # both were busy
    assert served[urls[1]] < 16 and many["shards"] > 2
    assert one["samples_per_server"] == {urls[0]: 16}
    a, b = HiddenStates(out), HiddenStates(tmp_path / "one")
    assert [s["id"] for s in a.meta["samples"]] == [s["id"] for s in b.meta["samples"]]  # the same order on disk
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x["id"] == y["id"] and torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["aux"], y["aux"]) and torch.equal(x["final"], y["final"])  # bit for bit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun() -> list[str]:
    """torchrun, 2 processes here, with its c10d rendezvous (the one its restarts and multi-node runs use)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]


def run_folder(folder: Path, records: Path, model: Path, urls: list[str], train: dict) -> Path:
    """params/<run>/ with 03's values and the 02 values the online source reads."""
    folder.mkdir(parents=True)
    (folder / "02_hidden_states.yaml").write_text(yaml.safe_dump(hidden_values(records, model, urls)))
    (folder / "03_train.yaml").write_text(yaml.safe_dump(train))
    return folder


def losses(out: Path) -> list[tuple[float, float]]:
    return [(r["loss"], r["grad_norm"]) for r in read_metrics(out) if r["kind"] == "train"]


def test_online_under_torchrun_resumes_after_kill9_exactly(servers, records, toy_smoke, tmp_path, one_thread):
    # rank 0 is given server 0, rank 1 server 1, which the test above killed: rank 1 then asks server 0
    urls = [s.url for s in servers]
    out = tmp_path / "online"
    online = {**TRAIN, "data_source": "online", "data_dir": str(tmp_path / "o-02"), "output_dir": str(out)}
    folder = run_folder(tmp_path / "o" / "test", records, toy_smoke, urls, online)
    # killed -9 after checkpoint 2: torchrun and both training processes (they run in sessions of their own)
    job = subprocess.Popen([*torchrun(), "-m", "eagle3nb.train", str(folder)], env=child_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_checkpoint(job, out, 2)
    workers = psutil.Process(job.pid).children(recursive=True)
    for p in [psutil.Process(job.pid), *workers]:
        p.kill()  # SIGKILL
    _, alive = psutil.wait_procs(workers, timeout=30)
    job.wait()
    killed_at = int(checkpoints(out / "checkpoints")[-1].stem.split("-")[1])
    assert 2 <= killed_at < TRAIN["max_steps"] and len(workers) >= 2 and not alive
    done = subprocess.run([*torchrun(), "-m", "eagle3nb.train", str(folder)], env=child_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming at step {killed_at}" in done.stdout and "2 process(es) x grad_accum 1" in done.stdout
    # the uninterrupted job, as one process with the same global batch (grad_accum 2): exactly equal, because
    # DDP's mean of two gradients is the sum of the two halves one process accumulates (halving is exact in
    # floating point and a sum of two is one rounding either way)
    ref = tmp_path / "one"
    run(from_dict("03_train", {**online, "output_dir": str(ref), "grad_accum": 2,
                               "params_file": str(folder / "03_train.yaml")}))
    assert len(losses(out)) == TRAIN["max_steps"] and losses(out) == losses(ref)
    want = torch.load(checkpoints(ref / "checkpoints")[-1], weights_only=False)["model"]
    got = torch.load(checkpoints(out / "checkpoints")[-1], weights_only=False)["model"]
    assert all(torch.equal(want[k], got[k]) for k in want)
    m = json.loads((out / "metrics.json").read_text())
    assert m["processes"] == 2 and m["data_source"] == "online" and not (out / CACHE_DIR).exists()


def test_hybrid_cache_of_two_processes_holds_each_shard_once(servers, records, toy_smoke, tmp_path):
    """The hybrid cache as two of 03's processes share it (here both in this process, in torchrun's order: rank 0
    opens it first): each writes its own shards and list, reads the other's instead of computing again, never
    overwrites a shard name another writer took, and a reopening cleans what a killed writer left."""
    HP = from_dict("02_hidden_states", {**hidden_values(records, toy_smoke, [servers[0].url]),
                                        "output_dir": str(tmp_path / "02")})
    cache = tmp_path / "cache"

    def process(rank: int) -> OnlineStates:
        return OnlineStates(HP, max_length=128, cache_dir=cache, cache_key={"k": 1}, share=(rank, 2),
                            write_files=rank == 0)

    r0, r1 = process(0), process(1)
    got0, got1 = r0.items([0, 1, 2]), r1.items([3, 4, 5])
    (cache / "shard-00003.safetensors").write_bytes(b"taken")  # rank 1's next name, taken by another writer
    got0 += r0.items([6, 7])
    got1 += r1.items([8, 9])
    assert [sh["file"] for sh in r0._own] == ["shard-00000.safetensors", "shard-00002.safetensors"]
    assert [sh["file"] for sh in r1._own] == ["shard-00001.safetensors", "shard-00005.safetensors"]
    assert (cache / "shard-00003.safetensors").read_bytes() == b"taken"  # never overwritten
    # each reads the other's samples from the cache, not from the server
    tokens = r0.target_tokens, r1.target_tokens
    across0, across1 = r0.items([3, 4, 5, 8, 9]), r1.items([0, 1, 2, 6, 7])
    assert (r0.target_tokens, r1.target_tokens) == tokens
    for a, b in zip(across0 + across1, got1 + got0):
        assert a["id"] == b["id"] and torch.equal(a["aux"], b["aux"]) and torch.equal(a["final"], b["final"])
    # the same numbers the online source computes (fp32 storage keeps them exactly)
    fresh = OnlineStates(HP, max_length=128).items([0, 3, 9])
    for a, b in zip(fresh, [got0[0], got1[0], got1[4]]):
        assert torch.equal(a["aux"], b["aux"]) and torch.equal(a["final"], b["final"])
    # a writer killed between its file and its list, and one killed mid-write: the next opening redoes both
    (cache / ".shard-part-r1.safetensors").write_bytes(b"partial")
    again = process(0)
    assert again.redone == ["shard-00003.safetensors"] and not list(cache.glob(".shard-*"))
    assert not (cache / listing_name(1)).exists()  # rank 1's list merged into cache.json
    listed = json.loads((cache / listing_name(0)).read_text())["shards"]
    assert sorted(sh["file"] for sh in listed) == sorted(p.name for p in cache.glob("shard-*"))
    assert sorted(s for sh in listed for s in sh["samples"]) == sorted(r0.samples[i]["id"] for i in range(10))
    assert process(1).cache.keys() == again.cache.keys()
