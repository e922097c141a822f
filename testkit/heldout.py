"""Held-out data built for checking 04 itself: the target's own greedy answers run through 02's extraction, on
which offline chains see exactly what greedy speculative decoding sees (the tests, the benchmarks and the GPU
check build their worlds with it)."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3nb.data.prompts import load_prompts
from eagle3nb.data.stream import Template
from eagle3nb.decoder.reference import plain_generate
from eagle3nb.hidden.stage import run as extract_hidden_states
from eagle3nb.params import from_dict


def greedy_hidden_states(model_dir: Path, prompts: str, n: int, max_new_tokens: int, out_dir: Path,
                         draft_vocab_size: int = 256, thinking: bool = True,
                         answers_from: Path | None = None) -> Path:
    """Held-out data that matches greedy decoding exactly: the target's own greedy answers to ``n`` prompts
    (01's sample format in ``out_dir/01``), through 02's extraction (``out_dir/02``, fp32). Offline chains on
    it see what real greedy speculative decoding sees, round for round. ``answers_from``: an earlier call's
    ``out_dir`` for a longer run of the same prompt set, whose first ``n`` answers are these (prompt sets are
    nested), so they are read instead of generated again."""
    if answers_from is not None:
        rows = [json.loads(line) for line in (Path(answers_from) / "01" / "samples-00000.jsonl").open()][:n]
        if len(rows) < n:
            raise ValueError(f"{answers_from} holds {len(rows)} answers, fewer than the {n} asked for")
    else:
        rows = _greedy_rows(model_dir, prompts, n, max_new_tokens, thinking)
    synth = Path(out_dir) / "01"
    synth.mkdir(parents=True, exist_ok=True)
    (synth / "samples-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    extract_hidden_states(from_dict("02_hidden_states", {
        "synth_dir": str(synth), "model_path": str(model_dir), "output_dir": str(Path(out_dir) / "02"),
        "storage": "fp32",
        "draft_vocab_size": draft_vocab_size, "run_name": "heldout"}))
    return Path(out_dir) / "02"


def _greedy_rows(model_dir: Path, prompts: str, n: int, max_new_tokens: int, thinking: bool) -> list[dict]:
    """01's sample rows: the target's greedy answer to each of the first ``n`` of ``prompts``."""
    import torch
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tpl = Template(model_dir, thinking=thinking)
    rows = []
    for r in load_prompts(prompts, n):
        p = tpl.prompt_ids(r["messages"])
        out = plain_generate(target, p, max_new_tokens, eos_token_ids=[tpl.end_id])
        rows.append({"id": r["id"], "status": "ok", "messages": r["messages"], "input_ids": p + out,
                     "loss_mask": [0] * len(p) + [1] * len(out), "category": r["category"], "thinking": thinking})
    return rows
