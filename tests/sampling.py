"""Judging sampled outputs by the model's own probabilities: seeded sampling is checked against numbers computed
from the target, not against one run's tokens."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

# A draw from another seed equals a given output with exactly that output's probability; below this the test's
# "other seeds differ" fails by chance less than once in a thousand runs.
COLLISION = 1e-3
# The distribution test (spread_prompt and the G-tests below): seeded requests per engine, and each G-test's
# false-alarm rate (the chance a lossless engine fails it). With N = 300 vLLM's CPU build without the sampling fix
# fails at p < 1e-50; a 5-point shift in a bin of 17% shows.
N = 300
ALPHA = 1e-3


def sequence_logprob(model_dir: Path, prompt_ids: list[int], ids: list[int], temperature: float) -> float:
    """log P(ids | prompt) when each token is drawn from softmax(logits / temperature) (top_p = 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    x = torch.tensor([list(prompt_ids) + list(ids)])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=x).logits[0, len(prompt_ids) - 1 : -1].double() / temperature, -1)
    return float(logp.gather(-1, torch.tensor(ids)[:, None]).sum())


def greedy_ids(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The target's own greedy continuation (transformers' generate)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([list(prompt_ids)]), attention_mask=torch.ones(1, len(prompt_ids),
                                                                                         dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def check_seeded_sampling(ask, model_dir: Path, temperature: float, max_tokens: int) -> None:
    """``ask(seed, temperature) -> (prompt_ids, ids)``: the same seed repeats; temperature 0 is the target's
    greedy output whatever the seed; and another seed differs from an output whose computed probability makes a
    collision improbable (a server that ignores the temperature or the seed fails one of these)."""
    prompt, a = ask(123, temperature)
    assert ask(123, temperature)[1] == a, "the same seed must give the same tokens"
    p = math.exp(sequence_logprob(model_dir, prompt, a, temperature))
    assert p < COLLISION, f"the sampled output has probability {p:.2g}: pick a prompt or length with more entropy"
    assert ask(7, temperature)[1] != a, f"another seed gave the same output (probability {p:.2g} by the model)"
    assert ask(123, 0.0)[1] == ask(7, 0.0)[1] == greedy_ids(model_dir, prompt, max_tokens), \
        "temperature 0 must be the target's greedy output, whatever the seed"


@dataclass
class SpreadPrompt:
    """Prompt ids (a chat prompt and the target's greedy answer up to the cut) and the target's distribution of
    the second token generated after them at T=1."""

    ids: list[int]
    probs: torch.Tensor  # shape: [vocab]


@torch.inference_mode()
def spread_prompt(model_dir: Path) -> SpreadPrompt:
    """The first held-out position whose next token is near-certain (p > 0.99) and the token after it spread
    (top p < 0.5), with the target's exact marginal of that second token: sum over every first token t of
    p(t) p(. | t)."""
    from eagle3nb.data.prompts import load_prompts
    from eagle3nb.data.stream import Template
    from eagle3nb.decoder.reference import plain_generate
    from eagle3nb.hf import DECODER, load_target

    tpl, target = Template(model_dir, True), load_target(model_dir, trust_remote_code=False, use=DECODER)
    for p in load_prompts("toy:heldout", 8):
        ids = tpl.prompt_ids(p["messages"])
        full = ids + plain_generate(target, ids, 48, eos_token_ids=[tpl.end_id])
        probs = target(torch.tensor([full])).logits[0].softmax(-1)  # shape: [len(full), vocab]
        for cut in range(len(ids), len(full) - 1):
            if probs[cut - 1].max() > 0.99 and probs[cut].max() < 0.5:
                prefix = full[:cut]
                first = probs[cut - 1]  # shape: [vocab]
                every = torch.cat([torch.tensor([prefix]).expand(len(first), -1),
                                   torch.arange(len(first))[:, None]], dim=1)  # shape: [vocab, cut + 1]
                second = target(every).logits[:, -1].softmax(-1)  # shape: [vocab, vocab]
                return SpreadPrompt(prefix, first @ second)
    raise AssertionError("no held-out position with a near-certain token followed by a spread one")


def bins(probs: torch.Tensor, n: int) -> torch.Tensor:
    """Each token's bin for the tests: its own where the target expects at least 5 of ``n``, the rest pooled."""
    big = (probs * n >= 5).nonzero().flatten()
    out = torch.full((len(probs),), len(big), dtype=torch.long)  # shape: [vocab]
    out[big] = torch.arange(len(big))
    return out


def g_test(observed: torch.Tensor, expected: torch.Tensor, df: int) -> float:
    """The G-test's p-value: 2 sum O ln(O/E), chi-square with ``df`` degrees of freedom."""
    o, e = observed.double(), expected.double()
    g = 2 * torch.where(o > 0, o * (o / e).log(), torch.zeros_like(o)).sum()
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), g / 2))


