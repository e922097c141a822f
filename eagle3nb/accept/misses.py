"""Where the draft misses, token by token (04): every drafted position coloured by how many of the k drafted
tokens the target accepted from there (0..k), the draft's guess and the target's token at each miss, and the
token kinds where misses concentrate (first token after the reasoning's end marker, numbers, the end of turn ...).

Two sources, one record shape (one JSON line per sample): ``positions.jsonl`` from the offline chains on held-out
hidden states (``accepted[p]`` = accepted tokens of the chain whose first drafted token is p), and
``local_rounds.jsonl`` from the local speculative decoding run (the real rounds: each token carries its round's
accepted count, ``rounds`` lists what was drafted). Each record: ``source``, ``id``, ``category``, ``ids``,
``loss_mask``, ``accepted`` (-1: not drafted), ``misses`` ([position, draft's guess, target's token]), ``unit``
(the method's name for a round's i-th drafted token, ``DraftMethod.unit``) and ``pieces`` (each id's text, so no
tokenizer is needed to show it). ``stage.run`` writes them; the views here (tables, static excerpts, the
JupyterLab browser) only read them. A block drafter's records (``unit`` block position) are drawn as blocks: per
round, the accepted prefix, the first rejected block position and the target's token after a full block."""

from __future__ import annotations

import html
import json
import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3nb.families import FAMILIES, Family, specials
from eagle3nb.tokenview import HTML, legend, pieces_for, render_tokens, roles_for

POSITIONS = "positions.jsonl"  # offline chains
ROUNDS = "local_rounds.jsonl"  # local speculative decoding
SOURCES = {"offline": POSITIONS, "local": ROUNDS}
SEGMENT_OF_ROLE = {"think": "reasoning", "reasoning": "reasoning", "answer": "answer", "end": "answer"}
MIN_CHECKED = 5  # a kind needs this many checked positions before the table names it as the worst
BLOCK = "block position"  # a block drafter's unit (its objective's): the views draw its rounds as blocks


# ----------------------------------------------------------------------------------------- writing (stage.run)


def with_pieces(record: dict[str, Any], tokenizer: Any, source: str, family: Family) -> dict[str, Any]:
    """``record`` with its ``source``, the text of every id it shows (its tokens, the guesses and the target's
    tokens at misses, every drafted token of the local rounds) and the target family's ``markers`` (the think
    markers and end-of-turn token as text), so the view reads roles without the tokenizer."""
    drafted = [t for r in record.get("rounds", ()) for t in r[2]]
    used = sorted({*record["ids"], *(m[1] for m in record["misses"]), *(m[2] for m in record["misses"]), *drafted})
    sp = specials(family, tokenizer)
    return {"source": source, **record, "pieces": dict(zip(map(str, used), pieces_for(tokenizer, used))),
            "markers": {"think_start": sp.think_start, "think_end": sp.think_end, "end": sp.end}}


def local_records(prompts: Sequence[Sequence[int]], local: dict[str, Any],
                  rows: Sequence[dict[str, Any]] | None = None, unit: str = "draft step") -> list[dict[str, Any]]:
    """Records of the local run's real rounds (``compare_with_plain``'s ``outputs``, ``accepted_per_round``,
    ``drafted_per_round``): round r drafts k tokens after the verified ones; its n accepted drafts and the
    target's own token are the round's tokens, each coloured by n; a round with n < k missed at its last token,
    where the draft had guessed ``drafted[n]``. ``rows``: the prompts' rows (their ``id`` and ``category``);
    ``unit``: the draft method's (``DraftMethod.unit``)."""
    out = []
    for i, (prompt, tokens, accepted, drafted) in enumerate(zip(prompts, local["outputs"], local["accepted_per_round"],
                                                                local["drafted_per_round"])):
        seq = list(prompt) + list(tokens)
        acc = [-1] * len(seq)
        misses, rounds = [], []
        p = len(prompt) + 1  # the first output token comes from the prefill; round 1 drafts the next ones
        for n, d in zip(accepted, drafted):
            end = min(p + n + 1, len(seq))
            acc[p:end] = [n] * (end - p)
            rounds.append([p, n, d])
            if n < len(d) and p + n < len(seq):
                misses.append([p + n, d[n], seq[p + n]])
            p += n + 1
        row = rows[i] if rows else {}
        out.append({"id": row.get("id", f"prompt-{i}"), "category": row.get("category"), "ids": seq,
                    "loss_mask": [0] * len(prompt) + [1] * len(tokens), "accepted": acc, "misses": misses,
                    "rounds": rounds, "unit": unit})
    return out


