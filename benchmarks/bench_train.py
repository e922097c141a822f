"""03_train throughput at a mid-size draft, measured so it can be trusted on a shared machine.

Config: hidden 512 (8 heads x 64), MLP 1536, target vocab 32000, draft vocab 8192, TTT 7 steps, one micro-batch of
2 x 512 tokens, forward + backward + grad clip + AdamW step.

- Threads: fixed (``--threads``, default 1) for the step and the reference alike. On a 2-core machine shared with
  other jobs, 2 OpenMP threads make every element-wise op wait for a descheduled sibling (measured here: a 0.5M
  element mul 0.15 ms at 1 thread, 2-16 ms at 2), which is why single runs once read 0.24 on one machine and 0.79
  on another.
- Repeats: ``--warmup`` untimed steps, then ``--repeats`` timed steps; each is followed by one pass of the
  reference, so a load change hits both. Median and spread (min..max) of step time, reference time and ratio.
- FLOPs: counted as computed, per module (``matmuls``): fc once (backward: weight gradient only, its input is
  data), per TTT step q/k/v/o, MLP and lm_head over all B x T positions (backward: input + weight gradients), the
  attention as ``TTTCache`` computes it (step 0: the CPU flash kernel, full square with an explicit mask, causal
  blocks only with ``is_causal``; steps >= 1: the step-0 score and value products over the full T x T square plus
  the element-wise diagonal), and the loss' vocab-side element-wise work (``VOCAB_FLOPS`` per position and draft
  vocab entry). The optimizer's few element-wise FLOPs per weight are not counted (< 0.1%).
- Reference: the same matmul shapes, the same number of times, as plain ``torch.matmul`` in this process. The ratio
  achieved FLOP/s / matmul FLOP/s = (reference time x counted / matmul FLOPs) / step time: it does not depend on
  how fast the machine is, only on how much of the step is matmul at full speed.
- Where the time goes: ``torch.profiler`` on one more step, the top 8 ops by self CPU time.

    python -m benchmarks.bench_train [--threads 1] [--repeats 5] [--warmup 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from benchmarks.harness import THREADS, command_line, median_span, parse
from eagle3nb.drafts.eagle3.model import Eagle3Config, Eagle3Draft
from eagle3nb.drafts.eagle3.objective import TTTObjective

H, HEADS, HEAD_DIM, INTER, V, VD, STEPS, B, T = 512, 8, 64, 1536, 32000, 8192, 7, 2, 512
GOAL = 0.6
STEP0_CAUSAL = False  # cache.sdpa passes step 0 an explicit causal mask: the flash kernel scores the full square
# Per (position, draft-vocab entry) and TTT step, forward: max, subtract, exp, sum (logsumexp), multiply-add with
# the target probabilities; backward: exp, scale, subtract, scale. ~10 element-wise FLOPs.
VOCAB_FLOPS = 10


def batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "aux": torch.randn(B, T, 3 * H, generator=g),
        "input_ids": torch.randint(0, V, (B, T), generator=g),
        "loss_mask": torch.ones(B, T, dtype=torch.int64),
        "target_argmax": torch.randint(0, VD, (B, T), generator=g),
        "target_probs": torch.softmax(torch.randn(B, T, VD, generator=g), -1),
    }


def causal_keys(t: int) -> int:
    """Query x key pairs the CPU flash-attention kernel scores with ``is_causal``: query blocks of 64 rows (its split
    for 192 <= T < 768; 256 from 768, 32 below 192), each against keys 0..end of its block."""
    qs = 256 if t >= 768 else 64 if t >= 192 else 32
    return sum(min(m + qs, t) * min(qs, t - m) for m in range(0, t, qs))


def matmuls(step0_causal: bool) -> list[tuple[str, int, int, int, int, int]]:
    """Every matmul of one training step as (module, batch, m, k, n, times): forward and backward products."""
    n, qkv = B * T, HEADS * HEAD_DIM
    out: list[tuple[str, int, int, int, int, int]] = [
        ("fc", 1, n, 3 * H, H, 1), ("fc", 1, H, n, 3 * H, 1),  # forward, weight gradient
    ]

    def linear(name: str, k: int, m: int, count: int) -> None:  # x[n,k] @ W[k,m], grad input, grad weight
        out.extend([(name, 1, n, k, m, count), (name, 1, n, m, k, count), (name, 1, m, n, k, count)])

    linear("q/k/v", 2 * H, qkv, 3 * STEPS)
    linear("o", qkv, H, STEPS)
    linear("mlp", H, INTER, 2 * STEPS)
    linear("mlp", INTER, H, STEPS)
    linear("lm_head", H, VD, STEPS)
    bh = B * HEADS
    # step 0, flash kernel: forward Q K^T, P V; backward recomputes Q K^T, then dV, dP, dQ, dK: 7 products
    keys = causal_keys(T) if step0_causal else T * T
    out.append(("attn step 0", bh, keys // T, HEAD_DIM, T, 7))  # [keys/T x d] @ [d x T]: keys x d MACs
    # steps >= 1: scores Q K0^T and W V0 over the full square; backward: dQ, dK0, dW, dV0
    out.append(("attn steps 1+", bh, T, HEAD_DIM, T, 6 * (STEPS - 1)))
    return out


def elementwise_flops() -> int:
    """The counted non-matmul work: the loss over the T-1-i positions with a target, the diagonal attention."""
    vocab = sum(B * (T - 1 - i) * VD * VOCAB_FLOPS for i in range(STEPS))
    diagonal = sum(3 * 2 * B * HEADS * T * HEAD_DIM * i for i in range(1, STEPS))  # scores, values, backward
    return vocab + diagonal


def reference_seconds(shapes: list[tuple[str, int, int, int, int, int]]) -> float:
    """Wall time of the step's matmuls as plain torch.matmul of the same shapes, the same number of times."""
    g = torch.Generator().manual_seed(1)
    total = 0.0
    for _, b, m, k, n, times in shapes:
        a = torch.randn(b, m, k, generator=g).squeeze(0)
        w = torch.randn(b, k, n, generator=g).squeeze(0)
        torch.matmul(a, w)
        t = time.perf_counter()
        for _ in range(times):
            torch.matmul(a, w)
        total += time.perf_counter() - t
    return total


