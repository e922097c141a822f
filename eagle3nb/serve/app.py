"""The OpenAI-compatible HTTP layer (FastAPI), shaped like vLLM's: chat and text completions, streaming,
reasoning split, ``return_token_ids``, OpenAI-style errors, bearer-key auth, ``/metrics``.

Choices made to match vLLM (checked against its source):
- ``choices[i].token_ids`` is every generated token, including the final ``<|im_end|>`` (EOS) when it
  stopped on it and the token that completed a stop string; the text drops EOS and cuts the stop string.
  Chat puts ``prompt_token_ids`` at the top level, text completions inside each choice.
- Reasoning parser (vLLM's for the model's family, e.g. ``kimi_k2``; ``eagle3nb.families``): with thinking on
  (the default) the text is split at the family's end marker (``</think>``; the start marker dropped, text
  before it reasoning too; no end marker yet means it is all reasoning); with the family's switch off in
  ``chat_template_kwargs`` (Kimi ``thinking: false``) everything is content. Without a parser, or for a family
  whose reasoning is not marked by think tags, the text stays in ``content``.
- Harmony (gpt-oss, ``openai_gptoss``): the text keeps Harmony's message markers and is split by channel, the
  analysis channel's messages the reasoning and the final channel's the content, whatever the effort.
- Unknown model -> 404 ``NotFoundError``; malformed body, n > 1, too-long prompt -> 400
  ``BadRequestError``; missing/wrong key -> 401; body ``{"error": {message, type, param, code}}``.

Hidden-states hook: with ``--hidden-states-dir`` every ``/v1/completions`` request is answered by
``eagle3nb.serve.extract.handle_completion_extract(model, tokenizer, body: dict, hidden_states_dir: Path)
-> dict`` (run in a worker thread), vLLM's ``extract_hidden_states`` contract.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from eagle3nb import __version__
from eagle3nb.data.turns import template_messages
from eagle3nb.families import Family, detect, harmony_split
from eagle3nb.serve.batcher import Engine, Request, SamplingParams, Update
from eagle3nb.serve.errors import APIError
from eagle3nb.serve.extract import handle_completion_extract
from eagle3nb.serve.requests import Body, ChatBody, CompletionBody

REASONING_FIELDS = ("reasoning", "reasoning_content", "both")


def error_json(status: int, message: str, type: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type, "param": param, "code": status}},
                        status_code=status)


class Server:
    """Request handling over one engine; ``create_app`` wires it into FastAPI routes."""

    def __init__(self, engine: Engine, *, model_name: str, model_dir: str, reasoning_field: str = "reasoning",
                 reasoning_parser: bool = True, api_key: str | None = None, hidden_states_dir: Path | None = None,
                 family: Family | None = None, log_requests: bool = False):
        if reasoning_field not in REASONING_FIELDS:
            raise ValueError(f"reasoning_field must be one of {REASONING_FIELDS}, got {reasoning_field!r}")
        self.engine, self.tok = engine, engine.tokenizer
        self.model_name, self.model_dir = model_name, model_dir
        self.fields = ["reasoning", "reasoning_content"] if reasoning_field == "both" else [reasoning_field]
        vocab = self.tok.get_vocab()
        self.family = family or detect(model_dir)
        self.tags = self.family.think_tags
        # A parser needs the family's markers (think tokens, Harmony's message markers); a model without them is
        # served like vLLM without a parser.
        markers = self.family.text_markers
        self.reasoning_parser = bool(reasoning_parser and markers and all(m in vocab for m in markers))
        self.api_key = api_key
        self.hidden_states_dir = hidden_states_dir
        self.extract = handle_completion_extract if hidden_states_dir is not None else None
        self.created = int(time.time())
        self.log_requests = log_requests

    # ---------------------------------------------------------------------------------------- helpers
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def sampling(self, body: Body, prompt_len: int, max_tokens: int | None,
                 prompt_param: str = "messages") -> SamplingParams:
        if body.n != 1:
            raise APIError(400, f"n={body.n} is not supported by the embedded server; use n=1.", param="n")
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your request has "
                                f"{prompt_len} input tokens. Please reduce the length of the input.",
                           param=prompt_param)
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise APIError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                                f"maximum context length is {limit} tokens and your request has {prompt_len} input "
                                f"tokens ({max_tokens} > {limit} - {prompt_len}).", param="max_tokens")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else limit - prompt_len,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed, stop=[s for s in stop if s], stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Update]:
        """Submit to the engine and yield output snapshots until finished (aborts if the client leaves)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[Update] = asyncio.Queue()
        req = Request(prompt_ids, params, lambda u: loop.call_soon_threadsafe(q.put_nowait, u))
        if self.engine.error is not None:
            raise APIError(503, f"the generation engine failed earlier ({self.engine.error!r}); restart the server",
                           "ServiceUnavailableError")
        self.engine.submit(req)
        finished = False
        try:
            while not finished:
                u = await q.get()
                while not q.empty():  # snapshots are cumulative: the newest one is enough
                    u = q.get_nowait()
                if u.finish_reason == "error":
                    raise APIError(500, f"generation failed: {u.stop_reason}", "InternalServerError")
                finished = u.finish_reason is not None
                yield u
        finally:
            if not finished:
                self.engine.abort(req)

    async def complete(self, prompt_ids: list[int], params: SamplingParams) -> Update:
        """The finished output of one request."""
        final = None
        async for u in self.generate(prompt_ids, params):
            final = u
        return final

    def split(self, text: str, thinking: bool) -> tuple[str | None, str | None]:
        """(reasoning, content) as vLLM's reasoning parser for the family (kimi_k2, qwen3, openai_gptoss...) gives
        them."""
        if self.reasoning_parser and self.family.harmony_channels:  # by channel; Harmony always reasons
            return harmony_split(text, self.family.harmony_channels)
        if not (self.reasoning_parser and thinking and self.tags):
            return None, text
        start, end = self.tags
        # vLLM's parsers start in the reasoning and drop a start marker there: text before it (GLM-4.5's "\n") is
        # reasoning too
        head, _, rest = text.partition(start)
        text = head + rest
        if end not in text:
            return text, None
        reasoning, _, content = text.partition(end)
        return reasoning, content or None

    def thinking(self, kwargs: dict[str, Any] | None) -> bool:
        """Whether a request asks for thinking: the family's switch as the request sets it (on by default)."""
        sw = self.family.switch
        if sw is None:
            return True
        return (kwargs or {}).get(sw.kwarg, sw.on) != sw.off

    def reasoning_fields(self, reasoning: str | None) -> dict[str, str | None]:
        return {f: reasoning for f in self.fields}

    def chat_prompt(self, body: ChatBody) -> list[int]:
        messages = template_messages([_flatten_content(m) for m in body.messages])
        more = {"tools": body.tools} if body.tools else {}
        try:
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False, **(body.chat_template_kwargs or {}), **more)
        except Exception as e:  # a template error is the request's fault (bad roles, missing fields)
            raise APIError(400, f"could not render the chat template for these messages: {e}", param="messages")
        return list(ids)

    # --------------------------------------------------------------------------------------- handlers
    async def chat(self, body: ChatBody):
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if self.log_requests:  # vLLM's request log line (--enable-log-requests at DEBUG), which 05 reads as traffic
            print(f"Request {rid} JSON body: {body.model_dump_json(exclude_unset=True)}", flush=True)
        self.check_model(body.model)
        prompt_ids = self.chat_prompt(body)
        params = self.sampling(body, len(prompt_ids), body.max_completion_tokens or body.max_tokens)
        thinking = self.thinking(body.chat_template_kwargs)
        if body.stream:
            return _sse(self.chat_stream(body, prompt_ids, params, thinking, rid, created))
        final = await self.complete(prompt_ids, params)
        reasoning, content = self.split(final.text, thinking)
        message = {"role": "assistant", "content": content, "refusal": None, "annotations": None, "audio": None,
                   "function_call": None, **self.reasoning_fields(reasoning)}
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": final.finish_reason,
                         "stop_reason": final.stop_reason,
                         "token_ids": final.token_ids if body.return_token_ids else None}],
            "usage": _usage(len(prompt_ids), len(final.token_ids)),
            "prompt_token_ids": prompt_ids if body.return_token_ids else None,
        }

    async def chat_stream(self, body: ChatBody, prompt_ids: list[int], params: SamplingParams, thinking: bool,
                          rid: str, created: int) -> AsyncIterator[dict]:
        def chunk(delta: dict, finish=None, stop_reason=None, token_ids=None, **extra) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish,
                                 "stop_reason": stop_reason, "token_ids": token_ids}], **extra}

        first = chunk({"role": "assistant", "content": ""},
                      prompt_token_ids=prompt_ids if body.return_token_ids else None)
        yield first
        sent_r, sent_c, sent_ids = "", "", 0
        holdback = max((len(s) for s in params.stop), default=1) - 1
        final = None
        async for u in self.generate(prompt_ids, params):
            final = u
            text = u.text if u.finish_reason is not None else _settled(u.text, holdback, self.tags)
            reasoning, content = self.split(text, thinking)
            delta: dict[str, Any] = {}
            if reasoning and len(reasoning) > len(sent_r):
                delta.update(self.reasoning_fields(reasoning[len(sent_r):]))
                sent_r = reasoning
            if content and len(content) > len(sent_c):
                delta["content"] = content[len(sent_c):]
                sent_c = content
            if delta or u.finish_reason is not None:
                new_ids, sent_ids = u.token_ids[sent_ids:], len(u.token_ids)
                yield chunk(delta, u.finish_reason, u.stop_reason, new_ids if body.return_token_ids else None)
        if (body.stream_options or {}).get("include_usage"):
            yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                   "choices": [], "usage": _usage(len(prompt_ids), len(final.token_ids))}

    async def completions(self, body: CompletionBody, raw: dict):
        self.check_model(body.model)
        if self.extract is not None:
            return await run_in_threadpool(self.extract, self.engine.model, self.tok, raw, self.hidden_states_dir)
        prompts = self.completion_prompts(body.prompt)
        if body.stream and len(prompts) != 1:
            raise APIError(400, "stream=true takes a single prompt; send one request per prompt.", param="prompt")
        params = [self.sampling(body, len(p), body.max_tokens or 16, "prompt") for p in prompts]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if body.stream:
            return _sse(self.completion_stream(body, prompts[0], params[0], rid, created))

        finals = await asyncio.gather(*(self.complete(p, sp) for p, sp in zip(prompts, params)))
        choices = [{"index": i, "text": u.text, "logprobs": None, "finish_reason": u.finish_reason,
                    "stop_reason": u.stop_reason,
                    "token_ids": u.token_ids if body.return_token_ids else None,
                    "prompt_token_ids": p if body.return_token_ids else None}
                   for i, (p, u) in enumerate(zip(prompts, finals))]
        n_prompt, n_gen = sum(map(len, prompts)), sum(len(u.token_ids) for u in finals)
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": _usage(n_prompt, n_gen)}

    async def completion_stream(self, body, prompt_ids, params, rid, created) -> AsyncIterator[dict]:
        sent, sent_ids = "", 0
        holdback = max((len(s) for s in params.stop), default=1) - 1
        first = True
        final = None
        async for u in self.generate(prompt_ids, params):
            final = u
            text = u.text if u.finish_reason is not None else _settled(u.text, holdback, self.tags)
            if len(text) > len(sent) or u.finish_reason is not None:
                choice = {"index": 0, "text": text[len(sent):], "logprobs": None, "finish_reason": u.finish_reason,
                          "stop_reason": u.stop_reason,
                          "token_ids": u.token_ids[sent_ids:] if body.return_token_ids else None,
                          "prompt_token_ids": prompt_ids if body.return_token_ids and first else None}
                sent, sent_ids, first = text, len(u.token_ids), False
                yield {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                       "choices": [choice]}
        if (body.stream_options or {}).get("include_usage"):
            yield {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                   "choices": [], "usage": _usage(len(prompt_ids), len(final.token_ids))}

    def completion_prompts(self, prompt) -> list[list[int]]:
        """Text, token ids, or a list of either -> token-id prompts (text as vLLM tokenizes it: with the
        tokenizer's own special tokens, e.g. BOS)."""
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty.", param="prompt")
        out = []
        vocab_size = len(self.tok)
        for p in prompt:
            ids = self.tok(p)["input_ids"] if isinstance(p, str) else list(p)
            if not ids:
                raise APIError(400, "prompt must not be empty.", param="prompt")
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise APIError(400, f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}", param="prompt")
            out.append(ids)
        return out

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "eagle3nb",
            "root": self.model_dir, "parent": None, "max_model_len": self.engine.max_model_len}]}


