"""A trained toy draft, judged three ways on the same held-out prompts: offline on their hidden states, by real
speculative decoding here (lossless, counted), and through the stage's own steps."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from eagle3nb.params import from_dict

from worlds import SEED

MAX_NEW = 40
N_PROMPTS = 16


@pytest.fixture(scope="module")
def world(toy_smoke, tmp_path_factory, one_thread) -> dict:
    """02's hidden states of the target's own *greedy* answers to held-out prompts (so offline chains see
    exactly what decoding sees), and a draft trained briefly on them by 03."""
    from transformers import AutoModelForCausalLM

    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.data.stream import Template
    from eagle3nb.drafts import load_draft
    from eagle3nb.train.stage import run
    from testkit.heldout import greedy_hidden_states

    root = tmp_path_factory.mktemp("accept")
    data_dir = greedy_hidden_states(toy_smoke, "toy:heldout", N_PROMPTS, MAX_NEW, root, draft_vocab_size=96)
    run(from_dict("03_train", dict(run_name="test", data_dir=str(data_dir), output_dir=str(root / "03"),
                                    ttt_steps=3, max_length=256, batch_tokens=400, lr=3e-3, warmup_ratio=0.05,
                                    eval_every=0, save_every=1000, holdout_fraction=0.1, max_steps=30,
                                    seed=SEED)))
    tpl = Template(toy_smoke, thinking=True)
    rows = [json.loads(line) for line in (root / "01" / "samples-00000.jsonl").read_text().splitlines()]
    return {"root": root, "target": AutoModelForCausalLM.from_pretrained(toy_smoke, dtype=torch.float32).eval(),
            "draft": load_draft(root / "03" / "draft"), "data": HiddenStates(data_dir), "rows": rows,
            "prompts": [r["input_ids"][: r["loss_mask"].index(1)] for r in rows], "eos": [tpl.end_id], "tpl": tpl}


def test_greedy_speculative_decoding_is_identical_to_the_target_on_many_prompts(world):
    from eagle3nb.decoder.batch import SpecDecoder

    target, draft = world["target"], world["draft"]
    for k in (1, 4):
        dec = SpecDecoder(target, draft, k)
        accepted = 0
        for p in world["prompts"]:
            ref = target.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False,
                                  eos_token_id=world["eos"], pad_token_id=0)[0, len(p):].tolist()
            res = dec.generate(p, MAX_NEW, eos_token_ids=world["eos"])
            assert res.tokens == ref
            accepted += res.counters.accepted
        assert accepted > 0, "the test must exercise accepted drafts, not only the bonus token"


def test_sampled_speculative_decoding_keeps_the_target_distribution(world):
    """Chi-square test on the first two generated tokens of one prompt, speculative vs the target's own
    distribution (exact, from its logits): the second token comes from a draft-and-verify round."""
    from eagle3nb.decoder.batch import SpecBatch, SpecDecoder
    from eagle3nb.verification.verify import probs_at

    target, draft, p = world["target"], world["draft"], world["prompts"][0]
    T = 1.0
    with torch.no_grad():
        p1 = probs_at(target(torch.tensor([p])).logits[0, -1], T)
        top = p1.topk(4).indices.tolist()
        p2 = {a: probs_at(target(torch.tensor([p + [a]])).logits[0, -1], T) for a in top}
    dec = SpecDecoder(target, draft, 2)
    g = torch.Generator().manual_seed(0)
    n = 500
    seqs = [tuple(dec.generate(p, 2, temperature=T, generator=g).tokens) for _ in range(n)]
    expected = {(a, b): float(p1[a] * p2[a][b]) for a in top for b in p2[a].topk(3).indices.tolist()}
    expected = {key: v for key, v in expected.items() if v * n >= 5}
    counts = {key: seqs.count(key) for key in expected}
    rest, observed_rest = 1.0 - sum(expected.values()), n - sum(counts.values())
    stat = sum((counts[key] - n * v) ** 2 / (n * v) for key, v in expected.items())
    stat += (observed_rest - n * rest) ** 2 / (n * rest)
    df = len(expected)
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / (2 / (9 * df)) ** 0.5  # Wilson-Hilferty
    assert z < 4.0, (stat, df)
    assert sum(SpecBatch(dec).counters.per_pos) == 0  # fresh batches start from zero counters


@pytest.fixture(scope="module")
def spread(toy_smoke):
    """tests/sampling.py's spread prompt of the smoke toy (~15 s)."""
    from sampling import spread_prompt

    return spread_prompt(toy_smoke)


