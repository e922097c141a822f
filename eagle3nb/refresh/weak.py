"""Where the current draft is weak: its acceptance per request of served traffic, grouped, and the groups ranked by
the speedup the traffic loses to them.

A group's loss is what the whole traffic would gain if that group alone accepted as well as the rest of the traffic
does on average: its share times the difference in expected speedup (``formulas.speedup``). A rare group that
accepts little loses less than a common one that accepts a bit less, which is the order a refresh should spend its
budget in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from eagle3nb.formulas import speedup


def per_request(decoder, template, rows: Sequence[dict], max_tokens: int, eos: Sequence[int],
                seed: int = 0) -> dict[str, list[float]]:
    """Each row's acceptance length decoded here speculatively at T=0 (the target verifying the draft, so the
    number is what serving would count), listed by the row's ``group`` in row order."""
    import torch

    out: dict[str, list[float]] = {}
    for i, row in enumerate(rows):
        ids = template.prompt_ids(row["messages"], row.get("tools"))
        res = decoder.generate(ids, max_tokens, 0.0, eos, torch.Generator().manual_seed(seed + i))
        out.setdefault(row["group"], []).append(res.counters.summary()["acceptance_length"])
    return out


@dataclass
class WeakGroup:
    name: str
    share: float
    requests: int
    acceptance_length: float
    speedup: float
    speedup_lost: float


def rank(by_group: dict[str, list[float]], shares: dict[str, float], k: int, cost_ratio: float,
         overhead: float = 0.0, parallel: bool = False) -> list[WeakGroup]:
    """The measured groups, the one costing the traffic most speedup first. ``shares``: each group's share of all
    traffic (``Traffic.shares``), renormalised over the groups measured."""
    taus = {g: sum(v) / len(v) for g, v in by_group.items() if v}
    total = sum(shares[g] for g in taus)
    out = []
    for g, tau in taus.items():
        share = shares[g] / total
        rest = [(shares[o] / total, t) for o, t in taus.items() if o != g]
        ref = sum(s * t for s, t in rest) / sum(s for s, _ in rest) if rest else tau
        s_g = speedup(tau, k, cost_ratio, overhead, parallel)
        lost = share * max(0.0, speedup(ref, k, cost_ratio, overhead, parallel) - s_g)
        out.append(WeakGroup(g, share, len(by_group[g]), tau, s_g, lost))
    return sorted(out, key=lambda w: (-w.speedup_lost, w.name))


def table(groups: list[WeakGroup]) -> list[dict[str, Any]]:
    """Rows for the report: group, share of traffic, requests measured, acceptance length, speedup, speedup lost."""
    return [{"group": w.name, "share": round(w.share, 4), "requests": w.requests,
             "acceptance_length": round(w.acceptance_length, 3), "speedup": round(w.speedup, 3),
             "speedup_lost": round(w.speedup_lost, 4)} for w in groups]
