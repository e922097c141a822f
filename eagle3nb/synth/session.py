"""One session of 01 over the prompts still to do: ``concurrency`` workers each keep one request in flight while
prompts remain (no waves), a conversation's turns asked in order; answers go through a queue to a writer thread
that builds the token stream, appends and fsyncs. The event loop runs on its own thread (``run_in_thread``),
which makes the same call work in a script, under papermill and inside JupyterLab's running loop; the calling
thread turns Ctrl-C and SIGTERM into a clean stop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from eagle3nb.data.reasoning import extract, field, no_reasoning_fix
from eagle3nb.data.samples import HEAVY, SampleWriter, check_run_config
from eagle3nb.data.stream import StreamError, Template, build
from eagle3nb.data.turns import answer_message, calls_of, replay, turn_id, turn_inputs
from eagle3nb.errors import scrub
from eagle3nb.launch import start_server
from eagle3nb.params import StageError
from eagle3nb.progress import Progress
from eagle3nb.synth.client import Endpoint, FatalServerError, InFlight, chat, connect, request_seed, with_retries
from eagle3nb.synth.params import SynthParams

EARLY_CHECK = 8  # first answers looked at to decide that reasoning is missing or every request fails


class SynthError(StageError):
    """The run stopped because of a problem every further request would share; the message has the fix."""


def answer_status(thinking: bool, finish_reason: str | None, reasoning: str | None) -> str:
    """A stored answer's status from its finish reason (and, with thinking on, whether reasoning came back). vLLM
    ends a turn whose calls its tool parser read with ``tool_calls`` (``tool_choice: auto``), a complete answer."""
    if finish_reason == "length":
        return "truncated"
    if finish_reason not in ("stop", "tool_calls"):
        return "error"
    return "no_reasoning" if thinking and not reasoning else "ok"


@contextlib.contextmanager
def server_urls(P: SynthParams, model_dir: Path) -> Iterator[list[str]]:
    """The URLs to ask; ``embedded`` starts the embedded server for ``model_dir`` for the block's duration."""
    if P.vllm_url != "embedded":
        yield P.urls
        return
    with start_server(model_dir, api_key_env=P.api_key_env, trust_remote_code=P.trust_remote_code) as handle:
        yield [handle.url]


