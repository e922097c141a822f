"""How LiLiCorr learns (the recipe NVIDIA's ModelOpt trains it by): DFlash's block loss, plus three terms on each
block's lattice, with absolute weights and no outer multiplier::

    loss = block_loss + w_ce * CE + w_margin * hinge + w_pen * penalty

The lattice is built from the same forward as the block loss: per drafting slot the backbone's top-K candidates
(ids without gradient), their log-probabilities recomputed from the live logits, so the three terms train the
backbone as well as the head. Each slot has a true token (``lilicorr_truth``: the target's argmax there, what greedy
decoding accepts and what the block loss here learns, by default; or the data's token, ModelOpt's choice, whose
backbone is trained on the data's tokens). The chain is walked *held to the truth*: slot 0's logits are the start
logits, slot s's the transition row leaving the candidate that holds the true token at slot s-1. A slot is
supervised when its true token is among the candidates there and at every slot before (the longest prefix the
lattice can get right), in a block whose every slot is one the block loss scores. Per supervised slot, with z its
logits and g the true candidate:

- CE: ``-log softmax(z)[g]``;
- hinge: ``relu(margin - (z[g] - max_{j != g} z[j]))`` (no other candidate at K = 1: no hinge);
- penalty: ``sum_j softmax(z)[j] * relu(t[g] - t[j])``, t the target's logit of each candidate at that position
  (its log-probabilities, from 02's stored distribution or the online target: the normaliser cancels): the head's
  mass on the candidates the target ranks below the true token, weighted by how far below.

Each term is averaged over the supervised slots. ModelOpt computes the penalty from the target's logits in the
process and so trains online only; 03's stored batches carry the target's distribution (``target_probs``, 02's
shards) as its online ones do, so this objective trains from stored states and online alike.

The diagnostics (``prefix``): per fully scored block, the prefix of true tokens the walk's own path gets right
(``selected``), the backbone's top-1 per slot (``top1``) and the longest the lattice holds at all (``oracle``): the
head's gain is selected - top1, its ranking failures oracle - selected.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from eagle3nb.drafts.base import DraftMismatchError, EvalDiagnostics
from eagle3nb.drafts.dflash.objective import BlockObjective, block_loss
from eagle3nb.drafts.lilicorr.model import LiLiCorrDraft, chain_logits, greedy_path
from eagle3nb.drafts.lilicorr.settings import weights_problem

TERMS = ("ce", "hinge", "penalty")
# What each slot's lattice is held to: the target's argmax there (what greedy decoding accepts, and what DFlash's
# block loss here learns: the target's distribution), or the data's token (ModelOpt's recipe, whose backbone learns
# the data's tokens too)
TRUTHS = ("target", "data")
PREFIXES = ("selected", "top1", "oracle")
TINY = 1e-30  # a target probability of 0 (top-k storage's tail) reads as log 1e-30: far below, finite


def prefix_lengths(cand: torch.Tensor, picks: torch.Tensor, truth: torch.Tensor) -> dict[str, torch.Tensor]:
    """cand [..., n, K], the walk's picks [..., n], the tokens to match truth [..., n] -> the leading run of slots
    right [...] for the walk (``selected``), the backbone's top-1 (``top1``) and the lattice at best (``oracle``)."""
    chosen = cand.gather(-1, picks[..., None]).squeeze(-1)  # shape: [..., n]
    runs = {"selected": chosen == truth, "top1": cand[..., 0] == truth, "oracle": (cand == truth[..., None]).any(-1)}
    return {k: v.long().cumprod(-1).sum(-1) for k, v in runs.items()}


