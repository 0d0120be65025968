"""The liveness heartbeats of a streaming run (stores/stream/heartbeat.py): a peer that beats is alive however
long it makes no progress; a peer whose beat stops is given up after the timeout; a peer process that is gone on
this machine is given up at once; progress seen by the waiting side counts too (an older peer without heartbeats)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from stores.features.feature_store import FeatureStore
from stores.stream.heartbeat import Heartbeat, PeerWatch, heartbeat_path, process_start, read_heartbeat

REPO = Path(__file__).resolve().parents[3]


def beating_process(store: Path, role: str) -> subprocess.Popen:
    """A process that beats ``role``'s heartbeat in ``store`` (every 0.1 s) until killed; returned once its first
    beat is written."""
    code = ("import sys, time; from stores.stream.heartbeat import Heartbeat; "
            f"h = Heartbeat(sys.argv[1], {role!r}, period_s=0.1); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(store)], cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    deadline = time.monotonic() + 30
    while (read_heartbeat(store, role) or {}).get("pid") != proc.pid:
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.05)
    return proc


def test_a_beating_peer_is_alive_past_the_timeout_and_a_stopped_one_is_given_up(tmp_path):
    beat = Heartbeat(tmp_path, "trainer", period_s=0.05)
    watch = PeerWatch(tmp_path, "trainer", timeout_s=0.3)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:  # three timeouts without any progress: the beat alone keeps it alive
        assert watch.dead() is None
        time.sleep(0.05)
    rec = read_heartbeat(tmp_path, "trainer")
    assert rec["pid"] == os.getpid() and rec["beat"] > 5 and rec["started"] == process_start(os.getpid())
    beat.progress(7)
    time.sleep(0.2)
    assert read_heartbeat(tmp_path, "trainer")["progress"] == 7
    beat.stop()  # this process lives on (so only the timeout can tell): given up 0.3 s after the last beat
    t0 = time.monotonic()
    while (why := watch.dead()) is None:
        assert time.monotonic() - t0 < 2
        time.sleep(0.02)
    assert 0.2 <= time.monotonic() - t0 <= 0.6
    assert f"its heartbeat ({heartbeat_path(tmp_path, 'trainer')}, pid {os.getpid()}" in why and "stopped for 0.3 s" in why


def test_no_heartbeat_is_given_up_after_the_timeout_unless_the_waiting_side_sees_progress(tmp_path):
    clock = [0.0]
    watch = PeerWatch(tmp_path, "extraction", timeout_s=10, clock=lambda: clock[0])
    clock[0] = 9.0
    assert watch.dead() is None
    watch.progressed()  # a block done: an older peer without heartbeats is judged by it
    clock[0] = 18.0
    assert watch.dead() is None
    clock[0] = 19.5
    assert watch.dead() == "no heartbeat of it appeared for 10 s, nor did it make progress"


def test_a_killed_peer_process_is_given_up_at_once(tmp_path):
    proc = beating_process(tmp_path, "extraction")
    watch = PeerWatch(tmp_path, "extraction", timeout_s=60)
    t0 = time.monotonic()
    while watch.alive_seen is None:  # its beat seen to change: a live process
        assert watch.dead() is None and time.monotonic() - t0 < 10
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    why = watch.dead()
    assert why is not None and f"its process {proc.pid} on this machine is gone" in why


def test_a_stale_heartbeat_of_an_earlier_process_is_no_live_peer(tmp_path):
    """The file of a process killed before the watch started: its pid is gone, but the watch never saw it beat,
    so it waits for the timeout (a new peer may be starting)."""
    proc = beating_process(tmp_path, "trainer")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    clock = [0.0]
    watch = PeerWatch(tmp_path, "trainer", timeout_s=5, clock=lambda: clock[0])
    assert watch.dead() is None
    clock[0] = 5.5
    assert "stopped for 5 s" in watch.dead()


def test_the_heartbeats_directory_is_no_stranger_to_zarr(tmp_path):
    """Listing the store's arrays (segment keys, every split) saw the directory as an unknown object and warned."""
    store = FeatureStore.create(tmp_path / "s.zarr", n_blocks=1, block_size=4, max_segments=1, layers=[1],
                                hidden_size=8, vocab_size=16, verifier={"name_or_path": "v", "hidden_size": 8,
                                                                        "vocab_size": 16})
    beat = Heartbeat(store.path, "extraction", period_s=0.05)
    time.sleep(0.2)
    beat.stop()
    assert read_heartbeat(store.path, "extraction") is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keys = list(FeatureStore.open(store.path).group.array_keys())
    assert "done" in keys and not np.isin(["stream_heartbeat"], keys).any()
