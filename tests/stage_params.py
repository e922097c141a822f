"""The stages' parameters as the tests build them, and the small inputs they run on: 01 against a server
(``synth_params``), 01-format samples of toy dialogues written directly (``write_synth``) and 02 over them
(``hidden_params``), aux layer ids for a target of fewer than 6 layers (``aux_ids``), and 03 training a fresh
draft on every sample of 02's output (``train_on_all``). Shared by the 02 tests, the smoke toy's vLLM tests and the
family modules."""

from __future__ import annotations

import json
import random
from pathlib import Path

from served_drafts import K

from worlds import THREADS


def synth_params(tmp: Path, url: str, model: Path, **kw):
    """01's parameters against the server at ``url``: 8 greedy toy prompts, answers of up to 96 tokens."""
    from eagle3nb.synth.params import SynthParams

    base = dict(model_path=str(model), output_dir=str(tmp / "01"), prompts="toy:train", max_samples=8,
                max_completion_tokens=96, concurrency=4, vllm_url=url, temperature=0.0, retry_backoff_s=0.05)
    return SynthParams(**{**base, **kw})


def write_synth(out: Path, model_dir: Path, n: int = 12, seed: int = 0, extra: tuple = ()) -> Path:
    """01_synth-format samples: toy dialogues rendered with the toy chat template, loss on the reply."""
    from transformers import AutoTokenizer

    from eagle3nb.toy import dialogues

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        d = dialogues.dialogue(rng, "train")
        prompt = tok.apply_chat_template(d["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
        reply = tok(f"<think>{d['reasoning']}</think>{d['answer']}<|im_end|>", add_special_tokens=False)["input_ids"]
        ids, p = list(prompt) + reply, len(prompt)
        rows.append({"id": f"s{i:03d}", "status": "ok", "messages": d["messages"], "input_ids": ids,
                     "loss_mask": [0] * p + [1] * (len(ids) - p), "category": "toy"})
    out.mkdir(parents=True, exist_ok=True)
    (out / "samples-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*rows, *extra]))
    return out


def hidden_params(synth: Path, out: Path, **kw):
    """02's parameters over the samples in ``synth``. The model is the folder the samples were made with
    (``synth.parent / "model"``: the callers copy it there), not ``toy:smoke``, which names whatever the toy build
    currently is."""
    from eagle3nb.params import from_dict

    values = {"synth_dir": str(synth), "model_path": str(synth.parent / "model"), "output_dir": str(out),
              "storage": "fp32",
              "dtype": "float32", "shard_tokens": 200, "tokens_per_batch": 256, "draft_vocab_size": 64, **kw}
    return from_dict("02_hidden_states", values)


def aux_ids(num_layers: int) -> list[int]:
    """Low, middle, high aux ids for a target below EAGLE-3's default's 6 layers ([2, L//2, L-3] needs 6)."""
    return [1, num_layers // 2, num_layers - 1]


def train_on_all(hidden: Path, out: Path, steps: int) -> Path:
    """03 itself: a fresh draft on every sample of 02's data in ``hidden`` (no held-out split), in ``out``."""
    import torch

    from eagle3nb.params import from_dict
    from eagle3nb.train.stage import run

    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        run(from_dict("03_train", {"data_dir": str(hidden), "output_dir": str(out), "max_length": 256,
                                   "batch_tokens": 4096, "max_steps": steps, "lr": 0.02, "ttt_steps": K,
                                   "eval_every": 0, "save_every": 1000, "seed": 0, "holdout_fraction": 0.0}))
    finally:
        torch.set_num_threads(threads)
    return out
