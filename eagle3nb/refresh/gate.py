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
3. **A group too small is not judged, and still counts.** Every group of the traffic is given, those left with no
   held-out request included (``read_traffic`` keeps a repeated prompt once across groups, so a group whose sampled
   requests all repeat another group's has none); the shares are of all traffic read and sum to 1. A group with
   fewer than ``min_requests`` judging requests (none at all included) is reported as not judged, with its share
   and why; it takes no part in rules 2 and 4, and the draft ships only if the groups not judged carry at most
   ``unjudged_share`` of all the traffic.
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
from functools import lru_cache
from statistics import NormalDist

from eagle3nb.formulas import speedup

ALPHA = 0.025  # the overall gain's one-sided bound (the lower end of its two-sided 95% interval): a refresh
# that changes nothing ships in about 2.5% of refreshes
DROP_ALPHA = 0.10  # a group's drop: refused when significant at 10% one-sided (a 3-SE drop is caught ~95%)
MIN_REQUESTS = 4  # judging requests a group needs to be judged (a t bound on fewer has under 3 degrees of freedom)
UNJUDGED_SHARE = 0.05  # the traffic the groups not judged may carry and the draft still ship
NO_REQUESTS = "no held-out requests after de-duplication"  # why a group with no held-out request is not judged


@dataclass
class GroupScores:
    """One group's held-out acceptance lengths: per request for the current draft, and per request for each seed of
    the refreshed draft (the same requests, in the same order), with the group's share of all traffic read. A group
    the traffic had but with no held-out request (all its sampled requests repeat another group's) comes with empty
    lists, one per seed: it must still be counted."""

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
    """One group judged: ``status`` is "held", "fell" or "not judged" (``why``: ``NO_REQUESTS`` or "under
    <min_requests> judging requests"); the numbers are over its judging requests (``requests`` of them) for the
    chosen seed; ``upper`` is the one-sided upper bound of the change."""

    name: str
    share: float
    requests: int
    before: float | None
    after: float | None
    change: float | None
    se: float | None
    upper: float | None
    status: str
    why: str | None = None  # why a group is not judged; None when it is

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

    def as_metrics(self) -> dict:
        """The gate's part of 05's ``metrics.json`` (what the report's gate table reads): every group of the
        traffic, with its share, status and why it is not judged."""
        return {"ship": self.ship, "reason": self.reason, "speedup_before": self.speedup_before,
                "speedup_after": self.speedup_after, "gain_lower": self.gain_lower, "rules": self.rules,
                "groups": [{**vars(g), "passed": g.passed} for g in self.groups]}


SERIES_DF = 1e5  # from here on t_quantile takes the Cornish-Fisher series: under 1e-13 off, where the incomplete
# beta's lgamma terms lose digits to cancellation


@lru_cache(maxsize=4096)  # the gate asks the same few (p, n - 1) again and again
def t_quantile(p: float, df: float) -> float:
    """Student's t quantile for any real ``df`` > 0 (the Welch-Satterthwaite df of rule 4 is fractional), with no
    scipy: P(T > t) = I_x(df/2, 1/2) / 2 at x = df / (df + t^2) (the regularized incomplete beta, by its continued
    fraction), solved for t by Newton's method on log t inside a shrinking bracket; above ``SERIES_DF`` the
    Cornish-Fisher series in the normal quantile; df = inf the normal quantile. Within 1e-10 of the
    exact quantile relative to max(1, |t|) (tests/test_gate.py holds it to an mpmath table over fractional and large
    df); a quantile beyond a float's range (df far below 1) is refused."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"t_quantile: p {p!r} must lie strictly between 0 and 1")
    if not df > 0:
        raise ValueError(f"t_quantile: df {df!r} must be a number above 0 (degrees of freedom)")
    if p == 0.5:
        return 0.0
    tail = 1.0 - p if p > 0.5 else p  # exact in floats for p in [0.5, 1)
    sign = 1.0 if p > 0.5 else -1.0
    z = -NormalDist().inv_cdf(tail)  # the upper-tail normal quantile, precise for tails down to 1e-300
    if df == math.inf:
        return sign * z
    if df > SERIES_DF:
        w = 1 / df
        return sign * (z + w * ((z**3 + z) / 4 + w * ((5 * z**5 + 16 * z**3 + 3 * z) / 96
                       + w * ((3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
                              + w * (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160))))
    u = _t_log_upper(tail, df, z)
    if u > 709.0:  # exp overflows a float
        raise ValueError(f"t_quantile: the {p} quantile at df {df} is beyond a float's range (over 1e308)")
    return sign * math.exp(u)


def _t_log_upper(tail: float, df: float, z: float) -> float:
    """log t for P(T > t) = ``tail`` (< 1/2), df <= SERIES_DF: Newton on log t from the tail's leading term (where
    I_x(a, b) ~ x^a / (a B(a, b)) puts it in the tail) or the normal quantile ``z``; a step leaving the bracket
    the iterates have built is replaced by its midpoint (or a unit step while one side is open)."""
    lb = _log_beta_half(df / 2)
    lx = (math.log(df * tail) + lb) * 2 / df  # log x of the leading term
    u = 0.5 * (math.log(df) + math.log(-math.expm1(lx)) - lx) if lx < math.log(0.5) else math.log(z)
    lo, hi, lq = -math.inf, math.inf, math.log(tail)
    for _ in range(400):
        log_sf, log_tf = _t_log_tail(u, df, lb)
        g = log_sf - lq
        if abs(g) <= 1e-15:
            return u
        lo, hi = (u, hi) if g > 0 else (lo, u)
        step = u + g * math.exp(log_sf - log_tf)  # d log sf / d log t = -t f(t) / sf
        if not lo < step < hi:
            step = (lo + hi) / 2 if math.isfinite(lo) and math.isfinite(hi) else u + (1.0 if g > 0 else -1.0)
        if abs(step - u) <= 1e-15 * max(1.0, abs(u)):
            return step
        u = step
    raise ArithmeticError(f"t_quantile: no convergence for tail {tail} at df {df}")


def _t_log_tail(u: float, df: float, lb: float) -> tuple[float, float]:
    """(log P(T > t), log(t * pdf(t))) at t = e^u, in logs so that heavy tails (t up to 1e308) neither overflow nor
    underflow; ``lb`` = log B(df/2, 1/2)."""
    a, b = df / 2, 0.5
    lr = 2 * u - math.log(df)  # log(t^2 / df)
    l1 = lr + math.log1p(math.exp(-lr)) if lr > 0 else math.log1p(math.exp(lr))  # log(1 + t^2 / df)
    lx, ly = -l1, lr - l1  # log x, log(1 - x), x = df / (df + t^2)
    x, y = math.exp(lx), math.exp(ly)
    if x < (a + 1) / (a + b + 2):  # where the continued fraction of I_x(a, b) converges fast
        log_sf = math.log(0.5) + a * lx + b * ly - lb + math.log(_beta_fraction(x, a, b) / a)
    else:  # I_x(a, b) = 1 - I_(1-x)(b, a)
        log_sf = math.log(0.5 - 0.5 * math.exp(b * ly + a * lx - lb) * _beta_fraction(y, b, a) / b)
    return log_sf, u - (df + 1) / 2 * l1 - 0.5 * math.log(df) - lb


def _beta_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of I_x(a, b) = x^a (1-x)^b / (a B(a, b)) * fraction (DLMF 8.17.22), by the modified
    Lentz method."""
    tiny = 1e-300  # stands in for a zero denominator
    d = 1.0 - (a + b) * x / (a + 1.0)
    c, d = 1.0, 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 100_000):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            return h
    raise ArithmeticError(f"t_quantile: the incomplete beta's fraction did not converge (x {x}, a {a}, b {b})")


