"""The checkpointer beside the training loop: when a run saves, validates and moves a stream's consumed cursor."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from peagle_train.train.checkpointer import Checkpointer, stream_save_due
from peagle_train.train.config import RunConfig
from stores.stream.plan import StreamPlan
from stores.stream.session import StreamSession


def _plan(window, policy="reextract", n=12):
    return StreamPlan(run={}, policy=policy, max_store_bytes=1, fixed_bytes=0, block_bytes=1, window=window,
                      val_blocks=(), order=np.zeros(n, dtype=np.int64))


def test_saves_are_due_before_the_window_runs_out():
    plan = _plan(window=4)  # P = 1: saves when half the window (2 entries) is consumed since the last save
    saved, due = 0, []
    for step in range(1, 12):
        if stream_save_due(step, 1, saved, plan):
            due.append(step)
            saved = step
    assert due == [2, 4, 6, 8, 10]
    # P = 2, window 3: the next step's 2 entries would pass the window after every step
    assert [s for s in range(1, 6) if stream_save_due(s, 2, 2 * (s - 1), _plan(window=3))] == [1, 2, 3, 4, 5]
    assert not stream_save_due(12, 1, 0, plan)  # the run's end: the final checkpoint follows anyway
    assert not any(stream_save_due(s, 1, 0, _plan(window=2, policy="keep")) for s in range(1, 12))


class _Accelerator:
    is_main_process = True

    def __init__(self):
        self.barriers = 0

    def wait_for_everyone(self):
        self.barriers += 1


def _checkpointer(tmp_path, cfg, plan=None, validates=True, max_steps=12):
    saved: list[str] = []

    def save(name):
        path = tmp_path / "out" / name
        path.mkdir(parents=True)
        (path / "model.safetensors").write_bytes(b"x")
        saved.append(name)
        return path

    stream = None
    if plan is not None:
        session = StreamSession(SimpleNamespace(path=str(tmp_path / "store")))
        session.plan = plan
        stream = SimpleNamespace(session=session, steps=[], wait_s=0.0, progress=None, close=None)
        stream.progress = stream.steps.append
    ckpt = Checkpointer(cfg, max_steps, _Accelerator(), save, blocks_per_step=1, validates=validates, stream=stream)
    return ckpt, saved, stream


def test_a_run_without_stream_saves_every_save_every_steps_and_validates_on_the_main_rank(tmp_path):
    ckpt, saved, _ = _checkpointer(tmp_path, RunConfig(output="o", save_every=5, val_every=4))
    for step in range(1, 13):
        ckpt.step_done(step, step)
    assert saved == ["checkpoint-5", "checkpoint-10"]  # not the last step's: final() saves it
    assert [s for s in range(1, 13) if ckpt.should_validate(s)] == [4, 8]
    assert ckpt.blocks_per_read is None and ckpt.final(12, 12) == {} and saved[-1] == "checkpoint-12"
    none, _, _ = _checkpointer(tmp_path / "b", RunConfig(output="o", val_every=4), validates=False)
    assert not any(none.should_validate(s) for s in range(1, 13))  # no held-out blocks


def test_a_streaming_run_saves_for_the_stream_and_moves_the_consumed_cursor(tmp_path):
    """P = 1, window 4: a save every 2 steps for the stream, besides --save-every 5's; each marks the cursor
    consumed, and a stream-only checkpoint is replaced by the next save (a --save-every one stays)."""
    ckpt, saved, stream = _checkpointer(tmp_path, RunConfig(output="o", save_every=5), plan=_plan(window=4))
    assert ckpt.blocks_per_read == 1
    for step in range(1, 8):
        ckpt.step_done(step, step)
    assert saved == ["checkpoint-2", "checkpoint-4", "checkpoint-5", "checkpoint-7"]
    assert stream.steps == list(range(1, 8))  # the trainer's heartbeat shows the steps
    assert StreamSession(stream.session.store).consumed() == 7
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-5", "checkpoint-7"]  # 2 and 4 replaced
    assert ckpt.saved_cursor == 7 and ckpt.stream_checkpoint == out / "checkpoint-7"
