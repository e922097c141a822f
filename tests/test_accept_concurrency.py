"""04's concurrency verdict (eagle3nb/accept/concurrency.py) on sweeps made from a known engine: a plain step of width
n costing a + b*n seconds, a draft paying tau / (t(c*(k+1)) / t(c) + D) at concurrency c. The fits recover the
engine's numbers, the best k and the crossovers follow from its speedups, and the verdict names the flags."""

from __future__ import annotations

import pytest

A, B = 0.010, 0.002  # seconds: a plain step's fixed cost and per-token cost
LEVELS = [1, 2, 4, 8, 16]
DRAFTS = {1: (1.7, 0.15), 3: (2.6, 0.35)}  # k -> (tau, D: the draft and bookkeeping, in plain steps)


def t(n: float) -> float:
    return A + B * n


def speedup(c: int, k: int) -> float:
    tau, d = DRAFTS[k]
    return tau / (t(c * (k + 1)) / t(c) + d)


def sweep() -> list[dict]:
    """Rows as 04's server sweep writes them: the baseline, then each k, at each level."""
    rows = [{"endpoint": "baseline", "k": None, "concurrency": c, "output_tokens_per_s": c / t(c), "speedup": 1.0,
             "acceptance_length": None} for c in LEVELS]
    rows += [{"endpoint": "eagle3", "k": k, "concurrency": c, "output_tokens_per_s": speedup(c, k) * c / t(c),
              "speedup": speedup(c, k), "acceptance_length": DRAFTS[k][0]} for k in DRAFTS for c in LEVELS]
    return rows


def test_the_step_cost_and_each_drafts_bookkeeping_are_recovered_and_predict_every_level():
    from eagle3nb.accept.concurrency import fit_step_cost, predict_series

    rows = sweep()
    a, b = fit_step_cost(rows, "baseline")
    assert a == pytest.approx(A) and b == pytest.approx(B)
    for k, (tau, d) in DRAFTS.items():
        got = predict_series([r for r in rows if r["k"] == k], (a, b), None)
        assert got["k"] == k and got["fitted_at"] == 1 and got["bookkeeping"] == pytest.approx(d)
        assert [lv["concurrency"] for lv in got["levels"]] == LEVELS
        assert got["max_error"] == pytest.approx(0, abs=1e-9)
        cross = got["predicted_crossover"]
        assert speedup(cross, k) < 1.0 <= speedup(cross - 1, k)


def test_best_k_crossovers_and_the_flags_follow_from_the_speedups(tmp_path):
    from eagle3nb.accept.concurrency import best_k_by_concurrency, concurrency_verdict, measured_crossover, serve_flags

    rows = sweep()
    best = best_k_by_concurrency(rows, "baseline")
    want = {str(c): (max(DRAFTS, key=lambda k: speedup(c, k)) if max(speedup(c, k) for k in DRAFTS) >= 1 else 0)
            for c in LEVELS}
    assert best == want and set(best.values()) >= {0} and any(best.values())  # the sweep crosses over
    first_plain = min(c for c in LEVELS if all(best[str(d)] == 0 for d in LEVELS if d >= c))
    assert measured_crossover(best) == first_plain
    verdict = concurrency_verdict(rows, "baseline")
    assert verdict["measured_crossover"] == first_plain
    assert verdict["predicted_crossover"] == max(s["predicted_crossover"] for s in verdict["series"])
    flags = serve_flags(best, "dflash", str(tmp_path / "draft"))
    for c, k in best.items():
        if k:
            assert f'"num_speculative_tokens": {k}' in flags[c] and '"method": "dflash"' in flags[c]
        else:
            assert flags[c] is None
    assert measured_crossover({"1": 3, "2": 0, "4": 1}) is None  # pays again at the highest level: no crossover


def test_the_verdict_names_the_crossover_and_the_flags_and_the_pareto_draws_every_series(tmp_path):
    from eagle3nb.accept.concurrency import best_k_by_concurrency, concurrency_verdict, plot_pareto, serve_flags
    from eagle3nb.accept.verdict import concurrency_rows

    rows = sweep()
    best = best_k_by_concurrency(rows, "baseline")
    conc = {**concurrency_verdict(rows, "baseline"), "serve_flags": serve_flags(best, "eagle3", str(tmp_path))}
    text = dict(concurrency_rows(conc))
    assert f"from concurrency {conc['measured_crossover']}" in text["Where speculation stops paying"]
    for c, k in best.items():
        assert ("num_speculative_tokens" in text[f"Serve at concurrency {c}"]) == bool(k)
    fig = plot_pareto(rows)
    lines = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in fig.axes[0].get_lines()}
    assert set(lines) == {"baseline", "eagle3 k=1", "eagle3 k=3"}
    xs, ys = lines["baseline"]
    assert xs == [c / t(c) for c in LEVELS] and ys == pytest.approx([1 / t(c) for c in LEVELS])
