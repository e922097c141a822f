"""Offline acceptance of a block drafter (no server): on a sequence's stored states, draft a block from every
generated token whose next token is generated too (the anchors decoding can use), and compare each slot's
greedy token with the target's argmax at that position. Teacher-forced as 04's EAGLE-3 chains are: each block
sees the data's context, which is exactly what an accepted prefix feeds when the data is the target's own greedy
output; DSpark's Markov bias reads the data's previous token, which equals the drafted one for as long as the
block is accepted.

Reported like 04: ``per_position`` alpha_i = P(drafted token i accepted | tokens < i accepted) over the blocks
where token i exists and is generated, ``acceptance_length`` tau = 1 + sum_i prod_{j<=i} alpha_j for the block's
``drafts_per_block`` tokens (``eagle3nb.formulas.tau_from_conditional``), and ``decoding_acceptance_length``
over the rounds greedy decoding would run on each sequence (``rounds``). ``chain_acceptance`` is the same
simulation in the shape 04 reads from every draft (``eagle3nb.accept.offline``): a block anchored at every token,
its drafted token i at start position t being step i.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from eagle3nb.drafts.base import expected_acceptance
from eagle3nb.drafts.dflash.model import DFlashDraft
from eagle3nb.drafts.dflash.objective import anchor_candidates, slot_targets
from eagle3nb.formulas import tau_from_conditional


@torch.no_grad()
def block_hits(model: DFlashDraft, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
               target_argmax: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence: aux [T, n*H_t], input_ids / loss_mask / target_argmax [T] (position t: the target's token
    t+1). Returns the anchor positions [A], hits and valid [A, k] (k drafted tokens per block): drafted token i
    matches the target's, and exists and is generated."""
    dev = model.fc.weight.device
    T, S = input_ids.shape[0], model.config.block_size
    ids, mask, top = input_ids.to(dev), loss_mask.to(dev).bool(), target_argmax.to(dev)
    first = 0 if model.config.sample_from_anchor else 1  # the slot of the first drafted token
    cand = anchor_candidates(mask)  # anchors decoding uses whose first drafted token is generated
    ctx = model.context(aux[None].to(dev))  # shape: [1, T, H]
    hits, valid = [], []
    for part in cand.split(chunk):
        logits = model.slot_logits(ctx, ids, part)  # shape: [A, S, V]
        at, drafts = slot_targets(model, part[None], T)  # shape: [1, A, S] each
        ok = (drafts & mask[(at + 1).clamp_max(T - 1)])[0, :, first:]  # shape: [A, k]
        valid.append(ok.long().cumprod(-1).bool())  # token i counts only where every token before it does
        hits.append((logits.argmax(-1) == top[at][0])[:, first:])
    k = S - first
    if not hits:
        return cand.cpu(), torch.zeros(0, k, dtype=torch.bool), torch.zeros(0, k, dtype=torch.bool)
    return cand.cpu(), torch.cat(hits).cpu(), torch.cat(valid).cpu()


@torch.no_grad()
def block_confidences(model: DFlashDraft, item: dict, target_argmax: torch.Tensor, chunk: int = 256
                      ) -> dict[str, torch.Tensor]:
    """DSpark, for 04's adaptive-verification simulation (``eagle3nb.accept.adaptive``): a block at every anchor
    decoding can use (``anchor_candidates``), drafted greedily left to right as vLLM's DSpark speculator drafts it (a
    slot's Markov bias and confidence read the token drafted before it, not the data's). Returns ``anchors`` [A],
    ``confidence`` [A, k] (the head's sigmoid: calibrated, as 03 folds its temperature into the export),
    ``run`` [A] (drafted tokens equal to the target's argmax before the first miss) and ``full`` [A] (all k drafted
    tokens are generated ones, so decoding verifies the whole block)."""
    dev = model.fc.weight.device
    ids, mask, top = item["input_ids"].to(dev), item["loss_mask"].to(dev).bool(), target_argmax.to(dev)
    T, first, k = ids.shape[0], 0 if model.config.sample_from_anchor else 1, model.config.drafts_per_block
    cand = anchor_candidates(mask)
    ctx = model.context(item["aux"][None].to(dev))  # shape: [1, T, H]
    conf, hits, full = [torch.zeros(0, k)], [torch.zeros(0, k, dtype=torch.bool)], [torch.zeros(0, dtype=torch.bool)]
    for part in cand.split(chunk):
        hidden = model(ctx, ids[part][None], part[None])[0][:, first:]  # shape: [A, k, H]
        at, drafts = slot_targets(model, part[None], T)  # shape: [1, A, S] each
        ok = (drafts & mask[(at + 1).clamp_max(T - 1)])[0, :, first:]  # shape: [A, k]
        prev, c, h = ids[part], [], []
        for j in range(k):
            c.append(torch.sigmoid(model.confidence_logit(hidden[:, j], prev).float()))
            prev = model.step_logits(hidden[:, j], prev).argmax(-1)  # shape: [A], the token drafted at slot j
            h.append(prev == top[at[0, :, first + j]])
        conf.append(torch.stack(c, 1).cpu())
        hits.append(torch.stack(h, 1).cpu())
        full.append(ok.all(-1).cpu())
    run = torch.cat(hits).long().cumprod(-1).sum(-1)
    return {"anchors": cand.cpu(), "confidence": torch.cat(conf), "run": run, "full": torch.cat(full)}


