"""Run the trained-number tests under the variations another machine brings, and say which held.

    python tools/variations.py [--only NAME[,NAME]] [--list]

Float results differ across CPUs (other vector kernels, other reduction orders): a test that judges a trained
number must hold its margin under each of these, not only on the machine that wrote it. Each variation is one
pytest run of ``TESTS`` in a subprocess with its environment:

- ``native``: this machine's own kernels, 1 torch thread, seed 0 (what ``make test`` runs);
- ``avx2``: ATen, MKL and oneDNN capped at AVX2 (an older or another vendor's x86 CPU);
- ``default``: ATen's portable kernels, MKL and oneDNN capped at SSE4.2;
- ``threads2``: 2 torch threads for the trained fixtures (another reduction order);
- ``seed1``: the trained fixtures drawn from another seed (a margin that is one seed's luck fails here).

Outside ``make test`` (it runs the trained tests once per variation, five in all). Prints one line per
variation and a summary; exits 1 when any failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The tests that judge trained numbers (a draft's acceptance, a toy's answers, training curves).
TESTS = ["tests/test_toy.py", "tests/test_doctor.py", "tests/test_bench_server.py", "tests/test_train.py",
         "tests/test_accept_spec.py", "tests/test_spec_batch.py", "tests/test_misses.py", "tests/test_ttt_speed.py",
         "tests/test_online_train.py", "tests/test_vllm.py", "tests/test_e2e.py", "tests/test_recipes.py",
         "tests/test_accept_sweep.py", "tests/test_vllm_recipes.py", "tests/test_parallel_drafting.py",
         "tests/test_family_glm.py", "tests/test_harmony.py", "tests/test_vllm_sampling.py", "tests/test_dflash.py",
         "tests/test_refresh.py", "tests/test_lilicorr.py", "tests/test_select.py", "tests/test_scale.py",
         "tests/test_family_kimi.py", "tests/test_family_qwen3.py", "tests/test_family_gptoss.py"]

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
PORTABLE = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41"}
VARIATIONS: dict[str, dict[str, str]] = {
    "native": {},
    "avx2": AVX2,
    "default": PORTABLE,
    "threads2": {"EAGLE3NB_TEST_THREADS": "2"},
    "seed1": {"EAGLE3NB_TEST_SEED": "1"},
}


def run(name: str, extra: dict[str, str], log_dir: Path) -> tuple[bool, str, float]:
    """One pytest run of TESTS under ``extra``; (passed, pytest's closing line, seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in {*AVX2, "EAGLE3NB_TEST_THREADS", "EAGLE3NB_TEST_SEED"}}
    env.update(extra)
    log = log_dir / f"{name}.log"
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS], cwd=ROOT,
                             env=env, stdout=f, stderr=subprocess.STDOUT)
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    return rc == 0, (lines[-1] if lines else "(no output)") + f"  [log: {log}]", time.time() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated variation names (default: all)")
    ap.add_argument("--list", action="store_true", help="print the variations and the tests, run nothing")
    ap.add_argument("--logs", type=Path, default=Path("/tmp/eagle3nb-variations"), help="folder for each run's log")
    args = ap.parse_args(argv)
    chosen = args.only.split(",") if args.only else list(VARIATIONS)
    unknown = sorted(set(chosen) - set(VARIATIONS))
    if unknown:
        ap.error(f"unknown variation(s) {', '.join(unknown)}: use {', '.join(VARIATIONS)}")
    if args.list:
        for name in chosen:
            print(f"{name:9} {' '.join(f'{k}={v}' for k, v in VARIATIONS[name].items()) or '(this machine)'}")
        print("tests:", " ".join(TESTS))
        return 0
    args.logs.mkdir(parents=True, exist_ok=True)
    failed = []
    for name in chosen:
        ok, last, seconds = run(name, VARIATIONS[name], args.logs)
        print(f"{'PASS' if ok else 'FAIL'} {name:9} {seconds:6.0f}s  {last}", flush=True)
        if not ok:
            failed.append(name)
    print(f"{len(chosen) - len(failed)}/{len(chosen)} variations held" + (f"; failed: {', '.join(failed)}"
                                                                          if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
