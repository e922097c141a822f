"""The 2026 draft recipes, one factor at a time against the EAGLE-3 baseline, on the smoke and the Kimi-shaped toy
(issue 24, item 2).

Every recipe trains through 03 itself (``eagle3nb.train.stage.run``) on the same data (the toy's own greedy
answers to ``toy:train`` prompts, through 02: ``testkit.heldout``), from the same seeds and for the same steps;
only its own parameter differs from the baseline's (which sets ``fc_norm: false, norm_output: false`` itself, so
it stays EAGLE-3.0 whatever 03's defaults are). Each draft is judged three ways, at greedy (T=0) and at
temperature 1 (sampled drafting):

- offline: 04's acceptance length at k=3 on the samples 03 held out (T=1: the expected acceptance of rejection
  sampling, sum min(p, q));
- local: our speculative decoder (``eagle3nb.decoder``, lossless: at T=0 every output is checked against the
  target's own greedy tokens) on held-out prompts (``toy:heldout``), acceptance length from its counters;
- vLLM (seed 0 only, one server per draft, ``draft_sample_method: probabilistic`` so T=1 drafts by sampling):
  the real vLLM's spec-decode counters on the same prompts, and the served speedup: output tokens/s with the draft
  over a plain vLLM server's on the same prompts at concurrency 1 and T=0, the two measured one after the other.
  vLLM runs with the project's fixes for its CPU build (the plugin ``eagle3nb_vllm_fixes``: without them its T=1
  acceptance is ~1.0 whatever the draft); ``--no-vllm-fixes`` serves the drafts without them, to show that.

with the spread over the seeds and 03's training tokens/s. The block drafters' rows (``dflash/4`` ... ``dspark/8``:
issue 35, item 6) train the same steps on a copy of the same answers that keeps the whole vocabulary (a block
drafter has no reduced one) and are judged at their block's k (DFlash: block - 1, DSpark: block); vLLM serves
DFlash here and refuses DSpark on a CPU (its V1 runner has no dspark, V2 needs Triton): that row's vLLM cells
carry vLLM's own error. A recipe "beats" the baseline only when its mean is
above the baseline's by more than both half ranges (over the seeds) together.

On ``toy:kimi`` (a DeepseekV3 MLA target) every EAGLE draft, the baseline's too, is an MLA draft (``draft_attention:
mla``, as params/vllm-cpu-kimi trains it); a block drafter keeps its Qwen3 attention, which vLLM's CPU build serves
beside an MLA target with the fixes plugin's block-size fix. A recipe 03 refuses is listed with 03's error.

    python -m benchmarks.bench_recipes               # every recipe on smoke, 3 seeds, vLLM (~25 min on 2 shared cores)
    python -m benchmarks.bench_recipes --no-vllm     # offline and local only (~17 min)
    python -m benchmarks.bench_recipes --seeds 1 --only baseline,muon
    python -m benchmarks.bench_recipes --toys kimi --only eagle3.1,num_layers=2,loss=lk_lambda --samples 32 --steps 40
    python -m benchmarks.bench_recipes --only eagle3.1,dflash/4,dflash/8,dspark/4,dspark/8   # the block drafters
    python -m benchmarks.bench_recipes --toys kimi \
        --only eagle3.1,dflash/4-2layers,dflash/8-2layers,dspark/4-2layers,dspark/8-2layers   # ... on the Kimi toy
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import (
    MAX_TOKENS,
    SAMPLES,
    SEEDS,
    STEPS,
    THREADS,
    TOYS,
    Local,
    choose,
    command_line,
    greedy_data,
    held_out,
    judge,
    mean_half,
    parse,
    refuse,
    serve_drafts,
    train,
    verdict,
)
from eagle3nb.data.prompts import load_prompts
from eagle3nb.data.reader import HiddenStates
from eagle3nb.drafts import DEFAULT, block_methods, rules
from eagle3nb.serve.vllm import unavailable_reason
from eagle3nb.toy import shipped

# One factor each, against the EAGLE-3.0 baseline (one Llama layer, no 3.1 norms, forward KL, AdamW).
BASELINE = {"fc_norm": False, "norm_output": False}
EAGLE_RECIPES: dict[str, dict] = {
    "baseline": BASELINE,
    "eagle3.1": {"fc_norm": True, "norm_output": True},
    "num_layers=2": {**BASELINE, "num_layers": 2},
    "loss=reverse_kl": {**BASELINE, "loss": "reverse_kl"},
    "loss=tv": {**BASELINE, "loss": "tv"},
    "loss=jsd": {**BASELINE, "loss": "jsd"},
    "loss=lk_alpha": {**BASELINE, "loss": "lk_alpha"},
    "loss=lk_lambda": {**BASELINE, "loss": "lk_lambda"},
    "muon": {**BASELINE, "optimizer": "muon"},
    "parallel_drafting": {**BASELINE, "parallel_drafting": True},  # P-EAGLE: all k drafts in one forward
}
BLOCKS = (4, 8)  # the block drafters' rows: each registered one at these block sizes


def recipes() -> dict[str, dict]:
    """Every recipe by name: the EAGLE ones above, then every block drafter the registry holds
    (``eagle3nb.drafts.block_methods``): a block of drafts in one forward, k = the block's drafts (its rules'
    ``drafts_per_block``), at one layer like EAGLE's and at the depth of the num_layers=2 row (a DFlash mask slot
    reads its anchor only through attention), the other settings 03's defaults."""
    return {**EAGLE_RECIPES,
            **{f"{m}/{b}{suffix}": {"method": m, "block_size": b,
                                    "num_speculative_tokens": rules(m).drafts_per_block(b), "num_layers": layers}
               for layers, suffix in ((1, ""), (2, "-2layers")) for m in block_methods() for b in BLOCKS}}