def _log_beta_half(a: float) -> float:
    """log B(a, 1/2); from a = 10 with log Gamma(a + 1/2) - log Gamma(a) from Stirling's series, term by term, so
    that a large a loses no digits to the difference of two large lgammas."""
    if a < 10:
        return math.lgamma(a) + math.lgamma(0.5) - math.lgamma(a + 0.5)

    def stirling(v: float) -> float:  # log Gamma(v) - ((v - 1/2) log v - v + log(2 pi) / 2), to 1e-12 from v = 10
        return 1 / (12 * v) - 1 / (360 * v**3) + 1 / (1260 * v**5) - 1 / (1680 * v**7)

    ratio = a * math.log1p(0.5 / a) - 0.5 + 0.5 * math.log(a) + stirling(a + 0.5) - stirling(a)
    return math.lgamma(0.5) - ratio


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
        why = f"under {min_requests} judging requests" if g.before else NO_REQUESTS
        return GroupVerdict(g.name, g.share, len(pos), _mean(before) if pos else None,
                            _mean(after) if pos else None, None, None, None, "not judged", why)
    diffs = [a - b for a, b in zip(after, before)]
    change, se = _mean(diffs), math.sqrt(_var(diffs) / len(diffs))
    upper = change + t_quantile(1 - drop_alpha, len(diffs) - 1) * se
    return GroupVerdict(g.name, g.share, len(pos), _mean(before), _mean(after), change, se, upper,
                        "fell" if upper < 0 else "held")


