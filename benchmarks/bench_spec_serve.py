"""Embedded server, speculative vs plain, at concurrency 1, 4 and 8: output tokens/s side by side and the ratio.

    python -m benchmarks.bench_spec_serve [--model toy:demo] [--draft DIR] [--k 3] [--max-tokens 64]

Two ``eagle3nb serve`` processes on the same target, one with ``--draft``; at each concurrency the same greedy
requests (toy held-out questions) go to the plain one and then the speculative one, twice, alternating, so
machine noise hits both alike. The speculative engine batches every running request's round (one target pass
verifies all their drafts), so the goal is spec/plain >= 1.0 at concurrency 4 and 8, as vLLM would show; the
outputs must be the plain server's token for token. tau: acceptance length from the server's own /metrics.
The draft: ``--draft``, else outputs/demo/03_train/draft, else one trained here on the target's greedy answers
(``harness.small_draft``, cached in .cache/).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import httpx
import openai

from benchmarks.harness import MAX_TOKENS, ROOT, chat, command_line, project_env, questions, small_draft
from eagle3nb.formulas import spec_counters, spec_delta
from eagle3nb.launch import start_server
from eagle3nb.toy import resolve_model_path

GOAL = {4: 1.0, 8: 1.0}


def find_draft(arg: str | None, model_dir: Path) -> tuple[Path, str]:
    """(draft folder, where it came from): the argument, the demo run's 03, else a quick one trained once."""
    if arg:
        return Path(arg), "--draft"
    demo = ROOT / "outputs" / "demo" / "03_train" / "draft"
    if demo.is_dir():
        return demo, "outputs/demo/03_train/draft"
    cached = Path(os.environ["EAGLE3NB_CACHE"]) / "bench_spec_serve" / model_dir.name
    if not (cached / "03" / "draft" / "config.json").exists():
        import torch

        print(f"training a quick draft for {model_dir.name} (once, cached in {cached})", flush=True)
        torch.set_num_threads(1)  # the toy's matrices are tiny: extra threads only spin on a shared machine
        small_draft(model_dir, cached)
    return cached / "03" / "draft", f"small_draft (benchmarks/harness.py), cached in {cached}"


async def side_by_side(plain_url: str, spec_url: str, model: str, asked: list[str], concurrency: int,
                       max_tokens: int, repeats: int):
    """Total (tokens, seconds) of each server over ``repeats`` alternating runs, and each server's outputs."""
    totals = {"plain": [0, 0.0], "spec": [0, 0.0]}
    outputs = {}
    async with openai.AsyncOpenAI(base_url=plain_url, api_key="unused", max_retries=0) as plain, \
            openai.AsyncOpenAI(base_url=spec_url, api_key="unused", max_retries=0) as spec:
        for _ in range(repeats):
            for name, client in (("plain", plain), ("spec", spec)):
                ids, seconds = await chat(client, model, asked, concurrency, max_tokens)
                totals[name][0] += sum(map(len, ids))
                totals[name][1] += seconds
                outputs[name] = ids
    return totals, outputs


def parser() -> argparse.ArgumentParser:
    ap = command_line(__doc__)
    ap.add_argument("--model", default="toy:demo")
    ap.add_argument("--draft", default=None, help="draft folder (default: see above)")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--requests-per-slot", type=int, default=4, help="requests = this x concurrency")
    ap.add_argument("--max-tokens", **MAX_TOKENS)
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs of each server per level")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    project_env()
    model_dir = resolve_model_path(args.model)
    draft_dir, source = find_draft(args.draft, model_dir)
    asked = questions(args.requests_per_slot * max(args.concurrency))
    batch = ["--max-batch-size", str(max(args.concurrency))]
    rows, same = [], True
    with start_server(model_dir, extra_args=batch) as plain, \
            start_server(model_dir, draft_dir=draft_dir, num_speculative_tokens=args.k, extra_args=batch) as spec:
        model = openai.OpenAI(base_url=plain.base_url, api_key="unused").models.list().data[0].id
        asyncio.run(side_by_side(plain.base_url, spec.base_url, model, asked[:2], 1, 8, 1))  # warm-up
        for c in args.concurrency:
            qs = asked[: args.requests_per_slot * c]
            before = spec_counters(httpx.get(f"{spec.url}/metrics").text)
            totals, outputs = asyncio.run(side_by_side(plain.base_url, spec.base_url, model, qs, c,
                                                       args.max_tokens, args.repeats))
            tau = spec_delta(before, spec_counters(httpx.get(f"{spec.url}/metrics").text))["acceptance_length"]
            tps = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
            same &= outputs["plain"] == outputs["spec"]
            rows.append((c, len(qs), tau, tps["plain"], tps["spec"], tps["spec"] / tps["plain"]))
            print(f"  concurrency {c}: plain {tps['plain']:.1f} tok/s, spec {tps['spec']:.1f} tok/s", flush=True)
    print(f"\n{args.model} ({model_dir.name}), k={args.k}, greedy, max_tokens {args.max_tokens}, "
          f"{args.repeats} alternating runs per side; draft: {source}")
    print(f"{'conc':>4} {'requests':>8} {'tau':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'spec/plain':>10}  goal")
    for c, n, tau, p, s, ratio in rows:
        goal = f">= {GOAL[c]:.1f} {'met' if ratio >= GOAL[c] else 'MISSED'}" if c in GOAL else "-"
        print(f"{c:>4} {n:>8} {tau:>5.2f} {p:>12.1f} {s:>11.1f} {ratio:>9.2f}x  {goal}")
    print(f"identical greedy outputs (spec == plain): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
