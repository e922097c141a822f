"""Token sequences as HTML: each token a span coloured by its role in the training stream (prompt, think wrapper,
reasoning, answer, end of turn), the tokens the loss counts underlined, optional per-token marks (a draft's
misses, a cut), and the id, text, role and any note on hover. One renderer for every stage's sample views (01's
records, 02's stored samples, 04's misses), so the colours mean the same everywhere.

Inline styles (not a ``<style>`` block), so the colours survive JupyterLab's output sanitiser and nbconvert's
HTML report alike; each span also carries classes (``tv-role-<role>``, ``tv-loss``, ``tv-mark-<mark>``) for tests
and for readers of the HTML.
"""

from __future__ import annotations

import html
import random
from pathlib import Path
from typing import Any, Sequence

from eagle3nb.families import Family, of_tokenizer, specials
from eagle3nb.hf import from_pretrained
from eagle3nb.toy import resolve_model_path

ROLES = ("prompt", "think", "reasoning", "answer", "end")
ROLE_STYLE = {  # background colour, legend text
    "prompt": ("#e8e8e8", "prompt (not trained: loss_mask 0)"),
    "think": ("#c9a0ff", "think wrapper (the family's reasoning markers)"),
    "reasoning": ("#ffe08a", "reasoning"),
    "answer": ("#a8e6a1", "answer"),
    "end": ("#ff9f9f", "end of turn"),
}
# Marks a caller may put on tokens: CSS for the span and the legend's words. Callers may pass their own.
MARK_STYLE = {
    "miss": ("outline:2px solid #d62728;", "draft missed here (first rejected token)"),
    "hit": ("outline:1px solid #2ca02c;", "draft accepted"),
    "oov": ("box-shadow:inset 0 -4px 0 #1f77b4;", "target's next token outside the draft vocab (not trained)"),
    "cut": ("border-right:3px solid #000;", "cut here by max_length"),
    "turn": ("border-left:3px solid #1f77b4;", "a turn starts (earlier turns: history, trained in their own samples)"),
}
LOSS_STYLE = "border-bottom:2px solid #333;"
NO_LOSS_STYLE = "opacity:0.75;"


def load_tokenizer(model_path: str | Path, trust_remote_code: bool = False) -> Any:
    """The target's tokenizer for the sample views (``model_path`` as the stages take it: a folder or toy:...)."""
    from transformers import AutoTokenizer

    return from_pretrained(AutoTokenizer, resolve_model_path(str(model_path)), trust_remote_code=trust_remote_code)


def special_ids(tokenizer: Any, family: Family | None = None) -> tuple[tuple[int | None, int | None], int | None]:
    """``((think_start, think_end), end_of_turn)`` ids of the target's family (None: told from the tokenizer's
    folder) in the tokenizer's vocabulary (None when absent; the end of turn falls back to the tokenizer's eos
    token, as 01's stream does)."""
    sp = specials(family or of_tokenizer(tokenizer), tokenizer)
    return sp.think_ids, sp.end_id


def roles_for(ids: Sequence[int], loss_mask: Sequence[int], think_ids: tuple[int | None, int | None],
              end_id: int | None) -> list[str]:
    """One role per token: ``prompt`` where the loss mask is 0 (the prompt, the assistant header, earlier turns),
    else ``think`` for the wrappers, ``reasoning`` inside them, ``end`` for the end-of-turn token and ``answer``
    for the rest (a reply without thinking is all answer)."""
    start, stop = think_ids
    out: list[str] = []
    inside = False
    for tok, m in zip(ids, loss_mask):
        if not m:
            out.append("prompt")
            inside = False
        elif start is not None and tok == start:
            inside = True
            out.append("think")
        elif stop is not None and tok == stop:
            inside = False
            out.append("think")
        elif end_id is not None and tok == end_id:
            out.append("end")
        else:
            out.append("reasoning" if inside else "answer")
    return out