def _flatten_content(m: dict) -> dict:
    """OpenAI content parts ([{"type": "text", "text": ...}]) -> one string, as chat templates expect."""
    c = m.get("content")
    if isinstance(c, list):
        m = {**m, "content": "".join(p.get("text", "") for p in c if isinstance(p, dict))}
    return m


def _settled(text: str, holdback: int, tags: tuple[str, str] | None) -> str:
    """The part of a growing text that can be streamed now: without the last ``holdback`` characters (they
    may still become a stop string), a split UTF-8 character, or a half-written think tag (of ``tags``)."""
    text = (text[:len(text) - holdback] if holdback else text).rstrip("\ufffd")
    for tag in tags or ():
        for k in range(len(tag) - 1, 0, -1):
            if text.endswith(tag[:k]):
                return text[:-k]
    return text


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for c in chunks:
                yield f"data: {json.dumps(c)}\n\n"
        except APIError as e:  # mid-stream failure: an error event, as vLLM sends
            yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.type, 'code': e.status}})}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream")


def create_app(server: Server) -> FastAPI:
    """The FastAPI app; the engine thread starts and stops with it."""

    @asynccontextmanager
    async def lifespan(app):
        server.engine.start()
        yield
        server.engine.shutdown()

    app = FastAPI(title="eagle3nb embedded server", lifespan=lifespan)

    @app.middleware("http")
    async def auth(request: HTTPRequest, call_next):
        if server.api_key and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {server.api_key}".encode()):
                return error_json(401, "Unauthorized: send 'Authorization: Bearer <key>' with the server's key.",
                                  "AuthenticationError")
        return await call_next(request)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return error_json(e.status, e.message, e.type, e.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        errs = e.errors()
        bad_json = [er for er in errs if er.get("type") == "json_invalid"]
        if bad_json:
            return error_json(400, f"request body is not valid JSON: {bad_json[0].get('ctx', {}).get('error', '')} "
                                   f"(at character {bad_json[0].get('loc', (None, '?'))[-1]})", "BadRequestError")
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ())[1:]) or 'body'}: {er.get('msg')}"
                        for er in errs) or "invalid request body"
        param = ".".join(str(x) for x in errs[0].get("loc", ())[1:]) if errs else None
        return error_json(400, msg, "BadRequestError", param or None)

    @app.get("/health")
    async def health():
        if server.engine.error is not None:
            return error_json(503, f"engine failed: {server.engine.error!r}", "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatBody):
        return await server.chat(body)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: HTTPRequest):
        return await server.completions(body, await request.json())

    return app
