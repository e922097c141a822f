"""Continuous batching of speculative decoding (``eagle3nb.decoder.batch.SpecBatch``, the embedded server's ``--draft``
engine): rows of different lengths that accept different numbers of drafts, join and leave between rounds, and
still decode exactly what they would alone."""

from __future__ import annotations

import asyncio

import pytest
import torch
from batching import join_and_leave

K = 3


@pytest.fixture(scope="module")
def pair(toy_smoke, trained):
    """(target, draft, eos id) in this process: the smoke toy and the trained draft of ``tests/worlds.py``."""
    from transformers import AutoModelForCausalLM

    from eagle3nb.data.stream import Template
    from eagle3nb.drafts import load_draft

    target = AutoModelForCausalLM.from_pretrained(toy_smoke, dtype=torch.float32).eval()
    draft = load_draft(trained["out"] / "03_train" / "draft",
                       embed_tokens=target.get_input_embeddings().weight.detach())
    return target, draft, Template(toy_smoke, thinking=True).end_id


def _prompts(toy_smoke, n: int) -> list[list[int]]:
    from eagle3nb.data.prompts import load_prompts
    from eagle3nb.data.stream import Template

    tpl = Template(toy_smoke, thinking=True)
    return [tpl.prompt_ids(r["messages"]) for r in load_prompts("toy:heldout", n)]


def test_rows_joining_and_leaving_between_rounds_decode_like_the_target_alone(pair, toy_smoke):
    """Greedy rows admitted at different rounds, each stopping at its own EOS or length, equal plain decoding."""
    from eagle3nb.decoder.batch import SpecBatch, SpecDecoder
    from eagle3nb.decoder.reference import plain_generate

    target, draft, eos = pair
    prompts, limits = _prompts(toy_smoke, 6), [60, 9, 60, 17, 60, 33]
    refs = [plain_generate(target, p, m, eos_token_ids=[eos]) for p, m in zip(prompts, limits)]

    def finished(i: int, out: list[int]) -> list[int] | None:
        if eos not in out and len(out) < limits[i]:
            return None
        return (out[: out.index(eos) + 1] if eos in out else out)[: limits[i]]

    batch = SpecBatch(SpecDecoder(target, draft, K))
    outs, sizes, ragged = join_and_leave(batch, prompts, finished)
    assert outs == refs
    assert max(sizes) >= 3 and ragged >= 3, (sizes, ragged)  # real batches, rows accepting different runs
    assert batch.counters.accepted > 0


def test_a_seeded_sampled_row_does_not_depend_on_its_batch(pair, toy_smoke):
    """Rejection sampling per row with the row's own generator: the same tokens alone and among other rows."""
    from eagle3nb.decoder.batch import SpecBatch, SpecDecoder
    from eagle3nb.verification.verify import Sampling

    target, draft, _ = pair
    dec = SpecDecoder(target, draft, K)
    prompts = _prompts(toy_smoke, 3)

    def decode(rows: list[int]) -> list[int]:
        batch = SpecBatch(dec)
        sampling = [Sampling(1.0, 0.9, torch.Generator().manual_seed(7 + i)) if i != 1 else Sampling() for i in rows]
        out = [[t] for t in batch.add([prompts[i] for i in rows], sampling)]
        while len(out[0]) < 30:
            for o, toks in zip(out, batch.round()):
                o += toks
        return out[0][:30]

    alone = decode([0])
    assert decode([0, 1, 2]) == alone
    assert len(set(alone)) > 3


def _generate(base_url: str, prompt: str, max_tokens: int, delay: float):
    from openai import AsyncOpenAI

    async def one() -> list[int]:
        await asyncio.sleep(delay)
        async with AsyncOpenAI(base_url=base_url, api_key="EMPTY", max_retries=0) as client:
            r = await client.chat.completions.create(
                model=(await client.models.list()).data[0].id, messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens, temperature=0.0, extra_body={"return_token_ids": True})
            return r.choices[0].model_extra["token_ids"]
    return one()


def test_spec_server_batches_concurrent_requests_and_answers_like_the_plain_server(toy_smoke, trained, embedded):
    """Concurrent greedy requests of different lengths, some arriving while others decode: the plain server's
    token ids for each, and /metrics shows rounds that verified several requests in one target pass."""
    import httpx

    from eagle3nb.data.prompts import load_prompts
    from eagle3nb.formulas import parse_prometheus
    from eagle3nb.launch import start_server
    from eagle3nb.serve.spec_batcher import BATCH_ROUNDS

    questions = [r["messages"][0]["content"] for r in load_prompts("toy:heldout", 6)]
    limits = [120, 12, 80, 30, 120, 50]
    delays = [0.0, 0.0, 0.0, 0.0, 0.3, 0.6]

    async def all_of(url: str) -> list[list[int]]:
        return await asyncio.gather(*(_generate(url, q, m, d) for q, m, d in zip(questions, limits, delays)))

    plain = asyncio.run(all_of(embedded.base_url))
    with start_server(toy_smoke, draft_dir=trained["out"] / "03_train" / "draft", num_speculative_tokens=K) as spec:
        got = asyncio.run(all_of(spec.base_url))
        rounds = parse_prometheus(httpx.get(f"{spec.url}/metrics").text)[BATCH_ROUNDS]
    assert got == plain
    assert [len(g) for g in got] != [len(got[0])] * len(got)  # different lengths really
    by_size = {int(labels["batch_size"]): v for labels, v in rounds if "batch_size" in labels}
    assert sum(v for s, v in by_size.items() if s >= 3) >= 5, by_size


def test_the_reference_decoder_decodes_like_the_batched_one(pair, toy_smoke):
    """``eagle3nb.decoder.reference`` (one sequence, no padding, no draft cache) and the batched decoder give the same
    tokens and the same accepted drafts every round: greedy (both the target's own output), and sampled with the
    same seed (both draw from the generator in the same order: first token, k drafts, verification), with
    token-wise and with block verification (greedy: identical to the target either way)."""
    from eagle3nb.decoder.batch import SpecDecoder
    from eagle3nb.decoder.reference import plain_generate, reference_generate

    target, draft, eos = pair
    dec = SpecDecoder(target, draft, K)
    outputs: dict[tuple[float, str], list[list[int]]] = {}
    for temperature, verification in ((0.0, "standard"), (0.0, "block"), (0.9, "standard"), (0.9, "block")):
        for i, prompt in enumerate(_prompts(toy_smoke, 2 if verification == "standard" else 1)):
            ref, rounds = reference_generate(target, draft, prompt, K, 40, temperature, [eos],
                                             torch.Generator().manual_seed(i), verification=verification)
            res = dec.generate(prompt, 40, temperature, [eos], torch.Generator().manual_seed(i),
                               verification=verification)
            assert (ref, rounds) == (res.tokens, res.accepted_per_round), (temperature, verification, i)
            assert sum(rounds) > 0  # drafts were accepted, so the draft's numbers were compared too
            if temperature == 0.0:
                assert ref == plain_generate(target, prompt, 40, eos_token_ids=[eos])
            outputs.setdefault((temperature, verification), []).append(ref)
    assert outputs[0.9, "standard"] != outputs[0.0, "standard"]  # the sampled path ran
    assert outputs[0.9, "block"] != outputs[0.9, "standard"][:1]  # the block rule ran: other draws, other tokens
