"""04's online benchmark: load OpenAI-compatible endpoints at several concurrency levels and read the server's own
speculative-decoding counters from ``/metrics`` (docs/DESIGN-FACTS.md "vLLM speculative-decoding metrics").

It sweeps concurrency and draft length k as SpecForge's and speculators' benchmarks do: a server's k is fixed at
its start (vLLM's ``num_speculative_tokens``), so the k sweep is over servers, each declaring its k (an endpoint's
``k``, or the embedded mode's ``ks``, which starts one speculative server per k); every row carries its k.

Throughput and latency come from the client side (real ``openai`` client over HTTP); acceptance comes from
the server side, as the delta of vLLM's counters between before and after each load level. SGLang exposes
only windowed gauges (``sglang:spec_accept_length``/``spec_accept_rate``), read after the level.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import os
import time
from collections.abc import Sequence
from typing import Any

from eagle3nb.accept.cache import cached_rows, fingerprint
from eagle3nb.accept.forecast import read_rounds, summarize
from eagle3nb.accept.params import AcceptParams
from eagle3nb.data.prompts import load_prompts
from eagle3nb.drafts import method_of
from eagle3nb.errors import InputError, scrub
from eagle3nb.formulas import spec_counters, spec_delta
from eagle3nb.launch import start_server


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
    """The served model name (``/v1/models``), so endpoints need only a URL; an endpoint that cannot be reached
    or does not answer as an OpenAI API is an InputError naming its URL."""
    import openai

    try:
        models = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=2).models.list().data
    except openai.APIConnectionError:
        raise InputError(f"endpoint {scrub(base_url)} cannot be reached: start the server or fix its url in "
                         f"endpoints") from None
    except (openai.APIStatusError, AttributeError, TypeError) as e:
        raise InputError(f"endpoint {scrub(base_url)} does not answer GET /models as an OpenAI API "
                         f"({type(e).__name__}: {str(e)[:120]}); fix its url in endpoints") from None
    if not isinstance(models, list):
        raise InputError(f"endpoint {scrub(base_url)} answered GET /models without a model list; fix its url in "
                         f"endpoints")
    if not models:
        raise InputError(f"{base_url}/models lists no model; is the server up (eagle3nb doctor: server)?")
    return models[0].id


def bench_endpoint(label: str, base_url: str, prompts: list[dict], concurrency_levels: Sequence[int],
                   max_tokens: int, temperature: float = 0.0, api_key: str = "EMPTY", model: str | None = None,
                   metrics: str | None = None, warmup: int = 2, extra_body: dict | None = None,
                   k: int | None = None, rounds: str | None = None) -> list[dict[str, Any]]:
    """One row per concurrency level: output tokens/s, latency percentiles and the server's acceptance.
    ``extra_body`` goes with every request (e.g. ``chat_template_kwargs`` for the thinking switch). ``k`` is the
    draft length the server was started with; null = the number of draft positions its counters show (none for
    a server without a draft). A declared k that its counters contradict is an InputError before the level's load.
    ``rounds``: the server's profile of its rounds (``eagle3nb.accept.forecast``); each row then carries ``engine``,
    the summary of the steps inside its level's window."""
    model = model or first_model(base_url, api_key)
    murl = metrics or metrics_url(base_url)
    if warmup:
        _run(_load_level(base_url, model, prompts[:warmup], warmup, max_tokens, temperature, api_key, extra_body))
    rows = []
    for c in concurrency_levels:
        before = spec_counters(scrape(murl))
        row_k = served_k(label, k, before)
        start = time.time()
        res = _run(_load_level(base_url, model, prompts, c, max_tokens, temperature, api_key, extra_body))
        end = time.time()
        acc = spec_delta(before, spec_counters(scrape(murl)))
        lat, n_tok = res["latencies"], sum(res["tokens"])
        row = {
            "endpoint": label, "k": row_k, "concurrency": c, "requests": len(prompts), "errors": len(res["errors"]),
            "output_tokens": n_tok, "duration_s": res["wall_s"],
            "output_tokens_per_s": n_tok / res["wall_s"] if res["wall_s"] > 0 else 0.0,
            "requests_per_s": len(lat) / res["wall_s"] if res["wall_s"] > 0 else 0.0,
            "latency_p50_s": percentile(lat, 50), "latency_p90_s": percentile(lat, 90),
            "latency_p99_s": percentile(lat, 99),
            "acceptance_rate": acc.get("acceptance_rate"), "acceptance_length": acc.get("acceptance_length"),
            "per_position": acc.get("per_position"), "metrics_engine": acc.get("engine"),
            "started_at": start, "ended_at": end,
        }
        if rounds:
            row["engine"] = summarize(read_rounds(rounds, start, end), len(prompts), end - start)
        if res["errors"]:
            row["first_error"] = res["errors"][0]
            print(f"[bench {label} c={c}] {len(res['errors'])} request(s) failed, first: {res['errors'][0]}")
        print(f"[bench {label} k={row_k} c={c}] {row['output_tokens_per_s']:.1f} tok/s, "
              f"p50 {row['latency_p50_s']:.2f}s, acceptance length {row['acceptance_length']}", flush=True)
        rows.append(row)
    return rows


