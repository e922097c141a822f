"""Stage 02: run the target over 01's token stream and store the hidden states EAGLE-3 trains on.

Plan first, then work: the samples are filtered, cut to ``max_length``, sorted by length and assigned to
shards; the draft vocabulary is chosen; the disk the run will take is printed and checked against the free
space. Then each shard not already on disk (and intact) is computed and written atomically. A killed run
restarts at the first missing shard and produces the same files as an uninterrupted one.

``run(P)`` is what the notebook and ``python -m eagle3nb.hidden params/<run>/`` call; it also writes
``metrics.json`` and the report's figures (PNG). ``preview(P)`` says what a run will do before doing it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from eagle3nb import track
from eagle3nb.data.batching import pack_batches
from eagle3nb.data.head import TargetHead, read_head_tensors, target_info, text_config
from eagle3nb.data.reader import HEAD_FILE, INDEX_FILE
from eagle3nb.data.samples import latest, sample_files
from eagle3nb.data.shards import FORMAT, ShardError, bytes_per_token, check_shard, encode, shard_name, write_shard
from eagle3nb.data.vocab import VOCAB_FILE, build_draft_vocab, draft_target_ids, save_draft_vocab
from eagle3nb.hidden import report
from eagle3nb.hidden.capture import capture_batch, load_target
from eagle3nb.hidden.params import STAGE, HiddenParams
from eagle3nb.hidden.vllm_backend import VllmClient, vllm_command
from eagle3nb.layers import check_layer_ids, default_aux_layer_ids, to_sglang
from eagle3nb.params import StageError
from eagle3nb.progress import Progress, one_writer, read_progress, write_json_atomic

PLAN_FILE = "plan.json"
THROUGHPUT_FILE = "throughput.jsonl"
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


def _config(P: HiddenParams, info: dict, layer_ids: list[int], samples: list[dict]) -> dict:
    return {**P.data_config(), "aux_layer_ids": layer_ids, "model_fingerprint": info["fingerprint"],
            "samples_sha256": samples_sha256(samples)}


def _resume(P: HiddenParams, config: dict, shards: list[dict]) -> dict:
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


def preview(P: HiddenParams) -> dict:
    """What a run will do, before doing it: the target's shape, the layers (both conventions), the samples and
    tokens, bytes/token of every storage option, and the vLLM command line for the vllm backend."""
    model_dir = P.model_dir
    info = target_info(model_dir)
    L = info["num_layers"]
    layer_ids = aux_layer_ids(P, L)
    samples, sample_report = prepare_samples(P)
    tokens = sum(len(s["input_ids"]) for s in samples)
    return {**info, "model_dir": str(model_dir), "layer_ids": layer_ids, "sglang_layer_ids": to_sglang(layer_ids),
            "samples": len(samples), "tokens": tokens, **sample_report,
            "storage_table": report.storage_table(info["hidden_size"], tokens, len(layer_ids), P.topk,
                                                  P.draft_vocab_size),
            "vllm_command": vllm_command(P.model_path, layer_ids, L, P.max_length, P.api_key_env,
                                         trust_remote_code=P.trust_remote_code)}


def write_head(path: Path, tensors: dict) -> None:
    """The target's embed_tokens / lm_head / norm weights beside the data (temp name, then rename)."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


class TransformersSource:
    """The target loaded here; one forward per token-budget batch, hooks keep only the chosen states."""

    def __init__(self, P: HiddenParams, model_dir: Path, info: dict, layer_ids: list[int]):
        self.model = load_target(model_dir, P.dtype, trust_remote_code=P.trust_remote_code)
        cfg = self.model.config
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        if cfg.num_hidden_layers != info["num_layers"] or cfg.hidden_size != info["hidden_size"]:
            raise HiddenStatesError(f"{model_dir}: loaded model shape differs from its config.json")
        self.layer_ids, self.tokens_per_batch = layer_ids, P.tokens_per_batch

    def batches(self, shard_samples: list[dict]):
        """Yield ``(rows, aux [B, T, n, H], final [B, T, H])`` per batch (rows index ``shard_samples``)."""
        for rows in pack_batches([len(s["input_ids"]) for s in shard_samples], self.tokens_per_batch):
            aux, final = capture_batch(self.model, [shard_samples[r]["input_ids"] for r in rows], self.layer_ids)
            yield rows, aux, final


