"""Chain speculative decoding with a Hugging Face target and our EAGLE-3 draft (one sequence at a time).

One round: the draft, fed the target's aux hidden states of every verified token, proposes k tokens (its own
KV cache, its own output hidden state fed back); the target scores the last verified token plus the k
proposals in one forward pass (its KV cache); the longest agreeing prefix is kept plus one token from the
target. Greedy: agree = equal to the target's argmax, so the output is exactly the target's greedy output.
Sampling: standard rejection sampling (accept d with min(1, p(d)/q(d)), else draw from the residual
max(0, p - q)), so the output distribution is exactly the target's. Both caches are cropped on rejection.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3nb.bench import summarize_counts


@dataclass
class SpecCounters:
    """vLLM's spec-decode counters: drafts, drafted tokens, accepted tokens, accepted tokens per position."""

    k: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.per_pos = self.per_pos or [0] * self.k

    def record(self, n_drafted: int, n_accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += n_drafted
        self.accepted += n_accepted
        for i in range(n_accepted):
            self.per_pos[i] += 1

    def merge(self, other: "SpecCounters") -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted += other.accepted
        self.per_pos = [a + b for a, b in zip(self.per_pos, other.per_pos)]

    def summary(self) -> dict[str, Any]:
        return summarize_counts(self.drafts, self.draft_tokens, self.accepted, self.per_pos)


def probs_at(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sampling distribution at ``temperature`` (> 0), in float32 for stable ratios."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def verify_greedy(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification. ``draft_ids`` [k] target-vocab ids, ``target_logits`` [k+1, V] (row i predicts the
    token after draft i-1). Returns (accepted count n, the target's token after the accepted prefix)."""
    target = target_logits.argmax(-1)
    k = draft_ids.shape[0]
    n = int((draft_ids == target[:k]).long().cumprod(0).sum())
    return n, int(target[n])


def verify_sampling(draft_ids: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                    generator: torch.Generator | None = None) -> tuple[int, int]:
    """Rejection sampling. ``draft_probs`` [k, V] the draft's distributions (over the target vocab) the ids were
    drawn from, ``target_probs`` [k+1, V]. Accept draft i with prob min(1, p/q); at the first rejection draw
    from normalize(max(0, p - q)); if all k are accepted draw the bonus token from p[k]."""
    k = draft_ids.shape[0]
    u = torch.rand(k, generator=generator)
    for i in range(k):
        d = int(draft_ids[i])
        p, q = float(target_probs[i, d]), float(draft_probs[i, d])
        if q > 0 and u[i] * q <= p:
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: the residual is undefined, p is exact
            residual = target_probs[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return k, int(torch.multinomial(target_probs[k], 1, generator=generator))


def _crop(cache, length: int) -> None:
    """Crop a transformers cache to ``length`` tokens (negative = tokens to remove, valid in 4.x and 5.x)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits.argmax(-1))
    return int(torch.multinomial(probs_at(logits, temperature), 1, generator=generator))


@torch.no_grad()
def plain_generate(target, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                   eos_token_ids: Sequence[int] = (), generator: torch.Generator | None = None) -> list[int]:
    """The target alone, one token per forward pass with a KV cache: the baseline speculative decoding is
    measured against (and, greedy, must reproduce exactly)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([list(prompt_ids)])
    out: list[int] = []
    while len(out) < max_new_tokens:
        logits = target(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        tok = _pick(logits, temperature, generator)
        out.append(tok)
        if tok in eos_token_ids:
            break
        ids = torch.tensor([[tok]])
    return out


@dataclass
class SpecOutput:
    tokens: list[int]
    counters: SpecCounters
    seconds: float


class SpecDecoder:
    """Chain speculative decoding of one sequence: ``SpecDecoder(target, draft, k).generate(prompt_ids, n)``.

    ``layer_ids`` are HF ``hidden_states`` indices (DESIGN.md); default: the draft's config.
    """

    def __init__(self, target, draft, k: int = 3, layer_ids: Sequence[int] | None = None):
        if k < 1:
            raise ValueError(f"k (num_speculative_tokens) must be >= 1, got {k}")
        self.target, self.draft, self.k = target.eval(), draft.eval(), k
        self.layer_ids = list(layer_ids if layer_ids is not None else draft.config.aux_layer_ids)
        n_states = target.config.num_hidden_layers + 1
        bad = [i for i in self.layer_ids if not 0 <= i < n_states]
        if bad:
            raise ValueError(f"aux layer ids {bad} are outside the target's hidden_states 0..{n_states - 1}; "
                             "check the draft's eagle_aux_hidden_state_layer_ids (eagle3nb doctor: layer_ids)")
        vocab = target.config.vocab_size
        d2t_ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size))
        self._d2t_ids = d2t_ids.long()
        self._target_vocab = vocab

    def _target_step(self, ids: list[int], cache) -> tuple[torch.Tensor, torch.Tensor]:
        """Target forward over ``ids`` after the cache: (logits [n, V], aux [1, n, 3H])."""
        out = self.target(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True,
                          output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i] for i in self.layer_ids], dim=-1)
        return out.logits[0], aux

    def _draft_probs(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """Draft distribution over the draft vocab mapped onto the target vocab (zero outside it)."""
        q = torch.zeros(self._target_vocab)
        q[self._d2t_ids] = probs_at(logits, temperature)
        return q

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 eos_token_ids: Sequence[int] = (), generator: torch.Generator | None = None) -> SpecOutput:
        from transformers import DynamicCache

        from eagle3nb.draft import DraftCache

        t0 = time.perf_counter()
        counters = SpecCounters(self.k)
        greedy = temperature <= 0
        tcache, dcache = DynamicCache(), DraftCache()
        prompt = list(prompt_ids)
        logits, aux = self._target_step(prompt, tcache)
        out = [_pick(logits[-1], temperature, generator)]
        # Draft inputs not yet in the draft cache: aux of verified tokens paired with the token after each.
        pend_aux, pend_ids = aux, prompt[1:] + out
        committed = 0  # positions in the draft cache that hold verified (target) states
        while len(out) < max_new_tokens and out[-1] not in eos_token_ids:
            n_new = pend_aux.shape[1]
            hidden = self.draft.fuse(pend_aux)
            pos = torch.arange(committed, committed + n_new)[None]
            h, dl = self.draft(hidden, torch.tensor([pend_ids]), pos, cache=dcache)
            committed += n_new
            drafts, qs = [], []
            h_last, l_last = h[:, -1:], dl[0, -1]
            for j in range(self.k):
                if greedy:
                    d = int(self._d2t_ids[int(l_last.argmax())])
                else:
                    q = self._draft_probs(l_last, temperature)
                    d = int(torch.multinomial(q, 1, generator=generator))
                    qs.append(q)
                drafts.append(d)
                if j + 1 < self.k:
                    p = torch.tensor([[committed - 1 + j + 1]])
                    h_last, dl = self.draft(h_last, torch.tensor([[d]]), p, cache=dcache)
                    l_last = dl[0, -1]
            dcache.crop(committed)
            seq_len = tcache.get_seq_length()
            vlogits, vaux = self._target_step([out[-1]] + drafts, tcache)
            dt = torch.tensor(drafts)
            if greedy:
                n, nxt = verify_greedy(dt, vlogits)
            else:
                n, nxt = verify_sampling(dt, torch.stack(qs), probs_at(vlogits, temperature), generator)
            counters.record(self.k, n)
            _crop(tcache, seq_len + n + 1)
            new = drafts[:n] + [nxt]
            pend_aux, pend_ids = vaux[:, : n + 1], new
            for tok in new:
                out.append(tok)
                if tok in eos_token_ids or len(out) >= max_new_tokens:
                    break
        return SpecOutput(out[:max_new_tokens], counters, time.perf_counter() - t0)


