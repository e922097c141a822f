"""Plant each bug a reworked test guards and show that test fail on it.

    python tools/plant_bugs.py [--only NAME[,NAME]] [--list]

A test that cannot fail proves nothing. Each plant below is one edit of the library (or the test helpers) in a
temporary copy of the repository; the tests named with it are run there, and the plant is *caught* when they
fail. Prints one line per plant and exits 1 when any plant went uncaught (or no longer applies: the code it
edits moved, so the plant must be moved with it). Outside ``make test``: about 15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Plant:
    name: str
    file: str  # relative to the repository
    old: str  # the exact text replaced (must occur once)
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail on the plant
    why: str


PLANTS = [
    Plant("random-flagged-picks-unflagged", "eagle3nb/tokenview.py",
          'hits = [r for r in matching(category.value, flag.value) if r.get("flags")]',
          'hits = [r for r in matching(category.value, flag.value) if not r.get("flags")]',
          ("tests/test_views.py::test_synth_sample_browser_and_static_samples",),
          "the sample browser's 'random flagged' button lands on an unflagged sample"),
    Plant("worst-sample-ignores-flags", "eagle3nb/synth/report.py", "        if hit:\n", "        if hit and False:\n",
          ("tests/test_views.py::test_synth_sample_browser_and_static_samples",),
          "the static 'worst sample' is never a flagged one"),
    Plant("miss-view-segment-ignored", "eagle3nb/accept/views.py",
          "sel = [_clip(r, lo, hi, segment.value) for r in rs]", 'sel = [_clip(r, lo, hi, "all") for r in rs]',
          ("tests/test_misses.py::test_miss_view_widget_table_and_excerpts",),
          "the miss table ignores the segment filter"),
    Plant("server-ignores-seed", "eagle3nb/serve/batcher.py",
          "out.append(int(torch.multinomial(probs, 1, generator=req.generator)))",
          "out.append(int(torch.multinomial(probs, 1)))",
          ("tests/test_serve.py::test_seeded_sampling_is_reproducible_and_temperature_zero_is_greedy",),
          "the embedded server samples without the request's seeded generator"),
    Plant("server-ignores-temperature", "eagle3nb/serve/batcher.py", "if p.temperature < 1e-5:", "if True:",
          ("tests/test_serve.py::test_seeded_sampling_is_reproducible_and_temperature_zero_is_greedy",),
          "the embedded server decodes greedily whatever the temperature"),
    Plant("spec-drafts-unseeded", "eagle3nb/drafts/eagle3/drafting.py",
          "tok[i] = int(torch.multinomial(q.cpu(), 1, generator=s.generator))",
          "tok[i] = int(torch.multinomial(q.cpu(), 1))",
          ("tests/test_bench_server.py::test_spec_server_samples_with_seeds_reproducibly",),
          "the speculative server samples its drafts without the request's generator"),
    Plant("spec-sampling-greedy", "eagle3nb/decoder/batch.py",
          "if s.greedy:\n                n, tok = verify_greedy", "if True:\n                n, tok = verify_greedy",
          ("tests/test_bench_server.py::test_spec_server_samples_with_seeds_reproducibly",),
          "the speculative server verifies greedily whatever the temperature"),
    Plant("thinking-kwarg-ignored", "eagle3nb/serve/app.py",
          "return_dict=False, **(body.chat_template_kwargs or {}), **more)", "return_dict=False, **more)",
          ("tests/test_serve.py::test_thinking_kwarg_changes_output_and_renders_like_template",),
          "the server renders every prompt with thinking on"),
    Plant("sigterm-recorded-as-failed", "eagle3nb/run/execute.py", 'recs[current].update(state="killed"',
          'recs[current].update(state="failed"',
          ("tests/test_run.py::test_sigterm_marks_the_running_stage_killed",),
          "a stage killed by a signal is recorded as an ordinary failure"),
    Plant("data-health-misses-one", "eagle3nb/doctor/checks/data.py", "no_wrap = sum(1 for s in thinking if",
          "no_wrap = sum(1 for s in thinking[1:] if",
          ("tests/test_doctor.py::test_reasoning_wrappers_lost_and_truncations_fail_data_health",),
          "the doctor's count of thinking samples without <think> is off by one"),
    Plant("refresh-never-asked", "eagle3nb/run/plan.py",
          'return [*STAGES, *(s for s in ON_REQUEST if (params_dir / f"{s}.yaml").exists())]',
          "return list(STAGES)",
          ("tests/test_run.py::test_refresh_runs_after_04_only_when_asked",),
          "a run's folder with 05_refresh.yaml still runs only 01-04"),
    Plant("output-root-not-followed", "eagle3nb/run/plan.py",
          '        os.environ["EAGLE3NB_OUTPUTS"] = str(Path(output_root).expanduser().resolve())\n',
          "        pass\n",
          ("tests/test_e2e.py::test_smoke_pipeline_produces_every_stage",),
          "--output-root moves the run's reports but not the stages' data"),
    Plant("served-acceptance-zero", "eagle3nb/formulas.py", "after[\"accepted\"] - b[\"accepted\"], [a - p",
          "0 * after[\"accepted\"], [a - p",
          ("tests/test_e2e.py::test_smoke_pipeline_produces_every_stage",),
          "04's online rows read no accepted tokens from the engine's counters"),
    Plant("ci-only-when-true", "tests/worlds.py",
          'return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no", "off")',
          'return os.environ.get("CI") == "true"',
          ("tests/test_packaging.py::test_real_vllm_is_required_under_any_truthy_ci",),
          "CI=1 would skip the real-vLLM tests silently"),
    Plant("embedded-server-outlives-stage", "eagle3nb/launch.py", '"--exit-with-parent", str(os.getpid())]', ']',
          ("tests/test_bad_input.py::test_the_embedded_server_dies_with_its_stage_on_kill_9",),
          "a stage killed with -9 leaves its embedded server running"),
    Plant("answers-not-checked", "eagle3nb/synth/client.py",
          "return check_answer(resp, vocab_size) if vocab_size is not None else resp", "return resp",
          ("tests/test_bad_input.py::test_bad_input_gets_one_clear_line[token ids as strings]",),
          "01 stores token ids a server sent as strings"),
    Plant("shards-not-verified", "eagle3nb/train/sources.py",
          '        verify_shards(data, P.stage_dir / VERIFIED_DIR, int(os.environ.get("RANK", "0")), world)\n', "",
          ("tests/test_bad_input.py::"
           "test_a_shard_whose_bytes_changed_stops_03_and_a_verified_one_is_not_hashed_again",),
          "03 trains on a shard whose bytes changed"),
    Plant("shipped-toy-byte-flipped", "eagle3nb/toy/shipped/smoke/config.json", '"hidden_act": "silu"',
          '"hidden_act": "gelu"',
          ("tests/test_toy.py::test_toy_paths_are_the_shipped_bytes_and_match_the_recipe",),
          "the shipped toy's bytes differ from its manifest"),
    Plant("recipe-changed-toy-stale", "eagle3nb/toy/build.py", "steps=560,", "steps=561,",
          ("tests/test_toy.py::test_toy_paths_are_the_shipped_bytes_and_match_the_recipe",),
          "the toy recipe changed but the shipped toy was not rebuilt"),
]


def copy_repo(dest: Path) -> None:
    """The tracked and untracked-but-not-ignored files (what a clone plus the working changes would hold)."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, names):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def apply(repo: Path, plant: Plant) -> None:
    path = repo / plant.file
    text = path.read_text()
    if text.count(plant.old) != 1:
        raise LookupError(f"{plant.file}: the planted text occurs {text.count(plant.old)} times (expected once): "
                          f"move the plant {plant.name!r} with the code")
    path.write_text(text.replace(plant.old, plant.new))


