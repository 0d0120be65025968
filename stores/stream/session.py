"""One streaming run's records in its feature store, behind one object (docs/design.md §7, "Streaming").

A :class:`StreamSession` is opened once on a store by each side of a streaming run (the extraction, the trainer)
and held for the run: it reads and writes the plan and the consumed cursor (:mod:`stores.stream.plan`), beats
this side's heartbeat and watches the peer's (:mod:`stores.stream.heartbeat`), and evicts the units the plan no
longer reads. The files and their formats are those of those two modules; the session adds none.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import numpy as np

from stores.stream.heartbeat import HEARTBEAT_S, Heartbeat, PeerWatch
from stores.stream.plan import (StreamPlan, apparent_bytes, fsync_tree, has_plan, plan_record, read_consumed,
                                read_plan, remove_plan, unit_store, write_consumed, write_plan)

__all__ = ["StreamSession"]


class StreamSession:
    """The stream plan, consumed cursor, heartbeat and evictions of one store (see the module doc).

    Args:
        store: the open ``FeatureStore`` (local; a full-context store's root; r+ to write the plan or the cursor,
            or to evict).

    Attributes:
        store: that store.
        plan: the plan this side follows: the last one read (:meth:`read_plan`) or written (:meth:`write_plan`);
            None before.
    """

    def __init__(self, store):
        self.store = store
        self.plan: StreamPlan | None = None
        self._heartbeat: Heartbeat | None = None

    @property
    def path(self) -> str:
        """The store's path."""
        return self.store.path

    @property
    def units(self):
        """The store whose blocks are the plan's units (:func:`stores.stream.plan.unit_store`)."""
        return unit_store(self.store)

    # ------------------------------------------------------------------------------------------ the plan
    def has_plan(self) -> bool:
        """Whether the store holds a stream plan (:func:`stores.stream.plan.has_plan`)."""
        return has_plan(self.store)

    def read_plan(self) -> StreamPlan | None:
        """The store's plan as written now (None: none, or one being written), kept as :attr:`plan` when there is
        one.

        Raises:
            StoreFormatError: see :func:`stores.stream.plan.read_plan`.
        """
        plan = read_plan(self.store)
        if plan is not None:
            self.plan = plan
        return plan

    def plan_record(self) -> dict[str, Any] | None:
        """The attributes of the plan as written now, read from its metadata file alone
        (:func:`stores.stream.plan.plan_record`)."""
        return plan_record(self.store)

    def write_plan(self, plan: StreamPlan, keep_consumed: bool = False, consumed: int = 0,
                   checkpoint: str | os.PathLike | None = None) -> None:
        """Write ``plan`` (:func:`stores.stream.plan.write_plan`: the cursor set to ``consumed``, or kept with
        ``keep_consumed``); it becomes :attr:`plan`. ``checkpoint``: the saved training state at ``consumed``,
        fsync'd first (:func:`stores.stream.plan.fsync_tree`)."""
        if checkpoint is not None:
            fsync_tree(checkpoint)
        write_plan(self.store, plan, keep_consumed=keep_consumed, consumed=consumed)
        self.plan = plan

    def remove_plan(self) -> None:
        """Delete the store's plan and consumed cursor, when it has a plan (a new run replaces the old one's)."""
        if has_plan(self.store):
            remove_plan(self.store)

    # ------------------------------------------------------------------------------------------ the cursor
    def consumed(self) -> int:
        """The consumed cursor (entries; 0 when none was written)."""
        return read_consumed(self.store)

    def mark_consumed(self, checkpoint: str | os.PathLike, cursor: int) -> None:
        """After ``checkpoint`` (holding the training state at ``cursor``) was saved: fsync it, then write the
        durable consumed cursor (:func:`stores.stream.plan.write_consumed`); never lowers the cursor."""
        fsync_tree(checkpoint)
        if cursor > read_consumed(self.store):
            write_consumed(self.store, cursor)

    # ------------------------------------------------------------------------------------------ eviction
    def evict(self, present: Iterable[int], consumed: int) -> list[int]:
        """Evict the units of ``present`` that :attr:`plan` no longer reads at cursor ``consumed``
        (:meth:`StreamPlan.evictable`); returns them, sorted."""
        gone = self.plan.evictable(present, consumed)
        units = self.units
        for u in gone:
            units.evict_block(u)
        return gone

    def evict_after_run(self) -> int:
        """At the end of a run whose last checkpoint is saved and consumed cursor written: evict the units the
        plan no longer needs (``reextract``: every training block's; the validation blocks' stay). Returns how many."""
        present = np.flatnonzero(self.units.done_mask()).tolist()
        return len(self.evict(present, read_consumed(self.store)))

    def bytes(self) -> int:
        """The store's apparent bytes now (:func:`stores.stream.plan.apparent_bytes`: what the budget counts)."""
        return apparent_bytes(self.store.path)

    # ------------------------------------------------------------------------------------------ liveness
    def beat(self, role: str, period_s: float = HEARTBEAT_S) -> None:
        """Start this process's heartbeat as ``role`` (one of :data:`stores.stream.heartbeat.ROLES`) until
        :meth:`close`."""
        self._heartbeat = Heartbeat(self.store.path, role, period_s)

    def progress(self, n: int) -> None:
        """Record this side's progress (steps, units) in its heartbeat, when it beats."""
        if self._heartbeat is not None:
            self._heartbeat.progress(n)

    def watch(self, role: str, timeout_s: float) -> PeerWatch:
        """A watch of the peer ``role`` for one wait (:class:`stores.stream.heartbeat.PeerWatch`)."""
        return PeerWatch(self.store.path, role, timeout_s)

    def close(self) -> None:
        """Stop this side's heartbeat (the file stays: the peer sees its beat stop)."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
