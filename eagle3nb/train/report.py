"""03's report, from what ``stage.run`` wrote (metrics.jsonl): the loss curve and the held-out simulated
acceptance length, live (``LivePlot``) or after (``plot_metrics``, ``training.png``), held-out acceptance by draft
position over training with the best evaluation (``plot_positions``, ``acceptance_by_position.png``), a confidence
head's reliability before and after its calibration (``plot_calibration``, ``calibration.png``), and the
before/after table."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

FIGURE = "training.png"
DATA_FIGURE = "data_curve.png"
POSITIONS_FIGURE = "acceptance_by_position.png"
CALIBRATION_FIGURE = "calibration.png"  # a draft with a confidence head (DSpark): its reliability diagram


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


def acc_unit(evals: list[dict[str, Any]]) -> str:
    """What the evaluations' ``acc`` entries are per: TTT step (EAGLE-3, and runs from before ``acc_by``), or a
    block drafter's block position."""
    return evals[-1].get("acc_by", "TTT step") if evals else "TTT step"


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
    ax1.set(xlabel="step", ylabel="loss (weighted over the steps)", title="loss")
    ax1.legend()
    ax2.plot([r["step"] for r in evals], [r["acceptance_length"] for r in evals], "o-", color="C2")
    ax2.set(xlabel="step", ylabel="tokens per verify step", title="held-out simulated acceptance length")
    unit = acc_unit(evals)
    if evals:
        acc = evals[-1]["acc"]
        ax3.bar(range(len(acc)), acc, color="C3")
        ax3.set_ylim(0, 1)
    ax3.set(xlabel=f"{unit} i", ylabel="accuracy", title=f"held-out accuracy per {unit}")
    fig.tight_layout()
    return fig


def plot_positions(rows: list[dict[str, Any]] | str | Path, best_step: int | None = None, fig=None):
    """Held-out acceptance at each draft position (the draft's token i accepted, given tokens < i were) at every
    evaluation, and the evaluation whose weights ``draft/`` holds (``best_step``; metrics.json ``best``): where the
    deep positions stop improving while the first still climbs, or an evaluation after the best one got worse."""
    if not isinstance(rows, list):
        rows = read_metrics(Path(rows))
    evals = [r for r in rows if r["kind"] == "eval"]
    if fig is None:
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(6.5, 4))
    fig.clear()
    ax = fig.subplots()
    steps = [r["step"] for r in evals]
    for i in range(len(evals[0]["acc"]) if evals else 0):
        ax.plot(steps, [r["acc"][i] for r in evals], "o-", ms=3, color=f"C{i % 10}",
                label=f"{'block ' if acc_unit(evals) == 'block position' else ''}position {i + 1}")
    if best_step is not None:
        ax.axvline(best_step, color="gray", ls="--", lw=1, label=f"best (step {best_step}): draft/")
    ax.set_ylim(0, 1)
    by = "block position" if acc_unit(evals) == "block position" else "draft position"
    ax.set(xlabel="step", ylabel="held-out acceptance (given the earlier positions)",
           title=f"held-out acceptance by {by}")
    if evals:
        ax.legend(fontsize=7, loc="lower right", ncol=2)
    fig.tight_layout()
    return fig


def best_step(stage_dir: str | Path) -> int | None:
    """The step of the evaluation ``draft/`` holds (metrics.json ``best``; None before run wrote it)."""
    path = Path(stage_dir) / "metrics.json"
    return (json.loads(path.read_text()).get("best") or {}).get("step") if path.exists() else None


