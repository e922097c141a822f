"""Local speculative decoding of sliding-window targets with attention sinks (issue 22): gpt-oss alternates
sliding and full layers, and ``PaddedKV``'s holes, left padding and packing make a row's window differ from the
last columns, so ``eagle3nb.decoder`` keeps full cache layers and applies each window over the row's real tokens.

Greedy speculative decoding must be lossless: every row's tokens equal transformers' own ``generate`` of that
prompt alone, with rows of different lengths joining and leaving, drafts rejected and accepted, prompts longer
than the window and generations crossing it. The draft is a random EAGLE-3 draft whose logits get a hint (the
target's next token after the input token, learned from the reference outputs, last one wins), so rounds accept
0..k drafts rather than always rejecting."""

from __future__ import annotations

import threading

import pytest
import torch
from batching import join_and_leave
from tiny_targets import WINDOW, generate_alone, save_and_load

K = 3
TEXTS = ["Hi", "What is 2+3?", "Compute 17 * 23 and explain each step.", "Name three colours.",
         "A much longer prompt: list the primes below fifty, then add them up and say whether the sum is even."]
LIMITS = [30, 12, 26, 20, 30]  # new tokens per prompt: 2..62-token prompts end at 14..92 tokens (window 8)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(t, add_special_tokens=False).input_ids for t in TEXTS]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory, tokenizer):
    """A tiny random Mistral: every layer slides (window 8), no ``layer_types``, sdpa (boolean masks)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=WINDOW,
                        max_position_embeddings=256, initializer_range=0.2, pad_token_id=0, eos_token_id=6)
    model = save_and_load(MistralForCausalLM(cfg), tokenizer, tmp_path_factory.mktemp("mistral"))
    assert model.config._attn_implementation == "sdpa"
    return model


@pytest.fixture(scope="module")
def llama(toy_smoke):
    """The shipped smoke toy (trained Llama, full attention only): the path without windows stays as it was."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(toy_smoke, dtype=torch.float32).eval()


def _draft(target):
    """A random EAGLE-3 draft for ``target`` (its vocabulary whole, so d2t is the identity)."""
    from eagle3nb.drafts.eagle3.model import Eagle3Config, Eagle3Draft

    torch.manual_seed(1)
    V, L = target.config.vocab_size, target.config.num_hidden_layers
    cfg = Eagle3Config(hidden_size=target.config.hidden_size, intermediate_size=96, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=V, draft_vocab_size=V,
                       aux_layer_ids=[1, L // 2, L - 1], rope_theta=10000.0)
    draft = Eagle3Draft(cfg)
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.3)
    draft.set_vocab(torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))
    return draft.eval()


def _hint(draft, sequences: list[list[int]]):
    """Add a large logit to the token that followed the draft's input token in ``sequences`` (last one wins),
    so some drafts agree with the target and some (repeated input tokens, other contexts) do not."""
    nxt = torch.full((draft.config.vocab_size,), -1)
    for seq in sequences:
        for a, b in zip(seq, seq[1:]):
            nxt[a] = b

    def hook(module, args, kwargs, out):
        h, logits = out  # logits: [B, n, V]
        hint = nxt[args[1]]  # shape: [B, n]: the hinted next token per input token, -1 = none
        bonus = torch.zeros_like(logits).scatter_(-1, hint.clamp(min=0)[..., None], 50.0)
        return h, logits + bonus * (hint >= 0)[..., None]

    draft.register_forward_hook(hook, with_kwargs=True)
    return draft


def _continuous(target, draft, prompts: list[list[int]], limits: list[int]):
    """Rows join one or two per other round and leave at their own limit: (outputs, batch sizes, ragged rounds,
    counters)."""
    from eagle3nb.decoder.batch import SpecBatch, SpecDecoder

    batch = SpecBatch(SpecDecoder(target, draft, K))
    outs, sizes, ragged = join_and_leave(batch, prompts, lambda i, out: out[: limits[i]] if len(out) >= limits[i]
                                         else None)
    return outs, sizes, ragged, batch.counters


