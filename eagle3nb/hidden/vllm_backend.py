"""Client side of vLLM's ``extract_hidden_states`` contract, as vLLM's speculators drives it.

The server runs the target with ``--speculative-config '{"method": "extract_hidden_states",
"num_speculative_tokens": 1, "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids":
[aux..., L]}}}'`` and ``--kv-transfer-config '{"kv_connector": "ExampleHiddenStatesConnector", "kv_role":
"kv_producer", "kv_connector_extra_config": {"shared_storage_path": DIR}}'`` (see :func:`vllm_command`).
For each sample we send ``/v1/completions`` with the token ids as the prompt, ``max_tokens=1`` and
``return_token_ids``; the response's ``kv_transfer_params.hidden_states_path`` names a safetensors file
``{token_ids [T], hidden_states [T, n, H]}`` that the connector writes asynchronously while holding an
exclusive flock on ``<file>.lock``. We wait on that lock, read the file, check its ids equal the ids sent
(and the ids the server echoed), and delete both files. Id ``L`` is the last layer's output *before* the
final norm; we apply the target's norm, so the stored final state matches the transformers backend.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Iterable, Iterator

from eagle3nb.params import StageError
from eagle3nb.vllm_config import connector_config, extract_spec

if TYPE_CHECKING:
    import torch


class VllmBackendError(StageError):
    """The server's answer breaks the extract_hidden_states contract (wrong ids, layers, model, files)."""


def vllm_command(model_path: str, layer_ids: list[int], num_layers: int, max_length: int | None = None,
                 api_key_env: str | None = None, tensor_parallel_size: int = 8,
                 storage_dir: str = "/dev/shm/eagle3nb-hidden", trust_remote_code: bool = False) -> str:
    """The ``vllm serve`` command line that serves what this backend expects: the aux ids plus id ``L`` (the
    final state), the file connector writing under ``storage_dir``, chunked prefill off (required); the
    folder's own code runs in vLLM too only with ``trust_remote_code``."""
    spec, kv = extract_spec([*layer_ids, num_layers]), connector_config(storage_dir, cpu=False)
    opts = f"--tensor-parallel-size {tensor_parallel_size} --no-enable-chunked-prefill"
    if trust_remote_code:
        opts += " --trust-remote-code"
    if max_length:
        opts += f" --max-model-len {max_length + 1}"
    if api_key_env:
        opts += f" --api-key ${api_key_env}"
    return (f"vllm serve {model_path} {opts} \\\n"
            f"  --speculative-config '{json.dumps(spec, separators=(',', ':'))}' \\\n"
            f"  --kv-transfer-config '{json.dumps(kv, separators=(',', ':'))}'")


def read_connector_file(path: str, timeout_s: float = 600.0) -> dict[str, "torch.Tensor"]:
    """Load a file written by vLLM's hidden-states connector once its writer has released ``<path>.lock``."""
    from safetensors.torch import load_file

    lock = path + ".lock"
    if os.path.exists(lock):
        fd = os.open(lock, os.O_RDONLY)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise VllmBackendError(f"{path}: the server still writes it after {timeout_s:.0f} s") from None
                    time.sleep(0.005)
        finally:
            os.close(fd)
    if not os.path.exists(path):
        raise VllmBackendError(
            f"the server says it wrote {path}, but that file is not visible on this machine: run this notebook on "
            "the server's machine, or point the connector's shared_storage_path at a shared filesystem")
    return load_file(path)


def remove_connector_file(path: str) -> None:
    for p in (path, path + ".lock"):
        try:
            os.remove(p)
        except FileNotFoundError:
            pass


