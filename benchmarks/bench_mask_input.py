"""A block drafter's mask input: the target's row of ``mask_token_id`` (the smoke toy's pad row, all zeros) against
the trained ``mask_embedding`` (issue 43, item 1). Each variant trains through 03 itself on bench_recipes' data
(the toy's own greedy answers to ``toy:train`` prompts, the whole vocabulary), with its settings, seeds and steps;
only the mask input differs. The dead-row variant is 03's fresh draft with its ``mask_embedding`` removed, so its
mask slots read the target's row, as every block drafter did before the change. Judged by 04's offline acceptance
at the block's k on 03's held-out samples: acceptance by block position (conditional) and tau, at T=0.

    python benchmarks/bench_mask_input.py                      # dflash/4, dflash/4-2layers; 3 seeds (~10 min)
    python benchmarks/bench_mask_input.py --only dspark/4 --seeds 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_recipes import RECIPES, TRAIN, k_of  # noqa: E402

from eagle3nb.accept.offline import offline_acceptance  # noqa: E402
from eagle3nb.data.reader import HiddenStates  # noqa: E402
from eagle3nb.data.split import split_holdout  # noqa: E402
from eagle3nb.drafts import load_draft  # noqa: E402
from eagle3nb.drafts.dflash import model as dflash_model  # noqa: E402
from eagle3nb.params import from_dict  # noqa: E402
from eagle3nb.toy import shipped  # noqa: E402
from eagle3nb.train.stage import run  # noqa: E402
from testkit.heldout import greedy_hidden_states  # noqa: E402


@contextlib.contextmanager
def dead_row() -> Iterator[None]:
    """03's fresh block drafters without a trained mask input: their mask slots read the target's row."""
    fresh = dflash_model.fresh_draft

    def without(*args, **kwargs):
        draft = fresh(*args, **kwargs)
        draft.mask_embedding = None
        return draft

    dflash_model.fresh_draft = without
    try:
        yield
    finally:
        dflash_model.fresh_draft = fresh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="dflash/4,dflash/4-2layers", help="bench_recipes' block recipes")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--samples", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = shipped("smoke")
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = greedy_hidden_states(model_dir, "toy:train", args.samples, 96, Path(tmp) / "data",
                                        draft_vocab_size=vocab)
        data = HiddenStates(data_dir)
        _, held = split_holdout([s["id"] for s in data.meta["samples"]], TRAIN["holdout_fraction"])
        rows = []
        for name in args.only.split(","):
            k = k_of(name)
            for variant, ctx in (("dead row", dead_row), ("trained", contextlib.nullcontext)):
                first, taus = [], []
                for seed in range(args.seeds):
                    out = Path(tmp) / name.replace("/", "-") / variant.replace(" ", "-") / str(seed)
                    with ctx():
                        run(from_dict("03_train", {**TRAIN, **RECIPES[name], "data_dir": str(data_dir),
                                                   "output_dir": str(out), "seed": seed, "max_steps": args.steps}))
                    draft = load_draft(out / "draft", embed_tokens=data.embed_tokens(), lm_head=data.lm_head())
                    assert (draft.mask_embedding is None) == (variant == "dead row")
                    r = offline_acceptance(draft, data, k=k, max_k=k, temperature=0.0, indices=held)["greedy"]
                    first.append(r["per_position"][0])
                    taus.append(r["acceptance_length"])
                    print(f"{name} {variant} seed {seed}: by position {[round(a, 3) for a in r['per_position']]}, "
                          f"tau {r['acceptance_length']:.3f}", flush=True)
                rows.append((name, variant, first, taus))
    print(f"\n{args.steps} steps, {args.samples} samples, seeds 0..{args.seeds - 1}; offline at T=0 on 03's held-out "
          "samples (mean ± half range)")
    print("| recipe | mask input | first position | tau |\n| --- | --- | --- | --- |")
    for name, variant, first, taus in rows:
        cells = [f"{statistics.mean(xs):.3f} ± {(max(xs) - min(xs)) / 2:.3f}" for xs in (first, taus)]
        print(f"| {name} | {variant} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
