"""Windows (docs/design.md §5): hand cases with arithmetic ids, and properties over random conversations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle_data.prepare.windows import SystemPrefixTooLongError, count_windows, make_windows, window_starts


def test_short_conversation_is_one_window():
    ids = np.arange(6, dtype=np.int32)
    mask = np.array([0, 0, 0, 1, 1, 1], dtype=np.uint8)
    (w,) = make_windows(ids, mask, system_len=2, max_seq_len=6)
    assert w.input_ids.tolist() == ids.tolist() and w.loss_mask.tolist() == mask.tolist()
    assert w.position_ids.tolist() == list(range(6)) and w.index == 0
    assert w.input_ids.dtype == np.int32 and w.loss_mask.dtype == np.uint8 and w.position_ids.dtype == np.int32


def test_long_conversation_hand_case_skip():
    # P = [100, 101, 102]; body ids 0..9 all supervised; W = 8 -> B = 5, stride ceil(2.5) = 3.
    ids = np.array([100, 101, 102] + list(range(10)), dtype=np.int32)
    mask = np.array([0, 0, 0] + [1] * 10, dtype=np.uint8)
    # The last piece is aligned to end at the body's end (start 5, not 6): every window is full.
    assert window_starts(13, 3, 8, 0.5) == [0, 3, 5]
    ws = make_windows(ids, mask, system_len=3, max_seq_len=8, overlap=0.5, overlap_loss="skip")
    assert [w.input_ids.tolist() for w in ws] == [
        [100, 101, 102, 0, 1, 2, 3, 4],
        [100, 101, 102, 3, 4, 5, 6, 7],
        [100, 101, 102, 5, 6, 7, 8, 9],
    ]
    assert [w.loss_mask.tolist() for w in ws] == [
        [0, 0, 0, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 1, 1, 1],
        [0, 0, 0, 0, 0, 0, 1, 1],  # body 5..7 already supervised: loss 0 with skip
    ]
    assert [w.position_ids.tolist() for w in ws][2] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert [w.index for w in ws] == [0, 1, 2]
    assert window_starts(12, 0, 4, 0.5) == [0, 2, 4, 6, 8]  # even B: stride exactly B / 2
    assert window_starts(9, 0, 4, 0.5) == [0, 2, 4, 5]  # last start 5 = 9 - 4, not 6


def test_long_conversation_hand_case_keep():
    ids = np.array([100, 101, 102] + list(range(10)), dtype=np.int32)
    mask = np.array([0, 0, 0] + [1] * 10, dtype=np.uint8)
    ws = make_windows(ids, mask, system_len=3, max_seq_len=8, overlap=0.5, overlap_loss="keep")
    assert [w.loss_mask.tolist() for w in ws][1] == [0, 0, 0, 1, 1, 1, 1, 1]


def test_window_without_supervised_token_is_dropped_and_index_kept():
    ids = np.arange(13, dtype=np.int32)
    mask = np.array([0, 0, 0] + [1, 1] + [0] * 8, dtype=np.uint8)  # only body tokens 0, 1 supervised
    ws = make_windows(ids, mask, system_len=3, max_seq_len=8)
    assert [w.index for w in ws] == [0]
    assert count_windows(13, 3, 8) - len(ws) == 2
    assert make_windows(np.arange(4), np.zeros(4, dtype=np.uint8), 1, 8) == []


def test_system_prefix_too_long_is_a_value_error():
    with pytest.raises(SystemPrefixTooLongError, match="system prefix too long"):
        make_windows(np.arange(20), np.ones(20, dtype=np.uint8), system_len=8, max_seq_len=8)
    assert issubclass(SystemPrefixTooLongError, ValueError)


def test_bad_arguments():
    with pytest.raises(ValueError, match="overlap"):
        make_windows(np.arange(4), np.ones(4), 0, 8, overlap=1.0)
    with pytest.raises(ValueError, match="overlap_loss"):
        make_windows(np.arange(4), np.ones(4), 0, 8, overlap_loss="twice")


@st.composite
def conversations(draw):
    """A random conversation: system prefix (mask 0), then alternating user (0) / assistant (1) runs."""
    system_len = draw(st.integers(0, 12))
    runs = draw(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 300)), min_size=1, max_size=8))
    mask = [0] * system_len
    for user, assistant in runs:
        mask += [0] * user + [1] * assistant
    mask = np.array(mask, dtype=np.uint8)
    ids = np.arange(len(mask), dtype=np.int32) + 1000  # ids reveal their position
    max_seq_len = draw(st.integers(system_len + 1, system_len + 120))
    overlap = draw(st.sampled_from([0.0, 0.25, 0.5, 0.75]))
    return ids, mask, system_len, max_seq_len, overlap


def _supervision_counts(ws, n_tokens, system_len):
    """How often each conversation position is supervised across the windows."""
    counts = np.zeros(n_tokens, dtype=np.int64)
    for w in ws:
        positions = w.input_ids - 1000
        np.add.at(counts, positions[w.loss_mask == 1], 1)
    return counts


def _coverage(n_tokens, system_len, max_seq_len, overlap):
    """How many candidate windows hold each body position."""
    cover = np.zeros(n_tokens, dtype=np.int64)
    if n_tokens <= max_seq_len:
        return cover + 1
    body = max_seq_len - system_len
    for s in window_starts(n_tokens, system_len, max_seq_len, overlap):
        cover[system_len + s: system_len + s + body] += 1
    return cover


@settings(max_examples=200, deadline=None)
@given(conversations(), st.sampled_from(["skip", "keep"]))
def test_window_properties(conv, overlap_loss):
    ids, mask, system_len, max_seq_len, overlap = conv
    n = len(ids)
    ws = make_windows(ids, mask, system_len, max_seq_len, overlap, overlap_loss)
    assert ws, "a conversation with supervised tokens keeps at least one window"
    for w in ws:
        assert w.n_tokens <= max_seq_len
        assert w.loss_mask.any()  # no empty window
        assert w.position_ids.tolist() == list(range(w.n_tokens))
        assert np.array_equal(w.input_ids[:system_len], ids[:system_len])  # starts with P
        if w.index > 0:
            assert not w.loss_mask[:system_len].any()
            body = w.input_ids[system_len:] - 1000
            assert np.array_equal(body, np.arange(body[0], body[0] + len(body)))  # contiguous piece
    supervised = _supervision_counts(ws, n, system_len)
    if overlap_loss == "skip":
        assert np.array_equal(supervised, mask.astype(np.int64))  # every supervised token exactly once
    else:
        expected = mask * _coverage(n, system_len, max_seq_len, overlap)
        assert np.array_equal(supervised, expected)
        if overlap == 0.5 and n > max_seq_len:
            assert supervised.max() <= 3  # 2, and 3 in the tail the aligned last window adds to
    # Every body token is in some candidate window (nothing falls between windows).
    assert (_coverage(n, system_len, max_seq_len, overlap)[system_len:] >= 1).all()
    if n > max_seq_len:  # every candidate window of a long conversation is full: W tokens
        assert all(w.n_tokens == max_seq_len for w in ws)
    # An assistant run longer than a window stays supervised across the windows that hold it.
    for a, b in _runs(mask):
        assert (supervised[a:b] >= 1).all()


def _runs(mask):
    padded = np.concatenate([[0], mask.astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


@settings(max_examples=200, deadline=None)
@given(conversations())
def test_trimmable_tail_drops_only_loss_zero_context(conv):
    ids, mask, system_len, max_seq_len, overlap = conv
    ws = make_windows(ids, mask, system_len, max_seq_len, overlap, "skip")
    for w in ws[:-1]:
        assert w.trimmable == 0
    last = ws[-1]
    assert last.prefix_len == (system_len if len(ids) > max_seq_len else 0)
    if last.trimmable:
        body = last.loss_mask[system_len:]
        assert not body[: last.trimmable].any()  # only already-supervised context is cut
        assert len(body) - last.trimmable >= 1 and body[last.trimmable:].any()
    assert all(w.trimmable == 0 for w in make_windows(ids, mask, system_len, max_seq_len, overlap, "keep"))
