"""Speculative decoding with a Hugging Face target and a draft of any registered algorithm (``eagle3nb.drafts``),
for one sequence or a continuously batched set of them (``SpecBatch``, what the embedded server runs).

One round: the draft proposes k tokens (its algorithm's ``Drafting`` step); the target scores the last verified
token plus the k proposals in one forward pass (its KV cache); the longest agreeing prefix is kept plus one token
from the target (``eagle3nb.verification.verify``: sampled rows token-wise or by block verification, each row's
``Sampling.verification``). Rejected drafts leave both caches (``eagle3nb.verification.padded``).
The same decoding for one sequence without any padding: ``eagle3nb.decoder.reference``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from eagle3nb import drafts
from eagle3nb.errors import InputError
from eagle3nb.layers import default_aux_layer_ids
from eagle3nb.verification.padded import PaddedKV, attention_windows, left_padded
from eagle3nb.verification.verify import Sampling, SpecCounters, pick, probs_at, verify_greedy


@dataclass
class SpecOutput:
    tokens: list[int]
    counters: SpecCounters
    seconds: float
    accepted_per_round: list[int]  # n accepted drafts in each round (round r starts right after round r-1's tokens)
    drafted_per_round: list[list[int]] = field(default_factory=list)  # the k drafted tokens of each round (04's misses)


class SpecDecoder:
    """A target + draft pair that decodes sequences speculatively, ``k`` drafted tokens per target step.

    ``layer_ids`` are HF ``hidden_states`` indices (docs/DESIGN-FACTS.md "Layer ids"); default: the draft's
    config, else vLLM's default (2, L//2, L-3), which is what vLLM would use for a draft config without ids."""

    def __init__(self, target, draft, k: int = 3, layer_ids: Sequence[int] | None = None):
        if k < 1:
            raise InputError(f"k (num_speculative_tokens) must be >= 1, got {k}")
        self.target, self.draft, self.k = target.eval(), draft.eval(), k
        n_layers = target.config.num_hidden_layers
        ids = layer_ids if layer_ids is not None else draft.config.aux_layer_ids
        self.layer_ids = list(ids) if ids is not None else default_aux_layer_ids(n_layers)
        bad = [i for i in self.layer_ids if not 0 <= i <= n_layers]
        if bad:
            raise InputError(f"aux layer ids {bad} are outside the target's hidden_states 0..{n_layers}; check the "
                             "draft's eagle_aux_hidden_state_layer_ids (eagle3nb doctor: layer_ids)")
        if draft.config.vocab_size != target.config.vocab_size:
            raise InputError(f"the draft maps onto a vocabulary of {draft.config.vocab_size} tokens but the target "
                             f"has {target.config.vocab_size}: wrong target for this draft "
                             "(eagle3nb doctor: shapes_vocab)")
        self.device = target.device
        self.drafting = drafts.of(draft).drafting(draft, k, self.device)  # the draft algorithm's own step
        attention_windows(target.config)  # layer kinds PaddedKV cannot hold fail here, before any request

    def target_forward(self, ids: torch.Tensor, kv: PaddedKV, pos: torch.Tensor, keep: int = 0):
        """Target forward over ``ids`` [B, n] after ``kv``: (logits [B, n, V] (the last ``keep`` only, if > 0),
        aux [B, n, 3H] at the draft's layers)."""
        mask = kv.attention_mask(ids.shape[1], self.target.config, self.target.dtype)
        out = self.target(input_ids=ids, attention_mask=mask, position_ids=pos, cache=kv.cache, use_cache=True,
                          output_hidden_states=True, logits_to_keep=keep)
        kv.cache = out.cache
        return out.logits, torch.cat([out.hidden_states[i] for i in self.layer_ids], dim=-1)

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 eos_token_ids: Sequence[int] = (), generator: torch.Generator | None = None,
                 top_p: float = 1.0, verification: str = "standard") -> SpecOutput:
        """Decode one prompt (a batch of one) to ``max_new_tokens`` or an EOS: tokens, counters and seconds.
        ``verification``: sampled drafts judged token-wise (``standard``) or as one block (``block``)."""
        t0 = time.perf_counter()
        batch = SpecBatch(self)
        out = batch.add([prompt_ids], [Sampling(temperature, top_p, generator, verification)])
        rounds: list[int] = []
        drafted: list[list[int]] = []
        while len(out) < max_new_tokens and out[-1] not in eos_token_ids:
            new = batch.round()[0]
            rounds.append(len(new) - 1)
            drafted.append(batch.drafted[0])
            for tok in new:
                out.append(tok)
                if tok in eos_token_ids or len(out) >= max_new_tokens:
                    break
        return SpecOutput(out, batch.counters, time.perf_counter() - t0, rounds, drafted)


