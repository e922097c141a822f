"""Talking to the target's server: one ``openai.AsyncOpenAI`` per URL (round-robin), retries with
exponential backoff and jitter on what a loaded server throws (429, 5xx, timeouts, dropped connections,
cut-off JSON), and the configuration errors that no retry fixes (wrong key, wrong model name) turned into
one clear message. The run, its probe and the doctor's check-up all send their requests through
``with_retries``, so a server that fails now and then fails none of them. A one-off request before the work
(``retried``: the model list, the probes) takes a refused connection as final: nothing listens there, and
waiting out the backoff would only delay the fix by a minute per server."""

from __future__ import annotations

import asyncio
import json
import random
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

from eagle3nb.data.reasoning import extract, field
from eagle3nb.errors import UserError
from eagle3nb.families import Family

T = TypeVar("T")

RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}
FATAL_STATUS = {401: "the server refused the API key: set api_key_env to the NAME of the environment variable "
                     "holding the key the server was started with (vLLM --api-key)",
                403: "the server forbids this request: check the API key named by api_key_env",
                404: "the server does not serve this model or path: check served_model_name and vllm_url "
                     "(ask GET {url}/models)"}
BACKOFF_CAP_S = 60.0


class FatalServerError(UserError, RuntimeError):
    """A problem every request would hit; the run stops at once with the fix."""


class GaveUp(UserError, RuntimeError):
    """A request that failed for good: a transient failure outlasted the retries, or the server rejected it."""


class MalformedResponse(ValueError):
    """A 200 answer without a usable choice (a proxy's error page, a cut-off body): retried."""


class BadAnswer(ValueError):
    """A 200 answer whose fields break what the API promises (token ids that are not ids of this tokenizer,
    fields of the wrong type): never stored; this request's error, counted with its reason."""


def check_ids(where: str, ids: Any, vocab_size: int) -> None:
    if ids is None:
        return
    if not isinstance(ids, list):
        raise BadAnswer(f"{where} is a {type(ids).__name__}, not a list of token ids")
    for i, t in enumerate(ids):
        if type(t) is not int:
            raise BadAnswer(f"{where}[{i}] is {t!r} ({type(t).__name__}), not an integer token id")
        if not 0 <= t < vocab_size:
            raise BadAnswer(f"{where}[{i}] = {t} is outside the tokenizer's {vocab_size} ids: the server runs "
                            f"another model or tokenizer than model_path")


def check_answer(resp: Any, vocab_size: int) -> Any:
    """``resp`` when every field 01 stores has the type the API promises and every token id is one of the
    tokenizer's; raises BadAnswer naming the first field that does not."""
    choice = resp.choices[0]
    reasoning, content, source = extract(choice.message)
    for name, value in (("content", content), (source, reasoning)):
        if value is not None and not isinstance(value, str):
            raise BadAnswer(f"choices[0].message.{name} is a {type(value).__name__}, not text")
    if choice.finish_reason is not None and not isinstance(choice.finish_reason, str):
        raise BadAnswer(f"choices[0].finish_reason is {choice.finish_reason!r}, not a string")
    check_ids("prompt_token_ids", field(resp, "prompt_token_ids"), vocab_size)
    check_ids("choices[0].token_ids", field(choice, "token_ids"), vocab_size)
    return resp


def base_url(url: str) -> str:
    """``http://host:8000`` -> ``http://host:8000/v1`` (the story passes the bare address)."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def request_seed(seed: int, sample_id: str) -> int:
    """Each prompt's own seed: reproducible whatever order or session answers it."""
    return (seed * 1_000_003 + zlib.crc32(sample_id.encode())) % 2**31


@dataclass
class Endpoint:
    url: str
    client: Any  # openai.AsyncOpenAI
    model: str


async def list_models(ep: Endpoint) -> list[str]:
    """The ids ``/models`` lists; BadAnswer when the answer is not an OpenAI model list (an HTML page, another
    API's JSON)."""
    try:
        listed = await ep.client.models.list()
        data = listed.data
    except (AttributeError, TypeError) as e:  # the openai client meets a body that is not its JSON
        raise BadAnswer(f"GET /models: not the OpenAI JSON ({type(e).__name__}: {e})") from None
    if not isinstance(data, list) or not all(isinstance(getattr(m, "id", None), str) for m in data):
        raise BadAnswer(f"GET /models: no list of models under 'data' (got {str(listed)[:120]})")
    return [m.id for m in data]


