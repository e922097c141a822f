"""The toy's prompt sets (``toy:train``, ``toy:heldout``): 01's prompts, written from the dialogue generator's
problems. Kept apart from ``dialogues.py``, whose source is part of the toy's recipe hash (``build.SOURCE_HASH``):
a change to how prompt sets are written does not change the shipped toys' training."""

from __future__ import annotations

import json
import random
from pathlib import Path

from eagle3nb.toy.dialogues import problem


def write_prompts(path: str | Path, n: int, split: str = "train", seed: int = 0) -> Path:
    """Write ``n`` distinct prompts of ``split`` as JSONL rows ``{"id", "messages", "category"}`` (01_synth's
    prompt format). Train and held-out rows never share a problem. The single questions come first (2,213 of the
    train split); past them, prompts carry one earlier exchange before the question, as a tenth of the toy's own
    training dialogues do, so a run can ask for the seed's 10,000 answers (their final questions repeat)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    path = Path(path)
    rng = random.Random(f"prompts:{split}:{seed}")
    rows, seen = [], set()

    def add(messages: list[dict], category: str) -> None:
        key = json.dumps(messages)
        if key not in seen and len(rows) < n:
            seen.add(key)
            rows.append({"id": f"toy-{split}-{seed}-{len(rows):06d}", "messages": messages, "category": category})

    for _ in range(n * 50):  # every single question of the split, in the generator's order
        if len(rows) == n:
            break
        p = problem(rng, split)
        add([{"role": "user", "content": p["question"]}], p["category"])
    for _ in range(n * 50):
        if len(rows) == n:
            break
        h, p = problem(rng, split), problem(rng, split)
        add([{"role": "user", "content": h["question"]}, {"role": "assistant", "content": h["answer"]},
             {"role": "user", "content": p["question"]}], p["category"])
    if len(rows) < n:
        raise ValueError(f"the toy generator has only {len(rows)} distinct {split} prompts; ask for n <= {len(rows)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return path
