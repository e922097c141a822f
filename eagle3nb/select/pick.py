"""The pick: the candidate that serves the most at the user's load, never the one that accepts the most.

A candidate's score is the weighted mean of its speedups over the user's concurrencies (the weights: the user's, a
traffic log's, or equal). Speedups, not raw tokens/s: each is the ratio of two measurements made minutes apart on the
same prompts (``measure.pair``), so the machine's drift over the run falls between pairs and cancels within each,
and candidates measured an hour apart compare; raw throughputs at the load are kept beside them (``at_load``) but do
not decide. A candidate with a failed request or an unmeasured level is not picked (said); when none scores above
1x, plain serving is the pick."""

from __future__ import annotations

from typing import Any


def score(result: dict[str, Any], weights: dict[int, float]) -> float | None:
    """The weighted mean speedup of a served candidate (``measure.serve``'s result) over the weighted levels; None
    when it was not served or a level has no speedup (failed requests)."""
    cells = {cell["concurrency"]: cell for cell in result.get("cells") or []}
    if not cells or any(cells.get(c, {}).get("speedup") is None for c, w in weights.items() if w):
        return None
    return sum(w * cells[c]["speedup"] for c, w in weights.items() if w) / sum(w for w in weights.values() if w)


def at_load(result: dict[str, Any], weights: dict[int, float], side: str = "candidate") -> float | None:
    """The weighted mean output tokens/s of ``side`` (candidate or plain) at the load's levels."""
    cells = {cell["concurrency"]: cell for cell in result.get("cells") or []}
    if not cells or any(c not in cells for c, w in weights.items() if w):
        return None
    return sum(w * cells[c][side]["output_tokens_per_s"] for c, w in weights.items() if w) / \
        sum(w for w in weights.values() if w)


def tau_of(result: dict[str, Any]) -> float | None:
    """The candidate's pooled acceptance length (vLLM's), what a pick by tau would go by."""
    return (result.get("tau") or {}).get("pooled")


def choose(results: dict[str, dict[str, Any]], weights: dict[int, float], load: str) -> dict[str, Any]:
    """``{"name", "score", "why", "ranking"}``: the candidate with the highest :func:`score` (None: plain serving,
    when none is above 1x), and the sentence that says why, naming the runner-up and the candidate that accepts
    the most where it is another."""
    scores = {name: s for name, r in results.items() if (s := score(r, weights)) is not None}
    ranking = sorted(scores, key=scores.get, reverse=True)
    levels = ", ".join(f"c={c}" for c, w in weights.items() if w)
    if not ranking or scores[ranking[0]] <= 1.0:
        best = f"; the best, {ranking[0]}, serves {scores[ranking[0]]:.2f}x" if ranking else ""
        return {"name": None, "score": None, "ranking": ranking,
                "why": f"no candidate serves faster than the target alone at the load ({levels}, {load}){best}: "
                       "serve the target plainly"}
    name = ranking[0]
    cells = {cell["concurrency"]: cell["speedup"] for cell in results[name]["cells"]}
    why = (f"picked {name}: {scores[name]:.2f}x at the load, because it serves the most output tokens per second "
           f"there (the mean of its speedups over the plain server measured beside it at {levels}, {load}: "
           + ", ".join(f"c={c} {cells[c]:.2f}x" for c, w in weights.items() if w) + ")")
    if len(ranking) > 1:
        why += f", ahead of {ranking[1]} ({scores[ranking[1]]:.2f}x)"
    taus = {n: t for n, r in results.items() if (t := tau_of(r)) is not None and n in scores}
    if taus and max(taus, key=taus.get) != name and name in taus:
        top = max(taus, key=taus.get)
        why += (f"; {top} accepts more (tau {taus[top]:.2f} against {taus[name]:.2f}) but serves "
                f"{scores[top]:.2f}x: its rounds cost more than the tokens they add")
    return {"name": name, "score": scores[name], "why": why, "ranking": ranking}