def write_records(path: Path, records: Sequence[dict[str, Any]]) -> Path:
    """One JSON line per sample, written atomically (a killed run leaves the old file or the new, never half)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------------------- reading


def load_records(stage_dir: Path, source: str = "offline") -> list[dict[str, Any]]:
    """The records ``stage.run`` wrote for ``source`` (offline | local); [] when that step did not run."""
    path = Path(stage_dir) / SOURCES[source]
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# Records written before they carried their family's markers all came from Kimi-format targets (the toys).
_OLD_RECORDS = FAMILIES["kimi"]


def markers(record: dict[str, Any]) -> dict[str, str | None]:
    """The record's think markers and end-of-turn token, as text."""
    old = _OLD_RECORDS
    return record.get("markers") or {"think_start": old.think_start, "think_end": old.think_end,
                                     "end": old.end_of_turn}


def _special(record: dict[str, Any], which: str) -> int | None:
    name = markers(record)[which]
    return next((int(i) for i, p in record["pieces"].items() if p == name), None) if name else None


def roles(record: dict[str, Any]) -> list[str]:
    """tokenview's role per token (prompt, think, reasoning, answer, end)."""
    think = (_special(record, "think_start"), _special(record, "think_end"))
    return roles_for(record["ids"], record["loss_mask"], think, _special(record, "end"))


def outcomes(record: dict[str, Any]) -> list[int]:
    """Per token: 1 the draft's token here was accepted, 0 rejected, -1 not checked. Offline: the first drafted
    token of the chain from here. Local: every drafted token the target compared (up to the round's miss)."""
    if "rounds" not in record:
        return [-1 if n < 0 else int(n > 0) for n in record["accepted"]]
    out = [-1] * len(record["ids"])
    for p, n, d in record["rounds"]:
        for q in range(p, min(p + n + (n < len(d)), len(out))):
            out[q] = int(q < p + n)
    return out


def _is_number(piece: str) -> bool:
    return bool(re.fullmatch(r"[\d.,]+", piece.strip())) and any(c.isdigit() for c in piece)


def kinds(record: dict[str, Any]) -> list[list[str]]:
    """The kinds each token belongs to (several may apply): its segment, the reasoning's end and the token after
    it, the end of turn, numbers, punctuation, words."""
    rl, ids, pieces = roles(record), record["ids"], record["pieces"]
    think_end, end_text = _special(record, "think_end"), markers(record)["think_end"]
    out = []
    for p, (tok, role) in enumerate(zip(ids, rl)):
        piece = pieces[str(tok)]
        ks = [SEGMENT_OF_ROLE.get(role, "prompt")]
        if think_end is not None and tok == think_end:
            ks.append(f"{end_text} (end of reasoning)")
        elif p > 0 and think_end is not None and ids[p - 1] == think_end:
            ks.append(f"first token after {end_text}")
        elif role == "think":
            ks.append(markers(record)["think_start"] or "think marker")
        if role == "end":
            ks.append("end of turn")
        elif _is_number(piece):
            ks.append("number")
        elif piece.strip() and not any(c.isalnum() for c in piece):
            ks.append("punctuation")
        elif any(c.isalpha() for c in piece) and role not in ("think", "end"):
            ks.append("word")
        out.append(ks)
    return out


def miss_table(records: Sequence[dict[str, Any]], min_checked: int = MIN_CHECKED):
    """Where misses concentrate: per token kind, the positions checked, how many the target rejected, the miss
    rate and how it compares with all positions, its share of all misses and the most common wrong guess
    (draft -> target). Sorted worst first (kinds with fewer than ``min_checked`` positions last)."""
    import pandas as pd

    checked: Counter = Counter()
    missed: Counter = Counter()
    pairs: dict[str, Counter] = {}
    for rec in records:
        got = {m[0]: (rec["pieces"].get(str(m[1]), str(m[1])), rec["pieces"].get(str(m[2]), str(m[2])))
               for m in rec["misses"]}
        for p, (o, ks) in enumerate(zip(outcomes(rec), kinds(rec))):
            if o < 0:
                continue
            for kind in ["all positions", *ks]:
                checked[kind] += 1
                if o == 0:
                    missed[kind] += 1
                    if p in got:
                        pairs.setdefault(kind, Counter())[got[p]] += 1
    total_missed = missed["all positions"] or 1
    overall = missed["all positions"] / max(checked["all positions"], 1)
    rows = []
    for kind, n in checked.items():
        rate = missed[kind] / n
        common = pairs.get(kind, Counter()).most_common(1)
        rows.append({"where": kind, "checked": n, "missed": missed[kind], "miss rate": rate,
                     "x overall": rate / overall if overall else None,
                     "share of misses": missed[kind] / total_missed,
                     "most common miss (draft -> target)":
                         f"{common[0][0][0]!r} -> {common[0][0][1]!r} ({common[0][1]}x)" if common else ""})
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    df["_small"] = df["checked"] < min_checked
    df["_all"] = df["where"] == "all positions"
    return df.sort_values(["_all", "_small", "miss rate"], ascending=[False, True, False]) \
        .drop(columns=["_small", "_all"]).reset_index(drop=True)


