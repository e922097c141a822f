"""03's training loop: the run's optimizer steps fixed in advance (``Layout``), the draft under training on this
process (``Trainer``: TTT objective, AdamW or Muon with warmup + cosine, gradient accumulation and clipping, exact
resume from checkpoints), held-out evaluations and the best one's weights (``Best``), and where each row goes
(``Curve``: ``metrics.jsonl``, the trackers, progress)."""

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

from eagle3nb import drafts
from eagle3nb.drafts.base import EvalDiagnostics
from eagle3nb.formulas import tau_from_conditional
from eagle3nb.params import StageError
from eagle3nb.progress import Progress
from eagle3nb.track import Tracker
from eagle3nb.train.checkpoint import checkpoints, load_checkpoint, save_checkpoint
from eagle3nb.train.data import DeviceTargets, collate, layout
from eagle3nb.train.distributed import all_reduce, autocast_for, print_rank0, wrap
from eagle3nb.train.optim import build_optimizer
from eagle3nb.train.params import TrainParams
from eagle3nb.train.report import read_metrics


class TrainingDiverged(StageError):
    """The loss became NaN/inf; the message names the step and the samples of the batch."""


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


def summarize(stats: torch.Tensor, decay: float) -> dict[str, Any]:
    """stats [4, steps] (loss sum, loss positions, correct, acceptance positions) -> loss (step i weighed
    ``decay``**i), per-step accuracy (a block drafter's: per block position) and the simulated acceptance length
    1 + sum_i prod_{j<=i} acc_j (formulas.tau_from_conditional)."""
    loss_i = (stats[0] / stats[1].clamp(min=1)).tolist()
    acc = (stats[2] / stats[3].clamp(min=1)).tolist()
    return {"loss": sum(decay ** i * x for i, x in enumerate(loss_i)), "step_loss": loss_i, "acc": acc,
            "acceptance_length": tau_from_conditional(acc), "positions": int(stats[3][0])}


@torch.no_grad()
def evaluate(objective: torch.nn.Module, data, batches: list[list[int]], P: TrainParams, device: torch.device,
             rank: int = 0, world: int = 1, targets: DeviceTargets | None = None) -> dict[str, Any]:
    """Held-out loss, per-step accuracy (draft argmax == target argmax) and simulated acceptance length; ``acc_by``
    names the steps (the objective's ``unit``: TTT step, or block position for a block drafter); ``diagnostics``,
    what an objective that reports more adds (``drafts.base.EvalDiagnostics``), from its sums over the batches."""
    was = objective.training
    objective.eval()
    stats = torch.zeros(4, objective.steps, dtype=torch.float64, device=device)
    names = objective.EVAL_SUMS if isinstance(objective, EvalDiagnostics) else ()
    sums = torch.zeros(len(names), dtype=torch.float64, device=device)
    for mb in batches[rank::world]:
        with autocast_for(P.autocast, device):
            stats += objective(collate(data, mb, P.max_length, device, targets))[1]
        if names:
            got = objective.eval_sums()
            sums += torch.stack([got[n].double().to(device) for n in names])
    objective.train(was)
    ev = {**summarize(all_reduce(stats, world).cpu(), objective.decay), "acc_by": objective.unit}
    if names:
        ev["diagnostics"] = objective.eval_diagnostics(dict(zip(names, all_reduce(sums, world).tolist())))
    return ev


def data_seen(plan, lengths: list[int], max_length: int) -> list[dict[str, int]]:
    """Training samples and tokens seen after each step (index 0: none), for the held-out curve against data."""
    out = [{"samples_seen": 0, "tokens_seen": 0}]
    for _, global_mbs in plan:
        idx = [i for mb in global_mbs for i in mb]
        out.append({"samples_seen": out[-1]["samples_seen"] + len(idx),
                    "tokens_seen": out[-1]["tokens_seen"] + sum(min(lengths[i], max_length) for i in idx)})
    return out


def accumulate(model, data, targets, mine: list[list[int]], P: TrainParams, device: torch.device, rank: int,
                world: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward over this process's micro-batches of one optimizer step (gradients synced across
    processes on the last one): the summed TTT stats, and a per-micro-batch flag of a non-finite loss over the
    global step's micro-batches (this process's slots filled). ``steps``: the objective's stats columns (TTT steps,
    or a block drafter's block positions)."""
    stats = torch.zeros(4, steps, dtype=torch.float64, device=device)
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


