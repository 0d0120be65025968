"""Character spans -> token loss mask, for a row tokenized with offsets, and the checks that the mask is exact.

A token is supervised when it starts inside its turn's span, up to the span's end-of-turn token (the last
special/added token in it; a span with none, or a cut reply, is supervised whole). A token across a span's
boundary (:func:`straddling_token`) or a last special token followed by more of the reply
(:func:`unclear_end_of_turn`) makes the row a reject (docs/design.md §3).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from peagle_data.chat.render import RenderedRow

__all__ = ["MaskedRow", "REPLY_STARTS_INSIDE", "special_ids", "row_masks", "straddling_token", "unclear_end_of_turn",
           "span_tokens"]

REPLY_STARTS_INSIDE = "reply starts inside a token"
"""How :func:`straddling_token`'s reason begins for a token across a turn's start (served, the prompt ends
before it: the row is built in pieces, :func:`~peagle_data.chat.served.served_pieces`)."""


@dataclass
class MaskedRow:
    """A row tokenized with its loss mask, before :func:`~peagle_data.chat.generated_ids.on_generated_ids`.

    ``ids`` int32 ``[T]``, ``offsets`` int64 ``[T, 2]`` characters, ``loss_mask`` uint8 ``[T]``, ``system_len``
    tokens, ``problem`` the reject reason or None, ``pieces`` 1 when built as served (in pieces), else 0."""

    ids: np.ndarray
    offsets: np.ndarray
    loss_mask: np.ndarray
    system_len: int
    problem: str | None
    pieces: int = 0


def special_ids(tokenizer) -> frozenset[int]:
    # Cached on the tokenizer, keyed by its size: adding tokens (or a deep copy that does) refreshes it.
    size = len(tokenizer)
    cached = getattr(tokenizer, "_peagle_special_ids", None)
    if cached is None or cached[0] != size:
        ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids.update(getattr(tokenizer, "added_tokens_decoder", {}).keys())
        cached = (size, frozenset(ids))
        try:
            tokenizer._peagle_special_ids = cached
        except AttributeError:
            pass
    return cached[1]


def row_masks(row: RenderedRow, ids: np.ndarray, offsets: np.ndarray,
               special: frozenset[int]) -> tuple[np.ndarray, int]:
    """``(loss_mask uint8 [T], system_len)`` of ``row`` tokenized as ``ids`` / ``offsets`` (step 3)."""
    loss_mask = _mask_from_spans(ids, offsets[:, 0], list(row.spans), special, frozenset(row.cut))
    if row.empty_think:
        loss_mask[_mask_from_spans(ids, offsets[:, 0], list(row.empty_think), frozenset()) == 1] = 0
    system_len = int(np.searchsorted(offsets[:, 1], row.prefix_chars, side="right"))
    supervised = np.flatnonzero(loss_mask)
    if supervised.size:
        system_len = min(system_len, int(supervised[0]))
    return loss_mask, system_len


def straddling_token(row: RenderedRow, offsets: np.ndarray, loss_mask: np.ndarray) -> str | None:
    """Why a supervised span of ``row`` has no exact mask, or None.

    A token that starts before a span and ends inside it (a generation prompt ending in a space,
    ``"ASSISTANT: "``, gives ``" Hello"``; reason :data:`REPLY_STARTS_INSIDE`), or a supervised token that ends
    past its span, has no exact mask. Only straddles whose part across the boundary holds non-whitespace
    count (a merged ``"\n\n"`` loses or adds only whitespace).

    Args:
        offsets: int64 ``[T, 2]`` character ``[start, end)`` of every token in ``row.text``.
        loss_mask: uint8 ``[T]`` built from ``row.spans``.
    """
    starts, ends = offsets[:, 0], offsets[:, 1]
    text = row.text
    for a, b in row.spans:
        i = int(np.searchsorted(starts, a, side="left")) - 1  # the last token starting before the span
        if i >= 0 and ends[i] > a and text[a:min(int(ends[i]), b)].strip():
            return (f"{REPLY_STARTS_INSIDE}: {text[int(starts[i]):int(ends[i])]!r} holds "
                    f"{text[int(starts[i]):a]!r} rendered before an assistant reply (the generation prompt's end or "
                    f"the previous message's) and {text[a:int(ends[i])]!r} of the reply, so the reply's first token "
                    "has no exact mask (a generation prompt that ends in a space does this); pass --chat-template "
                    "FILE with a generation prompt that ends where a token ends")
        lo, hi = int(np.searchsorted(starts, a, side="left")), int(np.searchsorted(starts, b, side="left"))
        inside = np.flatnonzero(loss_mask[lo:hi])
        t = lo + int(inside[-1]) if inside.size else -1
        if t >= 0 and ends[t] > b and text[b:int(ends[t])].strip():
            return (f"a supervised token ends past its assistant turn: {text[int(starts[t]):int(ends[t])]!r} "
                    f"holds {text[b:int(ends[t])]!r} of what follows the turn, so the turn has no exact mask; pass "
                    "--chat-template FILE with a template that ends assistant turns with an end-of-turn token")
    return None


def unclear_end_of_turn(row: RenderedRow, ids: np.ndarray, offsets: np.ndarray,
                         special: frozenset[int]) -> str | None:
    """Why a supervised span has no exact end, or None: its last special/added token (where
    :func:`_mask_from_spans` ends the mask) is followed by more than whitespace inside the span, so it is a
    token of the reply itself (``"a <file_sep> b"``) under a template that ends turns without one."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    text = row.text
    for k, (a, b) in enumerate(row.spans):
        if k in row.cut:  # ends with the reply's own text
            continue
        lo, hi = int(np.searchsorted(starts, a, side="left")), int(np.searchsorted(starts, b, side="left"))
        last = next((t for t in range(hi - 1, lo - 1, -1) if int(ids[t]) in special), None)
        if last is not None and text[int(ends[last]):b].strip():
            return (f"no end-of-turn token ends an assistant turn: its last special token "
                    f"{text[int(starts[last]):int(ends[last])]!r} is followed by {text[int(ends[last]):b][:40]!r} "
                    "inside the turn, so it is part of the reply and the turn has no exact mask; pass "
                    "--chat-template FILE with a template that ends assistant turns with an end-of-turn token")
    return None


def span_tokens(ids: np.ndarray, starts: np.ndarray, a: int, b: int, special: frozenset[int],
                 cut: bool) -> tuple[int, int]:
    """Tokens ``[lo, end)`` of the span ``[a, b)`` characters: those starting in it, up to and
    including its last special token (all of them when ``cut``: a reply cut at a token limit)."""
    lo = int(np.searchsorted(starts, a, side="left"))
    hi = int(np.searchsorted(starts, b, side="left"))  # tokens [lo, hi) start in [a, b)
    if not cut:
        for t in range(hi - 1, lo - 1, -1):
            if int(ids[t]) in special:
                return lo, t + 1
    return lo, max(hi, lo)


def _mask_from_spans(ids: np.ndarray, starts: np.ndarray, spans: list[tuple[int, int]],
                     special: frozenset[int], cut: frozenset[int] = frozenset()) -> np.ndarray:
    """uint8 ``[T]``: 1 for tokens starting in a span, up to and including its last special token
    (all of them for the spans whose position is in ``cut``: replies cut at a token limit, whose span
    already ends with the reply's text)."""
    mask = np.zeros(len(ids), dtype=np.uint8)
    for k, (a, b) in enumerate(spans):
        lo, end = span_tokens(ids, starts, a, b, special, k in cut)
        mask[lo:end] = 1
    return mask
