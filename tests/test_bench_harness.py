"""The benchmarks as a package (``benchmarks/``): every one is listed for ``make bench`` as quick or long and its
listed command parses; ``python -m benchmarks`` runs the quick ones in their own processes and fails when one does;
the benchmarks read the draft registry, so a newly registered block drafter gets its rows and candidates without an
edit; and the harness' shared pieces (side by side, spreads, results a stopped run resumes from, one-line
refusals). Nothing trains; a few seconds (two light benchmark processes)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import harness
from benchmarks.harness import LONG, QUICK, Bench, Results

ROOT = Path(__file__).resolve().parents[1]


def test_every_benchmark_is_quick_or_long_and_its_listed_command_parses():
    """A benchmark module nobody classed would never run (or run for hours under `make bench`); a listed command
    whose flags its parser refuses would fail there."""
    on_disk = {p.stem for p in (ROOT / "benchmarks").glob("bench_*.py")}
    names = [b.name for b in (*QUICK, *LONG)]
    assert sorted(names) == sorted(on_disk), "class each benchmark in benchmarks/harness.py QUICK or LONG, once"
    for b in (*QUICK, *LONG):
        module = importlib.import_module(f"benchmarks.{b.name}")
        assert callable(module.main), b.name
        if b.args:  # the flags `make bench` gives it, through its own parser
            module.parser().parse_args(list(b.args))
        assert b.minutes > 0, f"{b.name}: say its run time here"
    assert sum(b.minutes for b in QUICK) <= 5, "make bench stays within ~5 minutes: move one to LONG"


def test_the_runner_runs_each_quick_one_in_its_own_process_and_fails_when_one_fails(monkeypatch, capsys):
    import benchmarks.__main__ as runner

    # two light ones (bench_scale imports its work lazily): one that runs, one its parser refuses
    monkeypatch.setattr(runner, "QUICK", (Bench("bench_scale", ("--help",), 0.1),
                                          Bench("bench_scale", ("--no-such-flag",), 0.1)))
    assert runner.main([]) == 1
    out = capsys.readouterr().out
    assert "== bench_scale: ok" in out and "== bench_scale: FAILED (exit 2)" in out
    assert "1 of 2 quick benchmarks ran" in out and "failed: bench_scale" in out
    assert all(b.command in out for b in LONG), "the long ones are named with their commands"
    with pytest.raises(SystemExit, match="--only: unknown bench_nothing; choose from bench_scale, bench_scale"):
        runner.main(["--only", "bench_nothing"])


@pytest.fixture
def new_block_drafter(monkeypatch):
    """A block drafter registered as a new package would be (its rules only: nothing here builds it)."""
    from eagle3nb import drafts
    from eagle3nb.drafts.base import MethodRules

    name = "newblock"
    package = SimpleNamespace(__name__="newblock_pkg", RULES={name: MethodRules(summary="a new block drafter",
                                                                                 block=True, samples_from_anchor=True)})
    monkeypatch.setitem(sys.modules, package.__name__, package)
    # the registry maps a method to its package (a module, or, before that, the module's name)
    as_name = isinstance(next(iter(drafts.PACKAGES.values())), str)
    monkeypatch.setitem(drafts.PACKAGES, name, package.__name__ if as_name else package)
    return name


def test_a_newly_registered_block_drafter_gets_its_rows_and_candidates_without_an_edit(new_block_drafter):
    from benchmarks import bench_crossover, bench_mask_input, bench_peer, bench_recipes

    recipes = bench_recipes.recipes()
    for b in bench_recipes.BLOCKS:  # its k is its rules': a block that samples from its anchor drafts all of it
        assert recipes[f"{new_block_drafter}/{b}"]["num_speculative_tokens"] == b
        assert recipes[f"{new_block_drafter}/{b}-2layers"]["num_layers"] == 2
    assert new_block_drafter in bench_crossover.methods()
    assert f"{new_block_drafter}/4" in bench_mask_input.block_recipes(recipes)
    assert bench_peer.parser().parse_args(["--method", new_block_drafter]).method == new_block_drafter


def test_side_by_side_runs_the_sides_in_turn():
    order = []
    out = harness.alternate({"a": lambda: order.append("a") or len(order), "b": lambda: order.append("b") or 0}, 3)
    assert order == ["a", "b"] * 3 and out == {"a": [1, 3, 5], "b": [0, 0, 0]}


def test_a_gap_beats_only_beyond_both_half_ranges():
    base = [3.0, 3.2]  # half range 0.1
    assert harness.beats([3.35, 3.45], base)  # gap 0.3 > 0.1 + 0.05
    assert not harness.beats([3.1, 3.5], base)  # gap 0.2 = 0.1 + 0.2 short
    assert harness.verdict([3.35, 3.45], base) == "+0.300 beats"
    assert harness.verdict([2.5, 2.7], base) == "-0.500 worse"
    assert harness.verdict([3.0], base).endswith("(one seed: no spread)")
    assert harness.mean_half([1.0, 2.0]) == "1.500 ± 0.500"
    assert harness.median_span([3, 1, 2], ".1f") == "2.0 (1.0..3.0)"
    assert harness.table(["a", "b"], [[1, "x"]]) == "| a | b |\n| --- | --- |\n| 1 | x |"


def test_results_are_saved_as_they_land_and_a_stopped_run_reuses_them(tmp_path):
    first = Results(tmp_path, key=("n", "seed"), landed=lambda p: "tau" in p)
    first.add({"n": 48, "seed": 0, "tau": 2.5})
    first.add({"n": 48, "seed": 1, "error": "03 refuses it"})  # a refusal lands nothing: it runs again
    assert json.loads((tmp_path / "results.json").read_text()) == first.points  # on disk before the run ends
    again = Results(tmp_path, key=("n", "seed"), landed=lambda p: "tau" in p)
    assert again.reused({"n": 48, "seed": 0, "other": 1}) == {"n": 48, "seed": 0, "tau": 2.5}
    assert again.reused({"n": 48, "seed": 1}) is None and again.reused({"n": 500, "seed": 0}) is None


def test_bad_lists_are_refused_in_one_line_naming_the_flag():
    with pytest.raises(SystemExit, match=r"^--toys: unknown tiny; choose from smoke, demo, kimi$"):
        harness.choose("--toys", "smoke,tiny", list(harness.TOYS))
    with pytest.raises(SystemExit, match=r"^--sizes takes comma-separated integers, e.g. 48,500; got '48,x'$"):
        harness.ints("--sizes", "48,x")
    assert harness.ints("--sizes", "48,500") == [48, 500]


def test_a_draft_vllm_refuses_is_reported_by_its_first_cause(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("INFO starting\nWARNING something\n"
                   "pydantic ValidationError: 1 validation error for SpeculativeConfig\n"
                   "  Value error, dspark needs the V2 model runner. Set it. [type=value_error]\n"
                   "RuntimeError: Engine core initialization failed. See root cause above.\n")
    from eagle3nb.select.engines import refusal

    cause = refusal(RuntimeError(f"vLLM exited; its output ({log})"))  # what serve_drafts reports, as 06 does
    assert cause.startswith("dspark needs the V2 model runner")
