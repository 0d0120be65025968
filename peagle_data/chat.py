"""Chat templates and loss masks (DESIGN.md §3) on any template, without ``{% generation %}`` tags.

Method, for one conversation of T tokens:

1. Render the whole conversation once as text (``apply_chat_template(..., tokenize=False)``).
2. For every assistant turn i, render ``messages[:i]`` with the generation prompt (``P_i``) and
   ``messages[:i+1]`` (``Q_i``). Both must be string prefixes of the full render, else the
   template rewrites history (it renders earlier turns differently once later turns exist) and
   the row is rejected with "template rewrites history": a mask is never guessed.
   The assistant's span is the characters ``[len(P_i), len(Q_i))``: what the verifier generates
   after the generation prompt, as rendered (content, reasoning, tool-call text), and whatever
   the template appends to close the turn.
3. Tokenize the full text once with offsets. A token is supervised (mask 1) when it starts inside
   the span and no later than the span's end-of-turn token, the last special/added token in the
   span (``<|im_end|>`` in ChatML). What follows the end-of-turn token inside the span (ChatML's
   trailing ``"\\n"``) is template glue the verifier never generates: mask 0. A span with no
   special token is supervised whole.
4. The token ids must equal ``apply_chat_template(messages, tokenize=True)``; a mismatch rejects
   the row.

``system_len`` is the number of leading tokens that form the system prefix (BOS, the system turn,
or the default system text a template injects): the common prefix of two renders of the
conversation's system messages plus a first user turn with different sentinel contents, minus the
user-turn header (what a second user turn adds before its content).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from stores.errors import InputError

__all__ = ["ChatTemplateError", "TokenizedConversation", "tokenize_conversation", "system_prefix_text",
           "chat_template_sha256",
           "effective_chat_template"]

_SENTINELS = ("Q7Xz sentinel alpha", "K3Jw sentinel beta")


class ChatTemplateError(InputError):
    """A conversation cannot be rendered or masked exactly with this chat template (a reject reason)."""


@dataclass(frozen=True)
class TokenizedConversation:
    """One conversation as tokens.

    Attributes:
        input_ids: int32 ``[T]``, identical to ``apply_chat_template(messages, tokenize=True)``.
        loss_mask: uint8 ``[T]``, 1 on assistant tokens as rendered and their end-of-turn token.
        system_len: leading tokens that form the system prefix (loss 0), ``0 <= system_len <= T``.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    system_len: int


def effective_chat_template(tokenizer, chat_template: str | None = None) -> str:
    """The template text actually used (the override, else the tokenizer's own).

    Raises:
        InputError: the tokenizer has no chat template and none is given.
    """
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if template is None:
        raise InputError("the tokenizer has no chat template; pass one with --chat-template FILE")
    return template if isinstance(template, str) else json.dumps(template, sort_keys=True)


def chat_template_sha256(tokenizer, chat_template: str | None = None) -> str:
    """sha256 hex digest of the effective chat template text (recorded in manifests)."""
    import hashlib

    return hashlib.sha256(effective_chat_template(tokenizer, chat_template).encode("utf-8")).hexdigest()


def _render(tokenizer, messages, tools, chat_template, add_generation_prompt=False) -> str:
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if tools is not None:
        kwargs["tools"] = tools
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    try:
        if not messages:  # apply_chat_template refuses an empty history; the renderer does not
            from transformers.utils.chat_template_utils import render_jinja_template

            rendered, _ = render_jinja_template(
                conversations=[[]], tools=tools, chat_template=tokenizer.get_chat_template(chat_template, tools),
                add_generation_prompt=add_generation_prompt, **tokenizer.special_tokens_map)
            return rendered[0]
        return tokenizer.apply_chat_template(list(messages), **kwargs)
    except Exception as e:  # jinja errors, raise_exception() in templates, type errors on content
        raise ChatTemplateError(f"template error: {type(e).__name__}: {e}") from None


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _special_ids(tokenizer) -> frozenset[int]:
    cached = getattr(tokenizer, "_peagle_special_ids", None)
    if cached is None:
        ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids.update(getattr(tokenizer, "added_tokens_decoder", {}).keys())
        cached = frozenset(ids)
        try:
            tokenizer._peagle_special_ids = cached
        except AttributeError:
            pass
    return cached


