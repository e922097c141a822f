"""An engine endpoint predicted from its own step costs: the profile of its served rounds.

vLLM started with the project's plugin and ``EAGLE3NB_VLLM_ROUNDS=<file>`` (``start_vllm(..., rounds=)``; an
endpoint's ``rounds`` in 04's params) appends one line per engine step (``eagle3nb_vllm_fixes/rounds.py``): the
target's forward, sampling, the drafter's proposal, the rest of the step and the engine loop's gap before it. The
sweep keeps, per level, the summary of the steps inside that level's window (:func:`summarize`). The speedup at
concurrency c then follows from costs, not from the measured speedup::

    plain:  T_p(c) = requests x (arrival_p + outside_p)(r) + decode tokens / r          x period_p(r)
    spec:   T_s(c) = requests x (arrival_s + outside_s)(r) + decode tokens / (r x tau)  x period_s(r)
    speedup(c) = T_p(c) / T_s(c)        (the same prompts and output tokens on both sides)

with r the requests decoding in a step, ``period = forward + draft + sample + other + gap`` the cost of one decode
step (plain) or round (spec), prefill chunks riding along included, ``arrival`` the time a request spends in steps
where nothing decodes (its prefill alone, the engine's idle wait for it) and ``outside`` its share of the level's
wall time no engine step covers (the client's and the API server's time before the first step and after the last).
Each part is a line in r fitted over the endpoint's measured levels; a level's prediction is made with that level
left out of the fits (a leave-one-out forecast, so a measured level is never its own prediction), and the crossover
is where the all-levels fit falls below 1x.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The parts of a decode step or round, as the profile names them ("other": the step minus the three timed parts:
# input preparation, the runner's bookkeeping)
PARTS = ("forward", "draft", "sample", "other", "gap")
# The costs a request pays once: its arrival (prefill step, the wait for it) and its share of the level's time
# outside every engine step
PER_REQUEST = ("arrival", "outside")


def read_rounds(path: str | Path, start: float, end: float) -> list[dict[str, Any]]:
    """The profile lines of steps that started in [start, end] (wall-clock seconds)."""
    lines = []
    with open(path) as f:
        for raw in f:
            if raw.strip():
                line = json.loads(raw)
                if start <= line["t"] <= end:
                    lines.append(line)
    return lines


def summarize(lines: Sequence[dict[str, Any]], requests: int, seconds: float) -> dict[str, Any] | None:
    """One level's costs from its steps (the level: ``requests`` requests in ``seconds`` of wall time).

    A step in which some request decodes is a decode step (a plain step, or a speculative round), whatever else it
    carries (another request's prefill chunk rides along and is part of its cost): each part's mean over those
    steps (the first step's gap is the idle time before the level, so gaps are taken from the second step on),
    ``reqs`` the mean number of requests decoding in one (what makes its tokens). Per request: ``arrival``, the
    seconds of steps in which nothing decodes (prefill alone) and the gaps before them, and ``outside``, the
    level's seconds outside every step (the client and the API server before the first step and after the last:
    what the engine's profile cannot see). None: no decode step was recorded (an endpoint started without the
    profile)."""
    decoding = [x["decoding"] for x in lines]
    decode = [x for x, d in zip(lines, decoding) if d]
    if not decode:
        return None
    n = len(decode)
    out: dict[str, Any] = {"decode_steps": n, "steps": len(lines), "reqs": sum(d for d in decoding if d) / n,
                           "width": sum(x["width"] for x in decode) / n}
    for part in ("forward", "draft", "sample"):
        out[part] = sum(x[part] for x in decode) / n
    out["other"] = sum(x["step"] - x["forward"] - x["draft"] - x["sample"] for x in decode) / n
    gaps = [x["gap"] for x, d in zip(lines[1:], decoding[1:]) if d and x["gap"] is not None]
    out["gap"] = sum(gaps) / len(gaps) if gaps else 0.0
    out["period"] = sum(out[p] for p in PARTS)
    rest = [x for x, d in zip(lines[1:], decoding[1:]) if not d]
    out["arrival"] = sum(x["step"] + (x["gap"] or 0.0) for x in rest) / max(1, requests)
    inside = lines[0]["step"] + sum(x["step"] + (x["gap"] or 0.0) for x in lines[1:])
    out["outside"] = max(0.0, seconds - inside) / max(1, requests)
    return out


def line_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(a, b) of y = a + b*x by least squares; one point (or one distinct x) gives the constant through its mean."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def _fits(rows: Sequence[dict[str, Any]]) -> dict[str, tuple[float, float]]:
    """Each part's line in r (requests per decode step) over the rows' engine summaries."""
    return {p: line_fit([(r["engine"]["reqs"], r["engine"][p]) for r in rows]) for p in (*PARTS, *PER_REQUEST)}


def _at(fits: dict[str, tuple[float, float]], part: str, r: float) -> float:
    a, b = fits[part]
    return max(0.0, a + b * r)


def level_time(fits: dict[str, tuple[float, float]], r: float, requests: int, tokens: int, per_step: float
               ) -> dict[str, float]:
    """A level's predicted seconds and its parts: each request's arrival and outside time, then the decode tokens
    (all but each request's first, which its prefill makes) in steps of ``r x per_step`` tokens."""
    steps = max(0, tokens - requests) / (r * per_step)
    parts = {p: steps * _at(fits, p, r) for p in PARTS}
    parts.update({p: requests * _at(fits, p, r) for p in PER_REQUEST})
    return {"seconds": sum(parts.values()), "steps": steps, **parts}


def profiled(rows: Sequence[dict[str, Any]]) -> bool:
    """Every row carries an engine summary (its endpoint was served with the rounds profile)."""
    return bool(rows) and all(r.get("engine") for r in rows)


def predict_profiled(base: Sequence[dict[str, Any]], spec: Sequence[dict[str, Any]], tau: float | None,
                     max_c: int) -> dict[str, Any] | None:
    """One speculative series predicted from both endpoints' profiles: each measured level forecast with that
    level left out of the fits (``error`` beside the measured speedup), the round's cost in plain steps at each
    level (its parts, what explains the speedup), and the predicted crossover (all levels fitted; searched up to
    ``max_c``, requests and tokens per request as at the highest measured level). None: fewer than three levels
    profiled on both sides (a left-out forecast needs two to fit)."""
    by_c = {r["concurrency"]: r for r in base if r.get("engine")}
    pairs = sorted(((by_c[s["concurrency"]], s) for s in spec if s.get("engine") and s["concurrency"] in by_c
                    and (s.get("acceptance_length") or tau)), key=lambda p: p[0]["concurrency"])
    if len(pairs) < 3:
        return None
    k = int(pairs[0][1]["k"])
    levels = []
    for i, (b, s) in enumerate(pairs):
        rest = [p for j, p in enumerate(pairs) if j != i]
        fb, fs = _fits([p[0] for p in rest]), _fits([p[1] for p in rest])
        t = s.get("acceptance_length") or tau
        tp = level_time(fb, b["engine"]["reqs"], b["requests"], b["output_tokens"], 1.0)
        ts = level_time(fs, s["engine"]["reqs"], s["requests"], s["output_tokens"], t)
        predicted = tp["seconds"] / ts["seconds"] * s["output_tokens"] / max(1, b["output_tokens"])
        round_cost = {p: s["engine"][p] / b["engine"]["period"] for p in PARTS}
        levels.append({"concurrency": b["concurrency"], "measured": s["speedup"], "predicted": predicted,
                       "error": predicted / s["speedup"] - 1, "tau": t,
                       "plain_step_s": b["engine"]["period"], "round_s": s["engine"]["period"],
                       "round_in_plain_steps": sum(round_cost.values()), "round_parts": round_cost})
    fb, fs = _fits([p[0] for p in pairs]), _fits([p[1] for p in pairs])
    top_b, top_s = pairs[-1]  # past the measured levels: each request as there, r = c x the fill measured there
    per_request = top_b["output_tokens"] / max(1, top_b["requests"])
    fill_b, fill_s = (top["engine"]["reqs"] / top["concurrency"] for top in (top_b, top_s))
    t_top = top_s.get("acceptance_length") or tau

    def at(c: int) -> float:
        return (level_time(fb, c * fill_b, 1, per_request, 1.0)["seconds"]
                / level_time(fs, c * fill_s, 1, per_request, t_top)["seconds"])

    crossover = next((c for c in range(1, max_c + 1) if at(c) < 1.0), None)
    return {"endpoint": top_s["endpoint"], "k": k, "from": "profile of the served rounds (leave-one-out)",
            "levels": levels, "predicted_crossover": crossover,
            "max_error": max(abs(lv["error"]) for lv in levels)}
