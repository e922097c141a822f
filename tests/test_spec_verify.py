"""Verification rules of speculative decoding on hand-made distributions with known answers."""

from __future__ import annotations

import itertools
import math

import torch

from eagle3nb.decoding.verify import SpecCounters, verify_greedy, verify_sampling


def test_greedy_accepts_the_agreeing_prefix_and_returns_the_targets_next_token():
    logits = torch.full((4, 6), -5.0)
    for row, tok in enumerate([2, 4, 1, 5]):  # the target's argmax after each drafted position
        logits[row, tok] = 5.0
    assert verify_greedy(torch.tensor([2, 4, 1]), logits) == (3, 5)  # all accepted, bonus token
    assert verify_greedy(torch.tensor([2, 3, 1]), logits) == (1, 4)  # rejected at 1: target's token there
    assert verify_greedy(torch.tensor([0, 4, 1]), logits) == (0, 2)  # later agreement does not count


def test_counters_follow_vllm_definitions():
    c = SpecCounters(k=3)
    for n in [3, 1, 0, 2]:
        c.record(3, n)
    s = c.summary()
    assert c.per_pos == [3, 2, 1]
    assert s["acceptance_rate"] == 6 / 12
    assert s["acceptance_length"] == 1 + 6 / 4
    assert s["per_position_cumulative"] == [3 / 4, 2 / 4, 1 / 4]
    assert s["per_position"] == [3 / 4, 2 / 3, 1 / 2]  # conditional alpha_i


# A tiny "language": next-token distributions depend on the previous token (Markov chains over V=4).
P = torch.tensor([[0.6, 0.2, 0.1, 0.1], [0.1, 0.1, 0.7, 0.1], [0.25, 0.25, 0.25, 0.25], [0.05, 0.05, 0.1, 0.8]])
Q = torch.tensor([[0.1, 0.7, 0.1, 0.1], [0.4, 0.1, 0.4, 0.1], [0.7, 0.1, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])


def _spec_sample(n_tokens: int, k: int, g: torch.Generator, verify=verify_sampling) -> tuple[int, ...]:
    """Generate ``n_tokens`` after token 0 by chain speculation: draft from Q, verify against P."""
    out = [0]
    while len(out) <= n_tokens:
        drafts, qs, prev = [], [], out[-1]
        for _ in range(k):
            d = int(torch.multinomial(Q[prev], 1, generator=g))
            drafts.append(d)
            qs.append(Q[prev])
            prev = d
        ctx = [out[-1]] + drafts
        ps = torch.stack([P[c] for c in ctx])
        n, nxt = verify(torch.tensor(drafts), torch.stack(qs), ps, g)
        out += drafts[:n] + [nxt]
    return tuple(out[1 : n_tokens + 1])


def _chi2_z(counts: dict, expected: dict, total: int) -> float:
    """Wilson-Hilferty z-score of Pearson's chi-square statistic (z > 4: p < 3e-5)."""
    stat = sum((counts.get(s, 0) - total * p) ** 2 / (total * p) for s, p in expected.items())
    df = len(expected) - 1
    return ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


def _target_sequence_probs(n_tokens: int) -> dict:
    probs = {}
    for seq in itertools.product(range(4), repeat=n_tokens):
        p, prev = 1.0, 0
        for t in seq:
            p *= float(P[prev, t])
            prev = t
        probs[seq] = p
    return probs


def test_rejection_sampling_reproduces_the_target_distribution_of_whole_sequences():
    g = torch.Generator().manual_seed(0)
    n, total = 3, 6000
    counts: dict = {}
    for _ in range(total):
        s = _spec_sample(n, k=2, g=g)
        counts[s] = counts.get(s, 0) + 1
    expected = _target_sequence_probs(n)
    assert _chi2_z(counts, expected, total) < 4.0

    # The same test has the power to catch a wrong rule: accepting every draft gives the draft's chain.
    def accept_all(d, q, p, gen):
        return len(d), int(torch.multinomial(p[-1], 1, generator=gen))

    counts = {}
    for _ in range(1500):
        s = _spec_sample(n, k=2, g=g, verify=accept_all)
        counts[s] = counts.get(s, 0) + 1
    assert _chi2_z(counts, expected, 1500) > 10.0


def test_expected_acceptance_is_one_minus_total_variation():
    g = torch.Generator().manual_seed(1)
    p, q = P[0], Q[0]
    total, acc = 20000, 0
    for _ in range(total):
        d = torch.multinomial(q, 1, generator=g)
        n, _ = verify_sampling(d, q[None], torch.stack([p, p]), g)
        acc += n
    expected = float(torch.minimum(p, q).sum())  # = 1 - TV(p, q) = 0.4
    assert abs(acc / total - expected) < 4 * math.sqrt(expected * (1 - expected) / total)
