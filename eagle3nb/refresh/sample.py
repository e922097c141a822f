"""Which traffic requests judge and which may become refresh data: a split per group (so every group is judged),
and the refresh budget shared among the groups by the speedup each loses."""

from __future__ import annotations

import hashlib
import math

from eagle3nb.refresh.gate import MIN_REQUESTS


def split(rows: list[dict], seeds: int) -> tuple[list[dict], list[dict]]:
    """(held out, pool): within each group, in the order of a hash of the request's id (the same on a re-run),
    half held out to measure and judge, and at least what the gate needs to judge the group (``MIN_REQUESTS``
    judging requests, twice that with several seeds, whose choosing half takes the rest) while the group has
    them; the pool keeps the rest."""
    by_group: dict[str, list[dict]] = {}
    for r in rows:
        by_group.setdefault(r["group"], []).append(r)
    need = MIN_REQUESTS * (2 if seeds > 1 else 1)
    held, pool = [], []
    for g in sorted(by_group):
        group = sorted(by_group[g], key=lambda r: hashlib.sha256(str(r["id"]).encode()).hexdigest())
        k = min(len(group), max(math.ceil(len(group) / 2), need))
        held += group[:k]
        pool += group[k:]
    return held, pool


def allocate(loss: dict[str, float], pool: list[dict], budget: int) -> list[dict]:
    """Up to ``budget`` rows of ``pool``, shared among the groups in proportion to the speedup each loses (all
    groups alike when none loses any); what a group cannot fill goes to the others, in the same proportions."""
    by_group: dict[str, list[dict]] = {}
    for r in pool:
        by_group.setdefault(r["group"], []).append(r)
    weights = {g: loss.get(g, 0.0) for g in by_group}
    if not any(weights.values()):
        weights = dict.fromkeys(by_group, 1.0)
    take = dict.fromkeys(by_group, 0)
    left = min(budget, sum(len(v) for g, v in by_group.items() if weights[g] > 0))
    while left > 0:
        open_ = {g: w for g, w in weights.items() if w > 0 and take[g] < len(by_group[g])}
        total = sum(open_.values())
        shares = {g: max(1, int(left * w / total)) for g, w in open_.items()}
        for g in sorted(open_, key=lambda g: -open_[g]):
            n = min(shares[g], len(by_group[g]) - take[g], left)
            take[g] += n
            left -= n
    return [r for g in sorted(by_group) for r in by_group[g][: take[g]]]


def count(rows: list[dict]) -> dict[str, int]:
    """Rows per group, by group name."""
    out: dict[str, int] = {}
    for r in rows:
        out[r["group"]] = out.get(r["group"], 0) + 1
    return dict(sorted(out.items()))
