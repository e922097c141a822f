"""The checks of the data and the room for it: 6. data health, 7. disk."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

from eagle3nb.data.stream import StreamError, build
from eagle3nb.doctor.checks.common import worst_of
from eagle3nb.doctor.context import Context
from eagle3nb.doctor.result import FAIL, PASS, WARN, CheckResult

# data_health: shares of samples (of all ids) above which the data is suspect / unusable
TRUNCATED_WARN, TRUNCATED_FAIL = 0.05, 0.30
NO_REASONING_WARN, NO_REASONING_FAIL = 0.01, 0.10
ERROR_WARN, ERROR_FAIL = 0.02, 0.20
# share of loss-masked (trained-on) tokens beyond max_length
CUT_WARN, CUT_FAIL = 0.05, 0.50
# disk: projected bytes as a share of free space
DISK_WARN = 0.8


# -- 6. data health -------------------------------------------------------------------------------------------------

def check_data_health(ctx: Context) -> CheckResult:
    records, samples = ctx.records, ctx.samples
    n = len(samples)
    status = Counter(s["status"] for s in samples)
    share = {k: status[k] / n for k in ("ok", "truncated", "no_reasoning", "error")}
    details: dict[str, Any] = {"samples": n, "status": dict(status)}
    problems = []
    P1 = ctx.p("01_synth")
    for key, warn, fail, fix in [
        ("truncated", TRUNCATED_WARN, TRUNCATED_FAIL,
         f"raise max_completion_tokens in 01_synth (now {P1.max_completion_tokens}): truncated answers are dropped"),
        ("no_reasoning", NO_REASONING_WARN, NO_REASONING_FAIL,
         "the server is not returning reasoning: run the server check (reasoning parser, thinking kwarg)"),
        ("error", ERROR_WARN, ERROR_FAIL, "read the error field of those samples; re-run 01_synth to retry them"),
    ]:
        if share[key] > warn:
            problems.append((FAIL if share[key] > fail else WARN, f"{share[key]:.0%} {key}", fix))
    ok_ids = Counter(r["id"] for r in records if r["status"] == "ok")
    dups = [i for i, c in ok_ids.items() if c > 1]
    details["duplicate_ok_ids"] = dups[:20]
    if dups:
        problems.append((FAIL, f"{len(dups)} ids recorded ok more than once (e.g. {dups[0]!r})",
                         "training would count them twice; move the duplicate files away and resume 01_synth"))
    ok = [s for s in samples if s["status"] == "ok"]
    kinds = _mismatch_kinds(ctx, [s for s in ok if s.get("ids_match") is False])
    details["ids_mismatch"] = kinds
    if kinds["text"]:
        problems.append((WARN, f"{kinds['text']}/{len(ok)} ok samples: the chat template renders other text than "
                               f"the server generated", "run the token_stream check against the server; the data "
                                                        "keeps the server's ids"))
    later = [s for s in ok if (s.get("turn") or 1) > 1]
    details["turns"] = turns = {
        "multi_turn": P1.multi_turn,
        "conversations": len({s.get("conversation_id", s["id"]) for s in samples}),
        "first_turn_ok": len(ok) - len(later), "later_turn_ok": len(later),
        "later_ids_mismatch": _mismatch_kinds(ctx, [s for s in later if s.get("ids_match") is False])["text"],
        "dataset_turns_untrained": sum((s.get("turn") or 1) - 1 for s in ok) if P1.multi_turn == "last" else 0}
    if turns["later_ids_mismatch"]:
        problems.append((WARN, f"{turns['later_ids_mismatch']}/{len(later)} later turns: the template renders the "
                               f"history other than the server did", "the data keeps the server's ids; run the "
                                                                     "token_stream check on a multi-turn prompt"))
    answered = turns["dataset_turns_untrained"] + len(ok)
    if answered and turns["dataset_turns_untrained"] > answered / 2:
        problems.append((WARN, f"multi_turn: last trains {len(ok)} of {answered} assistant turns (the rest are the "
                               f"dataset's text, never the target's)",
                         "set multi_turn: every in 01_synth: each turn answered on-policy becomes a sample"))
    think, think_text = ctx.template.think_ids[0], ctx.template.specials.think_start
    thinking = [s for s in ok if s.get("thinking")] if think is not None else []
    no_wrap = sum(1 for s in thinking if think not in [t for t, m in zip(s["input_ids"], s["loss_mask"]) if m])
    if no_wrap:
        problems.append((FAIL, f"{no_wrap}/{len(thinking)} ok thinking samples have no {think_text} token in their "
                               f"trained tokens (reasoning or its wrappers lost: the story's bug)",
                         "regenerate them with the current 01_synth (it keeps the server's token ids)"))
    max_length = ctx.max_length()
    lengths = [len(s["input_ids"]) for s in ok]
    trained = sum(sum(s["loss_mask"]) for s in ok)
    cut = sum(sum(s["loss_mask"][max_length:]) for s in ok)
    longer = sum(n_ > max_length for n_ in lengths)
    details.update(max_length=max_length, longer=longer, cut_tokens=cut, trained_tokens=trained,
                   lengths=_percentiles(lengths))
    if trained and cut / trained > CUT_WARN:
        problems.append((FAIL if cut / trained > CUT_FAIL else WARN,
                         f"{longer}/{len(ok)} samples exceed max_length {max_length}: {cut / trained:.0%} of the "
                         f"trained tokens are cut", "raise max_length in 02_hidden_states and 03_train"))
    if not ok:
        problems.append((FAIL, "no ok samples", "see the statuses above; run 01_synth"))
    p = details["lengths"]
    measured = (f"{n} samples: {status['ok']} ok, {status['truncated']} truncated, {status['no_reasoning']} "
                f"no_reasoning, {status['error']} error; length p50 {p['p50']} p99 {p['p99']} max {p['max']} "
                f"vs max_length {max_length}; server ids != template: {kinds['text']} text, {kinds['split']} token "
                f"split only, {kinds['unclosed']} reasoning never closed; duplicates {len(dups)}; turns: "
                f"{turns['first_turn_ok']} first, {turns['later_turn_ok']} later ok ({turns['multi_turn']})")
    return worst_of("data_health", problems, measured, details)


def _mismatch_kinds(ctx: Context, samples: list[dict]) -> dict[str, int]:
    """Why server ids differ from the template rendering: ``split`` (same text, other token boundaries:
    sampling picked a non-canonical tokenization, harmless), ``unclosed`` (the model stopped inside its
    reasoning, which no template can render), ``text`` (the template renders other text: a real mismatch)."""
    tpl = ctx.template
    out = {"text": 0, "split": 0, "unclosed": 0}
    for s in samples:
        generated = [t for t, m in zip(s["input_ids"], s["loss_mask"]) if m]
        if s.get("thinking") and tpl.think_ids[1] is not None and tpl.think_ids[1] not in generated:
            out["unclosed"] += 1
            continue
        try:
            ours = build(tpl, s["messages"], s["reasoning"], s["content"], s["finish_reason"], None, None,
                         tools=s.get("tools"), tool_calls=s.get("tool_calls"))
        except StreamError:
            out["text"] += 1
            continue
        out["split" if tpl.decode(ours["input_ids"]) == tpl.decode(s["input_ids"]) else "text"] += 1
    return out


def _percentiles(xs: list[int]) -> dict[str, int]:
    if not xs:
        return {"p50": 0, "p99": 0, "max": 0}
    s = sorted(xs)
    return {"p50": s[len(s) // 2], "p99": s[min(len(s) - 1, int(len(s) * 0.99))], "max": s[-1]}


# -- 7. disk ---------------------------------------------------------------------------------------------------------

def _free_bytes(path: Path) -> tuple[int, Path]:
    """Free bytes of the file system ``path`` will be on (its nearest existing ancestor)."""
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free, p


def check_disk(ctx: Context) -> CheckResult:
    from eagle3nb.data.shards import bytes_per_token
    from eagle3nb.hidden.prepare import head_bytes

    P2 = ctx.p("02_hidden_states")
    source = getattr(ctx.params.get("03_train"), "data_source", "stored")
    out = P2.stage_dir
    info = ctx.target_dims
    n_aux = len(P2.aux_layer_ids) if P2.aux_layer_ids else 3
    # online: 03 computes the hidden states as it trains and stores none (02's folder gets the head and vocab);
    # hybrid: 03 keeps each sample's states once, in 02's storage, in its own output folder
    bpt = 0 if source == "online" else bytes_per_token(P2.storage, info["hidden_size"], n_aux, P2.topk,
                                                       P2.draft_vocab_size)
    if source == "hybrid":
        out = ctx.p("03_train").stage_dir / "hidden_cache"
    tokens, how = ctx.projected_tokens()
    written = sum(f.stat().st_size for f in out.iterdir() if f.is_file()) if out.is_dir() else 0
    need = max(0, tokens * bpt + head_bytes(ctx.model_dir, info) - written)
    free, where = _free_bytes(out)
    details = {"bytes_per_token": bpt, "tokens": tokens, "written": written, "need": need, "free": free,
               "path": str(where), "data_source": source}
    who = {"stored": "02", "online": "03 (data_source online: no hidden states stored, only the target's head)",
           "hybrid": "03's hybrid cache"}[source]
    measured = (f"{who} needs ~{_gb(need)} more ({tokens:,} tokens x {bpt:,} B/token, storage {P2.storage}, {how}; "
                f"{_gb(written)} written); {_gb(free)} free at {where}")
    if need > free:
        return CheckResult("disk", FAIL, measured,
                           "free space, point 02's output_dir at a bigger disk, pick a compact storage "
                           "(storage: fp8 or topk halves bytes/token or better), or train with 03's data_source: "
                           "online (no hidden states on disk; the target runs every epoch)", details)
    if need > DISK_WARN * free:
        return CheckResult("disk", WARN, measured, "the run would nearly fill the disk; free space first", details)
    return CheckResult("disk", PASS, measured, "", details)


def _gb(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


