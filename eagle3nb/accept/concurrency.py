"""04's concurrency verdict: up to which concurrency a draft pays, with which k.

From the server sweep's rows (one per endpoint, k and concurrency, each with its ``speedup`` over the baseline at
the same concurrency):

- ``best_k_by_concurrency``: each measured concurrency mapped to the k with the best spec/plain ratio, 0 where
  plain wins (no speculative row at 1x or better).
- the **measured crossover**: the lowest measured concurrency from which plain wins at every higher level.
- the **predicted crossover**, from the engine's own step costs. A plain decode step at batch width ``n`` (tokens in
  the forward) costs ``t(n) = a + b*n``, fitted on the baseline's own levels (a level of concurrency c runs steps
  of width c, each giving one token per request: ``t(c) = c / tokens_per_s(c)``). A speculative round at
  concurrency c verifies ``c*(k+1)`` tokens in one forward and pays the draft and the round's bookkeeping ``D``
  (in units of that level's plain step), so::

      speedup(c, k) = tau / (t(c*(k+1)) / t(c) + D)

  ``D`` is fitted once per series at its lowest measured concurrency (from its measured speedup and served tau),
  then the model predicts every other level. The width term is why speculation stops paying: once the engine is
  compute-bound (``b*n`` dominates ``a``), verifying k+1 tokens per request costs about k+1 plain steps while
  yielding tau < k+1 tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from eagle3nb.accept.forecast import line_fit, predict_profiled, profiled
from eagle3nb.vllm_config import draft_spec

# A predicted crossover is searched up to this concurrency (past the measured levels: a forecast, said so).
MAX_PREDICTED = 256


def series_label(row: dict[str, Any]) -> str:
    """A benchmark row's series (a line in the plots): its endpoint, and its draft length where it has one."""
    return row["endpoint"] if row.get("k") is None else f"{row['endpoint']} k={row['k']}"


