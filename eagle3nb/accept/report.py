"""04's tables and figures, from what ``stage.run`` wrote (its metrics dict, ``metrics.json``): they compute
nothing a later step needs. ``save_figures`` writes every figure as ``<stage_dir>/<name>.png`` for a headless
run; the notebook shows the same figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3nb.accept import adaptive
from eagle3nb.accept.concurrency import plot_pareto, series_label
from eagle3nb.accept.online import at_k
from eagle3nb.accept.predict import speedup_by_k
from eagle3nb.figures import save_figures as save_all
from eagle3nb.formulas import tau_iid

# The PNGs ``save_figures`` writes (offline_vs_local only when the local check ran).
FIGURES = ["offline_vs_local", "tau_vs_k", "throughput_vs_concurrency", "speedup_vs_concurrency",
           "acceptance_vs_concurrency", "speedup_vs_k", "alpha_per_position", "predicted_vs_measured_speedup",
           "acceptance_by_context", "throughput_pareto", "adaptive_verification"]


# ----------------------------------------------------------------------------------------- tables


def position_table(metrics: dict[str, Any]):
    """alpha_i per draft position from every source that has it (offline greedy / sampled, local)."""
    import pandas as pd

    off = metrics["offline"]
    table = {"offline greedy": off["greedy"]["alpha_by_position"]}
    if off.get("sampled"):
        table[f"offline T={off['temperature']}"] = off["sampled"]["alpha_by_position"]
    if metrics.get("local"):
        loc = metrics["local"]["per_position"]
        table["local decoding"] = loc + [None] * (off["max_k"] - len(loc))
    df = pd.DataFrame(table, index=pd.RangeIndex(1, off["max_k"] + 1, name="position i"))
    df["tau(k=i) offline"] = (off["sampled"] or off["greedy"])["tau_by_k"]
    return df


def breakdown_table(offline: dict[str, Any], by: str = "by_segment"):
    """One row per segment / category: positions, alpha_1, tau at k (greedy and sampled)."""
    import pandas as pd

    rows = []
    for name, b in (offline.get(by) or {}).items():
        row = {by.removeprefix("by_"): name, "positions": b["greedy"]["positions"],
               "alpha_1 greedy": b["greedy"]["per_position"][0],
               f"tau(k={offline['k']}) greedy": b["greedy"]["acceptance_length"]}
        if b.get("sampled"):
            row[f"alpha_1 T={offline['temperature']}"] = b["sampled"]["per_position"][0]
            row[f"tau(k={offline['k']}) T={offline['temperature']}"] = b["sampled"]["acceptance_length"]
        rows.append(row)
    return pd.DataFrame(rows).set_index(by.removeprefix("by_")) if rows else pd.DataFrame()


def benchmark_table(metrics: dict[str, Any], by: str | None = None):
    """Acceptance per benchmark set as the public drafters publish it: one row per dataset (``by``: per dataset and
    ``by_turn`` / ``by_category``), acceptance length at k and the per-position conditional rates, the draft
    settings in the columns' names (greedy verification, k, max tokens)."""
    import pandas as pd

    b = metrics.get("benchmarks")
    if not b:
        return pd.DataFrame()
    rows = []
    for name, d in b["datasets"].items():
        parts = {"prompts": d["prompts"], "turns": d["turns"], "summary": d} if by is None else None
        for part, s in ([(None, d)] if by is None else d.get(by, {}).items()):
            row = {"dataset": name, **({by.removeprefix("by_"): part} if by else
                                       {"prompts": parts["prompts"], "turns": parts["turns"]})}
            row[f"tau (k={b['k']}, T=0, {b['max_tokens']} tok)"] = s["acceptance_length"]
            row.update({f"alpha_{i + 1}": a for i, a in enumerate(s["per_position"])})
            rows.append(row)
    return pd.DataFrame(rows).set_index(["dataset", by.removeprefix("by_")] if by else "dataset") if rows \
        else pd.DataFrame()