class VllmSource:
    """vLLM servers (or embedded ones) started with extract_hidden_states; see ``vllm_backend``. ``home``: the
    servers this process keeps busy (03's share under torchrun), the others take only its retries."""

    def __init__(self, P: HiddenParams, info: dict, layer_ids: list[int], head: TargetHead,
                 home: list[str] | None = None):
        self.client = VllmClient(P.urls, P.api_key(), P.vllm_model, num_states=len(layer_ids) + 1,
                                 hidden_size=info["hidden_size"], timeout_s=P.request_timeout_s,
                                 concurrency=P.concurrency, max_retries=P.max_retries, backoff_s=P.retry_backoff_s,
                                 home=home)
        self.head = head
        self.checked = self.mismatched = 0

    def batches(self, shard_samples: list[dict]):
        """Yield ``([row], aux [1, T, n, H], final [1, T, H])`` per sample, in order."""
        items = [(s["id"], s["input_ids"]) for s in shard_samples]
        for r, (hs, next_token) in enumerate(self.client.map(items)):
            final = self.head.norm(hs[:, -1]).to(hs.dtype)
            if next_token is not None:
                self._check_model(final[-1:], next_token, shard_samples[r]["id"])
            yield [r], hs[None, :, :-1], final[None]

    def _check_model(self, last, next_token: int, sample_id: str) -> None:
        """The server's greedy token must be what model_path's head says; a different model fails fast."""
        _, argmax = self.head.draft_logits_and_argmax(last)
        self.checked += 1
        self.mismatched += int(int(argmax[0]) != next_token)
        if self.checked >= 8 and self.mismatched > self.checked // 2:
            raise HiddenStatesError(
                f"the server's next token disagrees with model_path's lm_head on {self.mismatched} of {self.checked} "
                f"samples (last: {sample_id}): the server serves another model than model_path, or other layer ids")


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
    """The aux layer ids to capture (HF/vLLM ids): ``aux_layer_ids``, else EAGLE-3's default for this depth."""
    return check_layer_ids(P.aux_layer_ids if P.aux_layer_ids is not None else default_aux_layer_ids(num_layers),
                           num_layers)


def make_plan(P: HiddenParams, model_dir: Path, info: dict, layer_ids: list[int]) -> Plan:
    """Samples, draft vocabulary and shards; the finished shards of an earlier run taken over; the projected disk
    use printed and checked against the free space."""
    samples, sample_report = prepare_samples(P)
    vocab = build_draft_vocab(samples, info["vocab_size"], P.draft_vocab_size)
    if vocab["note"]:
        print("draft vocab:", vocab["note"], flush=True)
    shards = plan_shards(samples, P.shard_tokens)
    config = _config(P, info, layer_ids, samples)
    resume = _resume(P, config, shards)
    total_tokens = sum(s["num_tokens"] for s in shards)
    remaining = sum(s["num_tokens"] for s in shards if not s.get("done"))
    bpt = bytes_per_token(P.storage, info["hidden_size"], len(layer_ids), P.topk, P.draft_vocab_size)
    disk = disk_check(P, remaining, bpt, head_bytes(model_dir, info), total_tokens)
    return Plan(samples, sample_report, vocab, shards, config, resume, bpt, disk, remaining)


def write_vocab_and_head(P: HiddenParams, plan: Plan, model_dir: Path, info: dict) -> TargetHead:
    """``draft_vocab.safetensors`` and ``target_head.safetensors`` beside the data; returns the target's head on
    the compute device (the loss target of the topk storage, the vLLM backend's final norm and model check)."""
    import torch

    stage_dir = P.stage_dir
    save_draft_vocab(stage_dir / VOCAB_FILE, plan.vocab)
    head_tensors = read_head_tensors(model_dir)
    if not plan.resume["resumed_shards"] or not (stage_dir / HEAD_FILE).exists():  # same config: same model, same head
        write_head(stage_dir / HEAD_FILE, head_tensors)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return TargetHead(head_tensors["lm_head.weight"], draft_target_ids(plan.vocab["d2t"]), head_tensors["norm.weight"],
                      info["rms_norm_eps"], device=device)


