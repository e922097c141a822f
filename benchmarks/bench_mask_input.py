"""A block drafter's mask input: the target's row of ``mask_token_id`` (the smoke toy's pad row, all zeros) against
the trained ``mask_embedding`` (issue 43, item 1). Each variant trains through 03 itself on bench_recipes' data
(the toy's own greedy answers to ``toy:train`` prompts, the whole vocabulary), with its settings, seeds and steps;
only the mask input differs. The dead-row variant is 03's fresh draft with its ``mask_embedding`` removed, so its
mask slots read the target's row, as every block drafter did before the change. Judged by 04's offline acceptance
at the block's k on 03's held-out samples: acceptance by block position (conditional) and tau, at T=0.

    python -m benchmarks.bench_mask_input    # the first registered block drafter at block 4, 1 and 2 layers (~10 min)
    python -m benchmarks.bench_mask_input --only dspark/4 --seeds 1
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from benchmarks.bench_recipes import RECIPES, k_of
from benchmarks.harness import (
    SAMPLES,
    SEEDS,
    STEPS,
    choose,
    command_line,
    draft_module,
    greedy_data,
    held_out,
    judged_draft,
    mean_half,
    offline,
    refuse,
    table,
    train,
)
from eagle3nb.data.reader import HiddenStates
from eagle3nb.drafts import block_methods
from eagle3nb.toy import shipped


def block_recipes(recipes: dict[str, dict]) -> list[str]:
    """bench_recipes' rows of the registered block drafters."""
    return [name for name, r in recipes.items() if r.get("method") in block_methods()]


DEFAULT_ONLY = f"{block_methods()[0]}/4,{block_methods()[0]}/4-2layers"  # the first registered block drafter's


@contextlib.contextmanager
def dead_row(method: str) -> Iterator[None]:
    """03's fresh ``method`` drafts without a trained mask input: their mask slots read the target's row (its
    package's ``model.fresh_draft``, patched meanwhile)."""
    model = draft_module(method, "model")
    fresh = model.fresh_draft

    def without(*args, **kwargs):
        draft = fresh(*args, **kwargs)
        draft.mask_embedding = None
        return draft

    model.fresh_draft = without
    try:
        yield
    finally:
        model.fresh_draft = fresh


def parser() -> argparse.ArgumentParser:
    ap = command_line(__doc__)
    ap.add_argument("--only", default=DEFAULT_ONLY, help="comma-separated block recipes of bench_recipes: "
                                                         + ", ".join(block_recipes(RECIPES)))
    ap.add_argument("--seeds", **SEEDS)
    ap.add_argument("--steps", **STEPS)
    ap.add_argument("--samples", **SAMPLES)
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    chosen = choose("--only", args.only, block_recipes(RECIPES))
    torch.set_num_threads(1)
    model_dir = shipped("smoke")
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = greedy_data(model_dir, "toy:train", args.samples, Path(tmp) / "data")
        data = HiddenStates(data_dir)
        held = held_out(data)
        rows = []
        for name in chosen:
            k = k_of(name)
            for variant in ("dead row", "trained"):
                first, taus = [], []
                for seed in range(args.seeds):
                    out = Path(tmp) / name.replace("/", "-") / variant.replace(" ", "-") / str(seed)
                    with dead_row(RECIPES[name]["method"]) if variant == "dead row" else contextlib.nullcontext():
                        metrics = train(RECIPES[name], data_dir, out, seed, args.steps)
                    if isinstance(metrics, str):
                        refuse(f"{name}: 03 refuses it: {metrics}")
                    assert (judged_draft(out / "draft", data).mask_embedding is None) == (variant == "dead row")
                    r = offline(out / "draft", data, held, k, temperature=0.0)["greedy"]
                    first.append(r["per_position"][0])
                    taus.append(r["acceptance_length"])
                    print(f"{name} {variant} seed {seed}: by position {[round(a, 3) for a in r['per_position']]}, "
                          f"tau {r['acceptance_length']:.3f}", flush=True)
                rows.append([name, variant, mean_half(first), mean_half(taus)])
    print(f"\n{args.steps} steps, {args.samples} samples, seeds 0..{args.seeds - 1}; offline at T=0 on 03's held-out "
          "samples (mean ± half range)")
    print(table(["recipe", "mask input", "first position", "tau"], rows))


if __name__ == "__main__":
    main()
