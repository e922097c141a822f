"""The mask token a block drafter fills its block's slots with, as vLLM embeds it: the target's embedding row of
``mask_token_id``, unless the draft folder ships a trained ``mask_embedding.pt`` that vLLM loads over that row
(``qwen3_dflash.py`` ``_read_mask_embedding``). A row the target never trained (a reserved or padding token: norm
near zero) gives every mask slot the same empty input, and the block drafts from its anchor alone."""

from __future__ import annotations

from pathlib import Path

import torch

# vLLM's name for a separately trained mask embedding, read from the draft's folder.
MASK_EMBEDDING_FILE = "mask_embedding.pt"
# A mask row is dead below this share of the median row norm of the target's embedding (trained rows sit around
# the median; the toy's and the big vocabularies' reserved rows are zero or near it).
DEAD_ROW_FRACTION = 0.5


def row_norms(embed_tokens: torch.Tensor) -> torch.Tensor:
    """[V, H] -> [V] the L2 norm of every embedding row, in float32."""
    return embed_tokens.detach().float().norm(dim=-1)


def live_mean(embed_tokens: torch.Tensor) -> torch.Tensor:
    """[V, H] -> [H] the mean of the live rows, leaving out those whose norm is ~0 (under 1e-3 of the median:
    padding and never-trained rows): where a fresh ``mask_embedding`` starts, a typical input, so every mask slot's
    layer 1 differs by position."""
    norms = row_norms(embed_tokens)  # shape: [V]
    return embed_tokens.detach().float()[norms > 1e-3 * norms.median()].mean(0)  # shape: [H]


def dead_mask_row(embed_tokens: torch.Tensor, mask_token_id: int) -> bool:
    """Whether the target's row of ``mask_token_id`` is too weak to be a block's mask input: its norm under
    ``DEAD_ROW_FRACTION`` of the median row norm."""
    norms = row_norms(embed_tokens)  # shape: [V]
    return bool(norms[mask_token_id] < DEAD_ROW_FRACTION * norms.median())


def dead_mask_reason(row_norms: torch.Tensor, mask_token_id: int, draft_dir: str | Path) -> str | None:
    """Why the mask slots would carry no input (None when they do): ``mask_token_id`` outside the target's
    vocabulary, or its row (``row_norms`` [V]: the target's embedding row norms) under half the median norm with
    no trained ``mask_embedding.pt`` in ``draft_dir``."""
    V = row_norms.numel()
    if not 0 <= mask_token_id < V:
        return f"mask_token_id {mask_token_id} is outside the target's {V}-token vocabulary"
    if (Path(draft_dir) / MASK_EMBEDDING_FILE).is_file():
        return None
    norm, median = float(row_norms[mask_token_id]), float(row_norms.float().median())  # as dead_mask_row
    if norm >= DEAD_ROW_FRACTION * median:
        return None
    return (f"the mask token {mask_token_id}'s embedding row is dead (norm {norm:.3g}, under {DEAD_ROW_FRACTION} x "
            f"the median row norm {median:.3g}) and {Path(draft_dir)} has no trained {MASK_EMBEDDING_FILE}")