def worst_kind(table) -> str:
    """One sentence naming the kind of token where the draft fails most (from ``miss_table``)."""
    if table is None or len(table) < 2:
        return "no drafted positions to judge"
    overall = table.iloc[0]
    if not overall["missed"]:  # a draft (or a filter) with no miss has no kind to name, nor an overall rate to scale
        return f"no misses: the target accepted all {overall['checked']} drafted positions"
    rest = table.iloc[1:]
    rest = rest[(rest["checked"] >= MIN_CHECKED) & ~rest["where"].isin(["reasoning", "answer"])]
    if rest.empty:
        return f"misses spread evenly (miss rate {overall['miss rate']:.0%} over {overall['checked']} positions)"
    w = rest.iloc[0]
    return (f"the draft fails most at: {w['where']} (miss rate {w['miss rate']:.0%} over {w['checked']} positions, "
            f"{w['x overall']:.1f}x the {overall['miss rate']:.0%} overall; {w['share of misses']:.0%} of all misses)")


def summary(stage_dir: Path) -> dict[str, Any]:
    """Per source that ran: the miss table's rows and the sentence naming the worst kind (for metrics.json)."""
    out = {}
    for source in SOURCES:
        records = load_records(stage_dir, source)
        if records:
            table = miss_table(records)
            out[source] = {"samples": len(records), "worst": worst_kind(table), "table": table.to_dict("records")}
    return out


def sample_stats(record: dict[str, Any], segment: str = "all", span: tuple[int, int] | None = None) -> dict[str, Any]:
    """One sample's acceptance: positions drafted, mean accepted count, misses (over ``segment``: all |
    reasoning | answer, and positions in ``span``)."""
    rl = roles(record)
    lo, hi = span or (0, len(record["ids"]))
    acc, miss = [], 0
    for p, (n, o) in enumerate(zip(record["accepted"], outcomes(record))):
        if n < 0 or not lo <= p < hi or (segment != "all" and SEGMENT_OF_ROLE.get(rl[p]) != segment):
            continue
        acc.append(n)
        miss += o == 0
    return {"id": record["id"], "category": record.get("category"), "length": len(record["ids"]),
            "drafted": len(acc), "mean accepted": sum(acc) / len(acc) if acc else None, "misses": miss}


def sample_table(records: Sequence[dict[str, Any]], segment: str = "all"):
    """Every sample's acceptance, worst first (pandas)."""
    import pandas as pd

    df = pd.DataFrame([sample_stats(r, segment) for r in records])
    return df.sort_values("mean accepted", na_position="last").reset_index(drop=True) if len(df) else df


# ----------------------------------------------------------------------------------------- rendering


def accept_colour(n: int, k: int) -> str:
    """Red (0 accepted) through yellow to green (all k accepted)."""
    hue = 120 * min(max(n, 0), k) / max(k, 1)
    return f"hsl({hue:.0f},75%,78%)"


def mark_styles(k: int, unit: str = "draft step") -> dict[str, tuple[str, str]]:
    """tokenview marks: ``acc0`` .. ``acc<k>`` the token's background by accepted count, a miss outlined; for a
    block drafter's records (``unit`` block position) ``blk_ok`` / ``blk_miss`` / ``blk_full`` (``block_marks``)."""
    if unit == BLOCK:
        return {"blk_ok": (f"background:{accept_colour(k, k)};", "block position accepted"),
                "blk_miss": (f"background:{accept_colour(0, k)};outline:1px solid #d62728;",
                             "first block position rejected (the block's later positions unseen)"),
                "blk_full": ("background:#e0e0e0;", f"the target's token after all {k} block positions accepted")}
    styles = {f"acc{n}": (f"background:{accept_colour(n, k)};", f"{n} of {k} {unit}s accepted")
              for n in range(k + 1)}
    styles["acc0"] = (styles["acc0"][0] + "outline:1px solid #d62728;", f"0 of {k} {unit}s accepted (a miss)")
    return styles


