"""The acceptance -> speed formulas, in one place (DESIGN.md "Acceptance -> speed").

alpha_i is the *conditional* acceptance of draft position i given positions < i were accepted.
"""

from __future__ import annotations

from collections.abc import Sequence


def tau_iid(a: float, k: int) -> float:
    """Expected tokens per verify step with i.i.d. per-token acceptance ``a`` and ``k`` drafted tokens:
    (1 - a^(k+1)) / (1 - a)."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {a}")
    if a == 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def tau_from_conditional(alphas: Sequence[float]) -> float:
    """Expected tokens per verify step from conditional per-position acceptances:
    1 + sum_i prod_{j<=i} alpha_j (the bonus token from the target always counts)."""
    tau, run = 1.0, 1.0
    for a in alphas:
        run *= float(a)
        tau += run
    return tau


def speedup(tau: float, k: int, cost_ratio: float, overhead: float = 0.0) -> float:
    """Predicted speedup over plain decoding: tau / (1 + k*c + overhead), with c = draft-step cost /
    target-step cost and overhead the verify/bookkeeping cost as a fraction of a target decode step."""
    return tau / (1.0 + k * cost_ratio + overhead)


def acceptance_rate_from_counts(accepted: float, draft_tokens: float) -> float:
    """vLLM's acceptance rate: accepted / drafted tokens (0 when nothing was drafted)."""
    return accepted / draft_tokens if draft_tokens else 0.0


def acceptance_length_from_counts(accepted: float, drafts: float) -> float:
    """vLLM's mean acceptance length: 1 + accepted / drafts (1 when nothing was drafted)."""
    return 1.0 + accepted / drafts if drafts else 1.0
