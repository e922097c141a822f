"""Stage 03's work, ``run(P)``: the training loop (AdamW + warmup/cosine, grad accumulation and clipping, bf16
autocast where supported, torch.distributed (DDP; launch with torchrun), exact resume from atomic checkpoints,
held-out evaluation), its metrics files and figure, and the export vLLM/SGLang load."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from eagle3nb.draft_checkpoint import EAGLE31_KEYS, draft_config_json, save_draft
from eagle3nb.formulas import tau_from_conditional
from eagle3nb.layers import to_sglang
from eagle3nb.params import StageError
from eagle3nb.progress import Progress, one_writer, write_json_atomic
from eagle3nb.track import Tracker
from eagle3nb.train.build import build_draft, with_recipe_defaults
from eagle3nb.train.checkpoint import checkpoints, load_checkpoint, run_config, save_checkpoint
from eagle3nb.train.data import DeviceTargets, collate, layout
from eagle3nb.train.optim import build_optimizer
from eagle3nb.train.params import TrainParams
from eagle3nb.train.report import read_metrics, save_figures
from eagle3nb.train.sources import CACHE_DIR, open_data, source_costs
from eagle3nb.train.ttt import TTTObjective
from eagle3nb.vllm_config import eagle3_spec


class TrainingDiverged(StageError):
    """The loss became NaN/inf; the message names the step and the samples of the batch."""


# ---- processes and devices ------------------------------------------------------------------------


def _dist_setup(device: str) -> tuple[int, int, int]:
    """(rank, world, local_rank). torchrun sets WORLD_SIZE/RANK/LOCAL_RANK; a plain run is one process."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if (device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())) \
            else "gloo"
        dist.init_process_group(backend)
    if world > 1:
        return dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", "0"))
    return 0, 1, 0


def pick_device(device: str, local_rank: int = 0) -> torch.device:
    if device == "auto":
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        return torch.device(f"cuda:{local_rank}")
    return torch.device(device)


def autocast_for(mode: str, device: torch.device):
    """bf16 autocast on CUDA devices that support it ("auto"), forced ("bf16"), or none."""
    on = mode == "bf16" or (mode == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported())
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


def _all_reduce(t: torch.Tensor, world: int) -> torch.Tensor:
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(t)
    return t


# ---- schedule and metrics --------------------------------------------------------------------------


def lr_lambda(total: int, warmup_ratio: float) -> Callable[[int], float]:
    """Linear warmup to the peak, then cosine to zero."""
    warm = int(math.ceil(total * warmup_ratio))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        progress = (step - warm) / max(1, total - warm)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