def unit_of(records: Sequence[dict[str, Any]]) -> str:
    """The records' ``unit`` (records written before they carried one: draft step)."""
    return next((r["unit"] for r in records if r.get("unit")), "draft step")


def block_rounds(record: dict[str, Any], k: int) -> list[tuple[int, int]]:
    """(first drafted position, accepted drafts) of each round: the local run's real rounds; offline, the rounds
    greedy decoding would run on the sample (as ``offline.simulate_rounds``: the first drafts the token after the
    first generated one, each next starts n+1 later, while the whole block of ``k`` is generated; a cut keeps
    its sample's in ``block_rounds``)."""
    if "rounds" in record:
        return [(p, n) for p, n, _ in record["rounds"]]
    if "block_rounds" in record:
        return [(p, n) for p, n in record["block_rounds"]]
    acc, mask, out = record["accepted"], record["loss_mask"], []
    p = mask.index(1) + 1 if 1 in mask else len(acc)
    while p + k <= len(acc) and all(mask[p:p + k]) and acc[p] >= 0:
        out.append((p, acc[p]))
        p += acc[p] + 1
    return out


def block_marks(record: dict[str, Any], k: int) -> list[tuple[str | None, str]]:
    """Per token of a block drafter's record, its mark and hover: each round's accepted prefix ``blk_ok``, the
    first rejected block position ``blk_miss`` (the target's token there; the draft's guess where the record has
    it: a local round's miss, an offline block that missed its first position), the target's token after a fully
    accepted block ``blk_full``; (None, "") outside every round."""
    out: list[tuple[str | None, str]] = [(None, "")] * len(record["ids"])
    got, pc = {m[0]: m for m in record["misses"]}, record["pieces"]
    for j, (p, n) in enumerate(block_rounds(record, k)):
        for i in range(min(n, len(out) - p)):
            out[p + i] = ("blk_ok", f"round {j + 1}, block position {i + 1} of {k}: accepted")
        q = p + n
        if q >= len(out):
            continue
        if n == k:
            out[q] = ("blk_full", f"round {j + 1}: all {k} block positions accepted; the target's own token")
            continue
        tip = f"round {j + 1}, block position {n + 1} of {k}: rejected, the target's token"
        if q in got and ("rounds" in record or n == 0):
            tip += (f"; MISS: draft guessed {pc.get(str(got[q][1]), str(got[q][1]))!r}, target "
                    f"{pc.get(str(got[q][2]), str(got[q][2]))!r}")
        out[q] = ("blk_miss", tip)
    return out


def render_record(record: dict[str, Any], k: int, span: tuple[int, int] | None = None,
                  segment: str = "all") -> str:
    """HTML of one sample: tokens coloured by accepted count, or a block drafter's rounds as blocks
    (``block_marks``), outside ``segment`` / ``span`` role colour only; hover for the count or block position, and
    at a miss the draft's guess beside the target's token."""
    pieces = [record["pieces"][str(i)] for i in record["ids"]]
    rl = roles(record)
    got = {m[0]: m for m in record["misses"]}
    starts = {r[0]: (j, r) for j, r in enumerate(record.get("rounds", []))}
    unit = record.get("unit", "draft step")
    blocks = block_marks(record, k) if unit == BLOCK else None
    lo, hi = span or (0, len(pieces))
    marks, titles = [], []
    for p, n in enumerate(record["accepted"]):
        shown = lo <= p < hi and (segment == "all" or SEGMENT_OF_ROLE.get(rl[p]) == segment)
        if blocks:
            mark, tip = blocks[p]
        else:
            mark = f"acc{min(n, k)}" if n >= 0 else None
            tip = "" if n < 0 else (f"round accepted {n} of {k}" if "rounds" in record
                                    else f"{n} of {k} drafted tokens accepted from here")
        marks.append(mark if shown else None)
        if p in starts:
            j, (_, _, d) = starts[p]
            tip += f"; round {j + 1} drafted " + " ".join(repr(record["pieces"].get(str(t), str(t))) for t in d)
        if p in got and not blocks:
            _, g, t = got[p]
            pc = record["pieces"]
            tip += f"; MISS: draft guessed {pc.get(str(g), str(g))!r}, target {pc.get(str(t), str(t))!r}"
        titles.append(tip or None)
    header = (f"<div style='font-size:12px;margin:6px 0'><b>{html.escape(str(record['id']))}</b>"
              f"{' · ' + html.escape(str(record['category'])) if record.get('category') else ''}"
              f" · {len(pieces)} tokens · {len(record['misses'])} misses</div>")
    body = render_tokens(pieces, record["ids"], rl, marks, titles, loss_mask=record["loss_mask"], with_legend=False,
                         mark_styles=mark_styles(k, unit))
    return header + body + misses_list(record, lo, hi)


