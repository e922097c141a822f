"""What 03 reads from 02: the micro-batch schedule over 03's held-out split, and padded batches.

The schedule is a pure function of (sample lengths, seed, epoch), so optimizer step s always sees the same
micro-batches: that is what makes a resumed run follow the uninterrupted run's loss curve, and what makes N
processes x grad_accum equal one process with N x grad_accum (the global batch is the same list)."""

from __future__ import annotations

from typing import Any

import torch

from eagle3nb.data.batching import pack_batches
from eagle3nb.data.split import split_holdout
from eagle3nb.errors import InputError


def pack(indices: list[int], lengths: list[int], batch_tokens: int, max_length: int) -> list[list[int]]:
    """Greedy micro-batches in the given order: samples x longest (cut at max_length) <= batch_tokens
    (02's token-budget packing, over sample indices)."""
    batches = pack_batches([min(lengths[i], max_length) for i in indices], batch_tokens)
    return [[indices[j] for j in batch] for batch in batches]


def schedule(train_idx: list[int], lengths: list[int], *, batch_tokens: int, max_length: int, seed: int,
             per_step: int, epochs: int, max_steps: int | None) -> tuple[list[tuple[int, list[list[int]]]], int]:
    """The whole run's optimizer steps as (epoch, [per_step micro-batches]), plus the number of micro-batches
    left over at epoch ends (too few for a full global batch; they are reshuffled into later epochs)."""
    steps: list[tuple[int, list[list[int]]]] = []
    dropped, epoch = 0, 0
    while (max_steps is None and epoch < epochs) or (max_steps is not None and len(steps) < max_steps):
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = [train_idx[j] for j in torch.randperm(len(train_idx), generator=g).tolist()]
        mbs = pack(order, lengths, batch_tokens, max_length)
        full = len(mbs) // per_step
        if full == 0:
            raise InputError(f"one optimizer step needs {per_step} micro-batches (grad_accum x processes) but the "
                             f"training split packs into {len(mbs)}; lower grad_accum or batch_tokens, or add data")
        steps += [(epoch, mbs[s * per_step:(s + 1) * per_step]) for s in range(full)]
        dropped += len(mbs) - full * per_step
        epoch += 1
    if max_steps is not None:
        steps = steps[:max_steps]
    return steps, dropped


def layout(P, meta: dict[str, Any], world: int = 1):
    """(train indices, held-out indices, the step plan, leftover micro-batches) for 02's index (or the online
    source's, which lists the same samples in the same order)."""
    samples = meta["samples"]
    lengths = [int(s["length"]) for s in samples]
    train_idx, held_idx = split_holdout([s["id"] for s in samples], P.holdout_fraction)
    plan, dropped = schedule(train_idx, lengths, batch_tokens=P.batch_tokens, max_length=P.max_length,
                             seed=P.seed, per_step=P.grad_accum * world, epochs=P.epochs, max_steps=P.max_steps)
    return train_idx, held_idx, plan, dropped


class DeviceTargets:
    """The loss targets of ``HiddenStates.target_probs`` / ``target_argmax``, computed on the training device
    from the stored final state. On CPU per sample they would dominate a big run (Kimi's argmax alone is
    2 x 7168 x 163840 FLOPs per token); on the GPU they are two matmuls against the target's lm_head.
    Data stored without the final state (top-k storage) keeps the reader's own cheap path."""

    def __init__(self, data: Any, device: torch.device):
        self.data, self.device = data, device
        self.head: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None

    def __call__(self, item: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if "final" not in item:
            return self.data.target_probs(item).to(self.device), self.data.target_argmax(item).to(self.device)
        if self.head is None:
            self.head = self.data.lm_head().to(self.device, torch.float32)
            d2t = self.data.d2t.to(self.device)
            self.rows = self.head[d2t + torch.arange(d2t.shape[0], device=self.device)]
        final = item["final"].to(self.device, torch.float32)
        probs = torch.softmax(final @ self.rows.T, dim=-1)
        argmax = torch.cat([(final[s:s + 1024] @ self.head.T).argmax(-1) for s in range(0, final.shape[0], 1024)])
        return probs, argmax


def collate(data: Any, indices: list[int], max_length: int, device: torch.device,
            targets: DeviceTargets | None = None) -> dict[str, torch.Tensor]:
    """Right-padded batch of samples ``indices`` from a ``HiddenStates``. Padding never needs an attention
    mask (causal attention never looks right) and has loss mask 0."""
    targets = targets or DeviceTargets(data, device)
    # a source that computes the states (hidden.online.OnlineStates) runs the target once per micro-batch
    items = data.items(indices) if hasattr(data, "items") else [data[i] for i in indices]
    T = max(min(len(it["input_ids"]), max_length) for it in items)
    B = len(items)
    width = items[0]["aux"].shape[-1]
    out = {
        "aux": torch.zeros(B, T, width),
        "input_ids": torch.zeros(B, T, dtype=torch.int64),
        "loss_mask": torch.zeros(B, T, dtype=torch.int64),
    }
    argmax = torch.zeros(B, T, dtype=torch.int64, device=device)
    probs = torch.zeros(B, T, data.d2t.shape[0], device=device)
    for b, it in enumerate(items):
        n = min(len(it["input_ids"]), max_length)
        out["aux"][b, :n] = it["aux"][:n].float()
        out["input_ids"][b, :n] = it["input_ids"][:n]
        out["loss_mask"][b, :n] = it["loss_mask"][:n]
        p, a = targets(it)
        probs[b, :n], argmax[b, :n] = p[:n], a[:n]
    batch = {k: v.to(device, non_blocking=True) for k, v in out.items()}
    return {**batch, "target_argmax": argmax, "target_probs": probs}
