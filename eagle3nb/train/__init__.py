"""03_train: training-time test, the training loop (single process or torchrun), checkpoints, export.

Importing this package registers the ``03_train`` parameter schema without importing torch; the training
functions load on first use."""

from __future__ import annotations

from eagle3nb.train.params import TrainParams

__all__ = ["TrainParams", "train", "describe", "evaluate", "export", "read_metrics", "plot_metrics", "LivePlot"]


def __getattr__(name: str):
    if name in ("train", "describe", "evaluate", "export", "read_metrics"):
        from eagle3nb.train import loop

        return getattr(loop, name)
    if name in ("plot_metrics", "LivePlot"):
        from eagle3nb.train import plot

        return getattr(plot, name)
    raise AttributeError(name)
