"""06_select's work, ``run(P) -> metrics``: the draft that pays, chosen by served throughput at the user's load
(docs/select.md). Candidate recipes are trained by 03 on the run's data within a budget, each served on the user's
engine beside the plain target at the user's concurrencies, and the one that serves the most at the load is written
as the run's draft with its serve command. Each step keeps its result: 02 and 03 resume on their own, each
(candidate, concurrency) measurement is written when it lands and reused, so a resume after a kill redoes only what
did not finish."""

from __future__ import annotations

import shutil
from typing import Any

from eagle3nb import track
from eagle3nb.data.head import text_config
from eagle3nb.progress import Progress, one_writer, write_json_atomic
from eagle3nb.select import candidates, measure
from eagle3nb.select.engines import serve_command, start
from eagle3nb.select.load import load_weights
from eagle3nb.select.params import STAGE, SelectParams
from eagle3nb.select.pick import choose
from eagle3nb.select.report import save_figures, verdict_lines
from eagle3nb.select.summary import candidate_rows, plain_levels, spread
from eagle3nb.select.training import train_all


def run(P: SelectParams) -> dict[str, Any]:
    """The whole stage; writes ``metrics.json``, the figure and, when a candidate pays, its draft in ``draft/``.
    Returns the metrics as written."""
    out = P.stage_dir
    with one_writer(out, STAGE):
        return _run(P, out)


def _run(P: SelectParams, out) -> dict[str, Any]:
    # 1. The candidates (the user's list, or every registered method's recipes), the trainings they share (a chain
    #    drafter's k is served, not trained) and the extractions those read, all of 03's settings checked first
    target = text_config(P.model_dir)
    plan = candidates.plan(P.candidates, P.train, P.method_settings, target["num_hidden_layers"],
                           target["vocab_size"], P.hidden, P.params_file or STAGE)
    for c in plan.candidates:
        how = f"the draft {c.draft} as it is" if c.draft else \
            f"training {c.training}, states {plan.trainings[c.training].need}"
        print(f"[06_select] candidate {c.name}: {how}", flush=True)
    # 2. Training within the budget: 02 once per extraction, 03 once per training, each resuming on its own
    costs = train_all(P, plan, out)
    # 3. Served on the user's engine: the plain server up for the whole run, each candidate's server in turn, every
    #    (candidate, concurrency) cell paired with the plain server's rate just before it and kept as it lands;
    #    then each candidate's acceptance length both ways from requests sent one at a time
    sent = measure.Sent(P)
    rounds = out / "rounds" / "plain.jsonl" if P.engine == "vllm" else None
    plain = measure.Lazy(lambda: start(P, rounds=rounds), candidate=False)
    progress = Progress(out, len(plan.candidates) * len(P.concurrencies), "serving candidates", "cells")
    results: dict[str, dict[str, Any]] = {}
    try:
        for c in plan.candidates:
            cost = costs.get(c.training) or {}
            if "skipped" in cost or "refused" in cost:  # left out by the budget, or refused when probed
                results[c.name] = {k: cost[k] for k in ("skipped", "refused") if k in cost}
                progress.update(len(P.concurrencies))
                continue
            draft = c.draft or out / "train" / c.training / "draft"
            results[c.name] = measure.serve(P, c, draft, plain, sent, out, progress)
    finally:
        plain.stop()
    progress.close()
    # 4. The user's load: the weight of each concurrency (given, equal, or a traffic log's by Little's law on the
    #    plain server's measured rates)
    levels = plain_levels(results)
    weights, load, traffic = load_weights(P, {int(c): v["requests_per_s"] for c, v in levels.items()})
    print(f"[06_select] the load: {load}; weights " + ", ".join(f"c={c} {w:.2f}" for c, w in weights.items()),
          flush=True)
    # 5. The pick: the highest weighted mean speedup at the load (never tau), or plain serving when none pays
    pick = choose(results, weights, load)
    # 6. The winner as the run's draft (a copy of its export), with the command that serves it
    rows = candidate_rows(plan, costs, results, weights, pick["name"])
    winner = next((r for r in rows if r["name"] == pick["name"]), None)
    drafted = out / "draft"
    shutil.rmtree(drafted, ignore_errors=True)
    if winner is not None:
        shutil.copytree(winner["draft"], drafted)
        pick.update(method=winner["method"], k=winner["k"], draft=str(drafted),
                    serve_command=serve_command(P, drafted, winner["k"]))
    cost = (winner or {}).get("cost") or {}
    # 7. metrics.json (with what 04 reads beside a draft: the held-out share and longest sequence of its training,
    #    its data), the figure, the trackers
    metrics = {"stage": STAGE, "run_name": P.run_name, "model_path": P.model_path, "engine": P.engine,
               "concurrencies": P.concurrencies, "weights": {str(c): w for c, w in weights.items()}, "load": load,
               "traffic": traffic, "plain": levels, "plain_spread": spread(levels), "pick": pick,
               "candidates": rows, "budget_minutes": P.budget_minutes, "steps": P.steps,
               "trained_s": sum(c.get("wall_s", 0.0) + c.get("extract_s", 0.0) for c in costs.values()),
               "holdout_fraction": cost.get("holdout_fraction"),
               "longest_train_sequence": cost.get("longest_train_sequence"), "data_dir": cost.get("data_dir")}
    write_json_atomic(out / "metrics.json", metrics)
    save_figures(out, metrics)
    print("\n".join(verdict_lines(metrics)), flush=True)
    track.stage_done(P)
    return metrics