def pieces_for(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token's own text, special tokens visible (a byte-level piece that is part of a character shows as
    the replacement character; the hover id tells which)."""
    return [tokenizer.decode([int(i)], skip_special_tokens=False) for i in ids]


def _visible(piece: str) -> str:
    """A piece as HTML where whitespace shows: newlines as a return arrow and a line break, tabs as arrows."""
    text = html.escape(piece).replace("\t", "→")
    return text.replace("\n", "↵<br>") if text.strip() or "\n" in text else text.replace(" ", "·") or "∅"


def legend(roles: Sequence[str] = ROLES, marks: Sequence[str] = (),
           mark_styles: dict[str, tuple[str, str]] | None = None) -> str:
    """The colour key: every role, the loss underline and the given marks."""
    styles = {**MARK_STYLE, **(mark_styles or {})}
    items = [f'<span class="tv-key-{r}" style="background:{ROLE_STYLE[r][0]};padding:0 4px;border-radius:3px">'
             f'{html.escape(ROLE_STYLE[r][1])}</span>' for r in roles]
    items.append(f'<span class="tv-key-loss" style="{LOSS_STYLE}padding:0 4px">'
                 'underlined: in the loss (loss_mask 1)</span>')
    items += [f'<span class="tv-key-{m}" style="{styles[m][0]}padding:0 4px;margin:0 2px">{html.escape(styles[m][1])}'
              f'</span>' for m in marks]
    return f'<div class="tv-legend" style="font-size:12px;margin:4px 0;line-height:1.9">{" ".join(items)}</div>'


def render_tokens(pieces: Sequence[str], ids: Sequence[int], roles: Sequence[str],
                  marks: Sequence[str | None] | None = None, titles: Sequence[str | None] | None = None, *,
                  loss_mask: Sequence[int] | None = None, show_ids: bool = False, with_legend: bool = True,
                  mark_styles: dict[str, tuple[str, str]] | None = None) -> str:
    """HTML of a token sequence: one span per token, background = its role (``ROLE_STYLE``), underlined when
    ``loss_mask`` (default: every non-prompt role) puts it in the loss, outlined per ``marks`` (a name from
    ``MARK_STYLE`` or ``mark_styles``, or None). Hover shows position, id, text, role and ``titles[i]``;
    ``show_ids`` also prints each id small after its text."""
    n = len(ids)
    if not (len(pieces) == len(roles) == n) or (marks is not None and len(marks) != n) \
            or (titles is not None and len(titles) != n) or (loss_mask is not None and len(loss_mask) != n):
        raise ValueError(f"render_tokens: pieces, ids, roles, marks, titles and loss_mask must have one entry per "
                         f"token; got {len(pieces)}, {n}, {len(roles)}, "
                         f"{None if marks is None else len(marks)}, {None if titles is None else len(titles)}, "
                         f"{None if loss_mask is None else len(loss_mask)}")
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        raise ValueError(f"render_tokens: unknown roles {unknown}; use {', '.join(ROLES)} (see roles_for)")
    styles = {**MARK_STYLE, **(mark_styles or {})}
    missing = sorted({m for m in marks or () if m} - set(styles))
    if missing:
        raise ValueError(f"render_tokens: no style for marks {missing}; pass mark_styles={{name: (css, legend text)}}")
    spans = []
    for i in range(n):
        role = roles[i]
        in_loss = bool(loss_mask[i]) if loss_mask is not None else role != "prompt"
        mark = marks[i] if marks is not None else None
        classes = [f"tv-role-{role}", "tv-loss" if in_loss else "tv-noloss"] + ([f"tv-mark-{mark}"] if mark else [])
        style = (f"background:{ROLE_STYLE[role][0]};" + (LOSS_STYLE if in_loss else NO_LOSS_STYLE)
                 + (styles[mark][0] if mark else ""))
        tip = f"#{i}  id {int(ids[i])}  {pieces[i]!r}  {role}  loss {int(in_loss)}"
        if titles is not None and titles[i]:
            tip += f"  {titles[i]}"
        sub = f'<sub style="font-size:8px;color:#555">{int(ids[i])}</sub>' if show_ids else ""
        spans.append(f'<span class="{" ".join(classes)}" data-id="{int(ids[i])}" title="{html.escape(tip)}" '
                     f'style="{style}">{_visible(pieces[i])}{sub}</span>')
    used = [m for m in dict.fromkeys(marks or ()) if m]
    body = (f'<div class="tv-tokens" style="font-family:monospace;font-size:13px;line-height:1.9;'
            f'white-space:pre-wrap;word-break:break-all">{"".join(spans)}</div>')
    return (legend([r for r in ROLES if r in set(roles)], used, mark_styles) if with_legend else "") + body


def fields_table(fields: dict[str, Any], max_chars: int = 400) -> str:
    """A record's fields as a two-column HTML table (long values cut to ``max_chars`` with the full length said)."""
    rows = []
    for k, v in fields.items():
        text = v if isinstance(v, str) else repr(v)
        if len(text) > max_chars:
            text = text[:max_chars] + f" … ({len(text)} chars)"
        rows.append(f'<tr><th style="text-align:left;padding-right:8px;vertical-align:top">{html.escape(k)}</th>'
                    f'<td style="text-align:left;white-space:pre-wrap">{html.escape(text)}</td></tr>')
    return f'<table class="tv-fields" style="font-size:12px">{"".join(rows)}</table>'


class HTML:
    """An HTML string that notebooks display as HTML (``_repr_html_``) and tests read as ``str``; nbconvert keeps
    it in the rendered report, unlike widget state."""

    def __init__(self, html_text: str):
        self.html = html_text

    def _repr_html_(self) -> str:
        return self.html

    def __str__(self) -> str:
        return self.html


ROWS_LISTED = 50  # per filter choice in a browser's sample list: a 10K-sample run's widget state stays small


