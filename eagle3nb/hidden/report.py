"""Tables and plots of a 02_hidden_states run, from what ``stage.run`` wrote (``index.json``, ``metrics.json``,
``throughput.jsonl``); plots take an optional matplotlib ``ax``, ``figures`` / ``save_figures`` give the
stage's figures (``run`` writes them as PNGs beside the shards). Reads only: the storage comparison that
extracts again is ``eagle3nb.hidden.cost``."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3nb.layers import to_sglang
from eagle3nb.hidden.storage import STORAGES, bytes_per_token

GB = 1e9


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
    return pd.DataFrame(rows)


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
    ])


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
    paths = []
    for name, fig in figures(stage_dir).items():
        path = Path(stage_dir) / f"{name}.png"
        fig.savefig(path, dpi=dpi)
        paths.append(path)
    return paths