class SpecBatch:
    """Speculative decoding of many sequences at once, each with its own length, sampling and acceptance.

    A round drafts k tokens for every row (one batched draft run per step), verifies them all in one target
    forward (each row its own positions over the shared ``PaddedKV``), and accepts per row: the kept run is
    the row's longest agreeing prefix plus one target token, the rejected drafts become masked holes. Rows
    join (``add``) and leave (``keep``) between rounds, which is continuous batching. Per row the draft's
    pending state is the target's aux states of its verified tokens not yet fed to the draft (1..k+1 of them,
    right-padded): position p pairs the aux state at p with the token at p+1."""

    def __init__(self, dec: SpecDecoder):
        self.dec = dec
        self.counters = SpecCounters(dec.k)
        self._empty()

    def _empty(self) -> None:
        self.rows: list[Sampling] = []
        self.target: PaddedKV | None = None
        self.draft: PaddedKV | None = None
        self.last = torch.zeros(0, dtype=torch.long, device=self.dec.device)  # [B] emitted, not yet run by the target
        self.pend_aux: torch.Tensor | None = None  # [B, P, 3H]
        self.pend_ids = torch.zeros(0, 0, dtype=torch.long, device=self.dec.device)  # [B, P]
        self.pend_n = torch.zeros(0, dtype=torch.long, device=self.dec.device)  # [B] real entries of each pending row

    def __len__(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def add(self, prompts: Sequence[Sequence[int]], sampling: Sequence[Sampling]) -> list[int]:
        """Prefill new rows (their own left-padded batch, then merged in) and return their first tokens. The
        draft consumes every prompt position but the last, whose aux state pairs with the first token and
        opens the row's first round."""
        dec, B = self.dec, len(prompts)
        ids, mask, pos = left_padded(prompts, 0, dec.device)
        target = PaddedKV.for_target(dec.target.config, mask)
        logits, aux = dec.target_forward(ids, target, pos, keep=1)
        aux = aux.masked_fill(~mask.bool()[..., None], 0.0)  # padding's states may be NaN; the draft caches them
        first = [pick(logits[i, -1], s.temperature, s.top_p, s.generator) for i, s in enumerate(sampling)]
        draft = dec.drafting.prefill(aux, ids, pos, mask)
        firsts = torch.tensor(first, device=dec.device)
        if self.target is None:
            self.target, self.draft, self.pend_aux = target, draft, aux[:, -1:]
            self.pend_ids = firsts[:, None]
        else:
            self.target.merge(target)
            self.draft.merge(draft)
            width = self.pend_ids.shape[1]
            self.pend_aux = torch.cat([self.pend_aux, _right_pad(aux[:, -1:], width)])
            self.pend_ids = torch.cat([self.pend_ids, _right_pad(firsts[:, None], width)])
        self.pend_n = torch.cat([self.pend_n, torch.ones(B, dtype=torch.long, device=dec.device)])
        self.last = torch.cat([self.last, firsts])
        self.rows += list(sampling)
        return first

    @torch.inference_mode()
    def round(self) -> list[list[int]]:
        """One draft-and-verify round for every row: each row's accepted drafts plus the target's next token."""
        dec, k = self.dec, self.dec.k
        drafts, qs = dec.drafting.propose(self.draft, self.pend_aux, self.pend_ids, self.pend_n, self.rows)
        pos = self.target.extend(k + 1)
        logits, aux = dec.target_forward(torch.cat([self.last[:, None], drafts], dim=1), self.target, pos)
        accepted, nxt = [], []
        for i, s in enumerate(self.rows):
            if s.greedy:
                n, tok = verify_greedy(drafts[i], logits[i])
            else:
                target_p = probs_at(logits[i], s.temperature, s.top_p)
                n, tok = s.verify(drafts[i].cpu(), qs[i].cpu(), target_p.cpu())
            self.counters.record(k, n)
            accepted.append(n)
            nxt.append(tok)
        n = torch.tensor(accepted, device=dec.device)
        self.target.reject(k - n)
        self.last = torch.tensor(nxt, device=dec.device)
        # The verified positions 0..n of each row (the previous last token and its accepted drafts) pair with
        # the token after each: the next draft, or at n the target's own token.
        self.pend_aux, self.pend_n = aux, n + 1
        self.pend_ids = torch.cat([drafts, drafts[:, :1]], dim=1).scatter(1, n[:, None], self.last[:, None])
        self.drafted = drafts.tolist()  # each row's k drafted tokens of this round, accepted or not
        return [row[:a] + [t] for row, a, t in zip(self.drafted, accepted, nxt)]

    def keep(self, rows: Sequence[int]) -> None:
        """Keep only ``rows`` (in this order), e.g. when requests finish."""
        if not rows:
            self._empty()
            return
        idx = torch.tensor(list(rows), device=self.dec.device)
        self.target.select(idx)
        self.draft.select(idx)
        self.rows = [self.rows[i] for i in rows]
        self.last, self.pend_aux = self.last[idx], self.pend_aux[idx]
        self.pend_ids, self.pend_n = self.pend_ids[idx], self.pend_n[idx]


def _right_pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """Pad dim 1 of ``x`` with zeros up to ``width`` (pending entries past a row's count are never read)."""
    shape = list(x.shape)
    shape[1] = width - x.shape[1]
    return torch.cat([x, x.new_zeros(shape)], dim=1)

