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

``vllm_url`` may list several servers: :class:`VllmClient` keeps each one busy and sends a failed request again
on another (``docs/scale.md``).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import time
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

from eagle3nb.params import StageError
from eagle3nb.synth.client import (
    Endpoint,
    FatalServerError,
    GaveUp,
    base_url,
    classify,
    list_models,
    make_client,
    retried,
    run_sync,
    with_retries,
)
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


RECHECK_S = 30.0  # a server that failed is given requests again after this long (a restarted one rejoins)


def assigned_urls(urls: list[str], rank: int, world: int) -> list[str]:
    """The servers whose request slots process ``rank`` of ``world`` fills: ``urls[rank::world]`` when there are
    enough for every process, else one each, shared round-robin. The others still take its retries."""
    return urls[rank::world] if len(urls) >= world else [urls[rank % len(urls)]]


class VllmClient:
    """Sends the extraction requests to one or more servers and returns each sample's tensors in order.

    Each server in ``home`` (default: all) has ``concurrency`` requests in flight, so a faster one takes more of
    the work; a request that fails transiently (refused connection, timeout, 5xx) is sent again on another server
    under 01's retry policy (``eagle3nb.synth.client.with_retries``), and the server that failed gets no new
    requests for ``RECHECK_S`` seconds. What a server answers is checked against the contract and never retried:
    a contract error is the same on every server."""

    def __init__(self, urls: str | list[str], api_key: str = "EMPTY", model: str | None = None, num_states: int = 4,
                 hidden_size: int | None = None, timeout_s: float = 600.0, concurrency: int = 8,
                 max_retries: int = 6, backoff_s: float = 1.0, home: list[str] | None = None):
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        self.home = list(home) if home else list(self.urls)
        self.api_key, self.timeout_s, self.concurrency = api_key, timeout_s, concurrency
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self.num_states, self.hidden_size = num_states, hidden_size
        self.down: dict[str, float] = {}  # url -> when a request to it last failed
        self.served: dict[str, int] = {}  # url -> samples it answered
        self.model = run_sync(lambda: self._served_model(model))

    def _endpoints(self, model: str) -> list[Endpoint]:
        """A client per server, for one event loop (``map`` runs each call on a fresh one)."""
        return [Endpoint(u, make_client(u, self.api_key, self.timeout_s, self.concurrency), model) for u in self.urls]

    async def _served_model(self, model: str | None) -> str:
        """The served model name (``model``, else the first server's), checked on every server that answers: one
        serving another model stops the run; one that does not answer is said and left for later (a run resumed
        while a server is down goes on with the others); none answering stops the run."""
        names, errors = [], []
        for ep in self._endpoints(""):
            try:
                listed = await retried(list_models, ep, max_retries=min(self.max_retries, 2),
                                       backoff_s=self.backoff_s)
            except (GaveUp, FatalServerError) as e:
                errors.append(f"cannot list models at {base_url(ep.url)} ({e})")
                self.down[ep.url] = time.monotonic()
                continue
            finally:
                await ep.client.close()
            if not listed:
                raise VllmBackendError(f"{base_url(ep.url)} serves no model")
            name = model or (names[0] if names else listed[0])
            if name not in listed:
                raise VllmBackendError(f"{base_url(ep.url)} serves {listed}, not {name!r}: every server in vllm_url "
                                       "must serve the target (fix vllm_model or the list)")
            names.append(name)
        if not names:
            raise VllmBackendError(f"{'; '.join(errors)}: start the server with the command in the notebook, or fix "
                                   "vllm_url / api_key_env")
        for line in errors:
            print(f"02's extraction: {line}; going on with the other servers, asking it again in {RECHECK_S:.0f} s",
                  flush=True)
        return names[0]

    async def _fetch(self, ep: Endpoint, ids: list[int], sample_id: str) -> tuple["torch.Tensor", int | None]:
        """One sample -> (hidden_states [T, n, H] as the server stored them, the server's greedy next token)."""
        res = await ep.client.completions.create(model=ep.model, prompt=ids, max_tokens=1, temperature=0.0,
                                                 extra_body={"return_token_ids": True})
        choice = res.choices[0] if res.choices else None
        echoed = getattr(choice, "prompt_token_ids", None)
        if echoed is None:
            raise VllmBackendError(f"sample {sample_id}: the response has no prompt_token_ids; the server must accept "
                                   "return_token_ids (vLLM >= 0.10.2)")
        if list(echoed) != list(ids):
            raise VllmBackendError(f"sample {sample_id}: the server tokenized the prompt differently ({len(echoed)} "
                                   f"ids back for {len(ids)} sent); send token ids to /v1/completions of a vLLM "
                                   "server")
        params = getattr(res, "kv_transfer_params", None) or {}
        path = params.get("hidden_states_path")
        if not path:
            raise VllmBackendError(f"sample {sample_id}: no kv_transfer_params.hidden_states_path in the response; "
                                   "start vLLM with the extract_hidden_states --speculative-config and the "
                                   "ExampleHiddenStatesConnector --kv-transfer-config (the notebook shows both)")
        try:
            data = await asyncio.to_thread(read_connector_file, path, self.timeout_s)
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

    def _picker(self, eps: list[Endpoint], home: Endpoint) -> Callable[[], Endpoint]:
        """Each attempt's server for one request: its worker's server first, then one not tried yet that is up
        (this process's own servers before the others), then the one that failed longest ago."""
        tried: list[str] = []
        order = sorted(eps, key=lambda e: e.url not in self.home)

        def pick() -> Endpoint:
            fresh = [e for e in order if e.url not in tried]
            up = [e for e in fresh if e.url not in self.down]
            if not tried and home.url not in self.down:
                ep = home
            elif up or fresh:
                ep = (up or fresh)[0]
            else:
                ep = min(eps, key=lambda e: self.down.get(e.url, 0.0))
            tried.append(ep.url)
            return ep

        return pick

    async def _map(self, items: list[tuple[str, list[int]]]) -> list[tuple["torch.Tensor", int | None]]:
        now = time.monotonic()
        self.down = {u: t for u, t in self.down.items() if now - t < RECHECK_S}
        eps = self._endpoints(self.model)
        homes = ([e for e in eps if e.url in self.home and e.url not in self.down]
                 or [e for e in eps if e.url not in self.down] or [e for e in eps if e.url in self.home])
        results: list = [None] * len(items)
        todo = iter(range(len(items)))

        async def call(ep: Endpoint, pos: int):
            sid, ids = items[pos]
            try:
                return await self._fetch(ep, ids, sid), ep.url
            except VllmBackendError as e:  # the server answered against the contract: no retry, raised below
                return e
            except Exception as e:
                if classify(e) == "retry":
                    self.down[ep.url] = time.monotonic()
                raise

        errors: list[BaseException] = []  # the first one is raised once every request in flight has finished

        async def worker(home: Endpoint) -> None:
            while not errors and (pos := next(todo, None)) is not None:
                res, _, err = await with_retries(lambda ep, pos=pos: call(ep, pos),
                                                 max_retries=self.max_retries, backoff_s=self.backoff_s,
                                                 endpoint_for_attempt=self._picker(eps, home))
                if isinstance(res, VllmBackendError):
                    raise res
                if err is not None:
                    raise VllmBackendError(f"sample {items[pos][0]}: no extraction server answered ({err}); start "
                                           f"the servers in vllm_url ({', '.join(self.urls)}) or remove the dead "
                                           "ones, then run again (finished work is kept)")
                results[pos] = res[0]
                self.served[res[1]] = self.served.get(res[1], 0) + 1
                if home.url in self.down and any(e.url not in self.down for e in homes):
                    return  # its server failed: the slots of the servers still up take the rest

        async def guarded(home: Endpoint) -> None:
            try:
                await worker(home)
            except Exception as e:  # noqa: BLE001 - kept, and raised below
                errors.append(e)

        try:
            # interleaved: the first requests go one to each server
            await asyncio.gather(*(guarded(home) for _ in range(self.concurrency) for home in homes))
        finally:
            for ep in eps:
                await ep.client.close()
        if errors:
            raise errors[0]
        return results

    def map(self, items: Iterable[tuple[str, list[int]]]) -> Iterator[tuple["torch.Tensor", int | None]]:
        """The samples ``(sample_id, ids)`` over the servers (see the class docstring), results in order."""
        items = list(items)
        yield from (run_sync(lambda: self._map(items)) if items else [])
