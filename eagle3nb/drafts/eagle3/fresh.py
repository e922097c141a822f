"""A fresh EAGLE-3 draft for 03 (``DraftMethod.fresh``): shaped like one of the target's layers, EAGLE-3.1 unless
03's params turn it off, starting from the target's embedding and its lm_head rows for the draft vocabulary."""

from __future__ import annotations

from typing import Any

import torch

from eagle3nb.drafts.base import DraftMismatchError
from eagle3nb.drafts.eagle3.model import MLA_KEYS, Eagle3Config, Eagle3Draft
from eagle3nb.families import is_mla


def fresh_shape(P, tc: dict[str, Any], hidden_size: int, where: str = "the target") -> dict[str, int]:
    """The attention and MLP sizes of a fresh draft: the target's own, explicit 03_train params winning.

    A Llama-like target (Llama, Qwen3, GLM, gpt-oss) lends its heads, KV heads and head width. An MLA target
    (DeepseekV3 / Kimi-K2: ``families.is_mla``) has no Llama head layout to copy: its ``head_dim`` is the rotary
    part only (qk_rope_head_dim, 64) and its KV lives in a latent. The published drafters of such targets
    (AQ-MedAI's Kimi-K2 EAGLE-3, docs/DESIGN-FACTS.md) are Llama layers with every head a KV head, of the
    target's value width (v_head_dim, else qk_nope_head_dim: 128 on Kimi-K2) and its dense MLP width, so a
    fresh draft is shaped the same way and a published checkpoint fits where a fresh draft would."""
    heads = P.num_attention_heads or tc.get("num_attention_heads")
    inter = P.intermediate_size or tc.get("intermediate_size")
    if not heads or not inter:
        raise DraftMismatchError(
            f"cannot read the target's config.json at {where} to shape a fresh draft; set num_attention_heads, "
            "num_key_value_heads, head_dim and intermediate_size in the 03_train parameters")
    if is_mla(tc):
        kv = P.num_key_value_heads or heads
        head_dim = P.head_dim or tc.get("v_head_dim") or tc.get("qk_nope_head_dim") or hidden_size // heads
    else:
        kv = P.num_key_value_heads or tc.get("num_key_value_heads") or heads
        head_dim = P.head_dim or tc.get("head_dim") or hidden_size // heads
    return {"num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
            "intermediate_size": inter}


def mask_token_id(tc: dict[str, Any], vocab_size: int) -> int:
    """The token a parallel-drafting draft's mask positions read: the target's pad token (a row no text contains),
    else its last id (a reserved or padding row in the big vocabularies). The embedding is frozen and the learned
    ``mask_hidden`` carries the "mask" signal, so any fixed row works; these are rows ordinary text never uses."""
    pad = tc.get("pad_token_id")
    return pad if isinstance(pad, int) and 0 <= pad < vocab_size else vocab_size - 1


def fresh_config(P, meta: dict[str, Any], tc: dict[str, Any], draft_vocab_size: int) -> Eagle3Config:
    """A draft (``num_layers`` decoder layers) shaped like one of the target's layers (:func:`fresh_shape`, ``tc``
    the target's config.json), EAGLE-3.1 (``fc_norm``, ``norm_output``) unless the params set them false."""
    H = meta["hidden_size"]
    shape = fresh_shape(P, tc, H, where=repr(meta.get("model_path")))
    llama = {**tc, "hidden_size": H, **shape, "vocab_size": meta["vocab_size"],
             "draft_vocab_size": draft_vocab_size}
    mla = None
    if P.draft_attention == "mla":
        if not is_mla(tc):
            raise DraftMismatchError(f"draft_attention: mla copies the target's latent attention, but the target at "
                                     f"{meta.get('model_path')!r} has no kv_lora_rank (it is not an MLA model); "
                                     "set draft_attention: llama")
        # vLLM 0.32's deepseek_eagle3 loader always stacks kv_a_proj_with_mqa into fused_qkv_a_proj, so it loads
        # only drafts with a low-rank query: a target without one (the toy) lends its hidden size as the rank.
        mla = {**{k: tc.get(k) for k in MLA_KEYS}, "q_lora_rank": tc.get("q_lora_rank") or H}
    return Eagle3Config.from_llama_dict(llama, target_hidden_size=H, aux_layer_ids=list(meta["layer_ids"]), mla=mla,
                                        fc_norm=P.fc_norm is not False, norm_output=P.norm_output is not False,
                                        num_layers=P.num_layers,
                                        mask_token_id=mask_token_id(tc, meta["vocab_size"])
                                        if getattr(P, "parallel_drafting", False) else None)


def fresh_draft(P, data, tc: dict[str, Any]) -> Eagle3Draft:
    """03's new draft on the data 02 stored (its ``meta``, draft vocabulary ``d2t``/``t2d``, the target's
    ``embed_tokens()`` and ``lm_head()`` [V, H]): step 0 already speaks the target's language."""
    d2t, t2d = data.d2t, data.t2d
    torch.manual_seed(P.seed)
    model = Eagle3Draft(fresh_config(P, data.meta, tc, d2t.shape[0]))
    model.set_vocab(d2t, t2d)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(data.embed_tokens())
        model.lm_head.weight.copy_(data.lm_head()[d2t + torch.arange(d2t.shape[0])])
    return model