@pytest.mark.parametrize("name", ["gpt_oss", "mistral", "llama"])
@torch.inference_mode()
def test_greedy_continuous_batching_equals_generate_across_the_window(name, prompts, request):
    """Five prompts (2..62 tokens, window 8) joining and leaving a SpecBatch: each row's tokens are generate's
    alone, with rounds that accepted different runs per row; for the sliding targets the window changes the
    reference, so a window applied wrongly (or not at all) cannot pass."""
    target = request.getfixturevalue(name)
    refs = [generate_alone(target, p, n) for p, n in zip(prompts, LIMITS)]
    if name != "llama":
        target.config.sliding_window = 10_000  # the same weights without the window: other tokens
        try:
            unwindowed = [generate_alone(target, p, n) for p, n in zip(prompts, LIMITS)]
        finally:
            target.config.sliding_window = WINDOW
        assert sum(a != b for a, b in zip(refs, unwindowed)) >= 3, "the window must matter for this test"
    draft = _hint(_draft(target), [p + r for p, r in zip(prompts, refs)])
    got, sizes, ragged, counters = _continuous(target, draft, prompts, LIMITS)
    assert got == refs
    assert max(sizes) >= 3 and ragged >= 3, (sizes, ragged)
    assert 0 < counters.accepted < counters.draft_tokens * 0.8, counters.summary()  # accepted and rejected both


@torch.inference_mode()
def test_one_sequence_generate_equals_generate(gpt_oss, prompts):
    """``SpecDecoder.generate`` (compare_with_plain's path, a batch of one) on the longest prompt."""
    from eagle3nb.decoder.batch import SpecDecoder

    ref = generate_alone(gpt_oss, prompts[-1], 30)
    draft = _hint(_draft(gpt_oss), [prompts[-1] + ref])
    out = SpecDecoder(gpt_oss, draft, K).generate(prompts[-1], 30)
    assert out.tokens == ref
    assert 0 < out.counters.accepted < out.counters.draft_tokens


def _serve_in_two_waves(engine, prompts: list[list[int]]) -> list:
    """Greedy requests of ``LIMITS`` tokens on a started Engine: three first, the rest once the shortest has
    finished (so they join a running batch); every request finished, the engine shut down and error-free."""
    from eagle3nb.serve.batcher import Request, SamplingParams

    done = [threading.Event() for _ in prompts]
    reqs = []
    for i, (p, n) in enumerate(zip(prompts, LIMITS)):
        def on_update(u, ev=done[i]):
            if u.finish_reason is not None:
                ev.set()
        reqs.append(Request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), on_update))
    try:
        for r in reqs[:3]:
            engine.submit(r)
        assert done[1].wait(60), engine.error  # the shortest of the first wave has finished
        for r in reqs[3:]:
            engine.submit(r)
        for ev in done:
            assert ev.wait(60), engine.error
    finally:
        engine.shutdown()
    assert engine.error is None
    return reqs


def test_embedded_spec_server_engine_answers_gpt_oss_like_generate(gpt_oss, tokenizer, prompts, tmp_path):
    """The embedded server's ``--draft`` path: its Engine thread with a SpecEngine over a saved draft, requests
    submitted in two waves (the second joins a running batch), each request's token ids equal generate's."""
    from eagle3nb.drafts.eagle3.layouts import save_draft
    from eagle3nb.serve.batcher import Engine, Metrics
    from eagle3nb.serve.spec_batcher import SpecEngine

    with torch.inference_mode():
        refs = [generate_alone(gpt_oss, p, n) for p, n in zip(prompts, LIMITS)]
    save_draft(_draft(gpt_oss), tmp_path / "draft")
    metrics = Metrics("gpt-oss-tiny")
    decoder = SpecEngine(gpt_oss, tokenizer, tmp_path / "draft", K, metrics)
    _hint(decoder.batch.dec.draft, [p + r for p, r in zip(prompts, refs)])
    engine = Engine(gpt_oss, tokenizer, model_name="gpt-oss-tiny", decoder=decoder, metrics=metrics).start()
    reqs = _serve_in_two_waves(engine, prompts)
    assert [r.finish_reason for r in reqs] == ["length"] * len(reqs)
    assert [r.output_ids for r in reqs] == refs
    assert 0 < decoder.batch.counters.accepted < decoder.batch.counters.draft_tokens


def test_embedded_plain_server_engine_answers_gpt_oss_like_generate(gpt_oss, tokenizer, prompts):
    """The embedded server without a draft (its BatchDecoder): requests in two waves, the second joining a
    running batch whose rows have crossed the window, each request's token ids equal generate's."""
    from eagle3nb.serve.batcher import Engine

    with torch.inference_mode():
        refs = [generate_alone(gpt_oss, p, n) for p, n in zip(prompts, LIMITS)]
    engine = Engine(gpt_oss, tokenizer, model_name="gpt-oss-tiny").start()
    reqs = _serve_in_two_waves(engine, prompts)
    assert [r.output_ids for r in reqs] == refs
