"""What a 01_synth run wrote, shown: the summary of its ``metrics.json`` (counts by status, tokens,
throughput, latency, token-id mismatches), its figures (``save_figures`` writes them as PNGs beside the
samples), the probe's findings as text, and the samples themselves token by token (``sample_browser`` in
JupyterLab, ``static_samples`` for the rendered report). Reads only; ``stage.run`` computes the metrics."""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from eagle3nb.data.samples import STATUSES, latest, sample_files
from eagle3nb.data.turns import template_messages
from eagle3nb.figures import save_figures as save_all
from eagle3nb.tokenview import (
    HTML,
    browser,
    fields_table,
    pieces_for,
    render_tokens,
    roles_for,
    special_ids,
)

# What makes a sample worth a look, worst first (``static_samples`` shows the first one present).
FLAGS = ("ids_mismatch", "no_reasoning", "truncated", "error")
_ID = re.compile(rb'^\{"id": ("(?:[^"\\]|\\.)*")')


def summary(m: dict[str, Any]) -> str:
    """``metrics.json`` in a few lines (printed at the end of a run)."""
    c = m["counts"]
    s = m["session"]
    lines = [f"01_synth: {m['samples']} samples: " + ", ".join(f"{k} {v}" for k, v in c.items())
             + (f"; {m['missing']} prompts not answered yet (re-run to resume)" if m["missing"] else "")]
    for why, n in (m.get("turns_cut") or {}).items():
        lines.append(f"  {n} turns not asked: {why} (their conversations end there)")
    t = m.get("turns") or {}
    if m.get("multi_turn") == "last" and t.get("in_prompts", 0) > 2 * t.get("conversations", 0):
        lines.append(f"  multi_turn: last trains {t['answered_ok']} of the prompts' {t['in_prompts']} assistant turns "
                     f"(the rest is the dataset's text, untrained); multi_turn: every answers them all on-policy")
    if m["errors"]:
        lines.append("  errors: " + ", ".join(f"{k} x{v}" for k, v in m["errors"].items()))
    if s["samples"]:
        lines.append(f"  this session: {s['samples']} samples in {s['wall_s']:.1f} s, {s['requests_per_s']:.2f} req/s, "
                     f"{s['output_tokens_per_s']:.1f} output tok/s, {s['retries']} retries, "
                     f"{s['in_flight_mean']:.1f} in flight on average")
    if m["ids_compared"]:
        lines.append(f"  server token ids vs template rendering: {m['ids_mismatch']} of {m['ids_compared']} ok samples "
                     f"differ "
                     f"(the server ids are kept; eagle3nb doctor explains the differences)")
    return "\n".join(lines)


def headline(m: dict[str, Any]) -> tuple[str, str, str]:
    """01's verdict in three lines (what was measured, whether the data is usable, what next) from its metrics."""
    c, n = m["counts"], max(1, sum(m["counts"].values()))
    measured = (f"{sum(c.values())} answers from the target: {c['ok']} ok ({c['ok'] / n:.0%}), {c['truncated']} "
                f"truncated, {c['no_reasoning']} without reasoning, {c['error']} errors")
    if not c["ok"]:
        return measured, "no: no usable sample", "read the errors below and `eagle3nb doctor params/<run>/ --stage 01`"
    if c["no_reasoning"] / n > 0.1:
        return (measured, "not yet: the reasoning is missing from many answers, so a draft would not learn it",
                "fix the server (its reasoning parser; doctor: server) and run 01 again")
    return (measured, f"yes: {c['ok']} samples with their reasoning feed 02",
            "run 02_hidden_states (`eagle3nb run params/<run>/` goes on by itself)")


