"""A vLLM KV connector that writes the `extract_hidden_states` cache to disk on any device.

Loaded inside the vLLM server (not by specops): `specops serve` puts this directory on the server's
PYTHONPATH and names the class in `--kv-transfer-config` through `kv_connector_module_path`, vLLM's
extension point. It imports only vLLM and torch.

vLLM's ExampleHiddenStatesConnector copies the cached states to pinned host memory on a CUDA
stream and writes them from a thread pool; on the CPU build (no CUDA streams, events or pinned
memory) the worker dies in that copy. Where the cache lives on the CPU this subclass gathers the
request's slots and writes the file synchronously in the worker: one safetensors file per request,
`hidden_states` [tokens, layers, hidden] and `token_ids` [tokens], written to `<file>.tmp` and
renamed, the `.lock` beside it held exclusively until then (readers take it shared). On CUDA the
stock connector runs unchanged.
"""

from __future__ import annotations

import fcntl
import os
from typing import Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


class _Written:
    """Stands where the stock connector keeps a CUDA event: the write is already done."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class SpecopsHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: Any) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            return super()._submit_async_write(pending)
        if not self._is_tp_rank_zero:
            return
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (blocks.reshape(-1, 1) * self._block_size + offsets.reshape(1, -1)).flatten()
        n = int(pending.token_ids.shape[0])
        states = extract_from_kv_cache(self._kv_cache, slots, n).clone()  # [tokens, layers, hidden]
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            tmp = pending.filename + ".tmp"
            save_file({"hidden_states": states.contiguous(), "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)
        except OSError as e:  # the reader finds no file and says so; the engine keeps serving
            logger.error("hidden states of %s not written to %s: %r", pending.req_id, pending.filename, e)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers waiting on LOCK_SH go on
        self._req_copy_events[pending.req_id] = _Written()
