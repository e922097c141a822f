"""The lost temperature of vLLM's CPU rejection sampler: ``_expand`` fixed where, and only where, it is broken.

vLLM 0.32's rejection sampler expands each request's temperature (and top-k, top-p) to its draft tokens with
``expand_batch_to_tokens``: a ``new_empty`` buffer filled by the ``expand_kernel`` Triton kernel. On a CPU without
Triton, the platform swaps that kernel for ``cpu_triton_utils._expand_kernel_impl``, which hands the C++ kernel
``_ensure_int64(output)``: for a float32 (or int32) buffer a new int64 copy, written and dropped. The buffer stays
uninitialised, the target's logits are divided by garbage, and at T > 0 almost every draft token is rejected
(docs/upstream/vllm-cpu-expand-loses-temperature.md). Greedy requests skip this path.

A worker loads general plugins *before* ``current_platform.register_triton_kernel_overrides()`` swaps the kernels, so
:func:`install` wraps that registration: once the platform's overrides are in, it runs ``_expand`` into a float buffer
of -7 and, only if the result is wrong, registers :func:`expand` for the kernel through vLLM's own dispatcher (which
rebinds every module holding the kernel), then runs the probe again. One log line says which.
"""

from __future__ import annotations

import torch

from eagle3nb_vllm_fixes.guard import NotFixed, guarded, log

KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"
_WRAPPED = "_eagle3nb_sampling_fix"
WITHOUT = "at T > 0 speculative decoding rejects almost every draft token (temperature and top-p lost)"


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


def check_and_fix() -> str:
    """Test ``_expand``; where it is broken, register :func:`expand` for its kernel and test again (a fix that
    does not hold is undone: the platform's kernel registered back, :class:`NotFixed` raised). The line logged."""
    from vllm.triton_utils.dispatcher import register_kernels
    from vllm.v1.sample import rejection_sampler

    if not expand_is_broken():
        return log("sampling", "vLLM's _expand keeps float values here; left alone")
    before = getattr(rejection_sampler.expand_kernel, "func", None)  # the platform's implementation
    register_kernels({KERNEL: expand})
    if expand_is_broken():
        if before is not None:
            register_kernels({KERNEL: before})
        raise NotFixed("_expand still loses float values through the registered fix (the platform's kernel put "
                       "back)")
    return log("sampling", "vLLM's CPU _expand lost float values (temperature, top-p at T>0 in rejection "
                           "sampling); replaced with a dtype-preserving expand")


def install() -> None:
    """On a CPU platform, make its kernel-override registration run :func:`check_and_fix` right after it (once per
    process, however often plugins load), guarded as :func:`register` is; any other platform is left untouched.
    The names the check needs are looked up here first, so a vLLM without them skips the fix at start-up."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        log("sampling", f"{current_platform.device_name} platform, not a CPU; left alone")
        return
    from vllm.triton_utils.dispatcher import register_kernels  # noqa: F401 (present, or the fix is skipped)
    from vllm.v1.sample.rejection_sampler import _expand, expand_kernel  # noqa: F401

    platform_cls = type(current_platform)
    register = platform_cls.register_triton_kernel_overrides
    if getattr(register, _WRAPPED, False):
        return

    def register_then_fix(cls: type) -> None:
        register()
        guarded("sampling", check_and_fix, WITHOUT)

    setattr(register_then_fix, _WRAPPED, True)
    platform_cls.register_triton_kernel_overrides = classmethod(register_then_fix)