class Metrics:
    """metrics.jsonl (one JSON object per line, ``kind`` train|eval) + the trackers of ``report_to``. On resume the
    lines after the checkpoint's step are dropped, so the file is the curve of one run."""

    def __init__(self, out: Path, keep_until: int | None, tracker: Tracker):
        self.path = out / "metrics.jsonl"
        rows = read_metrics(self.path) if keep_until is not None else []
        rows = [r for r in rows if r["step"] <= (keep_until or 0)]
        tmp = self.path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, self.path)
        self.tracker = tracker

    def log(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.tracker.log_step(row)


# ---- evaluation -----------------------------------------------------------------------------------


def summarize(stats: torch.Tensor, decay: float) -> dict[str, Any]:
    """stats [4, steps] (loss sum, loss positions, correct, acceptance positions) -> loss, per-step accuracy
    and the simulated acceptance length 1 + sum_i prod_{j<=i} acc_j (formulas.tau_from_conditional)."""
    loss_i = (stats[0] / stats[1].clamp(min=1)).tolist()
    acc = (stats[2] / stats[3].clamp(min=1)).tolist()
    return {"loss": sum(decay ** i * x for i, x in enumerate(loss_i)), "step_loss": loss_i, "acc": acc,
            "acceptance_length": tau_from_conditional(acc), "positions": int(stats[3][0])}


@torch.no_grad()
def evaluate(objective: TTTObjective, data, batches: list[list[int]], P: TrainParams, device: torch.device,
             rank: int = 0, world: int = 1, targets: DeviceTargets | None = None) -> dict[str, Any]:
    """Held-out loss, per-step accuracy (draft argmax == target argmax) and simulated acceptance length."""
    was = objective.training
    objective.eval()
    stats = torch.zeros(4, P.ttt_steps, dtype=torch.float64, device=device)
    for mb in batches[rank::world]:
        with autocast_for(P.autocast, device):
            stats += objective(collate(data, mb, P.max_length, device, targets))[1]
    objective.train(was)
    return summarize(_all_reduce(stats, world).cpu(), P.step_decay)


# ---- training -------------------------------------------------------------------------------------


def data_seen(plan, lengths: list[int], max_length: int) -> list[dict[str, int]]:
    """Training samples and tokens seen after each step (index 0: none), for the held-out curve against data."""
    out = [{"samples_seen": 0, "tokens_seen": 0}]
    for _, global_mbs in plan:
        idx = [i for mb in global_mbs for i in mb]
        out.append({"samples_seen": out[-1]["samples_seen"] + len(idx),
                    "tokens_seen": out[-1]["tokens_seen"] + sum(min(lengths[i], max_length) for i in idx)})
    return out


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


def _accumulate(model, data, targets, mine: list[list[int]], P: TrainParams, device: torch.device, rank: int,
                world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward over this process's micro-batches of one optimizer step (gradients synced across
    processes on the last one): the summed TTT stats, and a per-micro-batch flag of a non-finite loss over the
    global step's micro-batches (this process's slots filled)."""
    stats = torch.zeros(4, P.ttt_steps, dtype=torch.float64, device=device)
    bad = torch.zeros(P.grad_accum * world, device=device)
    for j, mb in enumerate(mine):
        batch = collate(data, mb, P.max_length, device, targets)
        sync = j == len(mine) - 1 or world == 1
        with (contextlib.nullcontext() if sync else model.no_sync()), autocast_for(P.autocast, device):
            loss, st = model(batch)
            (loss / P.grad_accum).backward()
        bad[rank * P.grad_accum + j] = float(not torch.isfinite(loss))
        stats += st
    return stats, bad


def _curve_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """metrics.json's view of the curve: the last train row's loss and speed, the first and last evaluation."""
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    return {"tokens_per_s": train[-1]["tokens_per_s"] if train else None,
            "final_loss": train[-1]["loss"] if train else None,
            "initial_heldout": evals[0] if evals else None, "heldout": evals[-1] if evals else None}


def print_rank0(rank: int, line: str) -> None:
    """A progress line, once per run (from the first process)."""
    if rank == 0:
        print(line, flush=True)


def _checkpoint(ckpt_dir: Path, step: int, keep: int, tr: "Trainer", config: dict[str, Any]) -> None:
    """Save the step's checkpoint (with the best evaluation so far) and drop all but the last ``keep``."""
    save_checkpoint(ckpt_dir / f"step-{step:07d}.pt", tr.draft, tr.optimizer, tr.scheduler, step, config,
                    tr.best.saved(step))
    for old in checkpoints(ckpt_dir)[:-keep]:
        old.unlink()


def _distributed(objective: TTTObjective, device: torch.device):
    """The objective wrapped for torchrun: gradients all-reduced across processes."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(objective, device_ids=[device.index] if device.type == "cuda" else None)


@dataclass
class Layout:
    """03's split of the data and the whole run's optimizer steps (``data.layout``: a pure function of the sample
    lengths, the seed and the epoch), with the sample lengths they were made from."""

    samples: list[dict[str, Any]]
    lengths: list[int]
    train_idx: list[int]
    held_idx: list[int]
    plan: list[tuple[int, list[list[int]]]]  # per optimizer step: (epoch, the global batch's micro-batches)
    dropped: int  # micro-batches left over at epoch ends
    per_step: int  # micro-batches per optimizer step: grad_accum x processes

    @classmethod
    def of(cls, P: TrainParams, meta: dict[str, Any], world: int) -> "Layout":
        samples = meta["samples"]
        train_idx, held_idx, plan, dropped = layout(P, meta, world)
        return cls(samples, [int(s["length"]) for s in samples], train_idx, held_idx, plan, dropped,
                   P.grad_accum * world)

    @property
    def total(self) -> int:
        return len(self.plan)

    @property
    def held_batches(self) -> list[list[int]]:
        """One held-out sample per batch: evaluation does not depend on the process count."""
        return [[i] for i in self.held_idx]


def _weights(draft) -> dict[str, torch.Tensor]:
    """A CPU copy of the draft's weights, the frozen embedding left out."""
    return {k: v.detach().to("cpu", copy=True) for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}


