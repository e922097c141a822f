"""A block drafter on disk, in the two layouts its engines read. Both hold the same tensors under the same
names (vLLM's ``DFlashQwen3Model`` / ``Qwen3DSparkModel`` and speculators' ``DFlashDraftModel`` /
``DSparkDraftModel`` agree): ``layers.{i}.self_attn.{q,k,v,o}_proj``, ``...{q,k}_norm``, ``layers.{i}.mlp.{gate,up,
down}_proj``, ``layers.{i}.{input,post_attention}_layernorm``, ``fc``, ``hidden_norm``, ``norm``, and for DSpark
``markov_head.markov_w{1,2}`` and ``confidence_head.proj`` (weight and bias). Neither file carries the target's
``embed_tokens`` or ``lm_head``: vLLM shares the target's when they are absent, speculators reloads them from the
verifier, and ``load_draft`` takes them from the caller.

The trained mask input (``DFlashDraft.mask_embedding``) is ``mask_embedding.pt`` beside them in both layouts, in
vLLM 0.32's format (``qwen3_dflash.py``'s ``_read_mask_embedding``): ``{"mask_token_id", "embedding" [H]}``, the id
checked against ``dflash_config.mask_token_id``; vLLM substitutes it for the target's row wherever a slot holds that
id, as ``DFlashDraft.embed`` does. vLLM's DSpark model ignores the file ("DSpark masks via the vocab row"), so a
DSpark export also carries ``embed_tokens.weight``: the target's table with that one row replaced, which vLLM keeps
as the draft's own (V x H more on disk). speculators 0.9.0 reads neither: its model reloads the target's table
from the verifier, so it runs (and fine-tunes) the draft on the target's mask row.

The configs differ:

- ``vllm`` (vLLM 0.32's native layout): a Qwen3 config of the draft (``num_hidden_layers`` its layers) with
  ``architectures`` ``DFlashDraftModel`` / ``Qwen3DSparkModel``, ``block_size``, and ``dflash_config {mask_token_id,
  target_layer_ids, block_size, causal}``. ``target_layer_ids`` are DFlash's output-of-layer ids: ours minus one
  (vLLM adds the one back, ``eagle3_utils.get_eagle3_aux_layers_from_config``). DSpark adds ``markov_rank``,
  ``enable_confidence_head``, ``confidence_head_with_markov`` and ``sample_from_anchor`` (true, its default).
- ``speculators`` (0.9.0): ``speculators_model_type`` dflash / dspark, a ``transformer_layer_config``,
  ``aux_hidden_state_layer_ids`` in *our* convention (vLLM's speculators parser subtracts the one), and
  ``sliding_window_non_causal: true``: vLLM's parser sets ``dflash_config.causal`` to its negation for every layer,
  so the speculators default (false) would be served causal although speculators trains full-attention layers
  bidirectionally.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from eagle3nb.drafts.base import WEIGHTS_FILE, DraftMismatchError, Misfit, read_tensors
from eagle3nb.drafts.dflash.mask import MASK_EMBEDDING_FILE, read_mask_file
from eagle3nb.drafts.dflash.model import DFlashConfig, DFlashDraft
from eagle3nb.layers import from_sglang
from eagle3nb.progress import write_json_atomic

LAYOUTS = ("vllm", "speculators")
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dspark": "Qwen3DSparkModel", "dflash2": "DFlash2DraftModel"}
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # vLLM's dflash_config
TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight")  # the target's: never written as such
MASK_FILE = MASK_EMBEDDING_FILE  # vLLM's name for a separately trained mask embedding
NOT_IN_WEIGHTS = (*TARGET_TENSORS, "mask_embedding")  # mask_embedding goes to MASK_FILE


def qwen3_dict(cfg: DFlashConfig) -> dict[str, Any]:
    """The draft's layers as a Qwen3 config (what vLLM's DFlash model and speculators' layers are built from)."""
    return {
        "model_type": "qwen3", "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": cfg.num_layers, "vocab_size": cfg.vocab_size,
        "hidden_act": "silu", "attention_bias": False, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": False,
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
    }


def claimer(method: str):
    """``claims(config_dict)`` for ``method`` (dflash / dspark): a speculators config of that type, or a vLLM one
    whose architectures name its model."""
    def claims(d: dict[str, Any]) -> bool:
        if d.get("speculators_model_type") is not None:
            return d["speculators_model_type"] == method
        return ARCHITECTURES[method] in (d.get("architectures") or [])

    return claims