def data_curve(rows: list[dict[str, Any]] | str | Path, train_samples: int | None = None) -> dict[str, Any]:
    """Held-out acceptance length against training samples seen (the evaluations that recorded it), and whether
    it still rises at the end: the slope over the last third of the points (at least two) in tokens per verify
    step gained per doubling of the samples seen. Samples seen count repeats after the first epoch
    (``train_samples``), which teach less than new data would."""
    if not isinstance(rows, list):
        rows = read_metrics(Path(rows))
    pts = [(r["samples_seen"], r["acceptance_length"]) for r in rows if r["kind"] == "eval" and "samples_seen" in r]
    out: dict[str, Any] = {"points": pts, "slope_per_doubling": None, "rising": None,
                           "text": "too few held-out evaluations to tell (set eval_every)"}
    tail = [(x, y) for x, y in pts if x > 0]
    tail = tail[-max(2, math.ceil(len(tail) / 3)):]
    if len(tail) < 2 or tail[0][0] == tail[-1][0]:
        return out
    xs = [math.log2(x) for x, _ in tail]
    mx, my = sum(xs) / len(xs), sum(y for _, y in tail) / len(tail)
    slope = sum((x - mx) * (y - my) for x, (_, y) in zip(xs, tail)) / sum((x - mx) ** 2 for x in xs)
    rising = slope > RISING_PER_DOUBLING
    epochs = f" ({tail[-1][0] / train_samples:.1f} epochs of {train_samples} samples)" if train_samples else ""
    verdict = ("still rising: more data (new samples, not more epochs of the same) should raise acceptance"
               if rising else "flat at the end: more of the same data is unlikely to help much; more varied data, "
               "longer samples or a bigger draft might")
    out.update(slope_per_doubling=slope, rising=rising,
               text=f"held-out acceptance length {tail[-1][1]:.2f} after {tail[-1][0]} samples seen{epochs}; "
                    f"{slope:+.3f} per doubling of the samples seen over the last {len(tail)} evaluations: {verdict}")
    return out


RISING_PER_DOUBLING = 0.02  # tokens per verify step gained per doubling of data seen: above this, still rising


def plot_data_curve(rows: list[dict[str, Any]] | str | Path, train_samples: int | None = None, fig=None):
    """Held-out acceptance length vs training samples seen (from the untrained start), the end slope in the
    title, a line where each epoch ends (after it, samples are repeats)."""
    if not isinstance(rows, list):
        rows = read_metrics(Path(rows))
    curve = data_curve(rows, train_samples)
    if fig is None:
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(6.5, 4))
    fig.clear()
    ax = fig.subplots()
    pts = curve["points"]
    if pts:
        ax.plot(*zip(*pts), "o-", color="C2", label="held-out (simulated) acceptance length")
        if train_samples:
            ends = [e * train_samples for e in range(1, int(pts[-1][0] // train_samples) + 1)]
            for i, x in enumerate(ends):
                ax.axvline(x, color="gray", ls=":", lw=0.8, label="end of an epoch" if i == 0 else None)
        ax.set_ylim(1.0, max(y for _, y in pts) * 1.1 + 0.05)  # tau >= 1: the floor is no acceptance at all
        ax.legend(fontsize=8, loc="upper left")
    slope = curve["slope_per_doubling"]
    ax.set(xlabel="training samples seen", ylabel="tokens per verify step",
           title="Would more data help? " + (f"end slope {slope:+.3f} per doubling: "
                                             f"{'still rising' if curve['rising'] else 'flat'}" if slope is not None
                                             else "too few evaluations"))
    fig.tight_layout()
    return fig


def plot_calibration(calibration: dict[str, Any], fig=None):
    """The confidence head's reliability diagram on the held-out slots (metrics.json ``calibration``): mean
    acceptance probability against mean confidence per bin, before and after the temperature, the diagonal
    being a calibrated head; each point's size is its bin's share of the slots."""
    if fig is None:
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(5, 4.5))
    fig.clear()
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], color="gray", ls=":", lw=0.8, label="calibrated")
    n = max(1, calibration["slots"])
    for when, color in (("before", "C3"), ("after", "C0")):
        pts = calibration[f"reliability_{when}"]
        ax.plot([p["confidence"] for p in pts], [p["acceptance"] for p in pts], "-", color=color, lw=1,
                label=f"{when} (ECE {calibration[f'ece_{when}']:.3f})")
        ax.scatter([p["confidence"] for p in pts], [p["acceptance"] for p in pts], color=color,
                   s=[10 + 200 * p["n"] / n for p in pts])
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence (the head's estimate)", ylabel="acceptance probability",
           title=f"Confidence head, {calibration['slots']} held-out slots: temperature "
                 f"{calibration['temperature']:.2f}{'' if calibration['applied'] else ' (not applied)'}")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def save_figures(stage_dir: str | Path) -> list[Path]:
    """Write ``training.png`` (``plot_metrics``), ``data_curve.png`` (``plot_data_curve``),
    ``acceptance_by_position.png`` (``plot_positions``) and, for a calibrated head, ``calibration.png``
    (``plot_calibration``) into the stage folder; ``run`` calls it at the end, so a
    headless run has them. Drawn on bare Figures: nothing is shown and pyplot's state is untouched."""
    from matplotlib.figure import Figure

    stage_dir = Path(stage_dir)
    path = stage_dir / FIGURE
    fig = plot_metrics(stage_dir, Figure(figsize=(11, 3.6)))
    fig.savefig(path, dpi=120)
    curve = stage_dir / DATA_FIGURE
    plot_data_curve(stage_dir, train_samples(stage_dir), Figure(figsize=(6.5, 4))).savefig(curve, dpi=120)
    positions = stage_dir / POSITIONS_FIGURE
    plot_positions(stage_dir, best_step(stage_dir), Figure(figsize=(6.5, 4))).savefig(positions, dpi=120)
    out = [path, curve, positions]
    metrics = stage_dir / "metrics.json"
    if metrics.exists() and (calibration := json.loads(metrics.read_text()).get("calibration")):
        out.append(stage_dir / CALIBRATION_FIGURE)
        plot_calibration(calibration, Figure(figsize=(5, 4.5))).savefig(out[-1], dpi=120)
    return out


