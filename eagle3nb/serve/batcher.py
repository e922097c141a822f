"""Generation engine of the embedded server: one background thread batches every running request.

Continuous batching: the running requests share one left-padded KV cache
(``eagle3nb.verification.padded.PaddedKV``, shared with the speculative decoder).
Between decode steps the engine admits waiting requests (prefilled as their own
left-padded batch, then merged into the running cache) and drops finished ones, so each request stops
independently and new ones never wait for a whole batch. Padding never changes a row's result: every forward
gets the 2D attention mask and per-row position_ids (the count of real tokens before each one), so a request's
greedy output is the same alone or in a batch, up to float noise.

Hooks for other parts (keep these signatures):
- The decoder is one swappable object with ``join(reqs)``, ``step()`` and ``leave(reqs)``; ``join`` and
  ``step`` return ``[(request, new_token_ids), ...]`` and may return several tokens per request (the engine
  applies stop conditions and drops tokens past a stop, as vLLM does). ``BatchDecoder`` is the plain one;
  ``--draft`` builds ``eagle3nb.serve.spec_batcher.SpecEngine(model, tokenizer, draft_dir,
  num_speculative_tokens, metrics)`` instead, which batches the running requests' rounds the same way.
- ``Metrics`` is the /metrics registry: ``metrics.counter(name, help)`` returns a counter whose
  ``inc(value, **labels)`` adds to the labelled series (e.g. ``vllm:spec_decode_num_drafts_total``).
"""

from __future__ import annotations

import queue
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from eagle3nb.families import Family, of_tokenizer
from eagle3nb.verification.padded import PaddedKV, left_padded

# ---------------------------------------------------------------------------------------------- metrics

class Counter:
    """A Prometheus counter with optional labels; values keyed by the sorted label items."""

    def __init__(self, name: str, help: str, kind: str = "counter"):
        self.name, self.help, self.kind = name, help, kind
        self.values: dict[tuple, float] = {}
        self.lock = threading.Lock()

    def inc(self, value: float = 1.0, **labels: Any) -> None:
        key = tuple(sorted((k, str(v)) for k, v in labels.items()))
        with self.lock:
            self.values[key] = self.values.get(key, 0.0) + value


class Metrics:
    """The /metrics registry, named like vLLM's so the same scraper reads both (every series carries
    ``model_name``)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.counters: dict[str, Counter] = {}
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}

    def counter(self, name: str, help: str) -> Counter:
        if name not in self.counters:
            self.counters[name] = Counter(name, help)
        return self.counters[name]

    def gauge(self, name: str, help: str, fn: Callable[[], float]) -> None:
        self.gauges[name] = (help, fn)

    def render(self) -> str:
        """Prometheus text exposition format."""
        base = (("model_name", self.model_name),)
        lines: list[str] = []
        for name, (help, fn) in self.gauges.items():
            lines += [f"# HELP {name} {help}", f"# TYPE {name} gauge", f"{name}{_labels(base)} {float(fn())}"]
        for c in self.counters.values():
            lines += [f"# HELP {c.name} {c.help}", f"# TYPE {c.name} counter"]
            with c.lock:
                items = sorted(c.values.items()) or [((), 0.0)]
            for key, v in items:
                lines.append(f"{c.name}{_labels(base + key)} {v}")
        return "\n".join(lines) + "\n"


def _labels(items: tuple) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in items) + "}"


# --------------------------------------------------------------------------------------------- requests

@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # vLLM's extension: run to max_tokens (fixed-length benchmarks)


@dataclass
class Update:
    """What a client sees after a step: the whole output so far (ids and text) and the finish reason."""
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None


class Request:
    """One generation. The engine thread appends tokens; ``on_update`` (thread-safe) delivers snapshots."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, on_update: Callable[[Update], None]):
        self.id = uuid.uuid4().hex
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.on_update = on_update
        self.output_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.aborted = False
        self.counted = 0  # output tokens already added to the generation counter
        self.generator = torch.Generator()
        seed = params.seed if params.seed is not None else int.from_bytes(uuid.uuid4().bytes[:7], "big")
        self.generator.manual_seed(seed)


