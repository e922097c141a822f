"""Stage 01 (``notebooks/01_synth.ipynb``, ``python -m eagle3nb.synth params/<run>/``): prompts in, one JSON
line per answered prompt out (per answered turn with ``multi_turn: every``), exactly once per id; ``run(P)`` also
writes ``metrics.json`` and the figures.

``concurrency`` workers each keep one request in flight while prompts remain (no waves): a worker takes a
conversation and asks its turns in order, each after the target's own earlier answers, so turns of one
conversation are sequential and conversations run side by side. Answers go
through a queue to a writer thread that builds the token stream, appends and fsyncs, so a slow disk or
tokenizer never idles a request slot. The event loop runs on its own thread, which makes the same call
work in a script, under papermill and inside JupyterLab's running loop; the calling thread turns Ctrl-C
and SIGTERM into a clean stop (in-flight requests are dropped, everything answered so far is on disk).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

from eagle3nb import track
from eagle3nb.data.prompts import load_prompts
from eagle3nb.data.reasoning import extract, field, no_reasoning_fix
from eagle3nb.data.samples import HEAVY, STATUSES, SampleWriter, check_run_config, exclusive, latest
from eagle3nb.data.stream import StreamError, Template, build, naive_text
from eagle3nb.data.turns import answer_message, calls_of, replay, turn_id, turn_inputs
from eagle3nb.errors import scrub
from eagle3nb.launch import start_server
from eagle3nb.params import StageError
from eagle3nb.progress import Progress, write_json_atomic
from eagle3nb.synth import report
from eagle3nb.synth.client import (
    Endpoint,
    FatalServerError,
    GaveUp,
    InFlight,
    chat,
    connect,
    request_seed,
    retried,
    run_sync,
    with_retries,
)
from eagle3nb.synth.params import STAGE, SynthParams

EARLY_CHECK = 8  # first answers looked at to decide that reasoning is missing or every request fails
DONE_STATUSES = ("ok", "truncated")  # never requested again; error / no_reasoning are, with retry_errors


class SynthError(StageError):
    """The run stopped because of a problem every further request would share; the message has the fix."""


def needs_request(last: dict | None, retry_errors: bool) -> bool:
    if last is None:
        return True
    return last["status"] not in DONE_STATUSES and retry_errors


def answer_status(thinking: bool, finish_reason: str | None, reasoning: str | None) -> str:
    """A stored answer's status from its finish reason (and, with thinking on, whether reasoning came back)."""
    if finish_reason == "length":
        return "truncated"
    if finish_reason != "stop":
        return "error"
    return "no_reasoning" if thinking and not reasoning else "ok"


CUT_NOT_OK = "an earlier turn is not ok"
CUT_NO_CALL = "the dataset replays tool results the target did not call for"


def plan_conversation(item: dict, every: bool, done: dict[str, dict], retry_errors: bool) -> tuple[dict | None,
                                                                                                     str | None, int]:
    """(the job still to ask or None, why the conversation stops early or None, turns it loses) for one prompt.
    A job is ``{"item", "inputs", "start", "history", "calls"}``: ask turns ``start..`` of ``inputs``, the first
    after ``history`` (the earlier turns, each followed by the target's answer from ``done``); ``calls`` are the
    target's tool calls of the turn before ``start``."""
    if not every:
        job = {"item": item, "inputs": [item["messages"]], "start": 1, "history": [], "calls": None}
        return (job if needs_request(done.get(item["id"]), retry_errors) else None), None, 0
    inputs = turn_inputs(item["conversation"])
    history: list[dict] = []
    calls = None
    for k in range(1, len(inputs) + 1):
        new = replay(inputs[k - 1], calls)
        if new is None:
            return None, CUT_NO_CALL, len(inputs) - k + 1
        rec = done.get(turn_id(item["id"], k))
        if needs_request(rec, retry_errors):
            return {"item": item, "inputs": inputs, "start": k, "history": history, "calls": calls}, None, 0
        if rec["status"] != "ok":
            return None, CUT_NOT_OK, len(inputs) - k
        calls = rec.get("tool_calls")
        history = [*history, *new, answer_message(rec["reasoning"], rec["content"], calls)]
    return None, None, 0


def planned_ids(item: dict, every: bool) -> list[str]:
    return [turn_id(item["id"], k) for k in range(1, len(turn_inputs(item["conversation"])) + 1)] if every \
        else [item["id"]]


@contextlib.contextmanager
def server_urls(P: SynthParams, model_dir: Path) -> Iterator[list[str]]:
    """The URLs to ask; ``embedded`` starts the embedded server for ``model_dir`` for the block's duration."""
    if P.vllm_url != "embedded":
        yield P.urls
        return
    with start_server(model_dir, api_key_env=P.api_key_env) as handle:
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


