"""02's work once planned: the draft vocabulary and the target's head beside the data, every shard not on disk
computed batch by batch and written atomically (one writer thread, while the next shard computes), then the
index the reader opens and the metrics."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from eagle3nb.data.head import TargetHead, read_head_tensors
from eagle3nb.data.reader import HEAD_FILE, INDEX_FILE
from eagle3nb.data.shards import FORMAT, bytes_per_token, encode, write_shard
from eagle3nb.data.vocab import VOCAB_FILE, draft_target_ids, save_draft_vocab
from eagle3nb.hf import compute_device
from eagle3nb.hidden.params import STAGE, HiddenParams
from eagle3nb.hidden.prepare import Plan, layers_for
from eagle3nb.hidden.sources import VllmSource
from eagle3nb.layers import to_sglang
from eagle3nb.progress import Progress, write_json_atomic

THROUGHPUT_FILE = "throughput.jsonl"


def write_head(path: Path, tensors: dict) -> None:
    """The target's embed_tokens / lm_head / norm weights beside the data (temp name, then rename)."""
    from safetensors.torch import save_file

    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def write_vocab_and_head(P: HiddenParams, plan: Plan, model_dir: Path, info: dict) -> TargetHead:
    """``draft_vocab.safetensors`` and ``target_head.safetensors`` beside the data; returns the target's head on
    the compute device (the loss target of the topk storage, the vLLM backend's final norm and model check)."""
    stage_dir = P.stage_dir
    save_draft_vocab(stage_dir / VOCAB_FILE, plan.vocab)
    head_tensors = read_head_tensors(model_dir)
    if not plan.resume["resumed_shards"] or not (stage_dir / HEAD_FILE).exists():  # same config: same model, same head
        write_head(stage_dir / HEAD_FILE, head_tensors)
    return TargetHead(head_tensors["lm_head.weight"], draft_target_ids(plan.vocab["d2t"]), head_tensors["norm.weight"],
                      info["rms_norm_eps"], device=compute_device())


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
        "layers_for": layers_for(P), "num_layers": info["num_layers"], "hidden_size": info["hidden_size"],
        "vocab_size": info["vocab_size"], "rms_norm_eps": info["rms_norm_eps"],
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
