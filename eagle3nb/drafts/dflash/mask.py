"""The mask token a block drafter fills its block's slots with, as vLLM embeds it: the target's embedding row of
``mask_token_id``, unless the draft folder ships a trained ``mask_embedding.pt`` that vLLM loads over that row
(``qwen3_dflash.py`` ``_read_mask_embedding``). A row the target never trained (a reserved or padding token: norm
near zero) gives every mask slot the same empty input, and the block drafts from its anchor alone; so does a file
whose vector is zero, tiny or not finite. Both are refused here in one line (:class:`MaskInputError`), as is a file
vLLM would not load or would load wrong: by ``load_draft`` (:func:`read_mask_file`), the serving check
(:func:`mask_problems`, no model loaded) and a loaded draft's ``check_usable`` (:func:`dead_mask_problem`)."""

from __future__ import annotations

import pickle
import re
import warnings
from pathlib import Path

import torch

from eagle3nb.drafts.base import DraftMismatchError, Misfit

# vLLM's name for a separately trained mask embedding, read from the draft's folder.
MASK_EMBEDDING_FILE = "mask_embedding.pt"
# The target's row of mask_token_id is dead below this share of the median row norm of its embedding (trained rows
# sit around the median; the toy's and the big vocabularies' reserved rows are zero or near it).
DEAD_ROW_FRACTION = 0.5
# A row or a trained mask vector is ~0 under this share of the median row norm (padding and never-trained rows; an
# all-zero or as tiny export): RMSNorm's eps swamps it, so layer 1 sees no input. A trained vector is held to this, not
# to DEAD_ROW_FRACTION: a fresh one starts at the live rows' mean (``live_mean``), whose norm is a fraction of a row's
# (0.23 x the median on the smoke toy, 0.16 on the demo), and RMSNorm scales any vector but a ~0 one back up.
NEAR_ZERO_FRACTION = 1e-3
FRESH = "retrain the draft fresh (03_train init_from: null), which trains its own mask embedding"


class MaskInputError(DraftMismatchError):
    """A block drafter's mask input that cannot work: ``what`` is wrong and ``fix`` says what to do; the message is
    both in one line, the serving check lists them as a misfit and the doctor shows the fix apart."""

    def __init__(self, what: str, fix: str):
        super().__init__(f"{what}: {fix}")
        self.what, self.fix = what, fix


def row_norms(embed_tokens: torch.Tensor) -> torch.Tensor:
    """[V, H] -> [V] the L2 norm of every embedding row, in float32."""
    return embed_tokens.detach().float().norm(dim=-1)


def live_mean(embed_tokens: torch.Tensor) -> torch.Tensor:
    """[V, H] -> [H] the mean of the live rows, leaving out those whose norm is ~0 (under ``NEAR_ZERO_FRACTION``
    of the median: padding and never-trained rows): where a fresh ``mask_embedding`` starts, a typical input, so every
    mask slot's layer 1 differs by position."""
    norms = row_norms(embed_tokens)  # shape: [V]
    return embed_tokens.detach().float()[norms > NEAR_ZERO_FRACTION * norms.median()].mean(0)  # shape: [H]


# What torch's weights_only unpickler says inside its long refusal: the class it refuses, or why it stopped.
_GLOBAL = re.compile(r"Unsupported global: GLOBAL (\S+)")
_UNPICKLER = re.compile(r"WeightsUnpickler error:\s*(\S[^\n]*)")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:120] if text else ""


