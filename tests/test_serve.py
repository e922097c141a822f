"""The embedded OpenAI-compatible server over real HTTP, with the real openai client (sync and async)."""

from __future__ import annotations

import asyncio
import os
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from eagle3nb.launch import start_server

KEY_ENV = "EAGLE3NB_TEST_SERVE_KEY"
KEY = "sk-test-7f3a9c-never-in-logs"


def questions(n: int, seed: int = 0) -> list[str]:
    from eagle3nb.toy.dialogues import problem

    rng = random.Random(seed)
    return [problem(rng, "heldout")["question"] for _ in range(n)]


@pytest.fixture(scope="module")
def tokenizer(toy_smoke):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_smoke)


class InProcessServer:
    """The same app served by uvicorn in a thread of this process (real HTTP, one shared model): each extra
    server mode costs no torch import. The subprocess path is covered by the ``start_server`` servers."""

    def __init__(self, model_dir, model, tokenizer, **opts):
        import socket

        import uvicorn

        from eagle3nb.serve.app import Server, create_app
        from eagle3nb.serve.batcher import Engine

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        engine = Engine(model, tokenizer, model_name=str(model_dir))
        app = create_app(Server(engine, model_name=str(model_dir), model_dir=str(model_dir), **opts))
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        deadline = time.monotonic() + 30
        while not self.uvicorn.started:
            assert time.monotonic() < deadline, "in-process server did not start"
            time.sleep(0.05)

    def stop(self):
        self.uvicorn.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def servers(toy_smoke, tokenizer):
    """Four reasoning modes: the default (``reasoning``) and ``reasoning_content`` with an API key as real
    ``eagle3nb serve`` subprocesses, ``both`` and no parser (think text inline) in-process."""
    import torch

    from eagle3nb.hf import DECODER, load_target, load_tokenizer

    os.environ[KEY_ENV] = KEY
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `eagle3nb serve` does: the toy's matrices are tiny, extra threads only spin
    with ThreadPoolExecutor(2) as pool:
        futs = {"reasoning": pool.submit(start_server, toy_smoke),
                "reasoning_content": pool.submit(start_server, toy_smoke, reasoning_field="reasoning_content",
                                                 api_key_env=KEY_ENV)}
        model = load_target(toy_smoke, trust_remote_code=False, use=DECODER)
        tok = load_tokenizer(toy_smoke, trust_remote_code=False)
        handles = {"both": InProcessServer(toy_smoke, model, tok, reasoning_field="both"),
                   "inline": InProcessServer(toy_smoke, model, tok, reasoning_parser=False)}
        handles.update({k: f.result() for k, f in futs.items()})
    yield handles
    for h in handles.values():
        h.stop()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(servers):
    return servers["reasoning"]


def client(handle, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=handle.base_url, api_key=key, max_retries=0)


def model_name(toy_smoke) -> str:
    return str(toy_smoke)


def chat(handle, toy_smoke, content: str, key: str = "unused", **kw):
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    return client(handle, key).chat.completions.create(
        model=model_name(toy_smoke), messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=kw.pop("max_tokens", 96), extra_body=extra, **kw)


def split_like_kimi(text: str) -> tuple[str | None, str | None]:
    """vLLM's kimi_k2 parser with thinking on: a leading <think> dropped, split at the first </think>."""
    text = text.removeprefix("<think>")
    if "</think>" not in text:
        return text, None
    r, _, c = text.partition("</think>")
    return r, c or None


def test_health_and_models(server, toy_smoke):
    assert httpx.get(server.url + "/health").status_code == 200
    models = client(server).models.list().data
    assert [m.id for m in models] == [model_name(toy_smoke)]
    assert models[0].model_extra["max_model_len"] > 0


def test_reasoning_field_names_and_inline_mode(servers, toy_smoke, tokenizer):
    q = questions(1, seed=3)[0]
    key = {"reasoning_content": KEY}
    out = {k: chat(h, toy_smoke, q, key=key.get(k, "unused")).choices[0] for k, h in servers.items()}
    ids = out["reasoning"].token_ids
    assert all(o.token_ids == ids for o in out.values()), "greedy output must not depend on the field name"
    text = tokenizer.decode([t for t in ids if t != tokenizer.eos_token_id], skip_special_tokens=False)
    assert text.startswith("<think>")
    reasoning, content = split_like_kimi(text)
    assert reasoning

    m = out["reasoning"].message
    assert m.model_extra["reasoning"] == reasoning and m.content == content
    assert "reasoning_content" not in m.model_extra
    m = out["reasoning_content"].message
    assert m.model_extra["reasoning_content"] == reasoning and m.content == content
    assert "reasoning" not in m.model_extra
    m = out["both"].message
    assert m.model_extra["reasoning"] == m.model_extra["reasoning_content"] == reasoning and m.content == content
    m = out["inline"].message
    assert m.content == text and m.content.startswith("<think>")
    assert m.model_extra.get("reasoning") is None


