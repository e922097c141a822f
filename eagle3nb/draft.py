"""The EAGLE-3 draft model (Li et al. 2025, arXiv:2503.01840), in the layout vLLM, SGLang and SpecForge use.

Read top to bottom like the paper:

1. ``fc`` fuses three of the target's hidden states (low, mid, high layer) into one feature g_t.
2. One Llama decoder layer (``midlayer``) takes ``cat(input_layernorm(embed(x_{t+1})), hidden_norm(g_t))``, so
   its q/k/v projections take 2H inputs; the residual stream is the hidden path (g_t), not the embedding.
3. The pre-norm output of that layer is the draft's own "feature"; it is fed back as g at the next draft step
   (training-time test and decoding alike). ``norm`` + ``lm_head`` turn it into logits over the draft vocabulary.
4. ``d2t``/``t2d`` map between draft and target vocabularies: ``target_id = draft_id + d2t[draft_id]``.

The embedding is the target's and stays frozen. Checkpoints load from and save to the EAGLE-3 layout
(``midlayer.*``, config ``LlamaForCausalLMEagle3`` + ``eagle_config``; AQ-MedAI drafters, SpecForge exports)
and the speculators layout (``layers.0.*``, ``speculators_model_type: eagle3``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle3nb.layers import default_aux_layer_ids, from_sglang
from eagle3nb.progress import write_json_atomic

WEIGHTS_FILE = "model.safetensors"


class DraftMismatchError(ValueError):
    """A draft checkpoint that does not fit the data / target it is used with."""


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

    def __post_init__(self):
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")

    # ---- config.json <-> Eagle3Config -------------------------------------------------------------

    def llama_dict(self) -> dict[str, Any]:
        """The Llama decoder-layer keys both layouts share."""
        return {
            "model_type": "llama",
            "num_hidden_layers": 1,
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
        }

    @classmethod
    def from_llama_dict(cls, d: dict[str, Any], **over: Any) -> "Eagle3Config":
        """Read the Llama keys (legacy ``rope_theta``/``rope_scaling`` or transformers-5 ``rope_parameters``)."""
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
        )
        values.update(over)
        return cls(**values)


# Token-id keys of the target's config that a draft config carries along unchanged.
_KEPT_EXTRA = ("bos_token_id", "eos_token_id", "pad_token_id")


# ---- building blocks ------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, scale by a learned weight."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class DraftCache:
    """The midlayer's K/V while decoding: keys/values [B, kv_heads, length, head_dim], one entry per position."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, n: int) -> None:
        """Keep the first ``n`` positions (drop the K/V of rejected draft tokens)."""
        if self.k is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]


