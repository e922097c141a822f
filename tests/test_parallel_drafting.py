"""Parallel drafting (P-EAGLE, arXiv 2602.01469; vLLM 0.32's ``parallel_drafting``): the draft proposes all k
tokens in one forward, k-1 mask slots after the last verified token. Held to vLLM's inference (the TTT unroll
trains exactly the one causal pass vLLM runs; our decoder drafts what that pass gives and stays lossless), to
vLLM's loader (config key and tensor names read by its own code), and to training (a short 03 run, read back by
04 and served by the real vLLM with the acceptance our decoder measures)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from tiny_drafts import VD, T, inputs, tiny_draft

from eagle3nb.drafts import load_draft
from eagle3nb.drafts.eagle3.layouts import save_draft

from worlds import requires_vllm

pytestmark = pytest.mark.usefixtures("one_thread")

MASK = 7  # a target-vocab id of the tiny drafts
K = 3
STEPS = 30  # 03 steps of the served run: acceptance well above 1 on the trained world's data


def one_pass_logits(m, aux: torch.Tensor, ids: torch.Tensor, t: int, masks: int) -> torch.Tensor:
    """vLLM's parallel-drafting forward for anchor ``t``, written out: positions 0..t read token p+1 and the
    target's feature at p, then ``masks`` slots read the mask token and the mask feature at positions t+1..;
    plain causal attention, no cache. Logits [1 + masks, Vd] of position t and the slots."""
    g = m.fuse(aux[:, :t + 1])  # shape: [1, t+1, H]
    feats = torch.cat([g, m.mask_feature().expand(1, masks, -1)], dim=1)  # shape: [1, t+1+masks, H]
    toks = torch.cat([ids[:, 1:t + 2], torch.full((1, masks), MASK)], dim=1)  # shape: [1, t+1+masks]
    _, logits = m(feats, toks, torch.arange(t + 1 + masks)[None])
    return logits[0, t:]


@pytest.mark.parametrize("variant", [{}, {"num_layers": 2, "fc_norm": True, "norm_output": True}])
def test_the_ttt_unroll_trains_the_one_pass_vllm_runs(variant):
    """The TTT objective of a P-EAGLE draft scores, at every step i and position t, the logits of vLLM's one
    causal pass over [tokens 0..t, i mask slots] (cross-entropy sums and greedy hits equal, per step); gradients
    reach mask_hidden; a sequential draft's unroll on the same weights scores other logits."""
    from eagle3nb.drafts.eagle3.objective import TTTObjective

    m = tiny_draft(mask_token_id=MASK, **variant)
    aux, ids, _ = inputs(B=1, seed=3)
    g = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(1, T, VD, generator=g) * 3, -1)
    batch = {"aux": aux, "input_ids": ids, "loss_mask": torch.ones(1, T, dtype=torch.long),
             "target_argmax": m.draft_to_target(probs.argmax(-1)), "target_probs": probs}
    loss, stats = TTTObjective(m, steps=K, decay=0.8)(batch)
    ce, hits = torch.zeros(K, dtype=torch.float64), torch.zeros(K)
    with torch.no_grad():
        for t in range(T - 1):
            logits = one_pass_logits(m, aux, ids, t, K - 1)
            for i in range(K):
                if t + 1 + i < T - 1:  # the target's distribution at t+1+i is over a token of the sequence
                    p = probs[0, t + 1 + i]
                    ce[i] += float(-(p * torch.log_softmax(logits[i], -1)).sum())
                    hits[i] += float(m.draft_to_target(logits[i].argmax()) == batch["target_argmax"][0, t + 1 + i])
    torch.testing.assert_close(stats[0], ce, rtol=1e-4, atol=1e-4)
    assert torch.equal(stats[2].float(), hits)
    loss.backward()
    assert m.mask_hidden.grad.abs().sum() > 0
    sequential = tiny_draft(**variant)
    sequential.load_state_dict({k: v for k, v in m.state_dict().items() if k != "mask_hidden"})
    assert not torch.allclose(TTTObjective(sequential, steps=K, decay=0.8)(batch)[1][0, 1:], stats[0, 1:])


def test_export_is_what_vllms_loader_reads_and_reads_back(tmp_path):
    """config.json carries mask_token_id and the weights mask_hidden [1, 3*H_t], the key and tensor vLLM 0.32's
    proposer and llama_eagle3 read (the served test below runs them); the speculative config switches parallel
    drafting on for such a draft only; load_draft
    reads it back (same logits); a speculators export is refused in one line."""
    from eagle3nb.drafts import DraftMismatchError
    from eagle3nb.vllm_config import draft_spec

    m = tiny_draft(mask_token_id=MASK, fc_norm=True)
    out = save_draft(m, tmp_path / "draft")
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(out / "model.safetensors")
    assert cfg["mask_token_id"] == MASK and tensors["mask_hidden"].shape == (1, 3 * m.config.target_hidden_size)
    assert draft_spec(out, 3, "eagle3") == {"method": "eagle3", "model": str(out), "num_speculative_tokens": 3,
                                   "parallel_drafting": True}
    assert "parallel_drafting" not in draft_spec(save_draft(tiny_draft(), tmp_path / "plain"), 3, "eagle3")
    back = load_draft(out)
    aux, ids, pos = inputs(B=1)
    with torch.no_grad():
        assert torch.equal(back.mask_feature(), m.mask_feature())
        assert torch.equal(one_pass_logits(back, aux, ids, 5, 2), one_pass_logits(m, aux, ids, 5, 2))
    with pytest.raises(DraftMismatchError, match="export it as eagle3") as e:
        save_draft(m, tmp_path / "spec", format="speculators")
    assert "\n" not in str(e.value)