def test_token_ids_equal_template_rendering(server, toy_smoke, tokenizer):
    """prompt ids == the chat template's generation prompt; prompt + completion ids == the template's rendering
    of the conversation with the answer as an assistant turn {reasoning_content, content} (Kimi shape)."""
    qs = questions(16, seed=5)
    async def run_all():
        c = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        return await asyncio.gather(*(c.chat.completions.create(
            model=model_name(toy_smoke), messages=[{"role": "user", "content": q}], temperature=0, max_tokens=96,
            extra_body={"return_token_ids": True}) for q in qs))
    responses = asyncio.run(run_all())
    think_start, think_end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    checked = 0
    for q, r in zip(qs, responses):
        messages = [{"role": "user", "content": q}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        assert r.model_extra["prompt_token_ids"] == list(prompt)
        ch = r.choices[0]
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ch.token_ids)
        ids = ch.token_ids
        stream = list(prompt) + ids  # the raw stream re-encodes to itself (no retokenization drift)
        assert tokenizer.encode(tokenizer.decode(stream, skip_special_tokens=False), add_special_tokens=False) == stream
        # An answer the template can express: <think>R</think>C<|im_end|> (a stray </think> inside C re-encodes to
        # the same special token, so it still compares).
        expressible = (ch.finish_reason == "stop" and ids[-1] == tokenizer.eos_token_id and ids[0] == think_start
                       and ids.count(think_start) == 1 and think_end in ids)
        if not expressible:
            continue
        turn = {"role": "assistant", "reasoning_content": ch.message.model_extra["reasoning"],
                "content": ch.message.content or ""}
        full = tokenizer.apply_chat_template(messages + [turn], tokenize=True, return_dict=False)
        assert list(prompt) + ids == list(full)
        checked += 1
    assert checked >= 1, "no <think>..</think>answer<|im_end|> output to compare against the template"


def test_thinking_kwarg_changes_output_and_renders_like_template(server, toy_smoke, tokenizer):
    think_start, think_end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    rendered = 0
    for q in questions(6, seed=7):
        on = chat(server, toy_smoke, q).choices[0]
        off_r = chat(server, toy_smoke, q, extra_body={"chat_template_kwargs": {"thinking": False}})
        off = off_r.choices[0]
        assert on.token_ids[0] == think_start and on.message.model_extra["reasoning"]
        assert off.message.model_extra["reasoning"] is None and off.message.content
        assert on.token_ids != off.token_ids
        messages = [{"role": "user", "content": q}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False, thinking=False)
        assert off_r.model_extra["prompt_token_ids"] == list(prompt)
        assert list(prompt)[-2:] == [think_start, think_end]
        if off.finish_reason == "stop" and think_end not in off.token_ids:  # what the template can express
            full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": off.message.content}],
                                                 tokenize=True, return_dict=False, thinking=False)
            assert list(prompt) + off.token_ids == list(full)
            rendered += 1
    assert rendered >= 3, f"only {rendered}/6 thinking-off answers ended cleanly to compare with the template"


