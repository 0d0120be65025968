"""vLLM's hidden-states connector for machines without an accelerator (loaded by ``kv_connector_module_path``).

vLLM's ``ExampleHiddenStatesConnector`` copies each finished request's hidden states out of the
cache into pinned host memory on a CUDA side stream; on a CPU-only machine ``pin_memory=True``
fails (``pin_memory=True requires a CUDA or other accelerator backend``) on the first finished
request. :class:`CpuHiddenStatesConnector` overrides only that copy: the cache already lives in
host memory, so the rows are gathered with a plain copy and written by the same writer threads,
files and ``.lock`` protocol (``hidden_states [T, n_layers, H]``, ``token_ids [T]``). GPU runs use
vLLM's own connector (:func:`peagle_data.extract_vllm.connector_config` chooses).
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

__all__ = ["CpuHiddenStatesConnector"]


class _Done:
    """A finished 'copy event' for the parent's bookkeeping (``query``/``synchronize``)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` whose cache-to-file copy needs no pinned memory or CUDA events."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        """Gather request ``pending``'s rows ``[T, n_layers, H]`` from the (host) cache and queue the file write."""
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        assert self._req_futures.get(pending.req_id) is None, "another request with the same req_id"
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
