"""The refresh gate (eagle3nb.refresh.gate) driven by synthetic per-request scores: what it guarantees, measured.

The simulation: 3 groups (shares 0.5, 0.3, 0.2), each request with its own difficulty (a base acceptance length
that the current and the refreshed draft share, so pairing removes it) plus independent per-request noise of
SIGMA = 0.3 on every draft's score (the current one's and each seed's). A group's true change is given in units of
its standard error as the gate computes it on its judging requests:

    SE = sd(new - old per request) / sqrt(n_judge) = SIGMA * sqrt(2) / sqrt(n_judge),

n_judge being half the group's held-out requests with two seeds (the other half chooses the seed), all of them
with one. 400 trials per case, seeded; pure Python and numpy, a few seconds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from eagle3nb.formulas import speedup
from eagle3nb.refresh.gate import ALPHA, GroupScores, halves, judge, t_quantile

SHARES = {"chat": 0.5, "code": 0.3, "math": 0.2}
SIGMA = 0.3
TRIALS = 400
K, COST = 3, 0.1


def se_of(n: int, seeds: int) -> float:
    """The standard error of a group's mean paired difference on its judging requests (the module's definition)."""
    return SIGMA * math.sqrt(2) / math.sqrt(len(halves(n, seeds)[1]))


def simulate(shift_se: dict[str, float], n: int, seeds: int, trials: int = TRIALS, seed: int = 0) -> list:
    """``trials`` verdicts: per group, ``n`` held-out requests; every seed's refreshed draft moves the group's true
    acceptance length by ``shift_se[group]`` standard errors (0 when absent)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(trials):
        groups = []
        for g, share in SHARES.items():
            base = rng.uniform(1.5, 3.5, n)  # each request's difficulty, shared by both drafts
            before = base + rng.normal(0, SIGMA, n)
            delta = shift_se.get(g, 0.0) * se_of(n, seeds)
            after = [list(base + delta + rng.normal(0, SIGMA, n)) for _ in range(seeds)]
            groups.append(GroupScores(g, share, list(before), after))
        out.append(judge(groups, k=K, cost_ratio=COST))
    return out


def rate(verdicts: list) -> float:
    return sum(v.ship for v in verdicts) / len(verdicts)


@pytest.mark.parametrize("n,seeds", [(16, 2), (16, 1), (64, 2)])
def test_a_refresh_that_changes_nothing_ships_at_most_5_percent(n: int, seeds: int) -> None:
    """Null refreshes: the old gate shipped about half of them (its overall test was after > before); this one's
    overall gain must clear its one-sided 97.5% bound, choosing the seed on other requests than it judges on."""
    assert rate(simulate({}, n, seeds)) <= 0.05


@pytest.mark.parametrize("n,seeds", [(16, 2), (16, 1), (64, 2)])
def test_a_group_3_se_worse_is_refused_at_least_95_percent(n: int, seeds: int) -> None:
    for g in SHARES:
        assert 1 - rate(simulate({g: -3.0}, n, seeds)) >= 0.95, g


@pytest.mark.parametrize("n,seeds", [(16, 2), (64, 2)])
def test_a_group_3_se_worse_is_refused_even_when_the_others_pay_for_it(n: int, seeds: int) -> None:
    """The smallest group 3 SE worse while the others gain 3 SE, so the traffic-weighted speedup rises: the group's
    own drop test (one-sided 10%) refuses it at least 90% (its power at 3 SE is ~95% with many requests, less with
    a t of 7 degrees of freedom)."""
    assert 1 - rate(simulate({"chat": 3.0, "code": 3.0, "math": -3.0}, n, seeds)) >= 0.90


@pytest.mark.parametrize("n,seeds", [(16, 2), (16, 1), (64, 2)])
def test_a_real_gain_of_3_se_everywhere_ships_at_least_90_percent(n: int, seeds: int) -> None:
    assert rate(simulate(dict.fromkeys(SHARES, 3.0), n, seeds)) >= 0.90


def test_the_seed_is_chosen_on_other_requests_than_it_is_judged_on() -> None:
    """Two seeds: one better on the choosing half only, one better on the judging half only. The gate picks the
    first (its choosing-half score is higher) and judges it where it is no better, so it does not ship; judged on
    the requests that chose it, it would have."""
    n = 16
    choosing, judging = halves(n, 2)
    assert not set(choosing) & set(judging) and sorted(choosing + judging) == list(range(n))
    before = [2.0 + 0.01 * i for i in range(n)]
    lucky = [b + (1.0 if i in choosing else 0.0) for i, b in enumerate(before)]
    steady = [b + (0.05 if i in judging else 0.0) + 0.001 * (i % 3) for i, b in enumerate(before)]
    v = judge([GroupScores("chat", 1.0, before, [lucky, steady])], k=K, cost_ratio=COST)
    assert v.seed == 0 and v.groups[0].change == pytest.approx(0.0) and not v.ship
    assert v.groups[0].requests == len(judging)


