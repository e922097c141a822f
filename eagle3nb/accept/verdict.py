"""04's verdict in plain words: the acceptance, what it means at each concurrency, and the likeliest causes when
it is low, from the stage's metrics and the doctor's check-up causes (passed in: the doctor sits above the
stages, so 04 never imports it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eagle3nb.accept.concurrency import series_label
from eagle3nb.accept.online import at_k

PUBLIC_KIMI = "public Kimi-K2.5 drafters reach tau 3.0-3.5 at k=3 (alpha ~0.85)"


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def _rate(alpha1: float) -> str:
    return "good" if alpha1 >= 0.7 else "fair" if alpha1 >= 0.4 else "low"


def likely_causes(metrics: dict[str, Any], checkup_causes: Sequence[str] | None = None) -> list[str]:
    """Likeliest causes of a low acceptance or a slowdown, each pointing to an ``eagle3nb doctor`` check.
    ``checkup_causes``: the doctor's causes from the stage's check-up, likeliest first (the notebook passes
    ``eagle3nb.doctor.likely_causes(checkup)``); its failed / warned checks come first, as evidence."""
    doctor = list(checkup_causes or [])
    causes = [c for c in doctor if " failed: " in c or " warned: " in c]  # evidence first
    off = metrics.get("offline") or {}
    alpha1 = off.get("per_position", [0.0])[0] if off else None
    seg = off.get("by_segment") or {}
    if alpha1 is not None and alpha1 < 0.2:
        causes.append("almost nothing is accepted even offline: the draft reads the wrong aux layers or a wrong "
                      "vocabulary map (doctor: layer_ids, shapes_vocab), or it is untrained (doctor: draft_sanity)")
    if "reasoning" in seg and "answer" in seg:
        r = seg["reasoning"]["greedy"]["per_position"][0]
        a = seg["answer"]["greedy"]["per_position"][0]
        if a - r > 0.15:
            causes.append(f"reasoning tokens are accepted far less than answer tokens ({r:.0%} vs {a:.0%}): the "
                          "training stream likely lost or mangled the reasoning (doctor: thinking, token_stream)")
    if alpha1 is not None and alpha1 < 0.5:
        causes.append("too little or unrepresentative training data for this draft (doctor: data_health)")
    online = [r for r in at_k(metrics.get("online") or [], off.get("k")) if r.get("acceptance_length")]
    if online and off:
        served = sum(r["acceptance_length"] for r in online) / len(online)
        if served < off["acceptance_length"] - 0.5:
            causes.append(f"the server accepts less than offline ({served:.2f} vs {off['acceptance_length']:.2f} "
                          "tokens per step): it runs the draft unlike training, e.g. aux ids in the other "
                          "engine's convention or another chat template / thinking mode (doctor: layer_ids, "
                          "server, thinking)")
    pred = (metrics.get("prediction") or {}).get("speedup")
    if pred is not None and pred < 1.0:
        causes.append(f"the acceptance cannot pay for drafting: tau {off['acceptance_length']:.2f} is less than the "
                      f"cost of a step with k={off['k']} drafts ({metrics['prediction']['formula']}); raise "
                      "acceptance first, or lower k")
    slow = [r for r in metrics.get("online") or [] if r.get("speedup") is not None and r["speedup"] < 0.95
            and r.get("endpoint") != metrics.get("online_baseline")]
    if slow and pred is not None and pred >= 1.0:
        levels = ", ".join(str(r["concurrency"]) for r in slow)
        causes.append(f"serving is slower than predicted ({pred:.2f}x) at concurrency {levels}: the verify pass of "
                      "k+1 tokens per request costs more once the server is compute-bound, and a speculative "
                      "engine that batches less than the baseline loses throughput (the embedded one runs "
                      "requests one at a time); use speculation at low concurrency only, or lower k")
    return list(dict.fromkeys(causes + doctor))


def headline(metrics: dict[str, Any], checkup_causes: Sequence[str] | None = None) -> tuple[str, str, str]:
    """04's verdict in three lines (the acceptance measured, whether serving gets faster, what next); the table at
    the end of the report (``verdict``) says the same at length."""
    off, pred = metrics.get("offline") or {}, metrics.get("prediction") or {}
    served = [r for r in metrics.get("online") or [] if r.get("speedup") is not None
              and r.get("endpoint") != metrics.get("online_baseline")]
    measured = (f"acceptance length {off['acceptance_length']:.2f} tokens per target step at k={off['k']} offline"
                if off else "no offline acceptance")
    if metrics.get("local"):
        loc = metrics["local"]
        per_request = loc.get("acceptance_length_per_request")
        measured += f", {loc['acceptance_length']:.2f} in real decoding here (vLLM's pooled" + (
            f"; {per_request:.2f} as SpecForge's mean of per-request means)" if per_request is not None else ")")
    best = max(served, key=lambda r: r["speedup"], default=None)
    if best is not None:
        gain = best["speedup"] >= 1.05
        pays = (f"{'yes' if gain else 'no'}: {best['speedup']:.2f}x the baseline's throughput at best (concurrency "
                f"{best['concurrency']}, {series_label(best)})")
    elif pred:
        gain = pred["speedup"] > 1
        pays = f"{'yes' if gain else 'no'}, predicted: {pred['speedup']:.2f}x plain decoding (no served benchmark)"
    else:
        gain, pays = False, "unknown: neither a prediction nor a served benchmark"
    causes = likely_causes(metrics, checkup_causes)
    nxt = ("serve it with the flags 03 printed, at the concurrency where it pays" if gain else
           f"the likeliest cause: {causes[0]}" if causes else "`eagle3nb doctor params/<run>/`")
    return measured, pays, nxt


def concurrency_rows(conc: dict[str, Any]) -> list[tuple[str, str]]:
    """Where speculation stops paying (measured and predicted from the engine's step costs) and, for each measured
    concurrency, the vLLM flags to serve with (``metrics.json`` ``concurrency``)."""
    rows = []
    if conc.get("series") or conc.get("serve_flags"):
        measured, predicted = conc.get("measured_crossover"), conc.get("predicted_crossover")
        rows.append(("Where speculation stops paying",
                     f"measured: {f'from concurrency {measured}' if measured else 'it pays at every measured level'}; "
                     f"predicted from the engine's step costs: "
                     f"{f'from concurrency {predicted}' if predicted else 'not below 1x up to 256'} (the verify pass "
                     "of c*(k+1) tokens costs more plain steps as the engine becomes compute-bound)."))
    for series in conc.get("series") or []:
        if series.get("from", "").startswith("profile"):
            rows.append((f"Why, from {series['endpoint']}'s profile", engine_why(series)))
    for c, flag in (conc.get("serve_flags") or {}).items():
        rows.append((f"Serve at concurrency {c}", f"vllm serve <target> {flag}" if flag else
                     "without --speculative-config: plain decoding is faster at this load"))
    return rows


def engine_why(series: dict[str, Any]) -> str:
    """A profiled series' rounds in plain words at its lowest and highest measured concurrency: what a round costs
    in plain decode steps, part by part, against the tokens it yields (``eagle3nb.accept.forecast``)."""
    names = {"forward": "the verify forward", "draft": "the draft", "sample": "sampling",
             "other": "the rest of the step", "gap": "the engine loop"}
    out = []
    for lv in (series["levels"][0], series["levels"][-1]):
        parts = ", ".join(f"{names[p]} {v:.2f}" for p, v in lv["round_parts"].items())
        out.append(f"at concurrency {lv['concurrency']} a round costs {lv['round_in_plain_steps']:.2f} plain decode "
                   f"steps ({parts}) and yields tau = {lv['tau']:.2f} tokens per request: predicted "
                   f"{lv['predicted']:.2f}x, measured {lv['measured']:.2f}x")
    return "; ".join(out) + " (each level forecast from the others' step costs)."


def verdict(metrics: dict[str, Any], checkup_causes: Sequence[str] | None = None):
    """The plain-words table that ends the notebook: acceptance, what it means at each concurrency, why.
    ``checkup_causes`` as in ``likely_causes``: the doctor's, passed in (04 does not run the doctor)."""
    import pandas as pd

    rows: list[tuple[str, str]] = []
    off = metrics.get("offline") or {}
    k = off.get("k")
    if off:
        a1, tau = off["per_position"][0], off["acceptance_length"]
        kind = "greedy" if not off.get("temperature") else f"at temperature {off['temperature']}"
        rows.append(("Acceptance (offline, held-out data)",
                     f"{_rate(a1)}: the first drafted token is accepted {a1:.0%} of the time ({kind}); a target "
                     f"step yields tau = {tau:.2f} tokens at k={k} (alpha per position "
                     f"{', '.join(f'{a:.2f}' for a in off['per_position'])}); for scale, {PUBLIC_KIMI}."))
    loc = metrics.get("local") or {}
    if loc:
        same = loc.get("identical_to_target")
        rows.append(("Lossless (local speculative decoding)",
                     "yes: greedy output identical to the target's own on every prompt" if same else
                     f"NO: outputs differ from the target's on prompts {loc.get('mismatched_prompts')}"
                     if same is False else "not checked (sampling)"))
        rows.append(("Acceptance (local, real decoding)",
                     f"tau = {loc['acceptance_length']:.2f} tokens per target step at k={loc['k']}, pooled over every "
                     f"round as vLLM counts it ({_num(loc.get('acceptance_length_per_request'))} as SpecForge's mean "
                     f"of per-request means; offline greedy "
                     f"said {_num(off.get('greedy', {}).get('acceptance_length'))} over all positions, "
                     f"{_num(off.get('greedy', {}).get('simulated_acceptance_length'))} replaying decoding rounds); "
                     f"{loc['spec_tokens_per_s']:.1f} vs {loc['plain_tokens_per_s']:.1f} tokens/s plain = "
                     f"{loc['speedup']:.2f}x here."))
    pred = metrics.get("prediction") or {}
    if pred:
        verdict_word = "faster" if pred["speedup"] > 1 else "SLOWER"
        costs = f" Costs: {pred['costs']}." if pred.get("costs") else ""
        rows.append(("Predicted speedup", f"{pred['formula']}: {verdict_word} than plain decoding for one request "
                                          f"at a time, with this machine's costs.{costs} Believe the measured "
                                          "throughput rows below: they time the server itself at each concurrency "
                                          "(its batching, its per-step costs, the served acceptance)."))
    for r in metrics.get("online") or []:
        if r.get("speedup") is None or r.get("endpoint") == (metrics.get("online_baseline") or ""):
            continue
        s = r["speedup"]
        what = ("faster" if s >= 1.05 else "no gain" if s >= 0.95 else "slower")
        acc = (f", server acceptance length {r['acceptance_length']:.2f}" if r.get("acceptance_length")
               else ", no spec-decode metrics from the server")
        rows.append((f"Throughput at concurrency {r['concurrency']} ({series_label(r)})",
                     f"{s:.2f}x the baseline ({r['output_tokens_per_s']:.1f} tok/s): {what}{acc}."))
    rows += concurrency_rows(metrics.get("concurrency") or {})
    causes = likely_causes(metrics, checkup_causes)
    low = off and (off["per_position"][0] < 0.4 or any(
        (r.get("speedup") or 1.0) < 1.0 for r in metrics.get("online") or []))
    if causes and low:
        for i, c in enumerate(causes[:5], 1):
            rows.append((f"Likeliest cause #{i}", c))
    elif off:
        rows.append(("Likeliest cause", "nothing points to a problem; `eagle3nb doctor params/<run>/` checks the "
                                        "setup end to end."))
    return pd.DataFrame(rows, columns=["question", "answer"]).style.hide(axis="index").set_properties(
        **{"text-align": "left", "white-space": "pre-wrap"})