def layout_config(cfg: DFlashConfig, layout: str = "vllm", verifier: str | None = None) -> dict[str, Any]:
    """The config.json of ``layout`` (one of :data:`LAYOUTS`)."""
    dspark = cfg.markov_rank > 0
    heads = {"markov_rank": cfg.markov_rank, "enable_confidence_head": True,
             "confidence_head_with_markov": True} if dspark else {}
    dflash2 = {k: getattr(cfg, k) for k in DFLASH2_KEYS} if cfg.method == "dflash2" else {}
    if layout == "vllm":
        return {"architectures": [ARCHITECTURES[cfg.method]], **qwen3_dict(cfg), "draft_vocab_size": cfg.vocab_size,
                "target_hidden_size": cfg.target_hidden_size, "block_size": cfg.block_size, **heads,
                **({"sample_from_anchor": True} if dspark else {}),
                "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": cfg.target_layer_ids,
                                  "block_size": cfg.block_size, "causal": cfg.causal, **dflash2}}
    if layout == "speculators":
        return {"architectures": [{"dspark": "DSparkSpeculator", "dflash2": "DFlash2DraftModel"}.get(
                    cfg.method, "DFlashSpeculator")], **dflash2,
                "speculators_model_type": cfg.method, "speculators_version": "0.9.0",
                "transformer_layer_config": qwen3_dict(cfg), "draft_vocab_size": cfg.vocab_size,
                "block_size": cfg.block_size, "target_hidden_size": cfg.target_hidden_size,
                "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "mask_token_id": cfg.mask_token_id,
                "sliding_window_non_causal": not cfg.causal, "sample_from_anchor": cfg.sample_from_anchor,
                **heads, **({"markov_head_type": "vanilla"} if dspark else {}),
                "speculators_config": {
                    "algorithm": cfg.method, "default_proposal_method": "greedy",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.drafts_per_block}],
                    "verifier": {"name_or_path": verifier, "architectures": []}}}
    raise ValueError(f"layout {layout!r}: use one of {LAYOUTS}")


def config_from_json(d: dict[str, Any], path: Path | str = "config.json") -> DFlashConfig:
    """The draft's shape from either layout's config.json."""
    if "speculators_model_type" in d:
        q, ids, causal = d["transformer_layer_config"], list(d["aux_hidden_state_layer_ids"]), \
            not d.get("sliding_window_non_causal", True)
        mask, block, extra = d["mask_token_id"], d["block_size"], d
    elif "dflash_config" in d:
        q, dc = d, d["dflash_config"]
        ids, causal = from_sglang(dc["target_layer_ids"]), bool(dc.get("causal", False))
        mask, block, extra = dc["mask_token_id"], d.get("block_size", dc.get("block_size")), dc
    else:
        raise DraftMismatchError(f"{path}: neither a vLLM DFlash/DSpark config (dflash_config) nor a speculators one")
    theta = (q.get("rope_parameters") or {}).get("rope_theta", q.get("rope_theta", 1_000_000.0))
    return DFlashConfig(
        hidden_size=q["hidden_size"], intermediate_size=q["intermediate_size"],
        num_attention_heads=q["num_attention_heads"], num_key_value_heads=q["num_key_value_heads"],
        head_dim=q["head_dim"], num_layers=q["num_hidden_layers"], vocab_size=q["vocab_size"],
        target_hidden_size=d.get("target_hidden_size") or q["hidden_size"], aux_layer_ids=ids,
        mask_token_id=int(mask), block_size=int(block), causal=causal, rope_theta=float(theta),
        rms_norm_eps=q["rms_norm_eps"], max_position_embeddings=q["max_position_embeddings"],
        markov_rank=int(d.get("markov_rank", 0)), **{k: int(extra[k]) for k in DFLASH2_KEYS if k in extra})


def draft_config_json(model: DFlashDraft, format: str = "vllm", dtype: torch.dtype | None = None,
                      verifier: str | None = None, num_speculative_tokens: int | None = None) -> dict[str, Any]:
    """The config.json of ``format`` (one of :data:`LAYOUTS`) with the weights' dtype, for the block it is served
    with: ``num_speculative_tokens`` under the trained block's drafts (a DFlash trained at 16 served at 8, as the
    papers do) writes the served block, k + 1 slots, which vLLM runs whatever the config says and speculators'
    proposal, our decoder and 04 read from it."""
    dtype = dtype or model.fc.weight.dtype
    cfg = model.config
    if num_speculative_tokens is not None and num_speculative_tokens < cfg.drafts_per_block:
        cfg = dataclasses.replace(cfg, block_size=num_speculative_tokens + 1)
    return {**layout_config(cfg, format, verifier), "torch_dtype": str(dtype).removeprefix("torch.")}