def sample_next(logits: torch.Tensor, reqs: list[Request]) -> list[int]:
    """One next token per row of ``logits`` [B, V] with each request's own temperature / top_p / generator
    (temperature 0 = greedy), so a request samples the same tokens whatever batch it is in."""
    out: list[int] = []
    for row, req in zip(logits.float().cpu(), reqs):
        p = req.params
        if p.temperature < 1e-5:
            out.append(int(row.argmax()))
            continue
        probs = torch.softmax(row / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, idx = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # always keeps the most likely token
            probs = torch.zeros_like(probs).scatter(0, idx[keep], sorted_p[keep])
        out.append(int(torch.multinomial(probs, 1, generator=req.generator)))
    return out


# ---------------------------------------------------------------------------------------------- decoder

class BatchDecoder:
    """Plain autoregressive decoding of the running batch over one left-padded KV cache."""

    def __init__(self, model, pad_id: int):
        self.model, self.pad_id, self.device = model, pad_id, model.device
        self.running: list[Request] = []
        self.kv: PaddedKV | None = None

    @torch.inference_mode()
    def join(self, reqs: list[Request]) -> list[tuple[Request, list[int]]]:
        """Prefill the new requests (left-padded), sample their first token, merge them into the batch."""
        ids, mask, pos = left_padded([r.prompt_ids + r.output_ids for r in reqs], self.pad_id, self.device)
        # sliding-window targets get full cache layers and their windows in the mask (PaddedKV.attention_mask)
        kv = PaddedKV.for_target(self.model.config, mask)
        out = self.model(input_ids=ids, attention_mask=kv.attention_mask(ids.shape[1], self.model.config,
                                                                         self.model.dtype),
                         position_ids=pos, cache=kv.cache, use_cache=True, logits_to_keep=1)
        kv.cache = out.cache
        toks = sample_next(out.logits[:, -1], reqs)
        if self.kv is None:
            self.kv = kv
        else:
            self.kv.merge(kv)
        self.running += reqs
        return [(r, [t]) for r, t in zip(reqs, toks)]

    @torch.inference_mode()
    def step(self) -> list[tuple[Request, list[int]]]:
        """One decode step for every running request: feed each one's last token, sample the next."""
        ids = torch.tensor([[r.output_ids[-1]] for r in self.running], device=self.device)
        pos = self.kv.extend(1)
        out = self.model(input_ids=ids, attention_mask=self.kv.attention_mask(1, self.model.config, self.model.dtype),
                         position_ids=pos, cache=self.kv.cache, use_cache=True)
        self.kv.cache = out.cache
        toks = sample_next(out.logits[:, -1], self.running)
        return [(r, [t]) for r, t in zip(self.running, toks)]

    def leave(self, reqs: list[Request]) -> None:
        """Drop finished requests and the padding columns no remaining row needs."""
        gone = {id(r) for r in reqs}
        keep = [i for i, r in enumerate(self.running) if id(r) not in gone]
        self.running = [self.running[i] for i in keep]
        if not keep:
            self.kv = None
        else:
            self.kv.select(torch.tensor(keep, device=self.device))


# ----------------------------------------------------------------------------------------------- engine

class Engine:
    """Owns the model, the waiting queue and the background loop; applies stop conditions and metrics."""

    def __init__(self, model, tokenizer, *, model_name: str, max_batch_size: int = 32, decoder=None,
                 metrics: Metrics | None = None, family: Family | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.max_batch_size = max_batch_size
        self.max_model_len = int(getattr(model.config, "max_position_embeddings", 2048))
        self.metrics = metrics or Metrics(model_name)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.decoder = decoder or BatchDecoder(model, pad_id=pad or 0)
        self.eos_ids = _eos_ids(model, tokenizer)
        # Text keeps the family's reasoning markers (think tags, Harmony's message markers: the reasoning split
        # needs them) but drops other special tokens.
        vocab = tokenizer.get_vocab()
        keep = {vocab[t] for t in (family or of_tokenizer(tokenizer)).text_markers if t in vocab}
        self.hidden_ids = set(tokenizer.all_special_ids) - keep
        self.waiting: queue.Queue[Request] = queue.Queue()
        m = self.metrics
        self.c_prompt = m.counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.")
        self.c_gen = m.counter("vllm:generation_tokens_total", "Number of generation tokens processed.")
        self.c_success = m.counter("vllm:request_success_total", "Count of successfully processed requests.")
        m.gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                lambda: len(self.decoder.running))
        m.gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                lambda: self.waiting.qsize())
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="eagle3nb-engine", daemon=True)

    def start(self) -> "Engine":
        self.thread.start()
        return self

    def shutdown(self) -> None:
        self._stop.set()
        self.waiting.put(None)  # wake the loop
        self.thread.join(timeout=10)

    def submit(self, req: Request) -> None:
        if self.error is not None:
            raise RuntimeError(f"generation engine stopped: {self.error!r}")
        self.waiting.put(req)

    def abort(self, req: Request) -> None:
        """The client went away: stop generating for it at the next step."""
        req.aborted = True

    def _take_waiting(self, block: bool) -> list[Request]:
        room = self.max_batch_size - len(self.decoder.running)
        out: list[Request] = []
        while len(out) < room:
            try:
                r = self.waiting.get(block=block and not out, timeout=0.5)
            except queue.Empty:
                break
            if r is None:
                break
            if not r.aborted:
                out.append(r)
        return out

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                new = self._take_waiting(block=not self.decoder.running)
                if new:
                    self.c_prompt.inc(sum(len(r.prompt_ids) for r in new))
                    self._handle(self.decoder.join(new))
                aborted = [r for r in self.decoder.running if r.aborted]
                if aborted:
                    self.decoder.leave(aborted)
                if self.decoder.running:
                    self._handle(self.decoder.step())
        except BaseException as e:  # surface the failure to every waiting client instead of hanging them
            self.error = e
            pending = list(self.decoder.running)
            while not self.waiting.empty():
                pending.append(self.waiting.get_nowait())
            for r in pending:
                if r is not None:
                    r.on_update(Update(list(r.output_ids), r.text, "error", repr(e)))
            raise

    def _handle(self, results: list[tuple[Request, list[int]]]) -> None:
        done: list[Request] = []
        for req, toks in results:
            for tok in toks:
                if req.finish_reason is not None:
                    break
                req.output_ids.append(tok)
                self._check_stop(req, tok)
            self.c_gen.inc(len(req.output_ids) - req.counted)
            req.counted = len(req.output_ids)
            if req.finish_reason is not None:
                done.append(req)
                self.c_success.inc(finished_reason=req.finish_reason)
            try:
                req.on_update(Update(list(req.output_ids), req.text, req.finish_reason, req.stop_reason))
            except RuntimeError:  # the client's event loop is gone: nobody is waiting for this request
                req.aborted = True
        if done:
            self.decoder.leave(done)

    def _check_stop(self, req: Request, tok: int) -> None:
        """vLLM's order: length cap, then EOS / stop token ids, then stop strings (text cut before them)."""
        p = req.params
        if tok not in self.hidden_ids:
            text = self.tokenizer.decode([t for t in req.output_ids if t not in self.hidden_ids],
                                         skip_special_tokens=False)
            req.text = text
        if len(req.output_ids) >= p.max_tokens or len(req.prompt_ids) + len(req.output_ids) >= self.max_model_len:
            req.finish_reason = "length"
        elif tok in self.eos_ids and not p.ignore_eos:
            req.finish_reason = "stop"
        elif tok in p.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", tok
        for s in p.stop if req.finish_reason is None else ():
            cut = req.text.find(s)
            if cut >= 0:
                req.text = req.text[:cut]
                req.finish_reason, req.stop_reason = "stop", s
                break


def _eos_ids(model, tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id}
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    ids |= set(eos) if isinstance(eos, (list, tuple)) else {eos}
    return {int(i) for i in ids if i is not None}