def _checkpoint(ckpt_dir: Path, step: int, keep: int, tr: "Trainer", config: dict[str, Any]) -> None:
    """Save the step's checkpoint (with the best evaluation so far) and drop all but the last ``keep``."""
    save_checkpoint(ckpt_dir / f"step-{step:07d}.pt", tr.draft, tr.optimizer, tr.scheduler, step, config,
                    tr.best.saved(step))
    for old in checkpoints(ckpt_dir)[:-keep]:
        old.unlink()


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
    diagnostics: dict[str, Any] | None = None  # the evaluation's, where the objective reports them

    def offer(self, step: int, ev: dict[str, Any], draft) -> None:
        if ev["acceptance_length"] >= self.acceptance_length:
            self.step, self.acceptance_length, self.acc = step, ev["acceptance_length"], list(ev["acc"])
            self.diagnostics = ev.get("diagnostics")
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
        return cls(saved["step"], saved["acceptance_length"], saved["acc"], state, saved.get("diagnostics"))

    def summary(self) -> dict[str, Any]:
        out = {"step": self.step, "acceptance_length": self.acceptance_length, "acc": self.acc}
        return out if self.diagnostics is None else {**out, "diagnostics": self.diagnostics}


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
    objective: torch.nn.Module
    model: Any  # the objective, or its DDP wrapper
    targets: DeviceTargets
    params: list[torch.nn.Parameter] | None = None
    optimizer: Any = None  # torch.optim.AdamW, or optim.Optimizers (Muon + AdamW)
    scheduler: Any = None
    best: Best = field(default_factory=Best)

    @classmethod
    def on(cls, P: TrainParams, rank: int, world: int, device: torch.device, data, draft) -> "Trainer":
        draft.to(device)
        objective = drafts.of(draft).objective(draft, P)
        model = wrap(objective, device) if world > 1 else objective
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
            start = int(all_reduce(torch.tensor([start if self.rank == 0 else 0], device=self.device),
                                    self.world).item())
        return start, bool(found)

    def evaluate(self, batches: list[list[int]]) -> dict[str, Any]:
        return evaluate(self.objective, self.data, batches, self.P, self.device, self.rank, self.world, self.targets)

    def calibrate(self, batches: list[list[int]]) -> dict[str, Any] | None:
        """The draft's post-hoc calibration on ``batches`` (its method's ``calibrate``, e.g. DSpark's confidence
        head, folded into the weights export writes); None for a method with nothing to calibrate."""
        fit = drafts.of(self.draft).calibrate
        if fit is None:
            return None
        return fit(self.objective, (collate(self.data, mb, self.P.max_length, self.device, self.targets)
                                    for mb in batches))

    def step(self, step: int, epoch: int, global_mbs: list[list[int]], lay: Layout, ckpt_dir: Path
             ) -> tuple[dict[str, Any], float, int]:
        """One optimizer step over this process's share of the global batch: (the TTT summary over every process,
        the gradient norm before clipping, the tokens this process trained on). A non-finite loss on any process
        stops the run, naming the step and the micro-batch's samples."""
        P, rank, world = self.P, self.rank, self.world
        mine = global_mbs[rank * P.grad_accum:(rank + 1) * P.grad_accum]
        stats, bad = accumulate(self.model, self.data, self.targets, mine, P, self.device, rank, world,
                                self.objective.steps)
        tokens = sum(min(lay.lengths[i], P.max_length) for mb in mine for i in mb)
        if all_reduce(bad, world).any():
            k = int(bad.nonzero()[0])
            ids = [lay.samples[i]["id"] for i in global_mbs[k]]
            raise TrainingDiverged(f"loss is NaN/inf at step {step + 1} (epoch {epoch}), micro-batch {k} with "
                                   f"samples {ids}; lower lr, check these samples' hidden states, or resume from "
                                   f"the last checkpoint in {ckpt_dir}")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, P.grad_clip))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return summarize(all_reduce(stats, world).cpu(), self.objective.decay), grad_norm, tokens


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
