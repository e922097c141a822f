"""vLLM's ExampleHiddenStatesConnector with the copy done synchronously, so it runs on a CPU-only vLLM.

A CPU-only aid, loaded by vLLM (never by eagle3nb) through the kv-transfer config:

    --kv-transfer-config '{"kv_connector": "CpuHiddenStatesConnector",
                           "kv_connector_module_path": "cpu_hidden_states_connector", "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"shared_storage_path": DIR}}'

with this folder on vLLM's PYTHONPATH. vLLM's own connector copies the states out of its cache through a CUDA
stream, a CUDA event and pinned host memory, none of which exists on a CPU build ("pin_memory=True requires a
CUDA or other accelerator backend"). Here the cache already lives in host memory: the rows are gathered with
the same indexing, cloned, and handed to the same writer thread, lock file and file layout as vLLM's. On GPUs
use vLLM's ``ExampleHiddenStatesConnector`` unchanged. Standalone on purpose: it runs in vLLM's environment.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event vLLM's connector waits on: a synchronous copy is complete at once."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """Same contract as ``ExampleHiddenStatesConnector``; only the device-to-host copy differs."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        assert self._req_futures.get(pending.req_id) is None, "two saves for one request id"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        done = _Done()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
