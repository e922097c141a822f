"""Where 03's hidden states come from, and what each choice costs for the run at hand.

``stored`` reads 02's shards. ``online`` and ``hybrid`` compute them from 01's samples with 02's own pieces
(:class:`eagle3nb.hidden.online.OnlineStates`), set up by 02's parameters of the same run: ``online`` stores
nothing and runs the target over every micro-batch of every epoch (and over the held-out samples at each
evaluation); ``hybrid`` runs it once per sample and keeps the result in 02's storage in ``output_dir/hidden_cache``.
The three give 03 the same samples in the same order, so the split and the micro-batches are the same. Under
torchrun (online and hybrid need 02's backend vllm there) each process asks its share of 02's ``vllm_url``
servers for its own micro-batches, and the processes share one hybrid cache (``docs/scale.md``).

:func:`source_costs` says before training what each costs: disk, target forward tokens, and the target's time
at a measured extraction throughput (02's ``metrics.json``, else a short measurement here, else unknown).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eagle3nb.data.reader import HiddenStates
from eagle3nb.data.shards import ShardError, bytes_per_token
from eagle3nb.hidden.online import OnlineStates
from eagle3nb.params import ParamsError, StageError, StageParams, from_dict
from eagle3nb.params_yaml import stage_values
from eagle3nb.paths import file_sha256, project_root, resolve
from eagle3nb.progress import write_json_atomic
from eagle3nb.train.data import layout
from eagle3nb.train.params import TrainParams

CACHE_DIR = "hidden_cache"
# what decides which samples the target runs over together (the hybrid cache is valid under the same values)
SCHEDULE_KEYS = ("seed", "batch_tokens", "max_length", "holdout_fraction", "epochs", "max_steps", "grad_accum")


class MissingData(StageError, FileNotFoundError):
    """data_dir (02's output) does not exist."""


class SourceError(StageError):
    """The chosen data source cannot run this way; the message says what to change."""


def hidden_params(P: TrainParams) -> StageParams:
    """02's parameters (``HiddenParams``) of this run (``hidden_params``, else the run folder of ``params_file``,
    else ``params/<run_name>/``), writing where 03 reads: ``output_dir`` = 03's ``data_dir``."""
    if P.hidden_params:
        src = resolve(P.hidden_params)
    elif P.params_file:
        src = Path(P.params_file).parent
    else:
        src = project_root() / "params" / P.run_name
    try:
        values = stage_values("02_hidden_states", src, [])
    except ParamsError as e:
        raise ParamsError(f"data_source {P.data_source} needs 02's parameters (the target, layers, draft vocabulary, "
                          f"storage, backend): {e}; set hidden_params to a params/<run>/ folder or its "
                          "02_hidden_states.yaml") from None
    values.update(output_dir=str(P.data_path), run_name=P.run_name)
    return from_dict("02_hidden_states", values)


VERIFIED_DIR = "verified_shards"  # one small file per shard 03 has hashed against 02's index


def verify_shards(data: HiddenStates, record: Path, rank: int, world: int) -> None:
    """Every shard's sha256 against the one 02 recorded, before the first step trains on it: each process
    hashes its share (``shards[rank::world]``), and a shard once verified is recorded in ``record`` with its
    size and mtime, so a resume does not hash hundreds of GB again. A shard whose bytes differ stops the run."""
    record.mkdir(parents=True, exist_ok=True)
    for s in data.meta["shards"][rank::world]:
        path = data.dir / s["file"]
        st = path.stat()
        stamp = {"sha256": s["sha256"], "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
        mark = record / f"{s['file']}.json"
        if mark.exists() and json.loads(mark.read_text()) == stamp:
            continue
        if file_sha256(path) != s["sha256"]:
            raise ShardError(f"{path}: its bytes differ from the sha256 02 recorded in {data.dir / 'index.json'} "
                             f"(a corrupt copy or disk); re-run 02_hidden_states on {data.dir} (it redoes shards "
                             f"whose hash differs) and train again")
        write_json_atomic(mark, stamp)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()  # no process trains before every share is checked


def open_data(P: TrainParams, world: int = 1) -> HiddenStates:
    """The hidden states 03 trains on, per ``P.data_source`` (all offer HiddenStates' interface)."""
    if P.data_source == "stored":
        if not P.data_path.is_dir():
            raise MissingData(f"data_dir {P.data_path} does not exist; run 02_hidden_states first, point data_dir "
                              "at its output folder, or train with data_source: online (no stored states)")
        data = HiddenStates(P.data_path)
        verify_shards(data, P.stage_dir / VERIFIED_DIR, int(os.environ.get("RANK", "0")), world)
        return data
    HP = hidden_params(P)
    if world > 1 and HP.backend != "vllm":
        raise SourceError(f"data_source {P.data_source} under torchrun needs 02's backend vllm (extraction servers "
                          "the processes share: vllm_url, one or a list); with the transformers backend every "
                          "process would load the target")
    key = {k: getattr(P, k) for k in SCHEDULE_KEYS}
    rank = int(os.environ.get("RANK", "0"))
    barrier = None
    if world > 1:
        import torch.distributed as dist

        barrier = dist.barrier
    return OnlineStates(HP, max_length=P.max_length, cache_key={**key, "processes": world},
                        cache_dir=P.stage_dir / CACHE_DIR if P.data_source == "hybrid" else None,
                        verify_sha256=HP.verify_sha256, write_files=rank == 0, share=(rank, world),
                        barrier=barrier)


def extraction_throughput(P: TrainParams, data: HiddenStates | None = None, measure: bool = True
                          ) -> tuple[float | None, str]:
    """(target tokens/s, where the number comes from): 02's metrics.json in data_dir, else a short measurement
    with the online source's target, else (None, "unknown")."""
    path = P.data_path / "metrics.json"
    if path.exists():
        tps = json.loads(path.read_text()).get("tokens_per_s")
        if tps:
            return float(tps), f"02's metrics.json ({path})"
    if measure and isinstance(data, OnlineStates):
        m = data.measure()
        if m["tokens_per_s"]:
            return m["tokens_per_s"], f"measured here ({m['tokens']:,} tokens in {m['seconds']:.1f} s)"
    return None, "unknown (02 has not run; measure with source_costs(P, measure=True) or run 02)"


def source_costs(P: TrainParams, data: HiddenStates | None = None, world: int = 1, measure: bool = True,
                 tokens_per_s: float | None = None, tokens_per_s_from: str | None = None) -> dict[str, Any]:
    """What ``stored``, ``online`` and ``hybrid`` cost for this run: hidden-state disk, target forward tokens
    (online: each epoch's tokens again, plus the held-out samples at every evaluation) and the target's time at
    the extraction throughput (given, from 02's metrics.json, measured briefly, or unknown). An estimate: the
    time assumes training waits for the target (no overlap) and the throughput holds at this scale."""
    data = data if data is not None else open_data(P, world)
    meta = data.meta
    train_idx, held_idx, plan, _ = layout(P, meta, world)
    full = [int(s["length"]) for s in meta["samples"]]
    cut = [min(n, P.max_length) for n in full]
    steps = len(plan)
    step_tokens = sum(cut[i] for _, mbs in plan for mb in mbs for i in mb)
    epoch_tokens = sum(cut[i] for i in train_idx)
    held_tokens = sum(cut[i] for i in held_idx)
    evals = len({0, steps, *(s for s in range(1, steps + 1) if P.eval_every and s % P.eval_every == 0)})
    visited = {i for _, mbs in plan for mb in mbs for i in mb} | set(held_idx)
    HP = getattr(data, "HP", None)
    storage = HP.storage if HP is not None else meta["storage"]
    topk = HP.topk if HP is not None else (meta.get("topk") or 32)
    bpt = bytes_per_token(storage, meta["hidden_size"], len(meta["layer_ids"]), topk, int(data.d2t.shape[0]))
    stored_bytes = (sum(s["bytes"] for s in meta["shards"]) if "shards" in meta and HP is None
                    else sum(full) * bpt)
    if tokens_per_s is None:
        tokens_per_s, tokens_per_s_from = extraction_throughput(P, data, measure)
    figures = {
        "stored": {"disk_bytes": stored_bytes, "target_tokens": sum(full)},
        "online": {"disk_bytes": 0, "target_tokens": step_tokens + evals * held_tokens},
        "hybrid": {"disk_bytes": sum(cut[i] for i in visited) * bpt,
                   "target_tokens": sum(cut[i] for i in visited)},
    }
    for f in figures.values():
        f["target_s"] = f["target_tokens"] / tokens_per_s if tokens_per_s else None
    return {"data_source": P.data_source, "storage": storage, "bytes_per_token": bpt, "steps": steps,
            "train_tokens_per_epoch": epoch_tokens, "epochs": step_tokens / max(epoch_tokens, 1),
            "heldout_tokens": held_tokens, "evaluations": evals, "tokens_per_s": tokens_per_s,
            "tokens_per_s_from": tokens_per_s_from, "sources": figures}


def _duration(s: float | None) -> str:
    if s is None:
        return "unknown"
    return f"{s / 3600:.1f} h" if s >= 3600 else f"{s / 60:.1f} min" if s >= 60 else f"{s:.1f} s"


def cost_table(costs: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per source (``source_costs`` output, or ``metrics["source_cost"]``): disk for hidden states, target
    forward tokens, target passes per token, the target's time, and which one this run uses."""
    rows = []
    distinct = costs["sources"]["hybrid"]["target_tokens"] or 1
    for name, f in costs["sources"].items():
        rows.append({"source": name, "used": "<-" if name == costs["data_source"] else "",
                     "hidden-state disk (GB)": round(f["disk_bytes"] / 1e9, 3),
                     "target forward tokens": f["target_tokens"],
                     "target passes per trained token": round(f["target_tokens"] / distinct, 2),
                     "target time": _duration(f["target_s"])})
    return rows


def cost_text(costs: dict[str, Any]) -> str:
    """The figures behind the table, in one paragraph."""
    tps = costs["tokens_per_s"]
    return (f"{costs['steps']} steps over {costs['train_tokens_per_epoch']:,} training tokens per epoch "
            f"({costs['epochs']:.2f} epochs) and {costs['heldout_tokens']:,} held-out tokens evaluated "
            f"{costs['evaluations']} times; storage {costs['storage']} at {costs['bytes_per_token']:,} bytes/token; "
            f"target throughput {f'{tps:,.0f} tokens/s' if tps else 'unknown'} from {costs['tokens_per_s_from']}. "
            "An estimate: it assumes training waits for the target and that the throughput holds.")


def source_metrics(P: TrainParams, data, world: int) -> dict[str, Any]:
    """Which data source trained the draft and what it cost (``source_costs``; the throughput is the one this
    run measured when it ran the target, else 02's)."""
    out: dict[str, Any] = {"data_source": P.data_source}
    measured: dict[str, Any] = {}
    if P.data_source != "stored":
        tps = data.target_tokens / data.target_s if data.target_s > 0 else None
        measured = {"tokens_per_s": tps, "tokens_per_s_from": "measured in this run" if tps else None}
        out["target_forward"] = {"tokens": data.target_tokens, "seconds": data.target_s, "tokens_per_s": tps}
    if P.data_source == "hybrid":
        out["hybrid_cache"] = {"dir": str(P.stage_dir / CACHE_DIR), "bytes": data.cache_bytes(),
                               "shards": len(data.cache_shards), "redone_shards": data.redone}
    given = measured if measured.get("tokens_per_s") else {}
    out["source_cost"] = source_costs(P, data, world, measure=False, **given)
    return out