def system_prefix_text(tokenizer, system_messages: Sequence[dict[str, Any]], tools=None,
                       chat_template: str | None = None) -> str:
    """Text of the system prefix the template renders for these leading system messages.

    Returns the common prefix of ``render(system + [user S1])`` and ``render(system + [user S2])``
    with the user-turn header stripped when it ends that prefix (templates that put the system
    text inside the first user turn, like Gemma, keep the header: it belongs to the prefix).
    """
    system_messages = list(system_messages)
    r1 = _render(tokenizer, system_messages + [{"role": "user", "content": _SENTINELS[0]}], tools, chat_template)
    r2 = _render(tokenizer, system_messages + [{"role": "user", "content": _SENTINELS[1]}], tools, chat_template)
    prefix = r1[:_common_prefix_len(r1, r2)]
    # The user-turn header: what a second user turn adds before its content.
    base_msgs = system_messages + [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    try:
        base = _render(tokenizer, base_msgs, tools, chat_template)
        h1 = _render(tokenizer, base_msgs + [{"role": "user", "content": _SENTINELS[0]}], tools, chat_template)
        h2 = _render(tokenizer, base_msgs + [{"role": "user", "content": _SENTINELS[1]}], tools, chat_template)
    except ChatTemplateError:
        return prefix
    if h1.startswith(base):
        header = h1[len(base):_common_prefix_len(h1, h2)]
        if header and prefix.endswith(header):
            prefix = prefix[: len(prefix) - len(header)]
    return prefix


_PREFIX_CACHE_MAX = 256


def _cached_system_prefix(tokenizer, system_messages, tools, chat_template) -> str:
    cache = getattr(tokenizer, "_peagle_prefix_cache", None)
    if cache is None:
        cache = {}
        try:
            tokenizer._peagle_prefix_cache = cache
        except AttributeError:
            pass
    key = json.dumps([system_messages, tools, chat_template], sort_keys=True, default=str)
    if key not in cache:
        if len(cache) >= _PREFIX_CACHE_MAX:
            cache.clear()
        cache[key] = system_prefix_text(tokenizer, system_messages, tools, chat_template)
    return cache[key]


def tokenize_conversation(tokenizer, messages: Sequence[dict[str, Any]], tools: list | None = None,
                          chat_template: str | None = None) -> TokenizedConversation:
    """Tokenize one conversation with its chat template and find its loss mask and system prefix.

    Args:
        tokenizer: a fast Hugging Face tokenizer (offsets are needed).
        messages: OpenAI messages (``role`` in system/user/assistant/tool), at least one assistant.
        tools: tool definitions passed to the template, or None.
        chat_template: template text overriding ``tokenizer.chat_template``, or None.

    Returns:
        A :class:`TokenizedConversation` (``input_ids`` int32 ``[T]``, ``loss_mask`` uint8 ``[T]``,
        ``system_len``).

    Raises:
        ChatTemplateError: the template fails on the messages ("template error"), rewrites earlier
            turns once later ones exist ("template rewrites history"), or its token ids differ from
            a plain tokenization of the rendered text ("token mismatch").
        InputError: the tokenizer has no chat template or is not a fast tokenizer.
    """
    messages = list(messages)
    full = _render(tokenizer, messages, tools, chat_template)
    spans: list[tuple[int, int]] = []
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], tools, chat_template, add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1], tools, chat_template)
        if not (full.startswith(before) and full.startswith(through) and len(through) >= len(before)):
            raise ChatTemplateError(
                f"template rewrites history: the render up to assistant turn {i} is not a prefix of "
                "the whole conversation's render")
        spans.append((len(before), len(through)))

    if not getattr(tokenizer, "is_fast", False):
        raise InputError("loss masks need a fast tokenizer (offset mapping); this one is not")
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int32)
    offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)  # [T, 2] chars

    kwargs: dict[str, Any] = {"tokenize": True, "return_dict": False}
    if tools is not None:
        kwargs["tools"] = tools
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    reference = tokenizer.apply_chat_template(messages, **kwargs)
    if len(reference) != len(ids) or not np.array_equal(np.asarray(reference, dtype=np.int32), ids):
        raise ChatTemplateError(
            f"token mismatch: tokenizing the rendered text gives {len(ids)} tokens, "
            f"apply_chat_template gives {len(reference)}")

    loss_mask = _mask_from_spans(ids, offsets[:, 0], spans, _special_ids(tokenizer))

    system_msgs = []
    for m in messages:
        if m.get("role") != "system":
            break
        system_msgs.append(m)
    prefix = _cached_system_prefix(tokenizer, system_msgs, tools, chat_template)
    prefix_chars = _common_prefix_len(prefix, full[: len(prefix)])
    system_len = int(np.searchsorted(offsets[:, 1], prefix_chars, side="right"))
    supervised = np.flatnonzero(loss_mask)
    if supervised.size:
        system_len = min(system_len, int(supervised[0]))
    return TokenizedConversation(input_ids=ids, loss_mask=loss_mask, system_len=system_len)


def _mask_from_spans(ids: np.ndarray, starts: np.ndarray, spans: list[tuple[int, int]],
                     special: frozenset[int]) -> np.ndarray:
    """uint8 ``[T]``: 1 for tokens starting in a span, up to and including its last special token."""
    mask = np.zeros(len(ids), dtype=np.uint8)
    for a, b in spans:
        lo = int(np.searchsorted(starts, a, side="left"))
        hi = int(np.searchsorted(starts, b, side="left"))  # tokens [lo, hi) start in [a, b)
        if hi <= lo:
            continue
        end = hi
        for t in range(hi - 1, lo - 1, -1):
            if int(ids[t]) in special:
                end = t + 1
                break
        mask[lo:end] = 1
    return mask