def served_k(label: str, declared: int | None, counters: dict[str, Any]) -> int | None:
    """The k of a row: the declared one, checked against the draft positions the server counts (vLLM keeps one
    counter per position, so their number is its num_speculative_tokens), else that number; None = no draft."""
    counted = len(counters.get("per_pos") or []) or None
    if declared is not None and counted is not None and counted != declared:
        raise InputError(f"endpoint {label} declares k={declared} but its /metrics counts {counted} draft positions "
                         f"(the server runs num_speculative_tokens={counted}); set its k to {counted} in endpoints")
    return declared if declared is not None else counted


def at_k(rows: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The rows served at draft length ``k``, plus those with no k (the baseline, servers with no counters): what
    compares with the offline numbers and the prediction made for that k."""
    return [r for r in rows if r.get("k") in (None, k)]


def add_speedup(rows: list[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """Each row's ``speedup``: its output tokens/s over the baseline endpoint's at the same concurrency."""
    base = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["endpoint"] == baseline}
    for r in rows:
        b = base.get(r["concurrency"])
        r["speedup"] = r["output_tokens_per_s"] / b if b else None
    return rows


# ----------------------------------------------------------------------------------------- the stage's step


def baseline_label(P: AcceptParams) -> str:
    """The endpoint every speedup is relative to: ``baseline`` (embedded) or the first endpoint listed."""
    return "baseline" if P.endpoints == "embedded" else P.endpoints[0].label


def probe_endpoints(P: AcceptParams) -> None:
    """Every listed endpoint answers ``/models`` before any work starts (the offline and local steps take
    minutes; a dead endpoint should not wait for them). The embedded ones are started later, by this stage."""
    if P.endpoints != "embedded":
        for e in P.endpoints:
            first_model(e.url, P.api_key())
            if e.rounds and not os.path.isfile(e.rounds):
                raise InputError(f"endpoint {e.label}: its rounds profile {e.rounds} does not exist: start its vLLM "
                                 f"with EAGLE3NB_VLLM_ROUNDS={e.rounds} and the project's plugin (docs/vllm.md), "
                                 f"or set rounds: null")


def run_online(P: AcceptParams) -> list[dict[str, Any]]:
    """Benchmark every endpoint (embedded: the target served plainly, then with the draft at each of ``ks``), one
    row per (endpoint, k, concurrency), with speedups over the baseline at the same concurrency."""
    rows = load_prompts(P.prompts, P.num_prompts)
    extra = {"chat_template_kwargs": P.target_family.template_kwargs(P.thinking, P.thinking_kwarg)}
    kw = dict(prompts=rows, concurrency_levels=P.concurrency_levels, max_tokens=P.max_tokens,
              temperature=P.temperature, extra_body=extra)
    config = {"draft": fingerprint(P.draft_path), "model": P.model_path, "prompts": P.prompts,
              "num_prompts": P.num_prompts, "levels": P.concurrency_levels, "max_tokens": P.max_tokens,
              "temperature": P.temperature, "thinking": P.thinking}
    out: list[dict[str, Any]] = []
    if P.endpoints == "embedded":
        model_dir = P.model_dir
        # the baseline once (it has no k), then one speculative server per k: a server's k is fixed at its start;
        # each labelled with the draft's method
        method = method_of(json.loads((P.draft_path / "config.json").read_text()), str(P.draft_path)).name
        servers = [("baseline", None, None, "online-baseline.json")] + \
            [(method, P.draft_path, k, f"online-{method}-k{k}.json") for k in P.sweep_ks]
        for label, draft, k, name in servers:
            def work(draft=draft, label=label, k=k) -> list[dict[str, Any]]:
                with start_server(model_dir, draft_dir=draft, num_speculative_tokens=k or P.k,
                                  trust_remote_code=P.trust_remote_code) as h:
                    return bench_endpoint(label, h.base_url, api_key="EMPTY", k=k, **kw)
            out += cached_rows(P.stage_dir / name, {**config, "label": label, "k": k}, work)
    else:
        key = P.api_key()
        for e in P.endpoints:
            def work(e=e) -> list[dict[str, Any]]:
                return bench_endpoint(e.label, e.url, api_key=key, model=e.model, metrics=e.metrics_url, k=e.k,
                                      rounds=e.rounds, **kw)
            out += cached_rows(P.stage_dir / f"online-{e.label}.json",
                               {**config, "url": e.url, "k": e.k, "rounds": bool(e.rounds)}, work)
    return add_speedup(out, baseline_label(P))