@dataclass
class Best:
    """The best held-out evaluation so far (simulated acceptance length; a tie goes to the later, more trained,
    weights) and the draft's weights at it: what ``draft/`` exports. Kept by the first process, saved in every
    checkpoint, so a resumed run picks among all its evaluations; the last weights stay in checkpoints/."""

    step: int | None = None
    acceptance_length: float = -math.inf
    acc: list[float] | None = None
    state: dict[str, torch.Tensor] | None = None

    def offer(self, step: int, ev: dict[str, Any], draft) -> None:
        if ev["acceptance_length"] >= self.acceptance_length:
            self.step, self.acceptance_length, self.acc = step, ev["acceptance_length"], list(ev["acc"])
            self.state = _weights(draft)

    def saved(self, step: int) -> dict[str, Any] | None:
        """What a checkpoint at ``step`` holds (the weights only when they are not that step's own)."""
        if self.step is None:
            return None
        return {**self.summary(), "model": None if self.step == step else self.state}

    @classmethod
    def restored(cls, saved: dict[str, Any] | None, draft) -> "Best":
        """From a checkpoint's ``best`` (None: a fresh run, or a checkpoint from before it was kept), the draft
        holding that checkpoint's weights."""
        if saved is None:
            return cls()
        state = saved["model"] if saved["model"] is not None else _weights(draft)
        return cls(saved["step"], saved["acceptance_length"], saved["acc"], state)

    def summary(self) -> dict[str, Any]:
        return {"step": self.step, "acceptance_length": self.acceptance_length, "acc": self.acc}


@dataclass
class Trainer:
    """The draft under training on this process: the TTT objective (DDP-wrapped under torchrun), the data and its
    loss targets on the training device, the optimizer and its learning-rate schedule."""

    P: TrainParams
    rank: int
    world: int
    device: torch.device
    data: Any
    draft: Any
    objective: TTTObjective
    model: Any  # the objective, or its DDP wrapper
    targets: DeviceTargets
    params: list[torch.nn.Parameter] | None = None
    optimizer: Any = None  # torch.optim.AdamW, or optim.Optimizers (Muon + AdamW)
    scheduler: Any = None
    best: Best = field(default_factory=Best)

    @classmethod
    def on(cls, P: TrainParams, rank: int, world: int, device: torch.device, data, draft) -> "Trainer":
        draft.to(device)
        objective = TTTObjective(draft, P.ttt_steps, P.step_decay, P.loss, P.lk_eta)
        model = _distributed(objective, device) if world > 1 else objective
        return cls(P, rank, world, device, data, draft, objective, model, DeviceTargets(data, device))

    def optimize(self, total: int, ckpt_dir: Path, config: dict[str, Any]) -> tuple[int, bool]:
        """AdamW over the trainable parameters (or Muon on the weight matrices and AdamW on the rest: ``optim``)
        with warmup + cosine over ``total`` steps, loaded from the last checkpoint when resuming. Returns (the step
        to start at, whether a checkpoint was found)."""
        P = self.P
        self.optimizer, self.scheduler, self.params = build_optimizer(self.draft, P, lr_lambda(total, P.warmup_ratio))
        found = checkpoints(ckpt_dir) if P.resume else []
        start, saved = load_checkpoint(found[-1], self.draft, self.optimizer, self.scheduler, config) if found \
            else (0, None)
        self.best = Best.restored(saved, self.draft)
        if self.world > 1:  # every rank must agree on the start
            start = int(_all_reduce(torch.tensor([start if self.rank == 0 else 0], device=self.device),
                                    self.world).item())
        return start, bool(found)

    def evaluate(self, batches: list[list[int]]) -> dict[str, Any]:
        return evaluate(self.objective, self.data, batches, self.P, self.device, self.rank, self.world, self.targets)

    def step(self, step: int, epoch: int, global_mbs: list[list[int]], lay: Layout, ckpt_dir: Path
             ) -> tuple[dict[str, Any], float, int]:
        """One optimizer step over this process's share of the global batch: (the TTT summary over every process,
        the gradient norm before clipping, the tokens this process trained on). A non-finite loss on any process
        stops the run, naming the step and the micro-batch's samples."""
        P, rank, world = self.P, self.rank, self.world
        mine = global_mbs[rank * P.grad_accum:(rank + 1) * P.grad_accum]
        stats, bad = _accumulate(self.model, self.data, self.targets, mine, P, self.device, rank, world)
        tokens = sum(min(lay.lengths[i], P.max_length) for mb in mine for i in mb)
        if _all_reduce(bad, world).any():
            k = int(bad.nonzero()[0])
            ids = [lay.samples[i]["id"] for i in global_mbs[k]]
            raise TrainingDiverged(f"loss is NaN/inf at step {step + 1} (epoch {epoch}), micro-batch {k} with "
                                   f"samples {ids}; lower lr, check these samples' hidden states, or resume from "
                                   f"the last checkpoint in {ckpt_dir}")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, P.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return summarize(_all_reduce(stats, world).cpu(), P.step_decay), grad_norm, tokens


