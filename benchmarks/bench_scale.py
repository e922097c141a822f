"""Sized for a million: what every stage's resume, index and split cost at 10K, 100K and 1M samples.

Index-level data only: short token lists (``--tokens``, mean 24 per sample), no hidden states. Each size is
written in the real formats by the real writers: 01's ``SampleWriter`` (records with 01's fields, in 4 sessions,
as a run resumed 3 times leaves them), 02's ``make_plan`` / ``plan.json`` / ``write_index`` with one tiny shard
file per shard of the default ``shard_tokens`` (a real ``write_shard`` of one small tensor, so the size checks
pass) and its draft vocabulary, 03's default parameters. The target is the toy (``toy:smoke``): only its
config.json is read; no model runs.

Each operation runs in its own subprocess; time is wall seconds of the operation alone, memory is the
operation's own peak resident set above what the process held before it (its inputs loaded): Linux's peak RSS
(``VmHWM``) reset just before the operation (``/proc/self/clear_refs``), minus ``VmRSS`` then; elsewhere the
``resource.getrusage`` ``ru_maxrss`` delta, which the imports' own peak can hide:

- ``01 resume``: ``latest(synth_dir, light=True)`` and the prompts still to answer (what ``synth/stage.py`` does
  on resume; its metrics read ``latest(light=True)`` again at the end, the same cost).
- ``02 prepare``: ``prepare_samples`` (01's records read in full, filtered, cut, sorted).
- ``02 plan``: ``make_plan`` (the above, the draft vocabulary, shards, the config hash, resume over the shards of
  ``plan.json``, the disk check); the target's forward is not part of it.
- ``02 index``: ``write_index`` (what 02 writes last).
- ``02 open``: ``HiddenStates(dir)`` (index.json read, every shard's size checked, the vocabulary loaded).
- ``03 split``: ``split_holdout`` over the index's ids.
- ``03 layout``: ``Layout.of`` (the split and every optimizer step's micro-batches, 03's defaults: 12 epochs).

``python -m benchmarks.bench_scale`` (about 5 minutes; 0.76 GB of disk at 1M) or ``--quick`` (10K and 100K,
projected to 1M). Growth above 10x per 10x samples is flagged.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import ROOT, command_line, table

SESSIONS = 4  # 01 writes one file per session: a run resumed three times
OPS = ("01 resume", "02 prepare", "02 plan", "02 index", "02 open", "03 split", "03 layout")
MODEL = "toy:smoke"
REAL_TOKENS = 1444  # the original Kimi run's mean tokens per sample (for the shard count at real lengths)


def hidden_params(root: Path):
    from eagle3nb.params import from_dict

    return from_dict("02_hidden_states", {"synth_dir": str(root / "01_synth"), "model_path": MODEL,
                                          "output_dir": str(root / "02_hidden_states"), "run_name": "scale"})


def train_params(root: Path):
    from eagle3nb.params import from_dict

    return from_dict("03_train", {"data_dir": str(root / "02_hidden_states"), "output_dir": str(root / "03_train"),
                                  "run_name": "scale"})


def model_parts(P):
    from eagle3nb.data.head import target_info
    from eagle3nb.hidden.prepare import aux_layer_ids

    info = target_info(P.model_dir)
    return P.model_dir, info, aux_layer_ids(P, info["num_layers"])


def build(root: Path, n: int, tokens: int, seed: int = 0) -> dict:
    """01's records, 02's plan.json / shards / index.json / vocabulary for ``n`` samples under ``root``."""
    from contextlib import redirect_stdout

    import torch

    from eagle3nb.data.samples import SampleWriter
    from eagle3nb.data.shards import write_shard
    from eagle3nb.data.vocab import VOCAB_FILE, save_draft_vocab
    from eagle3nb.hidden.extract import write_index
    from eagle3nb.hidden.prepare import make_plan

    rng = random.Random(seed)
    P = hidden_params(root)
    model_dir, info, layer_ids = model_parts(P)
    V = info["vocab_size"]
    synth = root / "01_synth"
    per = math.ceil(n / SESSIONS)
    t0 = time.perf_counter()
    for s in range(SESSIONS):
        w = SampleWriter(synth)
        for start in range(s * per, min(n, (s + 1) * per), 1000):
            batch = []
            for i in range(start, min(n, (s + 1) * per, start + 1000)):
                L = rng.randint(tokens // 2, tokens * 3 // 2)
                p = max(1, L // 4)
                status = "ok" if i % 100 else "error"
                ids = [rng.randrange(7, V) for _ in range(L)] if status == "ok" else []
                batch.append({"id": f"p{i:07d}", "status": status,
                              "messages": [{"role": "user", "content": f"question {i}"}],
                              "reasoning": "r" if ids else None, "content": "c" if ids else None,
                              "finish_reason": "stop" if ids else None, "input_ids": ids,
                              "loss_mask": [0] * p + [1] * (L - p) if ids else [], "thinking": True,
                              "category": "bench", "token_source": "server" if ids else None,
                              "ids_match": True if ids else None, "usage": None, "latency_s": 1.0,
                              "error": None if ids else "APIError: bench",
                              "tokens": {"prompt": p, "reasoning": L - p - 1, "content": 1} if ids else
                              {"prompt": 0, "reasoning": 0, "content": 0},
                              "attempts": 1, "finished_at": 0.0})
            w.write(batch)
        w.close()
    t_synth = time.perf_counter() - t0
    t0 = time.perf_counter()
    (P.stage_dir).mkdir(parents=True, exist_ok=True)
    with redirect_stdout(open(os.devnull, "w")):
        plan = make_plan(P, model_dir, info, layer_ids)
    for sh in plan.shards:  # a tiny but whole safetensors file per shard: the size and header checks pass
        sh.update(write_shard(P.stage_dir / sh["file"], {"0.input_ids": torch.zeros(1, dtype=torch.int32)}),
                  done=True, seconds=0.0)
    plan.save(P.stage_dir)
    save_draft_vocab(P.stage_dir / VOCAB_FILE, plan.vocab)
    write_index(P, plan, model_dir, info, layer_ids)
    t_hidden = time.perf_counter() - t0
    return {"build_s": {"01": t_synth, "02": t_hidden}, "tokens": plan.total_tokens, "shards": len(plan.shards),
            "files_01": len(list(synth.glob("samples-*.jsonl")))}


def measure(op: str, root: Path) -> dict:
    """One operation in this (fresh) process: its seconds and its own peak RSS above what it was given."""
    from contextlib import redirect_stdout

    from eagle3nb.data.reader import INDEX_FILE, HiddenStates
    from eagle3nb.data.samples import latest
    from eagle3nb.data.split import split_holdout
    from eagle3nb.hidden.extract import write_index
    from eagle3nb.hidden.prepare import make_plan, prepare_samples
    from eagle3nb.synth.resume import needs_request
    from eagle3nb.train.loop import Layout

    P = hidden_params(root)
    args: tuple = ()
    if op == "01 resume":
        n = sum(1 for _ in open(next((root / "01_synth").glob("samples-*.jsonl")))) * SESSIONS
        prompts = [{"id": f"p{i:07d}"} for i in range(n)]
    elif op in ("02 plan", "02 index"):
        model = model_parts(P)
    if op == "02 index":
        with redirect_stdout(open(os.devnull, "w")):
            plan = make_plan(P, *model)
    if op in ("03 split", "03 layout"):
        meta = json.loads((P.stage_dir / INDEX_FILE).read_text())
        TP = train_params(root)
    before = rss_reset()
    t0 = time.perf_counter()
    with redirect_stdout(open(os.devnull, "w")):
        if op == "01 resume":
            done = latest(root / "01_synth", light=True, torn=[])
            args = ([p for p in prompts if needs_request(done.get(p["id"]), False)],)
        elif op == "02 prepare":
            args = prepare_samples(P)
        elif op == "02 plan":
            args = (make_plan(P, *model),)
        elif op == "02 index":
            write_index(P, plan, *model)
        elif op == "02 open":
            args = (HiddenStates(P.stage_dir),)
        elif op == "03 split":
            args = split_holdout([s["id"] for s in meta["samples"]], TP.holdout_fraction)
        elif op == "03 layout":
            args = (Layout.of(TP, meta, 1),)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "mb": (rss_peak() - before) / 1e6, "kept": len(args)}


def _status_bytes(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(text.split(f"{field}:")[1].split()[0]) * 1024


def rss_reset() -> int:
    """Reset the peak RSS (Linux) and return the RSS now; elsewhere the ru_maxrss so far (bytes)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_bytes("VmRSS")
    except OSError:
        return rss_peak()