@torch.inference_mode()
def test_our_decoder_drafts_the_one_pass_losslessly_and_batched_rows_as_alone(toy_smoke, tmp_path):
    """A P-EAGLE draft on the smoke toy: greedy speculative output is the target's own, every round runs the
    draft once (the verified tokens and the k-1 mask slots together), and each round's k drafts are the argmax
    of vLLM's one causal pass over the whole history (the target's aux states, then the mask slots). Rows that
    share a batch (left padding, different pending counts) draft as they do alone."""
    from batching import assert_batched_rows_draft_as_alone
    from tiny_drafts import smoke_draft

    from eagle3nb.data.prompts import load_prompts
    from eagle3nb.data.stream import Template
    from eagle3nb.decoder.batch import SpecDecoder
    from eagle3nb.decoder.reference import plain_generate
    from eagle3nb.hf import DECODER, load_target

    m = smoke_draft(toy_smoke, 1)
    mask_id = m.config.vocab_size - 1
    cfg = m.config
    cfg.mask_token_id = mask_id
    pd = type(m)(cfg)
    pd.load_state_dict({**m.state_dict(), "mask_hidden": pd.mask_hidden}, strict=True)
    draft = load_draft(save_draft(pd, tmp_path / "draft")).eval()
    tpl = Template(toy_smoke, True)
    prompts = [tpl.prompt_ids(p["messages"]) for p in load_prompts("toy:heldout", 3)]
    target = load_target(toy_smoke, trust_remote_code=False, use=DECODER)
    dec = SpecDecoder(target, draft, K)
    calls = []
    hook = draft.register_forward_hook(lambda *a: calls.append(1))
    runs = [dec.generate(p, 12) for p in prompts]
    hook.remove()
    assert [r.tokens for r in runs] == [plain_generate(target, p, 12) for p in prompts]
    rounds = sum(len(r.accepted_per_round) for r in runs)
    assert len(calls) == rounds + len(prompts)  # one prefill per prompt, then one forward per round
    # each round's drafts from the written-out one pass over the verified history
    for prompt, run in zip(prompts, runs):
        n = 1  # tokens verified before the round: the prefill's, then each round's accepted drafts + the target's
        for accepted, drafted in zip(run.accepted_per_round, run.drafted_per_round):
            ids = torch.tensor([list(prompt) + run.tokens[:n]])
            hs = target(input_ids=ids, output_hidden_states=True).hidden_states
            aux = torch.cat([hs[i] for i in dec.layer_ids], dim=-1)  # shape: [1, L, 3H] over the L verified tokens
            feats = torch.cat([draft.fuse(aux[:, :-1]), draft.mask_feature().expand(1, K - 1, -1)], dim=1)
            toks = torch.cat([ids[:, 1:], torch.full((1, K - 1), mask_id)], dim=1)
            _, logits = draft(feats, toks, torch.arange(feats.shape[1])[None])
            want = draft.draft_to_target(logits[0, -K:].argmax(-1)).tolist()
            assert drafted == want
            n += accepted + 1
    assert_batched_rows_draft_as_alone(dec, prompts, runs)


