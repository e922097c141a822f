"""Verification rules of speculative decoding on hand-made distributions with known answers."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from eagle3nb.verification.verify import SpecCounters, verify_greedy, verify_sampling


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


# -- block verification (eagle3nb.verification.block), exact on the Markov chains above --------------------------------

def _rounds(p: torch.Tensor, q: torch.Tensor, k: int, start: int = 0):
    """Every draft block of one round after ``start``: (drafts [k], its draft probability, draft rows [k, V], target
    rows [k+1, V]); ``p`` and ``q`` are next-token tables [V, V] (row = previous token)."""
    for xs in itertools.product(range(p.shape[0]), repeat=k):
        ctx = [start, *xs]
        prob = math.prod(float(q[c, x]) for c, x in zip(ctx, xs))
        yield torch.tensor(xs), prob, q[ctx[:-1]].double(), p[ctx].double()


def _block_outcomes(xs, qs, ps, correction_of=None):
    """Exact (tau, P(tau), correction distribution) of block verification on one block: tau is the last prefix
    whose eta_i <= h_i, so P(tau = i) = h_i prod_{j > i} (1 - h_j)."""
    from eagle3nb.verification.block import block_weights, correction

    w, h = block_weights(xs, qs, ps)
    k = len(xs)
    for tau in range(k + 1):
        pt = (float(h[tau - 1]) if tau else 1.0) * math.prod(1 - float(h[j]) for j in range(tau, k))
        yield tau, pt, (correction_of or correction)(tau, w, qs, ps)


def _token_outcomes(xs, qs, ps):
    """Exact (tau, P(tau), correction) of token-wise rejection sampling (verify_sampling's rule)."""
    k, a = len(xs), [min(1.0, float(ps[i, x] / qs[i, x])) for i, x in enumerate(xs.tolist())]
    for tau in range(k + 1):
        pt = math.prod(a[:tau]) * (1 - a[tau] if tau < k else 1.0)
        resid = (ps[tau] - qs[tau]).clamp_min(0) if tau < k else ps[k]
        yield tau, pt, resid / resid.sum() if float(resid.sum()) > 0 else ps[tau]


def _round_then_target(p, q, k, outcomes, **kw) -> torch.Tensor:
    """The exact distribution [V^(k+1)] of the first k+1 tokens when one verified round is followed by sampling
    from the target: a rule is lossless iff this is the target's own (by induction over rounds)."""
    V = p.shape[0]
    dist = torch.zeros((V,) * (k + 1), dtype=torch.float64)
    for xs, prob, qs, ps in _rounds(p, q, k):
        for tau, pt, corr in outcomes(xs, qs, ps, **kw):
            for y in range(V):
                head = [*xs[:tau].tolist(), y]
                mass = prob * pt * float(corr[y])
                for tail in itertools.product(range(V), repeat=k - tau):  # the rest from the target
                    seq, prev = head + list(tail), y
                    m = mass
                    for t in tail:
                        m, prev = m * float(p[prev, t]), t
                    dist[tuple(seq)] += m
    return dist


def _target_dist(p, k) -> torch.Tensor:
    V = p.shape[0]
    dist = torch.zeros((V,) * (k + 1), dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=k + 1):
        dist[seq] = math.prod(float(p[c, t]) for c, t in zip((0, *seq), seq))
    return dist


def _expected_accepted(p, q, k, outcomes) -> float:
    return sum(prob * sum(tau * pt for tau, pt, _ in outcomes(xs, qs, ps)) for xs, prob, qs, ps in _rounds(p, q, k))


def _random_chains(seed: int, V: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dirichlet = lambda: (-torch.rand(V, V, generator=g, dtype=torch.float64).log()) ** 2  # noqa: E731 (peaky rows)
    p, q = dirichlet(), dirichlet()
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_block_verification_is_exactly_lossless(k):
    """One block-verified round followed by the target gives exactly the target's distribution of k+1 tokens, on
    the fixed chains and on random ones; the same harness holds token-wise verification lossless, and rejects
    block verification with token-wise's correction (w_tau dropped), so it has the power to see a wrong rule."""
    from eagle3nb.verification.block import correction

    for p, q in [(P.double(), Q.double()), _random_chains(k), _random_chains(10 + k)]:
        want = _target_dist(p, k)
        assert torch.allclose(_round_then_target(p, q, k, _block_outcomes), want, atol=1e-12)
        assert torch.allclose(_round_then_target(p, q, k, _token_outcomes), want, atol=1e-12)
    if k == 2:
        def no_weight(tau, w, qs, ps):
            return correction(tau, torch.ones_like(w), qs, ps)

        gaps = []
        for p, q in [_random_chains(seed) for seed in range(4)]:
            wrong = _round_then_target(p, q, k, _block_outcomes, correction_of=no_weight)
            gaps.append(float((wrong - _target_dist(p, k)).abs().max()))
        assert max(gaps) > 1e-3, gaps


def test_block_verification_accepts_at_least_as_many_drafts_as_token_wise():
    """Expected accepted drafts per round, exact: block >= token-wise on every pair of random chains, better on
    some; k = 1 is the same rule. The paper's example (Sun et al., section 2: M_b = (1/3, 2/3), M_s = (2/3, 1/3)
    at every position, k = 2): token-wise 10/9, block 11/9."""
    gains = []
    for seed in range(12):
        p, q = _random_chains(seed)
        for k in (1, 2, 3):
            block, token = (_expected_accepted(p, q, k, o) for o in (_block_outcomes, _token_outcomes))
            assert block >= token - 1e-12, (seed, k, block, token)
            if k == 1:
                assert block == pytest.approx(token, abs=1e-12)
            else:
                gains.append(block - token)
    assert max(gains) > 1e-2, gains
    mb, ms = torch.tensor([1 / 3, 2 / 3], dtype=torch.float64), torch.tensor([2 / 3, 1 / 3], dtype=torch.float64)
    p, q = mb.expand(2, 2), ms.expand(2, 2)
    assert _expected_accepted(p, q, 2, _token_outcomes) == pytest.approx(10 / 9)
    assert _expected_accepted(p, q, 2, _block_outcomes) == pytest.approx(11 / 9)


def test_verify_block_samples_what_the_exact_rule_says():
    """``verify_block`` (the sampler the decoders call) reproduces the target's sequences on the chains above, as
    token-wise does, and accepts per round what the exact computation expects."""
    from eagle3nb.verification.block import verify_block

    g = torch.Generator().manual_seed(2)
    n, total = 3, 6000
    counts: dict = {}
    for _ in range(total):
        s = _spec_sample(n, k=2, g=g, verify=verify_block)
        counts[s] = counts.get(s, 0) + 1
    assert _chi2_z(counts, _target_sequence_probs(n), total) < 4.0

    k, rounds = 3, 5000
    want = _expected_accepted(P.double(), Q.double(), k, _block_outcomes)
    blocks = list(_rounds(P.double(), Q.double(), k))
    pick = torch.multinomial(torch.tensor([b[1] for b in blocks]), rounds, replacement=True, generator=g)
    got = [verify_block(blocks[i][0], blocks[i][2], blocks[i][3], g)[0] for i in pick.tolist()]
    sd = torch.tensor(got, dtype=torch.float64).std().item()
    assert abs(sum(got) / rounds - want) < 4 * sd / math.sqrt(rounds), (sum(got) / rounds, want)


def test_a_sequence_names_its_verification_or_is_refused():
    from eagle3nb.errors import InputError
    from eagle3nb.verification.verify import Sampling

    assert Sampling(1.0, verification="block").verification == "block"
    with pytest.raises(InputError, match="standard, block"):
        Sampling(1.0, verification="blocks")
