"""Is a T=1 gap between our decoder and vLLM noise? One recipe's seed-0 draft, trained as bench_recipes.py trains
it, decoded by our decoder at T=1 over many sets of per-prompt seeds (``bench_recipes.Local`` uses one: prompt i
seeded i), and served by the real vLLM (sampled drafting) a few times on the same prompts.

A T=1 acceptance length over a few prompts is one draw from a wide distribution: which tokens get sampled steers
the whole continuation. On ``toy:kimi`` (measured, docs/recipes.md) our decoder's EAGLE-3.1 draft spread 2.27-2.82
over 20 seed sets on the benchmark's 8 prompts x 64 tokens (sd 0.15) and the benchmark's own set was the lowest;
on 48 prompts 2.59-2.90 (sd 0.07), where vLLM measured 2.66, 2.80 and 2.75.

    python -m benchmarks.bench_t1_spread                                      # toy:kimi, eagle3.1 (~8 min)
    python -m benchmarks.bench_t1_spread --recipe dflash/4-2layers --no-vllm
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.bench_recipes import RECIPES, full_vocab, k_of, settings, toy_data
from benchmarks.harness import MAX_TOKENS, SAMPLES, STEPS, TOYS, Local, command_line, refuse, train
from eagle3nb.accept.online import bench_endpoint
from eagle3nb.data.prompts import load_prompts
from eagle3nb.drafts import served_method
from eagle3nb.serve.vllm import start_vllm, unavailable_reason
from eagle3nb.toy import shipped
from eagle3nb.verification.verify import SpecCounters

SEED_STRIDE = 1000  # seed set s seeds prompt i with i + SEED_STRIDE * s (set 0 is the benchmark's)


@torch.inference_mode()
def local_spread(local: Local, draft_dir: Path, k: int, sets: int, counts: list[int]) -> dict[int, list[float]]:
    """Our decoder's T=1 acceptance length on the first n prompts, for each n in ``counts``, per seed set."""
    dec = local.decoder(draft_dir, k)
    out: dict[int, list[float]] = {n: [] for n in counts}
    for s in range(sets):
        counters = {n: SpecCounters(k) for n in counts}
        for i, p in enumerate(local.prompts):
            res = dec.generate(p, local.max_tokens, 1.0, local.eos, torch.Generator().manual_seed(i + SEED_STRIDE * s))
            for n in counts:
                if i < n:
                    counters[n].merge(res.counters)
        for n in counts:
            out[n].append(counters[n].summary()["acceptance_length"])
        print(f"seed set {s}: " + ", ".join(f"{n} prompts {out[n][-1]:.3f}" for n in counts), flush=True)
    return out


def parser() -> argparse.ArgumentParser:
    ap = command_line(__doc__)
    ap.add_argument("--toy", default="kimi", choices=list(TOYS))
    ap.add_argument("--recipe", default="eagle3.1", choices=list(RECIPES))
    ap.add_argument("--steps", **STEPS)
    ap.add_argument("--samples", **SAMPLES)
    ap.add_argument("--prompts", default="8,48", help="comma-separated toy:heldout prompt counts to judge on")
    ap.add_argument("--max-tokens", **MAX_TOKENS)
    ap.add_argument("--seed-sets", type=int, default=20, help="sets of per-prompt seeds for our decoder")
    ap.add_argument("--vllm-passes", type=int, default=2, help="vLLM passes per prompt count (concurrency 4)")
    ap.add_argument("--no-vllm", dest="vllm", action="store_false")
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.vllm and unavailable_reason():
        refuse(f"the real vLLM cannot run here ({unavailable_reason()}); pass --no-vllm to skip it")
    torch.set_num_threads(1)
    counts = sorted(int(n) for n in args.prompts.split(","))
    model_dir, name, k = shipped(args.toy), args.recipe, k_of(args.recipe)
    with tempfile.TemporaryDirectory() as tmp:
        # 1. The recipe's seed-0 draft, on the data and settings bench_recipes gives it.
        data = toy_data(model_dir, args.samples, Path(tmp) / "data", full_vocab(name))
        out = Path(tmp) / "run"
        metrics = train(settings(args.toy, name), data, out, 0, args.steps)
        if isinstance(metrics, str):
            refuse(f"{name}: 03 refuses it: {metrics}")
        # 2. Our decoder over the seed sets.
        local = Local(model_dir, counts[-1], args.max_tokens)
        spread = local_spread(local, out / "draft", k, args.seed_sets, counts)
        # 3. vLLM on the same prompts, sampled drafting as in the benchmark.
        served: dict[int, list[float]] = {n: [] for n in counts}
        if args.vllm:
            with start_vllm(f"toy:{args.toy}", served_method(out / "draft"), draft_dir=out / "draft",
                            num_speculative_tokens=k, speculative={"draft_sample_method": "probabilistic"}) as server:
                rows = load_prompts("toy:heldout", counts[-1])  # the prompts Local decodes, as chat messages
                for n in counts:
                    served[n] = [bench_endpoint(name, server.base_url, rows[:n], [4], args.max_tokens, 1.0,
                                                warmup=0, k=k)[0]["acceptance_length"]
                                 for _ in range(args.vllm_passes)]
    print(f"\n{args.toy} {name} seed 0, T=1, k={k}, {args.max_tokens} tokens a prompt")
    for n in counts:
        xs = spread[n]
        mean, sd = statistics.mean(xs), statistics.stdev(xs)
        vllm = ", ".join(f"{v:.3f} ({(v - mean) / sd:+.1f} sd)" for v in served[n]) or "not run"
        print(f"{n} prompts: our decoder over {len(xs)} seed sets mean {mean:.3f} sd {sd:.3f} "
              f"(min {min(xs):.3f}, max {max(xs):.3f}; the benchmark's set {xs[0]:.3f}); vLLM {vllm}")


if __name__ == "__main__":
    main()