def _spec_rows(rows: Sequence[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("endpoint") != baseline and r.get("speedup") is not None]


def best_k_by_concurrency(rows: Sequence[dict[str, Any]], baseline: str) -> dict[str, int]:
    """``{str(concurrency): k}`` over every measured concurrency: the k whose row has the best speedup there, 0 where
    no speculative row reaches 1x (plain wins) or none was measured."""
    levels = sorted({r["concurrency"] for r in rows})
    out = {}
    for c in levels:
        spec = [r for r in _spec_rows(rows, baseline) if r["concurrency"] == c and r.get("k")]
        best = max(spec, key=lambda r: r["speedup"], default=None)
        out[str(c)] = int(best["k"]) if best is not None and best["speedup"] >= 1.0 else 0
    return out


def measured_crossover(best_k: dict[str, int]) -> int | None:
    """The lowest measured concurrency from which plain wins at every higher measured level; None while the draft
    pays at the highest one."""
    levels = sorted(int(c) for c in best_k)
    cross = None
    for c in reversed(levels):
        if best_k[str(c)] != 0:
            break
        cross = c
    return cross


def fit_step_cost(rows: Sequence[dict[str, Any]], baseline: str) -> tuple[float, float] | None:
    """(a, b) of the plain step cost ``t(n) = a + b*n`` seconds, least squares over the baseline's levels; None with
    fewer than two levels (no width to fit). b is kept >= 0 (a forward never gets cheaper with more tokens)."""
    pts = [(r["concurrency"], r["concurrency"] / r["output_tokens_per_s"]) for r in rows
           if r.get("endpoint") == baseline and r.get("output_tokens_per_s")]
    if len({c for c, _ in pts}) < 2:
        return None
    a, b = line_fit(pts)
    if b < 0:
        return sum(t for _, t in pts) / len(pts), 0.0
    return a, b


def width_ratio(cost: tuple[float, float], c: float, k: int) -> float:
    """t(c*(k+1)) / t(c): the verify forward's width over a plain step's at concurrency c."""
    a, b = cost
    return (a + b * c * (k + 1)) / (a + b * c)


def predict_series(rows: Sequence[dict[str, Any]], cost: tuple[float, float], tau: float | None
                   ) -> dict[str, Any] | None:
    """One speculative series' (one endpoint and k) prediction: ``D`` fitted at its lowest measured concurrency,
    the predicted speedup at every measured level beside the measured one, and the predicted crossover (the lowest
    concurrency, up to ``MAX_PREDICTED``, where the prediction falls below 1x; None: it never does)."""
    rows = sorted((r for r in rows if r.get("speedup")), key=lambda r: r["concurrency"])
    if not rows or not rows[0].get("k"):
        return None
    k = int(rows[0]["k"])
    tau_of = {r["concurrency"]: r.get("acceptance_length") or tau for r in rows}
    first = rows[0]
    if not tau_of[first["concurrency"]]:
        return None
    d = tau_of[first["concurrency"]] / first["speedup"] - width_ratio(cost, first["concurrency"], k)
    fitted_tau = tau_of[first["concurrency"]]

    def at(c: float, t: float) -> float:
        return t / (width_ratio(cost, c, k) + d)

    levels = [{"concurrency": r["concurrency"], "measured": r["speedup"],
               "predicted": at(r["concurrency"], tau_of[r["concurrency"]] or fitted_tau)} for r in rows]
    for lv in levels:
        lv["error"] = lv["predicted"] / lv["measured"] - 1
    crossover = next((c for c in range(1, MAX_PREDICTED + 1) if at(c, fitted_tau) < 1.0), None)
    return {"endpoint": first["endpoint"], "k": k, "bookkeeping": d, "fitted_at": first["concurrency"],
            "levels": levels, "predicted_crossover": crossover,
            "max_error": max((abs(lv["error"]) for lv in levels[1:]), default=None)}


def concurrency_verdict(rows: Sequence[dict[str, Any]], baseline: str, tau: float | None = None) -> dict[str, Any]:
    """04's ``metrics.json`` ``concurrency``: the measured crossover, the step-cost fit and each speculative
    series' prediction (``tau``: the offline acceptance length, for rows whose server counts none)."""
    best = best_k_by_concurrency(rows, baseline)
    cost = fit_step_cost(rows, baseline)
    series: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in _spec_rows(rows, baseline):
        if r.get("k"):
            series.setdefault((r["endpoint"], int(r["k"])), []).append(r)
    base = [r for r in rows if r.get("endpoint") == baseline]
    predicted = [p for s in series.values()  # from the engine's profile where both sides have one, else the fit
                 if (p := (profiled(base) and profiled(s) and predict_profiled(base, s, tau, MAX_PREDICTED))
                     or (cost and predict_series(s, cost, tau)))]
    crossings = [p["predicted_crossover"] for p in predicted]
    return {"measured_crossover": measured_crossover(best),
            "predicted_crossover": (None if not predicted or None in crossings else max(crossings)),
            "step_cost": {"a_s": cost[0], "b_s_per_token": cost[1]} if cost else None,
            "series": predicted}


def pareto(rows: Sequence[dict[str, Any]]) -> dict[str, list[tuple[float, float, int]]]:
    """Per series, (total tokens/s, per-request tokens/s, concurrency) by concurrency: the throughput Pareto (a
    level keeps c requests in flight, so each request streams at total / c)."""
    out: dict[str, list[tuple[float, float, int]]] = {}
    for r in rows:
        total = r.get("output_tokens_per_s")
        if total:
            out.setdefault(series_label(r), []).append((total, total / r["concurrency"], r["concurrency"]))
    return {label: sorted(pts, key=lambda p: p[2]) for label, pts in out.items()}


def serve_flags(best_k: dict[str, int], method: str, draft_dir: str) -> dict[str, str | None]:
    """``{str(concurrency): vLLM's --speculative-config flag}`` for the best k at each measured concurrency, None
    where plain serving wins (serve it without the flag)."""
    return {c: (f"--speculative-config '{json.dumps(draft_spec(draft_dir, k, method))}'" if k else None)
            for c, k in best_k.items()}


def plot_pareto(rows: Sequence[dict[str, Any]]):
    """The throughput Pareto: per-request tokens/s against total tokens/s, one line per series (plain and each
    speculative k), each point labelled with its concurrency: up and to the right is better; where a plain point
    lies above and right of every speculative one, plain wins at that load."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for label, pts in pareto(rows).items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        for total, each, c in pts:
            ax.annotate(f"c={c}", (total, each), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="total output tokens / s", ylabel="per-request tokens / s",
           title="Throughput Pareto: each request's speed against the server's")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
