"""03_train throughput at a mid-size draft: training tokens/s, as achieved FLOP/s over this machine's matmul FLOP/s.

Config: hidden 512 (8 heads x 64), MLP 1536, target vocab 32000, draft vocab 8192, TTT 7 steps, micro-batches of
2 x 512 tokens, AdamW step included. FLOPs counted are the matmuls the step actually runs (forward + 2x for
backward): the linear layers at every TTT step, fc once, and the attention score/value products (step 0 causal
via SDPA, later steps against the step-0 keys plus the diagonal). The reference is a plain fp32 matmul of a
comparable shape, measured side by side in the same process with the same thread count.

    python benchmarks/bench_train.py
"""

from __future__ import annotations

import time

import torch

from eagle3nb.draft import Eagle3Config, Eagle3Draft
from eagle3nb.train.ttt import TTTObjective

H, HEADS, HEAD_DIM, INTER, V, VD, STEPS, B, T = 512, 8, 64, 1536, 32000, 8192, 7, 2, 512


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "aux": torch.randn(B, T, 3 * H, generator=g),
        "input_ids": torch.randint(0, V, (B, T), generator=g),
        "loss_mask": torch.ones(B, T, dtype=torch.int64),
        "target_argmax": torch.randint(0, VD, (B, T), generator=g),
        "target_probs": torch.softmax(torch.randn(B, T, VD, generator=g), -1),
    }


def train_flops_per_step() -> float:
    """Matmul FLOPs of one forward+backward over the micro-batch (backward = 2x forward)."""
    n = B * T
    linear = 2 * n * (2 * H * (HEADS + 2 * HEADS) * HEAD_DIM + HEADS * HEAD_DIM * H + 3 * H * INTER + H * VD)
    attn0 = 2 * 2 * B * HEADS * T * T * HEAD_DIM  # QK^T and AV of step 0 (SDPA computes the full square)
    attn_i = 2 * 2 * B * HEADS * T * T * HEAD_DIM  # each later step: against all step-0 keys (+ tiny diagonal)
    fwd = STEPS * linear + 2 * n * 3 * H * H + attn0 + (STEPS - 1) * attn_i
    return 3.0 * fwd


def matmul_flops_per_s(repeats: int = 20) -> float:
    a, b = torch.randn(B * T, H), torch.randn(H, VD)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * B * T * H * VD * repeats / (time.perf_counter() - t)


def main(iters: int = 2) -> None:
    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=H, intermediate_size=INTER, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                       head_dim=HEAD_DIM, vocab_size=V, draft_vocab_size=VD, aux_layer_ids=[2, 16, 29])
    draft = Eagle3Draft(cfg)
    draft.set_vocab(torch.arange(VD) * 3 - torch.arange(VD), torch.arange(V) % 3 == 0)
    objective = TTTObjective(draft, STEPS, 0.8)
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-4)
    data = batch()

    def step() -> None:
        loss, _ = objective(data)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up
    ref_before = matmul_flops_per_s()
    t = time.perf_counter()
    for _ in range(iters):
        step()
    dt = (time.perf_counter() - t) / iters
    ref = max(ref_before, matmul_flops_per_s())
    achieved = train_flops_per_step() / dt
    print(f"draft hidden {H}, draft vocab {VD}, TTT {STEPS}, micro-batch {B}x{T}, {torch.get_num_threads()} threads")
    print(f"training: {B * T / dt:,.0f} tokens/s ({dt:.2f} s/step)")
    print(f"achieved {achieved / 1e9:.1f} GFLOP/s vs matmul {ref / 1e9:.1f} GFLOP/s: ratio {achieved / ref:.2f}")


if __name__ == "__main__":
    main()
