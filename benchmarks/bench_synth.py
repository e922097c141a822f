"""01_synth client speed, measured side by side in one run (ratios, so a busy machine cancels out).

1. Overhead: against a server that answers at once, requests/s of the whole synth stage (openai client,
   reasoning extraction, template stream, fsynced JSONL) at concurrency 128, as a ratio to a bare httpx
   loop sending the same requests with the same concurrency. Target >= 0.8. Also shown, stricter: the same
   bare loop on the openai package's own HTTP client (``openai.DefaultAsyncHttpxClient``, much faster than
   plain httpx here), which prices what the openai client and our stage add on top of the transport.
2. No waves: against a server with random latency, the mean number of requests in flight (seen by the
   server, from the first request until the last one starts) over the concurrency. Target >= 0.95.

The server is the scripted fault server (no faults) in its own process: ``python -m eagle3nb.synth.faults``.
Run: ``.venv/bin/python -m benchmarks.bench_synth`` (a minute or two; needs the toy smoke tokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import ROOT, alternate, command_line, project_env
from eagle3nb.synth.client import base_url
from eagle3nb.synth.params import SynthParams
from eagle3nb.synth.stage import run
from eagle3nb.toy import resolve_model_path

CONCURRENCY = 128
N_FAST = 1500
ROUNDS = 2  # alternate the two clients and keep each one's best round: a busy machine hurts both alike
N_LATENCY = 512
LATENCY = (2.0, 6.0)  # LLM-like: slow enough that the machine's CPU is not what limits the in-flight count


def start_server(*args: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "eagle3nb.synth.faults", *args], stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)
    return proc, proc.stdout.readline().strip()


def write_prompts(path: Path, n: int) -> None:
    rows = ({"id": f"b{i:05d}", "messages": [{"role": "user", "content": f"What is {i}+{i}?"}]} for i in range(n))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def params(tmp: Path, url: str, n: int, name: str) -> SynthParams:
    prompts = tmp / f"{name}.jsonl"
    write_prompts(prompts, n)
    return SynthParams(model_path=str(resolve_model_path("toy:smoke")), output_dir=str(tmp / name),
                       prompts=str(prompts), max_samples=n, concurrency=CONCURRENCY, vllm_url=url, temperature=0.7,
                       max_completion_tokens=64)


async def bare_loop(url: str, P: SynthParams, n: int, transport: str = "httpx") -> float:
    """requests/s of the simplest client: same bodies, same concurrency, JSON parsed, nothing kept; on plain
    httpx or on the openai package's HTTP client."""
    import httpx
    import openai

    bodies = [{"model": "fault-model", "messages": [{"role": "user", "content": f"What is {i}+{i}?"}],
               "max_completion_tokens": P.max_completion_tokens, "temperature": P.temperature, "top_p": P.top_p,
               "seed": i, "chat_template_kwargs": {"thinking": True}, "return_token_ids": True} for i in range(n)]
    it = iter(bodies)
    limits = httpx.Limits(max_connections=CONCURRENCY + 8, max_keepalive_connections=CONCURRENCY + 8)
    make = httpx.AsyncClient if transport == "httpx" else openai.DefaultAsyncHttpxClient
    async with make(base_url=base_url(url), limits=limits, timeout=60) as client:
        async def worker():
            for body in it:
                r = await client.post("/chat/completions", json=body)
                r.json()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        return n / (time.perf_counter() - t0)


def server_in_flight(url: str) -> float:
    """Time-weighted mean of concurrent requests the server saw, from the first start to the last start."""
    with urllib.request.urlopen(url + "/stats") as r:
        intervals = json.loads(r.read())["intervals"]
    t_begin, t_end = min(a for a, _ in intervals), max(a for a, _ in intervals)
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    area, now, last = 0.0, 0, t_begin
    for t, d in events:
        t = min(max(t, t_begin), t_end)
        area += now * (t - last)
        now, last = now + d, t
    return area / (t_end - t_begin)


def parser() -> argparse.ArgumentParser:
    return command_line(__doc__)  # no flags: the sizes above are the benchmark's


def main(argv: Sequence[str] | None = None) -> None:
    parser().parse_args(argv)
    project_env()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        proc, url = start_server()
        rounds = itertools.count()

        def synth_rps() -> float:  # the whole stage, into a fresh folder each round
            return run(params(tmp, url, N_FAST, f"fast{next(rounds)}"))["session"]["requests_per_s"]

        try:
            P = params(tmp, url, N_FAST, "bare")  # the bare loops' bodies: the same requests
            sides = alternate({"bare": lambda: asyncio.run(bare_loop(url, P, N_FAST)),
                               "bare_openai": lambda: asyncio.run(bare_loop(url, P, N_FAST, "openai")),
                               "synth": synth_rps}, ROUNDS)
        finally:
            proc.terminate()
        synth, bare, bare_openai = sides["synth"], sides["bare"], sides["bare_openai"]
        synth_rps, bare_rps, bare_openai_rps = max(synth), max(bare), max(bare_openai)
        proc, url = start_server("--latency", str(LATENCY[0]), str(LATENCY[1]))
        try:
            m = run(params(tmp, url, N_LATENCY, "latency"))
            seen = server_in_flight(url)
        finally:
            proc.terminate()
    ratio = synth_rps / bare_rps
    fill = seen / CONCURRENCY
    print(f"instant server, concurrency {CONCURRENCY}, {N_FAST} requests, best of {ROUNDS}: synth {synth_rps:.0f} "
          f"req/s "
          f"{[round(x) for x in synth]}, bare httpx {bare_rps:.0f} req/s {[round(x) for x in bare]}, "
          f"ratio {ratio:.2f} (target >= 0.8)")
    print(f"  stricter: bare loop on openai's HTTP client {bare_openai_rps:.0f} req/s "
          f"{[round(x) for x in bare_openai]}, "
          f"ratio {synth_rps / bare_openai_rps:.2f} (what the openai client + the stage cost over the transport)")
    print(f"random latency {LATENCY[0]}-{LATENCY[1]} s, concurrency {CONCURRENCY}, {N_LATENCY} requests: "
          f"mean in flight {seen:.1f} seen by the server, {m['session']['in_flight_mean']:.1f} by the client; "
          f"in-flight/concurrency {fill:.3f} (target >= 0.95)")
    print(json.dumps({"synth_vs_httpx_rps_ratio": round(ratio, 3),
                      "synth_vs_openai_transport_rps_ratio": round(synth_rps / bare_openai_rps, 3),
                      "in_flight_over_concurrency": round(fill, 3)}))


if __name__ == "__main__":
    main()
