"""vLLM's CPU ``rms_norm`` with one weight row per group applies the first row to every group.

vLLM 0.32's DFlash draft (``model_executor/models/qwen3_dflash.py``, ``_normalize_context_k``) normalises the
context keys of all its layers in one call: input ``[L, tokens, kv_heads, head_dim]``, the layers' ``k_norm``
weights stacked ``[L, head_dim]``, "the weight selected per layer by the outermost index". The CPU kernel behind
``vllm._custom_ops.rms_norm`` reads only the first row, so every layer after the first attends to context keys
normalised with layer 0's ``k_norm``: a DFlash draft of two or more layers proposes slightly different blocks than
it was trained to (greedy output stays the target's; acceptance moves: 1.685 against 1.709 on the smoke toy's
trained 2-layer draft). :func:`install` runs the kernel on two groups with different weights against the formula
and, only if it is wrong, makes a grouped call run one group at a time through the same kernel. One log line
says which. ``qwen3_dflash`` (and every other caller in vLLM 0.32) looks ``ops.rms_norm`` up at each call, so
replacing it in ``vllm._custom_ops`` reaches them all (docs/vllm.md "Callers that bound it").
"""

from __future__ import annotations

import torch

from eagle3nb_vllm_fixes.guard import NotFixed, log

_WRAPPED = "eagle3nb_wrapped"
WITHOUT = "a DFlash draft of 2+ layers normalises every layer's context keys with layer 0's weights"
EXACT = 1e-5  # float32's noise on the probe's tensors; the first row applied to all errs by ~0.1


def grouped_error(kernel) -> float:
    """Max error of ``kernel(out, x, weight, eps)`` with a weight row per group against RMSNorm written out: x
    ``[2, 3, 2, 8]`` (groups, tokens, heads, dim), weights ``[2, 8]`` drawn apart (the second group's row differs)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 2, 8, generator=g)  # shape: [groups, tokens, heads, dim]
    weight = torch.rand(2, 8, generator=g) + 0.5  # shape: [groups, dim]
    eps = 1e-6
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight[:, None, None, :]
    out = torch.empty_like(x)
    kernel(out, x, weight, eps)
    return float((out - want).abs().max())


def _wrap(kernel):
    """``kernel`` with a grouped weight ``[G, dim]`` run once per group (input and output ``[G, ...]``); a 1-D
    weight passes through untouched."""

    def rms_norm(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor | None, epsilon: float) -> None:
        if weight is None or weight.dim() < 2:
            return kernel(out, input, weight, epsilon)
        for i in range(weight.shape[0]):
            kernel(out[i], input[i], weight[i].contiguous(), epsilon)

    setattr(rms_norm, _WRAPPED, kernel)
    return rms_norm


def install() -> None:
    """On a CPU, probe ``rms_norm`` with grouped weights; wrap it where it ignores all but the first row, then probe
    the wrapper (a wrapper that does not hold is undone: :class:`NotFixed`)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        log("grouped_norm", f"{current_platform.device_name} platform, not a CPU; left alone")
        return
    from vllm import _custom_ops as ops

    kernel = ops.rms_norm
    if hasattr(kernel, _WRAPPED):
        return
    error = grouped_error(kernel)
    if error < EXACT:
        log("grouped_norm", f"vLLM's CPU rms_norm applies each group's weight row (max error {error:.1e}); left alone")
        return
    ops.rms_norm = _wrap(kernel)
    fixed = grouped_error(ops.rms_norm)
    if not fixed < EXACT:  # NaN (a kernel that wrote nothing into empty memory) fails too
        ops.rms_norm = kernel
        raise NotFixed(f"the CPU rms_norm ignores all but the first weight row (max error {error:.2f}) and still "
                       f"errs one group at a time ({fixed:.1e}); vLLM's own kernel put back")
    log("grouped_norm", f"vLLM's CPU rms_norm applied the first weight row to every group (max error {error:.2f}; "
                        f"DFlash's context keys of layers after the first); it now runs one group at a time "
                        f"({fixed:.1e})")
