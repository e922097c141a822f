"""The online benchmark against the real embedded server: speculative decoding behind HTTP, vLLM's counters in
/metrics, parsed and turned into acceptance numbers, and the same tokens as the plain server (greedy)."""

from __future__ import annotations

from pathlib import Path

import pytest

from eagle3nb.bench import (add_speedup, bench_endpoint, metrics_url, parse_prometheus, scrape, spec_counters,
                            spec_delta)

K = 3


@pytest.fixture(scope="module")
def random_draft(toy_smoke, tmp_path_factory) -> Path:
    """An untrained draft for the toy target (the server and counters work for any draft)."""
    import torch
    from transformers import AutoConfig

    from eagle3nb.draft import Eagle3Config, Eagle3Draft, save_draft

    c = AutoConfig.from_pretrained(toy_smoke)
    torch.manual_seed(0)
    d = Eagle3Draft(Eagle3Config(hidden_size=c.hidden_size, intermediate_size=2 * c.hidden_size,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=c.hidden_size // 4,
                                 vocab_size=c.vocab_size, draft_vocab_size=c.vocab_size, aux_layer_ids=[2, 4, 5]))
    d.set_vocab(torch.zeros(c.vocab_size, dtype=torch.long), torch.ones(c.vocab_size, dtype=torch.bool))
    return save_draft(d, tmp_path_factory.mktemp("draft"), include_embed=False)


@pytest.fixture(scope="module")
def servers(toy_smoke, random_draft):
    from eagle3nb.serve import start_server

    with start_server(toy_smoke) as plain, start_server(toy_smoke, draft_dir=random_draft,
                                                         num_speculative_tokens=K) as spec:
        yield plain, spec


def _prompts(n: int) -> list[dict]:
    from eagle3nb.synth.prompts import load_prompts

    return load_prompts("toy:heldout", n)


def test_prometheus_text_parses_with_labels_escapes_and_comments():
    text = ('# HELP x a counter\n# TYPE x counter\nx{model_name="m",position="0"} 3.0\n'
            'x{model_name="m",position="1"} 1\ny_total 2.5e+01 1700000000\nz{a="q\\"uote"} NaN\n')
    parsed = parse_prometheus(text)
    assert parsed["x"] == [({"model_name": "m", "position": "0"}, 3.0), ({"model_name": "m", "position": "1"}, 1.0)]
    assert parsed["y_total"] == [({}, 25.0)]
    assert parsed["z"][0][0] == {"a": 'q"uote'}


def test_sglang_gauges_are_read_when_there_are_no_vllm_counters():
    text = 'sglang:spec_accept_length{model_name="m"} 2.5\nsglang:spec_accept_rate{model_name="m"} 0.5\n'
    c = spec_counters(text)
    assert c == {"engine": "sglang", "accept_length": 2.5, "accept_rate": 0.5}
    assert spec_delta({}, c)["acceptance_length"] == 2.5
    assert spec_counters("vllm:generation_tokens_total 5\n") == {"engine": None}


def test_spec_server_exposes_vllm_counters_and_bench_reads_them(servers):
    plain, spec = servers
    before = spec_counters(scrape(metrics_url(spec.base_url)))
    assert before["engine"] == "vllm" and len(before["per_pos"]) == K
    prompts = _prompts(6)
    rows = bench_endpoint("eagle3", spec.base_url, prompts, [1, 3], max_tokens=24, temperature=0.0, warmup=1)
    rows += bench_endpoint("baseline", plain.base_url, prompts, [1, 3], max_tokens=24, temperature=0.0, warmup=1)
    add_speedup(rows, "baseline")
    after = spec_counters(scrape(metrics_url(spec.base_url)))
    # Counter identities of vLLM's definitions, on real /metrics text
    assert after["drafts"] > before["drafts"]
    assert after["draft_tokens"] == K * after["drafts"]
    assert after["accepted"] == sum(after["per_pos"])
    assert all(a >= b for a, b in zip(after["per_pos"], after["per_pos"][1:]))  # cumulative by position
    spec_rows = [r for r in rows if r["endpoint"] == "eagle3"]
    for r in spec_rows:
        assert r["errors"] == 0 and r["output_tokens"] > 0 and r["output_tokens_per_s"] > 0
        assert r["metrics_engine"] == "vllm" and r["acceptance_length"] >= 1.0
        assert 0.0 <= r["acceptance_rate"] <= 1.0 and len(r["per_position"]) == K
        assert r["latency_p50_s"] <= r["latency_p99_s"]
        assert r["speedup"] is not None
    base_rows = [r for r in rows if r["endpoint"] == "baseline"]
    assert all(r["acceptance_length"] is None and r["speedup"] == 1.0 for r in base_rows)


def test_spec_server_is_lossless_over_http(servers):
    from openai import OpenAI

    plain, spec = servers
    outs = []
    for h in (plain, spec):
        client = OpenAI(base_url=h.base_url, api_key="EMPTY")
        model = client.models.list().data[0].id
        outs.append([client.chat.completions.create(model=model, messages=p["messages"], max_tokens=40,
                                                    temperature=0.0, extra_body={"return_token_ids": True})
                     .choices[0].model_extra["token_ids"] for p in _prompts(4)])
    assert outs[0] == outs[1]


def test_spec_server_samples_with_seeds_reproducibly(servers):
    """Sampled requests go through rejection sampling in the server; a seed makes a request repeatable."""
    from openai import OpenAI

    _, spec = servers
    client = OpenAI(base_url=spec.base_url, api_key="EMPTY")
    model = client.models.list().data[0].id
    msgs = _prompts(1)[0]["messages"]

    def ask(seed: int) -> list[int]:
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=30, temperature=1.0, top_p=0.9,
                                           seed=seed, extra_body={"return_token_ids": True})
        return r.choices[0].model_extra["token_ids"]

    first = ask(7)
    assert first and ask(7) == first
