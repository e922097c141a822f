"""vLLM's CPU rotary kernel on 3-D or strided views: hand it contiguous 2-D copies.

vLLM 0.32's CPU ``torch.ops._C.rotary_embedding`` (called by ``RotaryEmbedding.forward_cpu`` through
``vllm._custom_ops.rotary_embedding`` whenever the ``rotary_embedding`` custom op is on, e.g. ``--enforce-eager``)
reads its query and key as 2-D ``[tokens, heads * head_size]``: the token stride is ``stride(-2)`` and the head
count ``size(-1) / head_size``. A 3-D view breaks both: MLA (``layers/mla.py``) passes the query's rope part
``[T, H, 64]`` (strides ``(H * 192, 192, 1)``) and ``k_pe`` ``[T, 1, 64]`` sliced from the 576-wide latent, so the
kernel rotates the wrong rows at the wrong positions and writes into the latent ``kv_c``. Position 0's rotation is
the identity, so only later positions are wrong. A 2-D view with unit last stride (Llama's ``qkv.split``) is
read right and passes through untouched. ``forward_cpu`` (and every other caller in vLLM 0.32) looks the function up
in ``vllm._custom_ops`` at each call, so replacing it there reaches them all (docs/vllm.md "Callers that bound it").
"""

from __future__ import annotations

import torch

from eagle3nb_vllm_fixes.guard import NotFixed, log

WITHOUT = "MLA targets (DeepseekV3, Kimi-K2) rotate queries and keys at the wrong positions: wrong tokens"
EXACT = 1e-5  # float32's noise on the probe's tensors; a misread rotation errs by ~1


def _readable(x: torch.Tensor | None) -> bool:
    """Whether the CPU kernel reads ``x`` right: 2-D, unit last stride (any token stride)."""
    return x is None or (x.dim() == 2 and x.stride(-1) == 1)


def _native(positions: torch.Tensor, x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """The rotary formula in PyTorch (neox style, full rotary dim): the probe's reference."""
    cos, sin = cache[positions].chunk(2, dim=-1)  # shape: [T, rot/2] each
    cos, sin = cos[:, None], sin[:, None]  # shape: [T, 1, rot/2]
    a, b = x.chunk(2, dim=-1)  # shape: [T, H, rot/2] each
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


def _probe(kernel) -> float:
    """Max error of ``kernel`` on MLA's layout (a 3-D view of a wider tensor, positions past 0) against the formula,
    over the whole tensors (a write outside the views counts)."""
    g = torch.Generator().manual_seed(0)
    rot, tokens, heads = 8, 3, 2
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.outer(torch.arange(8, dtype=torch.float32), inv)  # shape: [8, rot/2]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # shape: [8, rot]
    positions = torch.arange(1, tokens + 1)
    q = torch.randn(tokens, heads, 2 * rot, generator=g)  # shape: [T, H, nope + rot]
    kv = torch.randn(tokens, 3 * rot, generator=g)  # shape: [T, latent + rot]
    want_q, want_kv = q.clone(), kv.clone()  # the untouched columns (q's nope, the latent) must stay as they were
    want_q[..., rot:] = _native(positions, q[..., rot:], cache)
    want_kv[:, None, 2 * rot:] = _native(positions, kv[:, None, 2 * rot:], cache)
    kernel(positions, q[..., rot:], kv[:, None, 2 * rot:], rot, cache, True)  # in place, through the views
    return max(float((q - want_q).abs().max()), float((kv - want_kv).abs().max()))


def _wrap(kernel):
    """``kernel`` taking any layout: a tensor it would misread goes in as a contiguous 2-D clone (``contiguous()``
    may alias a decode step's view, and the write-back must not read what the kernel wrote) and is copied back."""

    def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None, head_size: int,
                         cos_sin_cache: torch.Tensor, is_neox: bool, *args, **kwargs) -> None:
        if _readable(query) and _readable(key):
            return kernel(positions, query, key, head_size, cos_sin_cache, is_neox, *args, **kwargs)
        tokens = positions.numel()
        q2 = query if _readable(query) else query.reshape(tokens, -1).clone()  # shape: [T, H * head_size]
        k2 = key if _readable(key) else key.reshape(tokens, -1).clone()  # shape: [T, KH * head_size]
        kernel(positions, q2, k2, head_size, cos_sin_cache, is_neox, *args, **kwargs)
        if q2 is not query:
            query.copy_(q2.view(query.shape))
        if k2 is not key:
            key.copy_(k2.view(key.shape))

    rotary_embedding.eagle3nb_wrapped = kernel
    return rotary_embedding


def install() -> None:
    """On a CPU, probe vLLM's rotary kernel on MLA's layout; wrap it where it misreads, then probe the wrapper (a
    wrapper that does not hold is undone: :class:`NotFixed`). One log line either way."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        log("rotary", f"{current_platform.device_name} platform, not a CPU; left alone")
        return
    from vllm import _custom_ops as ops

    kernel = ops.rotary_embedding
    if hasattr(kernel, "eagle3nb_wrapped"):
        return
    error = _probe(kernel)
    if error < EXACT:
        log("rotary", f"vLLM's CPU rotary kernel reads 3-D strided views right (max error {error:.1e}); left alone")
        return
    ops.rotary_embedding = _wrap(kernel)
    fixed = _probe(ops.rotary_embedding)
    if not fixed < EXACT:  # NaN (a kernel that wrote nothing into empty memory) fails too
        ops.rotary_embedding = kernel
        raise NotFixed(f"the CPU rotary kernel misreads 3-D strided views (max error {error:.2f}) and still does "
                       f"through 2-D copies ({fixed:.1e}); vLLM's own kernel put back")
    log("rotary", f"vLLM's CPU rotary kernel misreads 3-D strided views (max error {error:.2f}; {fixed:.1e} through "
                  "the fix): it now gets contiguous 2-D copies")
