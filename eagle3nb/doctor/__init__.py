"""eagle3nb doctor: catch the known causes of a useless drafter before the long run, and explain a low
acceptance after it.

Each check is a function of one ``Context`` (a run's params and whatever artifacts exist) in
``eagle3nb.doctor.checks`` and returns one ``CheckResult``: pass / warn / fail / skip, what was measured and,
for anything but pass, what to do. A check that lacks what it needs says so (skip) instead of guessing.

    eagle3nb doctor params/<run>/ [--stage NN] [--json] [--serving-engine vllm|sglang]

In a notebook, at the start of a stage: ``eagle3nb.doctor.check_stage("01_synth", P)``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagle3nb.doctor import checks
from eagle3nb.doctor.checks.causes import rank_causes, short
from eagle3nb.doctor.context import Context
from eagle3nb.doctor.result import (
    CHECKS,
    FAIL,
    PASS,
    SKIP,
    STAGE_CHECKS,
    WARN,
    CheckResult,
    DoctorError,
    Report,
    render,
    summary,
)
from eagle3nb.errors import InputError
from eagle3nb.params import STAGES

__all__ = ["CHECKS", "STAGE_CHECKS", "PASS", "WARN", "FAIL", "SKIP", "CheckResult", "Report", "DoctorError",
           "render", "summary", "run_checks", "check_stage", "likely_causes"]

def _normalize_stage(stage: str) -> str:
    for s in STAGES:
        if stage in (s, s[:2], s.split("_", 1)[1]):
            return s
    raise InputError(f"unknown stage {stage!r}: use one of {', '.join(STAGES)} (or its number)")


def run_checks(params_dir: str | Path, stage: str | None = None, *, serving_engine: str = "vllm",
               serving_thinking: bool | None = None, server_url: str | None = None,
               timeout_s: float = 60.0) -> Report:
    """Every check the run's artifacts allow (only the stage's checks when ``stage`` is given).

    ``serving_engine`` is the engine that will serve the draft (layer-id convention); ``serving_thinking``
    the thinking mode serving will ask for (default: the server's default, probed); ``server_url`` overrides
    01_synth's ``vllm_url`` (e.g. a server the notebook already started)."""
    stage = _normalize_stage(stage) if stage else None
    ctx = Context.from_run_dir(Path(params_dir), serving_engine=serving_engine, serving_thinking=serving_thinking,
                               server_url=server_url, timeout_s=timeout_s)
    return _run(ctx, STAGE_CHECKS[stage] if stage else CHECKS)


def check_stage(stage: str, params: Any, *, strict: bool = False, serving_engine: str = "vllm",
                serving_thinking: bool | None = None, server_url: str | None = None,
                timeout_s: float = 60.0) -> Report:
    """The check-up a notebook runs before its stage's work, from the stage's validated params ``P``
    (the other stages' params come from the same run folder when ``P.params_file`` is in one).
    ``strict`` raises DoctorError on any fail."""
    stage = _normalize_stage(stage)
    ctx = Context.from_stage(stage, params, serving_engine=serving_engine, serving_thinking=serving_thinking,
                             server_url=server_url, timeout_s=timeout_s)
    report = _run(ctx, STAGE_CHECKS[stage])
    if strict and report.failed:
        raise DoctorError(stop_line(stage, report.failed) + "\n" + render(report.failed))
    return report


def stop_line(stage: str, failed: list[CheckResult]) -> str:
    """The first line of a failed check-up's stop: the first failure and its fix, since a terminal (papermill's,
    ``eagle3nb run``'s log) often shows nothing more."""
    first = failed[0]
    fix = f" -> {first.fix}" if first.fix else ""
    more = f" ({len(failed) - 1} more failed below)" if len(failed) > 1 else ""
    return (f"{stage}: the check-up failed: {first.name}: {short(first.measured, 300)}{fix}{more}; fix before the "
            f"run (or pass strict=False)")


def _run(ctx, names: list[str]) -> Report:
    report = Report(ctx.params_problems())
    ctx.use_server = "server" in names
    with ctx:
        for name in names:
            report.append(checks.run_one(name, ctx, prior=list(report)))
    return report


def likely_causes(results: list[CheckResult]) -> list[str]:
    """Causes of a low acceptance, likeliest first, from a check-up's results (used by draft_sanity and
    by the acceptance notebook's verdict)."""
    return rank_causes(results)


def _cmd(args: argparse.Namespace) -> int:
    thinking = None if args.serving_thinking is None else args.serving_thinking == "on"
    # what the libraries print on the way (a toy build, progress) goes to stderr: stdout is the report
    with contextlib.redirect_stdout(sys.stderr):
        report = run_checks(args.params_dir, args.stage, serving_engine=args.serving_engine,
                            serving_thinking=thinking, server_url=args.server_url, timeout_s=args.timeout)
    if args.json:
        print(json.dumps([asdict(r) for r in report], indent=2, default=str))
    else:
        print(render(report))
    return 1 if report.failed else 0


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="check a run's setup and artifacts for the known causes of a bad drafter",
                              description="Check a run's setup and artifacts for the known causes of a useless "
                                          "drafter before the long run (the target's family, the server's reasoning "
                                          "and token stream, thinking mode, layer ids, vocabulary, data, disk), and "
                                          "explain a low acceptance after it (draft sanity, the causes ranked). "
                                          "Exit 1 when a check fails.")
    p.add_argument("params_dir", help="the run's parameter folder, e.g. params/demo/")
    p.add_argument("--stage", help="only the checks for this stage (01, 02_hidden_states, ...)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--serving-engine", choices=["vllm", "sglang"], default="vllm",
                   help="engine that will serve the draft: decides the layer-id convention (default vllm)")
    p.add_argument("--serving-thinking", choices=["on", "off"],
                   help="thinking mode serving will use (default: the server's default, probed)")
    p.add_argument("--server-url", help="check this server instead of 01_synth's vllm_url")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per network probe (default 60)")
    p.set_defaults(func=_cmd)