def rss_peak() -> int:
    try:
        return _status_bytes("VmHWM")
    except OSError:
        scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def run_op(op: str, root: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_scale", "--measure", op, "--root", str(root)],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"{op} at {root} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def disk_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6


def parser() -> argparse.ArgumentParser:
    ap = command_line(__doc__)
    ap.add_argument("--sizes", default="10000,100000,1000000", help="sample counts, comma-separated")
    ap.add_argument("--quick", action="store_true", help="10K and 100K only (projected to 1M and 2M)")
    ap.add_argument("--tokens", type=int, default=24, help="mean tokens per synthetic sample")
    ap.add_argument("--dir", default=None, help="where to build the data (default: a temporary folder, removed)")
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # internal: one operation per subprocess
    ap.add_argument("--root", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    a = parser().parse_args(argv)
    if a.measure:
        print(json.dumps(measure(a.measure, Path(a.root))))
        return
    sizes = [10_000, 100_000] if a.quick else [int(s) for s in a.sizes.split(",")]
    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="bench_scale-"))
    results: dict[int, dict] = {}
    try:
        for n in sizes:
            root = base / f"n{n}"
            shutil.rmtree(root, ignore_errors=True)
            t0 = time.perf_counter()
            info = build(root, n, a.tokens)
            info["disk_mb"] = disk_mb(root)
            print(f"built {n:,} samples in {time.perf_counter() - t0:.1f} s (01 {info['build_s']['01']:.1f} s, "
                  f"02 {info['build_s']['02']:.1f} s): {info['tokens']:,} tokens, {info['files_01']} 01 files, "
                  f"{info['shards']:,} shards, {info['disk_mb']:.0f} MB", flush=True)
            info["ops"] = {}
            for op in OPS:
                info["ops"][op] = r = run_op(op, root)
                print(f"  {op:<11} {r['seconds']:8.2f} s {r['mb']:9.1f} MB", flush=True)
            results[n] = info
            if not a.dir:
                shutil.rmtree(root, ignore_errors=True)
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    report(results, a.tokens)