def run_in_thread(make_coro: Callable[[], Any], on_stop: Callable[[], None]) -> tuple[Any, bool]:
    """Run ``make_coro()`` on a fresh event loop in its own thread; Ctrl-C / SIGTERM here call ``on_stop``
    and wait for the coroutine to wind down. Returns (result, interrupted)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = asyncio.run(make_coro())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    def on_term(signum, frame):
        raise KeyboardInterrupt

    thread = threading.Thread(target=target, name="synth-loop", daemon=True)
    main = threading.current_thread() is threading.main_thread()
    old = signal.signal(signal.SIGTERM, on_term) if main else None
    interrupted = False
    try:
        thread.start()
        while thread.is_alive():
            try:
                thread.join(0.2)
            except KeyboardInterrupt:
                if not interrupted:
                    print("01_synth: stopping; saving what is finished (in-flight requests are dropped)", flush=True)
                interrupted = True
                on_stop()
    finally:
        if main:
            signal.signal(signal.SIGTERM, old)
    if "error" in box:
        raise box["error"]
    return box.get("result"), interrupted


def token_counts(tpl: Template, input_ids: list[int], loss_mask: list[int]) -> dict[str, int]:
    seg = tpl.specials.segments(input_ids, loss_mask)
    return {"prompt": seg.count(0), "reasoning": seg.count(1), "content": seg.count(2)}


class Session:
    """One run of the stage over the prompts still to do."""

    def __init__(self, P: SynthParams, tpl: Template, todo: list[dict], progress: Progress):
        self.P, self.tpl, self.todo, self.progress = P, tpl, todo, progress
        self.halt = threading.Event()
        self.progress_lock = threading.Lock()  # the writer thread and the loop's heartbeat both report
        self.fatal: BaseException | None = None
        self.in_flight = InFlight()
        self.records: list[dict] = []  # this session's records, heavy fields dropped
        self.next_index = 0
        self.endpoints: list[Endpoint] = []
        self.rr = 0
        self.checked: list[bool] = []  # reasoning present, for the first answers
        self.first_errors: list[str | None] = []  # the first outcomes, to catch a run where everything fails
        self.n_ok = self.out_tokens = 0
        self.writer: SampleWriter | None = None
        self.urls = P.urls
        self.t0 = self.t1 = 0.0

    def answer(self, model_dir: Path) -> None:
        """Ask every job (``vllm_url: embedded`` starts the server for the session). Raises SynthError with the fix
        when a problem every request shares stopped it, KeyboardInterrupt after a clean stop on Ctrl-C / SIGTERM
        (in-flight requests dropped, everything answered so far on disk)."""
        interrupted = False
        if self.todo:
            with server_urls(self.P, model_dir) as urls:
                self.urls = urls
                try:
                    _, interrupted = run_in_thread(self.main, self.stop)
                except FatalServerError as e:
                    raise SynthError(str(e)) from None
        if self.fatal is not None:
            if isinstance(self.fatal, (SynthError, StreamError, FatalServerError)):
                raise SynthError(str(self.fatal)) from None
            raise self.fatal
        if interrupted:
            raise KeyboardInterrupt(f"01_synth stopped; {len(self.records)} new samples saved in {self.P.stage_dir}. "
                                    f"Run it again with the same parameters to resume.")

    def stop(self, error: BaseException | None = None) -> None:
        if error is not None and self.fatal is None:
            self.fatal = error
        self.halt.set()

    def next_endpoint(self) -> Endpoint:
        ep = self.endpoints[self.rr % len(self.endpoints)]
        self.rr += 1
        return ep

    async def worker(self, results: asyncio.Queue) -> None:
        while not self.halt.is_set() and self.next_index < len(self.todo):
            job = self.todo[self.next_index]
            self.next_index += 1
            if self.next_index == len(self.todo):
                self.in_flight.work_ran_out()
            if not await self.converse(job, results):
                return

    async def converse(self, job: dict, results: asyncio.Queue) -> bool:
        """Ask a job's turns in order, each after the target's own answers to the earlier ones; a turn that is
        not ``ok`` ends the conversation (what follows would answer a history the target did not write).
        False when the run must stop."""
        P, item = self.P, job["item"]
        every = P.multi_turn == "every"
        history, calls, n = job["history"], job["calls"], len(job["inputs"])
        in_data = n if every else len(turn_inputs(item["conversation"]))  # `last` answers the conversation's last
        for k in range(job["start"], n + 1):
            new = replay(job["inputs"][k - 1], calls)
            if new is None or self.halt.is_set():
                return True
            req = {**item, "id": turn_id(item["id"], k) if every else item["id"], "conversation_id": item["id"],
                   "messages": [*history, *new],
                   "turn": k if every else in_data, "turns": in_data}
            t0 = time.time()
            seed = request_seed(P.seed, req["id"])

            def call(ep: Endpoint, req=req, seed=seed):
                return chat(ep, req["messages"], max_completion_tokens=P.max_completion_tokens,
                            temperature=P.temperature, top_p=P.top_p, seed=seed, template_kwargs=self.tpl.kwargs,
                            return_token_ids=P.return_token_ids, vocab_size=len(self.tpl.tokenizer),
                            tools=item.get("tools"), tool_choice=item.get("tool_choice"))

            try:
                resp, attempts, err = await with_retries(
                    call, max_retries=P.max_retries, backoff_s=P.retry_backoff_s, in_flight=self.in_flight,
                    endpoint_for_attempt=self.next_endpoint)
            except FatalServerError as e:
                self.stop(e)
                return False
            self.early_check(resp, err)
            await results.put((req, resp, attempts, err, time.time() - t0))
            if resp is None:
                return True
            reasoning, content, _ = extract(resp.choices[0].message, self.tpl.family.think_tags)
            if answer_status(P.thinking, resp.choices[0].finish_reason, reasoning) != "ok":
                return True
            calls = calls_of(resp.choices[0].message)
            history = [*req["messages"], answer_message(reasoning, content, calls)]
        return True

    def record(self, item: dict, resp: Any, attempts: int, err: str | None, latency: float) -> dict:
        """The JSON line for one prompt (docs/ARCHITECTURE.md "01_synth output")."""
        P = self.P
        rec: dict[str, Any] = {"id": item["id"], "status": "error", "messages": item["messages"], "reasoning": None,
                               "content": None, "tool_calls": None, "finish_reason": None, "input_ids": [],
                               "loss_mask": [], "thinking": P.thinking, "category": item.get("category"),
                               "conversation_id": item["conversation_id"], "turn": item["turn"], "turns": item["turns"],
                               "token_source": None, "ids_match": None, "usage": None,
                               "latency_s": round(latency, 4), "error": err}
        if item.get("tools"):
            rec["tools"] = item["tools"]
        if resp is not None:
            choice = resp.choices[0]
            reasoning, content, _ = extract(choice.message, self.tpl.family.think_tags)
            finish = choice.finish_reason
            calls = calls_of(choice.message)
            rec.update(reasoning=reasoning, content=content, tool_calls=calls, finish_reason=finish,
                       usage=resp.usage.model_dump() if resp.usage else None)
            try:
                stream = build(self.tpl, item["messages"], reasoning, content, finish,
                               field(resp, "prompt_token_ids"), field(choice, "token_ids"), tools=item.get("tools"),
                               tool_calls=calls)
            except StreamError as e:
                self.stop(e)
                rec["error"] = f"StreamError: {e}"
            else:
                rec.update(stream)
                rec["status"] = answer_status(P.thinking, finish, reasoning)
                if rec["status"] == "error":
                    rec["error"] = f"unexpected finish_reason {finish!r}"
        rec["tokens"] = token_counts(self.tpl, rec["input_ids"], rec["loss_mask"])
        rec["attempts"] = attempts
        rec["finished_at"] = round(time.time(), 3)
        return rec

    def early_check(self, resp: Any, err: str | None) -> None:
        """Stop after the first few answers when every one failed (a setting the server rejects) or, with
        thinking on, every one lacks reasoning (the story's broken data): minutes lost, not hours. Runs on
        the loop as each answer arrives, so no further request goes out once it has decided."""
        n = min(EARLY_CHECK, len(self.todo))
        if len(self.first_errors) < n:
            self.first_errors.append(err)
            if len(self.first_errors) == n and all(self.first_errors):
                servers = ", ".join(scrub(e.url) for e in self.endpoints)
                self.stop(SynthError(f"the first {n} requests to {servers} all failed, e.g. {self.first_errors[0]}; "
                                     f"fix the setting or server it names, then run again"))
        if not self.P.thinking or resp is None or len(self.checked) >= n:
            return
        self.checked.append(extract(resp.choices[0].message, self.tpl.family.think_tags)[0] is not None)
        if len(self.checked) == n and not any(self.checked):
            self.stop(SynthError(no_reasoning_fix(n, self.tpl.family, self.tpl.thinking_kwarg)))

    def process(self, batch: list[tuple]) -> None:
        """Writer thread: records for a batch of answers, appended and fsynced in one go, then progress."""
        recs = [self.record(*b) for b in batch]
        self.writer.write(recs)
        for rec in recs:
            self.records.append({k: v for k, v in rec.items() if k not in HEAVY})
            self.n_ok += rec["status"] == "ok"
            self.out_tokens += rec["tokens"]["reasoning"] + rec["tokens"]["content"]
        elapsed = max(time.time() - self.t0, 1e-9)
        with self.progress_lock:
            self.progress.update(len(recs), ok=self.n_ok, not_ok=len(self.records) - self.n_ok,
                                 out_tok_s=round(self.out_tokens / elapsed, 1), in_flight=self.in_flight.now)

    async def heartbeat(self, every_s: float = 5.0) -> None:
        """Keep the progress line and file alive while long answers are still being generated."""
        while True:
            await asyncio.sleep(every_s)
            with self.progress_lock:
                self.progress.update(0, in_flight=self.in_flight.now)

    async def write_loop(self, results: asyncio.Queue) -> None:
        final = False
        while not final:
            batch = [await results.get()]
            while not results.empty():
                batch.append(results.get_nowait())
            final = batch[-1] is None
            batch = [b for b in batch if b is not None]
            if batch:
                await asyncio.to_thread(self.process, batch)

    async def main(self) -> None:
        P = self.P
        self.endpoints = await connect(self.urls, P.api_key(), P.request_timeout_s, P.served_model_name, P.concurrency,
                                       max_retries=P.max_retries, backoff_s=P.retry_backoff_s, family=self.tpl.family)
        config = {**P.data_config(), "served_model_name": self.endpoints[0].model}
        check_run_config(P.stage_dir, config, P.force)
        print(f"01_synth: asking {', '.join(e.url for e in self.endpoints)} (model {self.endpoints[0].model!r}), "
              f"{P.concurrency} in flight, {len(self.todo)} {'conversations' if P.multi_turn == 'every' else 'prompts'}"
              f" to answer", flush=True)
        results: asyncio.Queue = asyncio.Queue()
        self.writer = SampleWriter(P.stage_dir)
        self.t0 = time.time()
        try:
            writer = asyncio.create_task(self.write_loop(results))
            workers = [asyncio.create_task(self.worker(results)) for _ in range(min(P.concurrency, len(self.todo)))]
            halted = asyncio.ensure_future(asyncio.to_thread(self.halt.wait))
            beat = asyncio.create_task(self.heartbeat())
            all_done = asyncio.gather(*workers, return_exceptions=True)
            await asyncio.wait([all_done, halted, writer], return_when=asyncio.FIRST_COMPLETED)
            if writer.done() and writer.exception() is not None:
                self.stop(writer.exception())
            if self.halt.is_set():
                for w in workers:
                    w.cancel()
            outcomes = await all_done
            beat.cancel()
            self.halt.set()  # releases the waiting thread
            await halted
            await results.put(None)
            if not writer.done():
                await writer
            for out in outcomes:
                if isinstance(out, Exception):
                    raise out
        finally:
            self.t1 = time.time()
            self.writer.close()
            for ep in self.endpoints:
                await ep.client.close()