class Curve:
    """Where the run's rows go, from the first process only: ``metrics.jsonl`` (kept up to the resumed step; plus
    the trackers of report_to), ``progress.json`` and the caller's ``callback``."""

    def __init__(self, P: TrainParams, rank: int, start: int, resumed: bool, total: int,
                 callback: Callable[[dict[str, Any]], None] | None):
        self.first = rank == 0
        self.callback = callback
        self.tracker = Tracker(P) if self.first else None
        self.metrics = Metrics(P.stage_dir, keep_until=start if resumed else None,
                               tracker=self.tracker) if self.first else None
        self.progress = Progress(P.stage_dir, total=total, desc="03_train", unit="step", done=start) \
            if self.first else None

    def log(self, row: dict[str, Any]) -> None:
        if self.first:
            self.metrics.log(row)
            if self.callback is not None:
                self.callback(row)

    def advance(self, row: dict[str, Any]) -> None:
        if self.progress is not None:
            self.progress.update(1, loss=round(row["loss"], 4), acc0=round(row["acc"][0], 3), lr=row["lr"])

    def close(self) -> None:
        self.progress.close()


def train(tr: Trainer, lay: Layout, start: int, curve: Curve, ckpt_dir: Path, config: dict[str, Any]) -> None:
    """Optimizer steps ``start`` .. the last: a train row per step, a held-out evaluation before the first step,
    every ``eval_every`` steps and at the end (each offered to ``tr.best``), a checkpoint every ``save_every`` steps
    and at the end."""
    P, rank, world, total = tr.P, tr.rank, tr.world, lay.total
    seen = data_seen(lay.plan, lay.lengths, P.max_length)
    if start == 0:
        ev = tr.evaluate(lay.held_batches)
        curve.log({"kind": "eval", "step": 0, **seen[0], **ev})
        if rank == 0:
            tr.best.offer(0, ev, tr.draft)
    tokens, t0 = 0, time.time()
    for step in range(start, total):
        epoch, global_mbs = lay.plan[step]
        s, grad_norm, n = tr.step(step, epoch, global_mbs, lay, ckpt_dir)
        tokens += n
        row = {"kind": "train", "step": step + 1, "epoch": epoch, "loss": s["loss"], "acc": s["acc"],
               "acceptance_length": s["acceptance_length"], "lr": tr.scheduler.get_last_lr()[0],
               "grad_norm": grad_norm, "tokens_per_s": tokens * world / max(time.time() - t0, 1e-9)}
        curve.log(row)
        curve.advance(row)
        done = step + 1 == total
        if (P.eval_every and (step + 1) % P.eval_every == 0) or done:
            ev = tr.evaluate(lay.held_batches)
            curve.log({"kind": "eval", "step": step + 1, **seen[step + 1], **ev})
            if rank == 0:
                tr.best.offer(step + 1, ev, tr.draft)
            print_rank0(rank, f"[03_train] step {step + 1}/{total} held-out acc {[round(a, 3) for a in ev['acc']]} "
                              f"acceptance length {ev['acceptance_length']:.3f}")
        if rank == 0 and ((step + 1) % P.save_every == 0 or done):
            _checkpoint(ckpt_dir, step + 1, P.keep_checkpoints, tr, config)


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
    rank, world, local_rank = _dist_setup(P.device)
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

    # 6. The export vLLM and SGLang load, metrics.json and the figures.
    curve.close()
    result = {"steps": lay.total, "processes": world, "global_micro_batches": lay.per_step,
              "train_samples": len(lay.train_idx), "heldout_samples": len(lay.held_idx),
              "truncated_samples": truncated, "leftover_micro_batches": lay.dropped,
              "longest_train_sequence": max((min(lay.lengths[i], P.max_length) for i in lay.train_idx), default=0),
              **_curve_summary(read_metrics(P.stage_dir)), **notes, **source_metrics(P, data, world)}
    if P.keep_best and tr.best.state is not None:  # draft/ is the best evaluation's weights; the last stay in
        # checkpoints/
        draft.load_state_dict({**tr.best.state, "embed_tokens.weight": draft.embed_tokens.weight})
        result["best"] = {**tr.best.summary(), "last_step": lay.total}
    result.update(export(draft, P, verifier=data.meta.get("model_path")))
    write_json_atomic(P.stage_dir / "metrics.json", result)
    save_figures(P.stage_dir)
    curve.tracker.stage_done()
    return result


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


