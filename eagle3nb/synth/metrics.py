"""01's ``metrics.json``: counts by status, tokens, token-id mismatches, latency and turns over every sample in
the output folder, plus the session's throughput."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from eagle3nb.data.samples import STATUSES
from eagle3nb.data.turns import turn_inputs
from eagle3nb.synth.resume import history_records, plan_conversation, planned_ids
from eagle3nb.synth.session import Session


def _percentiles(values: list[float]) -> dict[str, float] | None:
    import numpy as np

    if not values:
        return None
    a = np.asarray(values, dtype=float)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean()), "max": float(a.max())}


def collect_metrics(stage_dir: Path, prompts: list[dict], session: Session, torn: list[str]) -> dict[str, Any]:
    """``metrics.json``: counts by status, tokens, token-id mismatches and latency over every sample in
    ``stage_dir`` (latest record per id; every sample that is not ``ok`` is counted with its reason), plus
    this session's throughput."""
    every = session.P.multi_turn == "every"
    recs = history_records(stage_dir, every)
    cut: Counter = Counter()
    for p in prompts:
        _, why, lost = plan_conversation(p, every, recs, retry_errors=False)
        if why:
            cut[why] += lost
    planned = [i for p in prompts for i in planned_ids(p, every)]
    counts = Counter(r["status"] for r in recs.values())
    ok = [r for r in recs.values() if r["status"] == "ok"]
    tokens = {k: sum(r["tokens"][k] for r in ok) for k in ("prompt", "reasoning", "content")}
    answered = [r for r in recs.values() if r["status"] != "error"]
    compared = [r["ids_match"] for r in ok if r.get("ids_match") is not None]  # what training will read
    errors = Counter(r["error"].split(":")[0] for r in recs.values() if r["status"] == "error" and r.get("error"))
    mine = session.records
    wall = max(session.t1 - session.t0, 1e-9) if mine else 0.0
    out_tokens = sum(r["tokens"]["reasoning"] + r["tokens"]["content"] for r in mine)
    concurrency = min(session.P.concurrency, len(session.todo)) if session.todo else 0
    in_flight = session.in_flight.mean()
    return {
        "samples": len(recs),
        "prompts": len(prompts),
        "multi_turn": session.P.multi_turn,
        "turns": turn_metrics(prompts, recs),
        "turns_cut": dict(cut),
        "missing": sum(i not in recs for i in planned) - sum(cut.values()),
        "counts": {s: counts.get(s, 0) for s in STATUSES},
        "tokens_ok": tokens,
        "mean_tokens_ok": {k: (v / len(ok) if ok else 0.0) for k, v in tokens.items()},
        "token_source": dict(Counter(r.get("token_source") for r in answered)),
        "ids_compared": len(compared),
        "ids_mismatch": compared.count(False),
        "errors": dict(errors),
        "latency_s": _percentiles([r["latency_s"] for r in answered]),
        "session": {
            "samples": len(mine),
            "wall_s": wall,
            "requests_per_s": len(mine) / wall if wall else 0.0,
            "output_tokens_per_s": out_tokens / wall if wall else 0.0,
            "retries": sum(r.get("attempts", 1) - 1 for r in mine),
            "concurrency": concurrency,
            "in_flight_mean": in_flight,
            "in_flight_ratio": in_flight / concurrency if concurrency else None,
        },
        "torn_lines": torn,
    }


def turn_metrics(prompts: list[dict], recs: dict[str, dict]) -> dict[str, Any]:
    """How many turns the conversations hold and how many the training data answers: with ``last``, every turn
    but the last is the dataset's own text and trains nothing."""
    in_data = sum(len(turn_inputs(p["conversation"])) for p in prompts)
    ok = [r for r in recs.values() if r["status"] == "ok"]
    return {"conversations": len(prompts), "in_prompts": in_data, "multi_turn_conversations":
            sum(len(turn_inputs(p["conversation"])) > 1 for p in prompts),
            "answered_ok": len(ok), "first_ok": sum(r.get("turn", 1) == 1 for r in ok),
            "untrained": in_data - len(ok)}