def test_a_group_too_small_is_reported_not_judged_and_the_rule_is_applied() -> None:
    """A group with fewer than 4 judging requests is listed as not judged, with its share; the draft ships only when
    such groups carry at most 5% of the traffic."""
    rng = np.random.default_rng(1)

    def group(name: str, share: float, n: int) -> GroupScores:
        before = list(rng.uniform(1.5, 2.5, n))
        return GroupScores(name, share, before, [[b + 1.0 + rng.normal(0, 0.05) for b in before]])

    small = judge([group("chat", 0.97, 40), group("rare", 0.03, 3)], k=K, cost_ratio=COST)
    rare = next(g for g in small.groups if g.name == "rare")
    assert rare.status == "not judged" and rare.passed and rare.requests == 3
    assert small.ship and "not judged" in small.reason and "rare" in small.reason
    big = judge([group("chat", 0.8, 40), group("rare", 0.2, 3)], k=K, cost_ratio=COST)
    assert not big.ship and "not judged carry 20%" in big.reason
    none = judge([group("rare", 1.0, 3)], k=K, cost_ratio=COST)
    assert not none.ship and "no group has 4 judging requests" in none.reason


def test_the_speedups_and_the_bound_follow_the_formula() -> None:
    """One seed, two groups: the reported speedups are formulas.speedup of the groups' means weighted by share, and
    the lower bound is the gain less t(1 - ALPHA, Welch df) times its standard error, recomputed here."""
    before = {"math": [1.8, 2.0, 1.9, 2.1, 1.7, 2.2], "chat": [3.1, 3.3, 3.2, 3.0, 3.4, 3.2]}
    after = {"math": [2.9, 3.2, 2.8, 3.1, 3.0, 3.3], "chat": [3.2, 3.2, 3.3, 3.1, 3.3, 3.2]}
    shares = {"math": 0.6, "chat": 0.4}
    v = judge([GroupScores(g, shares[g], before[g], [after[g]]) for g in shares], k=K, cost_ratio=COST)
    mean = {g: sum(after[g]) / 6 - sum(before[g]) / 6 for g in shares}
    assert v.speedup_before == pytest.approx(sum(shares[g] * speedup(sum(before[g]) / 6, K, COST) for g in shares))
    assert v.speedup_after - v.speedup_before == pytest.approx(sum(shares[g] * speedup(mean[g], K, COST)
                                                                   for g in shares))
    var = {g: np.var(np.subtract(after[g], before[g]), ddof=1) / 6 for g in shares}
    a = {g: (shares[g] * speedup(1.0, K, COST)) ** 2 * var[g] for g in shares}
    df = sum(a.values()) ** 2 / sum(x**2 / 5 for x in a.values())
    expect = v.speedup_after - v.speedup_before - t_quantile(1 - ALPHA, df) * math.sqrt(sum(a.values()))
    assert v.gain_lower == pytest.approx(expect) and v.ship


def test_t_quantile_matches_the_tables() -> None:
    """Student's t quantiles from the printed tables (one-sided 90% and 95%)."""
    for p, df, table in [(0.95, 1, 6.314), (0.95, 2, 2.920), (0.95, 3, 2.353), (0.90, 7, 1.415), (0.95, 15, 1.753),
                         (0.90, 30, 1.310)]:
        assert t_quantile(p, df) == pytest.approx(table, abs=2e-3)


def test_each_group_is_held_out_on_its_own_with_what_the_gate_needs() -> None:
    """The held-out split is per group: half of each, at least 8 requests with several seeds (4 choose, 4 judge) or 4
    with one while the group has them, the same whatever the rows' order."""
    from eagle3nb.refresh.sample import split

    sizes = {"chat": 40, "code": 10, "math": 3, "rare": 1}
    rows = [{"id": f"{g}-{i}", "group": g} for g, n in sizes.items() for i in range(n)]
    for seeds, need in ((2, 8), (1, 4)):
        held, pool = split(rows, seeds)
        for g, n in sizes.items():
            assert sum(r["group"] == g for r in held) == min(n, max(math.ceil(n / 2), need)), (g, seeds)
        assert sorted(r["id"] for r in held + pool) == sorted(r["id"] for r in rows)
        assert split(rows[::-1], seeds) == (held, pool)