def read_mask_file(file: Path, mask_token_id: int, hidden_size: int) -> torch.Tensor:
    """[H] the vector of a ``mask_embedding.pt`` as vLLM reads it (``torch.load(weights_only=True)``: a tensor, or
    a dict whose ``embedding`` it is and whose ``mask_token_id``, when given, is the config's); a file it would not
    load, or would load as another row or size, is a :class:`MaskInputError` naming the file and the fix."""
    fix = (f"re-export the draft with 03_train (its export writes vLLM's {{mask_token_id, embedding}}), or delete "
           f"{file.name} (the mask slots then read the target's row of mask_token_id {mask_token_id})")
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol of a file it then refuses
            warnings.simplefilter("ignore")
            state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only's unpickler: an object it refuses, or no pickle at all
        if found := _GLOBAL.search(str(e)):
            raise MaskInputError(f"{file} holds Python objects ({found[1]}) that torch.load(weights_only=True), the "
                                 "way vLLM loads it, refuses", fix) from None
        why = _UNPICKLER.search(str(e))
        raise MaskInputError(f"{file} is not a torch file ({why[1] if why else _first_line(e)})", fix) from None
    except Exception as e:  # noqa: BLE001 - torch.load fails on a foreign file with any error (a KeyError on text)
        raise MaskInputError(f"{file} is not a torch file ({type(e).__name__}: {_first_line(e)})", fix) from None
    if isinstance(state, dict):
        if "embedding" not in state:
            raise MaskInputError(f"{file} holds a dict without 'embedding' (its keys: {sorted(map(str, state))[:6]}) "
                                 "where vLLM reads {mask_token_id, embedding}", fix)
        own = state.get("mask_token_id", mask_token_id)
        try:
            same = int(own) == mask_token_id
        except (TypeError, ValueError, RuntimeError):  # not one id
            same = False
        if not same:
            raise MaskInputError(f"{file} is the mask embedding of mask_token_id {own}, but config.json's "
                                 f"mask_token_id is {mask_token_id} (vLLM refuses it)", fix)
        state = state["embedding"]
    if not isinstance(state, torch.Tensor):
        raise MaskInputError(f"{file} holds a {type(state).__name__} where vLLM reads a tensor of {hidden_size} "
                             "values", fix)
    if state.numel() != hidden_size:
        raise MaskInputError(f"{file} holds a tensor of shape {list(state.shape)}, not the draft's hidden size "
                             f"{hidden_size}", fix)
    return state.reshape(-1)  # shape: [H]


def dead_mask_problem(norms: torch.Tensor, mask_token_id: int, vector: torch.Tensor | None,
                      where: str | Path) -> Misfit | None:
    """Why every mask slot of the draft in ``where`` would carry no input (None when they do not): ``norms`` [V]
    the target's embedding row norms, ``vector`` [H] its trained mask embedding (None: no ``mask_embedding.pt``, so
    the slots read the target's row of ``mask_token_id``). A row is dead under ``DEAD_ROW_FRACTION`` of the median
    row norm, a vector under ``NEAR_ZERO_FRACTION`` of it (zero included) or when any value is NaN or infinite."""
    V = norms.numel()
    if not 0 <= mask_token_id < V:
        return (f"mask_token_id {mask_token_id} is outside the target's {V}-token vocabulary",
                "retrain the draft with a mask_token_id of this target (03_train), or serve it beside its own target")
    median, row = float(norms.float().median()), float(norms[mask_token_id])
    live_row = row >= DEAD_ROW_FRACTION * median
    if vector is None:
        if live_row:
            return None
        return (f"mask_token_id {mask_token_id}'s embedding row is dead (norm {row:.3g}, under {DEAD_ROW_FRACTION} x "
                f"the median row norm {median:.3g}), a dead input for every mask slot, and {where} has no trained "
                f"{MASK_EMBEDDING_FILE}",
                f"ship the draft's trained mask embedding as {MASK_EMBEDDING_FILE} in {where} (vLLM loads it over "
                f"the row), or {FRESH}")
    v = vector.detach().float()  # shape: [H]
    finite = torch.isfinite(v)
    if not bool(finite.all()):
        bad = f"{int((~finite).sum())} of its {v.numel()} values are NaN or infinite"
    else:
        norm = float(v.norm())
        if norm >= NEAR_ZERO_FRACTION * median:
            return None
        bad = "all zeros" if norm == 0 else \
            f"norm {norm:.3g}, under {NEAR_ZERO_FRACTION:g} x the target's median row norm {median:.3g}"
    fix = (f"delete it (the mask slots then read the target's live row of mask_token_id {mask_token_id}) or {FRESH}"
           if live_row else f"{FRESH}, then re-export it (the target's row of mask_token_id {mask_token_id} is dead "
                            "too)")
    return (f"{Path(where) / MASK_EMBEDDING_FILE} is a dead mask input ({bad}): every mask slot would read it and "
            "draft from the anchor alone", fix)


def mask_problems(draft_dir: Path, mask_token_id: int, hidden_size: int, norms: torch.Tensor) -> list[Misfit]:
    """The mask input of the checkpoint in ``draft_dir`` as vLLM would serve it beside a target of embedding row
    norms ``norms`` [V], read without loading the draft: its ``mask_embedding.pt`` unreadable or dead, or no file
    and a dead row. [] when every mask slot carries a live input."""
    file = Path(draft_dir) / MASK_EMBEDDING_FILE
    vector = None
    if file.is_file():
        try:
            vector = read_mask_file(file, mask_token_id, hidden_size)
        except MaskInputError as e:
            return [(e.what, e.fix)]
    problem = dead_mask_problem(norms, mask_token_id, vector, draft_dir)
    return [problem] if problem else []
