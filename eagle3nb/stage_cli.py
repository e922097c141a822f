"""Every stage's command line, one form: ``python -m eagle3nb.<stage> params/<run>/ [--set key=value ...]``.

The same ``run(P)`` the notebook calls, on parameters validated as the notebook validates them, so a stage
runs headless without its notebook (``torchrun ... -m eagle3nb.train params/<run>/`` included). Exit codes
(``eagle3nb.errors``): 0 done, 2 a user error (one line: what is wrong, where, the fix), 1 a bug (one line; the
traceback with ``--debug`` or ``EAGLE3NB_DEBUG=1``), 130 stopped by Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

from eagle3nb.errors import guarded
from eagle3nb.params import STAGE_MODULES, StageParams, from_dict
from eagle3nb.params_yaml import stage_values


def run_stage(P: StageParams) -> Any:
    """The one way to a stage's ``run(P)`` from inside the package: its ``stage.py`` found by the parameters' stage
    name (the command line's, and 05's for 01-03). No module imports a ``stage.py`` (tests/test_architecture.py)."""
    return importlib.import_module(f"{STAGE_MODULES[P.stage]}.stage").run(P)


def main(stage: str, argv: list[str] | None = None) -> int:
    module = STAGE_MODULES[stage]
    ap = argparse.ArgumentParser(prog=f"python -m {module}", description=f"run {stage} without its notebook")
    ap.add_argument("params", type=Path, help=f"params/<run>/ (or one {stage}.yaml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one parameter")
    ap.add_argument("--debug", action="store_true", help="print the traceback of an error instead of one line")
    args = ap.parse_args(argv)

    def body() -> int:
        run_stage(from_dict(stage, stage_values(stage, args.params, args.set)))
        return 0

    return guarded(f"python -m {module}", body, argv=["--debug"] if args.debug else None)
