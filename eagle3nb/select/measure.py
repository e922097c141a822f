"""The paired measurement on the user's engine: for each candidate and each concurrency, the plain server's output
tokens/s measured right before the candidate's on the same prompts (the plain server stays up the whole run, the
candidates' servers one at a time), so each speedup is a ratio of two measurements minutes apart and the machine's
drift falls between pairs, not within one. Each (candidate, concurrency) cell is written atomically when it lands and
reused on a resume (``eagle3nb.accept.cache.cached``, keyed by the draft's fingerprint and what was sent); servers
start only for the cells still to measure. Also per candidate: acceptance length both ways from requests sent one at
a time (:func:`per_request`), and where a round's time goes in plain steps (:func:`round_parts`, from the rounds
profile of both servers)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3nb.accept.cache import cached, fingerprint
from eagle3nb.accept.forecast import PARTS
from eagle3nb.accept.online import bench_endpoint, first_model, metrics_url, scrape
from eagle3nb.data.prompts import load_prompts
from eagle3nb.drafts import ServingError
from eagle3nb.errors import UserError
from eagle3nb.formulas import spec_counters, spec_delta, tau_per_request_mean, tau_pooled
from eagle3nb.launch import ServerHandle
from eagle3nb.progress import Progress, write_json_atomic
from eagle3nb.select.candidates import Candidate
from eagle3nb.select.engines import refusal, start

# A round's parts as the report names them: the verify forward, the draft's forwards, and the rest of the round
# (sampling and rejection, the runner's bookkeeping, the engine loop): forecast.PARTS grouped
BOOKKEEPING = tuple(p for p in PARTS if p not in ("forward", "draft"))


class Refused(Exception):
    """The engine did not start on a candidate; ``reason`` is its own."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Lazy:
    """A server started on first use and stopped by :meth:`stop`: a resumed selection starts only the servers whose
    cells are still to measure. A candidate's start that fails is :class:`Refused` with the engine's reason (the
    plain server's is the selection's own error)."""

    def __init__(self, starter: Callable[[], ServerHandle], candidate: bool = True):
        self.starter, self.handle, self.candidate = starter, None, candidate

    def get(self) -> ServerHandle:
        if self.handle is None:
            try:
                self.handle = self.starter()
            except (UserError, RuntimeError) as e:
                if not self.candidate:
                    raise
                raise Refused(refusal(e)) from e
        return self.handle

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.stop()
            self.handle = None


class Sent:
    """What every server is sent: the prompts, the tokens per request, the temperature and the chat template's
    thinking switch; ``config`` keys the cells."""

    def __init__(self, P):
        self.rows = load_prompts(P.prompts, P.num_prompts)
        self.tau_rows = load_prompts(P.prompts, P.tau_requests)
        self.extra = {"chat_template_kwargs": P.target_family.template_kwargs(P.thinking, P.thinking_kwarg)}
        self.max_tokens, self.temperature = P.max_tokens, P.temperature
        self.config = {"model": P.model_path, "engine": P.engine, "prompts": P.prompts, "num_prompts": P.num_prompts,
                       "max_tokens": P.max_tokens, "temperature": P.temperature, "thinking": P.thinking}

    def bench(self, label: str, handle: ServerHandle, c: int, k: int | None, rounds: Path | None) -> dict[str, Any]:
        """04's benchmark of one level (``accept.online.bench_endpoint``): tokens/s, latency, vLLM's counters and,
        with a rounds profile, the engine summary of the level's steps."""
        return bench_endpoint(label, handle.base_url, self.rows, [c], self.max_tokens, self.temperature,
                              warmup=1, extra_body=self.extra, k=k,
                              rounds=str(rounds) if rounds is not None and rounds.exists() else None)[0]


def round_parts(plain: dict[str, Any], spec: dict[str, Any]) -> dict[str, float] | None:
    """What one speculative round costs in plain decode steps at the same level, and its parts (verify forward,
    draft forwards, bookkeeping), from both servers' rounds profile (``forecast.summarize``); None without one."""
    b, s = plain.get("engine"), spec.get("engine")
    if not b or not s or not b["period"]:
        return None
    step = b["period"]
    return {"plain_step_s": step, "round_s": s["period"], "in_plain_steps": s["period"] / step,
            "verify_forward": s["forward"] / step, "draft_forwards": s["draft"] / step,
            "bookkeeping": sum(s[p] for p in BOOKKEEPING) / step}


