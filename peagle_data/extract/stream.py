"""Extraction for a streaming run (``extract --stream``, docs/design.md §7 "Streaming").

Legend: T entries of the run, B the plan's window, K the consumed cursor. A unit is a block the verifier
runs: a training block of a format-1 store (``--context window``), a context block of a full-context store
(``--context full``), whose training blocks are views of context blocks.

The store is created (or continued) as for any extraction; then this side waits for the stream plan the
trainer writes into it (:mod:`stores.stream.plan`, through the :class:`stores.stream.session.StreamSession` this
side holds) and follows it: the validation blocks' units first, then
entry ``c = 0 .. T-1`` (training block ``order[c]``) once ``c < K + B``: its units, in order, skipping a unit
that is present (done, or queued for the writer), after evicting the units the window no longer reads (policy
``reextract``). A context block read by several training blocks of one window is so extracted once. The
evictions happen here, on the extraction side, right before a write, so the store's bytes never exceed the
budget; the trainer evicts once more at the end of its run (:mod:`peagle_train.data.stream`). The store's
true peak is measured after each write (:class:`StorePeak`).

Waits on the trainer (for its plan, a rewritten plan, its cursor) last as long as the trainer lives: this side
beats its own heartbeat and gives up only when the trainer's stopped (:mod:`stores.stream.heartbeat`).

A killed extractor continues with ``--resume``: the done units are checked (``repair_blocks``), leftover
feature files of units that are not done are deleted, and the walk starts again from entry 0, skipping
what is present and what was consumed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np

from peagle_data.extract.engine import VerifierEngine, timed
from peagle_data.extract.store import BlockWriter
from stores.errors import InputError, StoreFormatError
from stores.features.feature_store import FeatureStore
from runtime.progress import progress as progress_bar
from stores.stream.plan import StreamPlan
from stores.stream.session import StreamSession

__all__ = ["wait_for_plan", "followed_plan", "StorePeak", "stream_entries", "extract_stream", "POLL_S"]

POLL_S = 0.2
"""Seconds between two reads of the plan or of the consumed cursor while waiting."""


def wait_for_plan(session: StreamSession, timeout_s: float, log: Callable[[str], None]) -> StreamPlan:
    """The store's stream plan, waiting for ``peagle-train`` to write it while its heartbeat beats (a trainer
    loading or checking for long is waited for), up to ``timeout_s`` without it
    (:class:`stores.stream.heartbeat.PeerWatch`).

    Raises:
        InputError: no plan and the trainer dead or never seen for ``timeout_s`` (field ``--stream``), naming the
            command that writes it.
    """
    store, watch, told = session.store, session.watch("trainer", timeout_s), False
    while True:
        plan = session.read_plan()
        if plan is not None:
            return plan
        if not told:
            log(f"{store.path}: waiting for the stream plan (`peagle-train --store {store.path} --max-store-bytes "
                "SIZE ...` writes it)")
            told = True
        why = watch.dead()
        if why is not None:
            raise InputError(f"{store.path}: no stream plan, and peagle-train is not running ({why}): start "
                             f"`peagle-train --store {store.path} --max-store-bytes SIZE ...`, which writes it",
                             field="--stream")
        time.sleep(POLL_S)


def _clear_leftovers(store: FeatureStore, log: Callable[[str], None]) -> int:
    """Delete the feature files of units that are not done (a killed extraction's unit in flight, an
    eviction cut short; ``store``: the units' store): they would count against the budget. Returns how many
    units had some."""
    n = 0
    done = store.done_mask()
    for i in np.flatnonzero(~done).tolist():
        if any(p.exists() for p in store.feature_chunk_paths(i)):
            store.evict_block(i)
            n += 1
    if n:
        log(f"{store.path}: deleted the feature files of {n} block(s) that were not done")
    return n


def followed_plan(session: StreamSession, plan: StreamPlan, timeout_s: float,
                  log: Callable[[str], None]) -> StreamPlan:
    """The plan to follow from the next entry on: ``plan``, or the same run's plan as the trainer rewrote it with
    another budget (a ``--resume`` with another ``--max-store-bytes``: its window is followed from here, so the
    store stays within the new budget; it was once followed with the old window). A rewrite in progress (no
    plan attributes for a moment) is waited out.

    Raises:
        InputError: the plan was replaced by another run's (a new ``peagle-train`` run on this store), or stays
            missing while the trainer is dead for ``timeout_s`` (field ``--stream``).
    """
    store, watch = session.store, None
    while True:
        record = session.plan_record()
        if record == plan.record():
            return plan
        new = session.read_plan() if record is not None else None
        if new is not None and not new.same_run(plan):
            raise InputError(f"{store.path}: its stream plan was replaced (a new peagle-train run started on this "
                             "store); start the extraction again to follow the new plan", field="--stream")
        if new is not None:
            log(f"{store.path}: the stream plan was rewritten for another budget ({new.max_store_bytes:,} bytes, "
                f"window {new.window} blocks); following it")
            return new
        watch = watch or session.watch("trainer", timeout_s)
        why = watch.dead()
        if why is not None:
            raise InputError(f"{store.path}: its stream plan was removed and not written again, and peagle-train is "
                             f"not running ({why}); start the extraction again with the run", field="--stream")
        time.sleep(POLL_S)


class StorePeak:
    """The true peak of a streaming store's bytes (:meth:`StreamSession.bytes`): measured right
    after each unit's write (its features and done flag), under :attr:`lock`, which evictions hold too, so no
    eviction falls between a write and its measure. The store grows only by writes (the plan's own and
    heartbeat files aside, within the plan's allowance), so its largest size is one of these measures.
    ``peak`` starts at the store's bytes when made."""

    def __init__(self, session: StreamSession):
        self.session, self.lock = session, threading.Lock()
        self.peak = session.bytes()

    def measure(self, _unit: int | None = None) -> int:
        """Measure now (call with :attr:`lock` held); returns the peak so far."""
        self.peak = max(self.peak, self.session.bytes())
        return self.peak


def stream_entries(session: StreamSession, plan: StreamPlan, present: set[int], stats: dict[str, Any],
                   timeout_s: float, log: Callable[[str], None], lock=None) -> Iterator[int]:
    """The units to extract, in plan order, each when the plan allows it (see the module doc); evicts as it
    goes. ``session``: that of the store the plan is in (a full-context store's root); ``present``: the units with
    features now (updated here); ``stats`` gets ``evicted``, ``waits``, ``wait_s``; ``lock``: held around
    evictions (:class:`StorePeak`'s).

    A wait for the trainer's cursor lasts as long as the trainer lives: it stops when the trainer's heartbeat
    (:mod:`stores.stream.heartbeat`) and its cursor both stood still for ``timeout_s``, or at once when the
    trainer's process on this machine is gone; a slow trainer is waited for.

    Raises:
        InputError: a write waited on the cursor and the trainer is dead (see above), naming the entry and the
            cursor.
    """
    store, session.plan = session.store, plan  # the plan the evictions follow
    for u in plan.val_units:
        if u not in present:
            present.add(u)
            yield u
    evicted_at = None  # the cursor of the last eviction: at the same cursor, nothing more is evictable
    for c in range(plan.n_entries):
        b = int(plan.order[c])
        consumed = session.consumed()  # read at every entry: evictions follow the trainer's latest cursor
        if c < consumed:  # consumed already (a resumed extraction, or by the trainer meanwhile): nothing to write
            continue
        followed = followed_plan(session, plan, timeout_s, log)
        if followed is not plan:  # another budget: its window may evict more at the same cursor
            plan, evicted_at = followed, None
            session.plan = plan
        if not plan.may_write(c, consumed):
            t0 = time.monotonic()
            stats["waits"] += 1
            watch, seen = session.watch("trainer", timeout_s), consumed
            while not plan.may_write(c, consumed := session.consumed()):
                if consumed != seen:
                    watch.progressed()
                    seen = consumed
                why = watch.dead()
                if why is not None:
                    raise InputError(f"{store.path}: entry {c} (block {b}) waits for the trainer to consume entries "
                                     f"(cursor {consumed}, window {plan.window}), and peagle-train is not running: "
                                     f"{why}", field="--stream-timeout-s")
                time.sleep(POLL_S)
            stats["wait_s"] += time.monotonic() - t0
            if c < consumed:  # the trainer consumed it meanwhile (its units were present): nothing to write, and
                continue  # what the window evicts now must not come back for it
        if consumed != evicted_at:  # (units added since were read by the window)
            with lock or contextlib.nullcontext():
                for e in session.evict(present, consumed):
                    present.discard(e)
                    stats["evicted"] += 1
            evicted_at = consumed
        for u in plan.units_of(b):
            if u in present:
                continue
            present.add(u)
            yield u


def extract_stream(engine: VerifierEngine, store: FeatureStore, rows, timeout_s: float, label: str,
                   progress: bool, log: Callable[[str], None], writer_queue: int,
                   seconds: dict[str, float]) -> tuple[int, list[int], dict]:
    """Extract ``store``'s units as its stream plan says (see the module doc); adds to ``seconds`` ``engine_s``
    (waiting on the engine's features and, through the plan, on the trainer: ``stats["wait_s"]``),
    ``store_write_s`` and ``writer_wait_s`` (:class:`BlockWriter`'s ``write_s``, ``put_s``).

    Args:
        store: the store (a full-context store's root, whose ``contexts`` sub-store gets the features).
        rows: the units' packed rows (a full-context store's: its context blocks').

    Returns:
        ``(tokens extracted, units left not done for NaN/Inf hidden states, stats)``; ``stats``:
        ``extractions`` (units extracted by this process), ``evicted``, ``waits``, ``wait_s``,
        ``peak_store_bytes`` (the store's true peak: measured after each write, :class:`StorePeak`), ``plan``
        (its record).

    Raises:
        StoreFormatError: a full-context shard store (its training blocks read other shards' context blocks),
            a plan that reads blocks past the store's.
        InputError: see :func:`wait_for_plan`, :func:`stream_entries`.
    """
    if store.has_views and store.attrs.get("shard"):
        raise StoreFormatError(f"{store.path}: --stream extracts a whole store, not a shard")
    session = StreamSession(store)
    units = session.units
    plan = wait_for_plan(session, timeout_s, log)
    if max(plan.order.max(initial=-1), max(plan.val_blocks, default=-1)) >= store.n_blocks or max(
            (max(r, default=-1) for r in plan.reads or ()), default=-1) >= units.n_blocks:
        raise StoreFormatError(f"{store.path}: its stream plan reads blocks past its {store.n_blocks}; the plan "
                               "belongs to another store")
    _clear_leftovers(units, log)
    present = set(np.flatnonzero(units.done_mask()).tolist())
    stats: dict[str, Any] = {"extractions": 0, "evicted": 0, "waits": 0, "wait_s": 0.0, "peak_store_bytes": 0,
                             "plan": plan.record()}
    what = "context blocks" if plan.reads is not None else "blocks"
    log(f"{store.path}: streaming {plan.n_entries} entries (policy {plan.policy}, window {plan.window} entries, "
        f"{what} of {plan.block_bytes:,} bytes, budget {plan.max_store_bytes:,} bytes), the {len(plan.val_units)} "
        f"{what} of {len(plan.val_blocks)} validation blocks first")
    peak = StorePeak(session)
    writer = BlockWriter(units, writer_queue, lock=peak.lock, after_write=peak.measure)
    tokens = 0
    bar = progress_bar(total=plan.extractions(), desc=label, unit="block", disable=not progress)
    session.beat("extraction")  # the trainer waits on it, not on progress
    try:
        entries = stream_entries(session, plan, present, stats, timeout_s, log, lock=peak.lock)
        for i, aux, final in timed(engine.features((i, rows[i]) for i in entries), seconds, "engine_s"):
            writer.put(i, aux, final)
            tokens += int(rows[i]["n_tokens"])
            stats["extractions"] += 1
            session.progress(stats["extractions"])
            bar.update(1)
            bar.set_postfix(tokens=f"{tokens:,}")
    finally:
        try:
            writer.close()
        finally:
            session.close()
            bar.close()
            seconds.update(store_write_s=writer.write_s, writer_wait_s=writer.put_s)
    with peak.lock:
        stats["peak_store_bytes"] = peak.measure()
    return tokens, sorted(writer.nonfinite), stats
