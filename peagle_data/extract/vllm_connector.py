"""peagle's hidden-states connectors for vLLM (loaded by ``kv_connector_module_path``): vLLM's
``ExampleHiddenStatesConnector`` plus provenance in every file it writes.

Each request's safetensors file (``hidden_states [T, K, H]``, ``token_ids [T]``, written by the
parent's writer threads and ``.lock`` protocol) carries string metadata (:data:`META_KEYS`) read
from the vLLM config the connector is given: the layer ids the model captures (sorted, unique, the
order of the file's K axis), the model and its served name, the compute dtype, prefix caching and
the verifier's layer count. :class:`peagle_data.extract.vllm.VllmEngine` refuses a file without it
(a server started with vLLM's stock connector) or whose metadata is not what the extraction needs.

- :class:`HiddenStatesConnector`: GPUs; vLLM's write path unchanged, only the file gets metadata.
- :class:`CpuHiddenStatesConnector`: machines without an accelerator. vLLM's copy goes through
  pinned host memory on a CUDA side stream, and ``pin_memory=True`` fails on a CPU-only machine
  (``pin_memory=True requires a CUDA or other accelerator backend``) on the first finished request;
  the cache already lives in host memory, so the rows are gathered with a plain copy.

:func:`peagle_data.extract.vllm.connector_config` chooses.
"""

from __future__ import annotations

import fcntl
import json
import os
from functools import partial

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

__all__ = ["CpuHiddenStatesConnector", "HiddenStatesConnector", "META_KEYS", "provenance"]

META_KEYS = ("peagle_capture_ids", "peagle_model", "peagle_served_model_name", "peagle_dtype",
             "peagle_prefix_caching", "peagle_num_hidden_layers", "peagle_quantization", "peagle_kv_cache_dtype",
             "peagle_hf_overrides", "peagle_model_class_overrides",
             "peagle_disable_sliding_window", "peagle_connector")
"""The safetensors metadata keys every file carries (strings; ids and flags as JSON)."""


def provenance(vllm_config) -> dict[str, str]:
    """The metadata of the files a connector under ``vllm_config`` (a ``VllmConfig``) writes.

    ``peagle_capture_ids``: the draft config's ``eagle_aux_hidden_state_layer_ids``, sorted and unique
    (the model emits its aux hidden states in layer order, once each); ``peagle_model``: the model
    path or name vLLM loaded; ``peagle_served_model_name``: the name the server lists; ``peagle_dtype``:
    the compute dtype (``"float32"``, ``"bfloat16"``, ...); ``peagle_prefix_caching``: ``"true"`` or
    ``"false"``; ``peagle_num_hidden_layers``: the verifier's decoder layers; ``peagle_quantization``: vLLM's
    quantization method (``"None"`` if unquantized); ``peagle_kv_cache_dtype``: the verifier's KV cache
    dtype (``--kv-cache-dtype``: ``"auto"`` or a quantized one such as ``"fp8"``; vLLM's
    ``extract_hidden_states`` resets only its own hidden-states cache to ``"auto"``, so the captured
    tensor keeps the compute dtype while the verifier's attention reads a quantized cache);
    ``peagle_hf_overrides``:
    ``--hf-overrides`` as sorted JSON (``"{}"`` if none; rope scaling and every other config override
    arrive there), or ``"callable NAME"``; ``peagle_model_class_overrides``: sorted JSON;
    ``peagle_disable_sliding_window``: ``"true"``/``"false"``. The connector adds ``peagle_connector``,
    its class name (``HiddenStatesConnector`` on an accelerator, ``CpuHiddenStatesConnector``), which
    names the server's platform.
    """
    mc = vllm_config.model_config
    ids = getattr(vllm_config.speculative_config.draft_model_config.hf_config, "eagle_aux_hidden_state_layer_ids", [])
    served = mc.served_model_name
    served = served[0] if isinstance(served, (list, tuple)) else served
    return {"peagle_capture_ids": json.dumps(sorted(set(int(i) for i in ids))), "peagle_model": str(mc.model),
            "peagle_served_model_name": str(served or mc.model), "peagle_dtype": str(mc.dtype).replace("torch.", ""),
            "peagle_prefix_caching": json.dumps(bool(vllm_config.cache_config.enable_prefix_caching)),
            "peagle_num_hidden_layers": str(mc.hf_text_config.num_hidden_layers),
            "peagle_quantization": str(mc.quantization),
            "peagle_kv_cache_dtype": str(vllm_config.cache_config.cache_dtype),
            "peagle_hf_overrides": _overrides_json(mc.hf_overrides),
            "peagle_model_class_overrides": _overrides_json(getattr(mc, "model_class_overrides", None)),
            "peagle_disable_sliding_window": json.dumps(bool(mc.disable_sliding_window))}


def _overrides_json(overrides) -> str:
    """A config override (a dict, a callable or None) as a string: sorted JSON, ``"{}"`` if empty."""
    if callable(overrides):
        return f"callable {getattr(overrides, '__qualname__', repr(overrides))}"
    return json.dumps(overrides or {}, sort_keys=True, default=str)


class HiddenStatesConnector(ExampleHiddenStatesConnector):
    """``ExampleHiddenStatesConnector`` whose files carry :func:`provenance` as safetensors metadata."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._provenance = {**provenance(self._vllm_config), "peagle_connector": type(self).__name__}

    def _write_tensors(self, tensors: dict[str, torch.Tensor], event, filename: str, lock_fd: int | None) -> None:
        """Writer thread: wait for the copy, write the file with metadata, release the lock (the parent's
        static method, bound here to reach the metadata)."""
        try:
            event.synchronize()
            save_file(tensors, filename, metadata=self._provenance)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX


class _Done:
    """A finished 'copy event' for the parent's bookkeeping (``query``/``synchronize``)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class CpuHiddenStatesConnector(HiddenStatesConnector):
    """:class:`HiddenStatesConnector` whose cache-to-file copy needs no pinned memory or CUDA events."""

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
