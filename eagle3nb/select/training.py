"""The candidates' training, within the stated budget: 02 once per extraction the trainings need, then 03 once per
training, each run through the stages' public entry (``eagle3nb.stage_cli.run_stage``) under the run's name into
this stage's folder, so each resumes on its own after a kill. The cost of each training (03's steps and tokens/s,
the wall seconds of the run that finished it) is kept beside it; once the wall-time budget is spent, the trainings
left are not started (and say so)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from eagle3nb.drafts import ServingError, rules
from eagle3nb.errors import UserError
from eagle3nb.params import from_dict
from eagle3nb.progress import Progress, write_json_atomic
from eagle3nb.select.candidates import Plan, Training
from eagle3nb.select.engines import refusal, start
from eagle3nb.stage_cli import run_stage

COST = "cost.json"  # beside 03's folder: what its training cost


def sub_stage(stage: str, P, values: dict[str, Any]) -> Path:
    """Run ``stage`` with ``values`` under this run's name; its output folder."""
    sp = from_dict(stage, {"run_name": P.run_name, **{k: str(v) if isinstance(v, Path) else v for k, v in
                                                       values.items()}})
    run_stage(sp)
    return sp.stage_dir


def extract(P, plan: Plan, need: str, out: Path) -> Path:
    """02 over the run's 01 samples for one extraction (its layers as its method's recipe reads them, its
    vocabulary), into ``out/hidden/<need>``."""
    n = plan.needs[need]
    return sub_stage("02_hidden_states", P, {**P.hidden, "model_path": P.model_path, "synth_dir": P.synth_path,
                                             "trust_remote_code": P.trust_remote_code, "family": P.family,
                                             "draft_method": n.method, "draft_num_layers": n.num_layers,
                                             "draft_vocab_size": n.vocab, "output_dir": out / "hidden" / need})


def probe(P, training: Training, data: Path, out: Path) -> str | None:
    """Whether vLLM serves this training's method at all, asked before its hours of training when the registry says
    vLLM drafts the method in one model runner only (``MethodRules.v2_only``: its CPU build has no Triton for it):
    03 trains one step into ``train/<slug>-probe/`` and vLLM is started on that draft. The engine's own reason when
    it refuses (kept in ``probe.json``, so a resume does not ask again; a refusal by the project's own serving check
    is not kept, the code may change), else None."""
    if P.engine != "vllm" or not rules(training.settings["method"]).v2_only:
        return None
    folder = out / "train" / f"{training.slug}-probe"
    record = folder / "probe.json"
    if record.exists():
        return json.loads(record.read_text())["refused"]
    sub_stage("03_train", P, {**training.settings, "data_dir": data, "max_steps": 1, "eval_every": 0,
                              "output_dir": folder})
    try:
        start(P, folder / "draft", training.settings["num_speculative_tokens"]).stop()
        refused = None
    except (UserError, RuntimeError) as e:
        refused = refusal(e)
        if isinstance(e, ServingError):  # the project's own check, not the engine's: asked again on a resume
            return refused
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(record, {"refused": refused})
    return refused


def train_one(P, training: Training, data: Path, out: Path) -> dict[str, Any]:
    """03 for one training (``P.steps`` steps on ``data``), its cost written beside it: steps, 03's tokens/s, the
    wall seconds of the call that finished it (02's share not included), whether it resumed."""
    folder = out / "train" / training.slug
    cost_file = folder / COST
    if cost_file.exists() and (folder / "draft" / "config.json").exists():
        cost = json.loads(cost_file.read_text())
        if cost["steps"] == P.steps:
            return cost
    resumed = (folder / "checkpoints").is_dir() and any((folder / "checkpoints").iterdir())
    t0 = time.perf_counter()
    sub_stage("03_train", P, {**training.settings, "data_dir": data, "max_steps": P.steps, "output_dir": folder})
    metrics = json.loads((folder / "metrics.json").read_text())
    cost = {"steps": metrics["steps"], "tokens_per_s": metrics.get("tokens_per_s"),
            "wall_s": time.perf_counter() - t0, "resumed": resumed, "draft": str(folder / "draft"),
            "longest_train_sequence": metrics.get("longest_train_sequence"),
            "holdout_fraction": metrics.get("holdout_fraction"), "data_dir": str(data)}
    write_json_atomic(cost_file, cost)
    return cost


def train_all(P, plan: Plan, out: Path) -> dict[str, dict[str, Any]]:
    """Every training of the plan in order, each extraction made when its first training needs it: training slug
    -> its cost, ``{"skipped": why}`` for those the wall-time budget left out (the wall seconds of the trainings
    and extractions done so far, those of an earlier attempt included, against ``budget_minutes``), or
    ``{"refused": the engine's reason}`` for a method the engine refused to serve when probed (:func:`probe`)."""
    budget = P.budget_minutes * 60 if P.budget_minutes else None
    done: dict[str, dict[str, Any]] = {}
    data: dict[str, Path] = {}
    prog = Progress(out, len(plan.trainings), "training candidates", "trainings")
    for i, (slug, training) in enumerate(plan.trainings.items(), 1):
        spent = sum(c.get("wall_s", 0.0) + c.get("extract_s", 0.0) for c in done.values())
        finished = (out / "train" / slug / COST).exists()
        if budget is not None and spent >= budget and not finished:
            done[slug] = {"skipped": f"the wall-time budget ({P.budget_minutes:g} min) was spent before it started"}
            print(f"[06_select] training {i}/{len(plan.trainings)} ({', '.join(training.candidates)}): not started, "
                  f"{done[slug]['skipped']}", flush=True)
            prog.update(1)
            continue
        print(f"[06_select] training {i}/{len(plan.trainings)}: {', '.join(training.candidates)} ({P.steps} steps, "
              f"03 in {out / 'train' / slug})", flush=True)
        t0, fresh = time.perf_counter(), training.need not in data
        if fresh:
            data[training.need] = extract(P, plan, training.need, out)
        refused = None if finished else probe(P, training, data[training.need], out)
        if refused:
            print(f"[06_select] {', '.join(training.candidates)}: not served (asked with a one-step draft): "
                  f"{refused}; not trained", flush=True)
            done[slug] = {"refused": refused, "wall_s": time.perf_counter() - t0}
        else:
            done[slug] = train_one(P, training, data[training.need], out)
        if fresh and not finished:  # 02's time counts in the budget, charged to the training that made it run
            done[slug]["extract_s"] = time.perf_counter() - t0 - done[slug]["wall_s"]
        prog.update(1, trained=", ".join(training.candidates), wall_s=round(done[slug]["wall_s"], 1))
    prog.close()
    return done