def report(results: dict[int, dict], tokens: int) -> None:
    sizes = sorted(results)
    print(f"\nper size x operation: seconds / peak MB above the inputs (VmHWM reset, one subprocess each); "
          f"{tokens} tokens per sample on average")
    rows = [[op, *(f"{results[n]['ops'][op]['seconds']:.2f} s, {results[n]['ops'][op]['mb']:.0f} MB" for n in sizes)]
            for op in OPS]
    rows.append(["01 files / 02 shards", *(f"{results[n]['files_01']} / {results[n]['shards']:,}" for n in sizes)])
    rows.append(["disk (MB)", *(f"{results[n]['disk_mb']:.0f}" for n in sizes)])
    print(table(["operation", *(f"{n:,}" for n in sizes)], rows))
    print("\ngrowth of seconds (memory) per 10x samples; above 10x is flagged")
    flagged = []
    for op in OPS:
        cells = []
        for lo, hi in zip(sizes, sizes[1:]):
            a, b = results[lo]["ops"][op], results[hi]["ops"][op]
            per10 = math.log(10) / math.log(hi / lo)  # ratios normalised to a 10x step in samples
            rt = (b["seconds"] / max(a["seconds"], 1e-4)) ** per10
            rm = (max(b["mb"], 1) / max(a["mb"], 1)) ** per10
            flag = " SUPER-LINEAR" if rt > 10 * 1.5 or rm > 10 * 1.5 else ""
            if flag:
                flagged.append(f"{op} {lo:,}->{hi:,}")
            cells.append(f"{lo:,}->{hi:,}: {rt:.1f}x ({rm:.1f}x){flag}")
        print(f"  {op:<11} " + "; ".join(cells))
    print("flagged: " + (", ".join(flagged) if flagged else "none (1.5x margin over 10x for timing noise)"))
    top = sizes[-1]
    print(f"\nprojection (linear from {top:,}; per operation seconds, MB):")
    for target in (1_000_000, 2_000_000):
        f = target / top
        t = sum(results[top]["ops"][op]["seconds"] for op in OPS) * f
        m = max(results[top]["ops"][op]["mb"] for op in OPS) * f
        shards = results[top]["shards"] * f
        print(f"  {target:,} samples: {t:.0f} s for all seven operations, largest peak {m:.0f} MB, "
              f"{SESSIONS} 01 files (one per session), {shards:,.0f} shards at {tokens} tokens/sample, "
              f"{math.ceil(target * REAL_TOKENS / 16384):,} at the original run's {REAL_TOKENS:,} tokens/sample "
              "(shard_tokens 16384)")


if __name__ == "__main__":
    main()
