"""The lost temperature of vLLM's CPU rejection sampler: ``_expand`` fixed where, and only where, it is broken.

vLLM 0.32's rejection sampler expands each request's temperature (and top-k, top-p) to its draft tokens with
``expand_batch_to_tokens``: a ``new_empty`` buffer filled by the ``expand_kernel`` Triton kernel. On a CPU without
Triton, the platform swaps that kernel for ``cpu_triton_utils._expand_kernel_impl``, which hands the C++ kernel
``_ensure_int64(output)``: for a float32 (or int32) buffer a new int64 copy, written and dropped. The buffer stays
uninitialised, the target's logits are divided by garbage, and at T > 0 almost every draft token is rejected
(docs/upstream/vllm-cpu-expand-loses-temperature.md). Greedy requests skip this path.

A worker loads general plugins *before* ``current_platform.register_triton_kernel_overrides()`` swaps the kernels, so
:func:`install` wraps that registration: once the platform's overrides are in, it runs ``_expand`` into a float buffer
of -7 and, only if the result is wrong, registers :func:`expand` for the kernel. One log line says which.
"""

from __future__ import annotations

import torch

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
_WRAPPED = "_eagle3nb_sampling_fix"


def expand(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from: float,
           replace_to: float, MAX_NUM_TOKENS: int | None = None) -> None:  # noqa: N803 (the kernel's own name)
    """``expand_kernel``'s contract in PyTorch, in ``output``'s own dtype: request i's value (``replace_from``
    replaced by ``replace_to``) on each of its tokens, ``cu_num_tokens`` being the cumulative token counts."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())  # shape: [batch]
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype),
                         input_val)  # shape: [batch]
    expanded = values.repeat_interleave(counts)  # shape: [sum(counts)]
    output[: expanded.numel()] = expanded.to(output.dtype)


def expand_is_broken() -> bool:
    """Whether vLLM's ``_expand``, as the platform registered it, loses a float value: two requests (0.5 on one
    token, 2.0 on two) expanded into a buffer of -7 must read 0.5, 2, 2 (the stock CPU fallback leaves -7)."""
    from vllm.v1.sample.rejection_sampler import _expand

    out = torch.full((3,), -7.0)  # shape: [tokens]
    _expand(out, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), 0, 1)
    return not torch.equal(out, torch.tensor([0.5, 2.0, 2.0]))


def _log(line: str) -> str:
    from vllm.logger import init_logger

    init_logger("vllm.eagle3nb_vllm_fixes.sampling").info(line)
    return line


def check_and_fix() -> str:
    """Test ``_expand`` and register :func:`expand` for its kernel when it is broken; the line it logged."""
    from vllm.triton_utils.dispatcher import register_kernels

    if not expand_is_broken():
        line = "eagle3nb_vllm_fixes.sampling: vLLM's _expand keeps float values here; left alone"
    else:
        register_kernels({KERNEL: expand})
        if expand_is_broken():
            raise RuntimeError("eagle3nb_vllm_fixes.sampling: _expand is still wrong after the fix was registered")
        line = ("eagle3nb_vllm_fixes.sampling: vLLM's CPU _expand lost float values (temperature, top-p at T>0 in "
                "rejection sampling); replaced with a dtype-preserving expand")
    return _log(line)


def install() -> None:
    """On a CPU platform, make its kernel-override registration run :func:`check_and_fix` right after it (once per
    process, however often plugins load); any other platform (a GPU) is left untouched."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        _log(f"eagle3nb_vllm_fixes.sampling: {current_platform.device_name} platform, not a CPU; left alone")
        return
    platform_cls = type(current_platform)
    register = platform_cls.register_triton_kernel_overrides
    if getattr(register, _WRAPPED, False):
        return

    def register_then_fix(cls: type) -> None:
        register()
        check_and_fix()

    setattr(register_then_fix, _WRAPPED, True)
    platform_cls.register_triton_kernel_overrides = classmethod(register_then_fix)
