"""Where a stage's figures go: ``<stage_dir>/<name>.png``, written by its ``run`` so a headless run and the HTML
report have them. One helper for every stage's ``report.save_figures``."""

from __future__ import annotations

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
