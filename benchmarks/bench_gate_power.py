"""The refresh gate's power for small groups, simulated: how often a refreshed draft that is worse on one group of
traffic ships, by that group's share, its drop (in its own standard errors) and its judging requests; and how often
a refresh that changes nothing ships (docs/refresh.md, "What the gate guarantees").

The gate (``eagle3nb.refresh.gate.judge``, the real one) is driven by synthetic per-request acceptance lengths:
each held-out request has its own difficulty (a base acceptance length, uniform in 1.5-3.5, which the current and
the refreshed drafts share, so pairing removes it) plus independent noise of ``SIGMA`` on every draft's score. A
group's true change is given in units of its standard error as the gate computes it on its judging requests,

    SE = sd(new - old per request) / sqrt(n_judge) = SIGMA * sqrt(2) / sqrt(n_judge),

with two seeds (05's default): each group holds out twice its judging requests, the other half choosing the seed.
The bad group takes ``share`` of the traffic; the rest is two groups of equal share with ``REST_JUDGING`` judging
requests each, both gaining ``REST_GAIN`` SE, so that the traffic-weighted speedup rises and the draft would ship
but for the bad group. Pure Python and numpy, no model; about 20 s on two shared cores at the default 1,000 trials
a cell.

    .venv/bin/python -m benchmarks.bench_gate_power                  # the tables in docs/refresh.md
    .venv/bin/python -m benchmarks.bench_gate_power --trials 4000 --seed 1
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence

import numpy as np

from eagle3nb.refresh.gate import GroupScores, Verdict, halves, judge

SIGMA = 0.3  # per-request noise of each draft's acceptance length
K, COST = 3, 0.1  # the expected speedup's k and cost ratio (any would do: the gate's rules are in its units)
SEEDS = 2
REST_JUDGING = 16  # judging requests of each of the two other groups
REST_GAIN = 3.0  # their true gain, in their own SE
SHARES = (0.02, 0.04, 0.10, 0.30)  # the bad group's share of the traffic
DROPS = (0.0, 1.0, 2.0, 3.0, 5.0)  # its true drop, in its own SE
JUDGING = (3, 4, 8, 16, 32)  # its judging requests (3: under the gate's 4, so not judged)


def se_of(heldout: int, seeds: int = SEEDS) -> float:
    """The standard error of a group's mean paired difference on its judging requests (the gate's definition)."""
    return SIGMA * math.sqrt(2) / math.sqrt(len(halves(heldout, seeds)[1]))


def simulate(groups: dict[str, tuple[float, int, float]], seeds: int = SEEDS, trials: int = 1000,
             seed: int = 0) -> list[Verdict]:
    """``trials`` verdicts of the gate; ``groups``: name -> (share of traffic, held-out requests, true change in
    the group's SE). Every seed's refreshed draft has the same true change; the noise is drawn afresh per trial."""
    rng = np.random.default_rng(seed)
    drawn = {}
    for g, (share, n, shift) in groups.items():
        base = rng.uniform(1.5, 3.5, (trials, n))  # each request's difficulty, shared by both drafts
        before = base + rng.normal(0, SIGMA, (trials, n))
        after = base + shift * se_of(n, seeds) + rng.normal(0, SIGMA, (seeds, trials, n))
        drawn[g] = (share, before.tolist(), after.transpose(1, 0, 2).tolist())
    return [judge([GroupScores(g, share, before[t], after[t]) for g, (share, before, after) in drawn.items()],
                  k=K, cost_ratio=COST) for t in range(trials)]


def ship_rate(verdicts: Sequence[Verdict]) -> float:
    return sum(v.ship for v in verdicts) / len(verdicts)


def bad_group(share: float, judging: int, drop: float, rest_gain: float = REST_GAIN) -> dict:
    """The benchmark's traffic: a group of ``share`` with ``judging`` judging requests, ``drop`` SE worse, and the
    rest in two groups gaining ``rest_gain`` SE."""
    rest = (1 - share) / 2
    return {"bad": (share, SEEDS * judging, -drop), "rest-a": (rest, SEEDS * REST_JUDGING, rest_gain),
            "rest-b": (rest, SEEDS * REST_JUDGING, rest_gain)}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=1000, help="trials per cell (default 1000)")
    ap.add_argument("--seed", type=int, default=0, help="the simulation's seed")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    print(f"ship rate of a draft with one bad group ({args.trials} trials a cell, seed {args.seed}; the rest of the "
          f"traffic: two groups of {REST_JUDGING} judging requests gaining {REST_GAIN:g} SE; {SEEDS} seeds)\n")
    print("| bad group's share | judging requests | " + " | ".join(f"{d:g} SE worse" for d in DROPS) + " |")
    print("|---:|---:|" + "---:|" * len(DROPS))
    cell = 0
    for share in SHARES:
        for n in JUDGING:
            rates = []
            for drop in DROPS:
                rates.append(ship_rate(simulate(bad_group(share, n, drop), trials=args.trials,
                                                seed=args.seed * 1000 + cell)))
                cell += 1
            judged = "" if n >= 4 else " (not judged)"
            print(f"| {share:.0%} | {n}{judged} | " + " | ".join(f"{r:.1%}" for r in rates) + " |")
    print(f"\nfalse-ship rate of a refresh that changes nothing (every group unchanged; {args.trials} trials)\n")
    print("| bad group's share | " + " | ".join(f"{n} judging" for n in JUDGING) + " |")
    print("|---:|" + "---:|" * len(JUDGING))
    for share in SHARES:
        rates = []
        for n in JUDGING:
            rates.append(ship_rate(simulate(bad_group(share, n, 0.0, rest_gain=0.0), trials=args.trials,
                                            seed=args.seed * 1000 + cell)))
            cell += 1
        print(f"| {share:.0%} | " + " | ".join(f"{r:.1%}" for r in rates) + " |")
    print(f"\n{cell} cells in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