def fits_target(tokens: list[int], sp: SpreadPrompt) -> float:
    """p-value of ``tokens`` drawn from the target's distribution (goodness of fit on :func:`bins`)."""
    b = bins(sp.probs, len(tokens))
    counts = torch.bincount(b[tokens], minlength=int(b.max()) + 1)  # shape: [bins]
    expected = torch.zeros(len(counts), dtype=torch.double).index_add_(0, b, sp.probs.double()) * len(tokens)
    return g_test(counts, expected, len(counts) - 1)


def same_distribution(a: list[int], b_tokens: list[int], sp: SpreadPrompt) -> float:
    """p-value of two samples drawn from one distribution (G-test of homogeneity on :func:`bins`)."""
    b = bins(sp.probs, min(len(a), len(b_tokens)))
    width = int(b.max()) + 1
    table = torch.stack([torch.bincount(b[x], minlength=width) for x in (a, b_tokens)]).double()  # shape: [2, bins]
    seen = table.sum(0) > 0
    table = table[:, seen]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    return g_test(table, expected, table.shape[1] - 1)


@torch.inference_mode()
def decoded_second_tokens(model_dir: Path, draft_dir: Path, ids: list[int], k: int, seeds: range) -> list[int]:
    """Our decoder's (``eagle3nb.decoder``) second generated token of one seeded T=1 decode of ``ids`` per seed,
    ``k`` drafts a round; asserts every decode verified drafts for it (a round, not the prefill, decided it)."""
    from eagle3nb.decoder.batch import SpecDecoder
    from eagle3nb.drafts import load_draft
    from eagle3nb.hf import DECODER, load_target

    target = load_target(model_dir, trust_remote_code=False, use=DECODER)
    draft = load_draft(draft_dir, embed_tokens=target.get_input_embeddings().weight.detach(),
                       lm_head=target.get_output_embeddings().weight.detach())
    dec = SpecDecoder(target, draft, k)
    tokens, drafted = [], 0
    for seed in seeds:
        res = dec.generate(ids, 2, 1.0, (), torch.Generator().manual_seed(seed))
        tokens.append(res.tokens[1])
        drafted += res.counters.drafts
    assert drafted >= len(seeds), "every request must verify drafts for its second token"
    return tokens


def second_tokens(base_url: str, ids: list[int], seeds: range) -> list[int]:
    """The second generated token of one seeded T=1 request per seed, through ``/v1/completions``."""
    import httpx

    from eagle3nb.accept.online import first_model

    model = first_model(base_url, "EMPTY")

    def one(seed: int) -> int:
        body = {"model": model, "prompt": ids, "max_tokens": 2, "temperature": 1.0, "seed": seed,
                "return_token_ids": True, "ignore_eos": True}
        r = httpx.post(base_url + "/completions", json=body, timeout=120)
        r.raise_for_status()
        out = r.json()["choices"][0]["token_ids"]
        assert len(out) == 2, out
        return out[1]

    with ThreadPoolExecutor(16) as pool:  # the engines batch concurrent requests
        return list(pool.map(one, seeds))


def check_served_distribution(plain_url: str, spec_url: str, sp: SpreadPrompt) -> None:
    """The second generated token of N seeded T=1 requests to a plain server and of N (other seeds) to one with a
    draft: each fits the target's probabilities and the two agree (G-tests at ALPHA each)."""
    plain = second_tokens(plain_url, sp.ids, range(N))
    spec = second_tokens(spec_url, sp.ids, range(N, 2 * N))
    assert fits_target(plain, sp) > ALPHA, torch.bincount(torch.tensor(plain)).nonzero().flatten()
    assert fits_target(spec, sp) > ALPHA, torch.bincount(torch.tensor(spec)).nonzero().flatten()
    assert same_distribution(plain, spec, sp) > ALPHA