def context_table(metrics: dict[str, Any]):
    """Offline acceptance per context-length bucket (the drafted token's index in the sequence; buckets from the
    lengths the held-out data holds), and how far the draft trained and the benchmark serves."""
    import pandas as pd

    off, k = metrics["offline"], metrics["offline"]["k"]
    rows = [{"context (tokens)": name, "positions": b["greedy"]["positions"],
             "alpha_1 greedy": b["greedy"]["per_position"][0], f"tau(k={k}) greedy": b["greedy"]["acceptance_length"]}
            for name, b in (off.get("by_context") or {}).items()]
    df = pd.DataFrame(rows).set_index("context (tokens)") if rows else pd.DataFrame()
    ctx = metrics.get("context") or {}
    df.attrs["note"] = (f"longest training sequence {ctx.get('longest_trained')}, longest served (prompt + max_tokens) "
                        f"{ctx.get('longest_served')}" + (f". WARNING: {ctx['warning']}" if ctx.get("warning") else ""))
    return df


def online_table(rows: list[dict[str, Any]]):
    """The benchmark rows as a table, one per (endpoint, k, concurrency) as the server sweep measured them
    (per-position lists left out; k empty for the baseline)."""
    import pandas as pd

    cols = ["endpoint", "k", "concurrency", "output_tokens_per_s", "speedup", "acceptance_rate", "acceptance_length",
            "latency_p50_s", "latency_p90_s", "latency_p99_s", "requests", "errors"]
    df = pd.DataFrame([{c: r.get(c) for c in cols} for r in rows], columns=cols)
    df["k"] = df["k"].astype("Int64")  # whole numbers, <NA> for the baseline (not 3.0 / NaN)
    return df.set_index(["endpoint", "k", "concurrency"])


def acceptance_by_source(metrics: dict[str, Any]):
    """Acceptance length and alpha_i at the served k from every source side by side: offline (predicted from
    hidden states), local decoding (our decoder here) and each served endpoint's own counters (vLLM's
    /metrics; first concurrency level), so a draft the engine reads differently shows as a gap. Acceptance length
    both ways where the source has per-request data (``eagle3nb.formulas``): pooled over every round (vLLM's) and
    the mean of each request's own (SpecForge's; offline: of each held-out sample's simulated rounds). vLLM's
    /metrics counters are pooled only: its per-request column stays empty."""
    import pandas as pd

    k = metrics["offline"]["k"]
    off = metrics["offline"]["greedy"]
    pooled, mean = "acceptance_length pooled (vLLM's)", "acceptance_length per-request mean (SpecForge's)"
    rows = [{"source": "offline greedy (predicted)", pooled: off["tau_by_k"][k - 1],
             mean: off.get("simulated_acceptance_length_per_sample"),
             **{f"alpha_{i + 1}": a for i, a in enumerate(off["alpha_by_position"][:k])}}]
    if metrics.get("local"):
        loc = metrics["local"]
        rows.append({"source": "local decoding (measured)", pooled: loc["acceptance_length"],
                     mean: loc.get("acceptance_length_per_request"),
                     **{f"alpha_{i + 1}": a for i, a in enumerate(loc["per_position"][:k])}})
    seen = set()
    for r in at_k(metrics.get("online") or [], k):
        if r.get("acceptance_length") is None or r["endpoint"] in seen:
            continue
        seen.add(r["endpoint"])
        engine = r.get("metrics_engine") or "server"
        rows.append({"source": f"{r['endpoint']} ({engine} counters, c={r['concurrency']}: pooled only)",
                     pooled: r["acceptance_length"], mean: None,
                     **{f"alpha_{i + 1}": a for i, a in enumerate((r.get("per_position") or [])[:k])}})
    return pd.DataFrame(rows).set_index("source")


# ----------------------------------------------------------------------------------------- figures


