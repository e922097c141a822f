"""A LiLiCorr draft on disk, in the one layout that serves it: vLLM 0.32's (``model_executor/models/lilicorr.py``).
speculators 0.9.0 has no LiLiCorr (its algorithms stop at DFlash2), so there is no speculators layout.

- ``config.json`` is DFlash's vLLM config (``eagle3nb.drafts.dflash.layouts``: a Qwen3 config of the backbone,
  ``dflash_config {mask_token_id, target_layer_ids, block_size, causal}``) with ``architectures
  ["LiLiCorrDraftModel"]``, the architecture vLLM picks its LiLiCorr model and speculator by (served as ``method:
  dflash``), and the head's geometry in ``dflash_config``: ``lilicorr_enabled``, ``lilicorr_hidden_size``,
  ``lilicorr_candidate_topk``, ``lilicorr_num_heads``, ``lilicorr_mlp_ratio``, ``lilicorr_factor_dim``,
  ``lilicorr_vector_eps``, ``lilicorr_logit_scale``, ``lilicorr_num_layers`` (vLLM reads every one, none
  defaulted: the scale and the eps change the scores without changing a shape), plus ``conv_kernel_size`` /
  ``conv_group_size`` when the backbone has DFlash2's convolutions.
- ``model.safetensors``: the backbone's tensors under DFlash's names, the head's under ``lilicorr.`` (vLLM's
  ``load_weights`` loads those apart, with their own names: ``layers.{i}.attn.in_proj_weight``, ``mlp.up_proj`` ...).
  No target embedding, head nor ``d2t``: vLLM shares the target's and refuses a reduced vocabulary.
- ``mask_embedding.pt``, DFlash's trained mask input.

Served shorter than trained (``num_speculative_tokens`` k below the block's drafts), the export is the served block
of k + 1 slots, as DFlash's: vLLM runs k + 1 query slots whatever the config says, and its head reads the first k
slot embeddings and the slot-distance bias centred on the trained block, so the export keeps exactly those (the
first k rows, the 2k + 1 middle columns) and the served head scores as the trained one's first k slots do.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import torch

from eagle3nb.drafts.base import DraftMismatchError, Misfit
from eagle3nb.drafts.dflash import layouts as dflash_layouts
from eagle3nb.drafts.lilicorr.model import LatticeHead, LiLiCorrConfig, LiLiCorrDraft, head_problem

LAYOUTS = ("vllm",)
ARCHITECTURE = "LiLiCorrDraftModel"
# our config field -> vLLM's dflash_config key
HEAD_KEYS = {"lilicorr_hidden_size": "lilicorr_hidden_size", "lilicorr_topk": "lilicorr_candidate_topk",
             "lilicorr_num_heads": "lilicorr_num_heads", "lilicorr_mlp_ratio": "lilicorr_mlp_ratio",
             "lilicorr_factor_dim": "lilicorr_factor_dim", "lilicorr_vector_eps": "lilicorr_vector_eps",
             "lilicorr_logit_scale": "lilicorr_logit_scale", "lilicorr_num_layers": "lilicorr_num_layers"}
CONV_KEYS = ("conv_kernel_size", "conv_group_size")
HEAD = "lilicorr."


def claims(d: dict[str, Any]) -> bool:
    """Whether ``d`` (a config.json) is a LiLiCorr draft's: vLLM's layout naming its architecture."""
    return d.get("speculators_model_type") is None and ARCHITECTURE in (d.get("architectures") or [])


def check_format(format: str) -> None:
    if format not in LAYOUTS:
        raise DraftMismatchError(f"a LiLiCorr draft has vLLM's layout only, not {format!r} (speculators 0.9.0 has no "
                                 "LiLiCorr): set 03_train export_format to eagle3")


def layout_config(cfg: LiLiCorrConfig) -> dict[str, Any]:
    """vLLM's config.json of a LiLiCorr draft of shape ``cfg``."""
    out = dflash_layouts.layout_config(cfg.backbone(), "vllm")
    conv = {k: getattr(cfg, k) for k in CONV_KEYS} if cfg.conv_kernel_size > 0 else {}
    head = {theirs: getattr(cfg, ours) for ours, theirs in HEAD_KEYS.items()}
    return {**out, "architectures": [ARCHITECTURE],
            "dflash_config": {**out["dflash_config"], "lilicorr_enabled": True, **head, **conv}}