def save_draft(model: DFlashDraft, path: str | Path, format: str = "vllm", dtype: torch.dtype | None = None,
               include_embed: bool = False, verifier: str | None = None,
               num_speculative_tokens: int | None = None, *, config: dict[str, Any] | None = None,
               tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (+ ``mask_embedding.pt``) in ``format``. The target's
    embedding and head are not written (``include_embed`` changes nothing; DSpark's table with the trained mask row
    aside): vLLM shares the target's, ``load_draft`` takes them, and speculators reloads them from ``verifier`` (the
    target's path or hub id): without it, it leaves both NaN. ``config`` / ``tensors``: a draft on this backbone
    that writes its own (LiLiCorr's head, shaped for the served block), else the model's."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = config or draft_config_json(model, format, dtype, verifier, num_speculative_tokens)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return (t.to(dtype) if dtype is not None else t).detach().cpu().contiguous()

    tensors = {name: cast(t) for name, t in (model.state_dict() if tensors is None else tensors).items()
               if name not in NOT_IN_WEIGHTS}
    mask = path / MASK_FILE
    if model.mask_embedding is not None:
        if model.config.markov_rank > 0:  # vLLM's DSpark reads only its own table's row
            rows = model.embed_tokens.weight.detach().clone()  # shape: [V, H]
            rows[model.config.mask_token_id] = model.mask_embedding.detach()
            tensors["embed_tokens.weight"] = cast(rows)
        tmp = path / f".{MASK_FILE}.tmp"
        torch.save({"mask_token_id": model.config.mask_token_id, "embedding": cast(model.mask_embedding)}, tmp)
        tmp.replace(mask)
    else:
        mask.unlink(missing_ok=True)  # an earlier export's, which no longer belongs to these weights
    tmp = path / f".{WEIGHTS_FILE}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / WEIGHTS_FILE)
    write_json_atomic(path / "config.json", config)
    return path


def read_mask_embedding(path: Path, cfg: DFlashConfig) -> torch.Tensor | None:
    """The trained mask input [H] in ``path``'s ``mask_embedding.pt`` (a tensor, or vLLM's dict whose id must be
    the config's: ``mask.read_mask_file``, which refuses in one line a file vLLM would not load), None without the
    file."""
    file = path / MASK_FILE
    return read_mask_file(file, cfg.mask_token_id, cfg.hidden_size) if file.is_file() else None


def load_draft(path: str | Path, embed_tokens: torch.Tensor | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = torch.float32, lm_head: torch.Tensor | None = None, *,
               config_of=config_from_json, model_class: type[DFlashDraft] = DFlashDraft) -> DFlashDraft:
    """A drafter from either layout, on the target's ``embed_tokens`` and ``lm_head`` [V, H] (the files hold
    neither, but a DSpark export's table, written for vLLM, stands in for ``embed_tokens``: it differs only in the
    mask row, which the draft reads from ``mask_embedding.pt``); every tensor the config implies must be in the
    file, with its shape. ``config_of`` / ``model_class``: a draft on this backbone with its own config and model
    (LiLiCorr's)."""
    path = Path(path)
    cfg = config_of(json.loads((path / "config.json").read_text()), path / "config.json")
    mask = read_mask_embedding(path, cfg)
    model = model_class(cfg, mask_embedding=mask is not None)
    tensors = read_tensors(path)
    if mask is not None and cfg.markov_rank > 0 and "embed_tokens.weight" in tensors:
        table = tensors.pop("embed_tokens.weight")
        embed_tokens = table if embed_tokens is None else embed_tokens
    if embed_tokens is None or lm_head is None:
        raise DraftMismatchError(f"{path} is a block drafter, which reads the target's embedding and LM head: pass "
                                 "both (load_draft(dir, embed_tokens=data.embed_tokens(), lm_head=data.lm_head()))")
    want = {k: v.shape for k, v in model.state_dict().items() if k not in NOT_IN_WEIGHTS}
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    bad = [f"{k} {tuple(tensors[k].shape)} != {tuple(s)}" for k, s in want.items()
           if k in tensors and tensors[k].shape != s]
    if missing or extra or bad:
        raise DraftMismatchError(f"{path}: tensors do not fit config.json: missing {missing}, unexpected {extra}, "
                                 f"shapes {bad}")
    own = {"mask_embedding": mask} if mask is not None else {}
    model.load_state_dict({**tensors, **own, "embed_tokens.weight": embed_tokens, "lm_head.weight": lm_head})
    if dtype is not None:
        model.to(dtype)
    return model.to(device).eval()


def tensor_problems(config: dict[str, Any], shapes: dict[str, list[int]], hidden_size: int) -> list[Misfit]:
    """What a block drafter's checkpoint tensors (``shapes``: name -> shape) lack or shape wrong for a target of
    ``hidden_size``: its fc fuses one state per aux layer its config names; it holds no head nor vocabulary map
    (it writes through the target's own head, over the whole vocabulary)."""
    fix = "train the draft for this target (03_train) or pick a checkpoint made for it"
    cfg = config_from_json(config)
    fc, n = shapes.get("fc.weight"), len(cfg.aux_layer_ids)
    if fc is None or fc[1] != n * hidden_size:
        return [(f"fc.weight {fc} does not take {n} x {hidden_size} = {n * hidden_size} inputs (one state "
                         f"per aux layer {cfg.aux_layer_ids})", fix)]
    return []
