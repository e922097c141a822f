"""04's prediction: speedup = tau / (1 + n*c + overhead), with n the draft forwards per round (k, or 1 for a
parallel-drafting draft), c = draft step / target step cost and overhead = the extra cost of verifying k+1 tokens
instead of decoding 1 (measured here or given); the formulas live in ``eagle3nb.formulas``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eagle3nb.accept.params import AcceptParams
from eagle3nb.formulas import draft_passes, speedup, tau_from_conditional


def predict(tau: float, k: int, cost_ratio: float, overhead: float, parallel: bool = False) -> dict[str, Any]:
    """The predicted speedup with every term, so the notebook can show the arithmetic (``parallel``: the draft
    proposes all k tokens in one forward)."""
    s = speedup(tau, k, cost_ratio, overhead, parallel)
    n = draft_passes(k, parallel)
    passes = f"{n} draft forward (parallel drafting)" if parallel else f"k = {k} draft forwards"
    return {"tau": tau, "k": k, "cost_ratio": cost_ratio, "overhead": overhead, "speedup": s, "parallel": parallel,
            "formula": f"speedup = tau / (1 + n*c + overhead), n = {passes} per round: {tau:.3f} / (1 + {n}*"
                       f"{cost_ratio:.3f} + {overhead:.3f}) = {s:.3f}"}


def speedup_by_k(alpha_by_position: Sequence[float], cost_ratio: float, overhead: float,
                 parallel: bool = False) -> list[float]:
    """Predicted speedup for k = 1..K from the conditional alphas (the overhead is taken as independent of k)."""
    return [speedup(tau_from_conditional(alpha_by_position[:k]), k, cost_ratio, overhead, parallel)
            for k in range(1, len(alpha_by_position) + 1)]


def prediction(P: AcceptParams, offline: dict[str, Any], local: dict[str, Any] | None,
               parallel: bool = False) -> dict[str, Any]:
    """The predicted speedup at k from the offline tau and the given or measured costs (``parallel``: a
    parallel-drafting draft, one draft forward per round)."""
    costs = (local or {}).get("costs") or {}
    c = P.cost_ratio if P.cost_ratio is not None else costs["cost_ratio"]
    o = P.overhead if P.overhead is not None else costs["overhead"]
    out = predict(offline["acceptance_length"], P.k, c, o, parallel)
    out["costs_from"] = "given" if P.cost_ratio is not None and P.overhead is not None else "measured here"
    return out
