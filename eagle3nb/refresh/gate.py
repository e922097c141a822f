"""The gate a refreshed draft passes before it ships (docs/refresh.md, "What the gate guarantees").

Its input: per group of traffic, the current draft's acceptance length on each held-out request and each seed's
refreshed draft's on the same requests. Its rules, so that what ships is what was judged and a gain is a gain:

1. **Choosing is not judging.** With several seeds, a group's held-out requests alternate (in their hashed order)
   between a choosing half and a judging half. The seed whose traffic-weighted speedup is highest on the choosing
   halves is the draft that would ship; only the judging halves judge it. With one seed nothing is chosen and every
   held-out request judges.
2. **A group falls when its drop is significant.** Over the group's n judging requests, the paired differences
   d = new - old have a mean and a standard error SE = sd(d) / sqrt(n). The group falls when the one-sided
   ``1 - drop_alpha`` upper bound, mean + t(1 - drop_alpha, n - 1) * SE, is below 0.
3. **A group too small is not judged.** Fewer than ``min_requests`` judging requests: the group is reported as not
   judged (with its share), takes no part in rules 2 and 4, and the draft ships only if the groups not judged
   carry at most ``unjudged_share`` of the traffic.
4. **The overall gain must exceed its own noise.** The traffic-weighted expected speedup is linear in each group's
   acceptance length (``formulas.speedup``: tau / D), so its gain is sum_g w_g mean_g / D, with standard error
   sqrt(sum_g w_g^2 SE_g^2) / D (w_g: the judged groups' shares, renormalised). The draft ships only if the
   one-sided ``1 - alpha`` lower bound of that gain (Welch-Satterthwaite degrees of freedom) is above 0.

Decoding is at T=0, so a draft's score on a request is fixed: the noise is which requests were held out, and the
paired difference on the same requests is what measures it. Which seed was trained only matters through rule 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist

from eagle3nb.formulas import speedup

ALPHA = 0.025  # the overall gain's one-sided bound (the lower end of its two-sided 95% interval): a refresh
# that changes nothing ships in about 2.5% of refreshes
DROP_ALPHA = 0.10  # a group's drop: refused when significant at 10% one-sided (a 3-SE drop is caught ~95%)
MIN_REQUESTS = 4  # judging requests a group needs to be judged (a t bound on fewer has under 3 degrees of freedom)
UNJUDGED_SHARE = 0.05  # the traffic the groups not judged may carry and the draft still ship


@dataclass
class GroupScores:
    """One group's held-out acceptance lengths: per request for the current draft, and per request for each seed of
    the refreshed draft (the same requests, in the same order), with the group's share of traffic."""

    name: str
    share: float
    before: list[float]
    after: list[list[float]]

    def __post_init__(self) -> None:
        if not self.after or any(len(a) != len(self.before) for a in self.after):
            raise ValueError(f"group {self.name}: 'after' needs, for each seed, one value per request of 'before' "
                             f"({len(self.before)})")


@dataclass
class GroupVerdict:
    """One group judged: ``status`` is "held", "fell" or "not judged"; the numbers are over its judging requests
    (``requests`` of them) for the chosen seed; ``upper`` is the one-sided upper bound of the change."""

    name: str
    share: float
    requests: int
    before: float | None
    after: float | None
    change: float | None
    se: float | None
    upper: float | None
    status: str

    @property
    def passed(self) -> bool:
        return self.status != "fell"


