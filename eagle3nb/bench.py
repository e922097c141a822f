"""Online benchmark: load OpenAI-compatible endpoints at several concurrency levels and read the server's own
speculative-decoding counters from ``/metrics`` (DESIGN.md "vLLM speculative-decoding metrics").

Throughput and latency come from the client side (real ``openai`` client over HTTP); acceptance comes from
the server side, as the delta of vLLM's counters between before and after each load level. SGLang exposes
only windowed gauges (``sglang:spec_accept_length``/``spec_accept_rate``), read after the level.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import re
import time
from collections.abc import Sequence
from typing import Any

from eagle3nb.formulas import acceptance_length_from_counts, acceptance_rate_from_counts

VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"
SGLANG_ACCEPT_RATE = "sglang:spec_accept_rate"

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


# ----------------------------------------------------------------------------------------- /metrics


def parse_prometheus(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> {sample name: [(labels, value), ...]}. Comments are skipped."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = {k: bytes(v, "utf-8").decode("unicode_escape") for k, v in _LABEL.findall(m.group(3) or "")}
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def _total(parsed: dict, name: str) -> float | None:
    """Sum of a metric over all its label sets (several engines / model names), None when absent."""
    rows = parsed.get(name)
    return sum(v for _, v in rows) if rows else None


def spec_counters(text: str) -> dict[str, Any]:
    """The speculative-decoding numbers a server exposes: vLLM's cumulative counters, or SGLang's gauges.
    ``engine`` is "vllm", "sglang" or None (no speculative decoding metrics in this text)."""
    parsed = parse_prometheus(text)
    if VLLM_DRAFTS in parsed:
        per_pos: dict[int, float] = {}
        for labels, value in parsed.get(VLLM_PER_POS, []):
            pos = int(labels.get("position", 0))
            per_pos[pos] = per_pos.get(pos, 0.0) + value
        return {
            "engine": "vllm",
            "drafts": _total(parsed, VLLM_DRAFTS) or 0.0,
            "draft_tokens": _total(parsed, VLLM_DRAFT_TOKENS) or 0.0,
            "accepted": _total(parsed, VLLM_ACCEPTED) or 0.0,
            "per_pos": [per_pos[i] for i in sorted(per_pos)],
        }
    if SGLANG_ACCEPT_LENGTH in parsed:
        rows = parsed[SGLANG_ACCEPT_LENGTH]
        rates = parsed.get(SGLANG_ACCEPT_RATE, [])
        return {
            "engine": "sglang",
            "accept_length": sum(v for _, v in rows) / len(rows),
            "accept_rate": sum(v for _, v in rates) / len(rates) if rates else None,
        }
    return {"engine": None}


def summarize_counts(drafts: float, draft_tokens: float, accepted: float, per_pos: Sequence[float]) -> dict[str, Any]:
    """vLLM's formulas on raw counts: acceptance rate, mean acceptance length, and per position both vLLM's
    cumulative rate (per_pos[i] / drafts) and the conditional alpha_i (per_pos[i] / per_pos[i-1])."""
    cumulative = [p / drafts if drafts else 0.0 for p in per_pos]
    conditional, prev = [], float(drafts)
    for p in per_pos:
        conditional.append(p / prev if prev else 0.0)
        prev = float(p)
    return {
        "drafts": drafts,
        "draft_tokens": draft_tokens,
        "accepted": accepted,
        "acceptance_rate": acceptance_rate_from_counts(accepted, draft_tokens),
        "acceptance_length": acceptance_length_from_counts(accepted, drafts),
        "per_position": conditional,
        "per_position_cumulative": cumulative,
    }


def spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Acceptance over one run from two ``spec_counters`` snapshots (vLLM: counter deltas; SGLang: the gauge
    after the run, which is windowed, so only roughly the run's own value)."""
    if after.get("engine") == "vllm":
        b = before if before.get("engine") == "vllm" else {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
        bp = list(b["per_pos"]) + [0.0] * (len(after["per_pos"]) - len(b["per_pos"]))
        return {"engine": "vllm", **summarize_counts(
            after["drafts"] - b["drafts"], after["draft_tokens"] - b["draft_tokens"],
            after["accepted"] - b["accepted"], [a - p for a, p in zip(after["per_pos"], bp)])}
    if after.get("engine") == "sglang":
        return {"engine": "sglang", "acceptance_rate": after["accept_rate"],
                "acceptance_length": after["accept_length"], "per_position": None}
    return {"engine": None, "acceptance_rate": None, "acceptance_length": None, "per_position": None}


def metrics_url(base_url: str) -> str:
    """``http://host:port/v1`` -> ``http://host:port/metrics`` (vLLM and SGLang serve /metrics at the root)."""
    root = base_url.rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    return root + "/metrics"


def scrape(url: str, timeout: float = 10.0) -> str:
    """GET a /metrics page; an unreachable page gives "" (throughput is still measured, acceptance is not)."""
    import httpx

    try:
        r = httpx.get(url, timeout=timeout)
        r.raise_for_status()
        return r.text
    except httpx.HTTPError:
        return ""


# ----------------------------------------------------------------------------------------- load


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


async def _load_level(base_url: str, model: str, prompts: list[dict], concurrency: int, max_tokens: int,
                      temperature: float, api_key: str, extra_body: dict | None = None) -> dict[str, Any]:
    """Send every prompt with at most ``concurrency`` requests in flight; time each and the whole level."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600.0)
    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    tokens: list[int] = []
    errors: list[str] = []

    async def one(row: dict) -> None:
        async with sem:
            t0 = time.perf_counter()
            try:
                resp = await client.chat.completions.create(
                    model=model, messages=row["messages"], max_tokens=max_tokens, temperature=temperature,
                    extra_body=extra_body)
            except Exception as e:  # counted and reported, never silent
                errors.append(f"{type(e).__name__}: {e}"[:200])
                return
            latencies.append(time.perf_counter() - t0)
            tokens.append(resp.usage.completion_tokens if resp.usage else 0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(r) for r in prompts))
    wall = time.perf_counter() - t0
    await client.close()
    return {"latencies": latencies, "tokens": tokens, "errors": errors, "wall_s": wall}


def _run(coro):
    """Run a coroutine from plain Python or from inside Jupyter (whose loop is already running)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def first_model(base_url: str, api_key: str) -> str:
    """The served model name (``/v1/models``), so endpoints need only a URL."""
    from openai import OpenAI

    models = OpenAI(base_url=base_url, api_key=api_key, max_retries=2).models.list().data
    if not models:
        raise RuntimeError(f"{base_url}/models lists no model; is the server up (eagle3nb doctor: server)?")
    return models[0].id


def bench_endpoint(label: str, base_url: str, prompts: list[dict], concurrency_levels: Sequence[int],
                   max_tokens: int, temperature: float = 0.0, api_key: str = "EMPTY", model: str | None = None,
                   metrics: str | None = None, warmup: int = 2, extra_body: dict | None = None) -> list[dict[str, Any]]:
    """One row per concurrency level: output tokens/s, latency percentiles and the server's acceptance.
    ``extra_body`` goes with every request (e.g. ``chat_template_kwargs`` for the thinking switch)."""
    model = model or first_model(base_url, api_key)
    murl = metrics or metrics_url(base_url)
    if warmup:
        _run(_load_level(base_url, model, prompts[:warmup], warmup, max_tokens, temperature, api_key, extra_body))
    rows = []
    for c in concurrency_levels:
        before = spec_counters(scrape(murl))
        res = _run(_load_level(base_url, model, prompts, c, max_tokens, temperature, api_key, extra_body))
        acc = spec_delta(before, spec_counters(scrape(murl)))
        lat, n_tok = res["latencies"], sum(res["tokens"])
        row = {
            "endpoint": label, "concurrency": c, "requests": len(prompts), "errors": len(res["errors"]),
            "output_tokens": n_tok, "duration_s": res["wall_s"],
            "output_tokens_per_s": n_tok / res["wall_s"] if res["wall_s"] > 0 else 0.0,
            "requests_per_s": len(lat) / res["wall_s"] if res["wall_s"] > 0 else 0.0,
            "latency_p50_s": percentile(lat, 50), "latency_p90_s": percentile(lat, 90),
            "latency_p99_s": percentile(lat, 99),
            "acceptance_rate": acc.get("acceptance_rate"), "acceptance_length": acc.get("acceptance_length"),
            "per_position": acc.get("per_position"), "metrics_engine": acc.get("engine"),
        }
        if res["errors"]:
            row["first_error"] = res["errors"][0]
            print(f"[bench {label} c={c}] {len(res['errors'])} request(s) failed, first: {res['errors'][0]}")
        print(f"[bench {label} c={c}] {row['output_tokens_per_s']:.1f} tok/s, p50 {row['latency_p50_s']:.2f}s, "
              f"acceptance length {row['acceptance_length']}", flush=True)
        rows.append(row)
    return rows


def add_speedup(rows: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """Each row's ``speedup``: its output tokens/s over the baseline endpoint's at the same concurrency."""
    base = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["endpoint"] == baseline}
    for r in rows:
        b = base.get(r["concurrency"])
        r["speedup"] = r["output_tokens_per_s"] / b if b else None
    return rows


# ----------------------------------------------------------------------------------------- plots


def plot_throughput(rows: list[dict[str, Any]]):
    """Output tokens/s vs concurrency, one line per endpoint."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(r["endpoint"] for r in rows):
        pts = sorted((r["concurrency"], r["output_tokens_per_s"]) for r in rows if r["endpoint"] == label)
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput vs concurrency")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_speedup(rows: list[dict[str, Any]], predicted: float | None = None):
    """Measured speedup over the baseline vs concurrency, with the offline prediction as a reference line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label in dict.fromkeys(r["endpoint"] for r in rows if r.get("speedup") is not None):
        pts = sorted((r["concurrency"], r["speedup"]) for r in rows if r["endpoint"] == label)
        ax.plot(*zip(*pts), marker="o", label=f"{label} (measured)")
    ax.axhline(1.0, color="gray", lw=1, ls=":", label="no speedup")
    if predicted is not None:
        ax.axhline(predicted, color="C3", ls="--", label=f"predicted {predicted:.2f}x")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("speedup over baseline")
    ax.set_title("Speedup vs concurrency")
    ax.legend()
    fig.tight_layout()
    return fig
