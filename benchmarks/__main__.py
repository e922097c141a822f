"""``make bench``: the quick benchmarks in turn, each ``python -m benchmarks.<name>`` in its own process with the
flags ``benchmarks/harness.py`` ``QUICK`` gives it, then the long ones named with their run times and commands
(``LONG``: run each alone when its figures are wanted).

    python -m benchmarks                       # the quick ones, then the list of the long ones
    python -m benchmarks --list                # both lists only
    python -m benchmarks --only bench_train,bench_serve
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import time
from collections.abc import Sequence

from benchmarks.harness import LONG, QUICK, ROOT, Bench, choose, command_line


def describe(benches: Sequence[Bench]) -> str:
    return "\n".join(f"  {b.command:<70} ~{b.minutes:g} min" + (f"  ({b.note})" if b.note else "") for b in benches)


def cpu_seconds() -> float:
    """CPU seconds of this process's finished children (their servers' too): what a benchmark costs whatever else
    runs on the machine, where its wall time grows with the load."""
    use = resource.getrusage(resource.RUSAGE_CHILDREN)
    return use.ru_utime + use.ru_stime


def parser() -> argparse.ArgumentParser:
    ap = command_line(__doc__)
    ap.add_argument("--list", action="store_true", help="print the quick and the long benchmarks, run nothing")
    ap.add_argument("--only", default="", help="comma-separated quick ones to run: "
                                               + ", ".join(b.name for b in QUICK))
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    quick = [b for b in QUICK if b.name in choose("--only", args.only, [b.name for b in QUICK])] if args.only \
        else list(QUICK)
    print(f"quick (what `make bench` runs, ~{sum(b.minutes for b in QUICK):.1f} min here):\n{describe(QUICK)}\n"
          f"long (run each alone):\n{describe(LONG)}", flush=True)
    if args.list:
        return 0
    failed, t_all = [], time.perf_counter()
    for b in quick:
        print(f"\n== {b.command}", flush=True)
        t0, cpu0 = time.perf_counter(), cpu_seconds()
        rc = subprocess.run([sys.executable, "-m", f"benchmarks.{b.name}", *b.args], cwd=ROOT).returncode
        print(f"== {b.name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {time.perf_counter() - t0:.0f} s "
              f"({cpu_seconds() - cpu0:.0f} s of CPU)", flush=True)
        if rc:
            failed.append(b.name)
    print(f"\n{len(quick) - len(failed)} of {len(quick)} quick benchmarks ran in {time.perf_counter() - t_all:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f"\nthe long ones, each alone:\n{describe(LONG)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
