"""The verifier's side of speculative decoding: its passes, its lm_head, and a KV cache that can be
cut back after rejected drafts (:mod:`peagle_train.generate.speculative`).

Legend: n tokens fed in one pass, H verifier hidden size, V verifier vocab.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from transformers import DynamicCache
from transformers.cache_utils import (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin,
                                      LinearAttentionLayer)

from peagle_train.train.loss import LogitTransform
from stores.errors import InputError

__all__ = ["new_cache", "rollback_cache", "crop_cache", "recurrent_layers", "config_recurrent_layers",
           "StateSnapshot", "snapshot_state", "keep_fed", "state_pass", "TOKEN_STATES", "record_token_states",
           "verifier_pass", "verifier_body_pass", "lm_head_logits", "decoder_layers", "aux_hidden_states"]


def lm_head_logits(lm_head, hidden: torch.Tensor) -> torch.Tensor:
    """``lm_head(hidden)`` for all ``n`` rows of ``hidden [n, H]``: ``[n, V]`` float32 on CPU.

    On a CPU a plain ``nn.Linear`` head is computed as ``weight @ hidden.T``: one pass over the
    ``V x H`` weight serves all rows, so the ``K + 1`` rows of a verification cost about one row
    (measured on SmolLM2-135M, V = 49152, 1 thread: 5 rows 11 ms this way, 25 ms with
    ``F.linear``, 43 ms row by row; see docs/benchmarks.md). Other heads (quantized ``Linear``
    subclasses, GPU) are called as they are.
    """
    if type(lm_head) is torch.nn.Linear and hidden.device.type == "cpu":
        logits = torch.matmul(lm_head.weight, hidden.to(lm_head.weight.dtype).T).T  # [n, V]
        if lm_head.bias is not None:
            logits = logits + lm_head.bias
    else:
        logits = lm_head(hidden)
    return logits.float().cpu().contiguous()


def new_cache(verifier):
    """The verifier's own KV cache (sliding-window layers keep only their window): plain decoding."""
    try:
        return DynamicCache(config=verifier.config)
    except TypeError:  # older transformers
        return DynamicCache()


def recurrent_layers(cache) -> list[int]:
    """Indices of ``cache``'s layers that carry a recurrent state (gated DeltaNet, Mamba-2, ...: transformers'
    ``LinearAttentionLayer``) from token to token instead of one key and value per token."""
    return [i for i, layer in enumerate(getattr(cache, "layers", None) or [])
            if isinstance(layer, LinearAttentionCacheLayerMixin)]


def config_recurrent_layers(config) -> list[int]:
    """:func:`recurrent_layers` of the cache transformers builds for ``config`` (a model config, no weights
    needed): which layers of a verifier carry a recurrent state, known before its weights load."""
    try:
        cache = DynamicCache(config=config)
    except TypeError:  # older transformers: no per-layer cache from a config, and no hybrid layers in it
        return []
    return recurrent_layers(cache)


def rollback_cache(verifier):
    """A KV cache that :func:`crop_cache` can cut back exactly, for speculative decoding.

    The verifier's own cache with every sliding-window (or chunked) layer replaced by a full layer:
    those layers then keep all keys and values, and the model still masks them by its window (its
    masks are built from positions over the full key length), so the outputs equal the model's own
    and a rejected draft's keys can be dropped (a sliding layer that has shifted its window cannot
    give back the keys it evicted). Layers with a recurrent state (linear attention, state-space:
    :func:`recurrent_layers`) stay as they are: their state cannot be cut back to an earlier token,
    so a decoder has them record per-token states (:func:`record_token_states`) or snapshots them
    before a pass (:func:`snapshot_state`), and puts them back with :func:`keep_fed`.

    Raises:
        InputError: another cache layer (one that mixes a recurrent state and attention in one layer, or
            a kind this module does not know), which could not be cut back exactly.
    """
    cache = new_cache(verifier)
    layers = getattr(cache, "layers", None) or []
    for i, layer in enumerate(layers):
        if isinstance(layer, DynamicSlidingWindowLayer) and not isinstance(layer, LinearAttentionCacheLayerMixin):
            layers[i] = DynamicLayer()
        elif type(layer) not in (DynamicLayer, LinearAttentionLayer) and "Dummy" not in type(layer).__name__:
            raise InputError(f"the verifier's cache layer {i} is a {type(layer).__name__}: its state cannot be cut "
                             "back after a rejected draft, so speculative decoding would not be exact; peagle "
                             "supports verifiers whose layers are full, sliding-window or chunked attention, or "
                             "linear-attention / state-space layers with a state of their own", field="--verifier")
    return cache


