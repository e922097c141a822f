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

from eagle3nb.formulas import summarize_counts


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


def probs_at(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution at ``temperature`` (> 0) after nucleus filtering (``top_p``), in float32
    (the same rule as the embedded server's ``sample_next``: the most likely token is always kept)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        probs = probs.scatter(-1, idx, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


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


def _is_greedy(temperature: float) -> bool:
    return temperature < 1e-5  # the embedded server's rule


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    if _is_greedy(temperature):
        return int(logits.argmax(-1))
    return int(torch.multinomial(probs_at(logits, temperature, top_p).cpu(), 1, generator=generator))


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
        tok = _pick(logits, temperature, top_p, generator)
        out.append(tok)
        if tok in eos_token_ids:
            break
        ids = torch.tensor([[tok]], device=target.device)
    return out


@dataclass
class SpecOutput:
    tokens: list[int]
    counters: SpecCounters
    seconds: float
    accepted_per_round: list[int]  # n accepted drafts in each round (round r starts right after round r-1's tokens)


class SpecDecoder:
    """A target + draft pair that decodes sequences speculatively, ``k`` drafted tokens per target step.

    ``layer_ids`` are HF ``hidden_states`` indices (DESIGN.md); default: the draft's config, else vLLM's
    default (2, L//2, L-3), which is what vLLM would use for a draft config without ids."""

    def __init__(self, target, draft, k: int = 3, layer_ids: Sequence[int] | None = None):
        from eagle3nb.layers import default_aux_layer_ids

        if k < 1:
            raise ValueError(f"k (num_speculative_tokens) must be >= 1, got {k}")
        self.target, self.draft, self.k = target.eval(), draft.eval(), k
        n_layers = target.config.num_hidden_layers
        ids = layer_ids if layer_ids is not None else draft.config.aux_layer_ids
        self.layer_ids = list(ids) if ids is not None else default_aux_layer_ids(n_layers)
        bad = [i for i in self.layer_ids if not 0 <= i <= n_layers]
        if bad:
            raise ValueError(f"aux layer ids {bad} are outside the target's hidden_states 0..{n_layers}; check the "
                             "draft's eagle_aux_hidden_state_layer_ids (eagle3nb doctor: layer_ids)")
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft maps onto a vocabulary of {draft.config.vocab_size} tokens but the target "
                             f"has {target.config.vocab_size}: wrong target for this draft (eagle3nb doctor: shapes_vocab)")
        self.device = target.device
        self.d2t_ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size, device=draft.d2t.device))
        self.d2t_ids = self.d2t_ids.to(self.device)
        self.vocab = target.config.vocab_size

    def target_forward(self, ids: list[int], cache, keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Target forward over ``ids`` after the cache: (logits [n, V] (the last ``keep`` only, if > 0), aux
        [1, n, 3H] at the draft's layers)."""
        out = self.target(input_ids=torch.tensor([ids], device=self.device), cache=cache, use_cache=True,
                          output_hidden_states=True, logits_to_keep=keep)
        return out.logits[0], torch.cat([out.hidden_states[i] for i in self.layer_ids], dim=-1)

    def draft_probs(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """The draft's distribution over its vocab, placed onto the target vocab (zero outside it)."""
        q = torch.zeros(self.vocab, device=logits.device)
        return q.index_copy(0, self.d2t_ids, probs_at(logits, temperature))

    def sequence(self, prompt_ids: Sequence[int], temperature: float = 0.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> "SpecSequence":
        return SpecSequence(self, prompt_ids, temperature, top_p, generator)

    @torch.inference_mode()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, temperature: float = 0.0,
                 eos_token_ids: Sequence[int] = (), generator: torch.Generator | None = None,
                 top_p: float = 1.0) -> SpecOutput:
        """Decode one prompt to ``max_new_tokens`` or an EOS; returns the tokens, counters and seconds."""
        t0 = time.perf_counter()
        seq = self.sequence(prompt_ids, temperature, top_p, generator)
        out = [seq.prefill()]
        while len(out) < max_new_tokens and out[-1] not in eos_token_ids:
            for tok in seq.round():
                out.append(tok)
                if tok in eos_token_ids or len(out) >= max_new_tokens:
                    break
        return SpecOutput(out, seq.counters, time.perf_counter() - t0, seq.rounds)


class SpecSequence:
    """One sequence's speculative decoding state: the target's KV cache, the draft's KV cache, and the
    target's aux states of verified tokens that the draft has not consumed yet. ``prefill()`` returns the
    first token; each ``round()`` returns the accepted drafts plus the target's own next token."""

    def __init__(self, dec: SpecDecoder, prompt_ids: Sequence[int], temperature: float = 0.0, top_p: float = 1.0,
                 generator: torch.Generator | None = None):
        from transformers import DynamicCache

        from eagle3nb.draft import DraftCache

        self.dec, self.prompt = dec, list(prompt_ids)
        self.temperature, self.top_p, self.generator = temperature, top_p, generator
        self.greedy = _is_greedy(temperature)
        self.tcache, self.dcache = DynamicCache(), DraftCache()
        self.counters = SpecCounters(dec.k)
        self.rounds: list[int] = []  # accepted drafts per round
        self.last: int | None = None  # the newest token: emitted, not yet run through the target
        self.committed = 0  # draft-cache positions holding verified (target) features
        self.pend_aux: torch.Tensor | None = None  # [1, n, 3H] target aux states the draft has not seen
        self.pend_ids: list[int] = []  # the token after each of those positions

    @torch.inference_mode()
    def prefill(self) -> int:
        logits, aux = self.dec.target_forward(self.prompt, self.tcache, keep=1)
        self.last = _pick(logits[-1], self.temperature, self.top_p, self.generator)
        self.pend_aux, self.pend_ids = aux, self.prompt[1:] + [self.last]
        return self.last

    @torch.inference_mode()
    def propose(self) -> tuple[list[int], list[torch.Tensor]]:
        """The draft's k tokens (target ids) and, when sampling, the distributions they were drawn from.
        The draft's first step consumes the pending target features (position p pairs the aux state at p
        with the token at p+1); later steps feed back the draft's own hidden state one position further."""
        dec, draft = self.dec, self.dec.draft
        n_new = self.pend_aux.shape[1]
        pos = torch.arange(self.committed, self.committed + n_new, device=dec.device)[None]
        ids = torch.tensor([self.pend_ids], device=dec.device)
        h, logits = draft(draft.fuse(self.pend_aux), ids, pos, cache=self.dcache)
        self.committed += n_new
        h, logits = h[:, -1:], logits[0, -1]
        drafts, qs = [], []
        for j in range(dec.k):
            if self.greedy:
                d = int(dec.d2t_ids[int(logits.argmax())])
            else:
                q = dec.draft_probs(logits, self.temperature)
                d = int(torch.multinomial(q.cpu(), 1, generator=self.generator))
                qs.append(q)
            drafts.append(d)
            if j + 1 < dec.k:
                p = torch.tensor([[self.committed + j]], device=dec.device)
                h, logits = draft(h, torch.tensor([[d]], device=dec.device), p, cache=self.dcache)
                logits = logits[0, -1]
        self.dcache.crop(self.committed)
        return drafts, qs

    @torch.inference_mode()
    def round(self) -> list[int]:
        """Draft k tokens, verify them in one target forward, keep the agreeing prefix + one target token."""
        drafts, qs = self.propose()
        seq_len = self.tcache.get_seq_length()
        logits, aux = self.dec.target_forward([self.last] + drafts, self.tcache)
        dt = torch.tensor(drafts, device=logits.device)
        if self.greedy:
            n, nxt = verify_greedy(dt, logits)
        else:
            target_p = probs_at(logits, self.temperature, self.top_p)
            n, nxt = verify_sampling(dt.cpu(), torch.stack(qs).cpu(), target_p.cpu(), self.generator)
        self.counters.record(self.dec.k, n)
        self.rounds.append(n)
        _crop(self.tcache, seq_len + n + 1)
        new = drafts[:n] + [nxt]
        self.pend_aux, self.pend_ids, self.last = aux[:, : n + 1], new, nxt
        return new


def compare_with_plain(target, draft, prompts: Sequence[Sequence[int]], k: int, max_new_tokens: int,
                       temperature: float = 0.0, eos_token_ids: Sequence[int] = (), seed: int = 0,
                       progress=None) -> dict[str, Any]:
    """Decode every prompt plainly and speculatively, side by side: identical outputs (greedy), counters,
    tokens/s of each and the speedup. The local, lossless ground truth for the offline prediction."""
    dec = SpecDecoder(target, draft, k)
    if prompts:  # warm-up, untimed: first calls pay one-time allocation and dispatch costs
        plain_generate(target, prompts[0], 4)
        dec.generate(prompts[0], 4)
    counters = SpecCounters(k)
    plain_s = spec_s = 0.0
    plain_tokens = spec_tokens = 0
    mismatches: list[int] = []
    rounds: list[list[int]] = []
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
        rounds.append(res.accepted_per_round)
        if res.tokens != ref:
            mismatches.append(i)
        if progress is not None:
            progress.update(1, acceptance_length=counters.summary()["acceptance_length"])
    plain_tps = plain_tokens / plain_s if plain_s else 0.0
    spec_tps = spec_tokens / spec_s if spec_s else 0.0
    return {
        "k": k, "temperature": temperature, "prompts": len(prompts),
        **counters.summary(),
        "identical_to_target": not mismatches if _is_greedy(temperature) else None,
        "mismatched_prompts": mismatches,
        "plain_tokens_per_s": plain_tps, "spec_tokens_per_s": spec_tps,
        "speedup": spec_tps / plain_tps if plain_tps else None,
        "accepted_per_round": rounds,
    }


@torch.inference_mode()
def measure_costs(target, draft, k: int, context: int = 128, repeats: int = 20) -> dict[str, float]:
    """Wall-clock costs on this machine, relative to one plain target decode step at ``context`` tokens:
    ``cost_ratio`` c = one draft step / one target step; ``overhead`` = verifying k+1 tokens / one target
    step - 1 (the extra the verify pass costs). They enter speedup = tau / (1 + k*c + overhead)."""
    from transformers import DynamicCache

    from eagle3nb.draft import DraftCache

    dec = SpecDecoder(target, draft, k)
    dev = dec.device
    ids = torch.randint(0, target.config.vocab_size, (1, context), device=dev)

    def timed(fn) -> float:
        fn()  # warm-up
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats

    cache = DynamicCache()
    out = target(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i] for i in dec.layer_ids], dim=-1)
    one, many = ids[:, -1:], ids[:, -(k + 1):]

    def target_step(x):
        target(input_ids=x, cache=cache, use_cache=True, output_hidden_states=True)
        _crop(cache, context)

    t_step = timed(lambda: target_step(one))
    t_verify = timed(lambda: target_step(many))
    dcache = DraftCache()
    h, _ = draft(draft.fuse(aux[:, :-1]), ids[:, 1:], torch.arange(context - 1, device=dev)[None], cache=dcache)
    pos = torch.tensor([[context - 1]], device=dev)

    def draft_step():
        draft(h[:, -1:], one, pos, cache=dcache)
        dcache.crop(context - 1)

    t_draft = timed(draft_step)
    return {"target_step_s": t_step, "verify_s": t_verify, "draft_step_s": t_draft,
            "cost_ratio": t_draft / t_step, "overhead": max(0.0, t_verify / t_step - 1.0), "context": context}
