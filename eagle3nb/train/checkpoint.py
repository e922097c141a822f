"""03's checkpoints: atomic files holding everything an exact resume needs (model, optimizer, scheduler, RNG
states, the step), and the settings a resumed run must share with the run it continues."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3nb.drafts import DEFAULT, rules
from eagle3nb.drafts.eagle3.layouts import EAGLE31_KEYS
from eagle3nb.params import StageError
from eagle3nb.train.params import CURVE_KEYS, METHOD_KEYS, TrainParams

# The recipes' choices at the value every run had before they existed: a run config leaves them out at that value, so
# older runs still resume, and a checkpoint without one was made with that value. num_layers' 1 is also EAGLE-3's
# depth; a block drafter's null now resolves to its own depth (2), so its run saved with 1 is refused, naming it.
BEFORE = {"num_layers": 1, "loss": "forward_kl", "optimizer": "adamw", "parallel_drafting": False, "method": DEFAULT,
          "block_causal": False}


class ResumeMismatch(StageError, ValueError):
    """The checkpoint to resume from was made with other settings; the message names them and the ways out."""


def run_config(P: TrainParams, world: int, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """The settings a resumed run must share with the run it continues (``source``: an online or hybrid data
    source's own settings, which change the data as much as data_dir does)."""
    cfg = {k: getattr(P, k) for k in CURVE_KEYS}
    if cfg["draft_attention"] == "llama":
        del cfg["draft_attention"]  # the layer every run had before the choice existed: older runs still resume
    for key in EAGLE31_KEYS:  # EAGLE-3.1's options, off in every run before they existed
        if not cfg[key]:
            del cfg[key]
    for key, before in BEFORE.items():
        if cfg[key] == before:
            del cfg[key]
    if P.loss != "lk_lambda":
        del cfg["lk_eta"]  # only lk_lambda reads it
    for key in METHOD_KEYS:  # another method's settings, which do not shape this run
        if key not in rules(P.method).params:
            cfg.pop(key, None)
    cfg.update(source or {})
    cfg["data_dir"], cfg["init_from"] = str(P.data_path), str(P.init_path) if P.init_path else None
    cfg["global_micro_batches"] = P.grad_accum * world
    return cfg


def checkpoints(ckpt_dir: Path) -> list[Path]:
    return sorted(ckpt_dir.glob("step-*.pt"))


def save_checkpoint(path: Path, draft, optimizer, scheduler, step: int, config: dict[str, Any],
                    best: dict[str, Any] | None = None) -> None:
    """Model (without the frozen embedding), optimizer, scheduler, RNG states, the data position (the
    step: the schedule is a function of it) and ``best``, the best held-out evaluation so far with its weights
    (``model`` None when they are this step's). Written to a temporary name and renamed."""
    state = {k: v for k, v in draft.state_dict().items() if k != "embed_tokens.weight"}
    blob = {
        "step": step, "model": state, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
        "run_config": config, "best": best,
    }
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(blob, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path, draft, optimizer, scheduler, config: dict[str, Any]) -> tuple[int, dict | None]:
    """Restore everything ``save_checkpoint`` wrote: (the step, the best evaluation so far or None)."""
    blob = torch.load(path, map_location="cpu", weights_only=False)
    # a key BEFORE names, left out on either side, holds its value before it existed (so 2 -> 1 is caught too)
    saved, now = {**BEFORE, **blob["run_config"]}, {**BEFORE, **config}
    changed = {k: (saved.get(k), v) for k, v in now.items() if saved.get(k) != v}
    if changed:
        lines = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in changed.items())
        raise ResumeMismatch(f"{path} was made with other settings ({lines}). Restore them to resume, or set "
                             "resume: false / another output_dir to start a new run")
    missing = sorted(set(draft.state_dict()) - set(blob["model"]) - {"embed_tokens.weight"})
    if missing:  # a draft that has gained a trained tensor since (a block drafter's mask_embedding)
        raise ResumeMismatch(f"{path} has no {', '.join(missing)}: it was made before the draft trained them; set "
                             "resume: false / another output_dir to start a new run")
    draft.load_state_dict({**blob["model"], "embed_tokens.weight": draft.embed_tokens.weight}, strict=True)
    optimizer.load_state_dict(blob["optimizer"])
    scheduler.load_state_dict(blob["scheduler"])
    rng = blob["rng"]
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return int(blob["step"]), blob.get("best")
