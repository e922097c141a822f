"""What every stage's report shares: where its figures go (``<stage_dir>/<name>.png``, written by its ``run`` so a
headless run and the HTML report have them; one helper for every stage's ``report.save_figures``), and the
three-line headline each report opens with."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any


def save_figures(figs: dict[str, Any], stage_dir: str | Path, dpi: int = 100) -> list[Path]:
    """Write each matplotlib figure as ``stage_dir/<name>.png`` and close it (a notebook cell that ran the stage
    does not show it a second time); returns the paths."""
    import matplotlib.pyplot as plt

    stage_dir = Path(stage_dir)
    stage_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figs.items():
        paths.append(stage_dir / f"{name}.png")
        fig.savefig(paths[-1], dpi=dpi, bbox_inches="tight")
        plt.close(fig)
    return paths


class Headline:
    """A report's first lines, before its check-up: what was measured, whether it pays, what to do next. The
    notebook shows it near its top before the stage runs (a line saying so) and fills it in at the end; the
    display is updated in place, in JupyterLab as in the executed notebook papermill saves, so the rendered
    report opens with the verdict its later sections explain."""

    def __init__(self, stage: str):
        from IPython.display import HTML, display

        self.stage = stage
        self.handle = display(HTML(f"<p><b>{stage}</b>: the verdict appears here when the stage has run.</p>"),
                              display_id=True)

    def fill(self, measured: str, pays: str, next_step: str) -> None:
        self.handle.update(headline_html(measured, pays, next_step))


def headline_html(measured: str, pays: str, next_step: str):
    """The three lines as HTML: measured, whether it pays, next."""
    from IPython.display import HTML

    rows = (("Measured", measured), ("Pays?", pays), ("Next", next_step))
    return HTML("<div style='border-left:4px solid #1f6feb;padding:4px 10px;margin:6px 0'>" + "".join(
        f"<div><b>{k}:</b> {html.escape(v)}</div>" for k, v in rows) + "</div>")
