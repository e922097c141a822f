"""A block drafter's greedy decode held to 04's offline simulation of it: ``decode_and_replay`` decodes a prompt with
the batched decoder, runs the target over its own output and simulates the rounds on those states with the draft's
``chain_acceptance`` (shared by the block drafters' modules: test_lilicorr.py's and test_dflash.py's batched-decoder
tests)."""

from __future__ import annotations

from typing import Any

import torch


def decode_and_replay(dec: Any, prompt: list[int], new_tokens: int) -> tuple[Any, dict, list[int]]:
    """``dec`` (a ``SpecDecoder``) decodes ``prompt`` greedily for ``new_tokens``; returns its output, the offline
    item of that output (the target's aux states at the draft's layers, ids, the generated tokens' mask, the target's
    argmax) and the accepted drafts per round 04's ``simulate_rounds`` finds on it."""
    from eagle3nb import drafts
    from eagle3nb.accept.offline import simulate_rounds

    draft, k = dec.draft, dec.k
    out = dec.generate(prompt, new_tokens)
    ids = torch.tensor(prompt + out.tokens)
    with torch.no_grad():
        states = dec.target(input_ids=ids[None], output_hidden_states=True)
    aux = torch.cat([states.hidden_states[j][0] for j in draft.config.aux_layer_ids], -1)
    mask = (torch.arange(len(ids)) >= len(prompt)).long()
    item = {"aux": aux, "input_ids": ids, "loss_mask": mask, "target_argmax": states.logits[0].argmax(-1)}
    r = drafts.of(draft).chain_acceptance(draft, item, item["target_argmax"], None, k, 0.0)
    return out, item, simulate_rounds(r["greedy"], r["valid"], mask, k)
