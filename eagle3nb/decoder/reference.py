"""Two single-sequence decoders a newcomer reads in one sitting: the target alone (``plain_generate``, the baseline
speculative decoding must reproduce), and speculative decoding of one sequence with a chain draft
(``reference_generate``: EAGLE-3 without parallel drafting), with no padding, no holes and no draft KV cache: the
draft re-reads its whole input every step. ``eagle3nb.decoder.batch.SpecBatch`` does the same for many sequences at
once; a test holds the two token-equal, greedy and with the same seeds sampled.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eagle3nb.layers import default_aux_layer_ids
from eagle3nb.verification.verify import Sampling, is_greedy, pick, probs_at, verify_greedy


@torch.inference_mode()
def plain_generate(target, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                   eos_token_ids: Sequence[int] = (), generator: torch.Generator | None = None,
                   top_p: float = 1.0) -> list[int]:
    """The target alone, one token per forward pass with a KV cache: the baseline speculative decoding is
    measured against (and, greedy, must reproduce exactly)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([list(prompt_ids)], device=target.device)
    out: list[int] = []
    while len(out) < max_new_tokens:
        logits = target(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
        tok = pick(logits, temperature, top_p, generator)
        out.append(tok)
        if tok in eos_token_ids:
            break
        ids = torch.tensor([[tok]], device=target.device)
    return out


@torch.inference_mode()
def reference_generate(target, draft, prompt_ids: Sequence[int], k: int, max_new_tokens: int,
                       temperature: float = 0.0, eos_token_ids: Sequence[int] = (),
                       generator: torch.Generator | None = None, top_p: float = 1.0,
                       verification: str = "standard") -> tuple[list[int], list[int]]:
    """Decode one prompt speculatively, ``k`` drafted tokens a round: (tokens, accepted drafts per round).
    ``verification``: how sampled drafts are judged, token-wise (``standard``) or as one block (``block``)."""
    from transformers import DynamicCache

    layer_ids = draft.config.aux_layer_ids or default_aux_layer_ids(target.config.num_hidden_layers)
    d2t = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device))  # [Vd]
    cache, dev = DynamicCache(), target.device
    sampling = Sampling(temperature, top_p, generator, verification)

    def run_target(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target over new tokens after its cache: logits [n, V], aux states [n, 3H_t] at the draft's layers."""
        out = target(input_ids=torch.tensor([ids], device=dev), cache=cache, use_cache=True, output_hidden_states=True)
        return out.logits[0], torch.cat([out.hidden_states[i][0] for i in layer_ids], dim=-1)

    logits, aux = run_target(list(prompt_ids))  # shape: [T, V], [T, 3H_t]
    out, rounds = [pick(logits[-1], temperature, top_p, generator)], []
    while len(out) < max_new_tokens and out[-1] not in eos_token_ids:
        seq = list(prompt_ids) + out  # every token so far; the target has run all but the last
        # 1. Draft k tokens. Position p pairs the target's aux state at p with token p+1; the chain's steps pair
        #    the draft's own output feature with its last drafted token.
        feats, ids = draft.fuse(aux[None])[0], seq[1:]  # shape: [len(seq) - 1, H]
        drafted, qs = [], []
        for _ in range(k):
            h, z = draft(feats[None], torch.tensor([ids], device=dev), torch.arange(len(ids), device=dev)[None])
            if is_greedy(temperature):
                tok = int(d2t[z[0, -1].argmax()])
            else:  # the draft's distribution, placed on the target's vocabulary
                q = torch.zeros(draft.config.vocab_size, device=dev).index_copy(0, d2t, probs_at(z[0, -1], temperature))
                tok = int(torch.multinomial(q.cpu(), 1, generator=generator))
                qs.append(q)
            drafted.append(tok)
            feats, ids = torch.cat([feats, h[0, -1:]]), ids + [tok]  # shape: [len(ids) + 1, H]
        # 2. Verify: the target reads the last token and the k drafts in one forward, then keeps the agreeing prefix.
        logits, new_aux = run_target([seq[-1]] + drafted)  # shape: [k + 1, V], [k + 1, 3H_t]
        if is_greedy(temperature):
            n, tok = verify_greedy(torch.tensor(drafted, device=dev), logits)
        else:
            n, tok = sampling.verify(torch.tensor(drafted), torch.stack(qs), probs_at(logits, temperature, top_p))
        # 3. The rejected drafts leave the target's cache; the accepted ones and the target's token are output.
        if n < k:
            cache.crop(n - k)  # negative: drop the last k - n positions
        aux, rounds = torch.cat([aux, new_aux[:n + 1]]), rounds + [n]
        for t in drafted[:n] + [tok]:
            out.append(t)
            if t in eos_token_ids or len(out) >= max_new_tokens:
                break
    return out, rounds