def plot_alpha(metrics: dict[str, Any]):
    """Conditional acceptance per draft position: offline (greedy and sampled), local, and each endpoint."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    off = metrics.get("offline") or {}
    series = []
    if off:
        series.append(("offline greedy", off["greedy"]["alpha_by_position"], "o-"))
        if off.get("sampled"):
            series.append((f"offline T={off['temperature']}", off["sampled"]["alpha_by_position"], "s-"))
    if metrics.get("local"):
        series.append(("local decoding (greedy)", metrics["local"]["per_position"], "D--"))
    for r in metrics.get("online") or []:
        if r.get("per_position"):
            series.append((f"{series_label(r)} c={r['concurrency']}", r["per_position"], "x:"))
    for label, ys, style in series:
        ax.plot(range(1, len(ys) + 1), ys, style, label=label)
    ax.set_ylim(0, 1.02)
    ax.set_xticks(range(1, max([len(ys) for _, ys, _ in series] + [1]) + 1))
    ax.set_xlabel("draft position i")
    ax.set_ylabel("alpha_i = P(accept i | accepted < i)")
    ax.set_title("Acceptance per position")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_tau(offline: dict[str, Any], prediction: dict[str, Any] | None = None):
    """tau(k) offline for k = 1..K against i.i.d. references, with the predicted speedup per k (right axis).
    The references are labelled inside the plot, left of their last point, and the legend sits below the axes,
    so no label meets the right axis or another label."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.6), layout="constrained")
    ks = list(range(1, offline["max_k"] + 1))
    top = 0.0
    for a in (0.85, 0.5, 0.15):
        ys = [tau_iid(a, k) for k in ks]
        top = max(top, ys[-1])
        ax.plot(ks, ys, color="gray", lw=0.8, ls=":")
        ax.annotate(f"i.i.d. α={a}", (ks[-1], ys[-1]), xytext=(-4, 3), textcoords="offset points", ha="right",
                    va="bottom", fontsize=7, color="gray")
    ax.plot(ks, offline["greedy"]["tau_by_k"], "o-", label="offline greedy τ(k)")
    if offline.get("sampled"):
        ax.plot(ks, offline["sampled"]["tau_by_k"], "s-", label=f"offline T={offline['temperature']} τ(k)")
    top = max([top, *offline["greedy"]["tau_by_k"], *((offline.get("sampled") or {}).get("tau_by_k") or [])])
    ax.set_ylim(0.9, top * 1.1 + 0.1)  # room above the highest curve for its label
    ax.set_xticks(ks)
    ax.set_xlabel("k (drafted tokens per step)")
    ax.set_ylabel("τ = tokens per target step")
    ax.set_title("Acceptance length vs k")
    handles, labels = ax.get_legend_handles_labels()
    if prediction:
        ax2 = ax.twinx()
        ax2.plot(ks, speedup_by_k(offline["alpha_by_position"], prediction["cost_ratio"], prediction["overhead"],
                                  prediction.get("parallel", False)),
                 "^--", color="C3", label="predicted speedup (right axis)")
        ax2.axhline(1.0, color="C3", lw=0.6, ls=":")
        ax2.set_ylabel("predicted speedup", color="C3")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=8, frameon=False)
    return fig