@pytest.mark.parametrize("verification", ["standard", "block"])
def test_sampled_verification_keeps_the_targets_distribution_g_test(world, spread, verification):
    """Token-wise and block verification side by side: at T=1 the second generated token (the first one a round
    verifies) of N seeded rows, decoded together (k=3), fits the target's own distribution of that token
    (tests/sampling.py's G-test at ALPHA), and every row verified drafts for it. ~5 s each."""
    from eagle3nb.decoder.batch import SpecBatch, SpecDecoder
    from eagle3nb.verification.verify import Sampling

    from sampling import ALPHA, N, fits_target

    batch = SpecBatch(SpecDecoder(world["target"], world["draft"], 3))
    with torch.inference_mode():
        batch.add([spread.ids] * N, [Sampling(1.0, 1.0, torch.Generator().manual_seed(s), verification)
                                     for s in range(N)])
        seconds = [new[0] for new in batch.round()]
    assert batch.counters.drafts == N and batch.counters.accepted > 0
    assert fits_target(seconds, spread) > ALPHA, torch.bincount(torch.tensor(seconds)).nonzero().flatten()


def test_local_acceptance_agrees_with_offline_on_the_same_data(world):
    """Same data: offline chains (teacher-forced by the target's greedy tokens) and real decoding see the same
    inputs, so the rounds they imply agree exactly, and the acceptance lengths closely."""
    from eagle3nb.accept.local import compare_with_plain
    from eagle3nb.accept.offline import offline_acceptance, simulate_rounds
    from eagle3nb.drafts.eagle3.offline import chain_acceptance

    k = 3
    data, draft, target = world["data"], world["draft"], world["target"]
    off = offline_acceptance(draft, data, k, 4, segments=world["tpl"].specials.segments)
    local = compare_with_plain(target, draft, world["prompts"], k, MAX_NEW, eos_token_ids=world["eos"])
    assert local["identical_to_target"] is True
    assert 1.0 < off["acceptance_length"] < k + 1

    # round by round, for every prompt
    by_id = {s["id"]: i for i, s in enumerate(data.meta["samples"])}
    same = total = 0
    for row, real in zip(world["rows"], local["accepted_per_round"]):
        item = data[by_id[row["id"]]]
        r = chain_acceptance(draft, item, data.target_argmax(item), None, k, 0.0)
        sim = simulate_rounds(r["greedy"], r["valid"], item["loss_mask"], k)
        same += sum(a == b for a, b in zip(sim, real))
        total += len(sim)
    assert total > 50 and same >= 0.97 * total, (same, total)

    sim_tau = off["greedy"]["simulated_acceptance_length"]
    assert abs(local["acceptance_length"] - sim_tau) < 0.15, (local["acceptance_length"], sim_tau)
    # the all-positions estimate weights positions differently from decoding; it stays in the same range
    assert abs(local["acceptance_length"] - off["acceptance_length"]) < 0.5
    assert set(off["by_segment"]) == {"reasoning", "answer"}
    assert off["by_category"], "held-out toy prompts carry categories"


