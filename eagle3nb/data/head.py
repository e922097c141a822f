"""The target's shape and its output head, read from the model folder without loading the whole model.

The vLLM backend and the reader of vLLM/speculators files need the target's final norm, ``lm_head`` and
``embed_tokens`` but never its layers: these are read tensor by tensor from the safetensors shards (a 1T
model's head is a few GB). Config fields come from ``config.json`` directly (``text_config`` for
multimodal wrappers such as Kimi-K2.5), so no remote code runs.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from eagle3nb.drafts.base import ServedTarget
from eagle3nb.errors import InputError

if TYPE_CHECKING:
    import torch


def text_config(model_dir: Path) -> dict:
    """The language model's config.json fields (``text_config`` of a multimodal wrapper, else the top level)."""
    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: model_path must be a Hugging Face model folder")
    cfg = json.loads(path.read_text())
    return {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg


def target_info(model_dir: Path) -> dict:
    """num_layers, hidden_size, vocab_size, rms_norm_eps, tie_word_embeddings and a fingerprint."""
    cfg = text_config(model_dir)
    return {
        "num_layers": int(cfg["num_hidden_layers"]),
        "hidden_size": int(cfg["hidden_size"]),
        "vocab_size": int(cfg["vocab_size"]),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "fingerprint": model_fingerprint(model_dir),
    }


def model_fingerprint(model_dir: Path) -> str:
    """Identity of a model folder without hashing its weights: config.json plus the weight files' names and
    sizes (a retrained or re-quantized model changes it; a copy elsewhere does not)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for p in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        h.update(f"{p.name}:{p.stat().st_size}".encode())
    return h.hexdigest()[:16]


def _weight_map(model_dir: Path) -> dict[str, str]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open

    out: dict[str, str] = {}
    for p in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(p), "pt") as f:
            out.update({k: p.name for k in f.keys()})
    if not out:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors weights to read the target head from")
    return out


def _pick(names: list[str], suffix: str) -> str | None:
    """The shortest tensor name ending with ``suffix`` outside the decoder layers (skips MTP/vision heads)."""
    cands = sorted((n for n in names if n.endswith(suffix) and ".layers." not in n and "vision" not in n
                    and "mtp" not in n), key=len)
    return cands[0] if cands else None


def read_head_tensors(model_dir: Path) -> dict[str, "torch.Tensor"]:
    """``embed_tokens.weight``, ``lm_head.weight`` and ``norm.weight`` of the target, from its weight files."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    wmap = _weight_map(model_dir)
    names = list(wmap)
    picked = {"embed_tokens.weight": _pick(names, "embed_tokens.weight"),
              "lm_head.weight": _pick(names, "lm_head.weight"),
              "norm.weight": _pick(names, "norm.weight")}
    if picked["lm_head.weight"] is None and target_info(model_dir)["tie_word_embeddings"]:
        picked["lm_head.weight"] = picked["embed_tokens.weight"]
    missing = [k for k, v in picked.items() if v is None]
    if missing:
        raise InputError(f"{model_dir}: could not find {missing} among the weight names (e.g. {names[:3]}); "
                       "is this a causal LM folder?")
    out = {}
    for key, name in picked.items():
        with safe_open(str(model_dir / wmap[name]), "pt") as f:
            out[key] = f.get_tensor(name)
    return out


def embedding_row_norms(model_dir: Path, chunk_rows: int = 8192) -> "torch.Tensor":
    """The L2 norm of each row of the target's input embedding [V], read a chunk of rows at a time (a 1T model's
    embedding is GBs)."""
    import torch
    from safetensors import safe_open

    model_dir = Path(model_dir)
    wmap = _weight_map(model_dir)
    name = _pick(list(wmap), "embed_tokens.weight")
    if name is None:
        raise InputError(f"{model_dir}: no embed_tokens.weight among the weight names; is this a causal LM folder?")
    with safe_open(str(model_dir / wmap[name]), "pt") as f:
        rows = f.get_slice(name)
        V = rows.get_shape()[0]
        return torch.cat([rows[s:s + chunk_rows].float().norm(dim=-1) for s in range(0, V, chunk_rows)])


def served_target(model_dir: Path) -> ServedTarget:
    """The target as a served draft's check reads it (``eagle3nb.drafts.check_serving``): its depth and sizes from
    config.json now, its embedding's row norms when a method asks."""
    cfg = text_config(model_dir)
    return ServedTarget(int(cfg["num_hidden_layers"]), int(cfg["hidden_size"]), int(cfg["vocab_size"]),
                        lambda: embedding_row_norms(model_dir))


def rms_norm(x: "torch.Tensor", weight: "torch.Tensor", eps: float) -> "torch.Tensor":
    """The Llama/DeepSeek RMSNorm exactly as transformers computes it (float32 inside, back to x's dtype)."""
    import torch

    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(h.device) * h.to(dtype)


class TargetHead:
    """The target's ``lm_head`` (and final norm) on one device, with the draft vocabulary's rows gathered,
    to turn final states into the loss target: draft-vocab logits and the full-vocab argmax."""

    def __init__(self, lm_head: "torch.Tensor", draft_target_ids: "torch.Tensor",
                 norm_weight: "torch.Tensor | None" = None,
                 eps: float = 1e-6, device: "str | torch.device" = "cpu", chunk_tokens: int = 1024):
        import torch

        self.device = torch.device(device)
        self.lm_head = lm_head.to(self.device, torch.float32)
        self.draft_rows = self.lm_head[draft_target_ids.to(self.device)]
        self.norm_weight = None if norm_weight is None else norm_weight.to(self.device)
        self.eps = eps
        self.chunk_tokens = chunk_tokens

    def norm(self, prenorm: "torch.Tensor") -> "torch.Tensor":
        if self.norm_weight is None:
            raise ValueError("this TargetHead has no norm weight")
        return rms_norm(prenorm.to(self.device), self.norm_weight.to(prenorm.dtype), self.eps)

    def draft_logits_and_argmax(self, final: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
        """``final`` [..., H] (normed) -> (float32 logits over the draft vocab [..., D], int64 argmax over the
        whole target vocab [...]); chunked so a long batch never materialises [tokens, V] at once."""
        import torch

        flat = final.reshape(-1, final.shape[-1]).to(self.device, torch.float32)
        logits, argmax = [], []
        for s in range(0, flat.shape[0], self.chunk_tokens):
            x = flat[s:s + self.chunk_tokens]
            logits.append(x @ self.draft_rows.T)
            argmax.append((x @ self.lm_head.T).argmax(-1))
        lead = final.shape[:-1]
        return (torch.cat(logits).reshape(*lead, -1) if logits else flat.new_zeros(*lead, self.draft_rows.shape[0]),
                torch.cat(argmax).reshape(lead) if argmax else flat.new_zeros(lead, dtype=torch.int64))
