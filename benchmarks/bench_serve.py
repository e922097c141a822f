"""Embedded server throughput: single stream vs concurrency 32, measured side by side in one run.

The same greedy requests (toy held-out questions) go to one ``eagle3nb serve`` process twice: one at a time,
then with up to ``--concurrency`` in flight. Dynamic batching should give several times the single-stream
output-token throughput; the ratio (target >= 3) is printed, along with a check that every request got the
same tokens both times. Run: ``.venv/bin/python benchmarks/bench_serve.py [--model toy:demo]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("EAGLE3NB_ROOT", str(ROOT))
os.environ.setdefault("EAGLE3NB_CACHE", str(ROOT / ".cache"))

import openai  # noqa: E402

from eagle3nb.launch import start_server  # noqa: E402
from eagle3nb.toy.dialogues import problem  # noqa: E402


async def run(client: openai.AsyncOpenAI, model: str, questions: list[str], concurrency: int, max_tokens: int):
    """(token ids per request, seconds) with at most ``concurrency`` requests in flight."""
    gate = asyncio.Semaphore(concurrency)

    async def one(q: str) -> list[int]:
        async with gate:
            r = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": q}], temperature=0, max_tokens=max_tokens,
                extra_body={"return_token_ids": True})
            return r.choices[0].token_ids

    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(q) for q in questions))
    return out, time.perf_counter() - t0


async def bench(base_url: str, model: str, questions: list[str], concurrency: int, max_tokens: int):
    """Warm up, then the same requests one at a time and then ``concurrency`` at a time."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        await run(client, model, questions[:2], 1, 8)
        single = await run(client, model, questions, 1, max_tokens)
        batched = await run(client, model, questions, concurrency, max_tokens)
    return single, batched


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="toy:smoke")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    rng = random.Random(0)
    questions = [problem(rng, "heldout")["question"] for _ in range(args.requests)]
    with start_server(args.model, extra_args=["--max-batch-size", str(args.concurrency)]) as server:
        (single, t_single), (batched, t_batched) = asyncio.run(
            bench(server.base_url, args.model, questions, args.concurrency, args.max_tokens))
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
