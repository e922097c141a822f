"""03's report, from what ``stage.run`` wrote (metrics.jsonl): the loss curve and the held-out simulated
acceptance length, live (``LivePlot``) or after (``plot_metrics``, ``training.png``), and the before/after table."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

FIGURE = "training.png"


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl (a torn last line from a kill is skipped)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


def plot_metrics(rows: list[dict[str, Any]] | str | Path, fig=None):
    """Two panels from metrics.jsonl rows (or its folder): train/held-out loss, and held-out acceptance
    length with per-step accuracy of the last evaluation."""
    if not isinstance(rows, list):
        rows = read_metrics(Path(rows))
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    if fig is None:
        import matplotlib.pyplot as plt

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


def save_figures(stage_dir: str | Path) -> list[Path]:
    """Write ``training.png`` (``plot_metrics``) into the stage folder; ``run`` calls it at the end, so a headless
    run has it. Drawn on a bare Figure: nothing is shown and pyplot's state is untouched."""
    from matplotlib.figure import Figure

    path = Path(stage_dir) / FIGURE
    fig = plot_metrics(Path(stage_dir), Figure(figsize=(11, 3.6)))
    fig.savefig(path, dpi=120)
    return [path]


def heldout_table(metrics: dict[str, Any]):
    """Held-out accuracy per draft step and simulated acceptance length, before and after training (pandas)."""
    import pandas as pd

    before, after = metrics["initial_heldout"], metrics["heldout"]
    return pd.DataFrame({"before": before["acc"], "after": after["acc"]},
                        index=pd.Index(range(len(after["acc"])), name="draft step")).T.assign(
        acceptance_length=[before["acceptance_length"], after["acceptance_length"]])


class LivePlot:
    """``stage.run(P, callback=LivePlot())`` redraws the figure in JupyterLab at most every ``every_s`` seconds
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
