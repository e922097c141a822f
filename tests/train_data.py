"""Real 02 output for the 03 tests: toy dialogues as 01-style samples, through eagle3nb.hidden's extraction."""

from __future__ import annotations

import json
import random
from pathlib import Path


def make_hidden_states(root: Path, model_dir: Path, n: int = 48, draft_vocab_size: int = 160, seed: int = 0) -> Path:
    """``root/02`` (stage 02's output over ``n`` toy dialogues rendered with the toy's chat template)."""
    from transformers import AutoTokenizer

    from eagle3nb.hidden.stage import run as extract
    from eagle3nb.params import from_dict
    from eagle3nb.toy import dialogues

    synth = root / "01"
    synth.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    rows = []
    for k in range(n):
        d = dialogues.dialogue(rng, "train")
        kw = {"thinking": d["thinking"]}
        reply = {"role": "assistant", "content": d["answer"],
                 "reasoning_content": d["reasoning"] if d["thinking"] else ""}
        prompt = tok.apply_chat_template(d["messages"], tokenize=False, add_generation_prompt=True, **kw)
        full = tok.apply_chat_template(d["messages"] + [reply], tokenize=False, **kw)
        ids = tok.encode(full, add_special_tokens=False)
        prompt_len = len(tok.encode(prompt, add_special_tokens=False))
        rows.append({"id": f"toy-{k:03d}", "status": "ok", "messages": d["messages"], "input_ids": ids,
                     "loss_mask": [0] * prompt_len + [1] * (len(ids) - prompt_len), "category": None,
                     "thinking": d["thinking"]})
    (synth / "samples-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    P = from_dict("02_hidden_states", {"synth_dir": str(synth), "model_path": str(model_dir),
                                       "output_dir": str(root / "02"), "draft_vocab_size": draft_vocab_size,
                                       "storage": "fp32", "run_name": "test"})
    extract(P)
    return root / "02"

