"""What vLLM would read wrong from a LiLiCorr checkpoint served beside a target (``DraftMethod.serving_problems``),
from vLLM 0.32's own source (``model_executor/models/lilicorr.py``, ``v1/worker/gpu/spec_decode/lilicorr/``):

- **k against the block.** vLLM's ``LiLiCorr`` requires ``1 <= num_speculative_tokens < block_size`` (the head's slot
  embeddings are the block's); under it, its head scores the first k slots as trained. eagle3nb's own decoder
  (``Serving.whole_block``) drafts the checkpoint's whole block only (03 exports one for a shorter k).
- **The head.** ``lilicorr_candidate_topk`` a power of two up to 16 (vLLM raises otherwise) and at most the
  vocabulary; the head's width divisible by its heads.
- **The vocabulary.** LiLiCorr's candidates are target ids over the whole vocabulary: vLLM refuses a draft with a
  ``d2t`` map ("LiLiCorr candidates require the full target vocabulary"); ``vocab_size`` and
  ``target_hidden_size`` the target's, ``dflash_config.target_layer_ids`` layers it has (DFlash's rule, ours - 1).
- **The architecture**: ``LiLiCorrDraftModel``, which the registry's claim already held, else vLLM serves the
  backbone as a plain DFlash.
- **The mask input**, DFlash's rule (``dflash.mask.mask_problems``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3nb.drafts.base import Misfit, Serving, aux_ids_misfits, read_tensor, vocab_misfits
from eagle3nb.drafts.dflash.mask import mask_problems
from eagle3nb.drafts.lilicorr.layouts import config_from_json
from eagle3nb.drafts.lilicorr.model import head_problem


def serving_problems(path: Path, config: dict[str, Any], serving: Serving) -> list[Misfit]:
    """The checkpoint in ``path`` (``config`` its config.json) served as ``serving`` says."""
    cfg = config_from_json(config, path / "config.json")
    out: list[Misfit] = []
    k, n, field = serving.num_speculative_tokens, cfg.drafts_per_block, serving.k_field
    if k > n or (k < n and serving.whole_block):
        why = ("vLLM's LiLiCorr requires num_speculative_tokens < block_size: its head has no slot past the block"
               if k > n else "eagle3nb's own decoder drafts the checkpoint's whole block")
        fix = f"set {field} to {n}" + ("" if k > n else f", or export the draft for k = {k} (03_train "
                                                         f"num_speculative_tokens: {k})")
        out.append((f"{field} {k}, but this LiLiCorr draft's block of {cfg.block_size} drafts {n} ({why})", fix))
    if problem := head_problem(cfg):
        out.append((problem, "re-export the draft with a head vLLM serves"))
    if read_tensor(path, "d2t") is not None:
        out.append((f"{path} holds a d2t map, but LiLiCorr's candidates are target ids over the whole vocabulary "
                    "and vLLM refuses a reduced one",
                    "train on 02's whole vocabulary (draft_vocab_size = the target's vocab_size) and re-export"))
    out += aux_ids_misfits(config["dflash_config"].get("target_layer_ids"), "dflash_config.target_layer_ids", 1,
                           serving.target)
    out += vocab_misfits(cfg.target_hidden_size, cfg.vocab_size, config.get("draft_vocab_size"), None, serving.target)
    return out + mask_problems(path, cfg.mask_token_id, cfg.hidden_size, serving.target.embed_row_norms())
