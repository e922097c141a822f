"""Stage 02 (``notebooks/02_hidden_states.ipynb``): the target's hidden states EAGLE-3 trains on.

Light to import (the CLI and ``validate`` load it): torch, transformers and safetensors load on first use.
"""

from __future__ import annotations

from eagle3nb.layers import check_layer_ids, default_aux_layer_ids, from_sglang, to_sglang
from eagle3nb.hidden.params import HiddenParams

__all__ = ["HiddenParams", "HiddenStates", "VllmSampleStates", "extract", "check_layer_ids", "default_aux_layer_ids",
           "from_sglang", "to_sglang"]


def __getattr__(name: str):
    if name in ("HiddenStates", "VllmSampleStates"):
        from eagle3nb.hidden import reader

        return getattr(reader, name)
    if name == "extract":
        from eagle3nb.hidden.stage import extract

        return extract
    raise AttributeError(f"module 'eagle3nb.hidden' has no attribute {name!r}")
