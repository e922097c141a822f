"""The gate a refreshed draft passes before it ships: no group of traffic worse, and the traffic-weighted speedup up.

A refresh trains toward the groups where the current draft is weak; it can pay for that elsewhere (a draft
fine-tuned on arithmetic alone forgets the rest). So the new draft ships only if, on held-out requests of every
group, its acceptance length is not below the current draft's beyond the noise, and the speedup expected over the
traffic as it comes (each group weighted by its share of requests) rises.

The noise of one group is the larger of
- the seed spread: the range of the group's mean over the refreshed drafts trained with different seeds (what a
  retrain alone moves), and
- twice the standard error of the paired per-request difference (new minus old on the same requests: what the
  choice of held-out requests alone moves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from eagle3nb.formulas import speedup


@dataclass
class GroupScores:
    """One group's held-out acceptance lengths: per request for the current draft, and per request for each seed of
    the refreshed draft (the same requests, in the same order), with the group's share of traffic."""

    name: str
    share: float
    before: list[float]
    after: list[list[float]]

    def __post_init__(self) -> None:
        if not self.before or not self.after or any(len(a) != len(self.before) for a in self.after):
            raise ValueError(f"group {self.name}: 'after' needs, for each seed, one value per request of 'before' "
                             f"({len(self.before)})")


@dataclass
class GroupVerdict:
    name: str
    share: float
    requests: int
    before: float
    after: float
    change: float
    noise: float
    passed: bool


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def judge_group(g: GroupScores) -> GroupVerdict:
    """Mean acceptance before and after (after: over seeds), the group's noise, and whether it held."""
    seed_means = [_mean(a) for a in g.after]
    after = _mean(seed_means)
    before = _mean(g.before)
    diffs = [_mean([a[i] for a in g.after]) - b for i, b in enumerate(g.before)]
    n = len(diffs)
    sd = math.sqrt(sum((d - _mean(diffs)) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0
    noise = max(max(seed_means) - min(seed_means), 2 * sd / math.sqrt(n))
    return GroupVerdict(g.name, g.share, n, before, after, after - before, noise, after >= before - noise)


@dataclass
class Verdict:
    groups: list[GroupVerdict]
    speedup_before: float
    speedup_after: float
    ship: bool
    reason: str


def judge(groups: list[GroupScores], k: int, cost_ratio: float, overhead: float = 0.0,
          parallel: bool = False) -> Verdict:
    """Ship or not: every group held (:func:`judge_group`) and the traffic-weighted expected speedup rose
    (``formulas.speedup`` of each group's mean acceptance length, weighted by its share)."""
    if not groups:
        raise ValueError("the gate needs at least one group of held-out requests")
    verdicts = [judge_group(g) for g in groups]
    total = sum(v.share for v in verdicts)

    def weighted(attr: str) -> float:
        return sum(v.share * speedup(getattr(v, attr), k, cost_ratio, overhead, parallel) for v in verdicts) / total

    before, after = weighted("before"), weighted("after")
    fallen = [v for v in verdicts if not v.passed]
    if fallen:
        worst = min(fallen, key=lambda v: v.change)
        reason = (f"refused: {', '.join(v.name for v in fallen)} fell beyond the noise (worst {worst.name}: "
                  f"{worst.before:.2f} -> {worst.after:.2f}, noise {worst.noise:.2f}); the current draft stays")
    elif after <= before:
        reason = (f"refused: no group fell, but the traffic-weighted speedup did not rise ({before:.3f}x -> "
                  f"{after:.3f}x); the current draft stays")
    else:
        reason = (f"ship: no group fell beyond the noise and the traffic-weighted speedup rose {before:.3f}x -> "
                  f"{after:.3f}x")
    return Verdict(verdicts, before, after, not fallen and after > before, reason)
