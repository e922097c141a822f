"""The 2026 draft recipes, one factor at a time against the EAGLE-3 baseline, on the smoke and the Kimi-shaped toy
(issue 24, item 2).

Every recipe trains through 03 itself (``eagle3nb.train.stage.run``) on the same data (the toy's own greedy
answers to ``toy:train`` prompts, through 02: ``testkit.heldout``), from the same seeds and for the same steps;
only its own parameter differs from the baseline's. Each draft is judged by 04's offline acceptance on the
samples 03 held out: acceptance length at k=3, greedy (T=0) and sampled (T=1: the expected acceptance of
rejection sampling, sum min(p, q)), with the spread over the seeds, and 03's training tokens/s. A recipe "beats"
the baseline only when its mean is above the baseline's by more than both half ranges (over the seeds) together.

On ``toy:kimi`` (a DeepseekV3 MLA target) every draft, the baseline's too, is an MLA draft (``draft_attention:
mla``, the one vLLM's CPU build serves beside an MLA target); a recipe 03 refuses there is listed with 03's error.

    python benchmarks/bench_recipes.py               # every recipe on smoke, 3 seeds (~8 minutes on 2 shared cores)
    python benchmarks/bench_recipes.py --seeds 1 --only baseline,muon
    python benchmarks/bench_recipes.py --toys kimi --only eagle3.1,num_layers=2,loss=lk_lambda --samples 32 --steps 40

Not measured here (docs/recipes.md says why): local decoding and the real vLLM's counters per recipe.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from eagle3nb.accept.offline import offline_acceptance  # noqa: E402
from eagle3nb.data.reader import HiddenStates  # noqa: E402
from eagle3nb.data.split import split_holdout  # noqa: E402
from eagle3nb.draft_checkpoint import load_draft  # noqa: E402
from eagle3nb.errors import UserError  # noqa: E402
from eagle3nb.params import from_dict  # noqa: E402
from eagle3nb.toy import shipped  # noqa: E402
from eagle3nb.train.stage import run  # noqa: E402
from testkit.heldout import greedy_hidden_states  # noqa: E402

# One factor each, against the baseline (03's defaults: EAGLE-3, one Llama layer, forward KL, AdamW).
RECIPES: dict[str, dict] = {
    "baseline": {},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
    "num_layers=2": {"num_layers": 2},
    "loss=reverse_kl": {"loss": "reverse_kl"},
    "loss=tv": {"loss": "tv"},
    "loss=jsd": {"loss": "jsd"},
    "loss=lk_alpha": {"loss": "lk_alpha"},
    "loss=lk_lambda": {"loss": "lk_lambda"},
    "muon": {"optimizer": "muon"},
}
# The smoke run's 03 settings (params/smoke/03_train.yaml), a held-out quarter.
TRAIN = {"run_name": "bench", "ttt_steps": 3, "lr": 5e-3, "warmup_ratio": 0.05, "max_length": 1024,
         "batch_tokens": 1024, "eval_every": 0, "save_every": 1000, "holdout_fraction": 0.25}
# What every run on a toy sets beyond TRAIN: an MLA target's drafts are MLA drafts (params/vllm-cpu-kimi).
TOYS: dict[str, dict] = {"smoke": {}, "kimi": {"draft_attention": "mla"}}
K = 3
Row = dict[str, list[float]]


def spread(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.3f} ± {(max(xs) - min(xs)) / 2:.3f}" if len(xs) > 1 else f"{xs[0]:.3f}"


def verdict(xs: list[float], base: list[float]) -> str:
    """The mean's gap to the baseline's, and whether it exceeds both half ranges together."""
    gap = statistics.mean(xs) - statistics.mean(base)
    if len(xs) < 2:  # one seed has no spread to beat
        return f"{gap:+.3f} (one seed: no spread)"
    noise = (max(xs) - min(xs)) / 2 + (max(base) - min(base)) / 2
    return f"{gap:+.3f} {'beats' if gap > noise else 'worse' if gap < -noise else 'within spread'}"


def judge(out: Path, data: HiddenStates, held: list[int]) -> tuple[float, float]:
    """(greedy, sampled T=1) acceptance length at k=3 of ``out/draft`` on the held-out samples."""
    draft = load_draft(out / "draft", embed_tokens=data.embed_tokens())
    r = offline_acceptance(draft, data, k=K, max_k=K, temperature=1.0, indices=held)
    return r["greedy"]["acceptance_length"], r["sampled"]["acceptance_length"]


def bench_toy(toy: str, names: list[str], args: argparse.Namespace, root: Path) -> dict[str, Row | str]:
    """Each recipe on ``toy`` for every seed: its acceptance and tokens/s lists, or 03's one-line refusal."""
    t0 = time.perf_counter()
    data_dir = greedy_hidden_states(shipped(toy), "toy:train", args.samples, 96, root / toy / "data",
                                    draft_vocab_size=128)
    data = HiddenStates(data_dir)
    _, held = split_holdout([s["id"] for s in data.meta["samples"]], TRAIN["holdout_fraction"])
    print(f"{toy} data: {len(data)} samples of the toy's greedy answers ({len(held)} held out), "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    rows: dict[str, Row | str] = {name: {"t0": [], "t1": [], "tps": []} for name in names}
    for seed in range(args.seeds):  # seeds outside, recipes inside: a machine's load drifts over all recipes
        for name in names:
            row = rows[name]
            if isinstance(row, str):  # refused at an earlier seed: the same settings are refused again
                continue
            out = root / toy / "runs" / name / str(seed)
            try:
                metrics = run(from_dict("03_train", {**TRAIN, **TOYS[toy], **RECIPES[name], "data_dir": str(data_dir),
                                                     "output_dir": str(out), "seed": seed,
                                                     "max_steps": args.steps}))
            except UserError as e:
                rows[name] = str(e).splitlines()[0]
                print(f"{toy} {name}: 03 refuses it: {rows[name]}", flush=True)
                continue
            t_greedy, t_sampled = judge(out, data, held)
            row["t0"].append(t_greedy)
            row["t1"].append(t_sampled)
            row["tps"].append(metrics["tokens_per_s"])
            print(f"{toy} {name} seed {seed}: tau T=0 {t_greedy:.3f}, T=1 {t_sampled:.3f}, "
                  f"{metrics['tokens_per_s']:.0f} train tok/s", flush=True)
    return rows


def print_table(toy: str, rows: dict[str, Row | str], args: argparse.Namespace) -> None:
    """The markdown table docs/recipes.md carries, then each recipe's training speed relative to the baseline's."""
    base = rows["baseline"]
    if isinstance(base, str):
        print(f"\n{toy}: the baseline itself is refused ({base}); nothing to compare")
        return
    print(f"\n{toy}{' (MLA drafts)' if TOYS[toy] else ''}: held-out acceptance length at k={K} "
          f"(mean ± half range over {args.seeds} seed(s)), {args.steps} steps, {args.samples} samples")
    print("| recipe | tau T=0 | tau T=1 | train tok/s | vs baseline (T=0 / T=1) |")
    print("| --- | --- | --- | --- | --- |")
    for name, row in rows.items():
        if isinstance(row, str):
            print(f"| {name} | — | — | — | 03 refuses it: {row} |")
            continue
        verdicts = ["—"] if name == "baseline" else [verdict(row[key], base[key]) for key in ("t0", "t1")]
        print(f"| {name} | {spread(row['t0'])} | {spread(row['t1'])} | {statistics.mean(row['tps']):.0f} | "
              f"{' / '.join(verdicts)} |")
    tps = statistics.mean(base["tps"])
    print(f"\n{toy} training speed vs baseline: " + ", ".join(
        f"{n} {statistics.mean(r['tps']) / tps:.2f}x" for n, r in rows.items() if n != "baseline" and
        not isinstance(r, str)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--toys", default="smoke", help="comma-separated shipped toys: " + ", ".join(TOYS))
    ap.add_argument("--seeds", type=int, default=3, help="seeds per recipe (0..N-1)")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per run (the same for every recipe)")
    ap.add_argument("--samples", type=int, default=48, help="toy:train prompts answered by the toy (train + held out)")
    ap.add_argument("--only", default="", help="comma-separated recipe names (default: all): " + ", ".join(RECIPES))
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    toys = [t for t in args.toys.split(",") if t]
    names = [n for n in (args.only.split(",") if args.only else RECIPES) if n]
    for flag, given, known in (("--toys", toys, TOYS), ("--only", names, RECIPES)):
        unknown = [n for n in given if n not in known]
        if unknown or not given:
            what = f"unknown {', '.join(unknown)}" if unknown else "nothing given"
            sys.exit(f"{flag}: {what}; choose from {', '.join(known)}")
    if "baseline" not in names:
        names.insert(0, "baseline")
    with tempfile.TemporaryDirectory() as tmp:
        tables = {toy: bench_toy(toy, names, args, Path(tmp)) for toy in toys}
    for toy, rows in tables.items():
        print_table(toy, rows, args)


if __name__ == "__main__":
    main()
