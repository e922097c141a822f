"""The layers both draft families build from (EAGLE-3's ``eagle3.model``, the block drafters' ``dflash.model``):
Llama's RMSNorm, the rotary embedding's half rotation and the SwiGLU MLP, as vLLM's llama / qwen3 layers compute
them. ``# shape:`` comments: H the draft's hidden size, I its MLP width."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, scale by a learned weight."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # shape: [..., size], unit RMS
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotary embedding's partner of ``x`` (neox style: halves, not interleaved pairs): [-x2, x1]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), its widths from ``cfg`` (``hidden_size``, ``intermediate_size``: an
    ``Eagle3Config`` or a ``DFlashConfig``)."""

    def __init__(self, cfg: Any):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # shape: [..., H] -> [..., I] -> [..., H]