def lattice_terms(start: torch.Tensor, pairs: torch.Tensor, cand: torch.Tensor, truth: torch.Tensor,
                  target_logp: torch.Tensor, full: torch.Tensor, margin: float) -> dict[str, torch.Tensor]:
    """The three terms on M lattices: start [M, K] and pairs [M, n-1, K, K] path logits, cand [M, n, K], truth [M, n]
    the true tokens, target_logp [M, n, K] the target's log-probabilities of each candidate at its slot, full [M]
    the blocks whose every slot is scored. Returns ``ce``, ``hinge``, ``penalty`` (means over the supervised slots,
    with grad) and ``supervised`` [M, n]."""
    hits = cand == truth[..., None]  # shape: [M, n, K]
    g = hits.long().argmax(-1)  # shape: [M, n], the true candidate (0 where absent: never supervised)
    supervised = hits.any(-1).long().cumprod(-1).bool() & full[:, None]  # shape: [M, n]
    z = chain_logits(start, pairs, g[:, :-1])  # shape: [M, n, K]
    logp = F.log_softmax(z, -1)
    ce = -logp.gather(-1, g[..., None]).squeeze(-1)  # shape: [M, n]
    z_g = z.gather(-1, g[..., None]).squeeze(-1)
    if z.shape[-1] > 1:
        hinge = F.relu(margin - (z_g - z.scatter(-1, g[..., None], float("-inf")).max(-1).values))
    else:
        hinge = torch.zeros_like(z_g)
    below = (target_logp.gather(-1, g[..., None]) - target_logp).clamp_min(0)  # shape: [M, n, K], 0 at the truth
    penalty = (logp.exp() * below).sum(-1)  # shape: [M, n]
    count = supervised.sum().clamp_min(1)
    out = {name: (t * supervised).sum() / count for name, t in zip(TERMS, (ce, hinge, penalty))}
    return {**out, "supervised": supervised}


def lattice_loss(model: LiLiCorrDraft, blocks: dict[str, torch.Tensor], input_ids: torch.Tensor,
                 target_probs: torch.Tensor, margin: float, truth: str = "target", joint: bool = True
                 ) -> dict[str, Any]:
    """The lattice's terms on ``block_loss``'s blocks (its ``blocks``: ``ctx``, ``anchor_pos``, ``hidden``,
    ``logits``, ``at``, ``top``, ``mask``) of a batch with input_ids [B, T] and target_probs [B, T, V], each slot
    held to ``truth`` (:data:`TRUTHS`). Returns the terms (``lattice_terms``), ``correct`` [S] (the walk's own pick
    equals the target's argmax, per block slot, on the block loss's slots) and ``prefix``: per fully scored block
    the three prefix lengths against the same tokens (``prefix_lengths``), summed, with ``blocks`` counted.
    ``joint`` False: the head reads the backbone's outputs detached, so the terms train the head only."""
    if not joint:
        blocks = {k: v.detach() if k in ("ctx", "hidden", "logits") else v for k, v in blocks.items()}
    B, N, S, _ = blocks["hidden"].shape
    T = input_ids.shape[1]
    at, mask = blocks["at"][:, :, 1:], blocks["mask"][:, :, 1:]  # shape: [B, N, n]: DFlash's drafting slots
    anchor, valid = model.anchor_rows(blocks["ctx"], blocks["anchor_pos"])  # shape: [B, N, H], [B, N]
    cand, start, pairs = model.lattice(blocks["hidden"][:, :, 1:].flatten(0, 1), anchor.flatten(0, 1),
                                       valid.flatten(0, 1), logits=blocks["logits"][:, :, 1:].flatten(0, 1))
    cand4 = cand.view(B, N, S - 1, -1)  # shape: [B, N, n, K]
    if truth not in TRUTHS:
        raise ValueError(f"lilicorr_truth {truth!r}: use one of {TRUTHS}")
    if truth == "data":  # the data's token at each slot
        tokens = input_ids.gather(1, (at + 1).clamp_max(T - 1).flatten(1)).view_as(at)
    else:  # the target's argmax there
        tokens = blocks["top"][:, :, 1:]
    row = torch.arange(B, device=at.device)[:, None, None, None]
    tp = target_probs[row, at[..., None], cand4].float()  # shape: [B, N, n, K], only the candidates' entries
    full = mask.all(-1).flatten()  # shape: [M]
    out = lattice_terms(start, pairs, cand, tokens.flatten(0, 1), tp.clamp_min(TINY).log().flatten(0, 1), full,
                        margin)
    with torch.no_grad():
        picks = greedy_path(start, pairs)  # shape: [M, n], the walk serving takes
        chosen = cand.gather(-1, picks[..., None]).squeeze(-1).view_as(at)
        correct = torch.zeros(S, device=at.device)
        correct[1:] = ((chosen == blocks["top"][:, :, 1:]) & mask).sum((0, 1))
        runs = prefix_lengths(cand, picks, tokens.flatten(0, 1))
        prefix = {k: (v * full).sum() for k, v in runs.items()}
    return {**out, "correct": correct, "prefix": {**prefix, "blocks": full.sum()}}


