"""The verifier's side of speculative decoding: its passes, its lm_head, and a KV cache that can be
cut back after rejected drafts (:mod:`peagle_train.evaluate.speculative`).

Legend: n tokens fed in one pass, H verifier hidden size, V verifier vocab.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Iterator

import torch

from peagle_train.train.loss import LogitTransform
from stores.errors import InputError

__all__ = ["new_cache", "rollback_cache", "crop_cache", "verifier_pass", "verifier_body_pass", "lm_head_logits",
           "decoder_layers", "aux_hidden_states"]


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
    from transformers import DynamicCache

    try:
        return DynamicCache(config=verifier.config)
    except TypeError:  # older transformers
        return DynamicCache()


def rollback_cache(verifier):
    """A KV cache that :func:`crop_cache` can cut back exactly, for speculative decoding.

    The verifier's own cache with every sliding-window (or chunked) layer replaced by a full layer:
    those layers then keep all keys and values, and the model still masks them by its window (its
    masks are built from positions over the full key length), so the outputs equal the model's own
    and a rejected draft's keys can be dropped (a sliding layer that has shifted its window cannot
    give back the keys it evicted).

    Raises:
        InputError: a cache layer holding recurrent state (linear attention, state-space, convolution),
            which cannot be cut back to an earlier token.
    """
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = new_cache(verifier)
    layers = getattr(cache, "layers", None) or []
    for i, layer in enumerate(layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            layers[i] = DynamicLayer()
        elif type(layer) is not DynamicLayer and "Dummy" not in type(layer).__name__:
            raise InputError(f"the verifier's cache layer {i} is a {type(layer).__name__}: its state cannot be cut "
                             "back after a rejected draft, so speculative decoding would not be exact; peagle "
                             "supports verifiers whose layers are full, sliding-window or chunked attention",
                             field="--verifier")
    return cache


def cache_kwarg(verifier) -> str:
    """transformers ≥ 5.x names the cache argument ``cache``; earlier versions ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(verifier.forward).parameters else "past_key_values"


def crop_cache(cache, keep_tokens: int) -> None:
    """Cut ``cache`` back to its first ``keep_tokens`` tokens (negative ``crop`` = tokens to remove)."""
    remove = cache.get_seq_length() - keep_tokens
    assert remove >= 0, (cache.get_seq_length(), keep_tokens)
    if remove > 0:
        cache.crop(-remove)


def verifier_pass(verifier, ids: torch.Tensor, cache, want_hidden: bool, last_only: bool = False,
                  extra: dict | None = None):
    """Feed ``ids [n]`` after the cached tokens; ``extra``: more keyword arguments of the model's forward
    (tree verification's ``attention_mask`` and ``position_ids``, :mod:`peagle_train.evaluate.tree`).

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
