"""Every stage's command line, one form: ``python -m eagle3nb.<stage> params/<run>/ [--set key=value ...]``.

The same ``run(P)`` the notebook calls, on parameters validated as the notebook validates them, so a stage
runs headless without its notebook (``torchrun ... -m eagle3nb.train params/<run>/`` included). Exit codes:
0 done, 2 a parameter or stage error (the message says what to fix), 130 stopped by Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from eagle3nb.params import STAGE_MODULES, ParamsError, StageError, from_dict, stage_values


def main(stage: str, argv: list[str] | None = None) -> int:
    module = STAGE_MODULES[stage]
    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=f"run {stage} without its notebook")
    ap.add_argument("params", type=Path, help=f"params/<run>/ (or one {stage}.yaml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one parameter")
    args = ap.parse_args(argv)
    try:
        P = from_dict(stage, stage_values(stage, args.params, args.set))
        importlib.import_module(f"{module}.stage").run(P)
    except (ParamsError, StageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(e or f"{stage} stopped", file=sys.stderr)
        return 130
    return 0