def run(P: SynthParams) -> dict[str, Any]:
    """Answer every prompt not yet answered in ``P.stage_dir``; writes ``metrics.json`` and the report's
    figures (PNG) beside the samples and returns the metrics.
    Raises SynthError with the fix when the server or template cannot give faithful data, and
    KeyboardInterrupt after a clean stop on Ctrl-C / SIGTERM."""
    stage_dir = P.stage_dir
    prompts = load_prompts(P.prompts, P.max_samples)
    if P.multi_turn == "last":
        unanswered = next((p["id"] for p in prompts if len(p["messages"]) < len(p["conversation"])
                           and any(m["role"] == "user" for m in p["conversation"][len(p["messages"]):])), None)
        if unanswered is not None:
            raise SynthError(f"prompt {unanswered!r} has user turns without an answer between them (MT-Bench's shape); "
                             f"set multi_turn: every so the target answers each turn after its own earlier answers")
    model_dir = P.model_dir
    tpl = Template(model_dir, P.thinking, P.thinking_kwarg, P.trust_remote_code, P.target_family)
    P.api_key()  # a missing key variable is an error before anything starts
    early = P.data_config()
    if P.served_model_name is None:
        early.pop("served_model_name")
    check_run_config(stage_dir, early, P.force, write=False)
    with exclusive(stage_dir):
        return _answer(P, prompts, model_dir, tpl)


def _answer(P: SynthParams, prompts: list[dict], model_dir: Path, tpl: Template) -> dict[str, Any]:
    """The run proper, with the output folder to ourselves: resume point, session, metrics."""
    stage_dir = P.stage_dir
    torn: list[str] = []
    every = P.multi_turn == "every"
    done = history_records(stage_dir, every, torn)
    todo = [job for p in prompts if (job := plan_conversation(p, every, done, P.retry_errors)[0]) is not None]
    planned = [i for p in prompts for i in planned_ids(p, every)]
    answered = sum(not needs_request(done.get(i), P.retry_errors) for i in planned)
    print(f"01_synth: {len(prompts)} prompts" + (f" ({len(planned)} turns)" if every else "")
          + f", {answered} already answered in {stage_dir}"
          + (f" (torn last line skipped: {', '.join(torn)})" if torn else ""), flush=True)
    progress = Progress(stage_dir, total=len(planned), desc=STAGE, unit="turn" if every else "sample", done=answered)
    session = Session(P, tpl, todo, progress)
    interrupted, state = False, "done"
    try:
        if todo:
            with server_urls(P, model_dir) as urls:
                session.urls = urls
                try:
                    _, interrupted = run_in_thread(session.main, session.stop)
                except FatalServerError as e:
                    raise SynthError(str(e)) from None
        if session.fatal is not None:
            state = "failed"
            if isinstance(session.fatal, (SynthError, StreamError, FatalServerError)):
                raise SynthError(str(session.fatal)) from None
            raise session.fatal
        if interrupted:
            state = "stopped"
            raise KeyboardInterrupt(f"01_synth stopped; {len(session.records)} new samples saved in {stage_dir}. "
                                    f"Run it again with the same parameters to resume.")
    except KeyboardInterrupt:
        state = "stopped"
        raise
    except BaseException:
        if state == "done":
            state = "failed"
        raise
    finally:
        metrics = collect_metrics(stage_dir, prompts, session, torn)
        write_json_atomic(stage_dir / "metrics.json", metrics)
        progress.metrics.update({k: metrics[k] for k in ("counts", "ids_mismatch")})
        progress.close(state)
    report.save_figures(stage_dir)
    track.stage_done(P)
    print(report.summary(metrics), flush=True)
    return metrics


def history_records(stage_dir: Path, every: bool, torn: list[str] | None = None) -> dict[str, dict]:
    """The latest record per id, light; with ``multi_turn: every`` the answers are kept too: a conversation half
    done resumes at its next turn after the target's own earlier answers."""
    if not Path(stage_dir).exists():
        return {}
    if every:
        return latest(stage_dir, torn=torn, drop=("messages", "input_ids", "loss_mask"))
    return latest(stage_dir, light=True, torn=torn)


def _percentiles(values: list[float]) -> dict[str, float] | None:
    import numpy as np

    if not values:
        return None
    a = np.asarray(values, dtype=float)
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "mean": float(a.mean()), "max": float(a.max())}


