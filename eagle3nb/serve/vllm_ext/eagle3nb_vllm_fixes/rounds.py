"""A profile of the served rounds: one JSON line per engine step, what 04 predicts a vLLM endpoint's speedup from.

Not a fix: it runs only where vLLM's environment names a file in ``EAGLE3NB_VLLM_ROUNDS`` (``start_vllm(...,
rounds=PATH)``; by hand, ``EAGLE3NB_VLLM_ROUNDS=/tmp/rounds.jsonl`` beside the ``PYTHONPATH`` line of
docs/vllm.md). It wraps four methods of vLLM's V1 model runner (the CPU runner inherits them), times them with
``time.perf_counter`` and appends, after each step::

    {"t": wall-clock start, "width": tokens in the target's forward, "reqs": requests in the step,
     "drafted": draft tokens being verified, "decoding": requests that decode (the others prefill a chunk),
     "decode": every request decodes,
     "forward": the target's forward, "sample": sampling and rejection, "draft": the drafter's proposal,
     "step": execute_model's start to sample_tokens' end, "gap": the previous step's end to this start
     (the engine loop: scheduler, output processing, the API server's share of the cores)}

in seconds. A step is a plain decode step (``drafted`` 0) or a speculative round (a verify forward of ``width``
tokens, then the proposal of the next drafts). The line is flushed as written, so a killed server keeps its
profile.
"""

from __future__ import annotations

import json
import os
import time

ENV = "EAGLE3NB_VLLM_ROUNDS"


def install() -> None:
    """Wrap the runner's step methods when ``EAGLE3NB_VLLM_ROUNDS`` names a file; else do nothing."""
    path = os.environ.get(ENV)
    if not path:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    out = open(path, "a", buffering=1)  # line-buffered: each step's line reaches the file as it ends
    step: dict = {}
    last_end = [None]

    def timed(name: str, fn):
        def wrapper(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            finally:
                step[name] = step.get(name, 0.0) + time.perf_counter() - t0
        wrapper.__wrapped__ = fn
        return wrapper

    execute, sample_tokens = GPUModelRunner.execute_model, GPUModelRunner.sample_tokens

    def execute_model(self, scheduler_output, *args, **kwargs):
        step.clear()
        n = scheduler_output.num_scheduled_tokens
        spec = scheduler_output.scheduled_spec_decode_tokens
        now = time.perf_counter()
        decoding = sum(k == 1 + len(spec.get(r, ())) for r, k in n.items())
        step.update(t=time.time(), t0=now, width=scheduler_output.total_num_scheduled_tokens, reqs=len(n),
                    drafted=sum(len(v) for v in spec.values()), decoding=decoding, decode=decoding == len(n),
                    gap=None if last_end[0] is None else now - last_end[0])
        result = execute(self, scheduler_output, *args, **kwargs)
        if result is not None:  # no sample_tokens call follows (an empty step, or a non-final pipeline rank)
            _write()
        return result

    def sample(self, *args, **kwargs):
        try:
            return sample_tokens(self, *args, **kwargs)
        finally:
            _write()

    def _write() -> None:
        if "t0" not in step:
            return
        end = time.perf_counter()
        last_end[0] = end
        if step["width"]:
            line = {k: step[k] for k in ("t", "width", "reqs", "drafted", "decoding", "decode", "gap")}
            line.update(forward=step.get("_model_forward", 0.0), sample=step.get("_sample", 0.0),
                        draft=step.get("propose_draft_token_ids", 0.0), step=end - step["t0"])
            out.write(json.dumps(line) + "\n")
        step.clear()

    for name in ("_model_forward", "_sample", "propose_draft_token_ids"):
        setattr(GPUModelRunner, name, timed(name, getattr(GPUModelRunner, name)))
    execute_model.__wrapped__, sample.__wrapped__ = execute, sample_tokens
    GPUModelRunner.execute_model, GPUModelRunner.sample_tokens = execute_model, sample