RECIPES = recipes()
K = 3  # the EAGLE recipes' k; a block drafter's is its block's drafts (``k_of``)
# Offline (t0, t1), local (l0, l1) acceptance lengths and train tokens/s per seed; vLLM's (v0, v1, speedup) at
# seed 0, or the one-line reason it did not serve the draft.
Row = dict[str, list[float] | str]


def k_of(name: str) -> int:
    """The drafts a round of recipe ``name`` proposes (vLLM's ``num_speculative_tokens``)."""
    return RECIPES[name].get("num_speculative_tokens", K)


def full_vocab(name: str) -> bool:
    """A block drafter drafts over the target's whole vocabulary (02 must store it: no reduced draft vocab)."""
    return rules(RECIPES[name].get("method", DEFAULT)).block


def settings(toy: str, name: str) -> dict:
    """03's settings of recipe ``name`` on ``toy`` beyond TRAIN: an EAGLE draft's toy settings (MLA on an MLA
    target), then the recipe's own."""
    return {**({} if full_vocab(name) else TOYS[toy]), **RECIPES[name]}


def toy_data(model_dir: Path, samples: int, out: Path, full: bool) -> Path:
    """The toy's greedy answers to ``samples`` toy:train prompts through 02: the whole vocabulary for a block
    drafter, EAGLE's reduced 128 otherwise."""
    return greedy_data(model_dir, "toy:train", samples, out, draft_vocab=None if full else 128)


def bench_toy(toy: str, chosen: list[str], args: argparse.Namespace, root: Path) -> dict[str, Row | str]:
    """Each recipe on ``toy`` for every seed: offline and local acceptance and tokens/s, or 03's one-line
    refusal; then, with vLLM, seed 0's drafts served one at a time beside a plain server."""
    t0 = time.perf_counter()
    model_dir = shipped(toy)
    # The same answers for every recipe; the block drafters' copy keeps the whole vocabulary.
    data_dirs = {full: toy_data(model_dir, args.samples, root / toy / f"data-{full}", full)
                 for full in sorted({full_vocab(n) for n in chosen})}
    datas = {full: HiddenStates(d) for full, d in data_dirs.items()}
    held = held_out(next(iter(datas.values())))
    local = Local(model_dir, args.prompts, args.max_tokens)
    print(f"{toy} data: {len(next(iter(datas.values())))} samples of the toy's greedy answers ({len(held)} held "
          f"out), {len(local.prompts)} held-out prompts for decoding, {time.perf_counter() - t0:.0f} s", flush=True)
    rows: dict[str, Row | str] = {name: {key: [] for key in ("t0", "t1", "l0", "l1", "lossy", "tps")}
                                  for name in chosen}
    for seed in range(args.seeds):  # seeds outside, recipes inside: a machine's load drifts over all recipes
        for name in chosen:
            row = rows[name]
            if isinstance(row, str):  # refused at an earlier seed: the same settings are refused again
                continue
            out, full = root / toy / "runs" / name / str(seed), full_vocab(name)
            metrics = train(settings(toy, name), data_dirs[full], out, seed, args.steps)
            if isinstance(metrics, str):
                rows[name] = metrics
                print(f"{toy} {name}: 03 refuses it: {metrics}", flush=True)
                continue
            t_greedy, t_sampled = judge(out / "draft", datas[full], held, k_of(name))
            (l_greedy, l_sampled), lossy = local.decode(out / "draft", k_of(name))
            for key, value in zip(("t0", "t1", "l0", "l1", "lossy", "tps"),
                                  (t_greedy, t_sampled, l_greedy, l_sampled, lossy, metrics["tokens_per_s"])):
                row[key].append(value)
            print(f"{toy} {name} seed {seed}: offline tau T=0 {t_greedy:.3f}, T=1 {t_sampled:.3f}; local "
                  f"{l_greedy:.3f} / {l_sampled:.3f} ({lossy} not lossless); {metrics['tokens_per_s']:.0f} train tok/s",
                  flush=True)
    if args.vllm:
        serve_toy(toy, rows, root, load_prompts("toy:heldout", args.prompts), args.max_tokens, args.vllm_fixes)
    return rows


