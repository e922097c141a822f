"""Speculative vs plain decoding on the toy target, k = 1..5: tokens/s side by side, the ratio, and tau.

    python -m benchmarks.bench_spec [--model toy:smoke] [--draft DIR] [--prompts 12] [--max-tokens 64]

Without ``--draft`` a small draft is trained first (greedy held-out answers -> 02 -> 03, a minute or so).
Each prompt is decoded plainly and then speculatively in turn, so machine noise hits both alike. Greedy, one
thread. The ratio is wall-clock tokens/s of speculative over plain decoding on this machine's CPU, where a
verify pass of k+1 tokens costs about one decode step (like a memory-bound GPU at low concurrency).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.harness import MAX_TOKENS, command_line, small_draft


def parser() -> argparse.ArgumentParser:
    ap = command_line(__doc__)
    ap.add_argument("--model", default="toy:smoke")
    ap.add_argument("--draft", default=None, help="draft folder (default: train a small one first)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-tokens", **MAX_TOKENS)
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM

    from eagle3nb.accept.local import compare_with_plain, measure_costs
    from eagle3nb.data.prompts import load_prompts
    from eagle3nb.data.stream import Template
    from eagle3nb.drafts import load_draft
    from eagle3nb.toy import resolve_model_path

    model_dir = resolve_model_path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        draft_dir = Path(args.draft) if args.draft else small_draft(model_dir, Path(tmp))
        target = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        draft = load_draft(draft_dir, embed_tokens=target.get_input_embeddings().weight.detach())
    tpl = Template(model_dir, thinking=True)
    prompts = [tpl.prompt_ids(r["messages"]) for r in load_prompts("toy:heldout", args.prompts)]
    costs = measure_costs(target, draft, 3)
    print(f"\n{args.model}, {len(prompts)} held-out prompts x {args.max_tokens} tokens, greedy, 1 thread; "
          f"draft step / target step c = {costs['cost_ratio']:.3f}, verify overhead {costs['overhead']:.3f}")
    print(f"{'k':>2} {'tau':>6} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} {'lossless':>9}")
    for k in range(1, 6):
        r = compare_with_plain(target, draft, prompts, k, args.max_tokens, eos_token_ids=[tpl.end_id])
        print(f"{k:>2} {r['acceptance_length']:>6.3f} {r['plain_tokens_per_s']:>12.1f} {r['spec_tokens_per_s']:>11.1f} "
              f"{r['speedup']:>6.2f} {str(r['identical_to_target']):>9}", flush=True)


if __name__ == "__main__":
    main()