def spread(xs: list[float], fmt: str) -> str:
    return f"median {median_span(xs, fmt)}, n={len(xs)}"


def parser() -> argparse.ArgumentParser:
    ap = command_line(__doc__)
    ap.add_argument("--threads", **THREADS)
    ap.add_argument("--repeats", type=int, default=5, help="timed steps (each followed by one reference pass)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--no-profile", action="store_true", help="skip the torch.profiler step")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(parser(), argv)
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

    shapes = matmuls(STEP0_CAUSAL)
    mm_flops = sum(2 * b * m * k * n * times for _, b, m, k, n, times in shapes)
    flops = mm_flops + elementwise_flops()
    for _ in range(args.warmup):
        step()
    steps, refs = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        step()
        steps.append(time.perf_counter() - t)
        refs.append(reference_seconds(shapes))
    ratios = [r * flops / mm_flops / s for s, r in zip(steps, refs)]

    print(f"draft hidden {H}, MLP {INTER}, draft vocab {VD}, TTT {STEPS}, micro-batch {B}x{T}; "
          f"{torch.get_num_threads()} thread(s), {args.warmup} warm-up, {args.repeats} repeats")
    by_module: dict[str, int] = {}
    for name, b, m, k, n, times in shapes:
        by_module[name] = by_module.get(name, 0) + 2 * b * m * k * n * times
    print("FLOPs per step (fwd+bwd): " + ", ".join(f"{k} {v / 1e9:.1f}G" for k, v in by_module.items())
          + f", element-wise {elementwise_flops() / 1e9:.2f}G; total {flops / 1e9:.1f} GFLOP")
    print(f"step time, s:      {spread(steps, '.2f')}  ->  {B * T / statistics.median(steps):,.0f} tokens/s")
    print(f"reference time, s: {spread(refs, '.2f')}  (the same matmuls as plain torch.matmul)")
    med_s, med_r = statistics.median(steps), statistics.median(refs)
    print(f"achieved {flops / med_s / 1e9:.1f} GFLOP/s vs matmul {mm_flops / med_r / 1e9:.1f} GFLOP/s")
    print(f"ratio achieved/matmul: {spread(ratios, '.2f')}   goal >= {GOAL}: "
          f"{'met' if statistics.median(ratios) >= GOAL else 'NOT met'}")
    if not args.no_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        print("where one step's time goes (top 8 ops by self CPU time):")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))


if __name__ == "__main__":
    main()
