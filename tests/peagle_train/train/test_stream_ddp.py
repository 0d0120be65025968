"""Split roles (docs/guide-streaming.md, "A cluster"): one ``peagle-data extract --stream`` process and two
data-parallel ``peagle-train --max-store-bytes`` ranks (``accelerate launch --num_processes 2``, gloo on CPU)
without ``--extract-from``, on one store. The final weights equal, bit for bit, those of the same two-rank launch
on the offline store (extracted first), and the store's bytes, sampled every 20 ms by the test while both
run, never pass the budget.

Slow: three processes that each import torch (two trainer ranks and the extraction), twice the launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from stores.features.feature_store import FeatureStore
from stores.stream.plan import apparent_bytes
from stores.stream.session import StreamSession
from tests.peagle_train.train.test_stream import OPTS, _budget, _weights
from tests.processes import launch_two_ranks

REPO = Path(__file__).resolve().parents[3]
STEPS = 6  # two epochs: 6 training blocks (2 held out), two per step (one per rank)
pytestmark = pytest.mark.slow


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _train_args(store: str, out: Path, verifier: Path, *extra: str) -> list[str]:
    args = ["--store", store, "--output", str(out), "--verifier", str(verifier), "--max-steps", str(STEPS), *extra]
    for k, v in OPTS.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def _two_ranks(args: list[str]) -> dict:
    """``accelerate launch --multi_gpu --num_processes 2 -m cli.train ARGS`` (the guide's form; gloo on CPU);
    returns rank 0's summary."""
    res = launch_two_ranks(args, _env(), REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout[res.stdout.index("{"):])


class _PeakBytes(threading.Thread):
    """Samples the store directory's apparent bytes every 20 ms until stopped; ``peak`` is the largest."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.peak, self.samples, self.halt = path, 0, 0, threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.02):
            if self.path.is_dir():
                self.peak = max(self.peak, apparent_bytes(self.path))
                self.samples += 1


def test_split_roles_two_ranks_equal_the_offline_two_rank_run(tmp_path, packed, offline_store, tiny_verifier_dir):
    offline = _two_ranks(_train_args(offline_store, tmp_path / "offline", tiny_verifier_dir))
    assert (offline["world_size"], offline["steps"]) == (2, STEPS)

    store = tmp_path / "stream.zarr"
    budget = _budget(offline_store, window=3)  # room for 3 training blocks beside the 2 validation ones
    sampler = _PeakBytes(store)
    sampler.start()
    extraction = subprocess.Popen(  # machine A of the guide: the store is created here, then follows the plan
        [sys.executable, "-m", "cli.data", "extract", str(packed), "--output", str(store), "--verifier",
         str(tiny_verifier_dir), "--context", "window", "--stream", "--device", "cpu", "--stream-timeout-s", "120"],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        summary = _two_ranks(_train_args(str(store), tmp_path / "stream", tiny_verifier_dir,
                                         "--max-store-bytes", str(budget), "--stream-timeout-s", "120"))
        out, err = extraction.communicate(timeout=120)
    finally:
        if extraction.poll() is None:
            extraction.kill()
        sampler.halt.set()
        sampler.join()
    assert extraction.returncode == 0, err[-3000:]

    a, b = _weights(tmp_path / "offline"), _weights(tmp_path / "stream")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name
    assert summary["val_loss"] == offline["val_loss"] and (summary["world_size"], summary["steps"]) == (2, STEPS)

    opened = FeatureStore.open(store)
    plan = StreamSession(opened).read_plan()
    assert plan.run["blocks_per_step"] == 2 and plan.n_entries == 2 * STEPS and plan.window == 3
    assert StreamSession(opened).consumed() == 2 * STEPS
    assert set(np.flatnonzero(opened.done_mask()).tolist()) == set(plan.val_blocks)  # training blocks evicted
    stream = json.loads(out[out.index("{"):])["stream"]
    assert sampler.samples > 10 and sampler.peak <= budget
    assert stream["peak_store_bytes"] <= budget
    # each training block once per epoch, less those the window of 3 holds across the epoch's end, + 2 val
    assert 2 + 6 * 2 - 2 <= stream["extractions"] <= 2 + 6 * 2