def test_sampled_offline_acceptance_is_one_minus_tv_against_the_targets_full_distribution(world):
    """At T=1 the offline acceptance of a position equals sum_v min(p_v, q_v) with p the target's own softmax
    over its whole vocabulary (from a fresh forward pass) and q the draft's, placed on the target vocabulary."""
    from eagle3nb.accept.offline import offline_acceptance, target_probs_for
    from eagle3nb.drafts.eagle3.offline import chain_acceptance, chain_logits

    data, draft, target = world["data"], world["draft"], world["target"]
    off = offline_acceptance(draft, data, 3, 3, temperature=1.0)
    assert off["sampled"] is not None and off["per_position"] == off["sampled"]["per_position"]
    assert 0.0 < off["per_position"][0] < 1.0

    item = data[0]
    r = chain_acceptance(draft, item, data.target_argmax(item), target_probs_for(draft, data, item, 1.0), 1, 1.0)
    with torch.no_grad():
        p = torch.softmax(target(item["input_ids"][None]).logits[0].float(), dim=-1)
        q_draft = torch.softmax(next(chain_logits(draft, item["aux"], item["input_ids"], 1)), dim=-1)
    ids = draft.draft_to_target(torch.arange(draft.config.draft_vocab_size))
    t = int(item["loss_mask"].nonzero()[0])  # draft at t predicts token t+2, the target's distribution at t+1
    q = torch.zeros(p.shape[-1]).index_copy(0, ids, q_draft[t])
    assert float(r["sampled"][0, t]) == pytest.approx(float(torch.minimum(p[t + 1], q).sum()), abs=1e-4)


def test_stage_reuses_finished_steps_until_the_drafts_content_changes(world, toy_smoke, tmp_path, capsys):
    """04 resumes from its finished steps, and a draft rewritten in place with other weights but the same size
    and modification time (a copy that keeps times, a quick retrain) is measured again, not taken from cache."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from eagle3nb.accept.offline import run_offline
    from eagle3nb.drafts import load_draft

    draft_dir = tmp_path / "draft"
    shutil.copytree(world["root"] / "03" / "draft", draft_dir)
    P = from_dict("04_acceptance", dict(run_name="test", model_path=str(toy_smoke), draft_dir=str(draft_dir),
                                        data_dir=str(world["root"] / "02"), output_dir=str(tmp_path / "04"),
                                        k=3, max_k=3, offline_samples=4))
    tok = AutoTokenizer.from_pretrained(toy_smoke)
    first = run_offline(P, world["draft"], tok)
    assert "reusing" not in capsys.readouterr().out
    assert run_offline(P, world["draft"], tok) == first
    assert "offline.json: reusing the finished result" in capsys.readouterr().out

    weights = draft_dir / "model.safetensors"
    before = weights.stat()
    with safe_open(weights, "pt") as f:
        meta = f.metadata()
    tensors = load_file(weights)
    tensors["lm_head.weight"] = torch.zeros_like(tensors["lm_head.weight"])  # every draft token ties: id 0
    save_file(tensors, weights, metadata=meta)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    again = run_offline(P, load_draft(draft_dir, embed_tokens=world["data"].embed_tokens()), tok)
    assert "reusing" not in capsys.readouterr().out
    assert again["acceptance_length"] < first["acceptance_length"], (again, first)


class TurnIds:
    """The world's held-out states with per-turn ids (sample i: conversation i // 2, turn i % 2 + 1), as 01's
    multi_turn: every names them; everything else read from the states themselves."""

    def __init__(self, data):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict:
        return {**self.data[i], "id": f"conv{i // 2}/turn-{i % 2 + 1}"}

    def __getattr__(self, name: str):
        return getattr(self.data, name)


def test_offline_acceptance_by_turn_is_each_turn_groups_own_measure(world):
    """04's by_turn: first and later turns each measured as if alone (the same samples with their own ids)."""
    from eagle3nb.accept.offline import offline_acceptance

    data, draft = world["data"], world["draft"]
    n = min(len(data), 8)
    both = offline_acceptance(draft, TurnIds(data), 3, 3, indices=range(n))
    assert set(both["by_turn"]) == {"first turn", "later turns"}
    for name, idx in (("first turn", range(0, n, 2)), ("later turns", range(1, n, 2))):
        alone = offline_acceptance(draft, data, 3, 3, indices=idx)["greedy"]
        got = both["by_turn"][name]["greedy"]
        assert got["positions"] == alone["positions"] and got["per_position"] == pytest.approx(alone["per_position"])
    assert "by_turn" not in offline_acceptance(draft, data, 3, 3, indices=range(n))  # one-answer samples