def make_client(url: str, api_key: str, timeout_s: float, concurrency: int) -> Any:
    """An ``openai.AsyncOpenAI`` for ``url`` with room for ``concurrency`` requests in flight and no retries of
    its own (``with_retries`` owns the policy, and the endpoint of each attempt)."""
    import httpx
    import openai

    http = openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=concurrency + 8,
                                                              max_keepalive_connections=concurrency + 8))
    return openai.AsyncOpenAI(base_url=base_url(url), api_key=api_key, max_retries=0, timeout=timeout_s,
                              http_client=http)


async def connect(urls: list[str], api_key: str, timeout_s: float, served_model_name: str | None,
                  concurrency: int, *, max_retries: int, backoff_s: float, family: Family) -> list[Endpoint]:
    """A client per URL, each checked by asking ``/models`` (which also names the model when not given), with
    the run's retry policy: a loaded server's passing 503 is no reason to stop. ``family``: the target's, whose
    reasoning parser the start hint names."""
    out = []
    for url in urls:
        client = make_client(url, api_key, timeout_s, concurrency)
        try:
            models = await retried(list_models, Endpoint(url, client, ""), max_retries=max_retries,
                                   backoff_s=backoff_s)
        except GaveUp as e:
            if "BadAnswer" in str(e):
                raise FatalServerError(f"{base_url(url)} answered, but not as an OpenAI-compatible API ({e}); point "
                                       f"vllm_url at the API's address (vLLM, SGLang: http://HOST:PORT)") from None
            parser = "" if family.reasoning == "none" else f" with {family.parser_flag()}"
            raise FatalServerError(f"cannot reach an OpenAI-compatible server at {base_url(url)} ({e}); start it "
                                   f"(e.g. `vllm serve MODEL`{parser}), fix vllm_url, or use vllm_url: "
                                   f"embedded") from None
        if served_model_name is None and not models:
            raise FatalServerError(f"{url}/models lists no model; set served_model_name")
        if served_model_name is not None and models and served_model_name not in models:
            raise FatalServerError(f"{url} serves {models}, not served_model_name {served_model_name!r}; fix "
                                   f"served_model_name (or null to take the served one)")
        out.append(Endpoint(url, client, served_model_name or models[0]))
    return out


class InFlight:
    """Time-weighted mean of requests in flight, from the first dispatch until the work runs out."""

    def __init__(self):
        self.now = 0
        self.area = 0.0
        self.t0: float | None = None
        self.t_last = 0.0
        self.t_end: float | None = None

    def change(self, delta: int) -> None:
        t = time.monotonic()
        if self.t0 is None:
            self.t0 = self.t_last = t
        if self.t_end is None:
            self.area += self.now * (t - self.t_last)
            self.t_last = t
        self.now += delta

    def work_ran_out(self) -> None:
        if self.t_end is None:
            self.change(0)
            self.t_end = time.monotonic()

    def mean(self) -> float:
        end = self.t_end if self.t_end is not None else self.t_last
        return self.area / (end - self.t0) if self.t0 is not None and end > self.t0 else 0.0


def _retry_after(exc: Exception) -> float | None:
    response = getattr(exc, "response", None)
    try:
        return float(response.headers.get("retry-after")) if response is not None else None
    except (TypeError, ValueError):
        return None


def classify(exc: BaseException) -> str:
    """``retry`` (transient), ``fatal`` (every request would fail) or ``error`` (this request is bad)."""
    import openai

    if isinstance(exc, (openai.APIConnectionError, json.JSONDecodeError, openai.APIResponseValidationError,
                        MalformedResponse)):
        return "retry"  # timeouts, dropped connections, cut-off JSON
    if isinstance(exc, openai.APIStatusError):
        if exc.status_code in RETRY_STATUS or exc.status_code >= 500:
            return "retry"
        if exc.status_code in FATAL_STATUS:
            return "fatal"
    return "error"