@dataclass(frozen=True)
class StateSnapshot:
    """The recurrent state of a cache's linear-attention / state-space layers after ``tokens`` tokens."""

    tokens: int
    """Tokens the cache had read when the snapshot was taken."""
    layers: dict[int, dict[str, Any]]
    """Per recurrent layer index: copies of its ``conv_states``, ``recurrent_states`` (``{state index: tensor or
    None}``), ``has_previous_state`` and token count (``cumulative_length_linear``: transformers 5.25 has one, 5.19 none)."""


def snapshot_state(cache, tokens: int) -> StateSnapshot | None:
    """Copies of ``cache``'s recurrent states (a few ``[1, heads, d_k, d_v]`` and ``[1, channels, kernel]``
    tensors per layer, independent of the context length), taken when it has read ``tokens`` tokens; None for a
    cache without recurrent layers (attention only: :func:`crop_cache` needs no snapshot)."""
    layers = {}
    for i in recurrent_layers(cache):
        layer = cache.layers[i]
        clone = lambda states: {k: (v.clone() if isinstance(v, torch.Tensor) else v)  # noqa: E731
                                for k, v in states.items()}
        count = getattr(layer, "cumulative_length_linear", None)
        layers[i] = {"conv_states": clone(layer.conv_states), "recurrent_states": clone(layer.recurrent_states),
                     "has_previous_state": dict(layer.has_previous_state),
                     "count": count.clone() if isinstance(count, torch.Tensor) else count}
    return StateSnapshot(tokens=int(tokens), layers=layers) if layers else None


def _restore_state(cache, snapshot: StateSnapshot) -> None:
    """Put ``snapshot``'s states back into ``cache``'s recurrent layers (copied in place where the shapes agree)."""
    for i, saved in snapshot.layers.items():
        layer = cache.layers[i]
        for name in ("conv_states", "recurrent_states"):
            states = getattr(layer, name)
            for k, value in saved[name].items():
                current = states.get(k)
                if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor) \
                        and current.shape == value.shape:
                    current.copy_(value)
                else:
                    states[k] = value.clone() if isinstance(value, torch.Tensor) else value
        layer.has_previous_state.update(saved["has_previous_state"])
        if isinstance(saved["count"], torch.Tensor):
            layer.cumulative_length_linear.copy_(saved["count"])


def cache_kwarg(verifier) -> str:
    """transformers ≥ 5.x names the cache argument ``cache``; earlier versions ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(verifier.forward).parameters else "past_key_values"


def _attention_length(cache) -> int:
    """Tokens in the attention layers of ``cache`` (its first layer holding keys; 0 when none does)."""
    for layer in getattr(cache, "layers", None) or []:
        if not isinstance(layer, LinearAttentionCacheLayerMixin) and isinstance(getattr(layer, "keys", None), torch.Tensor):
            return int(layer.get_seq_length())
    return 0


def crop_cache(cache, keep_tokens: int, snapshot: StateSnapshot | None = None) -> None:
    """Cut ``cache`` back to its first ``keep_tokens`` tokens (negative ``crop`` = tokens to remove).

    A cache with recurrent layers (:func:`recurrent_layers`) is cut back only to where ``snapshot`` was taken:
    its attention layers are cropped and its recurrent layers get the snapshot's state.

    Raises:
        ValueError: a cache with recurrent layers and no snapshot, or one taken at another length.
    """
    recurrent = recurrent_layers(cache)
    if not recurrent:
        remove = cache.get_seq_length() - keep_tokens
        assert remove >= 0, (cache.get_seq_length(), keep_tokens)
        if remove > 0:
            cache.crop(-remove)
        return
    if snapshot is None or snapshot.tokens != keep_tokens:
        raise ValueError(f"the cache's layers {recurrent} carry a recurrent state, which can only be put back to a "
                         f"snapshot of it: cutting back to {keep_tokens} tokens needs a snapshot taken there (got "
                         f"{None if snapshot is None else snapshot.tokens})")
    remove = _attention_length(cache) - keep_tokens
    assert remove >= 0, (_attention_length(cache), keep_tokens)
    _restore_state(cache, snapshot)
    if remove > 0:
        for i, layer in enumerate(cache.layers):
            if i not in recurrent and isinstance(getattr(layer, "keys", None), torch.Tensor):
                layer.crop(-remove)


TOKEN_STATES = "recurrent_states_to_keep" in inspect.signature(LinearAttentionLayer.activate_past_recording).parameters
"""Whether this transformers records a recurrent layer's state after each token of a pass (5.25 does:
``activate_past_recording(recurrent_states_to_keep=N)``; 5.19's ``crop`` puts back the convolution state only)."""


