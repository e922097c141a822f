"""The plan before the bill: how many extraction servers, GPU-hours and disk N samples take, per data source.

``plan_run`` is arithmetic over the user's own figures (no stage runs, nothing is read but an optional 02
``metrics.json``): samples x mean tokens, 03's epochs and held-out share, one extraction server's measured
target tokens/s (the user's figure or 02's ``metrics.json``), the storage's bytes/token, the free disk, the
servers available and a deadline. Per data source (03's ``data_source``):

- ``stored``: 02 runs the target once over every sample and keeps its states (disk = tokens x bytes/token);
- ``online``: no disk; the target runs over the training split every epoch, and over the held-out samples at
  every evaluation;
- ``hybrid``: the target once per sample, its states kept as it goes (the disk of stored).

For each: target forward tokens, extraction server-hours and GPU-hours, disk, the wall time with the servers
available, the servers needed to meet the deadline, and which is the wall: ``disk`` (the states do not fit),
``servers`` (too few to meet the deadline), both, or none. An estimate: the throughput is assumed to hold at
this scale and to add up over servers, and training is assumed to wait for the target.

``eagle3nb plan --samples 1000000 --tokens-per-sample 1444 --tokens-per-s 3165 ...`` prints it.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from eagle3nb.errors import InputError

SOURCES = ("stored", "online", "hybrid")
GB = 1e9


def plan_run(samples: int, tokens_per_sample: float, tokens_per_s: float, bytes_per_token: float,
             free_disk_bytes: float, servers: int, deadline_h: float, epochs: int = 2,
             holdout_fraction: float = 0.1, evaluations: int = 2, gpus_per_server: int = 8) -> dict[str, Any]:
    """Per data source: ``target_tokens``, ``server_hours``, ``gpu_hours``, ``disk_bytes``, ``wall_h`` (with
    ``servers`` servers), ``servers_needed`` (to finish the target's work within ``deadline_h``), ``fits_disk``,
    ``meets_deadline`` and ``wall`` ("disk", "servers", "disk and servers" or None). ``tokens_per_s`` is one
    server's extraction throughput; ``evaluations`` counts 03's held-out evaluations (start and end at least)."""
    if samples < 1 or tokens_per_sample <= 0 or tokens_per_s <= 0 or bytes_per_token <= 0:
        raise InputError("samples, tokens per sample, tokens/s and bytes/token must be positive")
    if servers < 1 or gpus_per_server < 1 or deadline_h <= 0 or epochs < 1 or evaluations < 0:
        raise InputError("servers, GPUs per server, epochs and the deadline must be positive")
    if not 0 <= holdout_fraction < 1:
        raise InputError("holdout_fraction must be in [0, 1)")
    tokens = samples * tokens_per_sample
    train_tokens, held_tokens = tokens * (1 - holdout_fraction), tokens * holdout_fraction
    target = {"stored": tokens, "online": epochs * train_tokens + evaluations * held_tokens, "hybrid": tokens}
    disk = {"stored": tokens * bytes_per_token, "online": 0.0, "hybrid": tokens * bytes_per_token}
    out: dict[str, Any] = {}
    for name in SOURCES:
        server_s = target[name] / tokens_per_s
        needed = max(1, math.ceil(server_s / (deadline_h * 3600)))
        fits, meets = disk[name] <= free_disk_bytes, needed <= servers
        wall = " and ".join(w for w, ok in (("disk", fits), ("servers", meets)) if not ok) or None
        out[name] = {"target_tokens": target[name], "server_hours": server_s / 3600,
                     "gpu_hours": server_s / 3600 * gpus_per_server, "disk_bytes": disk[name],
                     "wall_h": server_s / 3600 / servers, "servers_needed": needed, "fits_disk": fits,
                     "meets_deadline": meets, "wall": wall}
    return {"samples": samples, "tokens": tokens, "tokens_per_s": tokens_per_s, "bytes_per_token": bytes_per_token,
            "free_disk_bytes": free_disk_bytes, "servers": servers, "deadline_h": deadline_h, "epochs": epochs,
            "holdout_fraction": holdout_fraction, "evaluations": evaluations, "gpus_per_server": gpus_per_server,
            "sources": out}


def plan_table(plan: dict[str, Any]) -> str:
    """The plan as a Markdown table and the inputs it was made from."""
    rows = ["| source | target forward tokens | server-hours | GPU-hours | disk (GB) | wall time with "
            f"{plan['servers']} server(s) | servers for {plan['deadline_h']:g} h | the wall |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, f in plan["sources"].items():
        rows.append(f"| {name} | {f['target_tokens']:,.0f} | {f['server_hours']:,.1f} | {f['gpu_hours']:,.1f} | "
                    f"{f['disk_bytes'] / GB:,.0f} | {f['wall_h']:,.1f} h | {f['servers_needed']} | "
                    f"{f['wall'] or 'none: fits'} |")
    rows.append(f"\n{plan['samples']:,} samples x {plan['tokens'] / plan['samples']:,.0f} tokens = "
                f"{plan['tokens']:,.0f} tokens; {plan['tokens_per_s']:,.0f} target tokens/s per server "
                f"({plan['gpus_per_server']} GPUs each); {plan['bytes_per_token']:,.0f} bytes/token; "
                f"{plan['free_disk_bytes'] / GB:,.0f} GB free; {plan['epochs']} epochs, "
                f"{plan['holdout_fraction']:.0%} held out, evaluated {plan['evaluations']} times. An estimate: "
                "the throughput is assumed to hold and to add up over servers.")
    return "\n".join(rows)


def _main(args: argparse.Namespace) -> int:
    tps, bpt = args.tokens_per_s, args.bytes_per_token
    if args.metrics:
        path = Path(args.metrics)
        if path.is_dir():
            path = path / "metrics.json"
        if not path.is_file():
            raise InputError(f"--metrics {args.metrics}: no 02 metrics.json there")
        m = json.loads(path.read_text())
        tps = tps or m.get("tokens_per_s")
        bpt = bpt or m.get("bytes_per_token")
    if not tps or not bpt:
        raise InputError("give --tokens-per-s and --bytes-per-token (or --metrics with 02's metrics.json)")
    plan = plan_run(args.samples, args.tokens_per_sample, float(tps), float(bpt), args.free_disk_gb * GB,
                    args.servers, args.deadline_h, epochs=args.epochs, holdout_fraction=args.holdout_fraction,
                    evaluations=args.evaluations, gpus_per_server=args.gpus_per_server)
    print(json.dumps(plan, indent=1) if args.json else plan_table(plan))
    return 0


def register_cli(sub) -> None:
    p = sub.add_parser("plan", help="extraction servers, GPU-hours and disk for N samples, online vs stored vs hybrid",
                       description="The plan before the bill: how many extraction servers, GPU-hours and disk N "
                                   "samples take, per data source (stored, online, hybrid), from your own figures.")
    p.add_argument("--samples", type=int, required=True, help="samples to train on")
    p.add_argument("--tokens-per-sample", type=float, required=True, help="mean tokens per sample")
    p.add_argument("--tokens-per-s", type=float, default=None,
                   help="one extraction server's measured target tokens/s (else --metrics)")
    p.add_argument("--bytes-per-token", type=float, default=None,
                   help="the storage's bytes/token (02's metrics.json bytes_per_token; bf16 at Kimi's width: 57352)")
    p.add_argument("--metrics", default=None, help="02's metrics.json (or its folder): tokens/s and bytes/token")
    p.add_argument("--free-disk-gb", type=float, required=True, help="free disk for hidden states, GB")
    p.add_argument("--servers", type=int, default=1, help="extraction servers available")
    p.add_argument("--gpus-per-server", type=int, default=8, help="GPUs of one extraction server")
    p.add_argument("--deadline-h", type=float, required=True, help="hours the target's work may take")
    p.add_argument("--epochs", type=int, default=2, help="03's epochs (online runs the target every epoch)")
    p.add_argument("--holdout-fraction", type=float, default=0.1, help="03's held-out share")
    p.add_argument("--evaluations", type=int, default=2, help="03's held-out evaluations (online re-runs them)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_main)
