"""03's optimizer (``optimizer``): AdamW over every trainable parameter, or Muon on the draft's hidden weight
matrices with AdamW on the rest, each under the warmup + cosine schedule.

Muon (``torch.optim.Muon``) orthogonalises each update of a 2-D weight matrix, which only means something for a
matrix that maps one hidden space to another: the attention and MLP projections and ``fc``. The norms' vectors and
``lm_head`` (an output layer over the vocabulary, as Muon's authors keep it) stay with AdamW. Muon's update is
scaled to AdamW's RMS (``adjust_lr_fn="match_rms_adamw"``), so one ``lr`` serves both. An AdamW run keeps a plain
AdamW and LambdaLR, so its checkpoints are what they were before the choice existed."""

from __future__ import annotations

from typing import Any

import torch

from eagle3nb.params import StageError


class MuonUnavailable(StageError):
    """optimizer: muon on a torch without torch.optim.Muon."""


def muon_class() -> type:
    """``torch.optim.Muon``, or a one-line error naming the fix on a torch that lacks it."""
    cls = getattr(torch.optim, "Muon", None)
    if cls is None:
        raise MuonUnavailable(f"optimizer: muon needs torch.optim.Muon, which this torch ({torch.__version__}) "
                              "lacks (torch >= 2.9 has it): set optimizer: adamw or upgrade torch")
    return cls


class Group:
    """Several optimizers (or their schedules) stepped as one, saved and restored by name: the interface 03's loop
    and checkpoints use."""

    def __init__(self, parts: dict[str, Any]):
        self.parts = parts

    def step(self) -> None:
        for part in self.parts.values():
            part.step()

    def state_dict(self) -> dict[str, Any]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, part in self.parts.items():
            part.load_state_dict(state[name])


class Optimizers(Group):
    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)


class Schedulers(Group):
    def get_last_lr(self) -> list[float]:
        return next(iter(self.parts.values())).get_last_lr()


def is_matrix(name: str, p: torch.nn.Parameter) -> bool:
    """A hidden weight matrix Muon updates: 2-D, and not the output layer over the vocabulary."""
    return p.ndim == 2 and not name.startswith("lm_head.")


def build_optimizer(draft, P, schedule) -> tuple[Any, Any, list[torch.nn.Parameter]]:
    """(optimizer, scheduler, the trainable parameters) for ``P.optimizer``; ``schedule(step) -> lr factor``."""
    named = [(n, p) for n, p in draft.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    if P.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=P.lr, weight_decay=P.weight_decay, betas=(0.9, 0.95))
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule), params
    muon = muon_class()(
        [p for n, p in named if is_matrix(n, p)], lr=P.lr, weight_decay=P.weight_decay,
        adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([p for n, p in named if not is_matrix(n, p)], lr=P.lr, weight_decay=P.weight_decay,
                              betas=(0.9, 0.95))
    opts = {"muon": muon, "adamw": adamw}
    scheds = {k: torch.optim.lr_scheduler.LambdaLR(o, schedule) for k, o in opts.items()}
    return Optimizers(opts), Schedulers(scheds), params
