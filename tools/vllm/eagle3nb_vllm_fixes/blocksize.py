"""vLLM's CPU attention declares KV blocks of 32 only, while its kernel computes blocks of 16 exactly.

vLLM 0.32's ``CPUAttentionBackend.get_supported_kernel_block_sizes`` returns ``[MultipleOf(32)]``, but its own
``_get_attn_isa`` sends a block size that is not a multiple of 32 to the ``vec16`` kernel, which computes it
exactly. The declaration alone decides what starts: the CPU MLA backend (``CPU_MLA``) takes blocks of 16 only, so
an MLA target (DeepseekV3, Kimi-K2) beside any draft with ordinary attention (a Llama EAGLE-3 midlayer, a Qwen3
DFlash block drafter) fails at start-up, "No common block size for 16". :func:`install` runs the kernel at a block
of 16 on a small paged cache (permuted blocks, a prefill and a decode request, grouped heads) against attention
written out in PyTorch and, only if it matches, declares multiples of 16. One log line says which.
"""

from __future__ import annotations

import torch

_WRAPPED = "_eagle3nb_blocksize_fix"


def _log(line: str) -> str:
    from vllm.logger import init_logger

    init_logger("vllm.eagle3nb_vllm_fixes.blocksize").info(line)
    return line


def kernel_error(block_size: int = 16) -> float:
    """Max error of vLLM's CPU paged attention at ``block_size`` (float32, the ISA vLLM picks for it) against the
    formula: two requests (a 37-token prefill, a 2-token step over 5 cached), 4 query heads over 2 KV heads."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, lens, q_lens = 4, 2, 64, (37, 5), (37, 2)
    isa = _get_attn_isa(torch.float32, block_size, dim)
    blocks = [-(-n // block_size) for n in lens]
    table = torch.zeros(len(lens), max(blocks), dtype=torch.int32)  # shape: [requests, blocks]
    ids = torch.randperm(sum(blocks), generator=g) + 1  # block 0 stays unused: a wrong lookup reads zeros
    for r, (n, start) in enumerate(zip(blocks, [0, blocks[0]])):
        table[r, :n] = ids[start:start + n]
    cache = torch.zeros(sum(blocks) + 1, kv_heads, 2 * block_size, dim)  # shape: [blocks, KH, 2 * block, D]
    key_cache, value_cache = cache.chunk(2, dim=2)
    k = [torch.randn(n, kv_heads, dim, generator=g) for n in lens]  # shape: [len, KH, D] each
    v = [torch.randn(n, kv_heads, dim, generator=g) for n in lens]
    q = [torch.randn(n, heads, dim, generator=g) for n in q_lens]  # shape: [q_len, H, D] each
    slots = torch.cat([table[r, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
                       for r, n in enumerate(lens)])  # shape: [sum(lens)]
    ops.cpu_attn_reshape_and_cache(torch.cat(k), torch.cat(v), key_cache, value_cache, slots, isa)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    starts = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=len(lens), num_heads=heads, num_kv_heads=kv_heads,
                                               head_dim=dim, seq_lens=seq_lens, dtype=torch.float32,
                                               query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
                                               enable_kv_split=False)
    out = torch.zeros(sum(q_lens), heads, dim)  # shape: [tokens, H, D]
    ops.cpu_attention_with_kv_cache(query=torch.cat(q), key_cache=key_cache, value_cache=value_cache, output=out,
                                    query_start_loc=starts, seq_lens=seq_lens, scale=dim ** -0.5, causal=True,
                                    alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
                                    scheduler_metadata=meta, s_aux=None)
    want = []
    for qr, kr, vr, n, m in zip(q, k, v, lens, q_lens):
        kr, vr = kr.repeat_interleave(heads // kv_heads, 1), vr.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", qr, kr) * dim ** -0.5  # shape: [H, q_len, len]
        seen = torch.arange(n)[None, :] <= torch.arange(n - m, n)[:, None]  # shape: [q_len, len]: causal
        want.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), vr))
    return float((out - torch.cat(want)).abs().max())


def check_and_fix() -> str:
    """Declare blocks of 16 for vLLM's CPU attention when it does not and its kernel computes them; the line
    logged."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    if CPUAttentionBackend.supports_block_size(16):
        return _log("eagle3nb_vllm_fixes.blocksize: vLLM's CPU attention takes KV blocks of 16; left alone")
    error = kernel_error(16)
    if error > 1e-4:
        return _log(f"eagle3nb_vllm_fixes.blocksize: vLLM's CPU attention kernel is wrong at KV blocks of 16 (max "
                    f"error {error:.2e}); its declared multiples of 32 left alone")

    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    setattr(get_supported_kernel_block_sizes, _WRAPPED, True)
    CPUAttentionBackend.get_supported_kernel_block_sizes = staticmethod(get_supported_kernel_block_sizes)
    return _log(f"eagle3nb_vllm_fixes.blocksize: vLLM's CPU attention declared KV blocks of 32 only, its kernel "
                f"computes blocks of 16 (max error {error:.1e}): it now takes multiples of 16, so an MLA target "
                "(blocks of 16) serves beside a draft with ordinary attention")


def install() -> None:
    """On a CPU, :func:`check_and_fix` once per process; any other platform is left untouched."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        _log(f"eagle3nb_vllm_fixes.blocksize: {current_platform.device_name} platform, not a CPU; left alone")
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    if getattr(CPUAttentionBackend.get_supported_kernel_block_sizes, _WRAPPED, False):
        return
    check_and_fix()