def misses_list(record: dict[str, Any], lo: int = 0, hi: int | None = None, limit: int = 12) -> str:
    """The first misses in [lo, hi) as 'position: draft guessed X, target Y' (what hover shows, in print)."""
    rows = [m for m in record["misses"] if lo <= m[0] < (hi or len(record["ids"]))]
    pc = record["pieces"]
    items = [f"#{p}: draft <code>{html.escape(repr(pc.get(str(g), str(g))))}</code> → target "
             f"<code>{html.escape(repr(pc.get(str(t), str(t))))}</code>" for p, g, t in rows[:limit]]
    more = f" … and {len(rows) - limit} more" if len(rows) > limit else ""
    return f"<div style='font-size:12px;margin:4px 0 10px'>misses: {'; '.join(items) or 'none'}{more}</div>"


def key(k: int, unit: str = "draft step") -> str:
    """The colour key of the miss view (a block drafter's: ``unit`` block position)."""
    return legend((), list(mark_styles(k, unit)), mark_styles(k, unit))


def window(record: dict[str, Any], width: int) -> tuple[int, int]:
    """The ``width`` tokens of ``record`` with the most misses (the whole sample when it is shorter)."""
    n = len(record["ids"])
    if n <= width:
        return 0, n
    pos = [m[0] for m in record["misses"]]
    best = max(range(0, n - width + 1, max(1, width // 8)), key=lambda s: sum(s <= p < s + width for p in pos))
    return best, best + width


def cut_record(rec: dict[str, Any], lo: int, hi: int, k: int) -> dict[str, Any]:
    """Tokens [lo, hi) of ``rec`` as a record of their own (positions renumbered from 0; a block drafter's
    offline rounds as the whole sample's, ``block_rounds``)."""
    out = {**rec, "ids": rec["ids"][lo:hi], "loss_mask": rec["loss_mask"][lo:hi], "accepted": rec["accepted"][lo:hi],
           "misses": [[p - lo, g, t] for p, g, t in rec["misses"] if lo <= p < hi]}
    if "rounds" in rec:
        out["rounds"] = [[p - lo, n, d] for p, n, d in rec["rounds"] if lo <= p < hi]
    elif rec.get("unit") == BLOCK:
        out["block_rounds"] = [[p - lo, n] for p, n in block_rounds(rec, k) if lo <= p < hi]
    return out


def excerpts(stage_dir: Path, k: int, source: str = "offline", width: int = 240) -> HTML:
    """The static view for the report: the worst sample and a typical (median) one, each cut to the ``width``
    tokens around its misses, with the colour key."""
    records = load_records(stage_dir, source)
    stats = [(sample_stats(r)["mean accepted"], i) for i, r in enumerate(records)]
    stats = sorted((m, i) for m, i in stats if m is not None)
    if not stats:
        return HTML(f"<i>no {source} positions recorded in {stage_dir}</i>")
    parts = [key(k, unit_of(records))]
    for label, (m, i) in (("worst", stats[0]), ("typical (median)", stats[len(stats) // 2])):
        rec = records[i]
        lo, hi = window(rec, width)
        cut = f", tokens {lo}-{hi - 1} of {len(rec['ids'])}" if (lo, hi) != (0, len(rec["ids"])) else ""
        parts.append(f"<h4 style='margin:10px 0 2px'>{label}: mean accepted {m:.2f} of {k}{cut}</h4>")
        parts.append(render_record(cut_record(rec, lo, hi, k), k))
    return HTML("".join(parts))


# ----------------------------------------------------------------------------------------- the browser


def browser(stage_dir: Path, k: int):
    """The interactive miss view (ipywidgets, JupyterLab): pick the source (offline chains / local rounds), sort
    samples by acceptance or length, filter by segment, category and position range, and see the sample coloured
    by accepted count with the miss table of everything the filters keep. Returns the widget (``.view`` is the
    HTML of the sample shown, ``.table`` the miss table's HTML)."""
    import ipywidgets as w

    data = {s: load_records(stage_dir, s) for s in SOURCES}
    sources = [s for s in SOURCES if data[s]] or ["offline"]
    longest = max((len(r["ids"]) for rs in data.values() for r in rs), default=1)
    source = w.ToggleButtons(options=sources, description="source")
    sort = w.Dropdown(options=["worst first", "best first", "most misses", "longest", "id"], description="sort")
    segment = w.Dropdown(options=["all", "reasoning", "answer"], description="segment")
    category = w.Dropdown(description="category")
    span = w.IntRangeSlider(value=(0, longest), min=0, max=longest, description="positions",
                            layout=w.Layout(width="420px"))
    pick = w.Dropdown(description="sample", layout=w.Layout(width="520px"))
    count, view, table = w.HTML(), w.HTML(), w.HTML()

    def records() -> list[dict[str, Any]]:
        rs = data[source.value]
        return [r for r in rs if category.value in (None, "(any)") or str(r.get("category")) == category.value]

    def refilter(_: Any = None) -> None:
        cats = ["(any)"] + sorted({str(r.get("category")) for r in data[source.value] if r.get("category")})
        if list(category.options) != cats:
            category.options = cats
        rs = records()
        stats = [sample_stats(r, segment.value, span.value) for r in rs]
        order = {"worst first": lambda s: (s["mean accepted"] is None, s["mean accepted"] or 0),
                 "best first": lambda s: (s["mean accepted"] is None, -(s["mean accepted"] or 0)),
                 "most misses": lambda s: -s["misses"], "longest": lambda s: -s["length"],
                 "id": lambda s: str(s["id"])}[sort.value]
        stats = sorted(stats, key=order)
        count.value = f"{len(rs)} of {len(data[source.value])} samples"
        keep = pick.value
        pick.options = [(f"{s['id']}  (mean accepted {s['mean accepted']:.2f}, {s['misses']} misses, "
                         f"{s['length']} tok)" if s["mean accepted"] is not None else f"{s['id']}  (nothing drafted)",
                         s["id"]) for s in stats]
        ids = [s["id"] for s in stats]
        pick.value = keep if keep in ids else (ids[0] if ids else None)
        lo, hi = span.value
        sel = [_clip(r, lo, hi, segment.value) for r in rs]
        t = miss_table(sel)
        table.value = (f"<b>{html.escape(worst_kind(t))}</b>" + t.to_html(index=False, float_format="%.2f")
                       if len(t) else "<i>nothing drafted under these filters</i>")
        show()

    def show(_: Any = None) -> None:
        rec = next((r for r in data[source.value] if r["id"] == pick.value), None)
        view.value = key(k, unit_of([rec])) + render_record(rec, k, span.value, segment.value) if rec \
            else "<i>no sample</i>"

    for c in (source, sort, segment, category, span):
        c.observe(refilter, names="value")
    pick.observe(show, names="value")
    refilter()

    class MissBrowser(w.VBox):
        """A rendered HTML report (no widget state) shows where to use the browser instead of the widget's repr."""

        def _repr_mimebundle_(self, **kwargs):
            bundle = super()._repr_mimebundle_(**kwargs)
            bundle["text/plain"] = "(interactive miss browser: open this notebook in JupyterLab)"
            return bundle

    box = MissBrowser([w.HBox([source, sort]), w.HBox([segment, category]), w.HBox([span, count]), pick, view,
                       w.HTML("<h4>Where the misses are (filtered samples)</h4>"), table])
    box.view, box.table = view, table
    return box


def _clip(record: dict[str, Any], lo: int, hi: int, segment: str) -> dict[str, Any]:
    """``record`` with only the positions in [lo, hi) of ``segment`` drafted (for the filtered miss table)."""
    rl = roles(record)
    keep = [lo <= p < hi and (segment == "all" or SEGMENT_OF_ROLE.get(r) == segment) for p, r in enumerate(rl)]
    acc = [n if kp else -1 for n, kp in zip(record["accepted"], keep)]
    out = {**record, "accepted": acc, "misses": [m for m in record["misses"] if keep[m[0]]]}
    if "rounds" in record:
        out.pop("rounds")  # the table reads local rounds through their per-token outcomes, clipped here
        oc = outcomes(record)
        out["accepted"] = [(-1 if o < 0 else o) if kp else -1 for o, kp in zip(oc, keep)]
    return out
