"""``eagle3nb run`` and ``eagle3nb status``."""

from __future__ import annotations

import argparse
import json

from eagle3nb.run.execute import detach, run
from eagle3nb.run.status import format_status, status


def _cmd_run(args: argparse.Namespace) -> int:
    if args.detach:
        return detach(args.params_dir, args.stages, args.force, args.output_root, args.notebooks_dir)
    return run(args.params_dir, args.stages, args.force, args.output_root, args.notebooks_dir,
               lock_fd=args.lock_fd, console=args.lock_fd is None)


def _cmd_status(args: argparse.Namespace) -> int:
    st = status(args.run_out_dir)
    print(json.dumps(st, indent=2, default=str) if args.json else format_status(st))
    return 0


def register_cli(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("run", help="execute a run's notebooks in order with papermill (resumes; can detach)",
                       description="Execute notebooks/NN_name.ipynb in order with the parameters in "
                                   "params/<run>/ into outputs/<run>/; done stages are skipped, failed or "
                                   "killed ones re-run and resume from their own progress.")
    r.add_argument("params_dir", help="the run's parameter folder, e.g. params/demo/")
    r.add_argument("--stages", help="only these stages, in pipeline order: numbers or names, e.g. 01,03; without "
                                    "it 01-04, then 05 (refresh) when the folder holds 05_refresh.yaml")
    r.add_argument("--force", action="store_true",
                   help="re-execute stages already done (each still resumes from its own files; delete "
                        "outputs/<run>/<NN_name>/ to redo one from scratch)")
    r.add_argument("--detach", action="store_true",
                   help="run in the background in a new session (survives closing the terminal) and return")
    r.add_argument("--output-root", help="folder that holds <run>/ (default: $EAGLE3NB_OUTPUTS, else "
                                         "<project>/outputs); the stages' default folders go there too, an "
                                         "output_dir set in the params wins")
    r.add_argument("--notebooks-dir", help="folder with the NN_name.ipynb notebooks (default: <project>/notebooks)")
    r.add_argument("--lock-fd", type=int, help=argparse.SUPPRESS)
    r.set_defaults(func=_cmd_run)
    s = sub.add_parser("status", help="what a run is doing: stage states, live progress, whether it is alive",
                       description="Show what the run writing into outputs/<run>/ is doing: each stage's state and "
                                   "times, the running stage's live progress and ETA, whether the run's process is "
                                   "alive, and the error and failing cell of a stage that failed.")
    s.add_argument("run_out_dir", help="the run's output folder, e.g. outputs/demo/")
    s.add_argument("--json", action="store_true", help="print the status as JSON")
    s.set_defaults(func=_cmd_status)
