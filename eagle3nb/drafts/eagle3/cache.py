"""The EAGLE-3 draft's attention over cached keys: ``DraftCache`` (decoding, one entry per position) and ``TTTCache``
(a training-time-test unroll: the causal step-0 keys plus each later step's diagonal), and ``sdpa``, the attention
both the model's layers and ``TTTCache``'s step 0 call. The ``# shape:`` letters are ``model``'s."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class DraftCache:
    """The midlayer's K/V while decoding: keys/values [B, kv_heads, length, head_dim], one entry per position.
    A deeper draft's later layers keep theirs in ``deeper`` (``layer(i)``), cropped and edited together."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.deeper: list[DraftCache] = []

    @classmethod
    def empty(cls, num_layers: int, like: torch.Tensor) -> "DraftCache":
        """A cache of ``num_layers`` layers holding zero positions, each ``like`` ([B, heads, 0, d]): rows can be
        merged into it before the first forward."""
        cache = cls()
        for c in [cache, *(cache.layer(i) for i in range(1, num_layers))]:
            c.k = c.v = like
        return cache

    def layer(self, i: int) -> "DraftCache":
        """Layer i's cache (0: this one), made on first use."""
        while len(self.deeper) < i:
            self.deeper.append(DraftCache())
        return self if i == 0 else self.deeper[i - 1]

    def layers(self) -> list["DraftCache"]:
        """Every layer's cache, layer 0 first."""
        return [self, *self.deeper]

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.length == 0:  # an empty cache (None, or zero positions of any width) takes the layer's widths
            self.k, self.v = k, v
            return self.k, self.v
        self.k = torch.cat([self.k, k], dim=2)
        self.v = torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, n: int) -> None:
        """Keep the first ``n`` positions (drop the K/V of rejected draft tokens), in every layer."""
        for c in self.layers():
            if c.k is not None:
                c.k, c.v = c.k[:, :, :n], c.v[:, :, :n]

    def map_kv(self, fn) -> None:
        """Every layer's keys and values become ``fn`` of them (``eagle3nb.verification.padded.PaddedKV``'s edits)."""
        for layer in self.layers():
            layer.k, layer.v = fn(layer.k), fn(layer.v)

    def zip_kv(self, other: "DraftCache", fn) -> None:
        """Every layer's keys and values become ``fn`` of them and ``other``'s (same depth), layer by layer."""
        for la, lb in zip(self.layers(), other.layers()):
            la.k, la.v = fn(la.k, lb.k), fn(la.v, lb.v)


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
        self.deeper: list[TTTCache] = []  # a deeper draft's later layers, each its own unroll

    def layer(self, i: int) -> "TTTCache":
        """Layer i's unroll (0: this one), made on first use with the same attention path."""
        while len(self.deeper) < i:
            self.deeper.append(TTTCache(self.dense))
        return self if i == 0 else self.deeper[i - 1]

    @property
    def steps(self) -> int:
        return 0 if self.k0 is None else 1 + len(self.ks)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None,
               ) -> torch.Tensor:
        """q [B, nh, T, d]; k, v [B, nh, T, d] (already expanded to the query heads)."""
        if self.k0 is None:
            self.k0, self.v0 = k, v
            return sdpa(q, k, v, attention_mask, past=0)
        self.ks.append(k)
        self.vs.append(v)
        T = q.shape[2]
        allowed = _causal(T, T, 0, q.device) if attention_mask is None else _as_bool_mask(attention_mask)  # [T, T]
        if self.dense if self.dense is not None else q.is_cuda:
            diagonal = torch.eye(T, dtype=torch.bool, device=q.device).expand_as(allowed)
            mask = torch.cat([allowed] + [diagonal] * len(self.ks), dim=-1)  # shape: [..., T, (1 + i) * T]
            keys, values = torch.cat([self.k0, *self.ks], dim=2), torch.cat([self.v0, *self.vs], dim=2)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)  # shape: [B, nh, T, d]
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores0 = (torch.matmul(q, self.k0.transpose(2, 3)) * scale).masked_fill(~allowed, float("-inf"))  # [B,nh,T,T]
        diag = torch.stack([(q * kj).sum(-1) for kj in self.ks], dim=-1) * scale  # shape: [B, nh, T, i]
        w = torch.softmax(torch.cat([scores0, diag], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)  # [B,nh,T,T+i]
        out = torch.matmul(w[..., :T], self.v0)  # shape: [B, nh, T, d]
        for j, vj in enumerate(self.vs):
            out = out + w[..., T + j, None] * vj  # position t's own key of step j+1
        return out


def _causal(tq: int, tk: int, past: int, device) -> torch.Tensor:
    """Query j (absolute position past+j) may see keys 0..past+j."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).tril(diagonal=past)


def _as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """Accept [B, Tq, Tk] or [B, 1, Tq, Tk] boolean (True = may attend) masks."""
    if mask.dtype != torch.bool:
        raise TypeError("attention_mask must be boolean (True = may attend)")
    return mask[:, None] if mask.dim() == 3 else mask


def sdpa(q, k, v, attention_mask, past: int) -> torch.Tensor:
    tq, tk = q.shape[2], k.shape[2]
    if attention_mask is not None:
        mask = _as_bool_mask(attention_mask)
    elif tq == 1:
        mask = None  # one new token sees everything cached before it
    else:
        mask = _causal(tq, tk, past, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
