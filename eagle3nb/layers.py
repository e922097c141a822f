"""Which target layers a draft reads (EAGLE-3's three, the block drafters' spread), and the two numbering
conventions for them.

Our one convention is the Hugging Face ``hidden_states`` index, which is also vLLM's
``eagle_aux_hidden_state_layer_ids``: id ``i`` is the *input* of decoder layer ``i`` (= the output of
layer ``i-1``; id 0 is the embeddings). SGLang/SpecForge number the same tensors by the layer whose
*output* they are, so their id is ours minus one. The same numbers name different layers in the two
engines, and an off-by-one collapses acceptance, so every boundary converts explicitly.
"""

from __future__ import annotations

import warnings

from eagle3nb.errors import UserError


class LayerIdError(UserError, ValueError):
    """Aux layer ids that cannot be right for this target."""


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's choice (low, middle, high) in HF/vLLM ids: ``[2, L//2, L-3]``."""
    if num_layers < 6:
        raise LayerIdError(f"the target has {num_layers} decoder layers; EAGLE-3's default ids need at least 6")
    return [2, num_layers // 2, num_layers - 3]


def spread_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """The block drafters' recipe (z-lab's DFlash, SpecForge, speculators' DFlash scripts): ``count`` target layers
    evenly from 1 to L-3 in DFlash's output-of-layer numbering (the middle layer alone for one), returned in ours
    (+1)."""
    if count == 1:
        return [num_target_layers // 2 + 1]
    start, end = 1, num_target_layers - 3
    if end <= start:
        raise LayerIdError(f"a {num_target_layers}-layer target is too shallow for the spread 1..L-3: set 02's "
                           "aux_layer_ids")
    return [round(start + i * (end - start) / (count - 1)) + 1 for i in range(count)]


def to_sglang(ids: list[int]) -> list[int]:
    """HF/vLLM ids -> SGLang/SpecForge (output-of-layer) ids: minus one."""
    return [int(i) - 1 for i in ids]


def from_sglang(ids: list[int]) -> list[int]:
    """SGLang/SpecForge (output-of-layer) ids -> HF/vLLM ids: plus one."""
    return [int(i) + 1 for i in ids]


def check_layer_ids(ids: list[int] | tuple[int, ...], num_layers: int) -> list[int]:
    """Validate aux ids (HF/vLLM convention) for a target with ``num_layers`` decoder layers.

    Raises on ids out of ``[0, L-1]`` (``L`` is the final state, stored separately), duplicates, or ids
    not increasing; warns loudly when the ids are exactly SGLang's default for this depth, which means
    someone copied them across conventions.
    """
    ids = [int(i) for i in ids]
    if not ids:
        raise LayerIdError("aux_layer_ids is empty; leave it unset (null) for the EAGLE-3 default "
                           f"{default_aux_layer_ids(num_layers) if num_layers >= 6 else '[2, L//2, L-3]'}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise LayerIdError(
            f"aux_layer_ids {ids}: {bad} out of range for a target with {num_layers} decoder layers; ids are "
            f"HF hidden_states indices / vLLM ids in [0, {num_layers - 1}] (id {num_layers} is the final state, "
            "which is always stored). Fix aux_layer_ids, or leave it unset for the default")
    if len(set(ids)) != len(ids) or ids != sorted(ids):
        raise LayerIdError(f"aux_layer_ids {ids}: list distinct ids in increasing order (low, middle, high)")
    if num_layers >= 6:
        sglang_default = to_sglang(default_aux_layer_ids(num_layers))
        if ids == sglang_default:
            msg = (f"aux_layer_ids {ids} look like SGLang/SpecForge (output-of-layer) ids for a "
                   f"{num_layers}-layer target. Here ids are HF hidden_states / vLLM ids: the same layers are "
                   f"{from_sglang(ids)} (= the EAGLE-3 default). Using {ids} as given shifts every aux state one "
                   "layer down, which is known to collapse acceptance. Set aux_layer_ids to "
                   f"{from_sglang(ids)} (or leave it unset) unless you mean it.")
            print("WARNING:", msg, flush=True)
            warnings.warn(msg, stacklevel=2)
    return ids
