"""The DFlash block drafter (arXiv 2602.06036) and DSpark on its backbone (arXiv 2607.05147), as vLLM 0.32's
``qwen3_dflash.py`` / ``qwen3_dspark.py`` and speculators 0.9.0 run them. No I/O here: ``layouts`` reads and
writes checkpoints.

Read top to bottom like the paper:

1. ``fc`` fuses the target's states at ``aux_layer_ids`` (concatenated low..high) and ``hidden_norm`` normalises
   the result: the *context* features, one per target position [B, T, H].
2. A block is the anchor token (the last token the target verified) then ``block_size - 1`` copies of ``mask_token_id``,
   at the rotary positions after the context. A mask slot enters as ``mask_embedding``, a trained vector (vLLM's
   ``mask_embedding.pt``) that stands in for the target's row of ``mask_token_id``: that row is often dead (the toys'
   pad row is all zeros), and a zero input leaves every mask slot identical in layer 1. It runs through ``num_layers``
   Qwen3 decoder layers (per-head ``q_norm``/``k_norm``, SwiGLU). In every layer the block's queries attend to the
   context's keys/values (that layer's own ``k_proj``/``v_proj``/``k_norm`` applied to the context features: no
   ``input_layernorm`` on them) ahead of the block's own keys; the block attends within itself non-causally
   (``causal=False``, the default) and sees only the context *before* its anchor.
3. ``norm`` then the target's ``lm_head`` (frozen, like the target's ``embed_tokens``) give the logits.
   DFlash: block slot j >= 1 predicts the token at the anchor's position + j (the anchor slot predicts nothing),
   so a block drafts ``block_size - 1`` tokens. DSpark (``markov_rank > 0``) samples from the anchor, as vLLM's
   DSpark speculator does by default: slot j predicts the token at anchor + j + 1, ``block_size`` drafts.
4. DSpark adds ``markov_w1`` [V, r] and ``markov_w2`` [r, V]: the logits of slot j get ``markov_w2(markov_w1[prev])``,
   prev the token drafted at slot j-1 (the anchor for slot 0), so the block is sampled left to right; and a
   confidence head ``proj([h; markov_w1[prev]])`` estimating each slot's acceptance.

The ``# shape:`` comments use B batch, T context positions, N blocks per row, S block size, H the draft's hidden
size, H_t the target's, nh / nkv query / key-value heads of size d, V the target's vocabulary, r the Markov rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle3nb.drafts.base import DraftMismatchError
from eagle3nb.drafts.dflash.dflash2 import CandidateSelector, GroupedConv, shape_problem
from eagle3nb.drafts.dflash.mask import MaskInputError, dead_mask_problem, live_mean, row_norms
from eagle3nb.drafts.nn import MLP, RMSNorm, rotate_half
from eagle3nb.layers import spread_layer_ids, to_sglang


@dataclass
class DFlashConfig:
    """The draft's shape. ``aux_layer_ids`` are in our one convention (HF ``hidden_states`` index == vLLM's
    eagle aux ids, ``eagle3nb.layers``); the checkpoint's ``dflash_config.target_layer_ids`` are those minus one
    (:meth:`target_layer_ids`)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_layers: int
    vocab_size: int  # the target's: the draft reads its embedding and writes through its lm_head
    target_hidden_size: int
    aux_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 8
    causal: bool = False  # vLLM's dflash_config.causal: within-block causal attention (default: bidirectional)
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    markov_rank: int = 0  # > 0: DSpark (the Markov head of this rank, and the confidence head)
    # > 0: DFlash2 (``dflash2``): each layer's grouped dynamic convolutions of this many taps over channel groups of
    # ``conv_group_size``, and the candidate selector of rank ``selector_rank`` over the top ``selector_top_k``
    conv_kernel_size: int = 0
    conv_group_size: int = 16
    selector_rank: int = 0
    selector_top_k: int = 16

    @property
    def method(self) -> str:
        """The method in the registry: ``dspark`` with a Markov head, ``dflash2`` with the convolutions and the
        selector (vLLM serves it as ``dflash``: its architecture tells them apart), else ``dflash``."""
        return "dspark" if self.markov_rank > 0 else "dflash2" if self.selector_rank > 0 else "dflash"

    @property
    def draft_vocab_size(self) -> int:
        """A block drafter speaks the target's whole vocabulary (the target's own ``lm_head``)."""
        return self.vocab_size

    @property
    def sample_from_anchor(self) -> bool:
        """Whether the anchor slot predicts (DSpark, vLLM's default for it) or only the mask slots do (DFlash)."""
        return self.markov_rank > 0

    @property
    def drafts_per_block(self) -> int:
        """Tokens one block proposes: vLLM's ``num_speculative_tokens``."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def target_layer_ids(self) -> list[int]:
        """DFlash's own ids (``dflash_config.target_layer_ids``): the layer whose *output* is read, 0-based; vLLM
        adds one to each (eagle3_utils.get_eagle3_aux_layers_from_config), which gives back ``aux_layer_ids``."""
        return to_sglang(self.aux_layer_ids)


def rope(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Default (neox-style) rotary tables for integer ``positions`` [...]: cos, sin [..., d]."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    ang = positions.float()[..., None] * inv  # shape: [..., d/2]
    ang = torch.cat([ang, ang], dim=-1)  # shape: [..., d]
    return ang.cos(), ang.sin()


class BlockAttention(nn.Module):
    """Qwen3 attention whose keys/values are the context's (projected from its features) then the block's."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        nh, nkv, d, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.nh, self.nkv, self.d = nh, nkv, d
        self.q_proj = nn.Linear(H, nh * d, bias=False)
        self.k_proj = nn.Linear(H, nkv * d, bias=False)
        self.v_proj = nn.Linear(H, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, H, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of ``x`` [B, L, H] at the rotary tables [B, L, d]."""
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, L, self.nkv, self.d)).transpose(1, 2)  # shape: [B, nkv, L, d]
        v = self.v_proj(x).view(B, L, self.nkv, self.d).transpose(1, 2)  # shape: [B, nkv, L, d]
        return k * cos[:, None] + rotate_half(k) * sin[:, None], v

    def forward(self, x, ctx, rot_q, rot_ctx, mask):
        """x [B, Q, H] the block slots (normed), ctx [B, T, H] the context features, rot_* (cos, sin) tables,
        mask [B, Q, T+Q] bool (True: may attend)."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.nh, self.d)).transpose(1, 2)  # shape: [B, nh, Q, d]
        q = q * rot_q[0][:, None] + rotate_half(q) * rot_q[1][:, None]
        k_ctx, v_ctx = self.kv(ctx, *rot_ctx)  # shape: [B, nkv, T, d] each
        k_blk, v_blk = self.kv(x, *rot_q)  # shape: [B, nkv, Q, d] each
        k = torch.cat([k_ctx, k_blk], 2).repeat_interleave(self.nh // self.nkv, 1)  # shape: [B, nh, T+Q, d]
        v = torch.cat([v_ctx, v_blk], 2).repeat_interleave(self.nh // self.nkv, 1)  # shape: [B, nh, T+Q, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])  # shape: [B, nh, Q, d]
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.nh * self.d))  # shape: [B, Q, H]


class BlockLayer(nn.Module):
    """One Qwen3 decoder layer over the block: pre-norm attention (context ahead), pre-norm SwiGLU; DFlash2 wraps
    each sublayer in its grouped dynamic convolutions (``dflash2.GroupedConv``)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = BlockAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        if cfg.conv_kernel_size > 0:
            conv = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size, cfg.block_size)
            self.attention_conv, self.mlp_conv = GroupedConv(*conv), GroupedConv(*conv)

    def forward(self, h, ctx, rot_q, rot_ctx, mask):
        if not hasattr(self, "attention_conv"):
            h = h + self.self_attn(self.input_layernorm(h), ctx, rot_q, rot_ctx, mask)  # shape: [B, Q, H]
            return h + self.mlp(self.post_attention_layernorm(h))  # shape: [B, Q, H]
        x, delta = self.attention_conv.prepare(self.input_layernorm(h))  # shape: [B, Q, H], [B, Q, taps, G]
        h = h + self.attention_conv.finish(self.self_attn(x, ctx, rot_q, rot_ctx, mask), delta)
        x, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), delta)  # shape: [B, Q, H]


def block_mask(anchor_pos: torch.Tensor, ctx_valid: torch.Tensor, block_size: int, causal: bool) -> torch.Tensor:
    """[B, N*S, T+N*S] bool: slot (n, j) sees context position t < anchor_pos[n] (and valid), and the slots of
    its own block (only j' <= j when ``causal``). anchor_pos [B, N], ctx_valid [B, T] bool."""
    B, N = anchor_pos.shape
    T, S = ctx_valid.shape[1], block_size
    t = torch.arange(T, device=anchor_pos.device)
    ctx = (t[None, None] < anchor_pos[..., None]) & ctx_valid[:, None]  # shape: [B, N, T]
    ctx = ctx.repeat_interleave(S, 1)  # shape: [B, N*S, T]
    q = torch.arange(N * S, device=anchor_pos.device)
    own = (q[:, None] // S) == (q[None] // S)  # shape: [N*S, N*S]
    if causal:
        own = own & (q[None] <= q[:, None])
    return torch.cat([ctx, own[None].expand(B, -1, -1)], 2)  # shape: [B, N*S, T+N*S]


class DFlashDraft(nn.Module):
    """The block drafter: ``context(aux)`` once per sequence, then ``forward`` any number of blocks in one pass."""

    def __init__(self, cfg: DFlashConfig, mask_embedding: bool = True):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        # the mask slots' trained input (vLLM's mask_embedding.pt); None: the target's mask row, as a checkpoint
        # without the file is served
        self.mask_embedding = nn.Parameter(torch.zeros(cfg.hidden_size)) if mask_embedding else None  # shape: [H]
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight.requires_grad_(False)  # the target's head, frozen
        if cfg.markov_rank > 0:  # DSpark (vLLM's markov_head.* and confidence_head.proj)
            self.markov_head = nn.Module()
            self.markov_head.markov_w1 = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
            nn.init.normal_(self.markov_head.markov_w1.weight, std=0.01)
            self.markov_head.markov_w2 = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)
            nn.init.zeros_(self.markov_head.markov_w2.weight)  # starts as plain DFlash
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(cfg.hidden_size + cfg.markov_rank, 1)
        if cfg.selector_rank > 0:  # DFlash2 (vLLM's candidate_selector.*)
            self.candidate_selector = CandidateSelector(cfg.vocab_size, cfg.hidden_size, cfg.selector_rank,
                                                        cfg.selector_top_k)
        # the identity vocabulary map every draft offers (eagle3nb.drafts): not saved, nothing to load
        self.register_buffer("d2t", torch.zeros(cfg.vocab_size, dtype=torch.long), persistent=False)
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool), persistent=False)

    @property
    def method(self) -> str:
        """Its name in the registry (``eagle3nb.drafts``)."""
        return self.config.method

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft ids are target ids."""
        return ids

    def set_target(self, embed_tokens: torch.Tensor, lm_head: torch.Tensor) -> None:
        """Copy the target's embedding [V, H] and lm_head [V, H] (the draft trains neither), and start
        ``mask_embedding`` at the mean of the embedding's live rows."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_tokens)
            self.lm_head.weight.copy_(lm_head)
            if self.mask_embedding is not None:
                self.mask_embedding.copy_(live_mean(embed_tokens))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """[...] token ids -> [..., H] inputs: the target's rows, ``mask_embedding`` wherever the id is
        ``mask_token_id`` (as vLLM's ``embed_input_ids`` substitutes it)."""
        rows = self.embed_tokens(ids)  # shape: [..., H]
        if self.mask_embedding is None:
            return rows
        is_mask = (ids == self.config.mask_token_id)[..., None]  # shape: [..., 1]
        return torch.where(is_mask, self.mask_embedding.to(rows.dtype), rows)

    def context(self, aux: torch.Tensor) -> torch.Tensor:
        """[B, T, n*H_t] the target's aux states (low..high) -> the context features [B, T, H]."""
        if aux.shape[-1] != self.fc.in_features:
            raise DraftMismatchError(
                f"aux states have width {aux.shape[-1]} but the draft's fc expects {len(self.config.aux_layer_ids)} "
                f"x target_hidden_size = {self.fc.in_features}: the states and the draft come from different targets")
        return self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))  # shape: [B, T, H]

    def block_ids(self, anchors: torch.Tensor) -> torch.Tensor:
        """[B, N] anchor tokens -> [B, N, S]: each anchor then ``block_size - 1`` mask tokens."""
        out = torch.full((*anchors.shape, self.config.block_size), self.config.mask_token_id,
                         dtype=torch.long, device=anchors.device)  # shape: [B, N, S]
        out[..., 0] = anchors
        return out

    def forward(self, ctx: torch.Tensor, anchors: torch.Tensor, anchor_pos: torch.Tensor,
                ctx_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks in one pass. ctx [B, T, H] context features at positions 0..T-1; anchors [B, N] the anchor
        tokens at positions anchor_pos [B, N] (each block sees the context before its anchor); ctx_valid [B, T]
        (None: all). Returns the post-norm states [B, N, S, H] (``logits`` turns them into token scores)."""
        cfg, dev = self.config, ctx.device
        B, T, _ = ctx.shape
        N, S = anchors.shape[1], cfg.block_size
        valid = torch.ones(B, T, dtype=torch.bool, device=dev) if ctx_valid is None else ctx_valid.bool()
        h = self.embed(self.block_ids(anchors)).view(B, N * S, -1).to(ctx.dtype)  # shape: [B, N*S, H]
        pos_q = (anchor_pos[..., None] + torch.arange(S, device=dev)).view(B, N * S)  # shape: [B, N*S]
        rot_q = rope(pos_q, cfg.head_dim, cfg.rope_theta)  # shape: 2 x [B, N*S, d]
        rot_ctx = rope(torch.arange(T, device=dev).expand(B, T), cfg.head_dim, cfg.rope_theta)  # shape: 2 x [B, T, d]
        mask = block_mask(anchor_pos, valid, S, cfg.causal)  # shape: [B, N*S, T+N*S]
        for layer in self.layers:
            h = layer(h, ctx, rot_q, rot_ctx, mask)  # shape: [B, N*S, H]
        return self.norm(h).view(B, N, S, -1)  # shape: [B, N, S, H]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] through the target's head (DSpark's Markov bias is added by the caller)."""
        return self.lm_head(hidden)

    def slot_logits(self, ctx: torch.Tensor, ids: torch.Tensor, anchor_pos: torch.Tensor) -> torch.Tensor:
        """Teacher-forced block logits [A, S, V] for one sequence: blocks anchored at anchor_pos [A] of its
        tokens ids [T] over its context features ctx [1, T, H]; a slot that reads the token before it (DSpark's
        Markov bias, DFlash2's selector) reads the data's (what a block accepted up to that slot has drafted)."""
        T, S = ids.shape[0], self.config.block_size
        pos = anchor_pos[None]  # shape: [1, A]
        hidden = self(ctx, ids[pos], pos)[0]  # shape: [A, S, H]
        if not self.reads_prev:
            return self.logits(hidden)  # shape: [A, S, V]
        shift = 0 if self.config.sample_from_anchor else 1  # slot j drafts the token at anchor + j + 1 - shift
        at = torch.maximum(anchor_pos[:, None] + torch.arange(S, device=ids.device) - shift, anchor_pos[:, None])
        return self.step_logits(hidden, ids[at.clamp_max(T - 1)])  # shape: [A, S, V]

    @property
    def reads_prev(self) -> bool:
        """Whether a slot's logits depend on the token drafted before it (DSpark, DFlash2): drafted left to right."""
        return self.config.markov_rank > 0 or self.config.selector_rank > 0

    def step_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """A drafting slot's logits [..., V] from its state hidden [..., H] given the token before it prev [...] (the
        one drafted at the slot before, the anchor for the first): the target's head, plus DSpark's Markov bias, or
        DFlash2's candidate selection (its top-k candidates' path scores, -inf elsewhere)."""
        logits = self.logits(hidden)  # shape: [..., V]
        if self.config.markov_rank > 0:
            logits = logits + self.markov_bias(prev)
        if self.config.selector_rank > 0:
            logits = self.candidate_selector.logits(logits, hidden, prev)
        return logits

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """DSpark: [...] previous tokens -> the logit bias [..., V] (``markov_w2 @ markov_w1[prev]``)."""
        return self.markov_head.markov_w2(self.markov_head.markov_w1(prev))

    def confidence_logit(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """DSpark: the confidence head's logit [...] for states [..., H] after tokens prev [...]."""
        feats = torch.cat([hidden, self.markov_head.markov_w1(prev).to(hidden.dtype)], -1)  # shape: [..., H+r]
        return self.confidence_head.proj(feats).squeeze(-1)


def from_target(target_config: dict[str, Any], *, num_layers: int = 1, block_size: int = 8,
                mask_token_id: int | None = None, aux_layer_ids: list[int] | None = None,
                markov_rank: int = 0, **over: Any) -> DFlashConfig:
    """A draft shaped like the target's layers (``target_config``: its config.json, a ``text_config`` read
    through): hidden size, heads, MLP width, eps and rotary base (``rope_theta``, as the peers' drafts copy it) the
    target's; ``aux_layer_ids`` the peers' spread over as many target layers as draft layers; ``mask_token_id`` when
    not given the target's pad token, else its last id (a reserved or padding row in the big vocabularies: rows
    ordinary text never uses)."""
    tc = target_config.get("text_config") or target_config
    L = tc["num_hidden_layers"]
    pad = tc.get("pad_token_id")
    mask = mask_token_id if mask_token_id is not None else \
        pad if isinstance(pad, int) and 0 <= pad < tc["vocab_size"] else tc["vocab_size"] - 1
    heads = tc["num_attention_heads"]
    theta = (tc.get("rope_parameters") or {}).get("rope_theta", tc.get("rope_theta"))
    over = {"rope_theta": float(theta), **over} if theta is not None else over
    return DFlashConfig(
        hidden_size=tc["hidden_size"], intermediate_size=tc["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=tc.get("num_key_value_heads", heads),
        head_dim=tc.get("head_dim") or tc["hidden_size"] // heads, num_layers=num_layers,
        vocab_size=tc["vocab_size"], target_hidden_size=tc["hidden_size"],
        aux_layer_ids=aux_layer_ids or spread_layer_ids(L, max(num_layers, 1)), mask_token_id=int(mask),
        block_size=block_size, rms_norm_eps=tc.get("rms_norm_eps", 1e-6),
        max_position_embeddings=tc.get("max_position_embeddings", 4096), markov_rank=markov_rank, **over)



def fresh_draft(P: Any, meta: dict[str, Any], target_config: dict[str, Any], embed_tokens: torch.Tensor,
                lm_head: torch.Tensor, **heads: int) -> DFlashDraft:
    """03's fresh drafter (``P``: its ``num_layers``, ``block_size``, ``seed``) on the data 02 stored (``meta``: the
    target's sizes and the aux layers it extracted) and the target's embedding and head [V, H]; ``heads``: the
    method's additions (``markov_rank``; DFlash2's ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``,
    ``selector_top_k``), checked to fit the draft's shape in one line."""
    torch.manual_seed(P.seed)
    tc = {**(target_config.get("text_config") or target_config), "vocab_size": meta["vocab_size"],
          "hidden_size": meta["hidden_size"]}
    cfg = from_target(tc, num_layers=P.num_layers, block_size=P.block_size, aux_layer_ids=list(meta["layer_ids"]),
                      **heads)
    if problem := shape_problem(cfg.hidden_size, cfg.vocab_size, cfg.block_size, cfg.conv_kernel_size,
                                cfg.conv_group_size, cfg.selector_top_k if cfg.selector_rank else 0):
        raise DraftMismatchError(problem)
    model = DFlashDraft(cfg)
    model.set_target(embed_tokens, lm_head)
    return model


def check_mask_input(model: DFlashDraft, where: str = "the draft") -> None:
    """Refuse (one line, ``mask.MaskInputError``) a draft whose mask slots would enter as a dead vector: no trained
    ``mask_embedding`` and the target's row of ``mask_token_id`` under half the median row norm, or a trained one
    that is zero, as tiny, or not finite (``mask.dead_mask_problem``). Every mask slot is then the same near-zero
    input (RMSNorm(0) = 0: uniform attention in layer 1), and such a draft accepts little whatever its training (the
    smoke toy's one-layer DFlash: first-position acceptance 0.24 on the dead row, docs/block-drafters.md)."""
    problem = dead_mask_problem(row_norms(model.embed_tokens.weight), model.config.mask_token_id,
                                model.mask_embedding, where)
    if problem:
        raise MaskInputError(*problem)
