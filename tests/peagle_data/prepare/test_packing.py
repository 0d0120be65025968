"""Packing (docs/design.md §5): best-fit decreasing exactness, determinism, packed-row columns."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle_data.prepare.packing import make_packed_row, pack_blocks, packing_efficiency


def reference_bfd(lengths, block_size):
    """Naive best-fit decreasing: scan every block for the least room that fits."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    blocks, rooms = [], []
    for i in order:
        best = None
        for b, room in enumerate(rooms):
            if lengths[i] <= room and (best is None or room < rooms[best]):
                best = b
        if best is None:
            blocks.append([]), rooms.append(block_size)
            best = len(blocks) - 1
        blocks[best].append(i)
        rooms[best] -= lengths[i]
    return blocks


def test_bfd_hand_case():
    # 5 -> B0 (room 3); 4 -> B1 (room 4); 3 -> B0 (best fit, room 0); 3 -> B1 (room 1);
    # 2 -> B2 (room 6); 1 -> B1 (least room that fits, room 0).
    assert pack_blocks([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]


def test_bfd_ties():
    assert pack_blocks([4, 4, 4, 4], 10) == [[0, 1], [2, 3]]  # equal lengths: lower index first
    assert pack_blocks([6, 6, 3], 9) == [[0, 2], [1]]  # equal room: the block opened first
    assert pack_blocks([], 8) == []
    assert pack_blocks([8, 8], 8) == [[0], [1]]


def test_bfd_rejects_items_that_do_not_fit():
    with pytest.raises(ValueError, match="block_size"):
        pack_blocks([9], 8)
    with pytest.raises(ValueError):
        pack_blocks([0], 8)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), max_size=120), st.integers(64, 160))
def test_bfd_properties(lengths, block_size):
    blocks = pack_blocks(lengths, block_size)
    assert blocks == reference_bfd(lengths, block_size)
    assert blocks == pack_blocks(list(lengths), block_size)  # deterministic
    flat = sorted(i for b in blocks for i in b)
    assert flat == list(range(len(lengths)))  # every window in exactly one block
    assert all(sum(lengths[i] for i in b) <= block_size for b in blocks)


def test_make_packed_row_columns():
    segments = [
        ("a#0", np.array([10, 11, 12]), np.array([0, 1, 1])),
        ("b#2", np.array([20, 21]), np.array([1, 0])),
    ]
    row = make_packed_row(7, segments)
    assert row.block_id == 7 and row.n_tokens == 5
    assert row.input_ids.tolist() == [10, 11, 12, 20, 21] and row.input_ids.dtype == np.int32
    assert row.loss_mask.tolist() == [0, 1, 1, 1, 0] and row.loss_mask.dtype == np.uint8
    assert row.position_ids.tolist() == [0, 1, 2, 0, 1] and row.position_ids.dtype == np.int32
    assert row.cu_seqlens.tolist() == [0, 3, 5] and row.cu_seqlens.dtype == np.int32
    assert row.segment_ids == ["a#0", "b#2"]


def test_make_packed_row_rejects_bad_segments():
    with pytest.raises(ValueError):
        make_packed_row(0, [])
    with pytest.raises(ValueError):
        make_packed_row(0, [("a#0", np.array([1, 2]), np.array([1]))])


def test_packing_efficiency():
    assert packing_efficiency(15, 2, 8) == 15 / 16
    assert packing_efficiency(0, 0, 8) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 64), st.integers(0, 63)), max_size=120), st.integers(64, 160))
def test_flexible_packing_properties(items, block_size):
    from peagle_data.prepare.packing import pack_blocks_flexible

    lengths = [n for n, _ in items]
    mins = [max(1, n - cut) for n, cut in items]
    blocks, used = pack_blocks_flexible(lengths, mins, block_size)
    assert (blocks, used) == pack_blocks_flexible(list(lengths), list(mins), block_size)  # deterministic
    assert sorted(i for b in blocks for i in b) == list(range(len(lengths)))
    assert all(m <= u <= n for u, m, n in zip(used, mins, lengths))
    assert all(sum(used[i] for i in b) <= block_size for b in blocks)
    # Fixed-length items are packed exactly as plain best-fit decreasing packs them.
    if all(m == n for m, n in zip(mins, lengths)):
        assert blocks == pack_blocks(lengths, block_size) and used == lengths


def test_flexible_item_fills_the_largest_gap():
    from peagle_data.prepare.packing import pack_blocks_flexible

    # 6 and 5 fill two blocks of 8 (rooms 2 and 3); the flexible item (8, may shrink to 3)
    # takes the largest room and is cut to fill it.
    assert pack_blocks_flexible([6, 5, 8], [6, 5, 3], 8) == ([[0], [1, 2]], [6, 5, 3])
    assert pack_blocks_flexible([6, 8], [6, 4], 8) == ([[0], [1]], [6, 8])  # too big for room 2: new block