# ---- export ---------------------------------------------------------------------------------------


def export(draft, P: TrainParams, verifier: str | None = None) -> dict[str, Any]:
    """Write ``draft/`` (EAGLE-3 layout, vLLM ids), ``draft-sglang/`` (same weights, SGLang's output-of-layer
    ids) and, on request, ``draft-speculators/`` (naming ``verifier``, the target); print the serving flags."""
    out = P.stage_dir
    dtype = getattr(torch, P.export_dtype)
    draft = draft.to("cpu").eval()
    paths: dict[str, Any] = {}
    k = P.num_speculative_tokens
    if P.export_format in ("eagle3", "both"):
        vllm_dir = save_draft(draft, out / "draft", dtype=dtype, include_embed=P.export_embed_tokens)
        sglang_dir = out / "draft-sglang"
        sglang_dir.mkdir(exist_ok=True)
        weights = sglang_dir / "model.safetensors"
        weights.unlink(missing_ok=True)
        os.link(vllm_dir / "model.safetensors", weights)
        cfg = draft_config_json(draft, "eagle3", dtype)
        ids = to_sglang(cfg["eagle_aux_hidden_state_layer_ids"])
        cfg["eagle_aux_hidden_state_layer_ids"] = ids
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = ids
        write_json_atomic(sglang_dir / "config.json", cfg)
        paths.update(draft_dir=str(vllm_dir), sglang_draft_dir=str(sglang_dir))
    if P.export_format in ("speculators", "both"):
        paths["speculators_dir"] = str(save_draft(draft, out / "draft-speculators", format="speculators",
                                                  dtype=dtype, include_embed=P.export_embed_tokens,
                                                  verifier=verifier, num_speculative_tokens=k))
    paths["serve"] = serve_commands(paths, k, eagle31=[key for key in EAGLE31_KEYS if getattr(draft.config, key)])
    for line in paths["serve"].values():
        print(line, flush=True)
    return paths


def serve_commands(paths: dict[str, Any], k: int, eagle31: list[str]) -> dict[str, str]:
    """The flags that serve the exported draft beside its target; for an EAGLE-3.1 draft (``eagle31``: its keys
    that are on) what an SGLang without them would do with it."""
    cmds = {}
    vllm_dir = paths.get("draft_dir") or paths.get("speculators_dir")
    spec = json.dumps(eagle3_spec(vllm_dir, k))  # a parallel-drafting draft's with parallel_drafting on
    cmds["vllm"] = f"vllm serve <target> --speculative-config '{spec}'"
    if paths.get("sglang_draft_dir"):
        cmds["sglang"] = (f"python -m sglang.launch_server --model-path <target> --speculative-algorithm EAGLE3 "
                          f"--speculative-draft-model-path {paths['sglang_draft_dir']} --speculative-num-steps {k} "
                          f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {k + 1}")
        if eagle31:
            cmds["sglang_note"] = (f"SGLang: this is an EAGLE-3.1 draft ({', '.join(eagle31)}); an SGLang whose "
                                   "llama_eagle3 does not read those keys loads it without them, silently, and "
                                   "accepts less: check yours, or train with fc_norm: false, norm_output: false")
    return cmds
