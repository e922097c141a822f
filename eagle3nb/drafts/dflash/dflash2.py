"""DFlash2's two additions to the DFlash backbone (as vLLM 0.32's ``qwen3_dflash2.py`` serves them and speculators
0.9.0's ``dflash2`` trains them). No I/O here.

1. **Grouped dynamic convolution** around each layer's attention and MLP (``attention_conv``, ``mlp_conv``). A block's
   slots are a short sequence, and a causal convolution of ``taps`` taps *within the block* mixes each slot with the
   ones before it. The kernel is a per-channel ``base_kernel`` plus a per-slot ``delta`` shared by each group of
   ``group_size`` channels, projected from the slot's own state (``kernel_projection``): a dynamic kernel. One
   projection gives the kernels of both sides: ``prepare`` convolves the sublayer's input and keeps the output-side
   kernel, ``finish`` convolves the sublayer's output with it. Initialised as the identity (tap 0 of the base 1, the
   rest and the projection 0), a fresh DFlash2 is exactly a DFlash.

       out[s, c] = sum over taps t with s - t in the block of (base[t, c] + delta[s, t, c // group_size]) * x[s - t, c]

2. **Candidate selector**: a low-rank bilinear score of a candidate token given the token before it and the slot's
   state, added to the unary logits of the block's top ``top_k`` candidates:
   ``score(v | prev, h) = unary[v] + <predecessor_codebook[prev] * hidden_projection(h), successor_codebook[v]>``.
   Decoding walks the block left to right, each slot choosing among its candidates given the token chosen before
   it (the anchor for the first), so the block reads as a path, not as independent guesses.
"""

from __future__ import annotations

import torch
from torch import nn


def shape_problem(hidden_size: int, vocab_size: int, block_size: int, taps: int, group_size: int, top_k: int
                  ) -> str | None:
    """Why DFlash2's additions cannot fit a draft of this shape (one line naming 03's setting), or None. ``taps`` /
    ``top_k`` 0: no convolution / no selector."""
    if taps and (hidden_size % group_size or taps > block_size):
        return (f"DFlash2's convolutions: conv_group_size {group_size} must divide the draft's hidden size "
                f"{hidden_size} and conv_kernel_size {taps} be at most block_size {block_size}: set "
                "conv_group_size / conv_kernel_size in 03_train")
    if top_k > vocab_size:
        return f"selector_top_k {top_k} exceeds the vocabulary ({vocab_size}): lower selector_top_k in 03_train"
    return None


def grouped_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """The causal grouped convolution within blocks. x [B, Q, H] block slots (Q = N*S, blocks of ``block_size``
    consecutive slots), delta [B, Q, taps, G] per-slot kernel offsets of each channel group, base [taps, H]."""
    B, Q, H = x.shape
    taps, G = base.shape[0], delta.shape[-1]
    xg = x.view(B, Q, G, H // G)  # shape: [B, Q, G, g]
    slot = torch.arange(Q, device=x.device) % block_size  # shape: [Q], the position inside each block
    out = torch.zeros_like(xg)
    for tap in range(taps):
        shifted = xg if tap == 0 else torch.cat([xg.new_zeros(B, tap, G, H // G), xg[:, :-tap]], 1)  # x[s - tap]
        coef = base[tap].view(G, H // G).to(x.dtype) + delta[:, :, tap, :, None]  # shape: [B, Q, G, g]
        out = out + shifted * coef * (slot >= tap).view(1, Q, 1, 1)
    return out.view(B, Q, H)


class GroupedConv(nn.Module):
    """The input- and output-side dynamic convolutions of one sublayer (vLLM's ``DFlashGroupedConv``)."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        self.taps, self.groups, self.block_size = taps, hidden_size // group_size, block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))  # shape: [2 sides, taps, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)
        with torch.no_grad():  # the identity: a fresh DFlash2 is a DFlash
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, Q, H] -> (x convolved by the input-side kernel [B, Q, H], the output side's delta [B, Q, taps, G])."""
        B, Q, _ = x.shape
        delta = self.kernel_projection(x).view(B, Q, 2, self.taps, self.groups)  # shape: [B, Q, 2, taps, G]
        return grouped_conv(x, delta[:, :, 0], self.base_kernel[0], self.block_size), delta[:, :, 1]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The sublayer's output y [B, Q, H] convolved by the output-side kernel (delta from ``prepare``)."""
        return grouped_conv(y, delta, self.base_kernel[1], self.block_size)


class CandidateSelector(nn.Module):
    """The low-rank path score over the unary top-k candidates (vLLM's and speculators' ``CandidateSelector``)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, init_std: float = 0.02):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * init_std)  # shape: [V, r]
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * init_std)  # shape: [V, r]
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=init_std)

    def scores(self, unary: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor, cand: torch.Tensor
               ) -> torch.Tensor:
        """unary [..., V] logits, hidden [..., H] the slot's state, prev [...] the token before the slot, cand [..., K]
        candidate ids -> their scores [..., K]: unary plus the bilinear transition."""
        ctx = self.predecessor_codebook[prev] * self.hidden_projection(hidden).to(self.predecessor_codebook.dtype)
        edge = (ctx[..., None, :] * self.successor_codebook[cand]).sum(-1)  # shape: [..., K]
        return unary.gather(-1, cand) + edge.to(unary.dtype)

    def logits(self, unary: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The slot's selection logits [..., V]: the top-k candidates' scores, -inf elsewhere (what vLLM's V2 runner
        caches as the draft's distribution for rejection sampling)."""
        cand = unary.topk(self.top_k, dim=-1).indices  # shape: [..., K]
        out = torch.full_like(unary, float("-inf"))
        return out.scatter(-1, cand, self.scores(unary, hidden, prev, cand))
