"""The EAGLE-3 draft model (Li et al. 2025, arXiv:2503.01840), in the layout vLLM, SGLang and SpecForge use.

Read top to bottom like the paper:

1. ``fc`` fuses three of the target's hidden states (low, mid, high layer) into one feature g_t.
2. One decoder layer (``midlayer``) takes ``cat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))``, so its
   attention projections take 2H inputs; the residual stream is the hidden path (g_t), not the embedding. Its
   attention is Llama's (``Attention``), or DeepSeek's multi-head latent attention (``MLAAttention``, when the
   config has ``mla`` widths: the draft stock vLLM's CPU build serves beside an MLA target, whose CPU kernels
   declare one KV block size in common only with another MLA layer; docs/vllm.md's plugin fixes that).
   ``num_layers`` > 1 stacks plain decoder layers (``deeper``) on it, as vLLM's llama_eagle3 / deepseek_eagle3
   build ``num_hidden_layers``: layer 0 reads the 2H concatenation, every later one only the H-wide residual
   stream (its attention input H, no embedding, no ``hidden_norm``).
3. The pre-norm output of that layer is the draft's own "feature"; it is fed back as g at the next draft step
   (training-time test and decoding alike). ``norm`` + ``lm_head`` turn it into logits over the draft vocabulary.
   EAGLE-3.1 (vLLM's ``fc_norm`` / ``norm_output`` config keys, both off by default): ``fc_norm`` puts one RMSNorm
   on each aux state before ``fc`` (so no layer's scale dominates the fused feature), ``norm_output`` feeds
   the post-norm state back instead of the pre-norm one.
4. ``d2t``/``t2d`` map between draft and target vocabularies: ``target_id = draft_id + d2t[draft_id]``.
5. Parallel drafting (P-EAGLE, arXiv 2602.01469; vLLM's ``parallel_drafting``): a draft whose config has a
   ``mask_token_id`` proposes all k tokens in one forward. After the step-0 position (the last verified token's
   embedding, the target's fused feature) come k-1 mask positions at the next rotary positions, each reading
   the mask token's embedding and ``mask_feature()`` (the learned ``mask_hidden``, a stand-in for the three aux
   states, fused by ``fc`` as vLLM's ``combine_hidden_states`` does), attending causally to everything before
   it; their outputs are drafts 2..k.

The embedding is the target's and stays frozen. The ``# shape:`` comments use B batch, T positions, H the
draft's hidden size, H_t the target's, nh / nkv query / key-value heads of size d, I the MLP width, V the
target's vocabulary, Vd the draft's. The K/V caches (decoding's ``DraftCache``, the training-time test's
``TTTCache``): ``cache``; loading and saving: ``layouts``; training: ``objective``; decoding: ``drafting``; 04's
offline simulation: ``offline`` (this package, ``eagle3nb.drafts.eagle3``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from eagle3nb.drafts.base import DraftMismatchError
from eagle3nb.drafts.eagle3.cache import DraftCache, TTTCache, sdpa
from eagle3nb.drafts.nn import MLP, RMSNorm, rotate_half
from eagle3nb.errors import InputError


@dataclass
class Eagle3Config:
    """The draft's shape. ``aux_layer_ids`` are HF ``hidden_states`` indices (== vLLM's ids)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    target_hidden_size: int | None = None  # None: same as hidden_size
    aux_layer_ids: list[int] | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    extra: dict[str, Any] = field(default_factory=dict)  # other config keys, kept on save (e.g. bos/eos ids)
    # An MLA midlayer's widths (MLA_KEYS; q_lora_rank None: a full-rank query); None: Llama attention.
    mla: dict[str, Any] | None = None
    # EAGLE-3.1 (vLLM's llama_eagle3 / deepseek_eagle3 config keys): an RMSNorm per aux state before fc
    # (``fc_norm.{i}.weight``), and the post-norm state fed back as the next step's feature.
    fc_norm: bool = False
    norm_output: bool = False
    num_layers: int = 1  # decoder layers (vLLM's num_hidden_layers): the midlayer, then num_layers - 1 ``deeper``
    # Parallel drafting (P-EAGLE): the target-vocab id the mask positions read (vLLM's ``mask_token_id`` config
    # key), with a learned ``mask_hidden``; None: a sequential EAGLE-3 draft.
    mask_token_id: int | None = None

    def __post_init__(self):
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.mla is not None:
            missing = [k for k in MLA_KEYS if k not in self.mla]
            if missing:
                raise InputError(f"an MLA draft needs {', '.join(MLA_KEYS)}; missing {', '.join(missing)}")
            self.num_key_value_heads = self.num_attention_heads  # MLA expands its latent to every head
            self.head_dim = self.mla["qk_rope_head_dim"]  # the rotary width
        if self.num_layers < 1:
            raise InputError(f"num_layers is {self.num_layers}; a draft has at least one decoder layer")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise InputError(f"mask_token_id {self.mask_token_id} is outside the target's vocabulary "
                             f"0..{self.vocab_size - 1}: use one of its token ids")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InputError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")

    # ---- config.json <-> Eagle3Config -------------------------------------------------------------

    def llama_dict(self) -> dict[str, Any]:
        """The decoder-layer keys both layouts share (Llama's; an MLA draft's under DeepseekV2's model_type, the
        one vLLM keeps for a draft: it rewrites deepseek_v3 configs into its MTP drafter)."""
        mla = {"model_type": "deepseek_v2", **self.mla} if self.mla is not None else {}
        return {
            "model_type": "llama",
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            **mla,
        }

    @classmethod
    def from_llama_dict(cls, d: dict[str, Any], **over: Any) -> "Eagle3Config":
        """Read the Llama keys (legacy ``rope_theta``/``rope_scaling`` or transformers-5 ``rope_parameters``).
        ``num_hidden_layers`` is not read (a target's config lends its other keys to a fresh draft): a draft's
        own config passes ``num_layers`` in ``over``."""
        rope = dict(d.get("rope_parameters") or {})
        rope_theta = d.get("rope_theta", rope.pop("rope_theta", 10000.0))
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = rope
        heads = d["num_attention_heads"]
        values = dict(
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            vocab_size=d["vocab_size"],
            draft_vocab_size=d.get("draft_vocab_size") or d["vocab_size"],
            target_hidden_size=d.get("target_hidden_size"),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            extra={k: d[k] for k in _KEPT_EXTRA if d.get(k) is not None},
            fc_norm=bool(d.get("fc_norm", False)),
            norm_output=bool(d.get("norm_output", False)),
        )
        values.update(over)
        return cls(**values)


