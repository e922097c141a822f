"""What a 01_synth run wrote, shown: the summary of its ``metrics.json`` (counts by status, tokens,
throughput, latency, token-id mismatches), its figures (``save_figures`` writes them as PNGs beside the
samples) and the probe's findings as text. Reads only; ``stage.run`` computes the metrics."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from eagle3nb.synth.store import STATUSES, latest


def summary(m: dict[str, Any]) -> str:
    """``metrics.json`` in a few lines (printed at the end of a run)."""
    c = m["counts"]
    s = m["session"]
    lines = [f"01_synth: {m['samples']} samples: " + ", ".join(f"{k} {v}" for k, v in c.items())
             + (f"; {m['missing']} prompts not answered yet (re-run to resume)" if m["missing"] else "")]
    if m["errors"]:
        lines.append("  errors: " + ", ".join(f"{k} x{v}" for k, v in m["errors"].items()))
    if s["samples"]:
        lines.append(f"  this session: {s['samples']} samples in {s['wall_s']:.1f} s, {s['requests_per_s']:.2f} req/s, "
                     f"{s['output_tokens_per_s']:.1f} output tok/s, {s['retries']} retries, "
                     f"{s['in_flight_mean']:.1f} in flight on average")
    if m["ids_compared"]:
        lines.append(f"  server token ids vs template rendering: {m['ids_mismatch']} of {m['ids_compared']} ok samples differ "
                     f"(the server ids are kept; eagle3nb doctor explains the differences)")
    return "\n".join(lines)


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
    paths = []
    for name, fig in figures(stage_dir).items():
        path = Path(stage_dir) / f"{name}.png"
        fig.savefig(path, dpi=dpi)
        paths.append(path)
    return paths


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
