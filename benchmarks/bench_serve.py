"""Embedded server throughput: single stream vs concurrency 32, measured side by side in one run.

The same greedy requests (toy held-out questions) go to one ``eagle3nb serve`` process twice: one at a time,
then with up to ``--concurrency`` in flight. Dynamic batching should give several times the single-stream
output-token throughput; the ratio (target >= 3) is printed, along with a check that every request got the
same tokens both times. Run: ``.venv/bin/python -m benchmarks.bench_serve [--model toy:demo]``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

import openai

from benchmarks.harness import MAX_TOKENS, chat, command_line, project_env, questions
from eagle3nb.launch import start_server


async def bench(base_url: str, model: str, asked: list[str], concurrency: int, max_tokens: int):
    """Warm up, then the same requests one at a time and then ``concurrency`` at a time."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        await chat(client, model, asked[:2], 1, 8)
        single = await chat(client, model, asked, 1, max_tokens)
        batched = await chat(client, model, asked, concurrency, max_tokens)
    return single, batched


def parser() -> argparse.ArgumentParser:
    ap = command_line(__doc__)
    ap.add_argument("--model", default="toy:smoke")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", **MAX_TOKENS)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    project_env()
    asked = questions(args.requests)
    with start_server(args.model, extra_args=["--max-batch-size", str(args.concurrency)]) as server:
        (single, t_single), (batched, t_batched) = asyncio.run(
            bench(server.base_url, args.model, asked, args.concurrency, args.max_tokens))
    tokens = sum(map(len, single))
    tps_single, tps_batched = tokens / t_single, sum(map(len, batched)) / t_batched
    same = sum(a == b for a, b in zip(single, batched))
    print(f"model {args.model}: {args.requests} requests, {tokens} output tokens, max_tokens {args.max_tokens}")
    print(f"single stream   : {t_single:6.2f} s  {tps_single:8.1f} tok/s")
    print(f"concurrency {args.concurrency:<3} : {t_batched:6.2f} s  {tps_batched:8.1f} tok/s")
    print(f"throughput ratio: {tps_batched / tps_single:.2f}x (target >= 3)")
    print(f"identical greedy outputs: {same}/{len(single)}")
    return 0 if same == len(single) else 1


if __name__ == "__main__":
    sys.exit(main())
