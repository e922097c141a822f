"""04's prediction of an engine endpoint from the profile of its served rounds (eagle3nb/accept/forecast.py), on
profiles written by a known engine: every part of a step linear in the requests it serves, the level's wall time the
sum of its steps. The summaries recover the parts, each level's left-out forecast is its measured speedup, and the
crossover is where the engine's own speedup falls below 1x."""

from __future__ import annotations

import json

import pytest

K, TAU = 3, 2.6
REQUESTS, TOKENS = 16, 40  # per level: requests, output tokens per request
LEVELS = [1, 2, 4, 8, 16]
# seconds per decode step as (fixed, per request) for each part; a round verifies K+1 tokens per request
PLAIN = {"forward": (0.010, 0.0010), "draft": (0.0, 0.0), "sample": (0.001, 0.0001), "other": (0.002, 0.0004),
         "gap": (0.003, 0.0002)}
SPEC = {"forward": (0.011, 0.0010 * (K + 1)), "draft": (0.008, 0.0015), "sample": (0.002, 0.0003),
        "other": (0.004, 0.0006), "gap": (0.003, 0.0003)}
PREFILL = (0.020, 0.005)  # a request's prefill step and the gap before it
BEFORE, AFTER = 0.05, 0.03  # a level's seconds before its first step and after its last (client, API server)


def part(costs: dict, name: str, r: float) -> float:
    a, b = costs[name]
    return a + b * r


def level_lines(costs: dict, c: int, per_step: float, t0: float) -> list[dict]:
    """A level's profile from t0: each request's prefill, then decode steps of c requests making c x per_step
    tokens; each line's gap is the engine's time before it."""
    lines = [{"width": 30, "reqs": 1, "drafted": 0, "decoding": 0, "decode": False, "gap": PREFILL[1],
              "forward": PREFILL[0], "sample": 0.0, "draft": 0.0, "step": PREFILL[0]} for _ in range(REQUESTS)]
    for _ in range(round(REQUESTS * (TOKENS - 1) / (c * per_step))):
        p = {n: part(costs, n, c) for n in costs}
        lines.append({"width": c * (K + 1 if per_step > 1 else 1), "reqs": c, "drafted": 0, "decoding": c,
                      "decode": True,
                      "gap": p["gap"], "forward": p["forward"], "sample": p["sample"], "draft": p["draft"],
                      "step": p["forward"] + p["sample"] + p["draft"] + p["other"]})
    t = t0
    for i, x in enumerate(lines):
        t += x["gap"] if i else 0.0
        x["t"] = t
        t += x["step"]
    return lines


def engine_speedup(c: float) -> float:
    """The engine's own speedup at concurrency c: both sides' seconds for the same requests and tokens."""
    def seconds(costs, per_step):
        decode = REQUESTS * (TOKENS - 1) / (c * per_step) * sum(part(costs, n, c) for n in costs)
        return BEFORE + AFTER + REQUESTS * sum(PREFILL) - PREFILL[1] + decode
    return seconds(PLAIN, 1.0) / seconds(SPEC, TAU)


def sweep(tmp_path) -> list[dict]:
    """Rows as 04's sweep writes them, each with its level's summary read back from a written profile."""
    from eagle3nb.accept.forecast import read_rounds, summarize

    rows, t0 = [], 1000.0
    for label, costs, per_step in (("vllm", PLAIN, 1.0), ("vllm-eagle3", SPEC, TAU)):
        path = tmp_path / f"{label}.jsonl"
        for c in LEVELS:
            lines = level_lines(costs, c, per_step, t0)
            with open(path, "a") as f:
                f.writelines(json.dumps(x) + "\n" for x in lines)
            start, end = t0 - BEFORE, lines[-1]["t"] + lines[-1]["step"] + AFTER
            engine = summarize(read_rounds(path, start, end), REQUESTS, end - start)
            rows.append({"endpoint": label, "k": K if per_step > 1 else None, "concurrency": c,
                         "requests": REQUESTS, "output_tokens": REQUESTS * TOKENS, "engine": engine,
                         "output_tokens_per_s": REQUESTS * TOKENS / (end - start),
                         "acceptance_length": TAU if per_step > 1 else None})
            t0 = end + 50.0  # idle between levels: outside every window
    base = {r["concurrency"]: r["output_tokens_per_s"] for r in rows if r["k"] is None}
    for r in rows:
        r["speedup"] = r["output_tokens_per_s"] / base[r["concurrency"]]
    return rows


def test_a_level_summary_recovers_the_parts_of_its_steps(tmp_path):
    rows = sweep(tmp_path)
    for r in rows:
        costs = SPEC if r["k"] else PLAIN
        e = r["engine"]
        assert e["reqs"] == r["concurrency"] and e["steps"] == e["decode_steps"] + REQUESTS
        for name in costs:
            assert e[name] == pytest.approx(part(costs, name, r["concurrency"]))
        assert e["arrival"] == pytest.approx(sum(PREFILL) * (REQUESTS - 1) / REQUESTS)  # the first gap is idle
        assert e["outside"] == pytest.approx((BEFORE + AFTER) / REQUESTS)  # the level's ends, outside every step


def test_each_level_is_forecast_from_the_others_and_the_crossover_is_the_engines(tmp_path):
    from eagle3nb.accept.concurrency import MAX_PREDICTED, concurrency_verdict

    rows = sweep(tmp_path)
    got = concurrency_verdict(rows, "vllm")
    (series,) = got["series"]
    assert series["k"] == K and series["from"].startswith("profile")
    for lv in series["levels"]:
        assert lv["predicted"] == pytest.approx(engine_speedup(lv["concurrency"]), rel=0.02)
        assert lv["predicted"] == pytest.approx(lv["measured"], rel=0.02)
        assert lv["round_in_plain_steps"] == pytest.approx(
            sum(part(SPEC, n, lv["concurrency"]) for n in SPEC) / sum(part(PLAIN, n, lv["concurrency"]) for n in PLAIN))
    cross = series["predicted_crossover"]
    assert cross is not None and cross <= MAX_PREDICTED
    assert engine_speedup(cross) < 1.0 <= engine_speedup(cross - 1)
    assert got["predicted_crossover"] == cross


def test_a_profile_on_fewer_than_three_levels_falls_back_to_the_step_cost_fit(tmp_path):
    from eagle3nb.accept.concurrency import concurrency_verdict

    rows = [r for r in sweep(tmp_path) if r["concurrency"] in (1, 2)]
    (series,) = concurrency_verdict(rows, "vllm")["series"]
    assert "from" not in series and series["fitted_at"] == 1


def test_the_verdict_says_where_a_round_goes_from_the_profile(tmp_path):
    from eagle3nb.accept.concurrency import concurrency_verdict
    from eagle3nb.accept.verdict import concurrency_rows

    conc = concurrency_verdict(sweep(tmp_path), "vllm")
    why = dict(concurrency_rows(conc))["Why, from vllm-eagle3's profile"]
    first, last = conc["series"][0]["levels"][0], conc["series"][0]["levels"][-1]
    for lv in (first, last):
        assert f"at concurrency {lv['concurrency']} a round costs {lv['round_in_plain_steps']:.2f}" in why
        assert f"the draft {lv['round_parts']['draft']:.2f}" in why and f"measured {lv['measured']:.2f}x" in why
