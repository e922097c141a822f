"""EAGLE-3's offline acceptance simulation (04, no server): on held-out hidden states, chain drafts of length K from
every position with the training-time-test attention (step j at position t sees the verified features 0..t and its
own chain), and compare each step with the target. Steps are teacher-forced with the data's tokens, which are exactly
what an accepted chain feeds when the data is the target's own (greedy) output; ``eagle3nb.accept.offline`` turns
the per-position results into acceptance rates.
"""

from __future__ import annotations

from eagle3nb.drafts.base import expected_acceptance
from eagle3nb.drafts.eagle3.cache import TTTCache


def chain_logits(draft, aux, input_ids, steps: int):
    """Draft logits of a K-step chain from every position, in parallel (training-time-test attention), one
    step at a time (a generator, so only one step's logits are held).

    aux [T, 3H], input_ids [T]. Step j at position t feeds the token t+1+j and predicts token t+2+j; yields
    ``steps`` tensors [T-1, draft_vocab] on the draft's device. Positions follow decoding: step j sits at
    position t + j. A parallel-drafting draft's steps j >= 1 read the mask token and feature (its mask slots)."""
    import torch

    dev = draft.fc.weight.device
    T = input_ids.shape[0]
    cache = TTTCache()
    pos = torch.arange(T - 1, device=dev)[None]
    hidden = draft.fuse(aux[None, :-1].to(dev))
    input_ids = input_ids.to(dev)
    for j in range(steps):
        ids = torch.zeros(T - 1, dtype=torch.long, device=dev)
        ids[: max(0, T - 1 - j)] = input_ids[1 + j:]
        inputs, hidden = draft.unroll_inputs(j, ids[None], hidden)  # shape: [1, T-1], [1, T-1, H]
        hidden, logits = draft(hidden, inputs, pos + j, cache=cache)
        yield logits[0].float()


def chain_acceptance(draft, item: dict, target_argmax, target_probs, steps: int, temperature: float) -> dict:
    """Per start position t: greedy acceptance [K, T-1] (0/1), expected sampled acceptance [K, T-1] (when
    ``target_probs`` [T, draft_vocab] at ``temperature`` is given), validity [K, T-1] (step j counts
    only when the tokens t+2..t+2+j exist and are all generated ones, i.e. in the loss mask), and the first
    step's ``guess`` [T-1] (the draft's token t+2, target ids; -1 where none) beside the target's own ``target``
    [T-1] (its argmax for token t+2): what the miss view shows where the draft was wrong."""
    import torch

    dev = draft.fc.weight.device
    ids, mask = item["input_ids"], item["loss_mask"].bool().to(dev)
    target_argmax = target_argmax.to(dev)
    target_probs = target_probs.to(dev) if target_probs is not None else None
    T = ids.shape[0]
    n = T - 1
    greedy = torch.zeros(steps, n, device=dev)
    sampled = torch.zeros(steps, n, device=dev) if target_probs is not None else None
    valid = torch.zeros(steps, n, dtype=torch.bool, device=dev)
    ok = torch.ones(n, dtype=torch.bool, device=dev)
    guess = torch.full((n,), -1, dtype=torch.long, device=dev)
    with torch.no_grad():  # evaluation only, whoever calls it
        for j, lg in enumerate(chain_logits(draft, item["aux"], ids, steps)):
            m = n - 1 - j  # positions t whose step-j target (the target's distribution at t+1+j) exists
            if m <= 0:
                break
            tgt = torch.zeros(n, dtype=torch.bool, device=dev)
            tgt[:m] = mask[2 + j:]
            ok = ok & tgt
            valid[j] = ok
            pred = draft.draft_to_target(lg[:m].argmax(-1))
            greedy[j, :m] = (pred == target_argmax[1 + j: 1 + j + m]).float()
            if j == 0:
                guess[:m] = pred
            if sampled is not None:
                q = torch.softmax(lg[:m] / temperature, dim=-1)
                sampled[j, :m] = expected_acceptance(q, target_probs[1 + j: 1 + j + m])
    target = torch.full((n,), -1, dtype=torch.long)
    target[:n - 1] = target_argmax[1:n].cpu()
    return {"greedy": greedy.cpu(), "sampled": sampled.cpu() if sampled is not None else None,
            "valid": valid.cpu(), "guess": guess.cpu(), "target": target}
