"""Train outside the notebook with the same code path, e.g. on 8 GPUs (or 2 nodes) with torchrun:

    torchrun --nproc_per_node 8 -m eagle3nb.train params/<run>/
    torchrun --nnodes 2 --node_rank R --master_addr HOST --nproc_per_node 8 -m eagle3nb.train params/<run>/

Parameters come from ``params/<run>/03_train.yaml`` (over ``common.yaml``), validated as the notebook does;
``--set key=value`` overrides one (YAML syntax for the value).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml


def main(argv: list[str] | None = None) -> int:
    from eagle3nb.params import from_dict, run_params
    from eagle3nb.train import train

    ap = argparse.ArgumentParser(prog="python -m eagle3nb.train", description=__doc__.split("\n")[0])
    ap.add_argument("params_dir", help="params/<run>/ holding 03_train.yaml")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one parameter")
    args = ap.parse_args(argv)
    values = run_params(Path(args.params_dir), "03_train")
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--set {item!r}: use KEY=VALUE")
        values[key] = yaml.safe_load(value)
    train(from_dict("03_train", values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
