"""06's report, from ``metrics.json``: the pick and why first, then every candidate's row (its acceptance length both
ways, its served speedup at each concurrency, where its round goes, what it cost to train, or why it was not
served) and the served throughput against concurrency, one line per candidate and the plain server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3nb.figures import save_figures as _save

FIGURES = ["served_throughput"]


def verdict_lines(metrics: dict[str, Any]) -> list[str]:
    """Three lines: the pick and why, what was measured, what to do next."""
    pick, cands = metrics["pick"], metrics["candidates"]
    served = [c for c in cands if c["status"] in ("picked", "served")]
    measured = (f"measured: {len(cands)} candidate(s) ({len(served)} served, "
                f"{sum(c['status'] == 'refused' for c in cands)} refused by the engine, "
                f"{sum(c['status'] == 'not trained' for c in cands)} not trained) on {metrics['engine']} at "
                f"concurrency {', '.join(map(str, metrics['concurrencies']))}, each beside the plain server "
                f"(its rate spread {metrics['plain_spread']:.0%} over the run)" if metrics.get("plain_spread")
                is not None else f"measured: {len(cands)} candidate(s), none served")
    if pick["name"] is None:
        return [pick["why"], measured, "next: serve the target plainly, or train longer / on more data and select "
                                       "again"]
    return [pick["why"], measured, f"next: {pick['serve_command']}"]


def _round(cell: dict[str, Any]) -> str:
    r = cell.get("round")
    if not r:
        return "—"
    return (f"{r['in_plain_steps']:.2f} = {r['verify_forward']:.2f} + {r['draft_forwards']:.2f} + "
            f"{r['bookkeeping']:.2f}")


def candidates_table(metrics: dict[str, Any]):
    """One row per candidate, every one (served, refused, not trained): status, method, k, tau pooled (vLLM's:
    accepted / rounds over all its rounds) and tau per-request mean (SpecForge's: the mean of each request's own),
    from the same requests sent one at a time; the speedup at each concurrency and at the load; a round in plain
    steps at the lowest level (verify forward + draft forwards + bookkeeping, from the rounds profile); the cost to
    train (03's steps, the wall seconds, 03's tokens/s); and why a candidate was not served."""
    import pandas as pd

    rows = []
    for c in metrics["candidates"]:
        cells = {cell["concurrency"]: cell for cell in c.get("cells") or []}
        tau, cost = c.get("tau") or {}, c.get("cost") or {}
        row = {"candidate": c["name"], "status": c["status"], "method": c["method"], "k": c["k"],
               "tau pooled (vLLM)": tau.get("pooled"), "tau per-request mean (SpecForge)": tau.get("per_request_mean"),
               **{f"speedup c={lv}": (cells.get(lv) or {}).get("speedup") for lv in metrics["concurrencies"]},
               "speedup at the load": c.get("score"),
               f"round in plain steps c={metrics['concurrencies'][0]} (verify + draft + bookkeeping)":
                   _round(cells.get(metrics["concurrencies"][0]) or {}),
               "train steps": cost.get("steps"), "train wall s": cost.get("wall_s"),
               "train tok/s": cost.get("tokens_per_s"), "why not served": c.get("reason") or ""}
        rows.append(row)
    return pd.DataFrame(rows).set_index("candidate").round(3)


def plot_throughput(metrics: dict[str, Any]):
    """Served output tokens/s against concurrency: the plain server (the mean of its paired measurements, their
    range as error bars) and one line per served candidate; a refused candidate is named in the legend."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    levels = metrics["concurrencies"]
    plain = metrics["plain"]
    if plain:
        means = [plain[str(c)]["mean"] for c in levels]
        ax.errorbar(levels, means, yerr=[[m - plain[str(c)]["min"] for m, c in zip(means, levels)],
                                         [plain[str(c)]["max"] - m for m, c in zip(means, levels)]],
                    color="black", marker="s", linestyle="--", capsize=3, label="plain (range over the pairs)")
    for c in metrics["candidates"]:
        cells = c.get("cells") or []
        if cells:
            mark = " (picked)" if c["status"] == "picked" else ""
            ax.plot([cell["concurrency"] for cell in cells],
                    [cell["candidate"]["output_tokens_per_s"] for cell in cells], marker="o",
                    linewidth=2.5 if mark else 1.2, label=f"{c['name']}{mark}")
        elif c["status"] in ("refused", "not trained"):
            ax.plot([], [], linestyle="none", marker="x", label=f"{c['name']}: {c['status']}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s (served)")
    ax.set_title(f"Served throughput on {metrics['engine']}, {metrics['model_path']}")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def save_figures(stage_dir: str | Path, metrics: dict[str, Any]) -> list[Path]:
    """The stage's figures as ``<stage_dir>/<name>.png`` (:data:`FIGURES`)."""
    return _save({"served_throughput": plot_throughput(metrics)}, stage_dir)
