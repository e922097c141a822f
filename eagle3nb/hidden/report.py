"""Tables and plots of a 02_hidden_states run, from what ``stage.run`` wrote (``index.json``, ``metrics.json``,
``throughput.jsonl``); plots take an optional matplotlib ``ax``, ``figures`` / ``save_figures`` give the
stage's figures (``run`` writes them as PNGs beside the shards); ``sample_browser`` / ``static_samples`` show the
stored samples token by token. Reads only: the storage comparison that extracts again is ``eagle3nb.hidden.cost``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from eagle3nb.data.reader import HiddenStates
from eagle3nb.data.shards import STORAGES, bytes_per_token
from eagle3nb.figures import save_figures as save_all
from eagle3nb.layers import to_sglang
from eagle3nb.tokenview import HTML, browser, fields_table, pieces_for, render_tokens, roles_for, special_ids

GB = 1e9
# Work the sample view may spend on the target's greedy picks (T x V x H multiply-adds, x2): a few seconds on a
# CPU; a 1T model's head over a long sample is far above it, and its picks show only when stored (topk storage).
PICKS_FLOPS = 2e11


def headline(m: dict[str, Any]) -> tuple[str, str, str]:
    """02's verdict in three lines (what was stored, whether the draft vocabulary fits, what next) from its
    metrics."""
    tps = f" at {m['tokens_per_s']:,.0f} tokens/s" if m.get("tokens_per_s") else ""
    size = f"{m['total_bytes'] / GB:.2f} GB" if m["total_bytes"] >= GB else f"{m['total_bytes'] / 1e6:.1f} MB"
    measured = (f"hidden states of {m['samples']} samples, {m['tokens']:,} tokens{tps}: {size} in {m['storage']} "
                f"({m['bytes_per_token']:,.0f} bytes/token)")
    cov = m["coverage"]
    if cov < 0.9:
        return (measured, f"partly: the {m['draft_vocab_size']}-token draft vocabulary covers {cov:.0%} of the "
                          f"trained tokens, and the rest can never be accepted",
                "raise draft_vocab_size and run 02 again (or train on it as it is)")
    return (measured, f"yes: the {m['draft_vocab_size']}-token draft vocabulary covers {cov:.0%} of the trained "
                      f"tokens", "run 03_train on them")


def layer_table(meta: dict):
    """Each stored state: its role, the HF/vLLM id, the SGLang/SpecForge id of the same tensor."""
    import pandas as pd

    ids, L = meta["layer_ids"], meta["num_layers"]
    roles = ["low", "middle", "high"] if len(ids) == 3 else [f"aux {k}" for k in range(len(ids))]
    rows = [{"state": r, "HF hidden_states / vLLM id": i, "SGLang / SpecForge id": s,
             "is": "embeddings" if i == 0 else f"output of decoder layer {i - 1} (input of layer {i})"}
            for r, i, s in zip(roles, ids, to_sglang(ids))]
    rows.append({"state": "final", "HF hidden_states / vLLM id": L, "SGLang / SpecForge id": L - 1,
                 "is": "after the final norm (vLLM's id L is before it; we apply the norm)"})
    return pd.DataFrame(rows).set_index("state")


def storage_table(hidden_size: int, tokens: int, num_aux: int = 3, topk: int = 32, draft_vocab_size: int = 32000):
    """Bytes/token of every storage option, its ratio to bf16 and the disk a run of ``tokens`` takes."""
    import pandas as pd

    bf16 = bytes_per_token("bf16", hidden_size, num_aux, topk, draft_vocab_size)
    rows = []
    for s in STORAGES:
        b = bytes_per_token(s, hidden_size, num_aux, topk, draft_vocab_size)
        rows.append({"storage": s, "bytes/token": b, "vs bf16": round(b / bf16, 4), "GB for the run": tokens * b / GB})
    return pd.DataFrame(rows)


def disk_table(metrics: dict):
    """Projected (printed before the run) vs actual disk use."""
    import pandas as pd

    return pd.DataFrame([
        {"what": "projected before starting", "GB": metrics["projected_bytes"] / GB},
        {"what": "actual (shards + head + vocab)", "GB": metrics["total_bytes"] / GB},
        {"what": "free when it started", "GB": metrics["free_bytes"] / GB},
    ]).set_index("what")


def throughput(stage_dir: str | Path, window_s: float = 30.0):
    """Per-batch log -> DataFrame with elapsed time and tokens/s averaged over ``window_s``."""
    import pandas as pd

    path = Path(stage_dir) / "throughput.jsonl"
    df = pd.DataFrame([json.loads(line) for line in path.read_text().splitlines()] if path.exists() else [],
                      columns=["time", "tokens", "seconds"])
    if df.empty:
        return df.assign(elapsed_s=[], tok_per_s=[])
    df["elapsed_s"] = df["seconds"].cumsum()
    win = max(1, int(window_s / max(df["seconds"].mean(), 1e-9)))
    df["tok_per_s"] = df["tokens"].rolling(win, min_periods=1).sum() / df["seconds"].rolling(win, min_periods=1).sum()
    return df


def plot_throughput(stage_dir: str | Path, ax=None):
    """Tokens/s over compute time, from ``throughput.jsonl``."""
    import matplotlib.pyplot as plt

    df = throughput(stage_dir)
    ax = ax or plt.subplots(figsize=(7, 3))[1]
    ax.plot(df["elapsed_s"], df["tok_per_s"])
    ax.set(xlabel="compute time (s)", ylabel="tokens/s", title="extraction throughput")
    return ax


def plot_lengths(meta: dict, ax=None):
    """Histogram of the stored samples' lengths (``meta``: ``index.json``, e.g. ``HiddenStates(d).meta``)."""
    import matplotlib.pyplot as plt

    lengths = [s["length"] for s in meta["samples"]]
    ax = ax or plt.subplots(figsize=(7, 3))[1]
    ax.hist(lengths, bins=min(50, max(5, len(lengths) // 4)))
    ax.set(xlabel="tokens per sample", ylabel="samples", title=f"sequence lengths ({len(lengths)} samples)")
    return ax


def figures(stage_dir: str | Path) -> dict:
    """The stage's figures (matplotlib Figures, not registered with pyplot; the caller displays or saves them):
    extraction throughput and the stored samples' lengths."""
    from matplotlib.figure import Figure

    meta = json.loads((Path(stage_dir) / "index.json").read_text())
    figs = {}
    for name, plot in (("throughput", lambda ax: plot_throughput(stage_dir, ax=ax)),
                       ("lengths", lambda ax: plot_lengths(meta, ax=ax))):
        fig = Figure(figsize=(7, 3.5), layout="constrained")
        plot(fig.subplots())
        figs[name] = fig
    return figs


def save_figures(stage_dir: str | Path, dpi: int = 100) -> list[Path]:
    """Write ``figures(stage_dir)`` as ``<name>.png`` in ``stage_dir``; returns the paths."""
    return save_all(figures(stage_dir), stage_dir, dpi)


# --------------------------------------------------------------------------------------------- the samples


def _max_length(stage_dir: Path) -> int | None:
    """The run's ``max_length`` (from ``plan.json``), to tell which stored samples were cut."""
    path = Path(stage_dir) / "plan.json"
    return json.loads(path.read_text())["config"].get("max_length") if path.exists() else None


def sample_rows(stage_dir: str | Path) -> list[dict[str, Any]]:
    """One summary per stored sample: ``id``, ``category``, ``length`` and ``flags`` (``cut``: as long as
    ``max_length``, so 01's sample was cut there), in index order."""
    meta = json.loads((Path(stage_dir) / "index.json").read_text())
    cap = _max_length(Path(stage_dir))
    return [{"id": s["id"], "category": s.get("category"), "length": s["length"],
             "flags": ["cut"] if cap and s["length"] >= cap else []} for s in meta["samples"]]


def sample_html(data: HiddenStates, i: int, tokenizer: Any, show_ids: bool = False,
                max_length: int | None = None) -> str:
    """Stored sample ``i`` as training reads it: its tokens coloured by role, the loss mask underlined, each
    token's hover naming the target's greedy pick at that position (from the stored final state) and marking in
    blue where that pick is outside the draft vocabulary (the loss skips those positions); the cut, if any. The
    picks need the target's head over every position: left out above ``PICKS_FLOPS`` unless stored (topk)."""
    item = data[i]
    ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
    think, end = special_ids(tokenizer)
    pieces = pieces_for(tokenizer, ids)
    marks: list[str | None] = [None] * len(ids)
    titles: list[str | None] = [None] * len(ids)
    fields = {"id": item["id"], "category": item.get("category"), "tokens stored": len(ids),
              "cut by max_length": "no", "loss tokens": sum(mask)}
    meta = data.meta
    if "argmax" in item or 2 * len(ids) * meta["vocab_size"] * meta["hidden_size"] <= PICKS_FLOPS:
        argmax = data.target_argmax(item).tolist()  # position t: the target's pick for token t+1
        in_vocab = data.t2d[argmax].tolist()
        picks = pieces_for(tokenizer, argmax)
        for t in range(1, len(ids)):
            agree = "= data" if argmax[t - 1] == ids[t] else "≠ data"
            titles[t] = (f"| target's greedy pick here: {picks[t - 1]!r} (id {argmax[t - 1]}, {agree}"
                         f"{'' if in_vocab[t - 1] else ', NOT in the draft vocab'})")
            if mask[t] and not in_vocab[t - 1]:
                marks[t] = "oov"
        trained = [t for t in range(1, len(ids)) if mask[t]]
        fields["target's pick outside the draft vocab"] = sum(not in_vocab[t - 1] for t in trained)
        fields["target's pick = data token"] = f"{sum(argmax[t - 1] == ids[t] for t in trained)}/{len(trained)}"
    cut = bool(max_length) and len(ids) >= max_length
    if cut:
        marks[-1] = "cut"
        fields["cut by max_length"] = f"yes (max_length {max_length})"
    fields["shard"] = data.samples[i]["shard"]
    head = f"<b>{item['id']}</b> — {len(ids)} tokens stored" + (" — <b>cut by max_length</b>" if cut else "")
    tokens = render_tokens(pieces, ids, roles_for(ids, mask, think, end), marks, titles, loss_mask=mask,
                           show_ids=show_ids)
    return (f'<div class="tv-sample" data-sample-id="{item["id"]}" style="margin:8px 0 16px">'
            f'<div style="margin-bottom:4px">{head}</div>'
            f'<div style="display:flex;gap:16px;align-items:flex-start"><div style="flex:3;min-width:0">{tokens}</div>'
            f'<div style="flex:2;min-width:0">{fields_table(fields)}</div></div></div>')


def sample_browser(stage_dir: str | Path, tokenizer: Any):
    """JupyterLab widget over the stored samples: filter by category, cut and length, pick one by id or at
    random among the cut ones, see it as training reads it (``sample_html``)."""
    data = HiddenStates(stage_dir)
    position = {s["id"]: i for i, s in enumerate(data.samples)}
    cap = _max_length(Path(stage_dir))
    return browser(sample_rows(stage_dir),
                   lambda sid, show_ids: sample_html(data, position[sid], tokenizer, show_ids, cap), ("cut",))


def chosen_samples(stage_dir: str | Path) -> dict[str, str]:
    """``{"worst": id, "typical": id}``: the longest sample (cut by max_length when any was) and the one nearest
    the median length."""
    rows = sample_rows(stage_dir)
    worst = max(rows, key=lambda r: (bool(r["flags"]), r["length"]))["id"]
    median = statistics.median(r["length"] for r in rows)
    typical = min([r for r in rows if r["id"] != worst] or rows, key=lambda r: (abs(r["length"] - median), r["id"]))
    return {"worst": worst, "typical": typical["id"]}


def static_samples(stage_dir: str | Path, tokenizer: Any, show_ids: bool = False) -> HTML:
    """The worst and a typical stored sample (``chosen_samples``) as static HTML, for the rendered report."""
    data = HiddenStates(stage_dir)
    position = {s["id"]: i for i, s in enumerate(data.samples)}
    cap = _max_length(Path(stage_dir))
    return HTML("".join(f"<h4>{which} sample</h4>{sample_html(data, position[sid], tokenizer, show_ids, cap)}"
                        for which, sid in chosen_samples(stage_dir).items()))
