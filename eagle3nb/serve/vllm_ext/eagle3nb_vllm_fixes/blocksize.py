"""vLLM's CPU attention declares KV blocks of 32 only, while its kernel computes blocks of 16 exactly.

vLLM 0.32's ``CPUAttentionBackend.get_supported_kernel_block_sizes`` returns ``[MultipleOf(32)]``, but its own
``_get_attn_isa`` sends a block size that is not a multiple of 32 to the ``vec16`` kernel (``neon`` on ARM), which
computes it exactly. The declaration alone decides what starts: the CPU MLA backend (``CPU_MLA``) takes blocks of 16
only, so an MLA target (DeepseekV3, Kimi-K2) beside any draft with ordinary attention (a Llama EAGLE-3 midlayer, a
Qwen3 DFlash block drafter) fails at start-up, "No common block size for 16". :func:`install` runs the kernel vLLM
picks for a block of 16 on a small paged cache (permuted blocks, a prefill and a decode request, grouped heads) in
each dtype the backend serves, causal and not (DFlash's block is not), against attention written out in PyTorch;
only if it is as exact there as at the 32 vLLM declares does it add 16 to the declaration, then asks vLLM again
whether it takes 16. One log line says which. vLLM reads the declaration through the class at each call.
"""

from __future__ import annotations

import torch

from eagle3nb_vllm_fixes.guard import NotFixed, log

_WRAPPED = "_eagle3nb_blocksize_fix"
WITHOUT = "an MLA target beside a draft with ordinary attention fails to start (no common KV block size for 16)"
BLOCK = 16  # the CPU MLA backend's only block size
DECLARED = 32  # the block vLLM's CPU attention declares (multiples of): the bar the probe holds 16 to
WRONG = 0.05  # an error no dtype's rounding explains (bfloat16's is ~8e-3 here, a wrong block read's ~1, outputs ~3)


def kernel_error(block_size: int = BLOCK, dtype: torch.dtype = torch.float32, causal: bool = True) -> float:
    """Max error of vLLM's CPU paged attention at ``block_size`` (the ISA vLLM picks for it and ``dtype``, its KV
    split as configured) against the formula in float32: two requests (a 37-token prefill, a 2-token step over 5
    cached), 4 query heads over 2 KV heads. ``vllm._custom_ops`` is read at each call (a test swaps a kernel)."""
    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, lens, q_lens = 4, 2, 64, (37, 5), (37, 2)
    isa = _get_attn_isa(dtype, block_size, dim)
    blocks = [-(-n // block_size) for n in lens]
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)  # shape: [requests, blocks]
    ids = torch.randperm(sum(blocks), generator=g) + 1  # block 0 stays unused: a wrong lookup reads zeros
    for r, (n, start) in enumerate(zip(blocks, [0, blocks[0]])):
        table[r, :n] = ids[start:start + n]
    cache = torch.zeros(sum(blocks) + 1, kv_heads, 2 * block_size, dim, dtype=dtype)  # shape: [blocks, KH, 2B, D]
    key_cache, value_cache = cache.chunk(2, dim=2)  # vLLM's own view of its [blocks, KH, B, 2D] cache
    k = [torch.randn(n, kv_heads, dim, generator=g).to(dtype) for n in lens]  # shape: [len, KH, D] each
    v = [torch.randn(n, kv_heads, dim, generator=g).to(dtype) for n in lens]
    q = [torch.randn(n, heads, dim, generator=g).to(dtype) for n in q_lens]  # shape: [q_len, H, D] each
    slots = torch.cat([table[r, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
                       for r, n in enumerate(lens)])  # shape: [sum(lens)]
    ops.cpu_attn_reshape_and_cache(torch.cat(k), torch.cat(v), key_cache, value_cache, slots, isa)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=len(lens), num_heads=heads, num_kv_heads=kv_heads,
                                               head_dim=dim, seq_lens=seq_lens, dtype=dtype, query_start_loc=starts,
                                               causal=causal, sliding_window_size=-1, isa=isa,
                                               enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
    out = torch.zeros(sum(q_lens), heads, dim, dtype=dtype)  # shape: [tokens, H, D]
    ops.cpu_attention_with_kv_cache(query=torch.cat(q), key_cache=key_cache, value_cache=value_cache, output=out,
                                    query_start_loc=starts, seq_lens=seq_lens, scale=dim ** -0.5, causal=causal,
                                    alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
                                    scheduler_metadata=meta, s_aux=None)
    want = []
    for qr, kr, vr, n, m in zip(q, k, v, lens, q_lens):
        kr, vr = kr.float().repeat_interleave(heads // kv_heads, 1), vr.float().repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", qr.float(), kr) * dim ** -0.5  # shape: [H, q_len, len]
        seen = torch.arange(n)[None, :] <= torch.arange(n - m, n)[:, None] if causal else torch.ones(m, n, dtype=bool)
        want.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), vr))
    return float((out.float() - torch.cat(want)).abs().max())


