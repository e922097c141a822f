"""How a block drafter learns (DFlash's recipe, as speculators 0.9.0 trains it): anchors sampled from the
generated (loss-masked) positions of each sequence, every block seeing the context before its anchor, all
blocks of a sequence in one forward; per slot a KL (or CE) to the target's next-token distribution, weighted by
block position:

- ``decay``: ``exp(-i/gamma)`` for the i-th drafted token of the block (i from 0), DFlash's weighting: the
  first tokens decide the acceptance length, so they count most.
- ``dpace`` (D-PACE, arXiv 2605.18810): token i weighs the sum over j >= i of the running product of the draft's
  own smoothed confidence ``(1-alpha) q_j + alpha`` up to j (q_j the draft's probability of the target's token),
  which is the gradient of the expected accepted length; the weights carry no gradient.

DSpark adds its Markov bias to every slot's logits (teacher-forced: the previous token of the data), and a
binary cross-entropy teaching the confidence head the slot's acceptance probability ``sum_v min(p_v, q_v)``.
DFlash2 adds a cross-entropy teaching its candidate selector to pick the target's token among the unary top-k,
given the data's previous token, weighted as the unary loss (``selector_loss``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eagle3nb.drafts.dflash.model import DFlashDraft

LOSSES = ("kl", "ce")
WEIGHTINGS = ("decay", "dpace")
SELECTOR_WEIGHT = 1.0  # DFlash2's selector loss beside the unary one (speculators' selector_loss_alpha default)


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """[M] the positions p with tokens p and p+1 generated (``loss_mask`` [T])."""
    m = loss_mask.bool()
    return (m[:-1] & m[1:]).nonzero().squeeze(-1)


def select_anchors(loss_mask: torch.Tensor, n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to ``n`` distinct anchor positions [N] (sorted) among the generated positions whose next token is
    generated too (speculators' choice): decoding anchors a block at a token the target made, and a block
    from there drafts at least one token the loss counts."""
    cand = anchor_candidates(loss_mask)  # shape: [M]
    pick = torch.randperm(cand.numel(), generator=generator)[:n]
    return cand[pick].sort().values


