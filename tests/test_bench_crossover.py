"""The scaling study's verdicts (``benchmarks/bench_crossover.py``): where a block drafter overtakes an EAGLE-3.1
row, and where fitted lines would cross when it does not. Pure logic on made-up curves; nothing trains."""

from __future__ import annotations

import math

import pytest

from benchmarks.bench_crossover import crossing, fit, overtakes, steps_for, verdicts


def test_overtakes_needs_a_gap_beyond_both_spreads():
    eagle = {48: [3.0, 3.2], 500: [3.3, 3.5], 2000: [3.4, 3.6]}  # half range 0.1 at every size
    # 500: mean gap 0.15 is within 0.1 + 0.1; 2000: gap 0.4 beats 0.1 + 0.1
    block = {48: [2.0, 2.2], 500: [3.45, 3.65], 2000: [3.8, 4.2]}
    assert overtakes(block, eagle) == 2000
    assert overtakes({48: [2.0], 500: [3.0]}, eagle) is None
    assert overtakes({n: [x + 1 for x in v] for n, v in eagle.items()}, eagle) == 48
    assert overtakes({10: [9.0]}, eagle) is None  # no size measured for both


def test_fit_and_crossing_follow_the_lines():
    # tau = 1 + 0.5 log10(n) against 3 + 0.1 log10(n): they meet where 0.4 log10(n) = 2, n = 10**5
    block = {n: [1 + 0.5 * math.log10(n)] for n in (10, 100, 1000)}
    eagle = {n: [3 + 0.1 * math.log10(n)] for n in (10, 100, 1000)}
    assert fit(block) == pytest.approx((1.0, 0.5))
    assert crossing(block, eagle) == pytest.approx(1e5, rel=1e-6)
    assert crossing(eagle, block) is None  # the slower climber never catches up
    above = {n: [v[0] + 5] for n, v in block.items()}  # already above at every size: no crossing ahead
    assert crossing(above, eagle) is None


def test_verdicts_name_the_size_or_the_slopes():
    points = [{"label": label, "n": n, "t0": t, "t1": t - 0.2}
              for label, taus in (("eagle3.1/k3", (3.0, 3.1, 3.2)), ("dflash/4", (2.0, 3.0, 4.0)))
              for n, t in zip((48, 500, 2000), taus)]
    lines = verdicts(points)
    assert "t0: dflash/4 overtakes eagle3.1/k3 at 2000 answers" in lines
    assert not any("eagle3.1/k7" in line for line in lines)  # a row that was not run is not compared


def test_steps_cover_the_epochs_with_a_floor():
    assert steps_for(tokens=10_000, epochs=4, min_steps=100, batch_tokens=1024) == 100
    assert steps_for(tokens=100_000, epochs=4, min_steps=100, batch_tokens=1024) == math.ceil(400_000 / 1024)


def test_smaller_sets_reuse_the_longer_runs_answers(tmp_path, toy_smoke):
    """A nested prompt set's data is the longer run's first answers, read, not generated again (and a longer
    set than the answers held is refused)."""
    from eagle3nb.data.reader import HiddenStates
    from testkit.heldout import greedy_hidden_states

    longer = greedy_hidden_states(toy_smoke, "toy:train", 3, 8, tmp_path / "3", draft_vocab_size=96).parent
    samples = longer / "01" / "samples-00000.jsonl"
    samples.write_text(samples.read_text().replace('"id": "', '"id": "read-', 1))  # marks the row as read, not made
    shorter = greedy_hidden_states(toy_smoke, "toy:train", 2, 8, tmp_path / "2", draft_vocab_size=96,
                                   answers_from=longer)
    rows = [(longer / "01" / "samples-00000.jsonl").read_text().splitlines(),
            (shorter.parent / "01" / "samples-00000.jsonl").read_text().splitlines()]
    assert rows[1] == rows[0][:2] and '"id": "read-' in rows[1][0]
    assert len(HiddenStates(shorter)) == 2
    with pytest.raises(ValueError, match="holds 3 answers, fewer than the 5"):
        greedy_hidden_states(toy_smoke, "toy:train", 5, 8, tmp_path / "5", answers_from=longer)
