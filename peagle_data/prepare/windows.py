"""Windows (docs/design.md §5): cut a tokenized conversation into pieces of at most ``max_seq_len`` tokens.

Pure functions over arrays. Legend: ``T`` tokens in the conversation, ``W`` = ``max_seq_len``,
``P`` the system prefix (the first ``system_len`` tokens), ``B = W - len(P)`` body tokens per window.
``T <= W``: one window. ``T > W``: every window is ``P + piece`` of exactly W tokens, pieces starting every
``ceil(B * (1 - overlap))`` body tokens and the last aligned to the body's end; ``overlap_loss="skip"`` gives a
token an earlier window covered loss 0, and makes the last window trimmable (:func:`trim_window`, used by
:func:`peagle_data.prepare.packing.pack_blocks_flexible`). A window with no supervised token is dropped
(the caller counts ``count_windows(...) - len(windows)``); ``Window.index`` counts all candidate windows, so ids
``conversation_id#index`` are stable. Position ids restart at 0 in every window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from stores.errors import InputError

__all__ = ["OVERLAP_LOSS", "MIN_TAIL_CONTEXT_FRACTION", "Window", "SystemPrefixTooLongError", "window_starts", "count_windows",
           "make_windows", "conversation_windows", "trim_window"]

OVERLAP_LOSS = ("skip", "keep")

MIN_TAIL_CONTEXT_FRACTION = 0.125
"""The packer may cut the aligned last window of a long conversation (``skip``) down to this
fraction of a window's body (B) of already-supervised context before its first newly supervised
token (253 tokens at W = 2048 with SmolLM2's 21-token default system prefix)."""


class SystemPrefixTooLongError(InputError):
    """The system prefix leaves no room for a body in a window (a reject reason for that conversation)."""


@dataclass(frozen=True)
class Window:
    """One window of a conversation.

    Attributes:
        input_ids: int32 ``[n]``, ``n <= max_seq_len``.
        loss_mask: uint8 ``[n]``.
        position_ids: int32 ``[n]``, ``0..n-1``.
        index: the window's place among the conversation's candidate windows (0-based).
        body_start: offset of the window's first body token from the body's start (the
            conversation token ``system_len + body_start``; 0 for a conversation that fits whole).
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    position_ids: np.ndarray
    index: int
    body_start: int
    trimmable: int = 0
    """Body tokens at the front of the piece that may be cut (the aligned last window of a long
    conversation with ``skip``: already supervised by an earlier window, all at loss 0). The packer
    may shorten the window by up to this many tokens to fill a block exactly."""
    prefix_len: int = 0
    """Tokens of the system prefix P at the window's start (kept when the window is trimmed)."""

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def _check(n_tokens: int, system_len: int, max_seq_len: int, overlap: float) -> None:
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if not 0.0 <= overlap < 1.0:
        raise ValueError(f"overlap must be in [0, 1), got {overlap}")
    if not 0 <= system_len <= n_tokens:
        raise ValueError(f"system_len {system_len} outside [0, {n_tokens}]")


def window_starts(n_tokens: int, system_len: int, max_seq_len: int, overlap: float = 0.5) -> list[int]:
    """Body offsets (relative to the body start) of every candidate window's piece.

    Returns ``[0]`` for a conversation of at most ``max_seq_len`` tokens.

    Raises:
        SystemPrefixTooLongError: ``n_tokens > max_seq_len`` and ``system_len >= max_seq_len``.
        ValueError: arguments out of range.
    """
    _check(n_tokens, system_len, max_seq_len, overlap)
    if n_tokens <= max_seq_len:
        return [0]
    body_per_window = max_seq_len - system_len
    if body_per_window < 1:
        raise SystemPrefixTooLongError(
            f"system prefix too long: {system_len} tokens leave no room for a body in a window of "
            f"{max_seq_len} tokens; raise --max-seq-len or shorten the system prompt")
    body_len = n_tokens - system_len
    stride = _stride(body_per_window, overlap)
    n = math.ceil(max(body_len - body_per_window, 0) / stride) + 1
    # Regular starts k * stride for all pieces but the last; the last ends at the body's end
    # ((n - 2) * stride < body_len - B <= (n - 1) * stride, so starts stay strictly increasing).
    return [k * stride for k in range(n - 1)] + [body_len - body_per_window]


def _stride(body_per_window: int, overlap: float) -> int:
    return max(1, math.ceil(body_per_window * (1.0 - overlap) - 1e-9))


def count_windows(n_tokens: int, system_len: int, max_seq_len: int, overlap: float = 0.5) -> int:
    """Number of candidate windows (before dropping those without a supervised token)."""
    return len(window_starts(n_tokens, system_len, max_seq_len, overlap))


def make_windows(input_ids: np.ndarray, loss_mask: np.ndarray, system_len: int, max_seq_len: int,
                 overlap: float = 0.5, overlap_loss: str = "skip") -> list[Window]:
    """Cut one conversation into windows of at most ``max_seq_len`` tokens (docs/design.md §5).

    Args:
        input_ids: int ``[T]``.
        loss_mask: 0/1 ``[T]``.
        system_len: leading tokens of the system prefix P, repeated (with loss 0) in every window.
        max_seq_len: W, the most tokens in a window.
        overlap: fraction of a piece shared with the next one, in ``[0, 1)``.
        overlap_loss: ``"skip"`` (supervise every token once) or ``"keep"`` (overlap twice).

    Returns:
        The windows that hold at least one supervised token, in order.

    Raises:
        SystemPrefixTooLongError: the conversation is longer than W and P leaves no room for a body.
        ValueError: arguments out of range or arrays of different lengths.
    """
    ids = np.asarray(input_ids, dtype=np.int32)
    mask = np.asarray(loss_mask, dtype=np.uint8)
    if ids.shape != mask.shape or ids.ndim != 1:
        raise ValueError(f"input_ids {ids.shape} and loss_mask {mask.shape} must be equal 1-D shapes")
    if overlap_loss not in OVERLAP_LOSS:
        raise ValueError(f"overlap_loss must be one of {OVERLAP_LOSS}, got {overlap_loss!r}")
    n_tokens = int(ids.shape[0])
    starts = window_starts(n_tokens, system_len, max_seq_len, overlap)
    if n_tokens <= max_seq_len:
        if not mask.any():
            return []
        return [Window(ids.copy(), mask.copy(), np.arange(n_tokens, dtype=np.int32), 0, 0)]

    body_per_window = max_seq_len - system_len
    body_ids, body_mask = ids[system_len:], mask[system_len:]
    prefix_ids = ids[:system_len]
    windows: list[Window] = []
    covered = 0  # body tokens [0, covered) belong to an earlier window
    for k, s in enumerate(starts):
        e = min(s + body_per_window, body_ids.shape[0])
        piece_mask = body_mask[s:e].copy()
        if overlap_loss == "skip" and covered > s:
            piece_mask[: covered - s] = 0
        covered_before = covered
        covered = max(covered, e)
        prefix_mask = mask[:system_len] if k == 0 else np.zeros(system_len, dtype=np.uint8)
        w_mask = np.concatenate([prefix_mask, piece_mask])
        if not w_mask.any():
            continue
        w_ids = np.concatenate([prefix_ids, body_ids[s:e]])
        trimmable = 0
        if k == len(starts) - 1 and k > 0 and overlap_loss == "skip":
            # Everything before covered_before was in window k-1 (loss 0 here): context only. Keep
            # at least MIN_TAIL_CONTEXT_FRACTION * B of it before the first newly supervised token.
            min_context = int(MIN_TAIL_CONTEXT_FRACTION * body_per_window)
            trimmable = max(0, covered_before - min_context - s)
        windows.append(Window(w_ids, w_mask, np.arange(w_ids.shape[0], dtype=np.int32), k, s,
                              trimmable, system_len))
    return windows


def conversation_windows(rows, max_seq_len: int, overlap: float = 0.5,
                         overlap_loss: str = "skip") -> tuple[list[tuple[str, Window]], int, int]:
    """The windows of one conversation's tokenized rows (one row, or one per assistant turn).

    Args:
        rows: :class:`~stores.tables.token_rows.TokenizedRow` (``conversation_id``, ``input_ids``,
            ``loss_mask``, ``system_len`` are read).
        max_seq_len, overlap, overlap_loss: as in :func:`make_windows`.

    Returns:
        ``([(segment id "conversation_id#index", Window)], candidate windows dropped (no
        supervised token), candidate windows)``.

    Raises:
        SystemPrefixTooLongError: as :func:`make_windows`.
    """
    segments, dropped, candidates = [], 0, 0
    for row in rows:
        ids, mask, system_len = row.input_ids, row.loss_mask, int(row.system_len)
        n_candidates = count_windows(len(ids), system_len, max_seq_len, overlap)
        windows = make_windows(ids, mask, system_len, max_seq_len, overlap, overlap_loss)
        dropped += n_candidates - len(windows)
        candidates += n_candidates
        segments += [(f"{row.conversation_id}#{w.index}", w) for w in windows]
    return segments, dropped, candidates


def trim_window(input_ids: np.ndarray, loss_mask: np.ndarray, prefix_len: int,
                n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """A window cut to ``n_tokens``: its first ``prefix_len`` tokens kept, leading body tokens dropped.

    The caller keeps ``n_tokens >= len(input_ids) - Window.trimmable`` (only loss-0 context is cut).
    ``[n] -> [n_tokens]`` each, same dtypes.
    """
    cut = len(input_ids) - n_tokens
    keep = np.r_[0:prefix_len, prefix_len + cut:len(input_ids)]
    return input_ids[keep], loss_mask[keep]