def _rows_table(hits: list[dict[str, Any]], total: int) -> str:
    """The samples a browser's filters keep, as an HTML table (the first ``ROWS_LISTED``) under their count."""
    more = f" (the first {ROWS_LISTED} listed)" if len(hits) > ROWS_LISTED else ""
    body = "".join(f'<tr data-sample-id="{html.escape(str(r["id"]))}"><td>{html.escape(str(r["id"]))}</td>'
                   f'<td>{r["length"]}</td><td>{html.escape(str(r.get("status") or ""))}</td>'
                   f'<td>{html.escape(str(r.get("category") or ""))}</td>'
                   f'<td>{html.escape(", ".join(r.get("flags", ())))}</td></tr>' for r in hits[:ROWS_LISTED])
    return (f"<div>{len(hits)} of {total} samples match{more}</div><table class=\"tv-rows\"><thead><tr><th>id</th>"
            f"<th>tokens</th><th>status</th><th>category</th><th>flags</th></tr></thead><tbody>{body}</tbody></table>")


def browser(rows: list[dict[str, Any]], view: Any, flags: Sequence[str] = ()) -> Any:
    """An ipywidgets sample browser: pick a sample by id, status, category, minimum length or at random among
    the flagged ones, and see ``view(id, show_ids) -> html`` for it. ``rows`` holds one summary per sample
    (``id``, ``length`` and any of ``status``, ``category``, ``flags`` (list of names from ``flags``)). Returns
    the widget (a VBox; ``.children[3]`` lists the matching samples, ``.children[-1]`` is the HTML of the sample
    shown).

    The list is precomputed for every (category, flagged) choice and switched by links in the page itself
    (``jsdlink`` of the dropdowns' index to ``Stack``s), so those two filters keep working in a rendered report,
    where no kernel runs; status and length refilter through the kernel."""
    import ipywidgets as w

    def choices(key: str) -> list[str]:
        return ["(any)"] + sorted({str(r.get(key)) for r in rows if r.get(key) is not None})

    status = w.Dropdown(options=choices("status"), description="status")
    category = w.Dropdown(options=choices("category"), description="category")
    flag = w.Dropdown(options=["(any)", *flags], description="flagged")
    longest = max((r["length"] for r in rows), default=0)
    min_len = w.IntSlider(0, min=0, max=max(longest, 1), description="min length")
    pick = w.Dropdown(description="sample", layout=w.Layout(width="420px"))
    lucky = w.Button(description="random flagged", tooltip="a random sample among the flagged ones (filters apply)")
    show_ids = w.Checkbox(False, description="show ids")
    # shape: tables.children[category index].children[flag index] -> the list under that choice
    tables = w.Stack([w.Stack([w.HTML() for _ in flag.options], selected_index=0) for _ in category.options],
                     selected_index=0)
    w.jsdlink((category, "index"), (tables, "selected_index"))
    for inner in tables.children:
        w.jsdlink((flag, "index"), (inner, "selected_index"))
    out = w.HTML()

    def matching(cat: str, flagged: str) -> list[dict[str, Any]]:
        return [r for r in rows
                if (status.value == "(any)" or str(r.get("status")) == status.value)
                and (cat == "(any)" or str(r.get("category")) == cat)
                and (flagged == "(any)" or flagged in r.get("flags", ()))
                and r["length"] >= min_len.value]

    def label(r: dict[str, Any]) -> str:
        extra = ", ".join(str(x) for x in (r.get("status"), r.get("category"), r.get("turn"), *r.get("flags", ()))
                          if x)
        return f"{r['id']}  ({r['length']} tok{', ' + extra if extra else ''})"

    def refilter(_: Any = None) -> None:
        for cat, inner in zip(category.options, tables.children):
            for flagged, cell in zip(flag.options, inner.children):
                cell.value = _rows_table(matching(cat, flagged), len(rows))
        hits = matching(category.value, flag.value)
        keep = pick.value
        pick.options = [(label(r), r["id"]) for r in hits]
        ids = [r["id"] for r in hits]
        pick.value = keep if keep in ids else (ids[0] if ids else None)
        show()

    def show(_: Any = None) -> None:
        out.value = view(pick.value, show_ids.value) if pick.value is not None else "<i>no sample matches</i>"

    def random_flagged(_: Any) -> None:
        hits = [r for r in matching(category.value, flag.value) if r.get("flags")]
        if hits:
            pick.value = random.choice(hits)["id"]
        else:
            out.value = "<i>no flagged sample matches the filters</i>"

    for c in (status, category, flag, min_len):
        c.observe(refilter, names="value")
    pick.observe(show, names="value")
    show_ids.observe(show, names="value")
    lucky.on_click(random_flagged)
    refilter()

    class Browser(w.VBox):
        """The widget, with a note instead of its repr where no widget renders (a report rendered headless)."""

        def _repr_mimebundle_(self, **kwargs: Any) -> Any:
            bundle = super()._repr_mimebundle_(**kwargs)
            note = "sample browser: interactive in JupyterLab (the samples above are its static version)"
            if isinstance(bundle, dict):
                bundle.update({"text/plain": note, "text/html": f"<p><i>{note}</i></p>"})
            return bundle

    return Browser([w.HBox([status, category, flag]), w.HBox([min_len]), w.HBox([pick, lucky, show_ids]), tables, out])
