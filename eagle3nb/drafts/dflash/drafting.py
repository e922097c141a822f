"""Local decoding with a block drafter, as vLLM's DFlash proposer runs it: each round the target's states at
every verified position are the context, the block is the last verified token (the anchor, at the next
position) then masks, one draft forward proposes the block's tokens, and one target forward verifies them
(greedy: ``eagle3nb.spec.verify_greedy``, so the output is the target's own greedy output). The context is
re-projected every round (vLLM keeps it in its KV cache: the same numbers, fewer FLOPs), fine for local checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from eagle3nb.drafts.dflash.model import DFlashDraft
from eagle3nb.spec.verify import verify_greedy


@torch.no_grad()
def draft_block(model: DFlashDraft, aux: torch.Tensor, anchor: int) -> list[int]:
    """The block's greedy drafts (``drafts_per_block`` target ids) after ``anchor``, the token at position T,
    given the target's aux states aux [T, n*H_t] at positions 0..T-1. DSpark picks left to right, each slot's
    logits biased by the Markov head from the token picked before it (the anchor for the first)."""
    dev = model.fc.weight.device
    T = aux.shape[0]
    hidden = model(model.context(aux[None].to(dev)), torch.tensor([[anchor]], device=dev),
                   torch.tensor([[T]], device=dev))[0, 0]  # shape: [S, H]
    logits = model.logits(hidden)  # shape: [S, V]
    if model.config.markov_rank == 0:
        return logits[1:].argmax(-1).tolist()  # DFlash: slot j >= 1 drafts the token at T + j
    out, prev = [], anchor
    for j in range(model.config.block_size):  # DSpark: slot j drafts the token at T + j + 1
        prev = int((logits[j] + model.markov_bias(torch.tensor(prev, device=dev))).argmax())
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
