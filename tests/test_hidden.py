"""02_hidden_states for real: the smoke toy target, real safetensors shards, the embedded server over HTTP."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from stage_params import hidden_params, write_synth

from eagle3nb.data.reader import HiddenStates
from eagle3nb.data.shards import STORAGES, ShardError, bytes_per_token
from eagle3nb.data.vocab import build_draft_vocab
from eagle3nb.hidden.cost import compare_targets
from eagle3nb.hidden.prepare import HiddenStatesError
from eagle3nb.hidden.stage import preview, run
from eagle3nb.layers import LayerIdError, check_layer_ids, default_aux_layer_ids, from_sglang, to_sglang
from eagle3nb.params import from_dict
from eagle3nb.paths import file_sha256

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def synth(toy_smoke, tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("world")
    shutil.copytree(toy_smoke, base / "model")
    return write_synth(base / "synth", base / "model")


@pytest.fixture(scope="module")
def fp32_run(synth, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp32")
    run(hidden_params(synth, out))
    return out


@pytest.fixture(scope="module")
def model(synth):
    from eagle3nb.hf import STATES, load_target

    return load_target(synth.parent / "model", trust_remote_code=False, use=STATES, dtype="float32")


# ------------------------------------------------------------------------------------------------ layer ids

def test_layer_id_conventions():
    assert default_aux_layer_ids(61) == [2, 30, 58]  # Kimi-K2.5: vLLM's default
    assert to_sglang([2, 30, 58]) == [1, 29, 57] and from_sglang([1, 29, 57]) == [2, 30, 58]
    assert check_layer_ids([2, 4, 5], 8) == [2, 4, 5]
    with pytest.raises(LayerIdError, match=r"out of range.*\[0, 7\]"):
        check_layer_ids([2, 4, 8], 8)
    with pytest.raises(LayerIdError, match="increasing"):
        check_layer_ids([4, 2, 5], 8)
    with pytest.warns(UserWarning, match=r"SGLang.*\[2, 30, 58\]"):
        check_layer_ids([1, 29, 57], 61)


# ---------------------------------------------------------------------------------------- what is captured

def test_captured_states_equal_output_hidden_states_exactly(fp32_run, model):
    """Per batch exactly as extraction ran it: hooks == hidden_states[i] at the ids, final == normed last."""
    from eagle3nb.data.batching import pack_batches
    from eagle3nb.hidden.capture import pad_batch

    hs = HiddenStates(fp32_run)
    ids = hs.meta["layer_ids"]
    assert ids == default_aux_layer_ids(hs.meta["num_layers"]) and hs.meta["sglang_layer_ids"] == to_sglang(ids)
    by_shard: dict[str, list[int]] = {}
    for i, s in enumerate(hs.samples):
        by_shard.setdefault(s["shard"], []).append(i)
    checked = 0
    for rows in by_shard.values():
        items = [hs[i] for i in rows]
        for batch in pack_batches([len(it["input_ids"]) for it in items], 256):
            x, mask = pad_batch([items[b]["input_ids"].tolist() for b in batch])
            with torch.no_grad():
                out = model(input_ids=x, attention_mask=mask, output_hidden_states=True)
            for k, b in enumerate(batch):
                n = len(items[b]["input_ids"])
                want = torch.cat([out.hidden_states[i][k, :n] for i in ids], dim=-1)
                assert torch.equal(items[b]["aux"], want)
                assert torch.equal(items[b]["final"], out.hidden_states[-1][k, :n])
                checked += 1
    assert checked == len(hs) == 12
    assert sum(len(r) for r in by_shard.values()) == 12 and len(by_shard) > 1
    # padding never changes a real position beyond float noise: each sample alone gives the same states
    item = hs[len(hs) - 1]
    with torch.no_grad():
        alone = model(item["input_ids"][None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(item["aux"], torch.cat([alone[i][0] for i in ids], -1), atol=1e-5, rtol=0)


def test_reader_contract(fp32_run):
    hs = HiddenStates(fp32_run)
    item, H = hs[0], hs.meta["hidden_size"]
    T = len(item["input_ids"])
    assert item["input_ids"].dtype == torch.int64 and item["loss_mask"].dtype == torch.int64
    assert item["aux"].shape == (T, 3 * H) and item["aux"].dtype == torch.float32
    p = hs.target_probs(item)
    assert p.shape == (T, 64) and torch.allclose(p.sum(-1), torch.ones(T))
    # position t predicts token t+1: the target's greedy choice, when in the draft vocab, is the draft argmax
    argmax = hs.target_argmax(item)
    in_vocab = hs.t2d[argmax]
    draft_ids = torch.arange(64) + hs.d2t
    assert torch.equal(draft_ids[p.argmax(-1)][in_vocab], argmax[in_vocab])
    assert hs.embed_tokens().shape == hs.lm_head().shape == (hs.meta["vocab_size"], H)
    index = json.loads((fp32_run / "index.json").read_text())
    assert {"id", "shard", "length", "category"} <= set(index["samples"][0])
    assert all(len(s["sha256"]) == 64 for s in index["shards"])
    metrics = json.loads((fp32_run / "metrics.json").read_text())
    assert metrics["tokens"] == sum(s["length"] for s in index["samples"]) and 0 < metrics["coverage"] <= 1
    assert metrics["bytes_per_token"] > 0 and metrics["tokens_per_s"] > 0
    assert sorted(p.name for p in fp32_run.glob("*.png")) == ["lengths.png", "throughput.png"]  # run saved the figures


def test_draft_vocab_is_exact_size_sorted_and_padded_when_short():
    samples = [{"input_ids": [5, 5, 7, 9, 3], "loss_mask": [0, 1, 1, 1, 0]}]
    v = build_draft_vocab(samples, vocab_size=20, draft_vocab_size=5)
    target = torch.arange(5) + v["d2t"]
    assert target.tolist() == sorted(target.tolist()) and len(set(target.tolist())) == 5
    assert {5, 7, 9} <= set(target.tolist()) and 3 in target.tolist()  # 3: most frequent of the rest
    assert v["padded"] == 2 and "exactly 5" in v["note"] and v["coverage"] == 1.0
    assert v["t2d"].sum() == 5 and v["t2d"][target].all()
    v2 = build_draft_vocab(samples, vocab_size=20, draft_vocab_size=2)
    assert (torch.arange(2) + v2["d2t"]).tolist() == [5, 7] and v2["coverage"] == pytest.approx(2 / 3)


# --------------------------------------------------------------------------------- the vLLM backend, for real

def test_vllm_backend_through_embedded_server_equals_transformers(synth, tmp_path):
    from eagle3nb.hidden.vllm_backend import VllmBackendError
    from eagle3nb.launch import start_server

    with start_server(synth.parent / "model", extra_args=["--hidden-states-dir", str(tmp_path / "srv")]) as srv:
        run(hidden_params(synth, tmp_path / "vllm", backend="vllm", vllm_url=srv.url, tokens_per_batch=1))
        # a server started with other layers than this run's is caught (here: it writes 4 states, we want 3)
        with pytest.raises(VllmBackendError, match="returns 4 hidden states per token, this run expects 3"):
            run(hidden_params(synth, tmp_path / "other", backend="vllm", vllm_url=srv.url, aux_layer_ids=[2, 4]))
    assert not list((tmp_path / "srv").iterdir()), "the client deletes each file and its lock after reading"
    run(hidden_params(synth, tmp_path / "hf", tokens_per_batch=1))  # one sample per forward, as the server runs them
    a, b = HiddenStates(tmp_path / "vllm"), HiddenStates(tmp_path / "hf")
    assert len(a) == len(b) == 12
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x["id"] == y["id"] and torch.equal(x["input_ids"], y["input_ids"])
        assert torch.equal(x["aux"], y["aux"]) and torch.equal(x["final"], y["final"])
    assert json.loads((tmp_path / "vllm" / "metrics.json").read_text())["backend"] == "vllm"


def test_reader_of_vllm_per_sample_files(synth, fp32_run, tmp_path):
    """Files exactly as vLLM's connector writes them (token_ids, hidden_states [T, 4, H], id L pre-norm)."""
    from safetensors.torch import save_file

    from eagle3nb.hf import DECODER, load_target, load_tokenizer
    from eagle3nb.hidden.vllm_backend import read_connector_file, remove_connector_file
    from eagle3nb.serve.extract import handle_completion_extract

    m = load_target(synth.parent / "model", trust_remote_code=False, use=DECODER)
    tok = load_tokenizer(synth.parent / "model", trust_remote_code=False)
    ours = HiddenStates(fp32_run)
    picked = [ours[i] for i in (0, 5)]
    for item in picked:
        res = handle_completion_extract(m, tok, {"prompt": item["input_ids"].tolist(), "max_tokens": 1,
                                                 "return_token_ids": True, "temperature": 0}, tmp_path)
        path = res["kv_transfer_params"]["hidden_states_path"]
        data = read_connector_file(path)
        assert data["hidden_states"].shape == (len(item["input_ids"]), 4, ours.meta["hidden_size"])
        remove_connector_file(path)
        save_file(data, str(tmp_path / f"{item['id']}.safetensors"))
    with pytest.raises(ValueError, match="model_path"):
        HiddenStates(tmp_path)
    theirs = HiddenStates(tmp_path, model_path=synth.parent / "model", draft_vocab_size=64)
    assert len(theirs) == 2 and "all ones" in theirs.meta["loss_mask"]
    by_id = {theirs[i]["id"]: theirs[i] for i in range(len(theirs))}
    for item in picked:
        other = by_id[item["id"]]
        assert torch.equal(other["loss_mask"], torch.ones_like(item["loss_mask"]))
        # alone vs in a padded batch: float noise only (states reach ~20 in magnitude, so relative too)
        torch.testing.assert_close(other["aux"], item["aux"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(other["final"], item["final"], atol=1e-5, rtol=1e-5)
        assert theirs.target_probs(other).shape[-1] == 64


# ------------------------------------------------------------------------------------ resume, corruption

def _run_subprocess(yaml_path: Path) -> subprocess.Popen:
    env = {**os.environ, "EAGLE3NB_ROOT": str(ROOT), "EAGLE3NB_CACHE": os.environ["EAGLE3NB_CACHE"]}
    return subprocess.Popen([sys.executable, "-m", "eagle3nb.hidden", str(yaml_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_kill_9_and_resume_gives_identical_shards(synth, tmp_path):
    import threading

    cfg = {"synth_dir": str(synth), "model_path": str(synth.parent / "model"), "storage": "bf16", "dtype": "float32",
           "shard_tokens": 60, "tokens_per_batch": 128, "draft_vocab_size": 64}
    (tmp_path / "killed.yaml").write_text(json.dumps({**cfg, "output_dir": str(tmp_path / "killed")}))
    victim = _run_subprocess(tmp_path / "killed.yaml")
    plan = tmp_path / "killed" / "plan.json"
    seen: dict = {}

    def kill_after_first_shard() -> None:
        deadline = time.time() + 240
        while time.time() < deadline and victim.poll() is None:
            try:
                seen["shards"] = json.loads(plan.read_text())["shards"]
            except (OSError, ValueError):
                seen["shards"] = []
            if any(s.get("done") for s in seen["shards"]):
                victim.send_signal(signal.SIGKILL)
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_after_first_shard)
    watcher.start()
    run(from_dict("02_hidden_states", {**cfg, "output_dir": str(tmp_path / "ref")}))  # meanwhile, the reference
    watcher.join()
    victim.wait()
    assert victim.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    done_before = sum(bool(s.get("done")) for s in json.loads(plan.read_text())["shards"])
    assert 0 < done_before < len(seen["shards"])
    resumed = _run_subprocess(tmp_path / "killed.yaml")
    out, _ = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, out
    assert f"({done_before} already on disk)" in out
    a, b = (json.loads((tmp_path / d / "index.json").read_text()) for d in ("ref", "killed"))
    assert a["shards"] == b["shards"] and a["samples"] == b["samples"]
    for s in a["shards"]:
        assert file_sha256(tmp_path / "killed" / s["file"]) == s["sha256"]
    assert not list((tmp_path / "killed").glob(".*.tmp"))


def test_corrupt_or_truncated_shard_is_detected_and_redone(fp32_run, synth, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(fp32_run, out)
    index = json.loads((out / "index.json").read_text())
    victim = out / index["shards"][1]["file"]
    good = victim.read_bytes()
    victim.write_bytes(good[:-100])
    with pytest.raises(ShardError, match="truncated"):
        HiddenStates(out)
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    victim.write_bytes(bytes(bad))
    HiddenStates(out)  # same size: only the hash can tell
    metrics = run(hidden_params(synth, out))
    assert metrics["redone_shards"] == [victim.name] and metrics["resumed_shards"] == len(index["shards"]) - 1
    assert victim.read_bytes() == good


# ---------------------------------------------------------------------------------------- clear errors

def test_preview_says_what_a_run_will_do_before_doing_it(synth, tmp_path):
    plan = preview(hidden_params(synth, tmp_path / "o"))
    assert plan["layer_ids"] == default_aux_layer_ids(plan["num_layers"])
    assert plan["sglang_layer_ids"] == to_sglang(plan["layer_ids"]) and plan["samples"] == 12
    assert list(plan["storage_table"]["storage"]) == list(STORAGES)
    assert "extract_hidden_states" in plan["vllm_command"]
    assert not (tmp_path / "o").exists()  # nothing written


def test_wrong_layer_id_is_a_clear_error_before_work(synth, tmp_path):
    L = json.loads((synth.parent / "model" / "config.json").read_text())["num_hidden_layers"]
    with pytest.raises(LayerIdError, match=rf"\[{L + 1}\] out of range.*{L} decoder layers"):
        run(hidden_params(synth, tmp_path / "o", aux_layer_ids=[2, 4, L + 1]))
    assert not list((tmp_path / "o").glob("shard-*"))


def test_mismatched_model_is_a_clear_error(synth, toy_smoke, tmp_path):
    alien = {"id": "alien", "status": "ok", "input_ids": [1, 2, 10**6], "loss_mask": [0, 1, 1], "category": None}
    shutil.copytree(toy_smoke, tmp_path / "model")
    other = write_synth(tmp_path / "synth2", toy_smoke, n=2, extra=(alien,))
    with pytest.raises(ValueError, match="another tokenizer than model_path"):
        run(hidden_params(other, tmp_path / "o"))
    # an output_dir made with other settings (here: another model) is refused, not mixed
    out = tmp_path / "o2"
    out.mkdir()
    (out / "plan.json").write_text(json.dumps({"config": {"model_fingerprint": "0123"}, "shards": []}))
    with pytest.raises(HiddenStatesError, match="model_fingerprint"):
        run(hidden_params(synth, out))


def test_resume_with_other_data_settings_is_refused_and_force_starts_over(fp32_run, synth, tmp_path):
    """Shards made with other storage or max_length must not be mixed with new ones: refused before any work,
    naming the setting; force: true discards them and extracts afresh."""
    out = tmp_path / "copy"
    shutil.copytree(fp32_run, out)
    plan = (out / "plan.json").read_bytes()
    for key, value in (("storage", "bf16"), ("max_length", 64)):
        with pytest.raises(HiddenStatesError, match=rf"other settings \([^)]*\b{key}\b[^)]*differ\).*force: true"):
            run(hidden_params(synth, out, **{key: value}))
    assert (out / "plan.json").read_bytes() == plan and HiddenStates(out).meta["storage"] == "fp32"
    m = run(hidden_params(synth, out, storage="bf16", force=True))
    assert m["resumed_shards"] == 0 and HiddenStates(out).meta["storage"] == "bf16"
    assert run(hidden_params(synth, out, storage="bf16"))["resumed_shards"] == len(HiddenStates(out).meta["shards"])


def test_disk_projection_refuses_when_it_does_not_fit(synth, tmp_path, monkeypatch, capsys):
    from collections import namedtuple

    from eagle3nb.hidden import prepare as plan

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(plan.shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(HiddenStatesError, match="projected disk use.*Not starting.*force"):
        run(hidden_params(synth, tmp_path / "o"))
    assert "GB for the whole run" in capsys.readouterr().out


# --------------------------------------------------------------------------------- compact storage

def test_compact_storage_halves_bytes_and_keeps_the_training_signal(synth, tmp_path):
    runs = {}
    for storage in ("bf16", "fp8", "topk"):
        m = run(hidden_params(synth, tmp_path / storage, storage=storage, topk=8))
        runs[storage] = (m, HiddenStates(tmp_path / storage))
    H = runs["bf16"][1].meta["hidden_size"]
    for storage, (m, _) in runs.items():  # the layout formula is the real file size (headers aside)
        assert m["layout_bytes_per_token"] == bytes_per_token(storage, H, 3, 8, 64)
        assert 0 <= m["bytes_per_token"] - m["layout_bytes_per_token"] < 0.1 * m["layout_bytes_per_token"]
    assert runs["fp8"][0]["bytes_per_token"] < 0.6 * runs["bf16"][0]["bytes_per_token"]
    kimi = bytes_per_token("bf16", 7168)  # at Kimi's width: fp8 ~half, topk well under half
    assert bytes_per_token("fp8", 7168) / kimi < 0.501 and bytes_per_token("topk", 7168, topk=32) / kimi < 0.4
    ref = runs["bf16"][1]
    fp8 = compare_targets(ref, runs["fp8"][1])
    assert fp8["positions"] == runs["bf16"][0]["loss_tokens"]
    assert fp8["total_variation"] < 0.02 and fp8["argmax_agreement"] > 0.97 and fp8["aux_relative_error"] < 0.05, fp8
    # top-k changes the loss target by exactly the probability mass it drops (and nothing else)
    topk = compare_targets(ref, runs["topk"][1])
    items = [ref[i] for i in range(len(ref))]
    tail = [1 - ref.target_probs(it)[it["loss_mask"].bool()].topk(8).values.sum(-1) for it in items]
    assert abs(topk["total_variation"] - torch.cat(tail).mean().item()) < 0.01, topk
    assert topk["argmax_agreement"] > 0.97 and topk["aux_relative_error"] < 0.05, topk


def test_samples_hash_is_the_one_of_the_whole_json():
    """02's config hash is fed in chunks (no whole-run JSON text in memory) and equals the one-shot digest."""
    import hashlib

    from eagle3nb.hidden.prepare import samples_sha256

    rng = random.Random(0)
    for n in (0, 1, 1023, 1024, 2500):
        rows = [{"id": f"s{i}é", "input_ids": [rng.randrange(99) for _ in range(rng.randrange(6))],
                 "loss_mask": [0, 1]} for i in range(n)]
        whole = json.dumps([(r["id"], r["input_ids"], r["loss_mask"]) for r in rows]).encode()
        assert samples_sha256(rows) == samples_sha256(rows, chunk=7) == hashlib.sha256(whole).hexdigest()