def plot_offline_vs_local(metrics: dict[str, Any]):
    """Offline-predicted vs locally measured acceptance (greedy), per position and as tau."""
    import matplotlib.pyplot as plt

    off, loc = metrics["offline"]["greedy"], metrics["local"]
    k = metrics["local"]["k"]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(1, k + 1)
    w = 0.38
    ax.bar([x - w / 2 for x in xs], off["alpha_by_position"][:k], w, label="offline (predicted)")
    ax.bar([x + w / 2 for x in xs], loc["per_position"], w, label="local decoding (measured)")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("draft position i")
    ax.set_ylabel("alpha_i")
    ax.set_title(f"Offline vs measured: tau {off['tau_by_k'][k - 1]:.2f} predicted, {loc['acceptance_length']:.2f} "
                 "measured (pooled over all rounds)")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_predicted_vs_measured(metrics: dict[str, Any]):
    """Measured speedup (local and each online level) against the prediction; the diagonal is agreement."""
    import matplotlib.pyplot as plt

    pred = metrics["prediction"]["speedup"]
    fig, ax = plt.subplots(figsize=(5, 4))
    pts = []
    if metrics.get("local") and metrics["local"].get("speedup") is not None:
        pts.append(("local", metrics["local"]["speedup"]))
    for r in at_k(metrics.get("online") or [], metrics["prediction"]["k"]):
        if r.get("speedup") is not None and r["endpoint"] != metrics.get("online_baseline"):
            pts.append((f"{r['endpoint']} c={r['concurrency']}", r["speedup"]))
    for label, y in pts:
        ax.scatter([pred], [y])
        ax.annotate(label, (pred, y), fontsize=8, xytext=(4, 0), textcoords="offset points")
    hi = max([pred, 1.0] + [y for _, y in pts]) * 1.15
    ax.plot([0, hi], [0, hi], color="gray", ls=":", lw=1)
    ax.axhline(1.0, color="gray", lw=0.6)
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("predicted speedup")
    ax.set_ylabel("measured speedup")
    ax.set_title("Predicted vs measured speedup")
    fig.tight_layout()
    return fig