class LatticeObjective(BlockObjective, EvalDiagnostics):
    """LiLiCorr under 03's loop: DFlash's ``BlockObjective`` (its anchors, stats by block position) plus the
    lattice's weighted terms. A slot's ``correct`` is the walk's pick, as served. ``last`` holds the latest batch's
    terms and prefix sums; 03's evaluations report the prefixes over the held-out batches (``EvalDiagnostics``):
    ``prefix_selected``, ``prefix_top1``, ``prefix_oracle`` (means per fully scored block) and ``prefix_blocks``."""

    EVAL_SUMS = (*PREFIXES, "blocks")

    def __init__(self, draft: LiLiCorrDraft, anchors_per_seq: int, loss: str, weighting: str, gamma: float,
                 dpace_alpha: float, w_ce: float, w_margin: float, w_pen: float, margin: float, truth: str = "target",
                 joint: bool = True):
        if problem := weights_problem(w_ce, w_margin, w_pen, margin):
            raise DraftMismatchError(problem)
        super().__init__(draft, anchors_per_seq, loss, weighting, gamma, dpace_alpha, confidence_weight=0.0)
        self.weights, self.margin, self.truth = dict(zip(TERMS, (w_ce, w_margin, w_pen))), margin, truth
        self.joint = joint
        self.last: dict[str, Any] = {}

    @classmethod
    def from_params(cls, draft: LiLiCorrDraft, P: Any) -> "LatticeObjective":
        """The loss 03's parameters ask for: the block settings ``BlockObjective`` reads and ``lilicorr_w_ce``,
        ``lilicorr_w_margin``, ``lilicorr_w_pen``, ``lilicorr_margin``, ``lilicorr_truth``, ``lilicorr_joint``."""
        return cls(draft, P.anchors_per_seq, P.block_loss, P.block_weighting, P.block_gamma, P.dpace_alpha,
                   P.lilicorr_w_ce, P.lilicorr_w_margin, P.lilicorr_w_pen, P.lilicorr_margin, P.lilicorr_truth,
                   P.lilicorr_joint)

    def terms(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
        """``block_loss``'s output and the lattice's (``lattice_loss``) on one batch, the anchors drawn as
        ``BlockObjective`` draws them."""
        gen = None if self.training else torch.Generator().manual_seed(0)
        out = block_loss(self.draft, batch["aux"], batch["input_ids"], batch["loss_mask"], batch["target_probs"],
                         batch["target_argmax"], generator=gen, **self.kw)
        return out, lattice_loss(self.draft, out["blocks"], batch["input_ids"], batch["target_probs"], self.margin,
                                 self.truth, self.joint)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """batch: aux [B, T, n*H_t], input_ids / loss_mask / target_argmax [B, T], target_probs [B, T, V]."""
        out, lat = self.terms(batch)
        loss = out["loss"] + sum(w * lat[name] for name, w in self.weights.items() if w)
        self.last = {**{name: lat[name].detach() for name in TERMS}, **lat["prefix"]}  # tensors: no sync here
        stats = torch.stack([out["loss_sum"], out["counted"], lat["correct"], out["counted"]])[:, 1:]
        return loss, stats.double()  # shape: [], [4, drafts_per_block]

    def eval_sums(self) -> dict[str, torch.Tensor]:
        """The latest batch's prefix sums and its count of fully scored blocks."""
        return {name: self.last[name] for name in self.EVAL_SUMS}

    def eval_diagnostics(self, totals: dict[str, float]) -> dict[str, float]:
        """Mean prefix per fully scored block: the walk's, the backbone's top-1 and the oracle's, and the blocks."""
        blocks = totals["blocks"]
        return {**{f"prefix_{name}": totals[name] / max(blocks, 1.0) for name in PREFIXES},
                "prefix_blocks": int(blocks)}