def refused(exc: BaseException) -> bool:
    """True when ``exc`` comes from a refused connection (nothing listens at the address), found in its chain:
    the openai client wraps httpx's ConnectError around the socket's ConnectionRefusedError."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ConnectionRefusedError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def describe(exc: BaseException) -> str:
    status = getattr(exc, "status_code", None)
    text = str(exc).splitlines()[0][:300] if str(exc) else ""
    return f"{type(exc).__name__}{f' {status}' if status else ''}: {text}"


async def chat(ep: Endpoint, messages: list[dict], *, max_completion_tokens: int, temperature: float, top_p: float,
               seed: int, template_kwargs: dict[str, Any], return_token_ids: bool = True,
               vocab_size: int | None = None, tools: list[dict] | None = None, tool_choice: Any = None) -> Any:
    """One chat completion, asking for the token ids too (vLLM/SGLang ``return_token_ids``); with ``vocab_size``
    (the target tokenizer's) every field 01 stores is checked (``check_answer``); ``tools``: the conversation's
    tool definitions, rendered by the server through the template's tool format (``tool_choice`` as the row sets
    it)."""
    extra: dict[str, Any] = {"chat_template_kwargs": template_kwargs}
    if return_token_ids:
        extra["return_token_ids"] = True
    more = {"tools": tools, **({"tool_choice": tool_choice} if tool_choice else {})} if tools else {}
    resp = await ep.client.chat.completions.create(
        model=ep.model, messages=messages, max_completion_tokens=max_completion_tokens, temperature=temperature,
        top_p=top_p, seed=seed, extra_body=extra, **more)
    if not getattr(resp, "choices", None) or getattr(resp.choices[0], "message", None) is None:
        raise MalformedResponse(f"no choices[0].message in the answer: {str(resp)[:200]}")
    return check_answer(resp, vocab_size) if vocab_size is not None else resp


async def with_retries(call: Callable[[Endpoint], Awaitable[T]], *, max_retries: int, backoff_s: float,
                       endpoint_for_attempt: Callable[[], Endpoint], in_flight: InFlight | None = None,
                       refused_is_final: bool = False) -> tuple[T | None, int, str | None]:
    """(response, attempts, error) for ``call(endpoint)``; retries transient failures with exponential backoff
    and jitter (honouring Retry-After), on the next endpoint each time. Fatal ones raise. Clients must be made
    with the openai client's own ``max_retries=0``, so that a request is sent exactly ``attempts`` times.
    ``refused_is_final``: a refused connection ends the attempts (a check before the work); during the work it
    is retried like any dropped connection (a server restarting)."""
    last, wait_hint = None, None
    for attempt in range(max_retries + 1):
        ep = endpoint_for_attempt()
        if in_flight is not None:
            in_flight.change(+1)
        try:
            return await call(ep), attempt + 1, None
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - sorted by classify()
            kind = classify(e)
            if kind == "fatal":
                raise FatalServerError(f"{ep.url}: {describe(e)}; "
                                       f"{FATAL_STATUS[e.status_code].format(url=ep.client.base_url)}") from None
            last, wait_hint = describe(e), _retry_after(e)
            if kind == "error":
                return None, attempt + 1, last
            if refused_is_final and refused(e):
                return None, attempt + 1, f"{last} (connection refused: nothing listens there)"
        finally:
            if in_flight is not None:
                in_flight.change(-1)
        if attempt < max_retries:
            delay = random.uniform(0.5, 1.0) * min(BACKOFF_CAP_S, backoff_s * 2**attempt)
            await asyncio.sleep(min(BACKOFF_CAP_S, max(delay, wait_hint or 0.0)))
    return None, max_retries + 1, f"{last} (gave up after {max_retries + 1} attempts)"


async def retried(call: Callable[[Endpoint], Awaitable[T]], ep: Endpoint, *, max_retries: int,
                  backoff_s: float) -> T:
    """``call(ep)``'s answer under the retry policy of ``with_retries``, for one-off requests before the work (the
    model list, check-up probes) that have no sample record to carry an error: raises GaveUp when no attempt
    succeeded (at once on a refused connection), FatalServerError when none can."""
    resp, _, err = await with_retries(call, max_retries=max_retries, backoff_s=backoff_s,
                                      endpoint_for_attempt=lambda: ep, refused_is_final=True)
    if err is not None:
        raise GaveUp(f"{ep.url}: {err}")
    return resp


def run_sync(make_coro: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``make_coro()`` run to completion from synchronous code, on a fresh event loop in a thread of its own:
    works where a loop already runs (a JupyterLab cell) as well as in scripts and worker threads."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(make_coro())).result()
