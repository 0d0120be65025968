"""Packing (docs/design.md §5): best-fit decreasing of windows into blocks of at most ``block_size`` tokens.

Pure functions. Legend: ``n`` tokens in a block, ``S`` segments (windows) in it.
"""

from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

from stores.tables.token_rows import PackedRow

__all__ = ["pack_blocks", "pack_blocks_flexible", "make_packed_row", "packing_efficiency"]


def pack_blocks(lengths: Sequence[int], block_size: int) -> list[list[int]]:
    """Best-fit decreasing: assign every item (a window of ``lengths[i]`` tokens) to one block.

    Items are placed longest first (ties: lower index first), each into the open block with the
    least room that still fits it (ties: the block opened first), else into a new block. The result
    depends only on ``lengths`` and ``block_size``.

    Args:
        lengths: tokens per item, each ``1 <= length <= block_size``.
        block_size: C, the most tokens in a block.

    Returns:
        Blocks in the order they were opened; each a list of item indices in placement order.
        Every index appears in exactly one block.

    Raises:
        ValueError: ``block_size < 1`` or an item of length < 1 or > ``block_size``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for i, n in enumerate(lengths):
        if not 1 <= n <= block_size:
            raise ValueError(f"item {i} has length {n}; every item must be in [1, block_size={block_size}]")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    blocks: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, block index), kept sorted
    for i in order:
        n = int(lengths[i])
        j = bisect.bisect_left(free, (n, -1))  # least room >= n, then the lowest block index
        if j < len(free):
            room, b = free.pop(j)
        else:
            room, b = block_size, len(blocks)
            blocks.append([])
        blocks[b].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, b))
    return blocks


def pack_blocks_flexible(lengths: Sequence[int], min_lengths: Sequence[int],
                         block_size: int) -> tuple[list[list[int]], list[int]]:
    """Best-fit decreasing, then items that may shrink fill the largest gaps exactly.

    Items with ``min_lengths[i] == lengths[i]`` are packed by :func:`pack_blocks`. The others (the
    aligned last windows of long conversations, which may drop leading context tokens) are placed
    longest minimum first (ties: lower index), each into the open block with the most room when
    that room is at least its minimum, shrunk to ``min(length, room)`` so the block is full; else
    into a new block at full length. Deterministic for given inputs.

    Args:
        lengths: tokens per item, each ``1 <= length <= block_size``.
        min_lengths: the fewest tokens each item may be cut to, ``1 <= min <= length``.
        block_size: C, the most tokens in a block.

    Returns:
        ``(blocks, used_lengths)``: blocks as in :func:`pack_blocks` (flexible items appended to
        their block's list), and the length each item is packed at.

    Raises:
        ValueError: as :func:`pack_blocks`, or a minimum outside ``[1, length]``.
    """
    if len(min_lengths) != len(lengths):
        raise ValueError(f"{len(lengths)} lengths but {len(min_lengths)} min_lengths")
    for i, (n, m) in enumerate(zip(lengths, min_lengths)):
        if not 1 <= m <= n:
            raise ValueError(f"item {i}: min_length {m} outside [1, length={n}]")
    fixed = [i for i in range(len(lengths)) if min_lengths[i] == lengths[i]]
    flexible = sorted((i for i in range(len(lengths)) if min_lengths[i] < lengths[i]),
                      key=lambda i: (-min_lengths[i], i))
    blocks = [[fixed[j] for j in b] for b in pack_blocks([lengths[i] for i in fixed], block_size)]
    used = [int(n) for n in lengths]
    # Rooms as a sorted list of (-room, block index): the first entry is the most room, lowest index.
    rooms = sorted((-(block_size - sum(lengths[i] for i in b)), k) for k, b in enumerate(blocks))
    rooms = [r for r in rooms if r[0] < 0]
    for i in flexible:
        if rooms and -rooms[0][0] >= min_lengths[i]:
            neg_room, b = rooms.pop(0)
            used[i] = min(int(lengths[i]), -neg_room)
        else:
            b = len(blocks)
            blocks.append([])
            neg_room = -block_size
        blocks[b].append(i)
        left = -neg_room - used[i]
        if left > 0:
            bisect.insort(rooms, (-left, b))
    return blocks, used


def make_packed_row(block_id: int, segments: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> PackedRow:
    """Build one packed row (docs/design.md §6) from its segments.

    Args:
        block_id: the row's id.
        segments: ``(segment_id, input_ids int [n_s], loss_mask 0/1 [n_s])`` per window, in order.

    Returns:
        A :class:`~stores.tables.token_rows.PackedRow`: ``input_ids`` int32 [n], ``loss_mask`` uint8 [n],
        ``position_ids`` int32 [n] (restart at 0 in every segment), ``cu_seqlens`` int32 [S + 1]
        ([0, n_0, n_0+n_1, ..., n]), ``segment_ids`` list[str] [S], ``n_tokens``; no mixture columns.

    Raises:
        ValueError: no segment, an empty segment, or ids and mask of different lengths.
    """
    if not segments:
        raise ValueError("a block needs at least one segment")
    lengths = []
    for sid, ids, mask in segments:
        if len(ids) != len(mask) or len(ids) == 0:
            raise ValueError(f"segment {sid}: {len(ids)} ids, {len(mask)} mask values (need equal, > 0)")
        lengths.append(len(ids))
    cu_seqlens = np.zeros(len(segments) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu_seqlens[1:])
    n_tokens = int(cu_seqlens[-1])
    starts = np.repeat(cu_seqlens[:-1], lengths)  # [n] start of each token's segment
    return PackedRow(
        block_id=int(block_id),
        input_ids=np.concatenate([np.asarray(s[1], dtype=np.int32) for s in segments]),
        loss_mask=np.concatenate([np.asarray(s[2], dtype=np.uint8) for s in segments]),
        position_ids=(np.arange(n_tokens, dtype=np.int32) - starts).astype(np.int32),
        cu_seqlens=cu_seqlens,
        segment_ids=[s[0] for s in segments],
        n_tokens=n_tokens,
    )


def packing_efficiency(n_tokens_total: int, n_blocks: int, block_size: int) -> float:
    """``Σ n_tokens / (n_blocks * block_size)``; 0.0 when there is no block."""
    return float(n_tokens_total) / (n_blocks * block_size) if n_blocks else 0.0
