"""Offline acceptance of a LiLiCorr draft on stored states (no server), as 04 reads every draft's
(``chain_acceptance``): start position t anchors a block at token t+1 over the context 0..t, as DFlash's simulation
does, and the lattice's walk picks its tokens. At T = 0 the walk follows its own picks, which is exactly what greedy
decoding verifies (a drafted token counts only while every one before it was accepted, and then each pick was the
target's token). The sampled rates hold the walk to the data's token at the slot before, where the lattice has it
(teacher-forced as 04's other chains are), each slot's draft distribution the softmax of its logits over its
candidates.

``prefix_diagnostics``: what the head adds, per block every slot of which is generated: the prefix of the target's
greedy tokens the walk gets right, the backbone's top-1 gets right, and the lattice holds at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from eagle3nb.drafts.base import expected_acceptance
from eagle3nb.drafts.dflash.objective import anchor_candidates
from eagle3nb.drafts.lilicorr.model import LiLiCorrDraft, chain_logits, greedy_path
from eagle3nb.drafts.lilicorr.objective import PREFIXES, prefix_lengths


def block_lattices(model: LiLiCorrDraft, ctx: torch.Tensor, ids: torch.Tensor, anchor_pos: torch.Tensor, k: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's blocks anchored at anchor_pos [A] (>= 1) of its tokens ids [T] over its context ctx [1, T, H],
    their first ``k`` drafting slots: candidates [A, k, K], start [A, K] and pairs [A, k-1, K, K] logits."""
    hidden = model(ctx, ids[anchor_pos][None], anchor_pos[None])[0, :, 1:1 + k]  # shape: [A, k, H]
    anchor = ctx[0, anchor_pos - 1]  # shape: [A, H]
    return model.lattice(hidden, anchor, torch.ones_like(anchor_pos, dtype=torch.bool))


@torch.no_grad()
def chain_acceptance(model: LiLiCorrDraft, item: dict, target_argmax: torch.Tensor, target_probs: torch.Tensor | None,
                     steps: int, temperature: float, chunk: int = 256) -> dict[str, Any]:
    """04's per-start-position view of one sample (``eagle3nb.drafts`` ``chain_acceptance``): ``greedy`` /
    ``sampled`` / ``valid`` [steps, T-1] (steps past the block's drafts are never valid), ``guess`` / ``target``
    [T-1]; ``target_probs`` [T, V] at ``temperature`` when sampled."""
    dev = model.fc.weight.device
    ids, mask, top = item["input_ids"].to(dev), item["loss_mask"].bool().to(dev), target_argmax.to(dev)
    T = ids.shape[0]
    n, k = T - 1, min(model.config.drafts_per_block, steps)
    greedy = torch.zeros(steps, n, device=dev)
    sampled = torch.zeros(steps, n, device=dev) if target_probs is not None else None
    valid = torch.zeros(steps, n, dtype=torch.bool, device=dev)
    guess = torch.full((n,), -1, dtype=torch.long, device=dev)
    ctx = model.context(item["aux"][None].to(dev))  # shape: [1, T, H]
    for part in torch.arange(1, T, device=dev).split(chunk):  # anchors at part, contexts 0..t with t = part - 1
        cand, start, pairs = block_lattices(model, ctx, ids, part, k)
        picks = greedy_path(start, pairs)  # shape: [A, k]
        chosen = cand.gather(-1, picks[..., None]).squeeze(-1)  # shape: [A, k]
        if sampled is not None:  # held to the data's token at the slot before, where the lattice has it
            data = ids[(part[:, None] + 1 + torch.arange(k, device=dev)).clamp_max(T - 1)]  # shape: [A, k]
            hits = cand == data[..., None]
            held = torch.where(hits.any(-1), hits.long().argmax(-1), picks)  # shape: [A, k]
            q = torch.softmax(chain_logits(start, pairs, held[:, :-1]) / temperature, -1)  # shape: [A, k, K]
        for i in range(k):
            t = part - 1
            keep = t + 2 + i <= T - 1  # token t+2+i exists
            t = t[keep]
            greedy[i, t] = (chosen[keep, i] == top[t + 1 + i]).float()
            valid[i, t] = mask[t + 2 + i]
            if i == 0:
                guess[t] = chosen[keep, 0]
            if sampled is not None:
                full = torch.zeros(len(t), target_probs.shape[-1], device=dev).scatter(1, cand[keep, i], q[keep, i])
                sampled[i, t] = expected_acceptance(full, target_probs.to(dev)[t + 1 + i])
    valid = valid.long().cumprod(0).bool()  # step i counts only where the tokens before it are generated too
    target = torch.full((n,), -1, dtype=torch.long)
    target[:n - 1] = top[1:n].cpu()
    return {"greedy": greedy.cpu(), "sampled": sampled.cpu() if sampled is not None else None,
            "valid": valid.cpu(), "guess": guess.cpu(), "target": target}


@torch.no_grad()
def prefix_diagnostics(model: LiLiCorrDraft, items: Iterable[dict], chunk: int = 256) -> dict[str, float]:
    """Over items with ``aux``, ``input_ids``, ``loss_mask``, ``target_argmax``: per block decoding can anchor
    whose drafts are all generated tokens, the mean prefix of the target's greedy tokens that the walk
    (``selected``), the backbone's top-1 (``top1``) and the lattice at best (``oracle``) get right, and ``blocks``."""
    was = model.training
    model.eval()
    dev, k = model.fc.weight.device, model.config.drafts_per_block
    sums, blocks = dict.fromkeys(PREFIXES, 0.0), 0
    for it in items:
        ids, mask, top = it["input_ids"].to(dev), it["loss_mask"].to(dev).bool(), it["target_argmax"].to(dev)
        T = ids.shape[0]
        ctx = model.context(it["aux"][None].to(dev))  # shape: [1, T, H]
        anchors = anchor_candidates(mask)
        slots = anchors[:, None] + torch.arange(1, k + 1, device=dev)  # shape: [A, k], each drafted token's position
        whole = (anchors >= 1) & (slots < T).all(-1) & mask[slots.clamp_max(T - 1)].all(-1)  # blocks generated
        anchors = anchors[whole]
        for part in anchors.split(chunk):
            cand, start, pairs = block_lattices(model, ctx, ids, part, k)
            truth = top[part[:, None] + torch.arange(k, device=dev)]  # shape: [A, k], the target's greedy tokens
            for name, run in prefix_lengths(cand, greedy_path(start, pairs), truth).items():
                sums[name] += float(run.sum())
            blocks += len(part)
    model.train(was)
    return {**{name: s / max(blocks, 1) for name, s in sums.items()}, "blocks": blocks}