def plot_context(metrics: dict[str, Any]):
    """Offline acceptance length and first-token acceptance per context-length bucket, positions per bar."""
    import matplotlib.pyplot as plt

    table = context_table(metrics)
    if table.empty:
        return None
    k = metrics["offline"]["k"]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = range(len(table))
    bars = ax.bar(xs, table[f"tau(k={k}) greedy"], color="C0", label=f"tau(k={k}) greedy")
    for bar, n in zip(bars, table["positions"]):
        ax.annotate(f"{n} positions", (bar.get_x() + bar.get_width() / 2, 0.05), ha="center", va="bottom",
                    fontsize=8, color="white")
    ax.set_ylim(0, k + 1.3)
    ax.set_ylabel("tokens per target step (greedy)")
    ax2 = ax.twinx()
    ax2.plot(list(xs), table["alpha_1 greedy"], "o-", color="C3", label="alpha_1 (first token)")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("alpha_1", color="C3")
    ax.set_xticks(list(xs), table.index)
    ax.set_xlabel("position of the drafted token in the sequence (tokens)")
    ctx = metrics.get("context") or {}
    trained = f"; trained up to {ctx['longest_trained']} tokens" if ctx.get("longest_trained") else ""
    ax.set_title(f"Acceptance by context length (offline{trained})", fontsize=10)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    # below the axes: inside, the legend covered the tallest bars
    ax.legend(h1 + h2, l1 + l2, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


def by_series(rows: list[dict[str, Any]], y: str) -> dict[str, list[tuple[int, float]]]:
    """``{series label: [(concurrency, row[y]), ...]}`` sorted by concurrency, rows without ``y`` left out."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r.get(y) is not None:
            out.setdefault(series_label(r), []).append((r["concurrency"], r[y]))
    return {label: sorted(pts) for label, pts in out.items()}


def plot_throughput(rows: list[dict[str, Any]]):
    """Output tokens/s vs concurrency, one line per endpoint and k."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in by_series(rows, "output_tokens_per_s").items():
        ax.plot(*zip(*pts), marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput vs concurrency")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_speedup(rows: list[dict[str, Any]], predicted: float | None = None):
    """Measured speedup over the baseline vs concurrency, with the offline prediction as a reference line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in by_series(rows, "speedup").items():
        ax.plot(*zip(*pts), marker="o", label=f"{label} (measured)")
    ax.axhline(1.0, color="gray", lw=1, ls=":", label="no speedup")
    if predicted is not None:
        ax.axhline(predicted, color="C3", ls="--", label=f"predicted {predicted:.2f}x")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("speedup over baseline")
    ax.set_title("Speedup vs concurrency")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_acceptance(rows: list[dict[str, Any]]):
    """The server's acceptance length and rate (its own counters) vs concurrency, one line per endpoint and k;
    None when no server reported spec-decode counters. Length is bounded by k + 1, so longer k sits higher."""
    import matplotlib.pyplot as plt

    lengths, rates = by_series(rows, "acceptance_length"), by_series(rows, "acceptance_rate")
    if not lengths:
        return None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for label, pts in lengths.items():
        ax1.plot(*zip(*pts), marker="o", label=label)
    for label, pts in rates.items():
        ax2.plot(*zip(*pts), marker="o", label=label)
    for ax, what in ((ax1, "acceptance length, pooled (tokens per target step)"),
                     (ax2, "acceptance rate (accepted / drafted)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(what)
        ax.legend(fontsize=8)
    ax2.set_ylim(0, 1.02)
    fig.suptitle("Server acceptance vs concurrency (its /metrics counters: pooled over all rounds, no per-request "
                 "figure)")
    fig.tight_layout()
    return fig


def plot_speedup_vs_k(rows: list[dict[str, Any]], baseline: str | None = None):
    """Measured speedup over the baseline vs draft length k, one line per concurrency level (each k is its own
    server); None when no row has both a k and a speedup."""
    import matplotlib.pyplot as plt

    pts: dict[int, list[tuple[int, float]]] = {}
    for r in rows:
        if r.get("k") is not None and r.get("speedup") is not None and r["endpoint"] != baseline:
            pts.setdefault(r["concurrency"], []).append((r["k"], r["speedup"]))
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for c, line in sorted(pts.items()):
        ax.plot(*zip(*sorted(line)), marker="o", label=f"concurrency {c}")
    ax.axhline(1.0, color="gray", lw=1, ls=":", label="no speedup")
    ax.set_xticks(sorted({k for line in pts.values() for k, _ in line}))
    ax.set_xlabel("draft length k (num_speculative_tokens)")
    ax.set_ylabel("speedup over baseline")
    ax.set_title("Speedup vs k")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def figures(metrics: dict[str, Any]) -> dict[str, Any]:
    """Every figure of the stage by PNG name (matplotlib figures), in ``FIGURES`` order."""
    makers = {
        "offline_vs_local": lambda: plot_offline_vs_local(metrics) if metrics.get("local") else None,
        "tau_vs_k": lambda: plot_tau(metrics["offline"], metrics.get("prediction")),
        "throughput_vs_concurrency": lambda: plot_throughput(metrics.get("online") or []),
        "speedup_vs_concurrency": lambda: plot_speedup(metrics.get("online") or [],
                                                       (metrics.get("prediction") or {}).get("speedup")),
        "acceptance_vs_concurrency": lambda: plot_acceptance(metrics.get("online") or []),
        "speedup_vs_k": lambda: plot_speedup_vs_k(metrics.get("online") or [], metrics.get("online_baseline")),
        "alpha_per_position": lambda: plot_alpha(metrics),
        "predicted_vs_measured_speedup": lambda: plot_predicted_vs_measured(metrics),
        "acceptance_by_context": lambda: plot_context(metrics) if metrics["offline"].get("by_context") else None,
        "throughput_pareto": lambda: plot_pareto(metrics.get("online") or []) if metrics.get("online") else None,
        "adaptive_verification": lambda: adaptive.plot(metrics),  # its table: adaptive.table
    }
    return {name: fig for name, fig in ((n, makers[n]()) for n in FIGURES) if fig is not None}


def save_figures(stage_dir: Path, metrics: dict[str, Any]) -> list[Path]:
    """Write every figure as ``stage_dir/<name>.png`` and close it (so a notebook does not show it twice)."""
    return save_all(figures(metrics), stage_dir, dpi=110)
