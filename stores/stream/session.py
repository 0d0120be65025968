"""One streaming run's records in its feature store, behind one object (docs/design.md §7, "Streaming").

A :class:`StreamSession` is opened once on a store by each side of a streaming run (the extraction, the trainer)
and held for the run: it reads and writes the plan (its record and format: :class:`stores.stream.plan.StreamPlan`)
and the consumed cursor (``STORE/stream/consumed.json``, the module doc of :mod:`stores.stream.plan`), beats this
side's heartbeat and watches the peer's (:mod:`stores.stream.heartbeat`), and evicts the units the plan no longer
reads.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import zarr

from stores.errors import StoreFormatError
from stores.files import is_local
from stores.stream.heartbeat import HEARTBEAT_S, Heartbeat, PeerWatch
from stores.stream.plan import CONSUMED_FILE, STREAM_GROUP, StreamPlan, apparent_bytes, unit_store

__all__ = ["StreamSession", "fsync_tree"]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(directory: str | os.PathLike) -> None:
    """fsync every file under ``directory``, the directories, and its parent (so that a renamed-into-place
    checkpoint survives a power loss before the consumed cursor that depends on it is written)."""
    directory = Path(directory)
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))
    _fsync_dir(directory.parent)


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

    def _dir(self) -> Path:
        """``STORE/stream``.

        Raises:
            StoreFormatError: a store that is not local (the consumed cursor is a file).
        """
        if not is_local(self.store.path):
            raise StoreFormatError(f"{self.store.path}: streaming needs a local store (the consumed cursor is a file)")
        return Path(self.store.path) / STREAM_GROUP

    # ------------------------------------------------------------------------------------------ the plan
    def has_plan(self) -> bool:
        """Whether the store holds a stream plan."""
        return (Path(self.store.path) / STREAM_GROUP / "zarr.json").is_file()

    def read_plan(self) -> StreamPlan | None:
        """The store's plan as written now (None: none, or one being written: its attributes come last), kept as
        :attr:`plan` when there is one.

        Raises:
            StoreFormatError: see :meth:`StreamPlan.from_record`.
        """
        if not self.has_plan():
            return None
        group = zarr.open_group(str(self._dir()), mode="r")
        rec = dict(group.attrs).get("peagle_stream")
        if rec is None:  # the attributes come last: a plan being written
            return None
        plan = StreamPlan.from_record(rec, np.asarray(group["order"][:], dtype=np.int64), self.store)
        self.plan = plan
        return plan

    def plan_record(self) -> dict[str, Any] | None:
        """The attributes of the plan as written now (:meth:`StreamPlan.record`; None: no plan, or one being
        written), read from its metadata file alone: cheap enough for an extraction to check before each block
        that its plan was not rewritten."""
        try:
            return json.loads((self._dir() / "zarr.json").read_text())["attributes"]["peagle_stream"]
        except (FileNotFoundError, KeyError, json.JSONDecodeError):
            return None

    def write_plan(self, plan: StreamPlan, keep_consumed: bool = False, consumed: int = 0,
                   checkpoint: str | os.PathLike | None = None) -> None:
        """Write ``plan`` into the store's ``stream`` sub-group (replacing one there) and set the consumed cursor
        to ``consumed`` (0: a new run; a resumed run whose store has no plan: its checkpoint's cursor, once that
        ``checkpoint`` is on disk: fsync'd here first), or with ``keep_consumed`` (the same run with another
        budget) keep it; the attributes last, so a reader never sees a plan without its order and cursor. It
        becomes :attr:`plan`."""
        if checkpoint is not None:
            fsync_tree(checkpoint)
        consumed = self.consumed() if keep_consumed else consumed
        group = zarr.open_group(str(self._dir()), mode="w")
        order = np.ascontiguousarray(plan.order, dtype=np.int64)
        arr = group.create_array("order", shape=order.shape, dtype="int64", chunks=(max(1, order.size),))
        arr[:] = order
        self.write_consumed(consumed)
        group.attrs["peagle_stream"] = plan.record()
        self.plan = plan

    def remove_plan(self) -> None:
        """Delete the store's stream plan and consumed cursor (a new run of the same output replaces its plan; the
        features present stay, they are the same for any plan)."""
        path = Path(self.store.path) / STREAM_GROUP
        if path.is_dir():
            shutil.rmtree(path)

    # ------------------------------------------------------------------------------------------ the cursor
    def consumed(self) -> int:
        """The consumed cursor (entries; 0 when none was written)."""
        try:
            return int(json.loads((self._dir() / CONSUMED_FILE).read_text())["consumed"])
        except FileNotFoundError:
            return 0

    def write_consumed(self, consumed: int) -> None:
        """Durably set the consumed cursor: a temporary file written and fsync'd, renamed over the old one, the
        directory fsync'd. Call only once the training state past ``consumed`` entries is on disk."""
        directory = self._dir()
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{CONSUMED_FILE}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps({"consumed": int(consumed), "time": time.time()}))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / CONSUMED_FILE)
        _fsync_dir(directory)

    def mark_consumed(self, checkpoint: str | os.PathLike, cursor: int) -> None:
        """After ``checkpoint`` (holding the training state at ``cursor``) was saved: fsync it, then write the
        durable consumed cursor (:meth:`write_consumed`); never lowers the cursor."""
        fsync_tree(checkpoint)
        if cursor > self.consumed():
            self.write_consumed(cursor)

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
        return len(self.evict(present, self.consumed()))

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
