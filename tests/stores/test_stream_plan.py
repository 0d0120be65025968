"""The stream plan's record and rules (stores/stream_plan.py): sizes, the window, eviction, the cursor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stores.errors import InputError
from stores.feature_store import FeatureStore
from stores.stream_plan import (StreamPlan, block_feature_bytes, format_size, parse_size, read_consumed, read_plan,
                                remove_plan, window_for_budget, write_consumed, write_plan)


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
    # block 1 at entries 1 and 4 (distance 3 = window): extracted again; block 0 at 0 and 5: again
    assert _plan([0, 1, 2, 3, 1, 0, 2, 3], window=3).extractions() == 8 + 1
    # with window 4, entry 4's block 1 (entry 1 is 3 entries before) is still there
    assert _plan([0, 1, 2, 3, 1, 0, 2, 3], window=4).extractions() == 4 + 3 + 1
    assert _plan([0, 1, 2, 3, 1, 0, 2, 3], window=8, policy="keep").extractions() == 4 + 1


def test_plan_and_cursor_round_trip(tmp_path):
    store = FeatureStore.create(tmp_path / "s.zarr", n_blocks=10, block_size=4, max_segments=1, layers=[1],
                                hidden_size=8, vocab_size=16, verifier={"name_or_path": "v", "hidden_size": 8,
                                                                         "vocab_size": 16})
    assert read_plan(store) is None and read_consumed(store) == 0
    plan = _plan([3, 1, 2, 0], window=2)
    write_plan(store, plan)
    back = read_plan(store)
    assert back.same_run(plan) and back.order.tolist() == [3, 1, 2, 0] and back.val_blocks == (9,)
    assert not back.same_run(_plan([3, 1, 0, 2], window=2))
    write_consumed(store, 3)
    assert read_consumed(store) == 3
    assert list(store.group.array_keys())  # the store still opens and lists its arrays
    remove_plan(store)
    assert read_plan(store) is None and read_consumed(store) == 0


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