def config_from_json(d: dict[str, Any], path: Path | str = "config.json") -> LiLiCorrConfig:
    """The draft's shape from its config.json (DFlash's backbone fields and the head's ``lilicorr_*``)."""
    dc = d.get("dflash_config") or {}
    missing = [k for k in HEAD_KEYS.values() if k not in dc]
    if not claims(d) or missing or not dc.get("lilicorr_enabled", True):
        raise DraftMismatchError(f"{path}: not a LiLiCorr config vLLM serves (architectures {ARCHITECTURE}, "
                                 f"dflash_config.lilicorr_enabled and every lilicorr_* field; missing {missing}): "
                                 "re-export the draft with 03_train")
    backbone = dflash_layouts.config_from_json(d, path)
    head = {ours: type(getattr(LiLiCorrConfig, ours))(dc[theirs]) for ours, theirs in HEAD_KEYS.items()}
    return LiLiCorrConfig(**dataclasses.asdict(backbone), **head)


def served(cfg: LiLiCorrConfig, num_speculative_tokens: int | None) -> LiLiCorrConfig:
    """The config of the block served at ``num_speculative_tokens`` (k + 1 slots below the trained block's)."""
    k = num_speculative_tokens
    return dataclasses.replace(cfg, block_size=k + 1) if k is not None and k < cfg.drafts_per_block else cfg


def served_tensors(model: LiLiCorrDraft, block_size: int) -> dict[str, torch.Tensor]:
    """The model's tensors with the head's block-shaped ones cut to a served block of ``block_size`` slots: the
    first ``block_size - 1`` slot embeddings, the slot distances within it (centred as trained)."""
    state = model.state_dict()
    B, b = model.config.block_size, block_size
    state[f"{HEAD}slot_embedding"] = state[f"{HEAD}slot_embedding"][:, :, :b - 1]
    state[f"{HEAD}relative_slot_bias"] = state[f"{HEAD}relative_slot_bias"][:, B - b:B + b - 1]
    return state


def draft_config_json(model: LiLiCorrDraft, format: str = "vllm", dtype: torch.dtype | None = None,
                      verifier: str | None = None, num_speculative_tokens: int | None = None) -> dict[str, Any]:
    """The config.json of the block served at ``num_speculative_tokens`` (``verifier``: no layout here reads it)."""
    check_format(format)
    dtype = dtype or model.fc.weight.dtype
    return {**layout_config(served(model.config, num_speculative_tokens)),
            "torch_dtype": str(dtype).removeprefix("torch.")}


def save_draft(model: LiLiCorrDraft, path: str | Path, format: str = "vllm", dtype: torch.dtype | None = None,
               include_embed: bool = False, verifier: str | None = None,
               num_speculative_tokens: int | None = None) -> Path:
    """Write ``config.json``, ``model.safetensors`` and ``mask_embedding.pt`` (DFlash's ``save_draft``) for the
    block served at ``num_speculative_tokens``."""
    config = draft_config_json(model, format, dtype, verifier, num_speculative_tokens)
    return dflash_layouts.save_draft(model, path, dtype=dtype, config=config,
                                     tensors=served_tensors(model, config["block_size"]))


# (dir, embed_tokens=None, device="cpu", dtype=float32, lm_head=None) -> the draft, as DFlash's load_draft reads it
load_draft = functools.partial(dflash_layouts.load_draft, config_of=config_from_json, model_class=LiLiCorrDraft)


def tensor_problems(config: dict[str, Any], shapes: dict[str, list[int]], hidden_size: int) -> list[Misfit]:
    """What the checkpoint's tensors (``shapes``: name -> shape) lack or shape wrong for a target of
    ``hidden_size``: DFlash's fc (``dflash_layouts.tensor_problems``), and a head of the config's shape."""
    out = dflash_layouts.tensor_problems(config, shapes, hidden_size)
    cfg = config_from_json(config)
    fix = "re-export the draft with 03_train (its head's tensors are written with its config)"
    if problem := head_problem(cfg):
        return [*out, (problem, fix)]
    with torch.device("meta"):  # shapes only, nothing allocated
        want = {f"{HEAD}{k}": list(v.shape) for k, v in LatticeHead(cfg).state_dict().items()}
    bad = sorted(k for k, s in want.items() if shapes.get(k) != s)
    if bad:
        out.append((f"the LiLiCorr head's tensors {bad[:4]}{' ...' if len(bad) > 4 else ''} are missing or not of "
                    f"the shape config.json's dflash_config.lilicorr_* and block_size {cfg.block_size} give", fix))
    return out