def check_groups(groups: list[GroupScores]) -> None:
    """The gate's input is every group of the traffic: refuse a list whose shares do not sum to 1 (a group left out,
    e.g. one with no held-out request, would drop out of the 5% rule unseen) or whose groups disagree on the seeds."""
    if not groups:
        raise ValueError("the gate needs at least one group of traffic")
    total = sum(g.share for g in groups)
    if abs(total - 1.0) > 1e-6 or any(g.share < 0 for g in groups):
        raise ValueError(f"the gate's group shares sum to {total:.6f}, not 1: pass every group of the traffic "
                         "(Traffic.shares()), those with no held-out request included")
    if len({len(g.after) for g in groups}) != 1:
        raise ValueError("the gate's groups disagree on the number of seeds: give each group one 'after' per seed")


def judge(groups: list[GroupScores], k: int, cost_ratio: float, overhead: float = 0.0, parallel: bool = False, *,
          alpha: float = ALPHA, drop_alpha: float = DROP_ALPHA, min_requests: int = MIN_REQUESTS,
          unjudged_share: float = UNJUDGED_SHARE) -> Verdict:
    """Ship or not (the module's rules 1-4); speedups are ``formulas.speedup`` of the judged groups' mean acceptance
    lengths on their judging requests, weighted by their shares."""
    check_groups(groups)
    denom = 1.0 / speedup(1.0, k, cost_ratio, overhead, parallel)  # D: speedup = tau / D
    seed = choose(groups, denom)
    verdicts = [judge_group(g, seed, drop_alpha, min_requests) for g in groups]
    judged = [v for v in verdicts if v.status != "not judged"]
    unjudged = sum(v.share for v in verdicts if v.status == "not judged")  # of all traffic: the shares sum to 1
    rules = {"alpha": alpha, "drop_alpha": drop_alpha, "min_requests": min_requests,
             "unjudged_share": unjudged_share, "chosen_on": "the other half" if len(groups[0].after) > 1 else None}
    left_out = [f"{v.name} ({v.share:.0%}, {v.why})" for v in verdicts if v.status == "not judged"]
    note = f"; not judged: {', '.join(left_out)}, {unjudged:.0%} of the traffic" if left_out else ""
    fix = "sample more per group (per_group)" + (
        "; a group whose sampled requests all repeat another group's is judged only if grouped with it (group_by)"
        if any(v.why == NO_REQUESTS for v in verdicts) else "")
    if not judged:
        return Verdict(verdicts, seed, None, None, None, False,
                       f"refused: no group has {min_requests} judging requests; {fix} or fewer groups{note}", rules)
    w = {v.name: v.share / sum(j.share for j in judged) for v in judged}
    before = sum(w[v.name] * v.before for v in judged) / denom
    after = sum(w[v.name] * v.after for v in judged) / denom
    a = [(w[v.name] * v.se / denom) ** 2 for v in judged]
    se = math.sqrt(sum(a))
    df = sum(a) ** 2 / sum(x**2 / (v.requests - 1) for x, v in zip(a, judged)) if se > 0 else math.inf
    lower = after - before - (t_quantile(1 - alpha, df) * se if se > 0 else 0.0)
    fallen = [v for v in verdicts if v.status == "fell"]
    if fallen:
        worst = min(fallen, key=lambda v: v.upper)
        reason = (f"refused: {', '.join(v.name for v in fallen)} fell significantly (worst {worst.name}: "
                  f"{worst.before:.2f} -> {worst.after:.2f}, upper bound of the change {worst.upper:+.3f}){note}")
    elif unjudged > unjudged_share:
        reason = (f"refused: groups not judged carry {unjudged:.0%} of the traffic (over {unjudged_share:.0%}); "
                  f"{fix}{note}")
    elif lower <= 0:
        reason = (f"refused: the traffic-weighted speedup gain does not exceed its noise ({before:.3f}x -> "
                  f"{after:.3f}x, lower bound {lower:+.3f}x){note}")
    else:
        reason = (f"ship: no group fell significantly and the traffic-weighted speedup rose {before:.3f}x -> "
                  f"{after:.3f}x (lower bound of the gain {lower:+.3f}x){note}")
    return Verdict(verdicts, seed, before, after, lower, reason.startswith("ship"), reason, rules)
