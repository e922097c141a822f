"""The acceptance -> speed formulas, in one place (docs/DESIGN-FACTS.md "Acceptance -> speed").

alpha_i is the *conditional* acceptance of draft position i given positions < i were accepted. vLLM's
speculative-decoding counters (their Prometheus names and the formulas over them) live here too: the embedded
server writes them, 04's benchmark reads them from any engine.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any


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


def draft_passes(k: int, parallel: bool) -> int:
    """Draft forwards per verify round: k for a sequential draft, one for a parallel-drafting (P-EAGLE) draft,
    which proposes all k tokens in one forward."""
    return 1 if parallel else k


def speedup(tau: float, k: int, cost_ratio: float, overhead: float = 0.0, parallel: bool = False) -> float:
    """Predicted speedup over plain decoding: tau / (1 + n*c + overhead), with n the draft forwards per round
    (:func:`draft_passes`), c = draft-step cost / target-step cost and overhead the verify/bookkeeping cost as a
    fraction of a target decode step."""
    return tau / (1.0 + draft_passes(k, parallel) * cost_ratio + overhead)


def acceptance_rate_from_counts(accepted: float, draft_tokens: float) -> float:
    """vLLM's acceptance rate: accepted / drafted tokens (0 when nothing was drafted)."""
    return accepted / draft_tokens if draft_tokens else 0.0


def acceptance_length_from_counts(accepted: float, drafts: float) -> float:
    """vLLM's mean acceptance length: 1 + accepted / drafts (1 when nothing was drafted)."""
    return 1.0 + accepted / drafts if drafts else 1.0


# Acceptance length (tau) two ways, from per-request counts (each request's accepted tokens and its rounds, i.e.
# drafts): users find engines and papers disagree because they average differently (vLLM #42508).

def tau_pooled(accepted: Sequence[float], drafts: Sequence[float]) -> float:
    """vLLM's tau, pooled: 1 + all accepted tokens / all rounds, over every round of every request (a long request
    weighs by its rounds); what its /metrics counters give, and all they can give."""
    return acceptance_length_from_counts(sum(accepted), sum(drafts))


def tau_per_request_mean(accepted: Sequence[float], drafts: Sequence[float]) -> float | None:
    """SpecForge's tau: the mean over requests of each one's own 1 + accepted / rounds (every request weighs the
    same, a short one as a long one); requests with no round are left out, None when none has one."""
    taus = [1.0 + a / d for a, d in zip(accepted, drafts) if d]
    return sum(taus) / len(taus) if taus else None


# ----------------------------------------------------------------------- vLLM's spec-decode counters

VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
SGLANG_ACCEPT_LENGTH = "sglang:spec_accept_length"
SGLANG_ACCEPT_RATE = "sglang:spec_accept_rate"

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')


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
