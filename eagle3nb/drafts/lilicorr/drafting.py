"""LiLiCorr's step in the batched decoder (``eagle3nb.decoder.batch``), as vLLM's V2 runner drafts it
(``v1/worker/gpu/spec_decode/lilicorr/speculator.py`` over ``dflash2/speculator.py``'s ``CandidateSampler``): DFlash's
block forward (``BlockDrafting.block``), then the lattice over the drafting slots' top-K candidates, its anchor the
context feature at the last verified token, and the walk: greedy rows take ``greedy_path``; a sampled row draws each
slot from the softmax of its logits at the row's temperature (the start logits, then the row leaving the candidate
drawn before), and that distribution, zero off the candidates, is what rejection sampling verifies against, as
vLLM caches the realised scores (-inf elsewhere). So greedy decoding gives the target's own output and sampled
decoding keeps the target's distribution."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from eagle3nb.drafts.dflash.drafting import BlockDrafting
from eagle3nb.drafts.lilicorr.model import LiLiCorrDraft, greedy_path
from eagle3nb.verification.padded import PaddedKV
from eagle3nb.verification.verify import Sampling, probs_at


def sample_path(start: torch.Tensor, pairs: torch.Tensor, cand: torch.Tensor, sampling: Sampling, vocab: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampled row's walk: start [K], pairs [n-1, K, K] logits, cand [n, K] -> the candidate drawn per slot [n]
    and the distributions drawn from [n, V] (the slot's softmax at ``sampling.temperature`` on its candidates)."""
    picks, qs = [], []
    logits = start  # shape: [K]
    for s in range(cand.shape[0]):
        if s:
            logits = pairs[s - 1, picks[-1]]
        full = torch.full((vocab,), float("-inf"), device=logits.device).scatter(0, cand[s], logits.float())
        q = probs_at(full, sampling.temperature)  # shape: [V]
        token = int(torch.multinomial(q.cpu(), 1, generator=sampling.generator))
        picks.append(int((cand[s] == token).nonzero()[0]))
        qs.append(q)
    return torch.tensor(picks, device=cand.device), torch.stack(qs)


class LatticeDrafting(BlockDrafting):
    """``BlockDrafting``'s block, its tokens picked by the lattice's walk (k = the block's drafts, as DFlash's)."""

    draft: LiLiCorrDraft

    def propose(self, kv: PaddedKV, pend_aux: torch.Tensor, pend_ids: torch.Tensor, pend_n: torch.Tensor,
                rows: Sequence[Sampling]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """k drafted tokens per row [B, k] and, for sampled rows, the distributions [k, V] they were drawn from."""
        hidden, ctx, length, _ = self.block(kv, pend_aux, pend_ids, pend_n)  # shape: [B, k, H], [B, L, H], [B]
        B = hidden.shape[0]
        anchor = ctx[torch.arange(B, device=ctx.device), (length - 1).clamp_min(0)]  # shape: [B, H]
        cand, start, pairs = self.draft.lattice(hidden, anchor, length > 0)  # shape: [B, k, K], [B, K], [B, k-1, K, K]
        picks = greedy_path(start, pairs)  # shape: [B, k]
        qs: list[torch.Tensor | None] = [None] * B
        for i, s in enumerate(rows):
            if not s.greedy:
                picks[i], qs[i] = sample_path(start[i], pairs[i], cand[i], s, self.draft.config.vocab_size)
        return cand.gather(-1, picks[..., None]).squeeze(-1), qs

    def step_timer(self, aux: torch.Tensor, ids: torch.Tensor) -> Callable[[], None]:
        """One round's drafting after the context ``aux`` [1, T, n*H_t], ``ids`` [1, T]: DFlash's block forward over
        the newest context positions (``BlockDrafting.step_timer``), its candidates and the lattice head."""
        model, S = self.draft, self.draft.config.block_size
        ctx = model.context(aux[:, -S - 1:-1])  # shape: [1, <=S, H]
        anchor, pos = ids[:, -1:], torch.tensor([[ctx.shape[1]]], device=ids.device)
        valid = torch.ones(1, dtype=torch.bool, device=ids.device)

        def step() -> None:
            hidden = model(ctx, anchor, pos)[:, 0, self.first:]  # shape: [1, k, H]
            greedy_path(*model.lattice(hidden, ctx[:, -1], valid)[1:])

        return step
