"""The embedded server's side of vLLM's ``extract_hidden_states`` contract (``eagle3nb serve --hidden-states-dir``).

vLLM, started with the ``extract_hidden_states`` speculative method and its ``ExampleHiddenStatesConnector``,
answers a ``/v1/completions`` request by running the prompt, writing ``<dir>/<request id>.safetensors`` with
``token_ids`` [T] (int64) and ``hidden_states`` [T, n, H] (the target's dtype) for the configured
``eagle_aux_hidden_state_layer_ids``, and returning the path in the response's top-level
``kv_transfer_params.hidden_states_path``. Id ``i < L`` is the input of decoder layer ``i``; id ``L`` is the last
layer's output before the final norm. The writer holds an exclusive flock on ``<file>.lock`` until the file
is complete; clients wait on it and delete both files. This module does the same for the toy target, so the
client in ``eagle3nb.hidden.vllm_backend`` is tested against the real contract.

Layer ids: vLLM takes them from ``--speculative-config``; here they default to what speculators launches,
``[2, L//2, L-3, L]``, and ``EAGLE3NB_HIDDEN_LAYER_IDS=2,4,5,8`` overrides them.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
import uuid
from pathlib import Path

from eagle3nb.layers import default_aux_layer_ids
from eagle3nb.serve.errors import APIError

LAYER_IDS_ENV = "EAGLE3NB_HIDDEN_LAYER_IDS"
_FORWARD = threading.Lock()  # hooks are per model: one capture at a time


def served_layer_ids(num_layers: int) -> list[int]:
    """The ids this server writes: $EAGLE3NB_HIDDEN_LAYER_IDS, else speculators' default ``[2, L//2, L-3, L]``."""
    env = os.environ.get(LAYER_IDS_ENV)
    ids = [int(x) for x in env.split(",")] if env else [*default_aux_layer_ids(num_layers), num_layers]
    if not ids or any(not 0 <= i <= num_layers for i in ids):
        raise ValueError(f"{LAYER_IDS_ENV}={env!r}: ids must lie in [0, {num_layers}]")
    return ids


def _prompt_ids(tokenizer, body: dict) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        prompt = tokenizer(prompt)["input_ids"]
    if not (isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)):
        raise APIError(400, "extract_hidden_states takes one prompt (token ids or text) per request", param="prompt")
    bad = [t for t in prompt if not 0 <= t < len(tokenizer)]
    if bad:
        raise APIError(400, f"prompt token ids out of range [0, {len(tokenizer)}): {bad[:5]}", param="prompt")
    if (body.get("max_tokens") or 1) != 1:
        raise APIError(400, "with extract_hidden_states send max_tokens=1 (only prompt states are saved)",
                       param="max_tokens")
    return prompt


def handle_completion_extract(model, tokenizer, body: dict, hidden_states_dir: Path) -> dict:
    """Answer one /v1/completions request: forward the prompt, write its hidden states file, return the
    completion (one sampled token) with ``kv_transfer_params.hidden_states_path``."""
    import torch
    from safetensors.torch import save_file

    from eagle3nb.hidden.capture import Capture, run_decoder

    ids = _prompt_ids(tokenizer, body)
    layers = served_layer_ids(model.config.num_hidden_layers)
    rid = f"cmpl-{uuid.uuid4().hex}"
    path = Path(hidden_states_dir) / f"{rid}.safetensors"
    lock_fd = os.open(str(path) + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)
    try:
        with _FORWARD, Capture(model, layers, final=True) as cap:
            run_decoder(model, [ids])
            states, final = cap.take()
        with torch.inference_mode():
            logits = model.get_output_embeddings()(final[0, -1:]).float()[0]
        temperature = body.get("temperature")
        temperature = 1.0 if temperature is None else float(temperature)
        if temperature == 0:
            token = int(logits.argmax())
        else:
            gen = torch.Generator().manual_seed(int(body["seed"])) if body.get("seed") is not None else None
            token = int(torch.multinomial(torch.softmax(logits.cpu() / temperature, -1), 1, generator=gen))
        save_file({"hidden_states": states[0].contiguous().cpu(), "token_ids": torch.tensor(ids, dtype=torch.int64)},
                  str(path))
    finally:
        os.close(lock_fd)  # releases the flock: readers may open the file now
    want_ids = bool(body.get("return_token_ids"))
    return {
        "id": rid, "object": "text_completion", "created": int(time.time()), "model": body.get("model"),
        "choices": [{"index": 0, "text": tokenizer.decode([token]), "logprobs": None, "finish_reason": "length",
                     "stop_reason": None, "token_ids": [token] if want_ids else None,
                     "prompt_token_ids": ids if want_ids else None}],
        "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1},
        "kv_transfer_params": {"hidden_states_path": str(path)},
    }
