"""The training side of a streaming run (peagle_train/data/stream.py): the plan from the block sequence, the
budget refusal, the deterministic saves, waiting reads that stop when the extraction stops."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from peagle_train.data.loader import BlockSequence, epoch_order
from peagle_train.data.stream import (PLAN_ALLOWANCE_BYTES, READ_TRIES, ExtractionDied, StreamingStore,
                                      fixed_store_bytes, make_plan, plan_entries)
from stores.errors import ChunkDamageError, InputError
from stores.features.feature_store import FeatureStore
from stores.stream.heartbeat import read_heartbeat
from stores.stream.plan import apparent_bytes, block_feature_bytes, flag_bytes
from tests.stores.stream.test_heartbeat import beating_process

C, L, H = 8, 2, 16


def _store(path, n=6, done=()):
    store = FeatureStore.create(path, n_blocks=n, block_size=C, max_segments=1, layers=[1, 2], hidden_size=H,
                                vocab_size=32, verifier={"name_or_path": "v", "hidden_size": H, "vocab_size": 32})
    for i in range(n):
        store.write_tokens(i, np.arange(C), np.ones(C), np.arange(C), np.array([0, C]))
    store.write_all_n_tokens(np.full(n, C))
    for i in done:
        _extract(store, i)
    return FeatureStore.open(path, mode="r+")


def _extract(store, i):
    store.write_features(i, torch.full((C, L, H), float(i), dtype=torch.bfloat16),
                         torch.full((C, H), float(i), dtype=torch.bfloat16))
    store.mark_done(i)


def test_plan_entries_follow_the_epoch_orders():
    seq = BlockSequence(np.array([0, 2, 3, 5]), np.array([0, 2, 3, 5]), seed=4)
    order = plan_entries(seq, 10)
    assert order[:4].tolist() == epoch_order(np.array([0, 2, 3, 5]), 4, 0).tolist()
    assert order[4:8].tolist() == epoch_order(np.array([0, 2, 3, 5]), 4, 1).tolist()
    assert order[8:].tolist() == epoch_order(np.array([0, 2, 3, 5]), 4, 2)[:2].tolist()


def test_make_plan_window_and_refusal(tmp_path):
    store = _store(tmp_path / "s.zarr")
    seq = BlockSequence(np.arange(5), np.arange(5), seed=0)
    block = block_feature_bytes(C, L, H, "bf16")
    fixed = fixed_store_bytes(store, 10)
    plan = make_plan(store, seq, np.array([5]), max_steps=5, blocks_per_step=2, val_max_blocks=4,
                     max_store_bytes=fixed + 4 * block + 10, policy="reextract", run={"output": "/o"})
    assert plan.window == 3 and plan.val_blocks == (5,) and plan.n_entries == 10 and plan.block_bytes == block
    with pytest.raises(InputError, match=f"smallest budget that works is {fixed + 3 * block:,} bytes"):
        make_plan(store, seq, np.array([5]), max_steps=5, blocks_per_step=2, val_max_blocks=4,
                  max_store_bytes=fixed + 3 * block - 1, policy="reextract", run={"output": "/o"})
    with pytest.raises(InputError, match=f"smallest budget that works is {fixed + 6 * block:,} bytes"):
        make_plan(store, seq, np.array([5]), max_steps=5, blocks_per_step=2, val_max_blocks=4,
                  max_store_bytes=fixed + 4 * block, policy="keep", run={"output": "/o"})


def test_fixed_bytes_stay_the_same_as_blocks_are_done_and_evicted(tmp_path):
    """The done flags' chunk files appear as blocks are done (5 bytes each, flag and crc32c): counted for every
    block from the start, the fixed bytes a resume measures equal those the run started with (a measure of the
    files alone grew, and the resume of a run at its smallest budget was refused as too small)."""
    store = _store(tmp_path / "s.zarr")
    before = fixed_store_bytes(store, 10)
    for i in range(3):
        _extract(store, i)
    store.evict_block(1)
    assert fixed_store_bytes(store, 10) == before
    assert flag_bytes(6) == 6 * 5
    # what the files hold now: everything fixed but the flags of the 3 blocks never done and the plan, + 2 blocks
    features = 2 * block_feature_bytes(C, L, H, "bf16")
    assert apparent_bytes(store.path) == before - flag_bytes(3) - 8 * 10 - PLAN_ALLOWANCE_BYTES + features


def test_a_read_waits_for_the_block(tmp_path):
    store = _store(tmp_path / "s.zarr", done=[0])
    reader = StreamingStore(store, timeout_s=30, poll_s=0.01)
    assert reader.read_block(0).aux_hidden.float().mean().item() == 0.0
    writer = FeatureStore.open(tmp_path / "s.zarr", mode="r+")
    threading.Timer(0.3, _extract, (writer, 3)).start()
    t0 = time.monotonic()
    block = reader.read_block(3)
    assert time.monotonic() - t0 >= 0.25 and block.aux_hidden.float().mean().item() == 3.0
    assert reader.n_blocks == 6  # everything else is the store's


def test_a_block_evicted_between_its_done_flag_and_the_read_is_waited_for_again_damage_is_raised(tmp_path):
    store = _store(tmp_path / "s.zarr", done=[3, 4])
    reader = StreamingStore(store, timeout_s=30, poll_s=0.01)
    read, calls = store.read_block, []

    def evicted_first(i, **kw):  # the extraction evicts it right after the reader saw its done flag
        calls.append(i)
        if calls == [3]:
            store.evict_block(i)
            threading.Timer(0.2, _extract, (FeatureStore.open(tmp_path / "s.zarr", mode="r+"), i)).start()
        return read(i, **kw)

    store.read_block = evicted_first
    assert reader.read_block(3).aux_hidden.float().mean().item() == 3.0 and calls == [3, 3]
    path = store.feature_chunk_paths(4)[0]
    data = bytearray(path.read_bytes())
    data[5] ^= 0x10
    path.write_bytes(bytes(data))  # damaged, still done: raised, not retried away
    calls.clear()
    with pytest.raises(ChunkDamageError):
        reader.read_block(4)
    assert calls == [4] * READ_TRIES


def test_a_read_stops_when_the_extraction_stopped(tmp_path):
    store = _store(tmp_path / "s.zarr")
    reader = StreamingStore(store, timeout_s=30, extraction_alive=lambda: "exit code 1", log_path="/x/s.extract.log",
                            poll_s=0.01)
    with pytest.raises(ExtractionDied, match=r"block 2 is not extracted and the extraction stopped \(exit code 1\); "
                                             r"its log: /x/s.extract.log"):
        reader.read_block(2)


def test_a_read_stops_after_the_timeout_without_progress(tmp_path):
    store = _store(tmp_path / "s.zarr")
    reader = StreamingStore(store, timeout_s=0.5, poll_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(ExtractionDied, match=r"block 1 is not extracted and the extraction .* is not running: no "
                                             r"heartbeat of it appeared for 0.5 s, nor did it make progress"):
        reader.read_block(1)
    assert time.monotonic() - t0 < 5


def test_a_slow_extraction_is_waited_for_and_a_killed_one_stops_the_read_at_once(tmp_path):
    """An extraction whose heartbeat beats is waited for past the timeout (a long unit); one killed during a wait is
    seen gone at once (split roles: no subprocess to poll). The reading store beats the trainer's heartbeat."""
    store = _store(tmp_path / "s.zarr")
    extraction = beating_process(store.path, "extraction")
    reader = StreamingStore(store, timeout_s=0.5, poll_s=0.02, heartbeat=True)
    try:
        threading.Timer(2.5, _extract, (store, 1)).start()
        t0 = time.monotonic()
        assert reader.read_block(1).aux_hidden.float().mean().item() == 1.0
        assert time.monotonic() - t0 >= 2.4
        assert read_heartbeat(store.path, "trainer")["pid"] == os.getpid()
        reader.timeout_s = 60
        threading.Timer(1.5, os.kill, (extraction.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(ExtractionDied, match=f"block 2 is not extracted and the extraction .* is not running: its "
                                                 f"process {extraction.pid} on this machine is gone"):
            reader.read_block(2)
        assert time.monotonic() - t0 < 5
    finally:
        reader.close()
        extraction.kill()
        extraction.wait()


def _windows_store(path):
    """A full-context store of 4 training blocks viewing 3 context blocks of 2·C slots: block 0 reads context 0,
    block 1 contexts 0 and 1 (two segments), block 2 context 1, block 3 (validation) context 2."""
    store = FeatureStore.create_windows(path, n_blocks=4, block_size=C, max_segments=2, n_context_blocks=3,
                                        context_size=2 * C, context_segments=2, layers=[1, 2], hidden_size=H,
                                        vocab_size=32, verifier={"name_or_path": "v", "hidden_size": H,
                                                                 "vocab_size": 32})
    for i, views in enumerate([[(0, 0, 0, 0)], [(0, 0, 0, 4), (1, 0, 0, 0)], [(1, 0, 0, 4)], [(2, 0, 0, 0)]]):
        store.write_views(i, views)
    return FeatureStore.open(path, mode="r+")


def test_a_full_context_plan_counts_context_blocks(tmp_path):
    store = _windows_store(tmp_path / "w.zarr")
    seq = BlockSequence(np.arange(3), np.arange(3), seed=0)
    unit = block_feature_bytes(2 * C, L, H, "bf16")  # a context block's features
    fixed = fixed_store_bytes(store, 6)
    plan = make_plan(store, seq, np.array([3]), max_steps=6, blocks_per_step=1, val_max_blocks=4,
                     max_store_bytes=fixed + 3 * unit, policy="reextract", run={"output": "/o"})
    assert plan.reads == ((0,), (0, 1), (1,), (2,)) and plan.val_units == (2,) and plan.block_bytes == unit
    assert plan.record()["format"] == 2
    # room for 2 context blocks beside the validation one: every window of this run reads at most units 0 and 1,
    # so the whole run is one window
    assert plan.window == 6
    # the smallest budget holds the validation block's context block and training block 1's two
    with pytest.raises(InputError, match=f"the 2 context block\\(s\\) the 1 training block\\(s\\) of one optimizer step "
                                         f"read .* smallest budget that works is {fixed + 3 * unit:,} bytes"):
        make_plan(store, seq, np.array([3]), max_steps=6, blocks_per_step=1, val_max_blocks=4,
                  max_store_bytes=fixed + 3 * unit - 1, policy="reextract", run={"output": "/o"})
    assert make_plan(store, seq, np.array([3]), max_steps=6, blocks_per_step=1, val_max_blocks=4,
                     max_store_bytes=fixed + 3 * unit, policy="keep", run={"output": "/o"}).window == 6