def train_samples(stage_dir: str | Path) -> int | None:
    """The training split's size from metrics.json (None before run wrote it)."""
    path = Path(stage_dir) / "metrics.json"
    return json.loads(path.read_text()).get("train_samples") if path.exists() else None


def heldout_table(metrics: dict[str, Any]):
    """Held-out accuracy per draft step and simulated acceptance length, before and after training (pandas)."""
    import pandas as pd

    before, after = metrics["initial_heldout"], metrics["heldout"]
    unit = acc_unit([after]).replace("TTT step", "draft step")
    return pd.DataFrame({"before": before["acc"], "after": after["acc"]},
                        index=pd.Index(range(len(after["acc"])), name=unit)).T.assign(
        acceptance_length=[before["acceptance_length"], after["acceptance_length"]])


def title(P: Any) -> str:
    """The report's heading, naming what this run trains (EAGLE-3, DFlash, DSpark: the registry's title) and
    whether it fine-tunes a checkpoint."""
    from eagle3nb.drafts import get

    return f"{'Fine-tune' if P.init_from else 'Train'} the {get(P.method).title} draft"


def headline(metrics: dict[str, Any], stage_dir: str | Path) -> tuple[str, str, str]:
    """03's verdict in three lines (what training reached, whether the draft learned and more data would pay,
    what next) from its metrics and its held-out curve."""
    first, best = metrics.get("initial_heldout") or {}, metrics.get("best") or metrics.get("heldout") or {}
    tau0, tau = first.get("acceptance_length"), best.get("acceptance_length")
    measured = f"{metrics['steps']} steps on {metrics['train_samples']} samples"
    measured += (f": held-out acceptance length {tau:.2f} (step {best.get('step')}), {tau0:.2f} before training"
                 if tau is not None and tau0 is not None else " (no held-out evaluation)")
    curve = data_curve(Path(stage_dir), metrics["train_samples"])
    learned = tau is not None and tau0 is not None and tau > tau0 + 0.1
    pays = (("yes, it learned" if learned else "not yet: held-out acceptance barely moved") +
            ("; more data should still raise it" if curve["rising"] else ""))
    return measured, pays, ("run 04_acceptance: it measures the draft on your server and says whether serving "
                            "gets faster" if learned else "more samples (01 max_samples) or steps (03 max_steps), "
                            "or `eagle3nb doctor params/<run>/`")


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

    def clear(self) -> None:
        """Take the live figure out of the notebook once training is done, so the report draws the curve once."""
        if self.handle is not None:
            self.handle.update({"text/plain": ""}, raw=True)