def serve_toy(toy: str, rows: dict[str, Row | str], root: Path, prompts: list[dict], max_tokens: int,
              fixes: bool = True) -> None:
    """Seed 0's draft of every recipe on the real vLLM (``harness.serve_drafts``, c=1), its cells added to its
    row."""
    drafts = {name: (root / toy / "runs" / name / "0" / "draft", k_of(name))
              for name, row in rows.items() if not isinstance(row, str)}
    for name, served in serve_drafts(toy, drafts, prompts, max_tokens, fixes).items():
        if isinstance(served, str):
            rows[name]["vllm"] = served
        else:
            rows[name]["v0"], rows[name]["v1"], rows[name]["speedup"] = [served["v0"]], [served["v1"]], \
                [served["speedup"][1]]


def print_table(toy: str, rows: dict[str, Row | str], args: argparse.Namespace) -> None:
    """The markdown table docs/recipes.md carries, then each recipe's training speed relative to the baseline's."""
    base = rows["baseline"]
    if isinstance(base, str):
        print(f"\n{toy}: the baseline itself is refused ({base}); nothing to compare")
        return
    lossy = sum(sum(r["lossy"]) for r in rows.values() if not isinstance(r, str))
    runs = sum(len(r["lossy"]) for r in rows.values() if not isinstance(r, str))
    print(f"\n{toy}{' (MLA drafts)' if TOYS[toy] else ''}: acceptance length at k={K} (a block drafter's: its "
          "block's drafts) "
          f"(mean ± half range over {args.seeds} seed(s)), {args.steps} steps, {args.samples} samples; offline on "
          f"03's held-out samples, local{' and vLLM' if args.vllm else ''} on {args.prompts} held-out prompts x "
          f"{args.max_tokens} tokens; "
          f"local decoding at T=0 gave the target's own tokens in {runs * args.prompts - lossy} of "
          f"{runs * args.prompts} prompt runs" +
          (f"; vLLM columns: seed 0{'' if args.vllm_fixes else ', WITHOUT the fixes'}" if args.vllm else ""))
    vllm_cols = " vLLM T=0 (seed 0) | vLLM T=1 (seed 0) | served speedup (seed 0) |" if args.vllm else ""
    print(f"| recipe | k | offline T=0 | offline T=1 | local T=0 | local T=1 |{vllm_cols} train tok/s | "
          "vs baseline (offline T=0 / T=1) |")
    print("| --- " * (8 + 3 * args.vllm) + "|")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"| {name} | {k_of(name)} |" + " — |" * (5 + 3 * args.vllm) + f" 03 refuses it: {row} |")
            continue
        verdicts = ["—"] if name == "baseline" else [verdict(row[key], base[key]) for key in ("t0", "t1")]
        served = ""
        if args.vllm:
            served = (f" not served: {row['vllm']} | — | — |" if "vllm" in row else
                      f" {row['v0'][0]:.3f} | {row['v1'][0]:.3f} | {row['speedup'][0]:.2f}x |")
        cells = " | ".join(mean_half(row[key]) for key in ("t0", "t1", "l0", "l1"))
        print(f"| {name} | {k_of(name)} | {cells} |{served} {statistics.mean(row['tps']):.0f} | "
              f"{' / '.join(verdicts)} |")
    tps = statistics.mean(base["tps"])
    print(f"\n{toy} training speed vs baseline: " + ", ".join(
        f"{n} {statistics.mean(r['tps']) / tps:.2f}x" for n, r in rows.items() if n != "baseline" and
        not isinstance(r, str)))


def parser() -> argparse.ArgumentParser:
    ap = command_line(__doc__)
    ap.add_argument("--toys", default="smoke", help="comma-separated shipped toys: " + ", ".join(TOYS))
    ap.add_argument("--seeds", **SEEDS)
    ap.add_argument("--steps", **STEPS)
    ap.add_argument("--samples", **SAMPLES)
    ap.add_argument("--prompts", type=int, default=8, help="toy:heldout prompts decoded locally and sent to vLLM")
    ap.add_argument("--max-tokens", **MAX_TOKENS)
    ap.add_argument("--only", default="", help="comma-separated recipe names (default: all): " + ", ".join(RECIPES))
    ap.add_argument("--no-vllm", dest="vllm", action="store_false", help="skip the real vLLM's columns")
    ap.add_argument("--no-vllm-fixes", dest="vllm_fixes", action="store_false",
                    help="serve the drafts without the vLLM plugin eagle3nb_vllm_fixes (the CPU build's defects back)")
    ap.add_argument("--threads", **THREADS)
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(parser(), argv)
    toys = choose("--toys", args.toys, list(TOYS))
    chosen = choose("--only", args.only, list(RECIPES)) if args.only else list(RECIPES)
    if args.vllm and unavailable_reason():
        refuse(f"the real vLLM cannot run here ({unavailable_reason()}); pass --no-vllm to skip its columns")
    if "baseline" not in chosen:
        chosen.insert(0, "baseline")
    with tempfile.TemporaryDirectory() as tmp:
        tables = {toy: bench_toy(toy, chosen, args, Path(tmp)) for toy in toys}
    for toy, rows in tables.items():
        print_table(toy, rows, args)


if __name__ == "__main__":
    main()