# An MLA midlayer's widths, as DeepSeek's config.json names them.
MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# Token-id keys of the target's config that a draft config carries along unchanged.
_KEPT_EXTRA = ("bos_token_id", "eos_token_id", "pad_token_id")


# ---- building blocks (RMSNorm, rotate_half and the MLP are eagle3nb.drafts.nn's) -----------------


class Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H concatenation of embedding and feature (``width`` H in the
    layers after the first)."""

    def __init__(self, cfg: Eagle3Config, width: int):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(width, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(width, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(width, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache, attention_mask):
        B, T, _ = x.shape  # shape: x [B, T, 2H] (H after the first layer)
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)  # shape: [B, nh, T, d]
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # shape: [B, nkv, T, d]
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # shape: [B, nkv, T, d]
        cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)  # shape: [B, 1, T, d]
        q = q * cos + rotate_half(q) * sin  # rotary position embedding
        k = k * cos + rotate_half(k) * sin
        groups = self.nh // self.nkv
        if isinstance(cache, TTTCache):  # training-time test: step i of the unroll
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # shape: [B, nh, T, d]
            out = cache.attend(q, k, v, attention_mask)  # shape: [B, nh, T, d]
        else:  # one pass, or decoding with a KV cache
            past = 0
            if cache is not None:
                past = cache.length
                k, v = cache.append(k, v)  # shape: [B, nkv, past + T, d]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # shape: [B, nh, past+T, d]
            out = sdpa(q, k, v, attention_mask, past)  # shape: [B, nh, T, d]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))  # shape: [B, T, H]


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotary pairs adjacent channels (2i, 2i+1); reorder them into halves so ``rotate_half`` applies
    (the same permutation on q and k leaves every q.k product as the interleaved rotation gives it)."""
    d = x.shape[-1]
    return x.unflatten(-1, (d // 2, 2)).transpose(-1, -2).flatten(-2)  # shape: [..., d]


class MLAAttention(nn.Module):
    """DeepSeek-V2/V3 multi-head latent attention reading the 2H concatenation: keys and values come from one
    compressed latent (kv_lora_rank) plus a rotary key part shared by all heads (``width`` H after the first
    layer); tensor names as vLLM's deepseek_eagle3 draft loads them."""

    def __init__(self, cfg: Eagle3Config, width: int):
        super().__init__()
        m = cfg.mla
        self.nh, self.rank, self.q_rank = cfg.num_attention_heads, m["kv_lora_rank"], m["q_lora_rank"]
        self.nope, self.rope, self.vd = m["qk_nope_head_dim"], m["qk_rope_head_dim"], m["v_head_dim"]
        qk = self.nope + self.rope
        if (cfg.rope_scaling or {}).get("mscale_all_dim"):
            raise InputError("an MLA draft with DeepSeek's yarn mscale (rope_scaling.mscale_all_dim) is not "
                             "supported yet: train a Llama-attention draft (draft_attention: llama)")
        if self.q_rank:
            self.q_a_proj = nn.Linear(width, self.q_rank, bias=False)
            self.q_a_layernorm = RMSNorm(self.q_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_rank, self.nh * qk, bias=False)
        else:
            self.q_proj = nn.Linear(width, self.nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(width, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, self.nh * (self.nope + self.vd), bias=False)
        self.o_proj = nn.Linear(self.nh * self.vd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache, attention_mask):
        B, T, _ = x.shape  # shape: x [B, T, 2H] (H after the first layer)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_rank else self.q_proj(x)
        q = q.view(B, T, self.nh, -1).transpose(1, 2)  # shape: [B, nh, T, nope + rope]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)  # [B, T, r], [B, T, rope]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, self.nh, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.vd], dim=-1)  # shape: [B, nh, T, nope], [B, nh, T, vd]
        cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)  # shape: [B, 1, T, rope]
        q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe[:, None])  # shape: [B, nh, T, rope], [B, 1, T, rope]
        q_pe = q_pe * cos + rotate_half(q_pe) * sin
        k_pe = k_pe * cos + rotate_half(k_pe) * sin
        q = torch.cat([q_nope, q_pe], dim=-1)  # shape: [B, nh, T, nope + rope]
        k = torch.cat([k_nope, k_pe.expand(-1, self.nh, -1, -1)], dim=-1)  # shape: [B, nh, T, nope + rope]
        if isinstance(cache, TTTCache):
            out = cache.attend(q, k, v, attention_mask)  # shape: [B, nh, T, vd]
        else:
            past = 0
            if cache is not None:
                past = cache.length
                k, v = cache.append(k, v)  # shape: [B, nh, past + T, .]
            out = sdpa(q, k, v, attention_mask, past)  # shape: [B, nh, T, vd], scale 1/sqrt(nope + rope)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.vd))  # shape: [B, T, H]


class MidLayer(nn.Module):
    """The single decoder layer. Residual = the feature path; attention input = [norm(embed), norm(feature)]."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention(cfg, 2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, cos, sin, cache, attention_mask):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # shape: [B, T, 2H]
        h = hidden + self.self_attn(x, cos, sin, cache, attention_mask)  # shape: [B, T, H], residual = feature
        return h + self.mlp(self.post_attention_layernorm(h))  # shape: [B, T, H]


class DecoderLayer(nn.Module):
    """A layer after the midlayer (``num_layers`` > 1): a plain pre-norm decoder layer over the residual stream,
    as vLLM's eagle3 drafts run their layers >= 1 (no embedding, attention input H)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention(cfg, cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, cache, attention_mask):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, attention_mask)  # shape: [B, T, H]
        return h + self.mlp(self.post_attention_layernorm(h))  # shape: [B, T, H]


def attention(cfg: Eagle3Config, width: int) -> nn.Module:
    """The config's attention (DeepSeek's latent one when it has ``mla`` widths, else Llama's) over ``width``."""
    return MLAAttention(cfg, width) if cfg.mla is not None else Attention(cfg, width)


# ---- the model ------------------------------------------------------------------------------------


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft: ``fuse`` the target's aux states once, then ``forward`` one step at a time."""

    method = "eagle3"  # its name in the eagle3nb.drafts registry

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        if cfg.fc_norm:  # EAGLE-3.1: one norm per aux state (vLLM's ``fc_norm.{i}``); absent otherwise
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(3))
        self.midlayer = MidLayer(cfg)
        if cfg.num_layers > 1:  # vLLM's layers 1.. (exported as ``layers.{i}``); absent in a one-layer draft
            self.deeper = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers - 1))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        if cfg.mask_token_id is not None:  # P-EAGLE: the mask positions' stand-in aux states (vLLM's ``mask_hidden``)
            self.mask_hidden = nn.Parameter(0.02 * torch.randn(1, 3 * cfg.target_hidden_size))  # shape: [1, 3*H_t]
        # The vocabulary maps (set_vocab); a draft over the whole vocabulary starts at its only map, the identity.
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.full((cfg.vocab_size,), cfg.draft_vocab_size == cfg.vocab_size))
        # Rotary tables from the config (any rope_scaling transformers knows); not part of the checkpoint.
        llama = LlamaConfig(**{k: v for k, v in cfg.llama_dict().items() if k != "model_type"})
        self.rotary = LlamaRotaryEmbedding(llama)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[B, T, 3*H_target] (low, mid, high aux states concatenated) -> the step-0 feature [B, T, H]."""
        if aux.shape[-1] != self.fc.in_features:
            raise DraftMismatchError(
                f"aux states have width {aux.shape[-1]} but the draft's fc expects 3 x target_hidden_size = "
                f"{self.fc.in_features}; the hidden-state data and the draft come from different targets")
        aux = aux.to(self.fc.weight.dtype)
        if self.config.fc_norm:  # EAGLE-3.1: normalise each aux state on its own, as vLLM's combine_hidden_states
            chunks = aux.chunk(3, dim=-1)  # shape: 3 x [B, T, H_t]
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)  # shape: [B, T, 3*H_t]
        return self.fc(aux)  # shape: [B, T, 3*H_t] -> [B, T, H]

    def mask_feature(self) -> torch.Tensor:
        """The feature every parallel-drafting mask position reads [1, 1, H]: ``mask_hidden`` through ``fuse``
        (fc_norm and fc), as vLLM computes it once at load."""
        return self.fuse(self.mask_hidden[None])  # shape: [1, 1, 3*H_t] -> [1, 1, H]

    def unroll_inputs(self, step: int, input_ids: torch.Tensor, hidden: torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a training-time-test unroll (``TTTCache``) feeds at ``step``: the shifted tokens [B, T] and the fed-back
        feature [B, T, H] given; for a parallel-drafting draft after step 0, the mask token and ``mask_feature()``
        at every position instead, as vLLM's mask slots read them."""
        if step == 0 or self.config.mask_token_id is None:
            return input_ids, hidden
        B, T = input_ids.shape
        return torch.full_like(input_ids, self.config.mask_token_id), self.mask_feature().expand(B, T, -1)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cache: DraftCache | TTTCache | None = None, attention_mask: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over [B, T] positions.

        hidden: [B, T, H] feature (``fuse(aux)`` at step 0, the previous step's ``hidden_out`` after);
        input_ids: [B, T] target-vocab ids of the *next* token at each position; position_ids: [B, T].
        Returns (hidden_out [B, T, H] pre-norm (post-norm with ``norm_output``), fed back at the next step;
        logits [B, T, draft_vocab])."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # shape: [B, T, H]
        cos, sin = self.rotary(hidden, position_ids)  # shape: [B, T, d] each
        h = self.midlayer(embeds, hidden, cos, sin, cache, attention_mask)  # shape: [B, T, H]
        for i, layer in enumerate(self.deeper if self.config.num_layers > 1 else (), start=1):
            h = layer(h, cos, sin, None if cache is None else cache.layer(i), attention_mask)  # shape: [B, T, H]
        normed = self.norm(h)  # shape: [B, T, H]
        out = normed if self.config.norm_output else h  # EAGLE-3.1 norm_output: the post-norm state is fed back
        return out, self.lm_head(normed)  # shape: [B, T, H], [B, T, Vd]

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target-vocab ids."""
        return ids + self.d2t[ids]

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        if d2t.shape != self.d2t.shape or t2d.shape != self.t2d.shape:
            raise DraftMismatchError(
                f"vocab maps have shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)}; the draft expects "
                f"d2t {tuple(self.d2t.shape)} (draft_vocab_size) and t2d {tuple(self.t2d.shape)} (vocab_size)")
        self.d2t.copy_(d2t.to(torch.int64))
        self.t2d.copy_(t2d.to(torch.bool))
