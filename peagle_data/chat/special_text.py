"""Special-token text written inside a supervised reply (``<|im_end|>`` in an answer about ChatML): found, and the
reject reason (docs/design.md §3)."""

from __future__ import annotations

import json
import re
from typing import Sequence

from runtime.chat.chat_template import content_texts

__all__ = ["special_token_text", "special_text_reason"]

def _special_texts(tokenizer) -> tuple[re.Pattern | None, dict[str, int]]:
    """A pattern matching the text of every special token of ``tokenizer`` (``all_special_tokens`` and
    the added tokens marked special), longest first, and each text's id; cached on the tokenizer, keyed
    by its size."""
    size = len(tokenizer)
    cached = getattr(tokenizer, "_peagle_special_texts", None)
    if cached is not None and cached[0] == size:
        return cached[1]
    ids: dict[str, int] = {}
    read_as_text = getattr(tokenizer, "split_special_tokens", False)  # then special text tokenizes as text
    for i, added in ([] if read_as_text else sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())):
        if getattr(added, "special", False) and str(added):
            ids.setdefault(str(added), int(i))
    for token in [] if read_as_text else getattr(tokenizer, "all_special_tokens", []) or []:
        if token and token not in ids:
            ids[token] = int(tokenizer.convert_tokens_to_ids(token))
    pattern = re.compile("|".join(re.escape(t) for t in sorted(ids, key=len, reverse=True))) if ids else None
    try:
        tokenizer._peagle_special_texts = (size, (pattern, ids))
    except AttributeError:
        pass
    return pattern, ids


def special_token_text(tokenizer, messages, indices: Sequence[int]) -> list[tuple[int, str, str]]:
    """Special-token text written inside the supervised replies ``indices`` of ``messages``.

    Which text counts (docs/design.md §3): the text of a special token of the tokenizer (``all_special_tokens``,
    added tokens marked special: ``<|im_end|>``, ``<file_sep>``, ``<s>``; not ``<think>``, ``<tool_call>``) in an
    assistant message's content parts, ``reasoning_content`` or tool calls (their JSON), which the tokenizer reads
    as the control id. A turn that carries its generated ``token_ids`` is not checked
    (:func:`~peagle_data.chat.generated_ids.on_generated_ids` checks it).

    Returns:
        ``[(message index, part, token text)]``, part ``content``, ``reasoning_content`` or ``tool_calls``.
    """
    pattern, _ = _special_texts(tokenizer)
    if pattern is None:
        return []
    found = []
    for i in indices:
        msg = messages[i]
        if msg.get("token_ids") is not None:
            continue
        parts = [("content", t) for t in content_texts(msg.get("content"))]
        parts.append(("reasoning_content", str(msg.get("reasoning_content") or "")))
        if msg.get("tool_calls"):
            parts.append(("tool_calls", json.dumps(msg["tool_calls"], ensure_ascii=False)))
        for part, text in parts:
            m = pattern.search(text)
            if m:
                found.append((i, part, m.group(0)))
                break
    return found


def special_text_reason(tokenizer, found: list[tuple[int, str, str]]) -> str:
    """The reject reason of :func:`special_token_text`'s ``found`` (non-empty), naming the first."""
    i, part, token = found[0]
    _, ids = _special_texts(tokenizer)
    more = f" ({len(found)} replies in this row)" if len(found) > 1 else ""
    return (f"special-token text in a reply: the {part} of assistant message {i} writes {token!r}{more}, which the "
            f"tokenizer reads as the special token id {ids.get(token)}, not as text, so the row would supervise a "
            "control token inside the reply (the verifier never generates it there); pass --on-special-token-text "
            "keep to keep such rows as the tokenizer reads them (counted as conversations_with_special_token_text), "
            "or remove the text")