def compare_with_plain(target, draft, prompts: Sequence[Sequence[int]], k: int, max_new_tokens: int,
                       temperature: float = 0.0, eos_token_ids: Sequence[int] = (), seed: int = 0,
                       progress=None) -> dict[str, Any]:
    """Decode every prompt plainly and speculatively, side by side: identical outputs (greedy), counters,
    tokens/s of each and the speedup. The local, lossless ground truth for the offline prediction."""
    dec = SpecDecoder(target, draft, k)
    counters = SpecCounters(k)
    plain_s = spec_s = 0.0
    plain_tokens = spec_tokens = 0
    mismatches: list[int] = []
    for i, prompt in enumerate(prompts):
        g = torch.Generator().manual_seed(seed + i)
        t0 = time.perf_counter()
        ref = plain_generate(target, prompt, max_new_tokens, temperature, eos_token_ids, g)
        plain_s += time.perf_counter() - t0
        g = torch.Generator().manual_seed(seed + i)
        res = dec.generate(prompt, max_new_tokens, temperature, eos_token_ids, g)
        spec_s += res.seconds
        plain_tokens += len(ref)
        spec_tokens += len(res.tokens)
        counters.merge(res.counters)
        if res.tokens != ref:
            mismatches.append(i)
        if progress is not None:
            progress.update(1, acceptance_length=counters.summary()["acceptance_length"])
    plain_tps = plain_tokens / plain_s if plain_s else 0.0
    spec_tps = spec_tokens / spec_s if spec_s else 0.0
    return {
        "k": k, "temperature": temperature, "prompts": len(prompts),
        **counters.summary(),
        "identical_to_target": not mismatches if temperature <= 0 else None,
        "mismatched_prompts": mismatches,
        "plain_tokens_per_s": plain_tps, "spec_tokens_per_s": spec_tps,
        "speedup": spec_tps / plain_tps if plain_tps else None,
    }