class VllmClient:
    """Sends the extraction requests (``concurrency`` in flight) and returns each sample's tensors in order."""

    def __init__(self, url: str, api_key: str = "EMPTY", model: str | None = None, num_states: int = 4,
                 hidden_size: int | None = None, timeout_s: float = 600.0, concurrency: int = 8, max_retries: int = 3):
        import openai

        base = url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.client = openai.OpenAI(base_url=self.base_url, api_key=api_key, timeout=timeout_s, max_retries=max_retries)
        self.model = model or self._served_model()
        self.num_states, self.hidden_size = num_states, hidden_size
        self.timeout_s, self.concurrency = timeout_s, concurrency

    def _served_model(self) -> str:
        try:
            models = self.client.models.list().data
        except Exception as e:  # connection refused, auth, ...: say where and what to do
            raise VllmBackendError(f"cannot list models at {self.base_url} ({type(e).__name__}: {e}); start the server "
                                   "with the command in the notebook, or fix vllm_url / api_key_env") from None
        if not models:
            raise VllmBackendError(f"{self.base_url} serves no model")
        return models[0].id

    def fetch(self, ids: list[int], sample_id: str = "") -> tuple["torch.Tensor", int | None]:
        """One sample -> (hidden_states [T, n, H] as the server stored them, the server's greedy next token)."""
        res = self.client.completions.create(model=self.model, prompt=ids, max_tokens=1, temperature=0.0,
                                             extra_body={"return_token_ids": True})
        choice = res.choices[0] if res.choices else None
        echoed = getattr(choice, "prompt_token_ids", None)
        if echoed is None:
            raise VllmBackendError(f"sample {sample_id}: the response has no prompt_token_ids; the server must accept "
                                   "return_token_ids (vLLM >= 0.10.2)")
        if list(echoed) != list(ids):
            raise VllmBackendError(f"sample {sample_id}: the server tokenized the prompt differently ({len(echoed)} "
                                   f"ids "
                                   f"back for {len(ids)} sent); send token ids to /v1/completions of a vLLM server")
        params = getattr(res, "kv_transfer_params", None) or {}
        path = params.get("hidden_states_path")
        if not path:
            raise VllmBackendError(f"sample {sample_id}: no kv_transfer_params.hidden_states_path in the response; "
                                   "start vLLM with the extract_hidden_states --speculative-config and the "
                                   "ExampleHiddenStatesConnector --kv-transfer-config (the notebook shows both)")
        try:
            data = read_connector_file(path, self.timeout_s)
        finally:
            remove_connector_file(path)
        got = data["token_ids"].tolist()
        if got != list(ids):
            raise VllmBackendError(f"sample {sample_id}: {path} holds other token ids than the ones sent")
        hs = data["hidden_states"]
        if hs.dim() != 3 or hs.shape[0] != len(ids):
            raise VllmBackendError(f"sample {sample_id}: hidden_states has shape {tuple(hs.shape)}, expected "
                                   f"[{len(ids)}, {self.num_states}, H]")
        if hs.shape[1] != self.num_states:
            raise VllmBackendError(
                f"the server returns {hs.shape[1]} hidden states per token, this run expects {self.num_states} "
                f"(the aux layers plus the final layer L): restart vLLM with eagle_aux_hidden_state_layer_ids = "
                "aux_layer_ids + [num_hidden_layers] as in the notebook's command line")
        if self.hidden_size is not None and hs.shape[2] != self.hidden_size:
            raise VllmBackendError(f"the server's hidden size is {hs.shape[2]} but model_path's config says "
                                   f"{self.hidden_size}: the server serves another model than model_path")
        out_ids = getattr(choice, "token_ids", None)
        return hs, (int(out_ids[0]) if out_ids else None)

    def map(self, items: Iterable[tuple[str, list[int]]]) -> Iterator[tuple["torch.Tensor", int | None]]:
        """``fetch`` over ``(sample_id, ids)`` pairs with ``concurrency`` requests in flight, results in order."""
        items = list(items)
        with ThreadPoolExecutor(self.concurrency) as pool:
            futures = [pool.submit(self.fetch, ids, sid) for sid, ids in items]
            for f in futures:
                yield f.result()

