"""Verification: which drafted tokens the target keeps. Greedy: agree = equal to the target's argmax, so the output
is exactly the target's greedy output. Sampling: standard rejection sampling (accept d with min(1, p(d)/q(d)), else
draw from the residual max(0, p - q)), so the output distribution is exactly the target's; or block verification
(``eagle3nb.verification.block``: the drafts judged as one block, lossless too and never fewer accepted in
expectation). Also how one sequence picks its tokens (``Sampling``) and vLLM's spec-decode counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from eagle3nb.errors import InputError
from eagle3nb.formulas import summarize_counts
from eagle3nb.verification.block import verify_block


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
    from normalize(max(0, p - q)); if all k are accepted draw the bonus token from p[k]. Drawn on the CPU, where
    the request's generator lives, whatever device the models run on."""
    k = draft_ids.shape[0]
    draft_probs, target_probs = draft_probs.cpu(), target_probs.cpu()
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


# Sampled verification rules by name (vLLM's ``rejection_sample_method`` names); greedy ignores them: at T=0 both
# keep exactly the target's argmax run.
VERIFIERS = {"standard": verify_sampling, "block": verify_block}


def check_verification(name: str) -> str:
    """``name`` if it is one of :data:`VERIFIERS`, else a one-line InputError naming them."""
    if name not in VERIFIERS:
        raise InputError(f"verification {name!r}: use one of {', '.join(VERIFIERS)} (vLLM's "
                         "rejection_sample_method names)")
    return name


def is_greedy(temperature: float) -> bool:
    return temperature < 1e-5  # the embedded server's rule


def pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    if is_greedy(temperature):
        return int(logits.argmax(-1))
    return int(torch.multinomial(probs_at(logits, temperature, top_p).cpu(), 1, generator=generator))


@dataclass
class Sampling:
    """How one sequence picks its tokens: greedy (temperature 0) or sampled with its own generator, so its
    tokens do not depend on which other sequences share its batch, and verified by ``verification`` (one of
    :data:`VERIFIERS`) when sampled."""

    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None
    verification: str = "standard"

    def __post_init__(self) -> None:
        check_verification(self.verification)

    def verify(self, draft_ids: torch.Tensor, draft_probs: torch.Tensor,
               target_probs: torch.Tensor) -> tuple[int, int]:
        """Sampled verification of one row by this sequence's rule and generator: (accepted n, next token)."""
        return VERIFIERS[self.verification](draft_ids, draft_probs, target_probs, self.generator)

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