def probe() -> dict[str, tuple[float, float]]:
    """:func:`kernel_error` at :data:`BLOCK` and at :data:`DECLARED` for each dtype the backend serves, causal and
    not, by case (``float32``, ``bfloat16 non-causal``, ...)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return {f"{str(dt).removeprefix('torch.')}{'' if causal else ' non-causal'}":
            (kernel_error(BLOCK, dt, causal), kernel_error(DECLARED, dt, causal))
            for dt in CPUAttentionBackend.supported_dtypes for causal in (True, False)}


def check_and_fix() -> str:
    """Declare :data:`BLOCK` beside vLLM's multiples of 32 when it does not and its kernel computes that block, in
    every case of :func:`probe`, as exactly as 32 (within 2x, plus float32's noise floor) and within :data:`WRONG`;
    the line logged."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    if CPUAttentionBackend.supports_block_size(BLOCK):
        return log("blocksize", f"vLLM's CPU attention takes KV blocks of {BLOCK}; left alone")
    cases = probe()
    case = max(cases, key=lambda c: cases[c][0] / (2 * cases[c][1] + 1e-6))  # the worst against 32
    error, declared = cases[case]
    if error > 2 * declared + 1e-6 or max(e for e, _ in cases.values()) > WRONG:
        return log("blocksize", f"vLLM's CPU attention kernel is wrong at KV blocks of {BLOCK} (max error by case "
                                f"at {BLOCK} / {DECLARED}: "
                                f"{', '.join(f'{c} {e:.1e} / {d:.1e}' for c, (e, d) in cases.items())}); "
                                "its declaration left alone")
    stock = CPUAttentionBackend.__dict__.get("get_supported_kernel_block_sizes")  # None: inherited
    sizes = [BLOCK, *CPUAttentionBackend.get_supported_kernel_block_sizes()]

    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return sizes

    setattr(get_supported_kernel_block_sizes, _WRAPPED, True)
    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(get_supported_kernel_block_sizes)
    if not CPUAttentionBackend.supports_block_size(BLOCK):
        if stock is None:
            del CPUAttentionBackend.get_supported_kernel_block_sizes
        else:
            CPUAttentionBackend.get_supported_kernel_block_sizes = stock
        raise NotFixed(f"vLLM's CPU attention still refuses KV blocks of {BLOCK} after declaring them (its check "
                       "reads something else now); its declaration put back")
    return log("blocksize", f"vLLM's CPU attention declared KV blocks of {DECLARED} only, its kernel computes "
                            f"blocks of {BLOCK} as exactly ({len(cases)} cases, worst {case}: max error {error:.1e}, "
                            f"{declared:.1e} at {DECLARED}): it now takes {BLOCK} too, so an MLA target serves beside "
                            "a draft with ordinary attention")


def install() -> None:
    """On a CPU, :func:`check_and_fix` once per process; any other platform is left untouched."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        log("blocksize", f"{current_platform.device_name} platform, not a CPU; left alone")
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    if getattr(CPUAttentionBackend.get_supported_kernel_block_sizes, _WRAPPED, False):
        return
    check_and_fix()
