"""When a training run saves, validates and lets a streaming extraction move on (docs/design.md §7 "Streaming",
§8): :class:`Checkpointer`, held by the :class:`peagle_train.train.trainer.Trainer` beside its loop (torchtitan's
``CheckpointManager`` and validator: the loop reports each step, the checkpointer decides).

Legend: P blocks per optimizer step (``grad_accum * world``), B the stream plan's window, K the consumed cursor.

- a ``checkpoint-N/`` every ``--save-every`` steps, and in a streaming run also when :func:`stream_save_due`
  (deterministic: the window and P decide it, never timing; saving changes no weight);
- after each save on a streaming run (main rank): the checkpoint fsync'd, then the durable consumed cursor written
  (:meth:`stores.stream.session.StreamSession.mark_consumed`), so extraction may evict and write further; a save
  made only for the stream replaces the previous one;
- a validation every ``--val-every`` steps (:meth:`RunConfig.val_interval`) on the main rank, when there are
  held-out blocks;
- at the end (:meth:`Checkpointer.final`): the last checkpoint, and the units the plan no longer needs evicted.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

from peagle_train.data.stream import StreamingStore, planned_tokens
from peagle_train.train.config import RunConfig
from stores.stream.plan import StreamPlan

__all__ = ["Checkpointer", "stream_save_due"]


def stream_save_due(step: int, blocks_per_step: int, saved_cursor: int, plan: StreamPlan) -> bool:
    """Whether the trainer saves after ``step`` (cursor ``step * P``) so that extraction can go on: the next
    step's entries would pass the window of the last saved cursor, or half the window has been consumed since
    it. Never with policy ``keep`` (nothing waits on the cursor) or after the run's last entry."""
    cursor = step * blocks_per_step
    if plan.policy == "keep" or cursor >= plan.n_entries:
        return False
    return cursor + blocks_per_step > saved_cursor + plan.window or cursor - saved_cursor >= max(
        blocks_per_step, plan.window // 2)


class Checkpointer:
    """The run's save, validation and stream decisions (see the module doc).

    Args:
        cfg: the run's ``--save-every``, ``--val-every`` settings.
        max_steps: the run's optimizer steps (no save or validation of its own after the last: :meth:`final`).
        accelerator: the run's ``accelerate.Accelerator`` (saves wait for every rank; the main rank writes).
        save: saves ``output/NAME`` (drafter and training state) and returns its path (main rank).
        blocks_per_step: P.
        validates: whether the run has held-out blocks to score.
        stream: a streaming run's store (its session holds the plan, the cursor, the trainer's heartbeat); None:
            the store is complete.
    """

    def __init__(self, cfg: RunConfig, max_steps: int, accelerator, save: Callable[[str], Path], *,
                 blocks_per_step: int, validates: bool, stream: StreamingStore | None = None):
        self.cfg, self.max_steps, self.accelerator, self.save = cfg, max_steps, accelerator, save
        self.blocks_per_step, self.validates, self.stream = blocks_per_step, validates, stream
        self.main = accelerator.is_main_process
        self.saved_cursor = 0
        """The block cursor of the last checkpoint saved (and marked consumed): 0, or a resumed run's."""
        self.stream_checkpoint: Path | None = None
        """The last checkpoint saved only for the stream (not a ``--save-every`` one), which the next such save
        replaces."""

    @property
    def blocks_per_read(self) -> int | None:
        """Blocks the loader reads per request: 1 on a streaming run (a request never waits on a block past the
        plan's window); None: the loader's default."""
        return 1 if self.stream is not None else None

    def step_done(self, step: int, cursor: int) -> None:
        """After optimizer step ``step`` (the run's block cursor now ``cursor``): the step goes into the trainer's
        heartbeat, and ``checkpoint-{step}`` is saved when ``--save-every`` or the stream asks (not after the last
        step: :meth:`final`). Every rank calls it."""
        if self.stream is not None:
            self.stream.progress(step)  # shown in the extraction's messages (its heartbeat beats regardless)
        every = self.cfg.save_every
        if every and step % every == 0 and step < self.max_steps:
            self._save(step, cursor, stream_only=False)
        elif self.stream is not None and stream_save_due(step, self.blocks_per_step, self.saved_cursor,
                                                         self.stream.session.plan):
            self._save(step, cursor, stream_only=True)  # a save for the extraction to go on: changes no weight

    def should_validate(self, step: int) -> bool:
        """Whether this rank validates after ``step``: the main rank, every ``--val-every`` steps before the last,
        with held-out blocks."""
        return (self.main and step % self.cfg.val_interval(self.max_steps) == 0 and step < self.max_steps
                and self.validates)

    def final(self, step: int, cursor: int) -> dict[str, Any]:
        """Main rank, after the last step: save ``checkpoint-{step}``; a streaming run's then evicts what the plan
        no longer needs. Returns the summary entries: ``stream`` (policy, window, entries, units, planned
        extractions and their tokens, seconds the reads waited, units evicted at the end); ``{}`` without a
        stream."""
        self._consumed(self.save(f"checkpoint-{step}"), cursor, stream_only=False)
        if self.stream is None:
            return {}
        session = self.stream.session
        plan = session.plan
        evicted = session.evict_after_run()
        return {"stream": {"policy": plan.policy, "window": plan.window, "entries": plan.n_entries,
                           "units": "context_blocks" if plan.reads is not None else "blocks",
                           "planned_extractions": plan.extractions(),
                           "planned_extraction_tokens": planned_tokens(session, plan),
                           "read_wait_s": round(self.stream.wait_s, 3), "evicted_at_end": evicted}}

    def close(self) -> None:
        """Every read of the run is done: a streaming run's trainer heartbeat stops."""
        if self.stream is not None:
            self.stream.close()

    def _save(self, step: int, cursor: int, stream_only: bool) -> None:
        self.accelerator.wait_for_everyone()
        if self.main:
            self._consumed(self.save(f"checkpoint-{step}"), cursor, stream_only)
        self.saved_cursor = cursor

    def _consumed(self, checkpoint: Path, cursor: int, stream_only: bool) -> None:
        """Main rank, a streaming run, after ``checkpoint`` was saved: fsync it and write the durable consumed
        cursor; the previous stream-only checkpoint is removed once this one is on disk (``--save-every`` ones and
        ``--save-total-limit`` are the user's)."""
        if self.stream is None:
            return
        self.stream.session.mark_consumed(checkpoint, cursor)
        old, self.stream_checkpoint = self.stream_checkpoint, checkpoint if stream_only else None
        if old is not None and old != checkpoint and old.is_dir():
            shutil.rmtree(old)