def shard_tensors(P: HiddenParams, source, shard_samples: list[dict], head: TargetHead, log, progress: Progress,
                  session: dict[str, float]) -> dict:
    """One shard's tensors, batch by batch from the source: each sample's ids, loss mask and encoded states under
    ``{row}.{name}``; every batch's tokens and seconds go to ``throughput.jsonl``, ``session`` and the progress."""
    import torch

    tensors: dict = {}
    t0 = time.time()
    for rows, aux, final in source.batches(shard_samples):
        enc = {k: v.cpu() for k, v in encode(aux, final, P.storage, head, P.topk).items()}
        n_tok = 0
        for b, r in enumerate(rows):
            s = shard_samples[r]
            n = len(s["input_ids"])
            n_tok += n
            tensors[f"{r}.input_ids"] = torch.tensor(s["input_ids"], dtype=torch.int32)
            tensors[f"{r}.loss_mask"] = torch.tensor(s["loss_mask"], dtype=torch.uint8)
            for k, v in enc.items():
                tensors[f"{r}.{k}"] = v[b, :n].clone()
        t1 = time.time()
        log.write(json.dumps({"time": t1, "tokens": n_tok, "seconds": t1 - t0}) + "\n")
        log.flush()
        session["tokens"] += n_tok
        session["seconds"] += t1 - t0
        progress.update(n_tok, tok_per_s=round(session["tokens"] / max(session["seconds"], 1e-9), 1))
        t0 = time.time()
    return tensors


def extract(P: HiddenParams, plan: Plan, source_for, head: TargetHead) -> dict:
    """Compute every shard not on disk, in order, and write it atomically while the next one computes (one writer
    thread); ``plan.json`` marks each shard done once its file is whole. ``source_for()`` makes the backend (only
    when there is work). Returns this session's compute: ``{"tokens", "seconds"}`` (the vllm backend adds
    ``samples_per_server``)."""
    stage_dir = P.stage_dir
    todo = [s for s in plan.shards if not s.get("done")]
    total = plan.total_tokens
    progress = Progress(stage_dir, total=total, desc=STAGE, unit="tok", done=total - plan.remaining_tokens)
    session: dict = {"tokens": 0, "seconds": 0.0}
    if todo:
        source = source_for()
        print(f"{len(todo)} of {len(plan.shards)} shards to compute ({plan.resume['resumed_shards']} already on disk)",
              flush=True)
        writer = ThreadPoolExecutor(1)
        pending: tuple[dict, Future] | None = None

        def finish(item: tuple[dict, Future]) -> None:
            shard, fut = item
            shard.update(fut.result(), done=True)
            plan.save(stage_dir)

        by_id = plan.by_id
        with open(stage_dir / THROUGHPUT_FILE, "a") as log:
            for shard in todo:
                t_shard = time.time()
                tensors = shard_tensors(P, source, [by_id[i] for i in shard["samples"]], head, log, progress, session)
                shard["seconds"] = time.time() - t_shard
                if pending:
                    finish(pending)
                pending = (shard, writer.submit(write_shard, stage_dir / shard["file"], tensors))
            if pending:
                finish(pending)
        writer.shutdown()
        if isinstance(source, VllmSource):
            session["samples_per_server"] = dict(source.client.served)
    progress.close()
    return session


def write_index(P: HiddenParams, plan: Plan, model_dir: Path, info: dict, layer_ids: list[int]) -> None:
    """``index.json``, what the reader opens (docs/ARCHITECTURE.md "02_hidden_states output")."""
    by_id = plan.by_id
    index = {
        "format": FORMAT, "storage": P.storage, "layer_ids": layer_ids, "sglang_layer_ids": to_sglang(layer_ids),
        "num_layers": info["num_layers"], "hidden_size": info["hidden_size"], "vocab_size": info["vocab_size"],
        "rms_norm_eps": info["rms_norm_eps"],
        "draft_vocab_size": P.draft_vocab_size, "topk": P.topk if P.storage == "topk" else None,
        "model_path": str(model_dir), "model_fingerprint": info["fingerprint"], "backend": P.backend,
        "samples": [{"id": i, "shard": sh["file"], "index": j, "length": len(by_id[i]["input_ids"]),
                     "category": by_id[i]["category"]} for sh in plan.shards for j, i in enumerate(sh["samples"])],
        "shards": [{"file": s["file"], "num_samples": len(s["samples"]), "num_tokens": s["num_tokens"],
                    "bytes": s["bytes"], "sha256": s["sha256"]} for s in plan.shards],
    }
    write_json_atomic(P.stage_dir / INDEX_FILE, index)