def slot_targets(model: DFlashDraft, anchor_pos: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For blocks at anchor_pos [B, N]: the sequence position whose *next-token* distribution each slot is
    trained on [B, N, S] (DFlash slot j: anchor + j - 1; DSpark: anchor + j), and which slots draft at all
    [B, N, S] bool (DFlash's anchor slot does not; positions past the sequence do not)."""
    S = model.config.block_size
    j = torch.arange(S, device=anchor_pos.device)
    shift = 0 if model.config.sample_from_anchor else -1
    at = anchor_pos[..., None] + j + shift  # shape: [B, N, S]
    drafts = (at >= anchor_pos[..., None]) & (at < T - 1)
    return at.clamp(0, T - 1), drafts


def draft_index(model: DFlashDraft) -> torch.Tensor:
    """[S] the i of each slot among the block's drafted tokens (DFlash's anchor slot: -1)."""
    S = model.config.block_size
    return torch.arange(S) - (0 if model.config.sample_from_anchor else 1)


def position_weights(kind: str, index: torch.Tensor, mask: torch.Tensor, confidence: torch.Tensor | None,
                     gamma: float, alpha: float) -> torch.Tensor:
    """[..., S] weights per slot: ``decay`` exp(-i/gamma) (index [S], the drafted-token index); ``dpace`` the
    suffix sums of the running products of the smoothed ``confidence`` [..., S] over the drafting slots
    (``mask`` [..., S] bool); zero where ``mask`` is off."""
    mask = mask.float()
    if kind == "decay":
        return torch.exp(-index.clamp_min(0).float() / gamma).to(mask.device) * mask
    if kind != "dpace":
        raise ValueError(f"position weighting {kind!r}: use one of {WEIGHTINGS}")
    with torch.no_grad():
        smooth = torch.where(mask > 0, (1 - alpha) * confidence.float() + alpha, torch.ones_like(mask))
        prefix = smooth.cumprod(-1) * mask  # shape: [..., S]
        return prefix.flip(-1).cumsum(-1).flip(-1) * mask


def block_loss(model: DFlashDraft, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
               target_probs: torch.Tensor, target_argmax: torch.Tensor, *, anchors_per_seq: int = 512,
               loss: str = "kl", weighting: str = "decay", gamma: float = 4.0, dpace_alpha: float = 0.5,
               confidence_weight: float = 1.0, generator: torch.Generator | None = None) -> dict[str, Any]:
    """One micro-batch's loss. aux [B, T, n*H_t], input_ids / loss_mask [B, T] (right-padded: loss_mask 0 on
    padding), target_probs [B, T, V] and target_argmax [B, T] (position t: the target's distribution over, and
    pick for, token t+1). Returns ``loss`` (scalar, with grad) and, detached, per slot [S]: ``loss_sum`` (the
    unweighted per-slot loss summed), ``correct`` / ``counted`` (greedy top-1 against the target's argmax) and,
    for DSpark, ``confidence_loss`` and ``confidence`` (the head's logit and the acceptance probability it
    estimates, on every scored slot); ``blocks``, what a head on the block's slots reads (LiLiCorr's lattice), with
    grad: the context features ``ctx`` [B, T, H], ``anchor_pos`` [B, N], the slots' post-norm states ``hidden`` [B,
    N, S, H] and ``logits`` [B, N, S, V], each slot's position ``at`` [B, N, S] (whose next token it drafts), the
    target's argmax there ``top`` and the scored slots ``mask`` [B, N, S]."""
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r}: use one of {LOSSES}")
    cfg, dev = model.config, aux.device
    B, T = input_ids.shape
    picks = [select_anchors(loss_mask[b].cpu(), anchors_per_seq, generator) for b in range(B)]
    N = max(1, max(p.numel() for p in picks))
    anchor_pos = torch.zeros(B, N, dtype=torch.long)
    used = torch.zeros(B, N, dtype=torch.bool)
    for b, p in enumerate(picks):
        anchor_pos[b, :p.numel()], used[b, :p.numel()] = p, True
    anchor_pos, used = anchor_pos.to(dev), used.to(dev)
    anchors = input_ids.gather(1, anchor_pos)  # shape: [B, N]
    ctx = model.context(aux)  # shape: [B, T, H]
    hidden = model(ctx, anchors, anchor_pos, ctx_valid=loss_mask.new_ones(B, T).bool())
    logits = model.logits(hidden).float()  # shape: [B, N, S, V]
    at, drafts = slot_targets(model, anchor_pos, T)  # shape: [B, N, S] each
    flat = at.view(B, -1)
    p_tgt = target_probs.gather(1, flat[..., None].expand(-1, -1, target_probs.shape[-1])).view_as(logits).float()
    top = target_argmax.gather(1, flat).view_as(at)  # shape: [B, N, S]
    generated = loss_mask.gather(1, (flat + 1).clamp_max(T - 1)).view_as(at).bool()  # the drafted token's mask
    mask = drafts & generated & used[..., None]  # shape: [B, N, S]
    prev = input_ids.gather(1, flat).view_as(at)  # shape: [B, N, S], the data's token before each drafted one
    if cfg.markov_rank > 0:  # DSpark: slot j's bias from the data's token before it (the anchor for slot 0)
        logits = logits + model.markov_bias(prev).float()
    logp = F.log_softmax(logits, -1)  # shape: [B, N, S, V]
    own = logp.gather(-1, top[..., None]).squeeze(-1)  # shape: [B, N, S], log q(target's token)
    per_slot = -own if loss == "ce" else (p_tgt * (p_tgt.clamp_min(1e-30).log() - logp)).sum(-1)
    index = draft_index(model).to(dev)
    weights = position_weights(weighting, index, mask, own.detach().exp(), gamma, dpace_alpha)
    counted = mask.float().sum().clamp_min(1.0)
    total = (per_slot * weights).sum() / counted
    out: dict[str, Any] = {}
    if cfg.markov_rank > 0:  # the confidence head learns the slot's acceptance probability
        with torch.no_grad():
            accept = torch.minimum(logp.exp(), p_tgt).sum(-1)  # shape: [B, N, S]
        conf = model.confidence_logit(hidden, prev).float()  # shape: [B, N, S]
        bce = F.binary_cross_entropy_with_logits(conf, accept, reduction="none")
        decay = position_weights("decay", index, mask, None, gamma, dpace_alpha)
        out["confidence_loss"] = (bce * decay).sum() / counted
        total = total + confidence_weight * out["confidence_loss"]
        out["confidence_loss"] = out["confidence_loss"].detach()
        out["confidence"] = (conf[mask].detach(), accept[mask])  # shape: [M] each, the scored slots
    hit = (logits.argmax(-1) == top) & mask
    if cfg.selector_rank > 0:  # DFlash2: the selector learns to pick the target's token among the unary top-k
        ce, hit = selector_loss(model, logits, hidden, prev, top, mask)
        out["selector_loss"] = (ce * weights).sum() / counted
        total = total + SELECTOR_WEIGHT * out["selector_loss"]
        out["selector_loss"] = out["selector_loss"].detach()
    out.update(loss=total, loss_sum=(per_slot * mask).sum((0, 1)).detach(), correct=hit.sum((0, 1)).detach(),
               counted=mask.sum((0, 1)).detach(),
               blocks={"ctx": ctx, "anchor_pos": anchor_pos, "hidden": hidden, "logits": logits, "at": at, "top": top,
                       "mask": mask})
    return out


def selector_loss(model: DFlashDraft, logits: torch.Tensor, hidden: torch.Tensor, prev: torch.Tensor,
                  top: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DFlash2's teacher-forced selector objective (speculators' ``compute_selector_loss``): per slot the unary
    logits' top-k candidates [B, N, S, K], the target's token put in the last place where it is missing (so every
    slot has a K-way label), and the cross-entropy of the selector's scores given the data's previous token. Returns
    the per-slot cross-entropy [B, N, S] and the slots whose selected candidate is the target's token within the
    serving candidates (the target not injected) [B, N, S]."""
    cand = logits.detach().topk(model.config.selector_top_k, dim=-1).indices  # shape: [B, N, S, K]
    present = (cand == top[..., None]).any(-1)  # shape: [B, N, S]
    cand[..., -1] = torch.where(present, cand[..., -1], top)
    label = (cand == top[..., None]).long().argmax(-1)  # shape: [B, N, S]
    scores = model.candidate_selector.scores(logits, hidden, prev, cand).float()  # shape: [B, N, S, K]
    ce = F.cross_entropy(scores.flatten(0, -2), label.flatten(), reduction="none").view_as(label)
    picked = cand.gather(-1, scores.detach().argmax(-1, keepdim=True)).squeeze(-1)  # shape: [B, N, S]
    return ce, (picked == top) & present & mask


class BlockObjective(nn.Module):
    """The drafter under 03's loop (``eagle3nb.drafts`` ``objective``): ``forward(batch)`` = (loss, stats [4,
    drafts_per_block]) by *block position* (the i-th drafted token of a block), where EAGLE-3's are by TTT step.
    Training draws anchors from torch's global generator (a resumed run restores it); evaluation uses every
    candidate anchor up to ``anchors_per_seq`` drawn from a fixed seed, so held-out numbers repeat."""

    unit = "block position"  # what 03's report calls the stats' columns

    def __init__(self, draft: DFlashDraft, anchors_per_seq: int, loss: str, weighting: str, gamma: float,
                 dpace_alpha: float, confidence_weight: float):
        super().__init__()
        self.draft = draft
        self.kw = {"anchors_per_seq": anchors_per_seq, "loss": loss, "weighting": weighting, "gamma": gamma,
                   "dpace_alpha": dpace_alpha, "confidence_weight": confidence_weight}
        self.steps = draft.config.drafts_per_block  # 03's stats columns
        self.decay = math.exp(-1.0 / gamma)  # exp(-i/gamma) = decay**i: how 03 weighs the positions' losses

    @classmethod
    def from_params(cls, draft: DFlashDraft, P: Any) -> "BlockObjective":
        """The loss 03's parameters ask for (``anchors_per_seq``, ``block_loss``, ``block_weighting``,
        ``block_gamma``, ``dpace_alpha``, ``confidence_weight``)."""
        return cls(draft, P.anchors_per_seq, P.block_loss, P.block_weighting, P.block_gamma, P.dpace_alpha,
                   P.confidence_weight)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """batch: aux [B, T, n*H_t], input_ids / loss_mask / target_argmax [B, T], target_probs [B, T, V]."""
        gen = None if self.training else torch.Generator().manual_seed(0)
        out = block_loss(self.draft, batch["aux"], batch["input_ids"], batch["loss_mask"], batch["target_probs"],
                         batch["target_argmax"], generator=gen, **self.kw)
        first = 0 if self.draft.config.sample_from_anchor else 1  # DFlash's anchor slot drafts nothing
        stats = torch.stack([out["loss_sum"], out["counted"], out["correct"], out["counted"]])[:, first:]
        return out["loss"], stats.double()  # shape: [], [4, drafts_per_block]

    @torch.no_grad()
    def confidence(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """DSpark: the confidence head's logits [M] on the batch's scored slots (evaluation's fixed anchors) and
        the acceptance probabilities [M] they estimate (``calibration``)."""
        return block_loss(self.draft, batch["aux"], batch["input_ids"], batch["loss_mask"], batch["target_probs"],
                          batch["target_argmax"], generator=torch.Generator().manual_seed(0), **self.kw)["confidence"]
