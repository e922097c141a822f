"""What the selection measured, as ``metrics.json`` carries it: one row per candidate, every one (served, refused by
the engine, left out by the budget), and the plain server's rate at each level over all its pairs (its spread is the
machine's drift over the run)."""

from __future__ import annotations

import statistics
from typing import Any

from eagle3nb.select.candidates import Plan
from eagle3nb.select.pick import at_load, score

# The fields of a benchmark row a cell keeps per side in metrics.json (the cell files keep the whole rows)
KEPT = ("output_tokens_per_s", "requests_per_s", "latency_p50_s", "acceptance_length", "errors")


def plain_levels(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per level (its concurrency as a string key), the plain server's output tokens/s over every pair: the values,
    mean, min, max, and its requests/s mean (what Little's law reads)."""
    by: dict[int, list[dict[str, Any]]] = {}
    for r in results.values():
        for cell in r.get("cells") or []:
            by.setdefault(cell["concurrency"], []).append(cell["plain"])
    out = {}
    for c, rows in sorted(by.items()):
        tps = [row["output_tokens_per_s"] for row in rows]
        out[str(c)] = {"output_tokens_per_s": tps, "mean": statistics.mean(tps), "min": min(tps), "max": max(tps),
                       "requests_per_s": statistics.mean(row["requests_per_s"] for row in rows)}
    return out


def spread(plain: dict[str, dict[str, Any]]) -> float | None:
    """The largest relative range of the plain server's rate at one level over the run ((max - min) / mean)."""
    return max(((v["max"] - v["min"]) / v["mean"] for v in plain.values() if v["mean"]), default=None)


def status(result: dict[str, Any], picked: bool) -> tuple[str, str | None]:
    """(status, why) of one candidate: picked, served, refused (the engine's reason), not trained (why), or failed
    requests (the first error)."""
    if "skipped" in result:
        return "not trained", result["skipped"]
    if "refused" in result:
        return "refused", result["refused"]
    failed = [cell for cell in result["cells"] if cell["errors"]]
    if failed:
        side = failed[0]["candidate"] if failed[0]["candidate"]["errors"] else failed[0]["plain"]
        return "failed requests", f"{failed[0]['errors']} request(s) failed at c={failed[0]['concurrency']}: " \
                                  f"{side.get('first_error')}"
    return ("picked" if picked else "served"), None


def candidate_rows(plan: Plan, costs: dict[str, dict[str, Any]], results: dict[str, dict[str, Any]],
                   weights: dict[int, float], picked: str | None) -> list[dict[str, Any]]:
    """One row per candidate in the plan's order: name, method, k, status and why, the training it shares and its
    cost, its acceptance length both ways, its score and throughput at the load, and each cell (the speedup, both
    sides' rates, vLLM's pooled tau at that level, the round's parts)."""
    rows = []
    for cand in plan.candidates:
        r = results[cand.name]
        state, why = status(r, cand.name == picked)
        cells = [{"concurrency": cell["concurrency"], "speedup": cell["speedup"], "round": cell["round"],
                  "plain": {k: cell["plain"].get(k) for k in KEPT}, "candidate": {k: cell["candidate"].get(k)
                                                                                   for k in KEPT}}
                 for cell in r.get("cells") or []]
        cost = costs.get(cand.training) if cand.training else None
        rows.append({"name": cand.name, "method": cand.method, "k": cand.k, "status": state, "reason": why,
                     "training": cand.training, "shares_training_with": [n for n in (plan.trainings[cand.training]
                                                                         .candidates if cand.training else [])
                                                                        if n != cand.name],
                     "draft": str(cand.draft) if cand.draft else (cost or {}).get("draft"),
                     "cost": None if cost is None or "skipped" in cost or "refused" in cost else cost,
                     "tau": r.get("tau"), "score": score(r, weights), "at_load": at_load(r, weights),
                     "cells": cells})
    return rows