def collect_metrics(stage_dir: Path, prompts: list[dict], session: Session, torn: list[str]) -> dict[str, Any]:
    """``metrics.json``: counts by status, tokens, token-id mismatches and latency over every sample in
    ``stage_dir`` (latest record per id; every sample that is not ``ok`` is counted with its reason), plus
    this session's throughput."""
    every = session.P.multi_turn == "every"
    recs = history_records(stage_dir, every)
    cut: Counter = Counter()
    for p in prompts:
        _, why, lost = plan_conversation(p, every, recs, retry_errors=False)
        if why:
            cut[why] += lost
    planned = [i for p in prompts for i in planned_ids(p, every)]
    counts = Counter(r["status"] for r in recs.values())
    ok = [r for r in recs.values() if r["status"] == "ok"]
    tokens = {k: sum(r["tokens"][k] for r in ok) for k in ("prompt", "reasoning", "content")}
    answered = [r for r in recs.values() if r["status"] != "error"]
    compared = [r["ids_match"] for r in ok if r.get("ids_match") is not None]  # what training will read
    errors = Counter(r["error"].split(":")[0] for r in recs.values() if r["status"] == "error" and r.get("error"))
    mine = session.records
    wall = max(session.t1 - session.t0, 1e-9) if mine else 0.0
    out_tokens = sum(r["tokens"]["reasoning"] + r["tokens"]["content"] for r in mine)
    concurrency = min(session.P.concurrency, len(session.todo)) if session.todo else 0
    in_flight = session.in_flight.mean()
    return {
        "samples": len(recs),
        "prompts": len(prompts),
        "multi_turn": session.P.multi_turn,
        "turns": turn_metrics(prompts, recs),
        "turns_cut": dict(cut),
        "missing": sum(i not in recs for i in planned) - sum(cut.values()),
        "counts": {s: counts.get(s, 0) for s in STATUSES},
        "tokens_ok": tokens,
        "mean_tokens_ok": {k: (v / len(ok) if ok else 0.0) for k, v in tokens.items()},
        "token_source": dict(Counter(r.get("token_source") for r in answered)),
        "ids_compared": len(compared),
        "ids_mismatch": compared.count(False),
        "errors": dict(errors),
        "latency_s": _percentiles([r["latency_s"] for r in answered]),
        "session": {
            "samples": len(mine),
            "wall_s": wall,
            "requests_per_s": len(mine) / wall if wall else 0.0,
            "output_tokens_per_s": out_tokens / wall if wall else 0.0,
            "retries": sum(r.get("attempts", 1) - 1 for r in mine),
            "concurrency": concurrency,
            "in_flight_mean": in_flight,
            "in_flight_ratio": in_flight / concurrency if concurrency else None,
        },
        "torn_lines": torn,
    }


def turn_metrics(prompts: list[dict], recs: dict[str, dict]) -> dict[str, Any]:
    """How many turns the conversations hold and how many the training data answers: with ``last``, every turn
    but the last is the dataset's own text and trains nothing."""
    in_data = sum(len(turn_inputs(p["conversation"])) for p in prompts)
    ok = [r for r in recs.values() if r["status"] == "ok"]
    return {"conversations": len(prompts), "in_prompts": in_data, "multi_turn_conversations":
            sum(len(turn_inputs(p["conversation"])) > 1 for p in prompts),
            "answered_ok": len(ok), "first_ok": sum(r.get("turn", 1) == 1 for r in ok),
            "untrained": in_data - len(ok)}


def probe(P: SynthParams, question: str = "What is 2+2?") -> dict[str, Any]:
    """Ask one question with the run's settings and show where everything landed: the raw reasoning and
    content fields, whether token ids came back, and the training stream decoded with special tokens
    visible. Catches a missing reasoning parser or a wrong template kwarg before a long run."""
    model_dir = P.model_dir
    tpl = Template(model_dir, P.thinking, P.thinking_kwarg, P.trust_remote_code, P.target_family)
    messages = [{"role": "user", "content": question}]

    async def ask(urls: list[str]) -> tuple[Endpoint, Any]:
        retry = {"max_retries": P.max_retries, "backoff_s": P.retry_backoff_s}
        eps = await connect(urls, P.api_key(), P.request_timeout_s, P.served_model_name, 1, family=tpl.family, **retry)
        try:
            resp = await retried(lambda ep: chat(ep, messages, max_completion_tokens=P.max_completion_tokens,
                                                 temperature=P.temperature, top_p=P.top_p, seed=P.seed,
                                                 template_kwargs=tpl.kwargs,
                                                 return_token_ids=P.return_token_ids,
                                                 vocab_size=len(tpl.tokenizer)), eps[0], **retry)
        except (GaveUp, FatalServerError) as e:
            raise SynthError(f"the probe request failed: {e}") from None
        finally:
            await eps[0].client.close()
        return eps[0], resp

    with server_urls(P, model_dir) as urls:
        ep, resp = run_sync(lambda: ask(urls))
    choice = resp.choices[0]
    msg = choice.message
    reasoning, content, source = extract(msg, tpl.family.think_tags)
    stream = build(tpl, messages, reasoning, content, choice.finish_reason,
                   field(resp, "prompt_token_ids"), field(choice, "token_ids"))
    n_prompt = stream["loss_mask"].count(0)
    problems = []
    if P.thinking and reasoning is None:
        problems.append(no_reasoning_fix(1, tpl.family, tpl.thinking_kwarg))
    if stream["token_source"] == "template":
        problems.append("the server returned no token ids (return_token_ids): the stream is re-rendered through "
                        "the chat template, which is exact only if the template keeps reasoning_content")
    if stream["ids_match"] is False:
        problems.append("the server's token ids differ from the template rendering of the same text: the server ids "
                        "are used (they are what the model produced)")
    return {
        "url": ep.url, "model": ep.model, "finish_reason": choice.finish_reason,
        "raw": {name: field(msg, name) for name in ("reasoning", "reasoning_content", "content")},
        "reasoning_from": source, "token_source": stream["token_source"], "ids_match": stream["ids_match"],
        "prompt": tpl.decode(stream["input_ids"][:n_prompt]), "completion": tpl.decode(stream["input_ids"][n_prompt:]),
        "naive_concatenation": naive_text(reasoning, content), "problems": problems,
    }