def record_token_states(cache, tokens_per_pass: int) -> bool:
    """Have ``cache``'s recurrent layers keep their state after each of the last ``tokens_per_pass`` tokens of a
    pass (:data:`TOKEN_STATES`), so :func:`keep_fed` can put a layer back to any kept length without feeding the
    tokens again. Call it after the prefill (a prefill longer than ``tokens_per_pass`` would not be recorded
    whole). Returns whether the cache records them (False: no recurrent layers, or a transformers without it)."""
    recurrent = recurrent_layers(cache)
    if not recurrent or not TOKEN_STATES:
        return False
    for i in recurrent:
        cache.layers[i].activate_past_recording(recurrent_states_to_keep=tokens_per_pass)
    return True


def _recorded_layers(cache, fed: int) -> list | None:
    """The recurrent layers of ``cache`` that hold a state per token of the last pass of ``fed`` tokens (their
    history and convolution window complete), or None when any layer does not (then the snapshot is used)."""
    layers = []
    for i in recurrent_layers(cache):
        layer = cache.layers[i]
        if not getattr(layer, "record_past", False):
            return None
        for k in range(layer.number_of_states):
            conv = layer.conv_states.get(k)
            history = getattr(layer, "recurrent_states_history", {}).get(k)
            if conv is not None and conv.shape[-1] != layer.conv_kernel_size[k] + fed:
                return None
            if layer.is_recurrent_states_initialized.get(k) and (history is None or len(history) != fed):
                return None
        layers.append(layer)
    return layers


def _trim_records(cache) -> None:
    """Drop what recording layers keep of the last pass beyond their current state (``crop(0)``: the convolution
    window back to its kernel, the per-token history emptied)."""
    for i in recurrent_layers(cache):
        layer = cache.layers[i]
        if getattr(layer, "record_past", False) and all(layer.is_conv_states_initialized.values()):
            layer.crop(0)


def keep_fed(verifier, cache, fed: torch.Tensor, keep: int, snapshot: StateSnapshot | None) -> bool:
    """After a pass that fed ``fed [m]`` tokens onto a cache of ``P`` tokens, keep only the first ``keep`` of them.

    Attention-only caches are cropped to ``P + keep``. A cache with recurrent layers, whose state after the pass
    has read all m tokens, is put back to the state after the ``keep`` tokens: from the per-token states the
    layers recorded in the pass (:func:`record_token_states`; each layer's own ``crop``), else to ``snapshot``
    (taken at P, before the pass) and the ``keep`` tokens fed again from there (:func:`state_pass`: snapshot and
    recompute). Either way the state is the state after exactly those tokens.

    Returns:
        Whether the kept tokens were fed again.

    Raises:
        ValueError: a cache with recurrent layers, no per-token states and no snapshot.
    """
    m = int(fed.numel())
    assert 0 <= keep <= m, (keep, m)
    remove = m - keep
    recorded = _recorded_layers(cache, m) if recurrent_layers(cache) else None
    if recorded is not None:
        for layer in recorded:
            layer.crop(-remove)  # the state after token keep; crop(0) trims the records of the pass
        if remove:
            for i, layer in enumerate(cache.layers):
                if i not in recurrent_layers(cache) and isinstance(getattr(layer, "keys", None), torch.Tensor):
                    layer.crop(-remove)
        return False
    if remove == 0:
        _trim_records(cache)
        return False
    if snapshot is None:
        if recurrent_layers(cache):
            raise ValueError("a cache with recurrent layers needs the snapshot taken before the pass")
        crop_cache(cache, cache.get_seq_length() - remove)
        return False
    crop_cache(cache, snapshot.tokens, snapshot)
    if keep > 0:
        state_pass(verifier, fed[:keep], cache)
    _trim_records(cache)
    return True


