"""What vLLM would read wrong from an EAGLE-3 checkpoint served beside a target (``DraftMethod.serving_problems``):
aux layer ids the target has no layer for, and sizes or a ``d2t`` map that do not fit its vocabulary. vLLM reads
``eagle_aux_hidden_state_layer_ids`` (top level, else ``eagle_config``) as input-of-layer ids, our convention."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3nb.drafts.base import Misfit, Serving, aux_ids_misfits, read_tensor, vocab_misfits
from eagle3nb.drafts.eagle3.layouts import _config_from_json


def serving_problems(path: Path, config: dict[str, Any], serving: Serving) -> list[Misfit]:
    """The checkpoint in ``path`` (``config`` its config.json) against ``serving``'s target; any k serves it."""
    cfg = _config_from_json(config, path)
    d2t = read_tensor(path, "d2t")
    return (aux_ids_misfits(cfg.aux_layer_ids, "eagle_aux_hidden_state_layer_ids", 0, serving.target)
            + vocab_misfits(cfg.target_hidden_size, cfg.vocab_size, cfg.draft_vocab_size, d2t, serving.target))
