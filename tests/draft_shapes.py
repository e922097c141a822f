"""The shape 03 gives a fresh draft, for a target known by its config.json alone (no weights): the folder, what 02
records of it, and 03's fresh EAGLE-3 config from both. Shared by the published-drafts and EAGLE-3.1 tests."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3nb.drafts.eagle3.fresh import fresh_config
from eagle3nb.drafts.eagle3.model import Eagle3Config
from eagle3nb.layers import default_aux_layer_ids
from eagle3nb.train.build import target_config


def target_dir(root: Path, config: dict) -> Path:
    """``root`` holding ``config`` as its config.json: all 03 reads of a target to shape a fresh draft."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    return root


def meta_of(model_dir: Path, config: dict) -> dict:
    """What 02 records about a target (index.json's keys a fresh draft reads)."""
    text = config.get("text_config") or config
    return {"model_path": str(model_dir), "hidden_size": text["hidden_size"], "vocab_size": text["vocab_size"],
            "layer_ids": default_aux_layer_ids(text["num_hidden_layers"]),
            "num_layers": text["num_hidden_layers"]}


def shaped(P, meta: dict, draft_vocab_size: int) -> Eagle3Config:
    """03's fresh EAGLE-3 draft config for the target 02 recorded in ``meta`` (its config.json as 03 reads it)."""
    return fresh_config(P, meta, target_config(meta), draft_vocab_size)
