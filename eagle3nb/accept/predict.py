"""04's prediction: speedup = tau / (1 + n*c + overhead), with n the draft forwards per round (k, or 1 for a
parallel-drafting draft), c = draft step / target step cost and overhead = everything else a round costs beyond
one target decode step (measured here from real rounds, or given); the formulas live in ``eagle3nb.formulas``.

Why the overhead is read from real rounds (docs/benchmarks.md "The speedup model"): timing only the forwards
(a verify pass of k+1 tokens against a 1-token decode, one draft forward) leaves out what a round does besides
them: the draft's fuse, its attention masks and cache bookkeeping, the target's padded cache and masks,
acceptance. On the demo the forward-only prediction said 2.54x where the server measured 1.38x; on the smoke run
that part was 0.39 of a decode step beside the verify forward's 0.35."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eagle3nb.accept.params import AcceptParams
from eagle3nb.formulas import draft_passes, speedup, tau_from_conditional


def round_costs(local: dict[str, Any], forward: dict[str, Any], k: int, parallel: bool = False) -> dict[str, Any]:
    """The costs the prediction charges, from decoding here (``local``: ``compare_with_plain``'s result) and the
    timed forwards (``forward``: ``measure_costs``). A round costs ``round_cost`` = tau x plain tokens/s /
    speculative tokens/s plain decode steps, all included (the two decodings timed on the same prompts); c is one
    draft forward over one target step, and the overhead is the rest of the round: ``round_cost - 1 - n*c``, of
    which ``verify_overhead`` (the verify forward's extra width) is the forwards' part and ``bookkeeping`` the
    remainder. Then the prediction at the local tau is the local speedup, by construction."""
    n, c = draft_passes(k, parallel), forward["cost_ratio"]
    rounds = local["acceptance_length"] * local["plain_tokens_per_s"] / local["spec_tokens_per_s"]
    overhead = max(0.0, rounds - 1.0 - n * c)
    return {**forward, "round_cost": rounds, "verify_overhead": forward["overhead"], "overhead": overhead,
            "bookkeeping": overhead - forward["overhead"]}


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
    if "round_cost" in costs and P.overhead is None:
        out["round_cost"] = costs["round_cost"]
        out["costs"] = (f"a round here costs {costs['round_cost']:.2f} plain decode steps: 1 target step, "
                        f"{draft_passes(P.k, parallel)} draft forward(s) of {c:.3f}, the verify pass's extra width "
                        f"{costs['verify_overhead']:.3f} and {costs['bookkeeping']:.3f} of bookkeeping (masks, caches, "
                        f"acceptance); timing the forwards alone would predict "
                        f"{speedup(out['tau'], P.k, c, costs['verify_overhead'], parallel):.2f}x")
    return out
