"""The served A/B: the current draft and the refreshed one, each served by the real vLLM beside the target, on the
weak group's held-out requests. The gate decides on local decoding (this machine, every group, every seed); this
says whether the gain survives serving: acceptance as vLLM itself counts it (its spec-decode counters on
``/metrics``, read as 04's benchmark reads them), at T=0, one request at a time."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from eagle3nb.accept.cache import cached, fingerprint
from eagle3nb.drafts import served_method
from eagle3nb.refresh.params import RefreshParams
from eagle3nb.serve.vllm import start_vllm

KEPT = ("acceptance_length", "acceptance_rate", "output_tokens", "output_tokens_per_s", "errors")


def served_ab(P: RefreshParams, group: str, rows: list[dict], drafts: dict[str, Path], path: Path) -> dict[str, Any]:
    """``{"group", "requests", <name>: {acceptance_length, acceptance_rate, output tokens and tokens/s, errors}}``
    for each draft of ``drafts`` (name -> folder), served side by side (both servers start at once); cached at
    ``path`` per the drafts' fingerprints and the requests."""
    config = {"drafts": {n: fingerprint(d) for n, d in drafts.items()}, "model": P.model_path, "k": P.k,
              "max_tokens": P.max_tokens, "requests": [r["id"] for r in rows]}
    return cached(path, config, lambda: {"group": group, "requests": len(rows), **_measure(P, rows, drafts)})


def _measure(P: RefreshParams, rows: list[dict], drafts: dict[str, Path]) -> dict[str, dict[str, Any]]:
    from eagle3nb.accept.online import bench_endpoint

    tools = any(r.get("tools") for r in rows)  # each draft served as the method it was trained with
    with ThreadPoolExecutor(len(drafts)) as pool:
        starts = {n: pool.submit(start_vllm, P.model_path, served_method(d), draft_dir=d, num_speculative_tokens=P.k,
                                 family=P.family, tools=tools) for n, d in drafts.items()}
    handles = {n: f.result() for n, f in starts.items() if f.exception() is None}
    try:
        failed = [f.exception() for f in starts.values() if f.exception() is not None]
        if failed:
            raise failed[0]
        out = {}
        for n, h in handles.items():
            row = bench_endpoint(n, h.base_url, rows, [1], P.max_tokens, k=P.k, warmup=0)[0]
            out[n] = {k: row[k] for k in KEPT}
        return out
    finally:
        for h in handles.values():
            h.stop()