def state_pass(verifier, ids: torch.Tensor, cache) -> None:
    """Feed ``ids [n]`` after the cached tokens only to advance the cache (no lm_head, no hidden states kept)."""
    device = next(verifier.parameters()).device
    body = getattr(verifier, "base_model", None)
    if body is None or body is verifier:
        verifier_pass(verifier, ids, cache, want_hidden=False, last_only=True)
        return
    body(input_ids=ids.to(device)[None], use_cache=True, **{cache_kwarg(body): cache})


def verifier_pass(verifier, ids: torch.Tensor, cache, want_hidden: bool, last_only: bool = False,
                  extra: dict | None = None):
    """Feed ``ids [n]`` after the cached tokens; ``extra``: more keyword arguments of the model's forward
    (tree verification's ``attention_mask`` and ``position_ids``, :mod:`peagle_train.generate.tree`).

    Returns:
        (logits ``[n, V]`` float on CPU, or ``[1, V]`` with ``last_only``; hidden_states or None).
    """
    device = next(verifier.parameters()).device
    kwargs = {cache_kwarg(verifier): cache}
    if last_only and "logits_to_keep" in inspect.signature(verifier.forward).parameters:
        kwargs["logits_to_keep"] = 1  # a prefill needs one row of the V-wide lm_head, not P
    out = verifier(input_ids=ids.to(device)[None], use_cache=True, output_hidden_states=want_hidden, **kwargs,
                   **(extra or {}))
    logits = out.logits[0, -1:] if last_only else out.logits[0]
    return logits.float().cpu(), (out.hidden_states if want_hidden else None)


def verifier_body_pass(verifier, ids: torch.Tensor, cache, extra: dict | None = None):
    """Feed ``ids [n]`` through the verifier without its lm_head (``extra``: as :func:`verifier_pass`).

    Returns:
        (logits ``[n, V]`` float32 on CPU from :func:`lm_head_logits`, hidden_states); falls back
        to the full forward for models whose logits are more than ``lm_head(last hidden state)``.
    """
    lm_head = verifier.get_output_embeddings()
    body = getattr(verifier, "base_model", None)
    if lm_head is None or body is None or body is verifier or not LogitTransform.from_config(verifier.config.get_text_config()).identity:
        logits, hs = verifier_pass(verifier, ids, cache, want_hidden=True, extra=extra)
        return logits, hs
    device = next(verifier.parameters()).device
    out = body(input_ids=ids.to(device)[None], use_cache=True, output_hidden_states=True,
               **{cache_kwarg(body): cache}, **(extra or {}))
    return lm_head_logits(lm_head, out.last_hidden_state[0]), out.hidden_states


def decoder_layers(verifier) -> torch.nn.ModuleList:
    """The decoder layers of ``verifier`` (a causal LM, or a multimodal wrapper's language model).

    Raises:
        InputError: no ``layers`` list found.
    """
    base = getattr(verifier, "base_model", verifier)
    for module in (getattr(base, "language_model", None), base, getattr(base, "model", None)):
        if module is not None and isinstance(getattr(module, "layers", None), torch.nn.ModuleList):
            return module.layers
    raise InputError(f"{type(verifier).__name__}: no decoder layers found", field="--verifier")


@contextmanager
def aux_hidden_states(verifier) -> Iterator[dict[str, torch.Tensor]]:
    """While active, ``out["last"]`` holds the last decoder layer's output of the newest pass
    (``[1, n, H]``, before the final norm): aux layer ``L`` as vLLM feeds it to a drafter
    (docs/design.md §7), which Hugging Face's ``hidden_states[L]`` (after the final norm) is not."""
    out: dict[str, torch.Tensor] = {}

    def keep(module, args, output):
        out["last"] = output[0] if isinstance(output, tuple) else output

    hook = decoder_layers(verifier)[-1].register_forward_hook(keep)
    try:
        yield out
    finally:
        hook.remove()