def figures(stage_dir: str | Path) -> dict[str, Any]:
    """Throughput over time, latency distribution, reasoning/content lengths, status counts (matplotlib
    Figures; the caller displays or saves them)."""
    import numpy as np
    from matplotlib.figure import Figure

    recs = list(latest(Path(stage_dir), light=True).values())
    figs: dict[str, Any] = {}

    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.subplots()
    done = sorted((r["finished_at"], r["tokens"]["reasoning"] + r["tokens"]["content"]) for r in recs
                  if r["status"] != "error" and r.get("finished_at"))
    if done:
        t = np.array([d[0] for d in done]) - done[0][0]
        edges = np.linspace(0, max(t[-1], 1e-3), min(40, max(2, len(done) // 5)) + 1)
        width = edges[1] - edges[0]
        n, _ = np.histogram(t, edges)
        toks, _ = np.histogram(t, edges, weights=[d[1] for d in done])
        ax.plot(edges[:-1], toks / width, label="output tokens/s")
        ax2 = ax.twinx()
        ax2.plot(edges[:-1], n / width, color="tab:orange", label="samples/s")
        ax2.set_ylabel("samples/s")
        fig.legend(loc="outside lower center", ncols=2)
    ax.set_xlabel("seconds since the first answer (gaps = restarts)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput over time")
    figs["throughput"] = fig

    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.subplots()
    lat = [r["latency_s"] for r in recs if r["status"] != "error"]
    ax.hist(lat, bins=40)
    ax.set_xlabel("request latency (s, retries included)")
    ax.set_ylabel("samples")
    ax.set_title("latency")
    figs["latency"] = fig

    fig = Figure(figsize=(7, 3.2), layout="constrained")
    ax = fig.subplots()
    ok = [r for r in recs if r["status"] == "ok"]
    for key in ("reasoning", "content"):
        ax.hist([r["tokens"][key] for r in ok], bins=40, alpha=0.6, label=key)
    ax.set_xlabel("tokens per sample (ok samples)")
    ax.set_ylabel("samples")
    ax.set_title("reasoning and answer lengths")
    ax.legend()
    figs["lengths"] = fig

    fig = Figure(figsize=(7, 2.8), layout="constrained")
    ax = fig.subplots()
    counts = Counter(r["status"] for r in recs)
    bars = ax.bar(list(STATUSES), [counts.get(s, 0) for s in STATUSES],
                  color=["tab:green", "tab:orange", "tab:purple", "tab:red"])
    ax.bar_label(bars)
    ax.set_ylabel("samples")
    ax.set_title("status (only ok feeds 02_hidden_states)")
    figs["status"] = fig
    return figs


def save_figures(stage_dir: str | Path, dpi: int = 100) -> list[Path]:
    """Write ``figures(stage_dir)`` as ``<name>.png`` in ``stage_dir`` (what ``stage.run`` leaves for a headless
    run and the HTML report); returns the paths."""
    return save_all(figures(stage_dir), stage_dir, dpi)


def probe_text(p: dict[str, Any]) -> str:
    """The probe's findings as readable text: raw fields first, then the stream the training will use."""
    raw = "\n".join(f"  message.{k}: {v!r}" for k, v in p["raw"].items())
    lines = [f"server {p['url']}  model {p['model']!r}  finish_reason {p['finish_reason']!r}",
             f"raw fields:\n{raw}",
             f"reasoning read from: {p['reasoning_from']}; token stream from: {p['token_source']}"
             + ("" if p["ids_match"] is None else f" (matches the template rendering: {p['ids_match']})"),
             f"training stream, prompt part (loss 0):\n  {p['prompt']}",
             f"training stream, answer part (loss 1):\n  {p['completion']}",
             f"naive reasoning+content concatenation (the story's bug, NOT used):\n  {p['naive_concatenation']}"]
    lines += [f"PROBLEM: {x}" for x in p["problems"]] or ["no problems found"]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- the samples


def flags(rec: dict[str, Any]) -> list[str]:
    """Why a record deserves a look (names from ``FLAGS``): server ids differing from the template rendering,
    no reasoning, cut by the token budget, or no answer at all."""
    out = ["ids_mismatch"] if rec.get("ids_match") is False else []
    return out + [s for s in ("no_reasoning", "truncated", "error") if rec.get("status") == s]


def _length(rec: dict[str, Any]) -> int:
    return sum((rec.get("tokens") or {}).values())


def sample_rows(stage_dir: str | Path) -> list[dict[str, Any]]:
    """One summary per sample (latest record per id): ``id``, ``status``, ``category``, ``length`` (tokens) and
    ``flags``, in id order."""
    recs = latest(Path(stage_dir), light=True)
    return [{"id": r["id"], "status": r["status"], "category": r.get("category"), "length": _length(r),
             "turn": _turn_label(r), "flags": flags(r)} for _, r in sorted(recs.items())]


def _turn_label(rec: dict[str, Any]) -> str | None:
    """``turn k/n`` for a record of a multi-turn conversation, None for a one-turn prompt."""
    return f"turn {rec.get('turn')}/{rec['turns']}" if (rec.get("turns") or 1) > 1 else None


class SampleStore:
    """Full records by id without holding them all: the byte offset of each id's latest line (the heavy token
    lists of a 10K-sample run would take gigabytes in memory), read on demand."""

    def __init__(self, stage_dir: str | Path):
        self.where: dict[str, tuple[Path, int]] = {}
        for path in sample_files(Path(stage_dir)):
            offset = 0
            with open(path, "rb") as f:
                for line in f:
                    m = _ID.match(line)
                    try:
                        rid = json.loads(m.group(1)) if m else json.loads(line)["id"]
                    except ValueError:  # a torn last line (a kill mid-write): the store's readers skip it too
                        rid = None
                    if rid is not None:
                        self.where[rid] = (path, offset)
                    offset += len(line)

    def __getitem__(self, rid: str) -> dict[str, Any]:
        path, offset = self.where[rid]
        with open(path, "rb") as f:
            f.seek(offset)
            return json.loads(f.readline())


def turn_starts(tokenizer: Any, messages: Sequence[dict], n_prompt: int) -> dict[int, int]:
    """{token position: turn number} where each user message of a multi-turn sample's prompt starts: the length of
    the chat template's rendering of the messages before it (positions past the prompt, where a template does not
    render history as a prefix, are left out)."""
    out: dict[int, int] = {}
    turn = 0
    for j, m in enumerate(messages):
        if m.get("role") != "user":
            continue
        turn += 1
        if j:
            n = len(tokenizer.apply_chat_template(template_messages(list(messages[:j])), tokenize=True,
                                                  return_dict=False))
            if n < n_prompt:
                out[n] = turn
    return out


def sample_html(rec: dict[str, Any], tokenizer: Any, show_ids: bool = False) -> str:
    """One record: its tokens coloured by role with the loss mask underlined (hover: id and text), beside its
    fields (status, finish_reason, the reasoning and content the server returned, ...)."""
    ids, mask = rec.get("input_ids") or [], rec.get("loss_mask") or []
    think, end = special_ids(tokenizer)
    turn = _turn_label(rec)
    head = (f"<b>{rec['id']}</b> — {rec.get('status')}, {len(ids)} tokens, category {rec.get('category')}"
            + (f" — {turn}: only this turn's answer is trained, earlier turns are its history" if turn else "")
            + (f" — <b>flagged: {', '.join(flags(rec))}</b>" if flags(rec) else ""))
    starts = turn_starts(tokenizer, rec.get("messages") or [], mask.count(0)) if turn and ids else {}
    marks = [("turn" if i in starts else None) for i in range(len(ids))] if starts else None
    titles = [(f"turn {starts[i]} starts" if i in starts else None) for i in range(len(ids))] if starts else None
    tokens = (render_tokens(pieces_for(tokenizer, ids), ids, roles_for(ids, mask, think, end), marks, titles,
                            loss_mask=mask, show_ids=show_ids)
              if ids else f"<i>no tokens ({rec.get('error') or 'no answer'})</i>")
    fields = fields_table({k: v for k, v in rec.items() if k not in ("input_ids", "loss_mask")})
    return (f'<div class="tv-sample" data-sample-id="{rec["id"]}" style="margin:8px 0 16px">'
            f'<div style="margin-bottom:4px">{head}</div>'
            f'<div style="display:flex;gap:16px;align-items:flex-start"><div style="flex:3;min-width:0">{tokens}</div>'
            f'<div style="flex:2;min-width:0">{fields}</div></div></div>')


def sample_browser(stage_dir: str | Path, tokenizer: Any):
    """JupyterLab widget over a run's samples: filter by status, category, flag and length, pick one by id or at
    random among the flagged ones, see its tokens and fields (``sample_html``)."""
    store = SampleStore(stage_dir)
    return browser(sample_rows(stage_dir), lambda rid, show_ids: sample_html(store[rid], tokenizer, show_ids), FLAGS)


def chosen_samples(stage_dir: str | Path) -> dict[str, str]:
    """``{"worst": id, "typical": id}``: the worst is the longest sample of the first flag present (``FLAGS``
    order), else the longest ok one; the typical is the ok sample nearest the median ok length."""
    rows = sample_rows(stage_dir)
    if not rows:
        raise FileNotFoundError(f"no samples in {stage_dir}: run 01_synth first (stage.run)")
    ok = [r for r in rows if r["status"] == "ok"] or rows
    out: dict[str, str] = {}
    for f in FLAGS:
        hit = [r for r in rows if f in r["flags"]]
        if hit:
            out["worst"] = max(hit, key=lambda r: r["length"])["id"]
            break
    else:
        out["worst"] = max(ok, key=lambda r: r["length"])["id"]
    median = statistics.median(r["length"] for r in ok)
    typical = [r for r in ok if r["id"] != out["worst"]] or ok
    out["typical"] = min(typical, key=lambda r: (abs(r["length"] - median), r["id"]))["id"]
    return out


def static_samples(stage_dir: str | Path, tokenizer: Any, show_ids: bool = False) -> HTML:
    """The worst and a typical sample (``chosen_samples``) as static HTML: what the rendered report shows, where
    no widget survives."""
    store = SampleStore(stage_dir)
    parts = [f"<h4>{which} sample</h4>{sample_html(store[rid], tokenizer, show_ids)}"
             for which, rid in chosen_samples(stage_dir).items()]
    return HTML("".join(parts))
