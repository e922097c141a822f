"""02's plan, fixed before any work: 01's samples to extract (filtered, cut to ``max_length``, in extraction
order), the draft vocabulary, the shards (those an earlier run finished taken over, each verified), the settings
they are made with, and the disk the rest will take, checked against the free space.

03's online source (``hidden.online``) makes the same plan per micro-batch: ``prepare_samples``,
``aux_layer_ids`` and ``data_key`` are what it shares with the stage, so its samples, order and ids are 02's.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from eagle3nb.data.head import text_config
from eagle3nb.data.reader import INDEX_FILE
from eagle3nb.data.samples import latest, sample_files
from eagle3nb.data.shards import ShardError, bytes_per_token, check_shard, shard_name
from eagle3nb.data.vocab import VOCAB_FILE, build_draft_vocab, keep_draft_vocab
from eagle3nb.drafts import method_layer_ids
from eagle3nb.hidden.params import HiddenParams
from eagle3nb.layers import check_layer_ids
from eagle3nb.params import StageError
from eagle3nb.paths import resolve
from eagle3nb.progress import read_progress, write_json_atomic

PLAN_FILE = "plan.json"
GB = 1e9


class HiddenStatesError(StageError):
    """A problem found before (or instead of) doing the work, phrased with what to do."""


def check_synth_finished(P: HiddenParams, torn: list[str]) -> None:
    """01's output is whole: its progress says done and no file ends in a torn line (a kill mid-write), unless
    ``allow_partial_synth`` says a partial one will do."""
    if P.allow_partial_synth:
        return
    fix = "resume 01_synth (run it again: it continues where it stopped), or set allow_partial_synth: true"
    state = (read_progress(P.synth_path) or {}).get("state")
    if state is not None and state != "done":
        raise HiddenStatesError(f"01_synth's output {P.synth_path} is not finished (its progress says {state!r}): "
                                f"{fix}")
    if torn:
        raise HiddenStatesError(f"01_synth's output {P.synth_path} ends in a torn line ({', '.join(torn)}: a run "
                                f"killed mid-write): {fix}")


def prepare_samples(P: HiddenParams) -> tuple[list[dict], dict]:
    """01's samples to extract, cut to ``max_length``, in extraction order (by length, then id), and a report of
    every sample left out and why."""
    if not P.synth_path.is_dir():
        raise HiddenStatesError(f"synth_dir {P.synth_path} does not exist: run 01_synth first or set synth_dir")
    torn: list[str] = []
    try:
        # 01's texts are not part of 02's input: dropped as each record is read
        records = sorted(latest(P.synth_path, torn=torn, drop=("messages", "reasoning", "content")).values(),
                         key=lambda r: r["id"])
    except FileNotFoundError as e:
        raise HiddenStatesError(str(e)) from None
    if not sample_files(P.synth_path):
        raise HiddenStatesError(f"no samples-*.jsonl in {P.synth_path}: run 01_synth first (or point synth_dir at "
                                f"its output_dir)")
    check_synth_finished(P, torn)
    dropped: dict[str, int] = {}
    keep = []
    for r in records:
        reason = None
        if r.get("status") not in P.statuses:
            reason = f"status_{r.get('status')}"
        elif not r.get("input_ids") or len(r.get("loss_mask") or []) != len(r["input_ids"]):
            reason = "bad_record"
        if reason:
            dropped[reason] = dropped.get(reason, 0) + 1
        else:
            keep.append(r)
    if P.max_samples is not None and len(keep) > P.max_samples:
        dropped["over_max_samples"] = len(keep) - P.max_samples
        keep = keep[:P.max_samples]
    samples, truncated = [], 0
    for r in keep:
        ids, mask = r["input_ids"], [int(m) for m in r["loss_mask"]]  # ids: a list of its own, parsed from JSON
        if len(ids) > P.max_length:
            ids, mask, truncated = ids[:P.max_length], mask[:P.max_length], truncated + 1
        if not any(mask):
            dropped["no_loss_tokens"] = dropped.get("no_loss_tokens", 0) + 1
            continue
        samples.append({"id": str(r["id"]), "input_ids": ids, "loss_mask": mask, "category": r.get("category")})
    if not samples:
        raise HiddenStatesError(f"no usable samples in {P.synth_path} (statuses {P.statuses}; left out: {dropped}); "
                                "check 01_synth's metrics or widen statuses")
    samples.sort(key=lambda s: (len(s["input_ids"]), s["id"]))
    return samples, {"records": len(records), "used": len(samples), "dropped": dropped, "truncated": truncated}


def plan_shards(samples: list[dict], shard_tokens: int) -> list[dict]:
    """Consecutive samples grouped into shards of about ``shard_tokens`` tokens."""
    shards, cur, n = [], [], 0
    for s in samples:
        cur.append(s["id"])
        n += len(s["input_ids"])
        if n >= shard_tokens:
            shards.append({"file": shard_name(len(shards)), "samples": cur, "num_tokens": n, "done": False})
            cur, n = [], 0
    if cur:
        shards.append({"file": shard_name(len(shards)), "samples": cur, "num_tokens": n, "done": False})
    return shards


def head_bytes(model_dir: Path, info: dict) -> int:
    """Bytes of target_head.safetensors (embed + lm_head + norm in the target's dtype)."""
    cfg = text_config(model_dir)
    width = {"float32": 4, "float64": 8}.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"), 2)
    return (2 * info["vocab_size"] + 1) * info["hidden_size"] * width


def disk_check(P: HiddenParams, remaining_tokens: int, bpt: int, extra: int, total_tokens: int) -> dict:
    """Print the projected disk use; refuse when it exceeds the free space (unless ``force``)."""
    stage_dir = P.stage_dir
    free = shutil.disk_usage(stage_dir).free
    need = remaining_tokens * bpt + extra
    line = (f"projected disk use: {need / GB:.3f} GB still to write ({remaining_tokens:,} of {total_tokens:,} tokens x "
            f"{bpt:,} bytes/token with storage '{P.storage}' + {extra / GB:.3f} GB head/vocab); "
            f"{total_tokens * bpt / GB:.3f} GB for the whole run; free on {stage_dir}: {free / GB:.3f} GB")
    print(line, flush=True)
    if need > free and not P.force:
        raise HiddenStatesError(f"{line}. Not starting: free space, choose a compact storage (fp8 or topk), lower "
                                "max_samples / max_length, or set force: true")
    return {"projected_bytes": total_tokens * bpt + extra, "projected_remaining_bytes": need, "free_bytes": free}


def samples_sha256(samples: list[dict], chunk: int = 1024) -> str:
    """sha256 of ``json.dumps([(id, input_ids, loss_mask), ...])``, fed a chunk of samples at a time: the same
    digest without the whole JSON text in memory (gigabytes at a million samples)."""
    h = hashlib.sha256(b"[")
    for start in range(0, len(samples), chunk):
        part = json.dumps([(s["id"], s["input_ids"], s["loss_mask"]) for s in samples[start:start + chunk]])
        h.update(((", " if start else "") + part[1:-1]).encode())
    h.update(b"]")
    return h.hexdigest()


def data_key(P: HiddenParams, info: dict, layer_ids: list[int], samples: list[dict]) -> dict:
    """What the shards are made with: 02's data settings, the layers, the target's fingerprint and the samples
    (an earlier run's shards are taken over only under the same key; the hybrid cache keys on it too)."""
    return {**P.data_config(), "aux_layer_ids": layer_ids, "model_fingerprint": info["fingerprint"],
            "samples_sha256": samples_sha256(samples)}


def resume_shards(P: HiddenParams, config: dict, shards: list[dict]) -> dict:
    """Take over the finished shards of an earlier run with the same config; verify each one."""
    stage_dir = P.stage_dir
    for tmp in stage_dir.glob(".shard-*.tmp"):
        tmp.unlink()
    path = stage_dir / PLAN_FILE
    resumed = {"resumed_shards": 0, "redone_shards": []}
    if not path.exists():
        return resumed
    old = json.loads(path.read_text())
    if old.get("config") != config:
        before = old.get("config", {})
        diff = sorted(k for k in set(config) | set(before) if config.get(k) != before.get(k))
        if not P.force:
            raise HiddenStatesError(
                f"{stage_dir} holds hidden states made with other settings ({', '.join(diff)} differ). Choose another "
                "output_dir, restore the old settings to resume, or set force: true to discard the old shards")
        print(f"force: discarding the shards of an earlier run ({', '.join(diff)} differ)", flush=True)
        for f in stage_dir.glob("shard-*.safetensors"):
            f.unlink()
        (stage_dir / INDEX_FILE).unlink(missing_ok=True)
        return resumed
    old_by_file = {s["file"]: s for s in old.get("shards", [])}
    for s in shards:
        o = old_by_file.get(s["file"])
        if not (o and o.get("done") and o["samples"] == s["samples"]):
            continue
        try:
            check_shard(stage_dir / s["file"], o["bytes"], o["sha256"] if P.verify_sha256 else None)
        except ShardError as e:
            print(f"redoing {s['file']}: {e}", flush=True)
            resumed["redone_shards"].append(s["file"])
            (stage_dir / s["file"]).unlink(missing_ok=True)
            continue
        s.update({k: o[k] for k in ("done", "bytes", "sha256", "seconds")})
        resumed["resumed_shards"] += 1
    return resumed


@dataclass
class Plan:
    """What a run does, fixed before any work: the samples in extraction order, the draft vocabulary, the shards
    (those already on disk marked done), the settings they are made with, and the disk the rest will take."""

    samples: list[dict]
    sample_report: dict
    vocab: dict
    shards: list[dict]
    config: dict
    resume: dict
    bytes_per_token: int
    disk: dict
    remaining_tokens: int  # tokens of the shards still to compute when the run started

    @property
    def by_id(self) -> dict[str, dict]:
        return {s["id"]: s for s in self.samples}

    @property
    def total_tokens(self) -> int:
        return sum(s["num_tokens"] for s in self.shards)

    def save(self, stage_dir: Path) -> None:
        """``plan.json``: the config and every shard's state (rewritten after each finished shard)."""
        write_json_atomic(stage_dir / PLAN_FILE, {"config": self.config, "shards": self.shards})


def aux_layer_ids(P: HiddenParams, num_layers: int) -> list[int]:
    """The aux layer ids to capture (HF/vLLM ids): ``aux_layer_ids``, else those ``draft_method`` reads by its recipe
    (``eagle3nb.drafts.method_layer_ids``: EAGLE-3's ``[2, L//2, L-3]``, a block drafter's spread), the method the
    run's plan handed 02 from 03's parameters."""
    if P.aux_layer_ids is not None:
        return check_layer_ids(P.aux_layer_ids, num_layers)
    return check_layer_ids(method_layer_ids(P.draft_method, num_layers, P.draft_num_layers), num_layers)


def layers_for(P: HiddenParams) -> dict | None:
    """``index.json``'s record of the run's draft whose recipe chose the layers (``{"method", "num_layers"}``): what
    03 holds its method to before training on these states. None when the user set ``aux_layer_ids``, or 02 ran
    outside a run folder (no parameter file): such states are taken as stored, whatever draft trains on them."""
    if P.aux_layer_ids is not None or not P.params_file:
        return None
    return {"method": P.draft_method, "num_layers": P.draft_num_layers}


def make_plan(P: HiddenParams, model_dir: Path, info: dict, layer_ids: list[int]) -> Plan:
    """Samples, draft vocabulary and shards; the finished shards of an earlier run taken over; the projected disk
    use printed and checked against the free space."""
    samples, sample_report = prepare_samples(P)
    vocab = (keep_draft_vocab(samples, resolve(P.vocab_from) / VOCAB_FILE, info["vocab_size"], P.draft_vocab_size)
             if P.vocab_from else build_draft_vocab(samples, info["vocab_size"], P.draft_vocab_size))
    if vocab["note"]:
        print("draft vocab:", vocab["note"], flush=True)
    shards = plan_shards(samples, P.shard_tokens)
    config = data_key(P, info, layer_ids, samples)
    resumed = resume_shards(P, config, shards)
    total_tokens = sum(s["num_tokens"] for s in shards)
    remaining = sum(s["num_tokens"] for s in shards if not s.get("done"))
    bpt = bytes_per_token(P.storage, info["hidden_size"], len(layer_ids), P.topk, P.draft_vocab_size)
    disk = disk_check(P, remaining, bpt, head_bytes(model_dir, info), total_tokens)
    return Plan(samples, sample_report, vocab, shards, config, resumed, bpt, disk, remaining)
