"""Broken ``mask_embedding.pt`` files of a block drafter, the way a new user's export brings them: dead ones (every
mask slot would read nothing) and ones vLLM would not load or would load as another row. ``tests/test_misconfig.py``
has each refused by ``start_vllm``, ``eagle3nb serve``, the doctor and ``load_draft``; ``tests/test_bad_input.py``
by 04. Each names what the refusal must say: the file, what is wrong and what to do (retrain, delete, re-export)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


class NotATensor:
    """A pickled object of a class of its own: ``torch.load(weights_only=True)``, the way vLLM loads the file,
    refuses it."""


@dataclass(frozen=True)
class MaskFile:
    """``state(mask id, H)``, what ``torch.save`` writes as the file (raw bytes: the file itself); ``names``: what
    the refusal says; ``row``: the draft's mask token, a ``live`` or a ``dead`` row of the target."""

    state: Callable[[int, int], object] | bytes
    names: tuple[str, ...]
    row: str = "live"

    def write(self, folder: Path) -> Path:
        """Replace the ``mask_embedding.pt`` of the block drafter in ``folder`` (either layout)."""
        cfg = json.loads((folder / "config.json").read_text())
        mask_id = (cfg.get("dflash_config") or cfg)["mask_token_id"]
        hidden = (cfg.get("transformer_layer_config") or cfg)["hidden_size"]
        file = folder / "mask_embedding.pt"
        if isinstance(self.state, bytes):
            file.write_bytes(self.state)
        else:
            torch.save(self.state(mask_id, hidden), file)
        return folder


MASK_FILES = {
    "an all-zero mask_embedding.pt": MaskFile(
        lambda i, H: {"mask_token_id": i, "embedding": torch.zeros(H)},
        ("mask_embedding.pt is a dead mask input (all zeros)", "delete it", "init_from: null")),
    "an all-zero mask_embedding.pt over a dead row": MaskFile(
        lambda i, H: torch.zeros(H),
        ("mask_embedding.pt is a dead mask input (all zeros)", "init_from: null", "then re-export it"), row="dead"),
    "a tiny mask_embedding.pt": MaskFile(
        lambda i, H: torch.full((H,), 1e-7),
        ("mask_embedding.pt is a dead mask input (norm", "under 0.001 x the target's median row norm")),
    "a NaN mask_embedding.pt": MaskFile(
        lambda i, H: {"mask_token_id": i, "embedding": torch.full((H,), float("nan"))},
        ("mask_embedding.pt is a dead mask input", "values are NaN or infinite", "delete it")),
    "a mask_embedding.pt that is not a torch file": MaskFile(
        b"mask embedding: see the paper\n",
        ("mask_embedding.pt is not a torch file", "re-export the draft", "or delete mask_embedding.pt")),
    "a mask_embedding.pt torch.load(weights_only) refuses": MaskFile(
        lambda i, H: {"mask_token_id": i, "embedding": NotATensor()},
        ("mask_embedding.pt holds Python objects", "weights_only=True", "re-export the draft")),
    "a mask_embedding.pt dict without embedding": MaskFile(
        lambda i, H: {"mask_token_id": i, "vector": torch.randn(H)},
        ("holds a dict without 'embedding'", "re-export the draft")),
    "a mask_embedding.pt of another size": MaskFile(
        lambda i, H: torch.randn(H + 1), ("holds a tensor of shape [", "not the draft's hidden size", "re-export")),
    "a mask_embedding.pt of another mask id": MaskFile(
        lambda i, H: {"mask_token_id": i + 1, "embedding": torch.randn(H)},
        ("is the mask embedding of mask_token_id", "config.json's mask_token_id", "re-export the draft")),
}