class TTTCache:
    """The K/V of a training-time-test unroll (paper section 3.3).

    Step 0 runs over the whole sequence with the target's features and attends causally. Step i >= 1 runs the
    whole sequence again, one position further into the future; at position t it attends to the causal step-0
    keys 0..t plus the keys that steps 1..i produced *at position t* (the "diagonal"), exactly what position t
    would see when decoding i tokens ahead with a KV cache.

    Two equal ways to compute it: ``dense=False`` scores the step-0 keys with one matmul and the diagonal
    element-wise (least compute; the default on CPU); ``dense=True`` hands all keys of steps 0..i to fused
    attention with a block mask [causal | identity | ...], which never materialises T x T scores (the default
    on GPUs, where long sequences would not fit otherwise)."""

    def __init__(self, dense: bool | None = None):
        self.dense = dense
        self.k0: torch.Tensor | None = None
        self.v0: torch.Tensor | None = None
        self.ks: list[torch.Tensor] = []
        self.vs: list[torch.Tensor] = []

    @property
    def steps(self) -> int:
        return 0 if self.k0 is None else 1 + len(self.ks)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None,
               ) -> torch.Tensor:
        """q [B, nh, T, d]; k, v [B, nh, T, d] (already expanded to the query heads)."""
        if self.k0 is None:
            self.k0, self.v0 = k, v
            return _sdpa(q, k, v, attention_mask, past=0)
        self.ks.append(k)
        self.vs.append(v)
        T = q.shape[2]
        allowed = _causal(T, T, 0, q.device) if attention_mask is None else _as_bool_mask(attention_mask)
        if self.dense if self.dense is not None else q.is_cuda:
            diagonal = torch.eye(T, dtype=torch.bool, device=q.device).expand_as(allowed)
            mask = torch.cat([allowed] + [diagonal] * len(self.ks), dim=-1)
            keys, values = torch.cat([self.k0, *self.ks], dim=2), torch.cat([self.v0, *self.vs], dim=2)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores0 = (torch.matmul(q, self.k0.transpose(2, 3)) * scale).masked_fill(~allowed, float("-inf"))
        diag = torch.stack([(q * kj).sum(-1) for kj in self.ks], dim=-1) * scale  # [B, nh, T, i]
        w = torch.softmax(torch.cat([scores0, diag], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(w[..., :T], self.v0)
        for j, vj in enumerate(self.vs):
            out = out + w[..., T + j, None] * vj
        return out


def _causal(tq: int, tk: int, past: int, device) -> torch.Tensor:
    """Query j (absolute position past+j) may see keys 0..past+j."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril(diagonal=past)


def _as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """Accept [B, Tq, Tk] or [B, 1, Tq, Tk] boolean (True = may attend) masks."""
    if mask.dtype != torch.bool:
        raise TypeError("attention_mask must be boolean (True = may attend)")
    return mask[:, None] if mask.dim() == 3 else mask


def _sdpa(q, k, v, attention_mask, past: int) -> torch.Tensor:
    tq, tk = q.shape[2], k.shape[2]
    if attention_mask is not None:
        mask = _as_bool_mask(attention_mask)
    elif tq == 1:
        mask = None  # one new token sees everything cached before it
    else:
        mask = _causal(tq, tk, past, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class Attention(nn.Module):
    """Llama attention whose q/k/v read the 2H concatenation of embedding and feature."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache, attention_mask):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        cos, sin = cos[:, None].to(q.dtype), sin[:, None].to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        groups = self.nh // self.nkv
        if isinstance(cache, TTTCache):
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = cache.attend(q, k, v, attention_mask)
        else:
            past = 0
            if cache is not None:
                past = cache.length
                k, v = cache.append(k, v)
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = _sdpa(q, k, v, attention_mask, past)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The single decoder layer. Residual = the feature path; attention input = [norm(embed), norm(feature)]."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, cos, sin, cache, attention_mask):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        h = hidden + self.self_attn(x, cos, sin, cache, attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


# ---- the model ------------------------------------------------------------------------------------


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft: ``fuse`` the target's aux states once, then ``forward`` one step at a time."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's embedding, frozen
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        # Rotary tables from the config (any rope_scaling transformers knows); not part of the checkpoint.
        llama = LlamaConfig(**{k: v for k, v in cfg.llama_dict().items() if k != "model_type"})
        self.rotary = LlamaRotaryEmbedding(llama)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """[B, T, 3*H_target] (low, mid, high aux states concatenated) -> the step-0 feature [B, T, H]."""
        if aux.shape[-1] != self.fc.in_features:
            raise DraftMismatchError(
                f"aux states have width {aux.shape[-1]} but the draft's fc expects 3 x target_hidden_size = "
                f"{self.fc.in_features}; the hidden-state data and the draft come from different targets")
        return self.fc(aux.to(self.fc.weight.dtype))

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cache: DraftCache | TTTCache | None = None, attention_mask: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over [B, T] positions.

        hidden: [B, T, H] feature (``fuse(aux)`` at step 0, the previous step's ``hidden_out`` after);
        input_ids: [B, T] target-vocab ids of the *next* token at each position; position_ids: [B, T].
        Returns (hidden_out [B, T, H] pre-norm, fed back at the next step; logits [B, T, draft_vocab])."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        cos, sin = self.rotary(hidden, position_ids)
        h = self.midlayer(embeds, hidden, cos, sin, cache, attention_mask)
        return h, self.lm_head(self.norm(h))

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


# ---- fitting a draft to its data -------------------------------------------------------------------


def check_fits(cfg: Eagle3Config, *, hidden_size: int, vocab_size: int, layer_ids: list[int] | None,
               num_layers: int | None = None, draft_vocab_size: int | None = None,
               draft: str = "the draft", data: str = "the data") -> None:
    """Raise DraftMismatchError naming both sides when a draft cannot be trained/used on this target's data."""
    problems = []
    if cfg.target_hidden_size != hidden_size:
        problems.append(f"target hidden size: {draft} has {cfg.target_hidden_size} (fc input "
                        f"{3 * cfg.target_hidden_size}), {data} has {hidden_size}")
    if cfg.vocab_size != vocab_size:
        problems.append(f"target vocab size: {draft} has {cfg.vocab_size}, {data} has {vocab_size}")
    if draft_vocab_size is not None and cfg.draft_vocab_size != draft_vocab_size:
        problems.append(f"draft vocab size: {draft} has {cfg.draft_vocab_size}, {data} has {draft_vocab_size}")

    ids = cfg.aux_layer_ids
    if ids is None and num_layers is not None:
        ids = default_aux_layer_ids(num_layers)  # what vLLM uses when a config names none
    if layer_ids is not None and ids is not None and list(ids) != list(layer_ids):
        hint = ""
        if from_sglang(ids) == list(layer_ids):
            hint = " (the draft's ids look like SGLang/SpecForge output-of-layer ids: add 1 to convert)"
        problems.append(f"aux layer ids (HF hidden_states index == vLLM ids): {draft} has {list(ids)}, "
                        f"{data} has {list(layer_ids)}{hint}")
    if problems:
        raise DraftMismatchError(
            "the draft does not fit the data:\n  - " + "\n  - ".join(problems)
            + "\nUse a checkpoint trained for this target (and these layers), or extract hidden states with the "
              "checkpoint's layer ids (02_hidden_states aux_layer_ids).")


# ---- load / save ----------------------------------------------------------------------------------


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (path / WEIGHTS_FILE).exists():
        return load_file(path / WEIGHTS_FILE)
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(path / f))
        return out
    if (path / "pytorch_model.bin").exists():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{path}: no model.safetensors, model.safetensors.index.json or pytorch_model.bin; "
                            "point at the draft checkpoint folder")


def _config_from_json(d: dict[str, Any], path: Path) -> Eagle3Config:
    """The draft's shape from an EAGLE-3-layout or speculators-layout config.json."""
    if d.get("speculators_model_type") is not None:
        if d["speculators_model_type"] != "eagle3":
            raise DraftMismatchError(f"{path}/config.json: speculators_model_type is "
                                     f"{d['speculators_model_type']!r}; only 'eagle3' drafts are supported")
        layer = dict(d["transformer_layer_config"])
        cfg = Eagle3Config.from_llama_dict(
            layer, draft_vocab_size=d.get("draft_vocab_size") or layer["vocab_size"],
            target_hidden_size=d.get("target_hidden_size"), aux_layer_ids=d.get("eagle_aux_hidden_state_layer_ids"))
        if d.get("norm_before_residual"):
            raise DraftMismatchError(f"{path}: norm_before_residual=true drafts are not supported "
                                     "(the residual would be the normed feature)")
        return cfg
    if "hidden_size" not in d:
        raise DraftMismatchError(f"{path}/config.json is neither an EAGLE-3 draft config (LlamaForCausalLMEagle3) "
                                 "nor a speculators config (speculators_model_type)")
    arch = [a for a in d.get("architectures") or [] if a not in ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")]
    if arch:
        raise DraftMismatchError(f"{path}: architecture {arch[0]} is not a Llama-layer EAGLE-3 draft (e.g. an MLA "
                                 "draft); only LlamaForCausalLMEagle3 checkpoints can be loaded and trained here")
    ids = d.get("eagle_aux_hidden_state_layer_ids") or (d.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if d.get("num_hidden_layers", 1) != 1:
        raise DraftMismatchError(f"{path}: num_hidden_layers={d['num_hidden_layers']}; only 1-layer EAGLE-3 "
                                 "drafts are supported")
    return Eagle3Config.from_llama_dict(d, aux_layer_ids=list(ids) if ids else None)


def _normalise_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map the layouts onto ours: ``layers.0.`` -> ``midlayer.``, strip a ``model.`` prefix."""
    out = {}
    for name, t in tensors.items():
        if name.startswith("model."):
            name = name[len("model."):]
        if name.startswith("layers.0."):
            name = "midlayer." + name[len("layers.0."):]
        out[name] = t
    return out


def load_draft(path: str | Path, embed_tokens: torch.Tensor | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = torch.float32) -> Eagle3Draft:
    """Load an EAGLE-3 draft (EAGLE-3 or speculators layout). ``embed_tokens`` [V, H] is the target's embedding,
    needed when the checkpoint does not carry one (e.g. ``HiddenStates(data_dir).embed_tokens()``)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found; point at a draft checkpoint folder (config.json + "
                                "model.safetensors)")
    cfg = _config_from_json(json.loads(cfg_file.read_text()), path)
    tensors = _normalise_names(_read_tensors(path))
    model = Eagle3Draft(cfg)
    expected = dict(model.state_dict())
    if "embed_tokens.weight" not in tensors:
        if embed_tokens is None:
            raise DraftMismatchError(f"{path} has no embed_tokens.weight; pass the target's embedding "
                                     "(load_draft(dir, embed_tokens=HiddenStates(data_dir).embed_tokens()))")
        tensors["embed_tokens.weight"] = embed_tokens
    if "d2t" not in tensors and "t2d" not in tensors and cfg.draft_vocab_size == cfg.vocab_size:
        tensors["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)  # identity map
        tensors["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise DraftMismatchError(f"{path}: tensors do not match an EAGLE-3 draft: missing {missing}, "
                                 f"unexpected {unexpected}")
    for name, t in tensors.items():
        if tuple(t.shape) != tuple(expected[name].shape):
            raise DraftMismatchError(f"{path}: tensor {name} has shape {tuple(t.shape)} but config.json implies "
                                     f"{tuple(expected[name].shape)}")
    tensors["d2t"] = tensors["d2t"].to(torch.int64)
    tensors["t2d"] = tensors["t2d"].to(torch.bool)
    model.load_state_dict(tensors)
    if dtype is not None:
        model.to(dtype)  # floating tensors only; d2t/t2d keep their integer/bool types
    return model.to(device).eval()


def draft_config_json(model: Eagle3Draft, format: str = "eagle3", dtype: torch.dtype | None = None,
                      verifier: str | None = None, num_speculative_tokens: int = 3) -> dict[str, Any]:
    """The config.json vLLM/SGLang (``eagle3``) or speculators (``speculators``) expect for this draft."""
    cfg = model.config
    dtype = dtype or model.fc.weight.dtype
    dtype_name = str(dtype).removeprefix("torch.")
    ids = list(cfg.aux_layer_ids) if cfg.aux_layer_ids is not None else None
    if format == "eagle3":
        d = {"architectures": ["LlamaForCausalLMEagle3"], **cfg.llama_dict(), **cfg.extra,
             "draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
             "torch_dtype": dtype_name}
        if ids is not None:
            d["eagle_aux_hidden_state_layer_ids"] = ids  # vLLM reads the top-level key
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True}
        return d
    if format == "speculators":
        return {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            "transformer_layer_config": {**cfg.llama_dict(), **cfg.extra},
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "norm_before_residual": False,
            "eagle_aux_hidden_state_layer_ids": ids,
            "torch_dtype": dtype_name,
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens}],
                "verifier": {"name_or_path": verifier, "architectures": []},
            },
        }
    raise ValueError(f"format must be 'eagle3' or 'speculators', got {format!r}")


def save_draft(model: Eagle3Draft, path: str | Path, format: str = "eagle3", dtype: torch.dtype | None = None,
               include_embed: bool = True, verifier: str | None = None, num_speculative_tokens: int = 3) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the EAGLE-3 layout (``midlayer.*``; vLLM/SGLang) or the
    speculators layout (``layers.0.*``). Files are written to temporary names and renamed."""
    from safetensors.torch import save_file


    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = draft_config_json(model, format, dtype, verifier, num_speculative_tokens)
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "embed_tokens.weight" and not include_embed:
            continue
        if t.is_floating_point() and dtype is not None:
            t = t.to(dtype)
        if format == "speculators" and name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer."):]
        tensors[name] = t.detach().cpu().contiguous()
    tmp = path / f".{WEIGHTS_FILE}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(path / WEIGHTS_FILE)
    write_json_atomic(path / "config.json", config)
    return path