def test_stream_reassembles_to_non_streaming(server, toy_smoke):
    q = questions(1, seed=11)[0]
    ref = chat(server, toy_smoke, q)

    async def stream():
        c = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        chunks = await c.chat.completions.create(
            model=model_name(toy_smoke), messages=[{"role": "user", "content": q}], temperature=0, max_tokens=96,
            stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
        return [ch async for ch in chunks]

    chunks = asyncio.run(stream())
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    m = ref.choices[0].message
    assert reasoning == (m.model_extra["reasoning"] or "") and content == (m.content or "")
    assert ids == ref.choices[0].token_ids
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].model_extra["prompt_token_ids"] == ref.model_extra["prompt_token_ids"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.usage.completion_tokens
    assert len(chunks) > 3  # really incremental, not one blob


def test_raw_sse_ends_with_done(server, toy_smoke):
    body = {"model": model_name(toy_smoke), "messages": [{"role": "user", "content": questions(1)[0]}],
            "max_tokens": 8, "stream": True}
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"


def test_completions_text_and_token_ids(server, toy_smoke, tokenizer):
    c = client(server)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": questions(1, seed=2)[0]}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    r = c.completions.create(model=model_name(toy_smoke), prompt=list(prompt), max_tokens=12, temperature=0,
                             extra_body={"return_token_ids": True})
    ch = r.choices[0]
    assert ch.model_extra["prompt_token_ids"] == list(prompt)
    assert 0 < len(ch.model_extra["token_ids"]) <= 12 and r.usage.completion_tokens == len(ch.model_extra["token_ids"])
    chat_ids = chat(server, toy_smoke, questions(1, seed=2)[0], max_tokens=12).choices[0].token_ids
    assert ch.model_extra["token_ids"] == chat_ids  # same prompt ids, same greedy continuation
    text_prompt = tokenizer.decode(prompt, skip_special_tokens=False)
    r2 = c.completions.create(model=model_name(toy_smoke), prompt=text_prompt, max_tokens=12, temperature=0)
    assert r2.choices[0].text == ch.text and r2.usage.prompt_tokens == len(tokenizer(text_prompt)["input_ids"])
    r3 = c.completions.create(model=model_name(toy_smoke), prompt=list(prompt), max_tokens=5, temperature=0)
    assert r3.choices[0].finish_reason == "length" and r3.usage.completion_tokens == 5
    chunks = list(c.completions.create(model=model_name(toy_smoke), prompt=list(prompt), max_tokens=12,
                                       temperature=0, stream=True, extra_body={"return_token_ids": True}))
    assert "".join(k.choices[0].text for k in chunks) == ch.text
    assert [t for k in chunks for t in k.choices[0].model_extra["token_ids"]] == ch.model_extra["token_ids"]
    assert chunks[-1].choices[0].finish_reason == ch.finish_reason


