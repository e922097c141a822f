"""Stage 02: run the target over 01's token stream and store the hidden states EAGLE-3 trains on.

Plan first, then work: the samples are filtered, cut to ``max_length``, sorted by length and assigned to
shards; the draft vocabulary is chosen; the disk the run will take is printed and checked against the free
space. Then each shard not already on disk (and intact) is computed and written atomically. A killed run
restarts at the first missing shard and produces the same files as an uninterrupted one.

``run(P)`` is what the notebook and ``python -m eagle3nb.hidden params/<run>/`` call; it also writes
``metrics.json`` and the report's figures (PNG). ``preview(P)`` says what a run will do before doing it,
``storage_cost(P)`` what a compact storage costs in training signal. The steps live in ``plan`` (samples, draft
vocabulary, shards, disk), ``sources`` (the two backends) and ``extract`` (shards, index, metrics).
"""

from __future__ import annotations

import time

from eagle3nb import track
from eagle3nb.data.head import target_info
from eagle3nb.data.reader import HiddenStates
from eagle3nb.hidden import report
from eagle3nb.hidden.cost import cost_table
from eagle3nb.hidden.extract import extract, stage_metrics, write_index, write_vocab_and_head
from eagle3nb.hidden.params import HiddenParams
from eagle3nb.hidden.prepare import GB, aux_layer_ids, make_plan, prepare_samples
from eagle3nb.hidden.sources import TransformersSource, VllmSource
from eagle3nb.hidden.vllm_backend import vllm_command
from eagle3nb.layers import to_sglang
from eagle3nb.progress import one_writer, write_json_atomic


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


def storage_cost(P: HiddenParams, samples: int = 16, storages: tuple[str, ...] = ("fp8", "topk")):
    """What a compact storage costs in training signal: the first ``samples`` samples extracted again in bf16
    and in each of ``storages`` (under ``<stage_dir>/storage_check/``), their loss targets compared
    (``cost.cost_table``): one row per storage."""
    base = P.stage_dir / "storage_check"
    runs = {}
    for s in ("bf16", *storages):
        q = P.model_copy(update={"storage": s, "output_dir": str(base / s), "max_samples": samples, "force": True})
        runs[s] = (run(q), HiddenStates(base / s))
    return cost_table(runs)


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