@requires_vllm()
def test_a_short_03_run_trains_a_draft_vllm_serves_in_parallel_with_the_acceptance_we_measure(trained, toy_smoke,
                                                                                               tmp_path):
    """``parallel_drafting: true`` through 03 itself (EAGLE-3.0 layer, a short run on the trained world's hidden
    states): held-out acceptance rises from the start's, the export names the toy's pad token as its mask token
    and the vLLM line 03 prints turns parallel drafting on;
    04 reads it back (offline and local decoding, lossless); the real vLLM serves it with ``parallel_drafting``
    on and its spec-decode counters give the acceptance our one-pass decoder measures on the same prompts (within
    10%), greedy and at T=1 (drafts sampled: ``draft_sample_method: probabilistic``; the sampling fix of
    eagle3nb/serve/vllm_ext/eagle3nb_vllm_fixes in place)."""
    from concurrent.futures import ThreadPoolExecutor

    from served_drafts import held_out, local_acceptance

    from eagle3nb.accept.offline import offline_acceptance
    from eagle3nb.accept.online import bench_endpoint
    from eagle3nb.data.reader import HiddenStates
    from eagle3nb.params import from_dict
    from eagle3nb.serve.vllm import start_vllm
    from eagle3nb.train.report import read_metrics
    from eagle3nb.train.stage import run

    from worlds import SEED

    hidden, out = trained["out"] / "02_hidden_states", tmp_path / "03"
    result = run(from_dict("03_train", {"run_name": "pd", "data_dir": str(hidden), "output_dir": str(out), "seed": SEED,
                               "parallel_drafting": True, "fc_norm": False, "norm_output": False, "ttt_steps": K,
                               "num_speculative_tokens": K, "max_steps": STEPS, "lr": 5e-3, "max_length": 512,
                               "batch_tokens": 1024, "eval_every": 0, "save_every": 1000}))
    assert '"parallel_drafting": true' in result["serve"]["vllm"]  # the serving line 03 prints
    evals = [r for r in read_metrics(out) if r["kind"] == "eval"]
    assert evals[-1]["acceptance_length"] > evals[0]["acceptance_length"] + 0.2, evals
    cfg = json.loads((out / "draft" / "config.json").read_text())
    assert cfg["mask_token_id"] == json.loads((toy_smoke / "config.json").read_text())["pad_token_id"]
    data = HiddenStates(hidden)
    draft = load_draft(out / "draft", embed_tokens=data.embed_tokens())
    assert draft.config.mask_token_id == cfg["mask_token_id"] and not draft.config.fc_norm
    prompts, max_tokens = held_out(8), 48
    sampled_prompts = held_out(48)  # T=1: ~1300 rounds each, so sampling noise stays well inside the 10% bar
    with ThreadPoolExecutor(1) as pool:  # vLLM starts while we measure locally
        starting = pool.submit(start_vllm, toy_smoke, "eagle3", draft_dir=out / "draft", num_speculative_tokens=K,
                               speculative={"draft_sample_method": "probabilistic"})
        try:
            offline = offline_acceptance(draft, data, k=K, max_k=K, indices=[0, 1])
            local = local_acceptance(toy_smoke, out / "draft", prompts, max_tokens)
            local_t1 = local_acceptance(toy_smoke, out / "draft", sampled_prompts, max_tokens, 1.0)
        finally:
            server = starting.result()
    try:
        assert "'parallel_drafting': True" in server.log(), "vLLM was started without parallel drafting"
        row = bench_endpoint("p-eagle", server.base_url, prompts, [4], max_tokens=max_tokens, temperature=0.0,
                             warmup=0, k=K)[0]
        row_t1 = bench_endpoint("p-eagle", server.base_url, sampled_prompts, [4], max_tokens=max_tokens,
                                temperature=1.0, warmup=0, k=K)[0]
    finally:
        server.stop()
    assert local["identical_to_target"] and offline["acceptance_length"] > 1.2, (local, offline)
    print(f"P-EAGLE after {STEPS} steps: vLLM acceptance length {row['acceptance_length']:.3f}, local "
          f"{local['acceptance_length']:.3f}, offline {offline['acceptance_length']:.3f}; at T=1 vLLM "
          f"{row_t1['acceptance_length']:.3f}, local {local_t1['acceptance_length']:.3f}")
    assert row["errors"] == row_t1["errors"] == 0 and row["metrics_engine"] == "vllm", (row, row_t1)
    # Both greedy on the same prompts and the same one-pass layout: the same rounds up to float ties. A draft vLLM
    # fed otherwise (the mask's token or feature, the slots' positions) drafts other tokens from its second on.
    assert local["acceptance_length"] > 1.3, local
    assert abs(row["acceptance_length"] - local["acceptance_length"]) <= 0.1 * local["acceptance_length"], \
        (row["acceptance_length"], local["acceptance_length"])
    # At T=1 both sample (different random streams): the same draft and target give the same expected acceptance
    assert abs(row_t1["acceptance_length"] - local_t1["acceptance_length"]) <= 0.1 * local_t1["acceptance_length"], \
        (row_t1["acceptance_length"], local_t1["acceptance_length"])


def test_settings_that_cannot_train_or_export_a_parallel_draft_are_refused_in_one_line():
    """Slot i is trained only by TTT step i, only the EAGLE-3 layout carries the mask, and no engine serves a
    parallel MLA draft: each refused before any work, naming the parameter and the fix; the defaults train a
    parallel draft."""
    from eagle3nb.params import ParamsError, from_dict

    for over, words in (({"ttt_steps": 2, "num_speculative_tokens": 3}, "ttt_steps"),
                        ({"export_format": "both"}, "export_format: eagle3"),
                        ({"draft_attention": "mla"}, "deepseek_eagle3 draft has no mask_hidden")):
        with pytest.raises(ParamsError, match=words) as e:
            from_dict("03_train", {"parallel_drafting": True, **over})
        assert "\n" not in str(e.value)
    assert from_dict("03_train", {"parallel_drafting": True}).parallel_drafting
