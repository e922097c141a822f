"""Stage 01 (``notebooks/01_synth.ipynb``, ``python -m eagle3nb.synth params/<run>/``): prompts in, one JSON
line per answered prompt out (per answered turn with ``multi_turn: every``), exactly once per id; ``run(P)`` also
writes ``metrics.json`` and the figures. The steps live in ``plan`` (where a run resumes), ``session`` (the
requests in flight, the writer thread, a clean stop on Ctrl-C / SIGTERM) and ``metrics``; ``probe.ask(P)`` asks one
question before a long run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3nb import track
from eagle3nb.data.prompts import load_prompts
from eagle3nb.data.samples import check_run_config, exclusive
from eagle3nb.data.stream import Template
from eagle3nb.progress import Progress, write_json_atomic
from eagle3nb.synth import report
from eagle3nb.synth.metrics import collect_metrics
from eagle3nb.synth.params import STAGE, SynthParams
from eagle3nb.synth.resume import history_records, needs_request, plan_conversation, planned_ids
from eagle3nb.synth.session import Session, SynthError


def run(P: SynthParams) -> dict[str, Any]:
    """Answer every prompt not yet answered in ``P.stage_dir``; writes ``metrics.json`` and the report's
    figures (PNG) beside the samples and returns the metrics.
    Raises SynthError with the fix when the server or template cannot give faithful data, and
    KeyboardInterrupt after a clean stop on Ctrl-C / SIGTERM."""
    # 1. The prompts, the target's template and the settings, checked before anything starts.
    stage_dir = P.stage_dir
    prompts = load_prompts(P.prompts, P.max_samples)
    if P.multi_turn == "last":
        unanswered = next((p["id"] for p in prompts if len(p["messages"]) < len(p["conversation"])
                           and any(m["role"] == "user" for m in p["conversation"][len(p["messages"]):])), None)
        if unanswered is not None:
            raise SynthError(f"prompt {unanswered!r} has user turns without an answer between them (MT-Bench's shape); "
                             f"set multi_turn: every so the target answers each turn after its own earlier answers")
    model_dir = P.model_dir
    tpl = Template(model_dir, P.thinking, P.thinking_kwarg, P.trust_remote_code, P.target_family)
    P.api_key()  # a missing key variable is an error before anything starts
    early = P.data_config()
    if P.served_model_name is None:
        early.pop("served_model_name")
    check_run_config(stage_dir, early, P.force, write=False)
    with exclusive(stage_dir):
        return _answer(P, prompts, model_dir, tpl)


def _answer(P: SynthParams, prompts: list[dict], model_dir: Path, tpl: Template) -> dict[str, Any]:
    """The run proper, with the output folder to ourselves."""
    # 2. Where to resume: the records already on disk, the turns still to ask.
    stage_dir = P.stage_dir
    torn: list[str] = []
    every = P.multi_turn == "every"
    done = history_records(stage_dir, every, torn)
    todo = [job for p in prompts if (job := plan_conversation(p, every, done, P.retry_errors)[0]) is not None]
    planned = [i for p in prompts for i in planned_ids(p, every)]
    answered = sum(not needs_request(done.get(i), P.retry_errors) for i in planned)
    print(f"01_synth: {len(prompts)} prompts" + (f" ({len(planned)} turns)" if every else "")
          + f", {answered} already answered in {stage_dir}"
          + (f" (torn last line skipped: {', '.join(torn)})" if torn else ""), flush=True)

    # 3. The session: every turn still to ask, answers appended as they come; the metrics whatever happened.
    progress = Progress(stage_dir, total=len(planned), desc=STAGE, unit="turn" if every else "sample", done=answered)
    session = Session(P, tpl, todo, progress)
    state = "failed"
    try:
        session.answer(model_dir)
        state = "done"
    except KeyboardInterrupt:
        state = "stopped"
        raise
    finally:
        metrics = collect_metrics(stage_dir, prompts, session, torn)
        write_json_atomic(stage_dir / "metrics.json", metrics)
        progress.metrics.update({k: metrics[k] for k in ("counts", "ids_mismatch")})
        progress.close(state)

    # 4. The figures, the trackers and the summary line.
    report.save_figures(stage_dir)
    track.stage_done(P)
    print(report.summary(metrics), flush=True)
    return metrics