def test_stop_string_cuts_text_but_keeps_the_token(server, toy_smoke, tokenizer):
    q = questions(1, seed=3)[0]
    full = chat(server, toy_smoke, q, max_tokens=40).choices[0]
    text = tokenizer.decode(full.token_ids, skip_special_tokens=False)
    word = re.findall(r"[A-Za-z]{2,}", text.removeprefix("<think>"))[1]
    cut = chat(server, toy_smoke, q, max_tokens=40, stop=[word]).choices[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == word
    assert word not in (cut.message.model_extra["reasoning"] or "") + (cut.message.content or "")
    assert full.token_ids[:len(cut.token_ids)] == cut.token_ids
    assert word in tokenizer.decode(cut.token_ids, skip_special_tokens=False)


def test_seeded_sampling_is_reproducible_and_temperature_zero_is_greedy(server, toy_smoke):
    from sampling import check_seeded_sampling

    q = questions(1, seed=4)[0]
    c = client(server)

    def ask(seed: int, temperature: float) -> tuple[list[int], list[int]]:
        r = c.chat.completions.create(model=model_name(toy_smoke), messages=[{"role": "user", "content": q}],
                                      temperature=temperature, top_p=1.0, seed=seed, max_tokens=32,
                                      extra_body={"return_token_ids": True})
        return r.model_extra["prompt_token_ids"], r.choices[0].token_ids

    check_seeded_sampling(ask, toy_smoke, temperature=1.5, max_tokens=32)


def test_bad_requests_get_openai_errors(server, toy_smoke):
    c = client(server)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="no-such-model", messages=msgs)
    assert e.value.status_code == 404 and "no-such-model" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=model_name(toy_smoke), messages=msgs, n=2)
    assert "n=2" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=model_name(toy_smoke), messages=[{"role": "user", "content": "one " * 3000}])
    assert "maximum context length" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=model_name(toy_smoke), messages=msgs, max_tokens=10**6)
    assert "max_tokens" in e.value.message
    r = httpx.post(server.base_url + "/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/chat/completions", json={"model": model_name(toy_smoke), "messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    assert r.json()["error"]["param"] == "messages"
    r = httpx.post(server.base_url + "/completions", json={"prompt": [10**9], "max_tokens": 2})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]


def test_api_key_required_and_never_logged(servers, toy_smoke):
    h = servers["reasoning_content"]
    for bad in ("", "wrong-key"):
        with pytest.raises(openai.AuthenticationError) as e:
            client(h, bad or "none").models.list()
        assert e.value.status_code == 401
    assert httpx.post(h.base_url + "/chat/completions", json={"messages": []}).status_code == 401
    assert client(h, KEY).models.list().data
    assert chat(h, toy_smoke, "Add 2 and 3.", key=KEY, max_tokens=4).choices[0].message
    assert httpx.get(h.url + "/health").status_code == 200  # health and metrics stay open, as in vLLM
    assert KEY not in h.log()
    assert "auth on" in h.log()


def test_missing_key_env_is_a_clear_startup_error(toy_smoke):
    os.environ.pop("EAGLE3NB_TEST_UNSET_KEY", None)
    with pytest.raises(RuntimeError, match="EAGLE3NB_TEST_UNSET_KEY"):
        start_server(toy_smoke, api_key_env="EAGLE3NB_TEST_UNSET_KEY", timeout=60)


def test_metrics_counters_move(server, toy_smoke):
    def scrape() -> dict[str, float]:
        out: dict[str, float] = {}
        for line in httpx.get(server.url + "/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    name = model_name(toy_smoke)
    before = scrape()
    r = chat(server, toy_smoke, questions(1, seed=9)[0], max_tokens=16)
    after = scrape()

    def key(metric: str, extra: str = "") -> str:
        return f'{metric}{{model_name="{name}"{extra}}}'

    assert after[key("vllm:prompt_tokens_total")] - before[key("vllm:prompt_tokens_total")] == r.usage.prompt_tokens
    assert (after[key("vllm:generation_tokens_total")] - before[key("vllm:generation_tokens_total")]
            == r.usage.completion_tokens)
    fin = f',finished_reason="{r.choices[0].finish_reason}"'
    assert after[key("vllm:request_success_total", fin)] - before.get(key("vllm:request_success_total", fin), 0) == 1
    assert key("vllm:num_requests_running") in after and key("vllm:num_requests_waiting") in after


def test_client_that_leaves_frees_its_slot(server, toy_smoke):
    """A stream closed by its client stops generating (no success counted, far fewer tokens than asked)."""
    def scrape(metric: str) -> float:  # summed over its labelled series
        lines = httpx.get(server.url + "/metrics").text.splitlines()
        return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith(metric + "{"))

    success, generated = scrape("vllm:request_success_total"), scrape("vllm:generation_tokens_total")
    body = {"model": model_name(toy_smoke), "messages": [{"role": "user", "content": questions(1)[0]}],
            "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert scrape("vllm:num_requests_running") == 1
    deadline = time.monotonic() + 30
    while scrape("vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert scrape("vllm:num_requests_running") == 0
    assert scrape("vllm:request_success_total") == success
    assert scrape("vllm:generation_tokens_total") - generated < 900


def test_ignore_eos_runs_to_max_tokens(server, toy_smoke, tokenizer):
    r = chat(server, toy_smoke, questions(1)[0], max_tokens=150, extra_body={"ignore_eos": True}).choices[0]
    assert r.finish_reason == "length" and len(r.token_ids) == 150


def test_concurrent_requests_are_batched_faster_with_identical_outputs(server, toy_smoke):
    """The same 12 greedy requests, one at a time and then all at once: same tokens, much less wall time."""
    qs = questions(12, seed=13)
    sync = client(server)

    def one(q):
        return sync.chat.completions.create(
            model=model_name(toy_smoke), messages=[{"role": "user", "content": q}], temperature=0, max_tokens=40,
            extra_body={"return_token_ids": True}).choices[0].token_ids

    async def together():
        c = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        rs = await asyncio.gather(*(c.chat.completions.create(
            model=model_name(toy_smoke), messages=[{"role": "user", "content": q}], temperature=0, max_tokens=40,
            extra_body={"return_token_ids": True}) for q in qs))
        return [r.choices[0].token_ids for r in rs]

    t0 = time.perf_counter()
    serial = [one(q) for q in qs]
    t_serial = time.perf_counter() - t0
    t0 = time.perf_counter()
    batched = asyncio.run(together())
    t_batched = time.perf_counter() - t0
    assert batched == serial
    assert t_serial / t_batched > 1.5, f"serial {t_serial:.2f}s vs batched {t_batched:.2f}s"
