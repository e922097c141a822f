"""Stage 03, ``run(P)``: what the notebook and ``python -m eagle3nb.train params/<run>/`` call. It sets up the
processes (``distributed``: torchrun's ranks, devices), opens the data (``sources``: 02's stored states, or
computed on demand) and the draft (``build``), trains (``loop``: the TTT objective, AdamW or Muon with warmup +
cosine, exact resume from checkpoints, held-out evaluations), exports the best evaluation's weights in the layouts
vLLM and SGLang load (``export``) and writes ``metrics.json`` and the figures. ``describe(P)`` says what a run will
do before it starts.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Callable

import torch

from eagle3nb import drafts
from eagle3nb.layers import to_sglang
from eagle3nb.progress import one_writer, write_json_atomic
from eagle3nb.train.build import build_draft, with_recipe_defaults
from eagle3nb.train.checkpoint import checkpoints, run_config
from eagle3nb.train.data import layout
from eagle3nb.train.distributed import pick_device, print_rank0, setup
from eagle3nb.train.export import export
from eagle3nb.train.loop import Curve, Layout, Trainer, train
from eagle3nb.train.params import TrainParams
from eagle3nb.train.report import read_metrics, save_figures
from eagle3nb.train.sources import open_data, source_metrics


def describe(P: TrainParams, world: int = 1) -> dict[str, Any]:
    """What a run will do, before it starts: the data, the split, the steps, the layers and where things go."""
    meta = open_data(P, world).meta
    train_idx, held_idx, plan, dropped = layout(P, meta, world)
    lengths = [int(s["length"]) for s in meta["samples"]]
    return {
        "data source": P.data_source, "data_dir": str(P.data_path), "target": meta.get("model_path"),
        "target hidden size / vocab": f"{meta['hidden_size']} / {meta['vocab_size']}",
        "aux layers (vLLM ids | SGLang ids)": f"{meta['layer_ids']} | {to_sglang(meta['layer_ids'])}",
        "draft vocab": meta.get("draft_vocab_size"), "storage": meta.get("storage"),
        "train / held-out samples": f"{len(train_idx)} / {len(held_idx)}",
        "train tokens": sum(min(lengths[i], P.max_length) for i in train_idx),
        "samples cut at max_length": sum(1 for i in train_idx if lengths[i] > P.max_length),
        "optimizer steps": len(plan), "micro-batches per step": P.grad_accum * world,
        "leftover micro-batches (reshuffled into later epochs)": dropped,
        "init": str(P.init_path) if P.init_path else "fresh (target's embedding and lm_head rows)",
        "output_dir": str(P.stage_dir),
    }


def _prepare_checkpoints(ckpt_dir: Path, resume: bool) -> None:
    """The checkpoint folder exists; with ``resume: false`` the previous run's checkpoints are removed (said)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    if not resume and checkpoints(ckpt_dir):
        print(f"[03_train] resume: false, so the {len(checkpoints(ckpt_dir))} checkpoints of the previous run "
              f"in {ckpt_dir} are removed", flush=True)
        for old in checkpoints(ckpt_dir):
            old.unlink()


def _curve_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """metrics.json's view of the curve: the last train row's loss and speed, the first and last evaluation."""
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    return {"tokens_per_s": train[-1]["tokens_per_s"] if train else None,
            "final_loss": train[-1]["loss"] if train else None,
            "initial_heldout": evals[0] if evals else None, "heldout": evals[-1] if evals else None}


def run(P: TrainParams, callback: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Train (or fine-tune) the draft per ``P``; resume if a checkpoint exists; export; write metrics.json and
    training.png; return metrics.json (an empty dict on ranks other than 0).

    Run it as is for one process, or under ``torchrun --nproc_per_node N`` for N (the same code path: each
    process takes its share of the same global batch). ``callback(row)`` sees every metrics row (live plots,
    ``report.LivePlot``)."""
    first = os.environ.get("RANK", "0") == "0"  # one lock per job: its rank 0 holds it
    with one_writer(P.stage_dir, "03_train") if first else contextlib.nullcontext():
        return _run(P, callback)


def _run(P: TrainParams, callback: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
    # 1. Processes and device: torchrun's ranks (a plain run is one process), the checkpoint folder.
    rank, world, local_rank = setup(P.device)
    device = pick_device(P.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ckpt_dir = P.stage_dir / "checkpoints"
    if rank == 0:
        _prepare_checkpoints(ckpt_dir, P.resume)
    P = with_recipe_defaults(P, ckpt_dir)

    # 2. The data (02's hidden states, stored or computed on demand) and the draft, wrapped in the TTT objective.
    data = open_data(P, world)
    draft, notes = build_draft(P, data)
    tr = Trainer.on(P, rank, world, device, data, draft)

    # 3. The split and every optimizer step's micro-batches, fixed before the first step.
    lay = Layout.of(P, data.meta, world)

    # 4. The optimizer and its schedule, resumed from the last checkpoint made with the same settings.
    config = run_config(P, world, None if P.data_source == "stored" else
                        {"data_source": P.data_source, "hidden": data.HP.data_config()})
    start, resumed = tr.optimize(lay.total, ckpt_dir, config)

    # 5. Train, logging every step and evaluation.
    curve = Curve(P, rank, start, resumed, lay.total, callback)
    truncated = sum(1 for i in lay.train_idx if lay.lengths[i] > P.max_length)
    print_rank0(rank, f"[03_train] {len(lay.train_idx)} training / {len(lay.held_idx)} held-out samples, {lay.total} "
                      f"steps of {lay.per_step} micro-batches ({world} process(es) x grad_accum {P.grad_accum}), "
                      f"device {device}, {truncated} samples cut at max_length {P.max_length}, "
                      f"{'resuming at step ' + str(start) if start else 'starting fresh'}")
    train(tr, lay, start, curve, ckpt_dir, config)
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    if rank != 0:
        return {}

    # 6. The best weights, calibrated where the method has a head to calibrate; the export vLLM and SGLang load,
    # metrics.json and the figures.
    curve.close()
    result = {"steps": lay.total, "processes": world, "global_micro_batches": lay.per_step,
              "train_samples": len(lay.train_idx), "heldout_samples": len(lay.held_idx),
              "holdout_fraction": P.holdout_fraction,
              "truncated_samples": truncated, "leftover_micro_batches": lay.dropped,
              "longest_train_sequence": max((min(lay.lengths[i], P.max_length) for i in lay.train_idx), default=0),
              **_curve_summary(read_metrics(P.stage_dir)), **notes, **source_metrics(P, data, world)}
    if P.keep_best and tr.best.state is not None:  # draft/ is the best evaluation's weights; the last stay in
        # checkpoints/
        draft.load_state_dict({**tr.best.state, "embed_tokens.weight": draft.embed_tokens.weight})
        result["best"] = {**tr.best.summary(), "last_step": lay.total}
    if (calibration := tr.calibrate(lay.held_batches)) is not None:  # e.g. DSpark's confidence head
        result["calibration"] = calibration
        print(f"[03_train] {drafts.of(draft).title}'s confidence head on {calibration['slots']} held-out slots: ECE "
              f"{calibration['ece_before']:.4f} -> {calibration['ece_after']:.4f} (temperature "
              f"{calibration['temperature']:.3f}{'' if calibration['applied'] else ', not applied'})", flush=True)
    result.update(export(draft, P, verifier=data.meta.get("model_path")))
    write_json_atomic(P.stage_dir / "metrics.json", result)
    save_figures(P.stage_dir)
    curve.tracker.stage_done()
    return result