def pair(sent: Sent, plain: ServerHandle, spec: ServerHandle, c: int, k: int, rounds: tuple[Path | None, Path | None]
         ) -> dict[str, Any]:
    """One cell: the plain server at ``c``, then the candidate at ``c`` on the same prompts, and the ratio."""
    base = sent.bench("plain", plain, c, None, rounds[0])
    mine = sent.bench("candidate", spec, c, k, rounds[1])
    ok = base["output_tokens_per_s"] and not base["errors"] and not mine["errors"]
    return {"concurrency": c, "plain": base, "candidate": mine,
            "speedup": mine["output_tokens_per_s"] / base["output_tokens_per_s"] if ok else None,
            "errors": base["errors"] + mine["errors"], "round": round_parts(base, mine)}


def per_request(sent: Sent, handle: ServerHandle) -> dict[str, Any]:
    """Acceptance length both ways from the same requests, sent one at a time with the server's counters read before
    and after each (one request in flight, so each delta is that request's): vLLM's pooled tau (all accepted over
    all rounds, what its /metrics gives) and SpecForge's mean of per-request taus (``eagle3nb.formulas``)."""
    import openai

    client = openai.OpenAI(base_url=handle.base_url, api_key="EMPTY", max_retries=0, timeout=600.0)
    model, murl = first_model(handle.base_url, "EMPTY"), metrics_url(handle.base_url)
    accepted, drafts = [], []
    before = spec_counters(scrape(murl))
    for row in sent.tau_rows:
        client.chat.completions.create(model=model, messages=row["messages"], max_tokens=sent.max_tokens,
                                       temperature=sent.temperature, extra_body=sent.extra)
        after = spec_counters(scrape(murl))
        delta = spec_delta(before, after)
        if delta.get("engine") != "vllm":  # no spec-decode counters on this server
            return {"requests": len(sent.tau_rows), "pooled": None, "per_request_mean": None}
        accepted.append(delta["accepted"])
        drafts.append(delta["drafts"])
        before = after
    return {"requests": len(accepted), "accepted": accepted, "drafts": drafts, "pooled": tau_pooled(accepted, drafts),
            "per_request_mean": tau_per_request_mean(accepted, drafts)}


def serve(P, cand: Candidate, draft: Path, plain: Lazy, sent: Sent, out: Path, progress: Progress
          ) -> dict[str, Any]:
    """Every cell of one candidate, then its per-request tau; ``{"refused": reason}`` when the engine does not start
    on it (kept, so a resume does not ask again)."""
    folder = out / "serve" / cand.slug
    key = {**sent.config, "draft": fingerprint(draft), "k": cand.k}
    refused = folder / "refused.json"
    earlier = json.loads(refused.read_text()) if refused.exists() else {}
    if earlier.get("config") == json.loads(json.dumps(key, default=str)):  # refused with these very settings
        progress.update(len(P.concurrencies))
        return {"refused": earlier["result"]["reason"]}
    rounds = (out / "rounds" / "plain.jsonl", out / "rounds" / f"{cand.slug}.jsonl") if P.engine == "vllm" \
        else (None, None)
    server = Lazy(lambda: start(P, draft, cand.k, rounds[1]))
    try:
        cells = {}
        for c in P.concurrencies:
            cells[c] = cached(folder / f"c{c}.json", {**key, "concurrency": c},
                              lambda c=c: pair(sent, plain.get(), server.get(), c, cand.k, rounds))
            progress.update(1, candidate=cand.name, concurrency=c, speedup=cells[c]["speedup"] or 0.0)
        tau = cached(folder / "tau.json", {**key, "requests": P.tau_requests}, lambda: per_request(sent, server.get()))
    except Refused as e:
        print(f"[06_select] {cand.name} is not served: {e.reason}", flush=True)
        if not isinstance(e.__cause__, ServingError):  # kept: the engine's; the project's own check is asked again
            folder.mkdir(parents=True, exist_ok=True)
            write_json_atomic(refused, {"config": key, "result": {"reason": e.reason}})
        progress.update(len(P.concurrencies) - len(cells))
        return {"refused": e.reason}
    finally:
        server.stop()
    return {"cells": [cells[c] for c in P.concurrencies], "tau": tau}
