"""03_train with the hidden states computed on the fly (data_source online) against reading 02's shards (stored):
training tokens/s of each over the same micro-batches, side by side in one run, and their ratio.

Online pays one target forward per micro-batch (and per held-out sample at each evaluation) on top of the
draft's step; stored pays 02's extraction once, before training, plus the shard reads. On the toy the target is
small next to the draft's TTT unroll, so the ratio is a ceiling: with a 1T target the target's share grows (see
``train.sources.source_costs`` for the run at hand). The data: 01-format rows of random toy token ids (the cost
does not depend on what the tokens say); 02 extracts them once at fp32.

    python -m benchmarks.bench_online [--model toy:demo --samples 64 --steps 12 --repeats 2]
"""

from __future__ import annotations

import argparse
import itertools
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import REPEATS, THREADS, alternate, command_line, parse, write_samples


def parser() -> argparse.ArgumentParser:
    ap = command_line(__doc__)
    ap.add_argument("--model", default="toy:demo")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", **REPEATS)
    ap.add_argument("--threads", **THREADS)
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(parser(), argv)
    import torch
    import yaml

    from eagle3nb.data.head import target_info
    from eagle3nb.hidden.stage import run as extract
    from eagle3nb.params import from_dict
    from eagle3nb.toy import resolve_model_path
    from eagle3nb.train.stage import run as train

    model = resolve_model_path(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rng = random.Random(0)
        lengths = (rng.randint(128, 512) for _ in range(args.samples))  # loss on the last three quarters
        write_samples(root / "01", target_info(model)["vocab_size"], lengths, rng)
        hidden = {"run_name": "bench", "synth_dir": str(root / "01"), "model_path": str(model), "storage": "fp32"}
        t = time.perf_counter()
        extract(from_dict("02_hidden_states", {**hidden, "output_dir": str(root / "02")}))
        extract_s = time.perf_counter() - t
        (root / "02_hidden_states.yaml").write_text(yaml.safe_dump(hidden))
        base = {"run_name": "bench", "max_steps": args.steps, "eval_every": 0, "save_every": 10**6,
                "batch_tokens": 2048, "max_length": 512, "seed": 0}
        run = itertools.count()

        def trained(source: str, data_dir: Path) -> dict:
            return train(from_dict("03_train", {**base, "data_source": source, "data_dir": str(data_dir),
                                                "output_dir": str(root / f"03-{source}-{next(run)}"),
                                                "hidden_params": str(root / "02_hidden_states.yaml")}))

        # alternating, best of each: the machine is shared, timings are noisy
        sides = alternate({"stored": lambda: trained("stored", root / "02"),
                           "online": lambda: trained("online", root / "online-02")}, args.repeats)
        best = {source: max(ms, key=lambda m: m["tokens_per_s"]) for source, ms in sides.items()}
    s, o = best["stored"]["tokens_per_s"], best["online"]["tokens_per_s"]
    tf = best["online"]["target_forward"]
    print(f"model {args.model}, {args.samples} samples, {args.steps} steps, best of {args.repeats} alternating runs, "
          f"{torch.get_num_threads()} threads")
    print(f"02 extraction (stored, once): {extract_s:.1f} s")
    print(f"stored: {s:,.0f} training tokens/s")
    print(f"online: {o:,.0f} training tokens/s (target: {tf['tokens']:,} tokens in {tf['seconds']:.1f} s, "
          f"{tf['tokens_per_s']:,.0f} tokens/s)")
    print(f"online / stored: ratio {o / s:.2f}")


if __name__ == "__main__":
    main()
