"""Figures for the 03 notebook: the loss curve and the held-out simulated acceptance length, live or after."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def plot_metrics(rows: list[dict[str, Any]] | str | Path, fig=None):
    """Two panels from metrics.jsonl rows (or its folder): train/held-out loss, and held-out acceptance
    length with per-step accuracy of the last evaluation."""
    import matplotlib.pyplot as plt

    from eagle3nb.train.loop import read_metrics

    if not isinstance(rows, list):
        rows = read_metrics(Path(rows))
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    if fig is None:
        fig = plt.figure(figsize=(11, 3.6))
    fig.clear()
    ax1, ax2, ax3 = fig.subplots(1, 3)
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, label="train")
    ax1.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label="held-out")
    ax1.set(xlabel="step", ylabel="TTT loss (weighted soft CE)", title="loss")
    ax1.legend()
    ax2.plot([r["step"] for r in evals], [r["acceptance_length"] for r in evals], "o-", color="C2")
    ax2.set(xlabel="step", ylabel="tokens per verify step", title="held-out simulated acceptance length")
    if evals:
        acc = evals[-1]["acc"]
        ax3.bar(range(len(acc)), acc, color="C3")
        ax3.set_ylim(0, 1)
    ax3.set(xlabel="draft step i", ylabel="accuracy", title="held-out accuracy per TTT step")
    fig.tight_layout()
    return fig


class LivePlot:
    """``train(P, callback=LivePlot())`` redraws the figure in JupyterLab at most every ``every_s`` seconds
    (and at each evaluation); without IPython (papermill, scripts) it only keeps the rows."""

    def __init__(self, every_s: float = 5.0):
        self.rows: list[dict[str, Any]] = []
        self.every_s, self.last = every_s, 0.0
        self.handle = self.fig = None

    def __call__(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        now = time.time()
        if row["kind"] != "eval" and now - self.last < self.every_s:
            return
        self.last = now
        try:
            from IPython import get_ipython
            from IPython.display import display
        except ImportError:
            return
        if get_ipython() is None:
            return
        import matplotlib.pyplot as plt

        if self.fig is None:
            self.fig = plt.figure(figsize=(11, 3.6))
            plt.close(self.fig)  # shown through the display handle only
        plot_metrics(self.rows, self.fig)
        if self.handle is None:
            self.handle = display(self.fig, display_id=True)
        else:
            self.handle.update(self.fig)