def run_plant(plant: Plant, log_dir: Path) -> tuple[str, float]:
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix=f"plant-{plant.name}-") as tmp:
        repo = Path(tmp)
        copy_repo(repo)
        try:
            apply(repo, plant)
        except LookupError as e:
            return f"STALE {e}", time.time() - t0
        env = {**os.environ, "PYTHONPATH": str(repo), "EAGLE3NB_ROOT": str(repo),
               "EAGLE3NB_CACHE": os.environ.get("EAGLE3NB_CACHE", str(ROOT / ".cache"))}
        log = log_dir / f"{plant.name}.log"
        with open(log, "w") as f:
            rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                  *plant.tests], cwd=repo, env=env, stdout=f, stderr=subprocess.STDOUT)
    # pytest: 1 = tests failed (caught); 0 = all passed (uncaught); anything else is an error of the run itself
    verdict = {0: "UNCAUGHT", 1: "caught"}.get(rc, f"ERROR (pytest exit {rc})")
    return f"{verdict}  [log: {log}]", time.time() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated plant names (default: all)")
    ap.add_argument("--list", action="store_true", help="print the plants and their tests, run nothing")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/eagle3nb-plants"), help="folder for each run's log")
    args = ap.parse_args(argv)
    plants = [p for p in PLANTS if not args.only or p.name in args.only.split(",")]
    if args.only and len(plants) != len(args.only.split(",")):
        ap.error(f"unknown plant in {args.only!r}: use {', '.join(p.name for p in PLANTS)}")
    if args.list:
        for p in plants:
            print(f"{p.name:32} {p.why}\n{'':32} -> {' '.join(p.tests)}")
        return 0
    args.logs.mkdir(parents=True, exist_ok=True)
    bad = []
    for p in plants:
        verdict, seconds = run_plant(p, args.logs)
        print(f"{p.name:32} {seconds:5.0f}s  {verdict}", flush=True)
        if not verdict.startswith("caught"):
            bad.append(p.name)
    print(f"{len(plants) - len(bad)}/{len(plants)} plants caught" + (f"; not caught: {', '.join(bad)}" if bad
                                                                     else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
