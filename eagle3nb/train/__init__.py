"""Stage 03 (``notebooks/03_train.ipynb``): train (or fine-tune) the draft of ``method`` (EAGLE-3 with its
training-time test, or a block drafter: DFlash, DSpark) on 02's hidden states, in one process or under
torchrun, and export it for vLLM/SGLang. ``stage.run(P)`` does the work; ``report`` draws what it wrote.
Importing this package registers the ``03_train`` schema (no torch)."""

from __future__ import annotations

from eagle3nb.train.params import TrainParams

__all__ = ["TrainParams"]
