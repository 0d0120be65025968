"""Exact deduplication and length filters for ``peagle-data tokenize`` and ``pack``.

Deduplication keys a conversation by a 16-byte BLAKE2b digest of its normalised messages and
tools (:class:`peagle_data.readers.rows.Conversation` after the reader's normalisation: roles mapped,
user turns merged, leading assistant turns dropped; with the chat-template variables a row records,
``regenerate``'s per-row mode), serialised as canonical JSON (sorted keys,
no whitespace). The first occurrence in input order is kept; every later one is rejected as
``duplicate: ...`` with ``duplicate_of`` naming the kept row's ``file:N``. Tokenize outputs given
to ``pack`` are keyed by their rows' token ids and loss masks instead. Memory: one digest and one
``file:N`` string per distinct conversation.

Filters reject a whole conversation (all its rows when a history-rewriting template split it)
after tokenization: ``--max-tokens N`` when its tokens exceed N, ``--min-loss-tokens N`` when its
supervised tokens are fewer than N. A conversation's tokens are its longest row's: the whole render,
or for a split conversation the row of its last assistant turn, which holds the whole history (the
rows repeat the history, so their sum is not a length); its supervised tokens are summed over its
rows (each row supervises its own turn). The reason keys (``too long``, ``too few supervised tokens``)
are counted per key in the manifest's ``rejected_by_reason``.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from peagle_data.readers.rows import Conversation, Reject
from stores.tables.token_rows import TokenizedRow

__all__ = ["DUPLICATE", "Duplicate", "Deduplicator", "conversation_key", "rows_key", "copy_key", "dedup_items",
           "filter_reason"]

DUPLICATE = "duplicate"
"""Reason key of a duplicate in rejects.jsonl and ``rejected_by_reason``."""


@dataclass
class Duplicate(Reject):
    """A row dropped as an exact duplicate; ``duplicate_of`` is the kept row's ``file:N``."""

    duplicate_of: str | None = None
    key: bytes | None = None
    """The content digest it shares with the kept row (shards place both alike)."""


def conversation_key(conv: Conversation) -> bytes:
    """16-byte digest of a conversation's normalised messages and tools (canonical JSON), and of the
    chat-template variables it records (``chat_template_kwargs``, only when it records some: the same
    messages in another mode render another training row, so they are no duplicate)."""
    record = {"messages": conv.messages, "tools": conv.tools,
              **({"chat_template_kwargs": conv.chat_template_kwargs} if conv.chat_template_kwargs else {})}
    text = json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def rows_key(rows: Iterable[TokenizedRow]) -> bytes:
    """16-byte digest of tokenized rows' ``input_ids`` and ``loss_mask`` (a tokenize output's conversation)."""
    h = hashlib.blake2b(digest_size=16)
    for row in rows:
        ids = np.ascontiguousarray(row.input_ids, dtype=np.int32)
        h.update(len(ids).to_bytes(8, "little"))
        h.update(ids.tobytes())
        h.update(np.ascontiguousarray(row.loss_mask, dtype=np.uint8).tobytes())
    return h.digest()


class Deduplicator:
    """Remembers the first ``file:N`` of every key seen."""

    def __init__(self) -> None:
        self._first: dict[bytes, str] = {}

    def first_of(self, key: bytes, source: str) -> str | None:
        """The source that first had ``key``, or None (and ``source`` is remembered) when new."""
        first = self._first.get(key)
        if first is None:
            self._first[key] = source
        return first

    def __len__(self) -> int:
        return len(self._first)


def duplicate_reject(conv_id: str | None, source: str, first: str, renamed: int = 0,
                     key: bytes | None = None) -> Duplicate:
    """The :class:`Duplicate` reject of ``source``, whose content (digest ``key``) equals that of ``first``."""
    return Duplicate(source=source, reason=f"{DUPLICATE}: same messages as {first}", conversation_id=conv_id,
                     duplicate_id_renamed=renamed, duplicate_of=first, key=key)


_COPY = re.compile(r":\d+\*(\d+)$")
"""The ``file:N*k`` source of copy k >= 2 of a row (a mixture weight above 1)."""


def copy_key(key: bytes, source: str) -> bytes:
    """The deduplication key of a row with content digest ``key`` from ``source``: copy k >= 2 of a
    row (``file:N*k``, a mixture weight above 1) is keyed apart, a duplicate only of an earlier copy k."""
    copy = _COPY.search(source)
    return key + copy.group(1).encode() if copy else key


def dedup_items(items: Iterable[Conversation | Reject], dedup: Deduplicator | None
                ) -> Iterator[Conversation | Reject]:
    """Pass reader items through, turning repeats of an earlier conversation into :class:`Duplicate`.

    Copy k >= 2 of a row (source ``file:N*k``, a mixture weight above 1) repeats only an earlier
    copy k: the copies a weight draws are not duplicates of each other.

    ``dedup`` None passes everything through (``--no-dedup``).
    """
    for item in items:
        if dedup is not None and isinstance(item, Conversation):
            key = conversation_key(item)
            first = dedup.first_of(copy_key(key, item.source), item.source)
            if first is not None:
                item = duplicate_reject(item.conversation_id, item.source, first, item.duplicate_id_renamed, key)
        yield item


def filter_reason(n_tokens: int, n_loss_tokens: int, max_tokens: int | None,
                  min_loss_tokens: int | None) -> str | None:
    """Why a conversation of ``n_tokens`` tokens (its longest row), ``n_loss_tokens`` supervised (summed
    over its rows), is filtered out, or None."""
    if max_tokens is not None and n_tokens > max_tokens:
        return f"too long: {n_tokens} tokens > --max-tokens {max_tokens}"
    if min_loss_tokens is not None and n_loss_tokens < min_loss_tokens:
        return f"too few supervised tokens: {n_loss_tokens} < --min-loss-tokens {min_loss_tokens}"
    return None