def stage_metrics(P: HiddenParams, plan: Plan, info: dict, layer_ids: list[int], session: dict,
                  elapsed_s: float) -> dict:
    """``metrics.json``: sizes, throughput, draft-vocabulary coverage, what was resumed and what was left out."""
    stage_dir, shards, vocab = P.stage_dir, plan.shards, plan.vocab
    total_tokens = plan.total_tokens
    shard_bytes = sum(s["bytes"] for s in shards)
    aux_bytes = sum(p.stat().st_size for p in (stage_dir / HEAD_FILE, stage_dir / VOCAB_FILE))
    compute_s = sum(s.get("seconds", 0.0) for s in shards)
    session_tokens, session_s = session["tokens"], session["seconds"]
    return {
        "samples": len(plan.samples), "tokens": total_tokens,
        "loss_tokens": vocab["loss_tokens"], "tokens_per_s": total_tokens / compute_s if compute_s else None,
        "session_tokens_per_s": session_tokens / session_s if session_s else None,
        "bytes_per_token": shard_bytes / total_tokens, "layout_bytes_per_token": plan.bytes_per_token,
        "bf16_bytes_per_token": bytes_per_token("bf16", info["hidden_size"], len(layer_ids)),
        "total_bytes": shard_bytes + aux_bytes, "shard_bytes": shard_bytes, **plan.disk,
        "coverage": vocab["coverage"], "draft_vocab_size": P.draft_vocab_size, "draft_vocab_note": vocab["note"],
        "distinct_loss_tokens": vocab["distinct_loss_tokens"],
        "storage": P.storage, "backend": P.backend, "layer_ids": layer_ids, "sglang_layer_ids": to_sglang(layer_ids),
        "shards": len(shards), **plan.resume, **plan.sample_report, "elapsed_s": elapsed_s,
        "samples_per_server": session.get("samples_per_server"),
    }


def run(P: HiddenParams) -> dict:
    """Run stage 02 with validated parameters: the shards, ``index.json``, ``metrics.json`` and the report's
    figures (``throughput.png``, ``lengths.png``) in ``P.stage_dir``; returns the metrics."""
    with one_writer(P.stage_dir, "02_hidden_states"):
        return _run(P)


def _run(P: HiddenParams) -> dict:
    t_start = time.time()
    stage_dir = P.stage_dir
    stage_dir.mkdir(parents=True, exist_ok=True)

    # 1. The target: its shape from config.json, the layers whose states EAGLE-3 fuses.
    model_dir = P.model_dir
    info = target_info(model_dir)
    L, H = info["num_layers"], info["hidden_size"]
    layer_ids = aux_layer_ids(P, L)
    print(f"target {model_dir}: {L} layers, hidden {H}, vocab {info['vocab_size']}; aux layers {layer_ids} "
          f"(HF/vLLM ids; SGLang/SpecForge: {to_sglang(layer_ids)}) + the final normed state", flush=True)

    # 2. The plan, before any work: samples, draft vocabulary, shards (earlier ones resumed), disk.
    plan = make_plan(P, model_dir, info, layer_ids)
    plan.save(stage_dir)

    # 3. The draft vocabulary and the target's head beside the data.
    head = write_vocab_and_head(P, plan, model_dir, info)

    # 4. Every shard not on disk: the target's states per token-budget batch, written atomically.
    def source_for():
        return (VllmSource(P, info, layer_ids, head) if P.backend == "vllm"
                else TransformersSource(P, model_dir, info, layer_ids))

    session = extract(P, plan, source_for, head)

    # 5. The index the reader opens, the metrics and the figures.
    write_index(P, plan, model_dir, info, layer_ids)
    metrics = stage_metrics(P, plan, info, layer_ids, session, time.time() - t_start)
    write_json_atomic(stage_dir / "metrics.json", metrics)
    report.save_figures(stage_dir)
    track.stage_done(P)
    print(f"done: {plan.total_tokens:,} tokens in {len(plan.shards)} shards, {metrics['shard_bytes'] / GB:.3f} GB "
          f"({metrics['bytes_per_token']:.0f} bytes/token), draft-vocab coverage {plan.vocab['coverage']:.1%}",
          flush=True)
    return metrics