def test_benchmark_sets_answer_later_turns_on_policy(world):
    """04's per-dataset rows on MT-Bench and HumanEval as their packages ship them: every MT-Bench question in two
    turns, the second decoded after the target's own first answer (rebuilt here turn by turn from the
    decoder's output), the counters split by turn and category adding up to the set's."""
    from eagle3nb.accept.bench import answer_of, decode_set
    from eagle3nb.data.prompts import load_prompts
    from eagle3nb.decoder.batch import SpecDecoder
    from eagle3nb.verification.verify import SpecCounters

    target, draft, tpl, eos = world["target"], world["draft"], world["tpl"], world["eos"]
    dec = SpecDecoder(target, draft, 3)
    mt = load_prompts("mt-bench", 2)
    got = decode_set(dec, tpl, mt, 12, eos, None)
    expected = SpecCounters(3)
    for i, row in enumerate(mt):
        first = [{"role": "user", "content": row["conversation"][0]["content"]}]
        one = dec.generate(tpl.prompt_ids(first), 12, 0.0, eos, torch.Generator().manual_seed(i))
        second = [*first, answer_of(tpl, one.tokens), {"role": "user", "content": row["conversation"][1]["content"]}]
        two = dec.generate(tpl.prompt_ids(second), 12, 0.0, eos, torch.Generator().manual_seed(i))
        assert answer_of(tpl, one.tokens)["content"] in tpl.decode(tpl.prompt_ids(second))
        expected.merge(one.counters)
        expected.merge(two.counters)
    assert (got["prompts"], got["turns"]) == (2, 4) and got["acceptance_length"] == expected.summary()[
        "acceptance_length"] and got["drafts"] == expected.drafts
    assert sum(s["drafts"] for s in got["by_turn"].values()) == got["drafts"] == \
        sum(s["drafts"] for s in got["by_category"].values())
    he = decode_set(dec, tpl, load_prompts("humaneval", 2), 12, eos, None)
    assert (he["turns"], list(he["by_turn"])) == (2, ["first turn"]) and he["by_category"] == {}


def test_04_compares_token_wise_and_block_verification_per_temperature(world, toy_smoke, tmp_path):
    """04's verification step: T=1 always, the stage's temperature when it is another positive one; one tau per
    seed and rule (the same seeds under both rules: at k=1 the two rules are one, so equal taus), the metrics'
    means and the report's table read from them."""
    from eagle3nb.accept.verification import compare_verification, summary, temperatures, verification_table

    def P(t: float):
        return from_dict("04_acceptance", dict(run_name="test", model_path=str(toy_smoke), temperature=t,
                                               draft_dir=str(world["root"] / "03" / "draft"),
                                               data_dir=str(world["root"] / "02"), output_dir=str(tmp_path)))

    assert [temperatures(P(t)) for t in (0.0, 1.0, 0.7)] == [[1.0], [1.0], [1.0, 0.7]]
    prompts = world["prompts"][:3]
    got = compare_verification(world["target"], world["draft"], prompts, 3, 16, [1.0, 0.7], world["eos"], seeds=2)
    assert list(got) == ["1", "0.7"] and all(list(rules) == ["standard", "block"] for rules in got.values())
    assert all(len(taus) == 2 and all(1.0 <= tau <= 4.0 for tau in taus) for rules in got.values()
               for taus in rules.values())
    assert got["1"]["standard"] != got["0.7"]["standard"]  # each temperature decoded on its own
    one = compare_verification(world["target"], world["draft"], prompts, 1, 16, [1.0], world["eos"], seeds=2)["1"]
    assert one["standard"] == one["block"]  # k = 1: block verification is token-wise, draw for draw
    means = summary(got)
    assert means["1"]["block"] == pytest.approx(sum(got["1"]["block"]) / 2)
    table = verification_table({"verification": means, "verification_seeds": got})
    assert list(table.index) == ["1", "0.7"]
    assert table.loc["1", "block - standard"] == pytest.approx(means["1"]["block"] - means["1"]["standard"])
