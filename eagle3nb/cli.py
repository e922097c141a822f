"""The ``eagle3nb`` console script. Each command lives in the module that does the work; that module
exposes ``register_cli(subparsers)`` and keeps its top-level imports light (torch is imported lazily)."""

from __future__ import annotations

import argparse
import importlib
import sys

from eagle3nb.drafts import PACKAGES
from eagle3nb.errors import guarded

# command -> module with register_cli(subparsers)
CLI_MODULES = [
    "eagle3nb.run.cli",    # run, status
    "eagle3nb.toy.cli",    # toy build, toy prompts
    "eagle3nb.serve.cli",  # serve
    "eagle3nb.doctor",     # doctor
    "eagle3nb.sizing",       # plan
]


DESCRIPTION = f"""\
Train and judge speculative-decoding draft models ({", ".join(PACKAGES)}) for a reasoning LLM. The six stages are
the notebooks notebooks/01_synth.ipynb ... 06_select.ipynb (also `python -m
eagle3nb.synth|hidden|train|accept|refresh|select params/<run>/`): 01-04 make and judge a draft, 05 refreshes a served
one from its traffic, 06 trains several recipes and picks the one that serves fastest at your load, both on
request. These commands run them in order, check a run, serve a model and build the toy target."""

EPILOG = """\
examples:
  eagle3nb run params/demo/              stages 01-04 in order (and 05 when params/demo/ holds 05_refresh.yaml);
                                         run it again and it resumes
  eagle3nb run params/mine/ --stages 05  the refresh alone, on params/mine/05_refresh.yaml's traffic (docs/refresh.md)
  eagle3nb run params/mine/ --stages 06  the selection: recipes trained, served, the fastest picked (docs/select.md)
  eagle3nb doctor params/mine/           check a run for the known causes of a bad drafter, before the GPU hours
  eagle3nb run params/mine/ --detach     the same in the background: it survives the terminal closing
  eagle3nb status outputs/mine/          what a run is doing, its live progress, whether it is alive
  eagle3nb COMMAND --help                a command's options

Docs: README.md (start there) and docs/README.md (every page, by purpose)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle3nb", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error instead of one line")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in CLI_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):
                continue  # command not built yet
            raise
        mod.register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Every command through one error path (``eagle3nb.errors.guarded``): a user error is one line and exit 2."""
    args = build_parser().parse_args(argv)
    return guarded(f"eagle3nb {args.command}", args.func, args, argv=["--debug"] if args.debug else None)


if __name__ == "__main__":
    sys.exit(main())
