"""04's adaptive verification (eagle3nb/accept/adaptive.py): vLLM's budget rule on hand-made confidences, its
response to the width cost, the simulation against fixed k, and the DSpark hook on an untrained draft (random
weights: the shapes and the skip reason are what is tested, no trained number)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eagle3nb.accept import adaptive

K = 4


def blocks_of(conf: np.ndarray, run: np.ndarray) -> list[dict]:
    """One sample whose rounds walk anchors 0, run+1, ...: every anchor holds the same block."""
    A = 64
    return [{"anchors": torch.arange(A), "confidence": torch.tensor(np.tile(conf, (A, 1)), dtype=torch.float32),
             "run": torch.full((A,), int(run)), "full": torch.ones(A, dtype=torch.bool)}]


def test_the_budget_is_the_argmax_of_expected_tokens_over_cost():
    survival = np.cumprod(np.array([[0.9, 0.8, 0.5, 0.2], [0.6, 0.5, 0.9, 0.9]]), 1)
    c, cost, draft = 2, (1.0, 0.3), 0.2
    scores = np.sort(survival.ravel())[::-1]
    ratios = [(c + scores[:b].sum()) / (draft + (cost[0] + cost[1] * (c + b)) / (cost[0] + cost[1] * c))
              for b in range(scores.size + 1)]
    b = adaptive.budget(survival, c, cost, draft)
    assert b == int(np.argmax(ratios))
    got = adaptive.admit(survival, b)
    assert got.sum() == b
    for row, n in zip(survival, got):  # a prefix of each block: its n best slots are its first n
        assert np.all(row[:n] >= np.sort(survival.ravel())[::-1][b - 1])


def test_a_flat_verify_cost_verifies_everything_and_a_wider_one_less():
    survival = np.cumprod(np.full((8, K), 0.7), 1)
    budgets = [adaptive.budget(survival, 8, (1.0, b), 0.1) for b in (0.0, 0.01, 0.1, 1.0, 10.0)]
    assert budgets[0] == survival.size  # no width term: every positive survival adds tokens at no cost
    assert budgets == sorted(budgets, reverse=True) and budgets[-1] < budgets[0]


def test_adaptive_equals_fixed_without_width_cost_and_beats_it_as_width_grows():
    flat = adaptive.levels(blocks_of(np.array([0.9, 0.6, 0.3, 0.1]), run=1), [1, 8], (1.0, 0.0), 0.1)
    for lv in flat:  # every slot's survival is positive and verifying costs nothing more: the whole block
        assert lv["verify_budget"] == K and lv["tau"] == pytest.approx(lv["tau_fixed"]) == 2.0
        assert lv["gain"] == pytest.approx(1.0)
    # estimates that are the truth (two sure slots, two hopeless ones): the rule's objective is then the priced
    # speedup itself, and fixed k is one of the budgets it weighed, so it cannot lose, and wins once width costs
    exact = blocks_of(np.array([1.0, 1.0, 0.0, 0.0]), run=2)
    wide = adaptive.levels(exact, [1, 8, 32], (1.0, 0.5), 0.1)
    assert [lv["verify_budget"] for lv in wide] == sorted((lv["verify_budget"] for lv in wide), reverse=True)
    assert all(lv["gain"] > 1.0 and lv["tau"] == pytest.approx(lv["tau_fixed"]) for lv in wide)
    assert all(lv["tau_per_verified"] > lv["tau_per_verified_fixed"] for lv in wide)


def test_the_speedup_is_tokens_over_the_priced_cost():
    blocks = blocks_of(np.ones(K), run=K)  # sure drafts, all accepted: full budget at any width cost below 1 token
    c, cost, draft = 4, (1.0, 0.05), 0.2
    lv = adaptive.simulate(blocks, c, cost, draft)
    assert lv["tau"] == K + 1 and lv["verify_budget"] == K
    assert lv["speedup"] == pytest.approx((K + 1) / ((cost[0] + cost[1] * c * (K + 1)) / (cost[0] + cost[1] * c)
                                                     + draft))


@pytest.fixture(scope="module")
def dspark_and_dflash(toy_smoke):
    from eagle3nb.drafts.dflash.model import DFlashDraft, from_target

    tc = json.loads((toy_smoke / "config.json").read_text())
    out = {}
    for rank in (8, 0):
        torch.manual_seed(0)
        m = DFlashDraft(from_target(tc, num_layers=1, block_size=K, markov_rank=rank))
        m.set_target(torch.randn(tc["vocab_size"], tc["hidden_size"]), torch.randn(tc["vocab_size"], tc["hidden_size"]))
        out[m.method] = m.eval()
    return out


def test_dspark_blocks_reach_the_stage_key_and_dflash_is_skipped(dspark_and_dflash, tmp_path, monkeypatch):
    from eagle3nb import drafts

    m = dspark_and_dflash["dspark"]
    g = torch.Generator().manual_seed(1)
    T = 30
    item = {"aux": torch.randn(T, m.fc.in_features, generator=g), "input_ids": torch.randint(0, 100, (T,), generator=g),
            "loss_mask": torch.cat([torch.zeros(4), torch.ones(T - 4)]).long()}
    b = drafts.of(m).confidences(m, item, item["input_ids"].roll(-1))
    A = T - 4 - 1  # anchors with the next token generated too
    assert b["confidence"].shape == (A, K) and ((b["confidence"] > 0) & (b["confidence"] < 1)).all()
    assert b["full"].sum() == A - (K - 1) and (b["run"] <= K).all()

    P = SimpleNamespace(stage_dir=tmp_path, draft_path=tmp_path, data_path=tmp_path, concurrency_levels=[1, 4],
                        endpoints=[], k=K)
    monkeypatch.setattr(adaptive, "baseline_label", lambda P: "baseline")
    pred = {"k": K, "parallel": True, "cost_ratio": 0.05, "overhead": 0.2}
    av = adaptive.run_adaptive(P, [b], [], pred, None)
    assert [lv["concurrency"] for lv in av["levels"]] == [1, 4] and av["k"] == K
    assert av["cost"]["b"] == pytest.approx(0.2 / K) and av["cost"]["draft"] == pytest.approx(0.05)
    assert (tmp_path / "adaptive.json").exists()
    assert list(adaptive.table({"adaptive_verification": av})["concurrency"]) == [1, 4]
    assert adaptive.plot({"adaptive_verification": av}) is not None

    P.draft_path = tmp_path / "dflash"
    reason = adaptive.confidence_blocks(P, dspark_and_dflash["dflash"])
    assert "no confidence head" in reason and "DFlash" in reason
    skipped = {"adaptive_verification": adaptive.run_adaptive(P, reason, [], pred, None)}
    assert "no confidence head" in skipped["adaptive_verification"]["skipped"]
    assert adaptive.table(skipped) is None and adaptive.plot(skipped) is None
