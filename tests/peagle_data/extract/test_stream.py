"""The extraction side of a streaming run (peagle_data/extract/stream.py): the order, the window, eviction, a
replaced plan, a trainer that stopped."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from peagle_data.extract.stream import extract_stream, stream_entries
from stores.errors import InputError
from stores.features.feature_store import FeatureStore
from stores.stream.heartbeat import Heartbeat
from stores.stream.plan import StreamPlan, apparent_bytes, block_feature_bytes
from stores.stream.session import StreamSession
from tests.stores.stream.test_heartbeat import beating_process

C, H = 4, 8


def _store(path, n=6):
    store = FeatureStore.create(path, n_blocks=n, block_size=C, max_segments=1, layers=[1], hidden_size=H,
                                vocab_size=16, verifier={"name_or_path": "v", "hidden_size": H, "vocab_size": 16})
    for i in range(n):
        store.write_tokens(i, np.arange(C), np.ones(C), np.arange(C), np.array([0, C]))
    store.write_all_n_tokens(np.full(n, C))
    return FeatureStore.open(path, mode="r+")


def _write(store, i):
    store.write_features(i, torch.ones(C, 1, H, dtype=torch.bfloat16), torch.ones(C, H, dtype=torch.bfloat16))
    store.mark_done(i)


def _plan(order, window, policy="reextract", val=(5,)):
    return StreamPlan(run={"output": "/o"}, policy=policy, max_store_bytes=1, fixed_bytes=0, block_bytes=1,
                      window=window, val_blocks=tuple(val), order=np.asarray(order, dtype=np.int64))


def _stats():
    return {"extractions": 0, "evicted": 0, "waits": 0, "wait_s": 0.0, "peak_store_bytes": 0}


def test_entries_in_order_within_the_window_evicting_what_it_no_longer_reads(tmp_path):
    store = _store(tmp_path / "s.zarr")
    order = [0, 1, 2, 3, 1, 4, 0, 2]
    plan = _plan(order, window=3)
    StreamSession(store).write_plan(plan)
    present, stats, got = set(), _stats(), []
    stop = threading.Event()

    def trainer():  # consumes an entry every 50 ms once the first two training blocks are there
        k = 0
        while not stop.is_set() and k < len(order):
            if store.is_done(order[k]):
                k += 1
                StreamSession(store).write_consumed(k)
            stop.wait(0.05)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    try:
        for b in stream_entries(StreamSession(store), plan, present, stats, timeout_s=30, log=print):
            training = set(np.flatnonzero(store.done_mask()).tolist()) - {5}
            assert len(training) <= 2  # with the one about to be written: at most the window's 3
            _write(store, b)
            got.append(b)
    finally:
        stop.set()
        thread.join()
    assert got[:5] == [5, 0, 1, 2, 3]  # the validation block first, then the plan's order
    # entry 4's block 1 is re-extracted only if evicted meanwhile; entry 7's block 2 is skipped when the trainer
    # consumed it before the extraction got there (a slow extraction on a loaded machine: block 2 never evicted)
    assert got[5:] in ([4, 0, 2], [1, 4, 0, 2], [4, 0], [1, 4, 0])
    assert stats["evicted"] >= 2 and stats["waits"] >= 1


def test_keep_extracts_each_block_once_and_never_evicts(tmp_path):
    store = _store(tmp_path / "s.zarr")
    plan = _plan([0, 1, 2, 3, 1, 4, 0, 2], window=8, policy="keep")
    StreamSession(store).write_plan(plan)
    present, stats = set(), _stats()
    got = []
    for b in stream_entries(StreamSession(store), plan, present, stats, timeout_s=30, log=print):
        _write(store, b)
        got.append(b)
    assert got == [5, 0, 1, 2, 3, 4] and stats["evicted"] == 0


def test_a_resumed_extraction_skips_consumed_entries(tmp_path):
    store = _store(tmp_path / "s.zarr")
    plan = _plan([0, 1, 2, 3], window=2, val=())
    StreamSession(store).write_plan(plan)
    StreamSession(store).write_consumed(2)
    got = list(stream_entries(StreamSession(store), plan, set(), _stats(), timeout_s=30, log=print))
    assert got == [2, 3]


def test_entries_the_trainer_consumed_while_the_extraction_waited_are_not_extracted_again(tmp_path):
    """Entries 1 and 2 read block 0, present since entry 0: the trainer consumes them while the extraction waits
    at entry 1 for the window (B = 1), and the cursor jumps to 3. The window [3, 4) evicts block 0; entry 1 is
    consumed, so it must not bring block 0 back (CI found 14 extractions where the plan counts 13)."""
    store = _store(tmp_path / "s.zarr")
    plan = _plan([0, 0, 0, 1], window=1, val=())
    StreamSession(store).write_plan(plan)
    present, stats = set(), _stats()
    entries = stream_entries(StreamSession(store), plan, present, stats, timeout_s=30, log=print)
    assert next(entries) == 0
    _write(store, 0)
    StreamSession(store).write_consumed(3)  # (before the extraction reads the cursor again: it is waiting at entry 1)
    assert next(entries) == 1 and present == {1} and not store.is_done(0)
    assert list(entries) == [] and stats["evicted"] == 1 and plan.extractions() == 2


def test_a_stopped_trainer_and_a_replaced_plan_stop_the_extraction(tmp_path):
    store = _store(tmp_path / "s.zarr")
    plan = _plan([0, 1, 2, 3], window=1, val=())
    StreamSession(store).write_plan(plan)
    entries = stream_entries(StreamSession(store), plan, set(), _stats(), timeout_s=0.3, log=print)
    assert next(entries) == 0
    with pytest.raises(InputError, match="entry 1 \\(block 1\\) waits for the trainer .* not running: no heartbeat "
                                         "of it appeared for 0.3 s"):
        next(entries)
    entries = stream_entries(StreamSession(store), plan, set(), _stats(), timeout_s=30, log=print)
    assert next(entries) == 0
    StreamSession(store).write_plan(_plan([3, 2, 1, 0], window=1, val=()))
    with pytest.raises(InputError, match="stream plan was replaced"):
        next(entries)


def test_the_same_run_rewritten_with_another_budget_is_followed(tmp_path):
    """A ``--resume`` with a smaller ``--max-store-bytes`` rewrites the plan (same run, smaller window); an
    extraction that read the old plan follows the new window from its next entry, so the store keeps to the new
    budget (it once kept the old window, the run's identity being unchanged)."""
    store = _store(tmp_path / "s.zarr")
    plan = _plan([0, 1, 2, 3], window=3, val=())
    StreamSession(store).write_plan(plan)
    present = set()
    entries = stream_entries(StreamSession(store), plan, present, _stats(), timeout_s=0.3, log=print)
    for want in (0, 1):
        b = next(entries)
        assert b == want
        _write(store, b)
    StreamSession(store).write_plan(_plan([0, 1, 2, 3], window=1, val=()), keep_consumed=True)  # cursor 0, window 1
    with pytest.raises(InputError, match="entry 2 \\(block 2\\) waits for the trainer .*window 1"):
        next(entries)  # under the old window of 3 it was written at once
    StreamSession(store).write_consumed(2)
    entries = stream_entries(StreamSession(store), _plan([0, 1, 2, 3], window=3, val=()), present, _stats(),
                             timeout_s=30, log=print)
    assert next(entries) == 2 and present == {2}  # the new window [2, 3): blocks 0 and 1 evicted first
    assert not store.is_done(0) and not store.is_done(1)


def test_a_slow_trainer_is_waited_for_and_a_killed_one_stops_the_extraction_at_once(tmp_path):
    """The cursor moves only when the trainer saves (every half window of steps): a trainer whose heartbeat beats
    is waited for however long that takes (here 3x the timeout); a trainer process killed during a wait is seen
    gone at once, not after the timeout."""
    store = _store(tmp_path / "s.zarr")
    plan = _plan([0, 1, 2, 3], window=1, val=())
    StreamSession(store).write_plan(plan)
    trainer = beating_process(store.path, "trainer")
    try:
        entries = stream_entries(StreamSession(store), plan, set(), _stats(), timeout_s=0.5, log=print)
        assert next(entries) == 0
        _write(store, 0)
        threading.Timer(1.5, StreamSession(store).write_consumed, (1,)).start()
        t0 = time.monotonic()
        assert next(entries) == 1 and time.monotonic() - t0 >= 1.4
        _write(store, 1)
        entries = stream_entries(StreamSession(store), plan, {0, 1}, _stats(), timeout_s=60, log=print)
        threading.Timer(0.5, os.kill, (trainer.pid, signal.SIGKILL)).start()
        t0 = time.monotonic()
        with pytest.raises(InputError, match=f"entry 2 \\(block 2\\) waits for the trainer .* peagle-train is not "
                                             f"running: its process {trainer.pid} on this machine is gone"):
            next(entries)
        assert time.monotonic() - t0 < 5
    finally:
        trainer.kill()
        trainer.wait()


class _Engine:
    """Features of ``C2`` tokens per block (random, bf16): extraction without a verifier."""

    def features(self, rows):
        for i, _ in rows:
            yield i, torch.randn(C2, 2, H2).to(torch.bfloat16), torch.randn(C2, H2).to(torch.bfloat16)


C2, H2 = 16, 64


def test_the_reported_peak_is_the_stores_largest_size_after_a_write(tmp_path):
    """The store is largest right after a write fills the window (no eviction before the cursor moves): the
    extraction's ``peak_store_bytes`` is that size, measured after each write. (Before, it was sampled before each
    write and at the end: here a window's block less, the run ending with the trainer past the window.)"""
    n = 8
    store = FeatureStore.create(tmp_path / "s.zarr", n_blocks=n, block_size=C2, max_segments=1, layers=[1, 2],
                                hidden_size=H2, vocab_size=16,
                                verifier={"name_or_path": "v", "hidden_size": H2, "vocab_size": 16})
    for i in range(n):
        store.write_tokens(i, np.arange(C2), np.ones(C2), np.arange(C2), np.array([0, C2]))
    store.write_all_n_tokens(np.full(n, C2))
    store = FeatureStore.open(tmp_path / "s.zarr", mode="r+")
    order, window = [0, 1, 2, 3, 4, 5, 5, 5], 3  # the last entries write nothing: the run ends evicting to block 5
    plan = _plan(order, window=window, val=(7,))
    StreamSession(store).write_plan(plan)
    full = []

    def trainer():  # consumes each entry once it is done; at entry 1 it first waits for the window to fill; it
        # stops at cursor 6, so the extraction evicts there for entries 6 and 7 (else it skips them, consumed)
        k, beat = 0, Heartbeat(store.path, "trainer", period_s=0.1)
        while k < 6:
            if all(store.is_done(order[c]) for c in range(k, min(k + (window if k == 1 else 1), len(order)))):
                if k == 1:
                    time.sleep(0.3)  # (the writer's last write and done flag are on disk)
                    full.append(apparent_bytes(store.path))
                k += 1
                StreamSession(store).write_consumed(k)
            time.sleep(0.02)
        beat.stop()

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    rows = [{"n_tokens": C2}] * n
    _, nonfinite, stats = extract_stream(_Engine(), store, rows, timeout_s=30, label="x", progress=False, log=print,
                                         writer_queue=2, seconds={})
    thread.join()
    block = block_feature_bytes(C2, 2, H2, "bf16")
    assert nonfinite == [] and stats["extractions"] == 7 and len(full) == 1
    held = sum(store.is_done(i) for i in range(n))
    assert held <= 2 and apparent_bytes(store.path) < full[0] - block  # the run ends below its peak
    # the peak: the window's 3 blocks and the validation block (the heartbeats' bytes change by a few as they beat)
    assert abs(stats["peak_store_bytes"] - full[0]) < 256
