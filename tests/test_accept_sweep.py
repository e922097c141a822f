"""04's server sweep over draft length k and concurrency, on the embedded server with the suite's trained draft:
one speculative server per k (a server's k is fixed at its start), the baseline's tokens/s the speedup's
reference at each concurrency, acceptance from the server's own counters, reused when finished. The real vLLM
at one k is in tests/test_vllm.py (``test_04_sweep_reads_the_k_of_a_real_vllm_server``)."""

from __future__ import annotations

import pytest

KS = [1, 3]
LEVELS = [1, 2]


def sweep_params(trained: dict, tmp, **values):
    from eagle3nb.params import from_dict
    from eagle3nb.params_yaml import run_params

    from worlds import write_run

    stages = {"04_acceptance": {**trained["stages"]["04_acceptance"], "output_dir": tmp / "04", "ks": KS,
                                "concurrency_levels": LEVELS, "num_prompts": 4, "max_tokens": 24, **values}}
    return from_dict("04_acceptance", run_params(write_run(tmp / "run", stages), "04_acceptance"))


@pytest.fixture(scope="module")
def sweep(trained, tmp_path_factory) -> tuple[object, list[dict]]:
    """(params, rows) of one sweep: the baseline and the trained draft at each of ``KS``, at each of ``LEVELS``."""
    from eagle3nb.accept.online import run_online

    P = sweep_params(trained, tmp_path_factory.mktemp("sweep"))
    return P, run_online(P)


def test_every_k_and_concurrency_is_measured_and_acceptance_grows_with_k(sweep):
    _, rows = sweep
    by = {(r["endpoint"], r["k"], r["concurrency"]): r for r in rows}
    assert sorted(by, key=str) == sorted([("baseline", None, c) for c in LEVELS] +
                                         [("eagle3", k, c) for k in KS for c in LEVELS], key=str)
    for (endpoint, k, c), r in by.items():
        assert r["errors"] == 0 and r["output_tokens"] > 0 and r["output_tokens_per_s"] > 0, r
        if endpoint == "baseline":
            assert r["acceptance_length"] is None and r["metrics_engine"] is None, r
            continue
        # the server's counters: one per draft position, and vLLM's definitions tie length to rate
        assert r["metrics_engine"] == "vllm" and len(r["per_position"]) == k, r
        assert 1.0 <= r["acceptance_length"] <= k + 1, r
        assert r["acceptance_length"] == pytest.approx(1 + k * r["acceptance_rate"]), r
    for c in LEVELS:
        # k=3 has two more positions to accept in; the trained draft's later positions are accepted often
        # (measured ~2.5 vs ~1.8 tokens per step), so 0.2 holds with room on any CPU
        assert by[("eagle3", 3, c)]["acceptance_length"] > by[("eagle3", 1, c)]["acceptance_length"] + 0.2


def test_speedup_is_each_rows_tokens_per_s_over_the_baseline_at_its_concurrency(sweep):
    _, rows = sweep
    base = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["endpoint"] == "baseline"}
    for r in rows:
        assert r["speedup"] == pytest.approx(r["output_tokens_per_s"] / base[r["concurrency"]]), r


def test_the_sweep_is_reused_and_drawn_one_line_per_k(sweep):
    from eagle3nb.accept import report
    from eagle3nb.accept.online import run_online

    P, rows = sweep
    assert sorted(p.name for p in P.stage_dir.glob("online-*.json")) == \
        ["online-baseline.json"] + [f"online-eagle3-k{k}.json" for k in KS]
    assert run_online(P) == rows  # no server started: each server's rows come from its file
    table = report.online_table(rows)
    assert len(table) == len(rows) and list(table.index.names) == ["endpoint", "k", "concurrency"]
    fig = report.plot_acceptance(rows)
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in fig.axes[0].get_lines()}
    assert lines == {f"eagle3 k={k}": [r["acceptance_length"] for r in sorted(rows, key=lambda r: r["concurrency"])
                                       if r["k"] == k] for k in KS}
    fig = report.plot_speedup_vs_k(rows, "baseline")
    lines = {ln.get_label(): list(ln.get_xdata()) for ln in fig.axes[0].get_lines()}
    assert {f"concurrency {c}": KS for c in LEVELS}.items() <= lines.items()
    throughput = {ln.get_label() for ln in report.plot_throughput(rows).axes[0].get_lines()}
    assert throughput == {"baseline"} | {f"eagle3 k={k}" for k in KS}
    assert {"acceptance_vs_concurrency", "speedup_vs_k"} <= set(report.FIGURES)


def test_a_sweep_that_cannot_be_served_is_refused_naming_the_fix(trained, tmp_path):
    from eagle3nb.accept.online import served_k
    from eagle3nb.errors import InputError
    from eagle3nb.params import ParamsError

    with pytest.raises(ParamsError, match="give each its k"):
        sweep_params(trained, tmp_path / "a", endpoints=[{"label": "b", "url": "http://127.0.0.1:9"}])
    with pytest.raises(ParamsError, match="distinct draft lengths"):
        sweep_params(trained, tmp_path / "b", ks=[2, 2])
    counters = {"engine": "vllm", "per_pos": [5.0, 3.0, 1.0]}
    assert served_k("s", None, counters) == 3 and served_k("s", None, {"engine": None}) is None
    with pytest.raises(InputError, match="declares k=2 but its /metrics counts 3 .* set its k to 3"):
        served_k("s", 2, counters)


def test_the_concurrency_verdict_covers_every_measured_level(sweep):
    """Each measured concurrency maps to the k with the best measured speedup there (0 where plain wins), and each
    speculative series gets a prediction fitted on the baseline's own steps."""
    from eagle3nb.accept.concurrency import best_k_by_concurrency, concurrency_verdict

    _, rows = sweep
    best = best_k_by_concurrency(rows, "baseline")
    assert sorted(best, key=int) == [str(c) for c in LEVELS]
    for c, k in best.items():
        spec = {r["k"]: r["speedup"] for r in rows if r["k"] and r["concurrency"] == int(c)}
        assert k == (max(spec, key=spec.get) if max(spec.values()) >= 1 else 0), (c, spec)
    verdict = concurrency_verdict(rows, "baseline")
    assert verdict["step_cost"] is not None and sorted(s["k"] for s in verdict["series"]) == KS
