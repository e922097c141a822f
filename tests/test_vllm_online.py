"""03's online data source against the real vLLM (CPU build) in extract_hidden_states mode: the same client 02's vllm
backend uses, nothing stored, and the same per-step losses as training on 02's fp32 shards of the same samples.

Skipped with the reason where vLLM cannot run (as tests/test_vllm.py); under any truthy CI it must run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import yaml

from eagle3nb.params import from_dict
from eagle3nb.serve.vllm import start_vllm
from eagle3nb.train.report import read_metrics
from eagle3nb.train.stage import run

sys.path.insert(0, str(Path(__file__).parent))
from train_data import make_hidden_states  # noqa: E402
from worlds import SEED, requires_vllm  # noqa: E402

pytestmark = requires_vllm()

LAYERS = [2, 4, 5, 8]  # the smoke toy's EAGLE-3 aux ids (2, L//2, L-3) plus L = 8 for the final state
TRAIN = dict(run_name="test", ttt_steps=3, max_length=256, batch_tokens=400, lr=3e-3, warmup_ratio=0.05,
             eval_every=0, save_every=100, holdout_fraction=0.2, seed=SEED, max_steps=8)


@pytest.fixture(scope="module")
def extract_server(toy_smoke, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-online")
    handle = start_vllm(toy_smoke, "extract", layer_ids=LAYERS, storage_dir=tmp / "hidden")
    try:
        yield handle
    finally:
        handle.stop()


def curve(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out) if r["kind"] == "train"]


def test_online_training_through_vllm_extract_equals_stored(extract_server, toy_smoke, tmp_path):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        root = tmp_path / "w"
        make_hidden_states(root, toy_smoke, n=16, draft_vocab_size=96, seed=SEED)  # 01 records + 02's fp32 shards
        folder = tmp_path / "params" / "test"
        folder.mkdir(parents=True)
        (folder / "02_hidden_states.yaml").write_text(yaml.safe_dump({
            "synth_dir": str(root / "01"), "model_path": str(toy_smoke), "draft_vocab_size": 96, "storage": "fp32",
            "aux_layer_ids": LAYERS[:-1], "backend": "vllm", "vllm_url": extract_server.url, "concurrency": 4}))
        stored = run(from_dict("03_train", {**TRAIN, "data_dir": str(root / "02"), "output_dir": str(tmp_path / "s")}))
        online = run(from_dict("03_train", {**TRAIN, "data_source": "online", "hidden_params": str(folder),
                                            "data_dir": str(tmp_path / "no-02"), "output_dir": str(tmp_path / "o")}))
    finally:
        torch.set_num_threads(n)
    a, b = curve(tmp_path / "o"), curve(tmp_path / "s")
    assert len(a) == len(b) == TRAIN["max_steps"]
    # vLLM's CPU forward at fp32 computes what transformers does, up to summation order
    assert max(abs(x - y) / abs(y) for x, y in zip(a, b)) < 1e-4
    assert online["data_source"] == "online" and online["target_forward"]["tokens"] > 0
    assert online["heldout"]["acceptance_length"] == pytest.approx(stored["heldout"]["acceptance_length"], abs=1e-6)
    assert sorted(p.name for p in (tmp_path / "no-02").iterdir()) == ["draft_vocab.safetensors",
                                                                     "target_head.safetensors"]
    assert not list((tmp_path / "no-02").glob("shard-*"))
