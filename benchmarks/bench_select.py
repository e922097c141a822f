"""06's selection on the smoke toy, three candidates, end to end: how long it takes (target: at most 15 minutes on
two cores) and what it picks.

The toy's own greedy answers to ``--samples`` ``toy:train`` prompts are the run's 01 samples (``testkit.heldout``
through the harness' ``greedy_data``); 06 then runs as a user runs it (``eagle3nb.select.stage.run``): three of the
registry's recipes (the first and last of the default method's, which share one training, and the first block
drafter's first), 02 and 03 per need and training, each served on ``--engine`` beside the plain target at c=1 and
c=4 (the speedups are ratios measured side by side, each candidate's beside the plain server's of the same minute).
Prints the phases' wall times, the candidates' table and the pick.

    python -m benchmarks.bench_select                       # the real vLLM (make vllm), ~10 min here
    python -m benchmarks.bench_select --engine embedded     # eagle3nb's own server, no vLLM needed
    python -m benchmarks.bench_select --out /tmp/select     # keep the run (a second call resumes it)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import THREADS, command_line, greedy_data, project_env, refuse, table
from eagle3nb.drafts import DEFAULT, block_methods, rules
from eagle3nb.params import from_dict
from eagle3nb.select.candidates import recipe_name
from eagle3nb.select.stage import run
from eagle3nb.serve.vllm import unavailable_reason
from eagle3nb.toy import shipped

TARGET_MINUTES = 15  # issue 51: the selection on the smoke toy, three candidates, on two cores


def three_candidates() -> list[dict]:
    """The first and last recipe of the default method (one training served at two k) and the first block
    drafter's first recipe, as the registry holds them."""
    chain, block = rules(DEFAULT).recipes, rules(block_methods()[0]).recipes[0]
    picked = [(DEFAULT, chain[0]), (DEFAULT, chain[-1]), (block_methods()[0], block)]
    return [{"name": recipe_name(m, {"method": m, **r}), "method": m, **r} for m, r in picked]


def parser() -> argparse.ArgumentParser:
    ap = command_line(__doc__)
    ap.add_argument("--engine", choices=("vllm", "embedded"), default="vllm", help="where the candidates are served")
    ap.add_argument("--samples", type=int, default=200, help="toy:train prompts the toy answers (the run's data)")
    ap.add_argument("--steps", type=int, default=200, help="03's steps per training")
    ap.add_argument("--prompts", type=int, default=32, help="requests per concurrency level")
    ap.add_argument("--threads", **THREADS)
    ap.add_argument("--out", type=Path, default=None, help="keep the run here (default: a temporary folder)")
    return ap


def bench(args: argparse.Namespace, root: Path) -> None:
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    synth = greedy_data(shipped("smoke"), "toy:train", args.samples, root / "data").parent / "01"
    data_s = time.perf_counter() - t0
    P = from_dict("06_select", {
        "run_name": "bench-select", "model_path": "toy:smoke", "synth_dir": str(synth), "engine": args.engine,
        "output_dir": str(root / "06_select"), "steps": args.steps, "candidates": three_candidates(),
        "train": {"batch_tokens": 2048, "max_length": 512, "lr": 5e-3, "eval_every": 0},
        "hidden": {"max_length": 512}, "concurrencies": [1, 4], "num_prompts": args.prompts, "max_tokens": 64})
    t1 = time.perf_counter()
    m = run(P)
    total = time.perf_counter() - t1
    print(f"\nthe run's data ({args.samples} greedy answers, not part of the selection): {data_s:.0f} s")
    print(f"06 on {args.engine}: {total:.0f} s = training {m['trained_s']:.0f} s (02 and 03, {args.steps} steps) + "
          f"serving and the rest {total - m['trained_s']:.0f} s; target at most {TARGET_MINUTES} min: "
          f"{'met' if total <= TARGET_MINUTES * 60 else 'MISSED'}")
    rows = []
    for c in m["candidates"]:
        cells = {cell["concurrency"]: cell["speedup"] for cell in c.get("cells") or []}
        tau = c.get("tau") or {}
        rows.append([c["name"], c["status"], *(f"{tau[k]:.2f}" if tau.get(k) else "—" for k in
                                               ("pooled", "per_request_mean")),
                     *(f"{cells[lv]:.2f}x" if cells.get(lv) else "—" for lv in (1, 4)),
                     f"{c['score']:.2f}x" if c.get("score") else "—",
                     f"{c['cost']['wall_s']:.0f}" if c.get("cost") else "—", c.get("reason") or ""])
    print(table(["candidate", "status", "tau pooled", "tau per-request", "c=1", "c=4", "at the load", "train s",
                 "why not served"], rows))
    print(f"plain server's spread over the run: {m['plain_spread']:.0%}" if m.get("plain_spread") is not None
          else "")
    print(m["pick"]["why"])


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.engine == "vllm" and unavailable_reason():
        refuse(f"the real vLLM cannot run here ({unavailable_reason()}); pass --engine embedded")
    project_env()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        bench(args, args.out)
        return
    with tempfile.TemporaryDirectory() as tmp:
        bench(args, Path(tmp))


if __name__ == "__main__":
    main()