def rounds(anchors: torch.Tensor, hits: torch.Tensor, valid: torch.Tensor) -> list[int]:
    """Accepted drafts per round when decoding the sequence greedily: the first block at the first anchor (the
    first generated token, as after prefill), each next one at the anchor after the accepted drafts and the
    target's token. Blocks running past the sequence's generated tokens are not simulated. On the target's own
    greedy output this reproduces the rounds of real block decoding (``drafting.generate``)."""
    where = {int(p): i for i, p in enumerate(anchors)}
    out, p = [], int(anchors[0]) if len(anchors) else -1
    while p in where and bool(valid[where[p], -1]):
        n = int(hits[where[p]].long().cumprod(0).sum())
        out.append(n)
        p += n + 1
    return out


def summarize(hits: torch.Tensor, valid: torch.Tensor) -> dict[str, Any]:
    """Conditional acceptance per drafted position and the acceptance length, from hits / valid [A, k]."""
    run = torch.ones(hits.shape[0], dtype=torch.bool)
    alphas = []
    for i in range(hits.shape[1]):
        v = valid[:, i]
        before = (run & v).sum()
        run = run & hits[:, i]
        alphas.append(float((run & v).sum() / before) if before > 0 else 0.0)
    return {"per_position": alphas, "acceptance_length": tau_from_conditional(alphas),
            "blocks": int(valid[:, 0].sum()) if valid.numel() else 0}


def offline_acceptance(model: DFlashDraft, items: Iterable[dict]) -> dict[str, Any]:
    """Over items with ``aux``, ``input_ids``, ``loss_mask``, ``target_argmax`` (02's reader's fields plus the
    target's argmax): acceptance by block position and the acceptance length for the draft's block size."""
    was = model.training
    model.eval()
    seqs = [block_hits(model, it["aux"], it["input_ids"], it["loss_mask"], it["target_argmax"]) for it in items]
    model.train(was)
    out = summarize(torch.cat([h for _, h, _ in seqs]), torch.cat([v for _, _, v in seqs]))
    done = [n for s in seqs for n in rounds(*s)]
    out["decoding_acceptance_length"] = 1.0 + sum(done) / max(1, len(done))  # over the simulated rounds
    return out


@torch.no_grad()
def chain_acceptance(model: DFlashDraft, item: dict, target_argmax: torch.Tensor, target_probs: torch.Tensor | None,
                     steps: int, temperature: float, chunk: int = 256) -> dict[str, Any]:
    """04's per-start-position view of one sample (``eagle3nb.drafts`` ``chain_acceptance``): start position t
    anchors a block at token t+1 over the context 0..t, whose drafted token i is the draft's guess for token t+2+i.
    ``greedy`` / ``sampled`` / ``valid`` [steps, T-1] (steps past the block's drafts are never valid), ``guess`` /
    ``target`` [T-1] as EAGLE-3's chains give them; ``target_probs`` [T, V] at ``temperature`` when sampled."""
    dev = model.fc.weight.device
    ids, mask = item["input_ids"].to(dev), item["loss_mask"].bool().to(dev)
    top = target_argmax.to(dev)
    T = ids.shape[0]
    n, first, k = T - 1, 0 if model.config.sample_from_anchor else 1, model.config.drafts_per_block
    greedy = torch.zeros(steps, n, device=dev)
    sampled = torch.zeros(steps, n, device=dev) if target_probs is not None else None
    valid = torch.zeros(steps, n, dtype=torch.bool, device=dev)
    guess = torch.full((n,), -1, dtype=torch.long, device=dev)
    ctx = model.context(item["aux"][None].to(dev))  # shape: [1, T, H]
    for part in torch.arange(1, T, device=dev).split(chunk):  # anchors: t = part - 1
        logits = model.slot_logits(ctx, ids, part)[:, first:first + min(k, steps)].float()  # shape: [A, k', V]
        for i in range(logits.shape[1]):
            t = part - 1
            keep = t + 2 + i <= T - 1  # token t+2+i exists
            t, lg = t[keep], logits[keep, i]  # shape: [A'], [A', V]
            pred = lg.argmax(-1)
            greedy[i, t] = (pred == top[t + 1 + i]).float()
            valid[i, t] = mask[t + 2 + i]
            if i == 0:
                guess[t] = pred
            if sampled is not None:
                p = target_probs.to(dev)[t + 1 + i]
                sampled[i, t] = expected_acceptance(torch.softmax(lg / temperature, -1), p)
    valid = valid.long().cumprod(0).bool()  # step i counts only where the tokens before it are generated too
    target = torch.full((n,), -1, dtype=torch.long)
    target[:n - 1] = top[1:n].cpu()
    return {"greedy": greedy.cpu(), "sampled": sampled.cpu() if sampled is not None else None,
            "valid": valid.cpu(), "guess": guess.cpu(), "target": target}
