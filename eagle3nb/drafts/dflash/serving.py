"""What vLLM would read wrong from a DFlash or DSpark checkpoint served beside a target
(``DraftMethod.serving_problems``), from vLLM 0.32's own source:

- **k.** DSpark drafts its block with the anchor as the first draft (``sample_from_anchor``): vLLM runs
  ``num_speculative_tokens`` query slots (``v1/worker/gpu/spec_decode/dspark/speculator.py``), so any k but the
  block size is another block than the one trained. DFlash runs the anchor and k masks: past ``block_size - 1``
  the masks were never trained; eagle3nb's own decoder (``Serving.whole_block``: ``eagle3nb serve``, 04) drafts the
  checkpoint's whole block, so it takes k = ``block_size - 1`` only (03 exports a draft for a shorter k).
- **The block layout.** DSpark's vLLM config reads ``sample_from_anchor`` at the top level, default true
  (``config/vllm.py``); vLLM's speculators parser reads ``sample_from_anchor`` default false, and for DSpark
  switches to the fill-in block (``dspark_bonus_anchor``, ``transformers_utils/configs/speculators/algos.py``). A
  DSpark draft without it in the speculators layout is served as a fill-in block: under 1% accepted, no error.
  DFlash reads ``dflash_config.sample_from_anchor`` (refused when true). The architecture (or
  ``speculators_model_type``) must be the one the heads make: ``markov_rank > 0`` is DSpark.
- **Layers and vocabulary.** ``dflash_config.target_layer_ids`` are output-of-layer ids (ours minus one),
  speculators' ``aux_hidden_state_layer_ids`` ours; ``target_hidden_size`` and ``vocab_size`` the target's.
- **The mask input** (``mask.mask_problems``): a ``mask_embedding.pt`` vLLM would not load or would load
  as a dead vector (zero, tiny or not finite), or none and a dead row of ``mask_token_id``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3nb.drafts.base import Misfit, Serving, aux_ids_misfits, read_tensor, vocab_misfits
from eagle3nb.drafts.dflash.layouts import ARCHITECTURES, claimer, config_from_json
from eagle3nb.drafts.dflash.mask import mask_problems
from eagle3nb.drafts.dflash.model import DFlashConfig
from eagle3nb.drafts.dflash.rules import RULES


def _anchor_as_read(config: dict[str, Any], method: str) -> tuple[str, bool, bool]:
    """(the field, its value as vLLM reads it when served as ``method``, whether the file sets it)."""
    if config.get("speculators_model_type") is not None:
        return "sample_from_anchor", bool(config.get("sample_from_anchor", False)), "sample_from_anchor" in config
    if method == "dspark":
        return "sample_from_anchor", bool(config.get("sample_from_anchor", True)), "sample_from_anchor" in config
    dc = config.get("dflash_config") or {}
    return "dflash_config.sample_from_anchor", bool(dc.get("sample_from_anchor", False)), "sample_from_anchor" in dc


def _layout_problems(path: Path, config: dict[str, Any], cfg: DFlashConfig, serving: Serving) -> list[Misfit]:
    """The declared kind against the heads, and the block layout vLLM would run against the trained one."""
    declared = next(m for m in ARCHITECTURES if claimer(m)(config))  # the registry matched one of ours
    if cfg.method != declared:  # the heads say another method than the declaration
        speculators = config.get("speculators_model_type") is not None
        field, right = ("speculators_model_type", cfg.method) if speculators else \
            ("architectures", [ARCHITECTURES[cfg.method]])
        served = RULES[cfg.method].served_as or cfg.method
        also = "" if served == serving.method else f" and serve it with {serving.method_field} {served}"
        return [(f"{path}/config.json declares a {declared} draft but its heads (markov_rank {cfg.markov_rank}, "
                 f"selector_rank {cfg.selector_rank}) make it {cfg.method}", f"write {field} {right}{also}")]
    field, read, written = _anchor_as_read(config, serving.method)
    if read == cfg.sample_from_anchor:
        return []
    trained = "the anchor as the first draft" if cfg.sample_from_anchor else "the anchor as a bonus token"
    served = "the anchor as the first draft" if read else "a fill-in block (the anchor a bonus token)"
    return [(f"{field} is {str(read).lower()}{'' if written else ' (unset: vLLM defaults it)'}: vLLM would run "
             f"{served}, but this {serving.method} draft was trained with {trained}, so almost nothing is accepted",
             f"set {field}: {str(cfg.sample_from_anchor).lower()} in {path}/config.json")]


def _k_problems(cfg: DFlashConfig, serving: Serving) -> list[Misfit]:
    k, n = serving.num_speculative_tokens, cfg.drafts_per_block
    shorter = not cfg.sample_from_anchor  # DFlash: fewer masks than trained still draft its block, on vLLM
    if k == n or (k < n and shorter and not serving.whole_block):
        return []
    fix = f"set {serving.k_field} to {n}"
    if k > n:
        why = "the masks past its block were never trained" if shorter else \
            "vLLM runs k query slots and this draft was trained on its whole block"
    elif shorter:  # an engine that drafts the checkpoint's whole block
        why = "eagle3nb's own decoder drafts the checkpoint's whole block"
        fix += f", or export the draft for k = {k} (03_train num_speculative_tokens: {k}, a served block of {k + 1})"
    else:
        why = "vLLM runs k query slots and this draft was trained on its whole block"
    return [(f"{serving.k_field} {k}, but this {serving.method} draft's block of {cfg.block_size} drafts {n} ({why})",
             fix)]


def serving_problems(path: Path, config: dict[str, Any], serving: Serving) -> list[Misfit]:
    """The checkpoint in ``path`` (``config`` its config.json) served as ``serving`` says."""
    cfg = config_from_json(config, path / "config.json")
    out = _layout_problems(path, config, cfg, serving)
    if out:
        return out
    out += _k_problems(cfg, serving)
    if config.get("speculators_model_type") is not None:
        ids, field, offset = config.get("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids", 0
    else:
        ids, field, offset = config["dflash_config"].get("target_layer_ids"), "dflash_config.target_layer_ids", 1
    out += aux_ids_misfits(ids, field, offset, serving.target)
    out += vocab_misfits(cfg.target_hidden_size, cfg.vocab_size, config.get("draft_vocab_size"),
                         read_tensor(path, "d2t"), serving.target)
    return out + mask_problems(path, cfg.mask_token_id, cfg.hidden_size, serving.target.embed_row_norms())
