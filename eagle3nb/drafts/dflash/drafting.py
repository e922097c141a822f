"""Local decoding with a block drafter, as vLLM's DFlash proposer runs it: each round the target's states at
every verified position are the context, the block is the last verified token (the anchor, at the next
position) then masks, one draft forward proposes the block's tokens, and one target forward verifies them
(greedy: ``eagle3nb.verification.verify_greedy``, so the output is the target's own greedy output). The context's
keys and values are re-projected every round (vLLM keeps them in its KV cache: the same numbers, fewer FLOPs), fine for
local checks.

``BlockDrafting`` is that step inside the batched decoder (``eagle3nb.decoder.batch``: every row its own length,
sampling and acceptance; its rounds verified by rejection sampling at T > 0); ``generate`` is the same greedy
decode of one sequence with transformers' cache, the reference the tests hold it to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from eagle3nb.drafts.base import DraftMismatchError
from eagle3nb.drafts.dflash.model import DFlashDraft
from eagle3nb.verification.padded import PaddedKV
from eagle3nb.verification.verify import Sampling, probs_at, verify_greedy


class ContextCache:
    """The context features [B, 1, L, H] of every row's verified positions (fc + hidden_norm of the target's aux
    states), as a one-tensor cache ``PaddedKV`` edits column by column (``map_kv`` / ``zip_kv``)."""

    def __init__(self, x: torch.Tensor):
        self.x = x

    def map_kv(self, fn) -> None:
        self.x = fn(self.x)

    def zip_kv(self, other: "ContextCache", fn) -> None:
        self.x = fn(self.x, other.x)


class BlockDrafting:
    """A block drafter's step for rows sharing one ``PaddedKV`` of context features (``eagle3nb.drafts.base.
    Drafting``): each round the row's pending target states join its context, then one forward drafts a block
    from its anchor (the last verified token) and the round proposes its ``k`` drafts (the block's
    ``drafts_per_block``: vLLM sizes the block it runs by k). DSpark and DFlash2 draw left to right, each slot given the
    token drawn before it."""

    def __init__(self, draft: DFlashDraft, k: int, device: torch.device):
        n = draft.config.drafts_per_block
        if k != n:  # vLLM sizes the block by k (DFlash: the anchor + k masks): another k is another block
            raise DraftMismatchError(f"k = {k} drafted tokens a round, but this {draft.method} draft's block of "
                                     f"{draft.config.block_size} drafts {n}: use k = {n} (vLLM's "
                                     "num_speculative_tokens)")
        self.draft, self.k, self.device = draft, k, device
        self.first = 0 if draft.config.sample_from_anchor else 1  # the block slot of the first drafted token

    def prefill(self, aux: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> PaddedKV:
        """The context of new rows' prompts (aux [B, T, n*H_t], ids / pos / mask [B, T], left-padded): every prompt
        position but the last, whose aux state comes with the first round's pending entries."""
        return PaddedKV(ContextCache(self.draft.context(aux[:, :-1])[:, None]), mask[:, :-1])

    def propose(self, kv: PaddedKV, pend_aux: torch.Tensor, pend_ids: torch.Tensor, pend_n: torch.Tensor,
                rows: Sequence[Sampling]) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """k drafted tokens per row [B, k] (target ids) and, for sampled rows, the distributions [k, V] they were
        drawn from. The pending entries (``pend_aux`` [B, P, n*H_t], ``pend_n`` [B] real ones) join the context;
        the token after the last one (``pend_ids``) anchors the block."""
        model = self.draft
        hidden, _, _, anchors = self.block(kv, pend_aux, pend_ids, pend_n)  # shape: [B, k, H], ..., [B, 1]
        toks, qs = [], [[] for _ in rows]
        prev = anchors[:, 0]  # shape: [B]
        for j in range(self.k):  # left to right: DSpark's bias and DFlash2's selector read the token drawn before
            lg = model.step_logits(hidden[:, j], prev).float()  # shape: [B, V]
            tok = lg.argmax(-1)
            for i, s in enumerate(rows):
                if not s.greedy:
                    q = probs_at(lg[i], s.temperature)
                    tok[i] = int(torch.multinomial(q.cpu(), 1, generator=s.generator))
                    qs[i].append(q)
            toks.append(tok)
            prev = tok
        return torch.stack(toks, dim=1), [torch.stack(q) if q else None for q in qs]

    def block(self, kv: PaddedKV, pend_aux: torch.Tensor, pend_ids: torch.Tensor, pend_n: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The round's one block forward, before any token is picked (a head on the block's slots, LiLiCorr's
        lattice, picks its own way): the pending entries join each row's context, then every row's block drafts
        from its anchor. Returns the drafting slots' states [B, k, H], each row's context features in order [B, L,
        H] (right-padded), its length [B] (the anchor's position) and the anchors [B, 1]."""
        model, width = self.draft, int(pend_n.max())
        kv.extend(width)
        kv.cache.x = torch.cat([kv.cache.x, model.context(pend_aux[:, :width])[:, None]], dim=2)
        kv.reject(width - pend_n)
        # 1. Each row's context in order, right-padded from column 0, so a column is its position.
        real = kv.mask.bool()  # shape: [B, W]
        length = real.sum(1)  # shape: [B]: the anchor's position
        L = int(length.max())
        order = real.long().argsort(dim=1, descending=True, stable=True)[:, :L]  # shape: [B, L] real columns first
        ctx = kv.cache.x[:, 0].gather(1, order[..., None].expand(-1, -1, kv.cache.x.shape[-1]))  # shape: [B, L, H]
        valid = torch.arange(L, device=length.device)[None] < length[:, None]  # shape: [B, L]
        anchors = pend_ids.gather(1, (pend_n - 1)[:, None])  # shape: [B, 1]
        # 2. One forward drafts every row's block.
        hidden = model(ctx, anchors, length[:, None], ctx_valid=valid)[:, 0, self.first:]  # shape: [B, k, H]
        return hidden, ctx, length, anchors

    def step_timer(self, aux: torch.Tensor, ids: torch.Tensor) -> Callable[[], None]:
        """One block forward after the context ``aux`` [1, T, n*H_t], ``ids`` [1, T]: the block's queries over the
        newest ``block_size`` context positions (what a round adds to vLLM's cache at most, whose keys vLLM
        projects once); the older context's cached keys cost vLLM attention only (S x L x head_dim per layer)."""
        model, S = self.draft, self.draft.config.block_size
        ctx = model.context(aux[:, -S - 1:-1])  # shape: [1, <=S, H]
        anchor, pos = ids[:, -1:], torch.tensor([[ctx.shape[1]]], device=ids.device)

        def step() -> None:
            model.logits(model(ctx, anchor, pos))

        return step


@torch.no_grad()
def draft_block(model: DFlashDraft, aux: torch.Tensor, anchor: int) -> list[int]:
    """The block's greedy drafts (``drafts_per_block`` target ids) after ``anchor``, the token at position T,
    given the target's aux states aux [T, n*H_t] at positions 0..T-1. DSpark and DFlash2 pick left to right, each
    slot's logits given the token picked before it (the anchor for the first): the Markov bias, the selector."""
    dev = model.fc.weight.device
    T = aux.shape[0]
    hidden = model(model.context(aux[None].to(dev)), torch.tensor([[anchor]], device=dev),
                   torch.tensor([[T]], device=dev))[0, 0]  # shape: [S, H]
    first = 0 if model.config.sample_from_anchor else 1  # DSpark: slot j drafts the token at T + j + 1, else T + j
    if not model.reads_prev:
        return model.logits(hidden[first:]).argmax(-1).tolist()
    out, prev = [], anchor
    for h in hidden[first:]:  # DSpark, DFlash2: left to right, each slot given the token picked before it
        prev = int(model.step_logits(h, torch.tensor(prev, device=dev)).argmax())
        out.append(prev)
    return out


@dataclass
class BlockDecode:
    """A greedy block-speculative decode: the tokens, and per round how many of the block's drafts the target
    accepted (``accepted[r]`` of ``drafts_per_block``)."""

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """Tokens per target verification: accepted drafts plus the target's own token."""
        return 1.0 + sum(self.accepted) / max(1, len(self.accepted))


def _aux(out, layer_ids: Sequence[int]) -> torch.Tensor:
    """The aux states [T, n*H] of one forward's ``hidden_states`` (HF index == our layer ids)."""
    return torch.cat([out.hidden_states[i][0] for i in layer_ids], -1)


@torch.no_grad()
def generate(target, model: DFlashDraft, prompt_ids: Sequence[int], max_new_tokens: int,
             eos_token_ids: Sequence[int] = ()) -> BlockDecode:
    """Greedy block-speculative decoding of a transformers ``target`` with the drafter: prefill, then rounds of
    (draft a block, verify it in one target forward with the KV cache, keep the accepted prefix's states)."""
    from transformers import DynamicCache

    dev, ids = target.device, model.config.aux_layer_ids
    cache = DynamicCache()
    out = target(input_ids=torch.tensor([list(prompt_ids)], device=dev), cache=cache, use_cache=True,
                 output_hidden_states=True)
    aux = _aux(out, ids)  # shape: [T, n*H_t], the verified positions' states
    tokens = [int(out.logits[0, -1].argmax())]
    result = BlockDecode(tokens)
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_token_ids:
        block = draft_block(model, aux, tokens[-1])
        feed = torch.tensor([[tokens[-1], *block]], device=dev)  # the anchor, then the drafts
        out = target(input_ids=feed, cache=cache, use_cache=True, output_hidden_states=True)
        n, nxt = verify_greedy(torch.tensor(block, device=dev), out.logits[0])
        aux = torch.cat([aux, _aux(out, ids)[:n + 1]])  # the anchor and the accepted drafts are verified
        if cache.get_seq_length() > aux.shape[0]:  # the rejected drafts leave the target's cache
            cache.crop(aux.shape[0] - cache.get_seq_length())  # negative: tokens to remove
        result.accepted.append(n)
        for t in [*block[:n], nxt]:
            if len(tokens) < max_new_tokens and tokens[-1] not in eos_token_ids:
                tokens.append(t)
    return result