@dataclass
class Verdict:
    groups: list[GroupVerdict]
    seed: int  # index into the seeds: the draft that ships when ``ship``
    speedup_before: float | None  # None when no group was judged
    speedup_after: float | None
    gain_lower: float | None  # the one-sided lower bound of the traffic-weighted speedup gain
    ship: bool
    reason: str
    rules: dict = field(default_factory=dict)


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile (exact for 1 and 2 degrees of freedom, else the Cornish-Fisher series in the normal
    quantile: within 1e-3 from 3 degrees of freedom), so the gate needs no scipy."""
    if df <= 1:
        return math.tan(math.pi * (p - 0.5))
    if df <= 2:
        return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
    z = NormalDist().inv_cdf(p)
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
            + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * df**4))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _var(xs: list[float]) -> float:
    m = _mean(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def halves(n: int, seeds: int) -> tuple[list[int], list[int]]:
    """(choosing, judging) positions of a group's n held-out requests: alternating with several seeds (the judging
    half takes the odd one), all judging with one."""
    if seeds == 1:
        return [], list(range(n))
    return list(range(1, n, 2)), list(range(0, n, 2))


def choose(groups: list[GroupScores], denom: float) -> int:
    """The seed with the highest traffic-weighted speedup on the choosing halves (the first on a tie)."""
    seeds = len(groups[0].after)
    if seeds == 1:
        return 0

    def score(s: int) -> float:
        total = 0.0
        for g in groups:
            pos = halves(len(g.before), seeds)[0]
            if pos:
                total += g.share * _mean([g.after[s][i] for i in pos]) / denom
        return total

    return max(range(seeds), key=lambda s: (score(s), -s))


def judge_group(g: GroupScores, seed: int, drop_alpha: float = DROP_ALPHA,
                min_requests: int = MIN_REQUESTS) -> GroupVerdict:
    """Rules 2 and 3 for one group and the chosen seed, on its judging requests."""
    pos = halves(len(g.before), len(g.after))[1]
    before = [g.before[i] for i in pos]
    after = [g.after[seed][i] for i in pos]
    if len(pos) < min_requests:
        return GroupVerdict(g.name, g.share, len(pos), _mean(before) if pos else None,
                            _mean(after) if pos else None, None, None, None, "not judged")
    diffs = [a - b for a, b in zip(after, before)]
    change, se = _mean(diffs), math.sqrt(_var(diffs) / len(diffs))
    upper = change + t_quantile(1 - drop_alpha, len(diffs) - 1) * se
    return GroupVerdict(g.name, g.share, len(pos), _mean(before), _mean(after), change, se, upper,
                        "fell" if upper < 0 else "held")


def judge(groups: list[GroupScores], k: int, cost_ratio: float, overhead: float = 0.0, parallel: bool = False, *,
          alpha: float = ALPHA, drop_alpha: float = DROP_ALPHA, min_requests: int = MIN_REQUESTS,
          unjudged_share: float = UNJUDGED_SHARE) -> Verdict:
    """Ship or not (the module's rules 1-4); speedups are ``formulas.speedup`` of the judged groups' mean acceptance
    lengths on their judging requests, weighted by their shares."""
    if not groups:
        raise ValueError("the gate needs at least one group of held-out requests")
    denom = 1.0 / speedup(1.0, k, cost_ratio, overhead, parallel)  # D: speedup = tau / D
    seed = choose(groups, denom)
    verdicts = [judge_group(g, seed, drop_alpha, min_requests) for g in groups]
    judged = [v for v in verdicts if v.status != "not judged"]
    total = sum(g.share for g in groups)
    unjudged = sum(v.share for v in verdicts if v.status == "not judged") / total
    rules = {"alpha": alpha, "drop_alpha": drop_alpha, "min_requests": min_requests,
             "unjudged_share": unjudged_share, "chosen_on": "the other half" if len(groups[0].after) > 1 else None}
    if not judged:
        return Verdict(verdicts, seed, None, None, None, False,
                       f"refused: no group has {min_requests} judging requests; sample more per group "
                       "(per_group) or fewer groups", rules)
    w = {v.name: v.share / sum(j.share for j in judged) for v in judged}
    before = sum(w[v.name] * v.before for v in judged) / denom
    after = sum(w[v.name] * v.after for v in judged) / denom
    a = [(w[v.name] * v.se / denom) ** 2 for v in judged]
    se = math.sqrt(sum(a))
    df = sum(a) ** 2 / sum(x**2 / (v.requests - 1) for x, v in zip(a, judged)) if se > 0 else math.inf
    lower = after - before - (t_quantile(1 - alpha, df) * se if se > 0 else 0.0)
    fallen = [v for v in verdicts if v.status == "fell"]
    left_out = [v.name for v in verdicts if v.status == "not judged"]
    note = (f"; not judged (under {min_requests} judging requests): {', '.join(left_out)}, {unjudged:.0%} of the "
            "traffic") if left_out else ""
    if fallen:
        worst = min(fallen, key=lambda v: v.upper)
        reason = (f"refused: {', '.join(v.name for v in fallen)} fell significantly (worst {worst.name}: "
                  f"{worst.before:.2f} -> {worst.after:.2f}, upper bound of the change {worst.upper:+.3f}){note}")
    elif unjudged > unjudged_share:
        reason = (f"refused: groups not judged carry {unjudged:.0%} of the traffic (over {unjudged_share:.0%}); "
                  f"sample more per group (per_group){note}")
    elif lower <= 0:
        reason = (f"refused: the traffic-weighted speedup gain does not exceed its noise ({before:.3f}x -> "
                  f"{after:.3f}x, lower bound {lower:+.3f}x){note}")
    else:
        reason = (f"ship: no group fell significantly and the traffic-weighted speedup rose {before:.3f}x -> "
                  f"{after:.3f}x (lower bound of the gain {lower:+.3f}x){note}")
    return Verdict(verdicts, seed, before, after, lower, reason.startswith("ship"), reason, rules)
