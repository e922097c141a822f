"""04's token views of where the draft misses: each drafted position coloured by how many of the k drafted tokens
the target accepted from there (red 0 through green k), or, for a block drafter's records (``unit`` block
position), each round drawn as a block (the accepted prefix, the first rejected position, the target's token after
a full block); static excerpts for the rendered report and the JupyterLab browser. They only read the records
``eagle3nb.accept.misses`` writes."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle3nb.accept.misses import (
    BLOCK,
    SEGMENT_OF_ROLE,
    SOURCES,
    load_records,
    miss_table,
    outcomes,
    roles,
    sample_stats,
    worst_kind,
)
from eagle3nb.tokenview import HTML, legend, render_tokens


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
