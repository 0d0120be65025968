"""The stream plan's record and rules (stores/stream/plan.py): sizes, the window, eviction, the cursor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stores.errors import InputError, StoreFormatError
from stores.features.feature_store import FeatureStore
from stores.stream.plan import (StreamPlan, block_feature_bytes, context_reads, format_size, parse_size, step_units,
                                window_for_budget, window_for_reads)
from stores.stream.session import StreamSession


@pytest.mark.parametrize("text, value", [("1048576", 2 ** 20), ("20GB", 20 * 10 ** 9), ("512MiB", 512 * 2 ** 20),
                                         ("1.5KiB", 1536), ("3g", 3 * 10 ** 9), (" 7 TiB ", 7 * 2 ** 40), (5, 5),
                                         ("20 GB", 20 * 10 ** 9), ("0.5GiB", 2 ** 29),
                                         # decimal, exactly: the float products are 2,009,999,999 and 1,000
                                         ("2.01GB", 2_010_000_000), ("1.001KB", 1001)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "GB", "12XB", "-5", "-1", "0", "0.5", "1e9", "nan", "\uff11\uff12"])
def test_parse_size_refuses(text):
    with pytest.raises(InputError, match="--max-store-bytes"):
        parse_size(text)


@pytest.mark.parametrize("n", [1, 1000, 1023, 1024, 1536, 2 ** 20 + 1, 5 * 2 ** 30 + 12345])
def test_format_size_reads_back_to_at_least_the_value(n):
    assert n <= parse_size(format_size(n)) <= n * 1.01 + 1


def test_block_feature_bytes_is_the_chunk_files():
    # bf16: aux [C, L, H] and final [C, H] as uint16, each chunk file + its 4-byte crc32c
    assert block_feature_bytes(48, 2, 64, "bf16") == 48 * 2 * 64 * 2 + 4 + 48 * 64 * 2 + 4
    # fp8: codes (1 byte) and float32 scales per token and layer
    assert block_feature_bytes(48, 2, 64, "fp8") == (48 * 2 * 64 + 4) + (48 * 2 * 4 + 4) + (48 * 64 + 4) + (48 * 4 + 4)


def test_window_for_budget():
    assert window_for_budget(1000 + 10 * 100, 1000, 100, 2) == 8
    assert window_for_budget(1000 + 10 * 100 + 99, 1000, 100, 2) == 8
    assert window_for_budget(1000 + 2 * 100, 1000, 100, 2) == 0


def _plan(order, window, policy="reextract", val=(9,)):
    return StreamPlan(run={"output": "/o"}, policy=policy, max_store_bytes=10, fixed_bytes=1, block_bytes=1,
                      window=window, val_blocks=tuple(val), order=np.asarray(order, dtype=np.int64))


def test_window_and_eviction_rules():
    plan = _plan([0, 1, 2, 3, 1, 0, 2, 3], window=3)
    assert [plan.may_write(c, 0) for c in range(5)] == [True, True, True, False, False]
    assert plan.may_write(4, 2) and not plan.may_write(5, 2)
    assert plan.needed(2) == {2, 3, 1}
    # at cursor 2, block 0 (entries 0 and 5) is outside [2, 5): evicted; the validation block never is
    assert plan.evictable([0, 1, 2, 9], 2) == [0]
    assert plan.evictable([0, 1, 2, 3, 9], 8) == [0, 1, 2, 3]
    assert _plan([0, 1, 2, 3], window=4, policy="keep").evictable([0, 1, 2, 3], 4) == []
    assert _plan([0, 1, 2, 3], window=1, policy="keep").may_write(3, 0)


def test_planned_extractions():
    # block 1 at entries 1 and 4 (distance 3 = window): the window of every cursor the extraction evicts at in
    # between holds entry 1 or entry 4, so it stays; blocks 0, 2, 3 (distance 5, 4, 4 > 3) are extracted again
    assert _plan([0, 1, 2, 3, 1, 0, 2, 3], window=3).extractions() == 4 + 3 + 1
    # with window 4, only block 0 (distance 5) is extracted again
    assert _plan([0, 1, 2, 3, 1, 0, 2, 3], window=4).extractions() == 4 + 1 + 1
    assert _plan([0, 1, 2, 3, 1, 0, 2, 3], window=8, policy="keep").extractions() == 4 + 1


def test_evict_block_clears_the_flag_and_deletes_the_features(tmp_path):
    store = FeatureStore.create(tmp_path / "s.zarr", n_blocks=3, block_size=4, max_segments=1, layers=[1],
                                hidden_size=8, vocab_size=16, verifier={"name_or_path": "v", "hidden_size": 8,
                                                                         "vocab_size": 16})
    for i in range(3):
        store.write_tokens(i, np.arange(4), np.ones(4), np.arange(4), np.array([0, 4]))
        store.write_features(i, torch.ones(4, 1, 8, dtype=torch.bfloat16), torch.ones(4, 8, dtype=torch.bfloat16))
        store.mark_done(i)
    store.write_all_n_tokens(np.full(3, 4))
    store.evict_block(1)
    assert store.done_mask().tolist() == [True, False, True]
    assert not any(p.exists() for p in store.feature_chunk_paths(1))
    assert all(p.exists() for p in store.feature_chunk_paths(0))
    assert store.read_tokens(1)["input_ids"].tolist() == [0, 1, 2, 3]  # the token arrays stay


# a full-context store's plan: training block -> the context blocks (units) it reads
READS = ((0,), (0, 1), (2,), (3,), (4, 5), (6,))
"""Training blocks 0 and 1 share context block 0 (a long conversation's two windows); block 4 reads two; block 5
is the validation block (context block 6)."""


def _windows_plan(order, window, policy="reextract"):
    return StreamPlan(run={"output": "/o"}, policy=policy, max_store_bytes=10, fixed_bytes=1, block_bytes=1,
                      window=window, val_blocks=(5,), order=np.asarray(order, dtype=np.int64), reads=READS)


def test_a_full_context_plan_writes_and_evicts_context_blocks():
    plan = _windows_plan([1, 2, 0, 3, 4, 1, 2, 0], window=2)
    assert plan.val_units == (6,) and plan.units_of(4) == (4, 5)
    assert plan.needed(0) == {0, 1, 2} and plan.needed(2) == {0, 3}
    # context block 0 is read by entries 0 and 2 (training blocks 1 and 0): kept at cursor 1, evicted at 3
    assert plan.evictable([0, 1, 2, 6], 1) == [1]
    assert plan.evictable([0, 3, 6], 3) == [0]
    # counts: unit 0 read at entries 0, 2, 5, 7: again at 5 only (distances 2, 3, 2 against the window 2); 1 at 0
    # and 5: again; 2 at 1 and 6: again; 3, 4, 5 once; the validation unit once
    assert plan.extraction_counts() == {6: 1, 0: 2, 1: 2, 2: 2, 3: 1, 4: 1, 5: 1}
    assert _windows_plan([1, 2, 0, 3, 4, 1, 2, 0], window=8, policy="keep").extractions() == 7
    assert plan.record()["format"] == 2 and plan.record()["units"] == "context_blocks"
    assert not plan.same_run(_plan([1, 2, 0, 3, 4, 1, 2, 0], window=2, val=(5,)))  # other units: another run


def test_the_window_holds_the_budget_at_every_cursor():
    order = np.array([1, 2, 0, 3, 4, 1, 2, 0])  # units per entry: {0, 1} {2} {0} {3} {4, 5} {0, 1} {2} {0}
    # one step (P = 1) reads at most 2 units (training block 1: units 0 and 1; block 4: units 4 and 5)
    assert step_units(order, READS, (6,), 1) == 2
    assert step_units(order, READS, (6,), 2) == 4  # entries [4, 6): units 4, 5, 0, 1
    # 4 units beside the validation one: a window of 2 entries ([4, 6) reads 4), not 3 ([3, 6) reads 5)
    assert window_for_reads(order, READS, (6,), 4, 1) == 2
    assert window_for_reads(order, READS, (6,), 3, 1) == 1
    assert window_for_reads(order, READS, (6,), 5, 1) == 3
    assert window_for_reads(order, READS, (6,), 1, 1) == 0  # not even one entry
    assert window_for_reads(order, READS, (6,), 100, 1) == 8  # at most T
    # with steps of 2 entries only cursors 0, 2, 4, 6 occur: [2, 4) reads 2 units, but [4, 7) reads 5
    assert window_for_reads(order, READS, (6,), 4, 2) == 2


def _windows_store(path):
    """A full-context store of 3 training blocks viewing 2 context blocks: block 0 reads context 0, block 1
    contexts 0 and 1, block 2 context 1."""
    store = FeatureStore.create_windows(path, n_blocks=3, block_size=4, max_segments=2, n_context_blocks=2,
                                        context_size=8, context_segments=2, layers=[1], hidden_size=8, vocab_size=16,
                                        verifier={"name_or_path": "v", "hidden_size": 8, "vocab_size": 16})
    for i, views in enumerate([[(0, 0, 0, 0)], [(0, 0, 0, 4), (1, 0, 0, 0)], [(1, 0, 0, 4)]]):
        store.write_views(i, views)
    return FeatureStore.open(path, mode="r+")


def test_a_full_context_plan_round_trip_reads_its_units_from_the_views(tmp_path):
    store = _windows_store(tmp_path / "w.zarr")
    assert context_reads(store) == ((0,), (0, 1), (1,))
    plan = StreamPlan(run={"output": "/o"}, policy="reextract", max_store_bytes=10, fixed_bytes=1, block_bytes=1,
                      window=1, val_blocks=(2,), order=np.array([1, 0]), reads=context_reads(store))
    StreamSession(store).write_plan(plan)
    back = StreamSession(store).read_plan()
    assert back.same_run(plan) and back.reads == ((0,), (0, 1), (1,)) and back.val_units == (1,)
    store.write_views(0, [(1, 0, 0, 0)])  # views that read other context blocks than the plan was made for
    with pytest.raises(StoreFormatError, match="do not match its stream plan's"):
        StreamSession(FeatureStore.open(tmp_path / "w.zarr")).read_plan()
    StreamSession(store).write_plan(_plan([1, 0], window=1, val=(2,)))  # a format-1 plan in a full-context store
    with pytest.raises(StoreFormatError, match="a stream plan of format 1 in a windows store"):
        StreamSession(store).read_plan()
