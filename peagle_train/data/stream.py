"""The training side of a streaming run (docs/design.md §7 "Streaming", §8): the plan and waiting reads.

Legend: T entries of the run (``max_steps * P``), P blocks per optimizer step (``grad_accum * world``), B the
plan's window, K the consumed cursor, V validation blocks. A unit is what the extraction writes and evicts: a
format-1 store's block, a full-context store's context block (:mod:`stores.stream.plan`).

- :func:`make_plan`: the run's :class:`stores.stream.plan.StreamPlan` from its block sequence (the split and
  every epoch's order are pure functions of ``(seed, n_blocks, val_fraction)`` and the store's segment keys,
  so the plan is made before any feature exists), its budget and its policy; refuses a budget smaller than
  the smallest that works, naming it.
- :class:`StreamingStore`: the store as the loader and validation read it, except that a read waits for the
  block's done flag (then checks its crc32c as every read does); a wait stops the run, naming the extraction's
  log, only when the extraction is dead: its process exited (the one-command form), its process on this machine
  is gone, or neither its heartbeat nor any unit moved for ``timeout_s`` (:mod:`stores.stream.heartbeat`); a slow
  extraction is waited for. The main rank's store beats the trainer's heartbeat, which the extraction waits on;
  its :class:`stores.stream.session.StreamSession` holds the plan and the consumed cursor.

The checkpoints that let extraction move on, and the cursor written after each, are
:class:`peagle_train.train.checkpointer.Checkpointer`'s.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from peagle_train.data.loader import BlockSequence
from stores.errors import ChunkDamageError, InputError, StoreFormatError
from stores.features.feature_schema import ARRAYS, hidden_arrays
from stores.features.feature_store import CONTEXTS, FeatureStore
from stores.stream.heartbeat import HEARTBEAT_DIR
from stores.stream.plan import (POLICIES, STREAM_GROUP, StreamPlan, apparent_bytes, block_feature_bytes, context_reads,
                                flag_bytes, format_size, step_units, unit_store, window_for_budget, window_for_reads)
from stores.stream.session import StreamSession

__all__ = ["PLAN_ALLOWANCE_BYTES", "READ_TRIES", "plan_entries", "make_plan", "fixed_store_bytes", "StreamingStore",
           "planned_tokens", "rerun_note", "ExtractionDied"]


PLAN_ALLOWANCE_BYTES = 8192
"""Bytes allowed for the plan's files besides its order (``stream/zarr.json``, ``stream/order/zarr.json``, the
order chunk's checksum, ``consumed.json`` and its temporary twin) and for the two sides' heartbeat files
(``stream_heartbeat/``, :mod:`stores.stream.heartbeat`, with their temporary twins)."""


class ExtractionDied(StoreFormatError):
    """The extraction a streaming run waits for stopped (exited, or made no progress in the timeout)."""


def plan_entries(sequence: BlockSequence, n_entries: int) -> np.ndarray:
    """``[n_entries] int64``: the blocks of the sequence's first ``n_entries`` entries (cursor order), every
    train-side block usable."""
    out = np.empty(n_entries, dtype=np.int64)
    for k, (_, block) in zip(range(n_entries), sequence.entries(0)):
        out[k] = block
    return out


def _bytes_without_features(directory: Path, hidden: set[str], skip: set[str], n_blocks: int) -> int:
    """The bytes of a store group's files but its feature chunks (a feature array's metadata counts), its done
    flags counted for all its ``n_blocks`` blocks (:func:`stores.stream.plan.flag_bytes`: their files appear as
    blocks are done, so a measure of the files alone grew during the run, and a resume with the budget that
    started it was refused)."""
    flags = {s.name for s in ARRAYS if s.role == "flag"}
    total = 0
    for child in directory.iterdir():
        if child.name in skip:
            continue
        if child.name in hidden or child.name in flags:
            total += sum(p.stat().st_size for p in child.glob("*.json"))
            total += flag_bytes(n_blocks) if child.name in flags else 0
            continue
        total += apparent_bytes(child) if child.is_dir() else child.stat().st_size
    return total


def fixed_store_bytes(store: FeatureStore, n_entries: int) -> int:
    """The store's bytes without its feature chunks, measured now (its token arrays, every block's done flag and
    metadata; a full-context store's: also its ``contexts`` sub-store's), plus the plan's own (``order``
    ``[T] int64`` and its metadata)."""
    hidden = {s.name for s in hidden_arrays(store.storage_dtype)}
    # the plan is counted below, the same whether it is written yet or not
    total = _bytes_without_features(Path(store.path), hidden, {STREAM_GROUP, CONTEXTS, HEARTBEAT_DIR}, store.n_blocks)
    if store.has_views:
        total += _bytes_without_features(Path(store.path) / CONTEXTS, hidden, set(), unit_store(store).n_blocks)
    return total + 8 * n_entries + PLAN_ALLOWANCE_BYTES


def make_plan(store: FeatureStore, sequence: BlockSequence, val_side: np.ndarray, *, max_steps: int,
              blocks_per_step: int, val_max_blocks: int, max_store_bytes: int, policy: str,
              run: dict[str, Any]) -> StreamPlan:
    """The stream plan of a run (see the module doc). A full-context store's plan counts context blocks: the
    window B is the largest whose entries' context blocks, beside the validation blocks' and the fixed arrays,
    fit the budget at every cursor (:func:`stores.stream.plan.window_for_reads`).

    Args:
        store: the run's store (local, token arrays written; a full-context store: not a shard).
        sequence: the run's block sequence (every train-side block usable).
        val_side: ``[m] int64`` the validation side (sorted); the first ``val_max_blocks`` are scored and kept.
        max_steps, blocks_per_step: T = their product.
        max_store_bytes: the budget; policy: one of :data:`stores.stream.plan.POLICIES`.
        run: the run's identity (output, seed, val_fraction, ...).

    Raises:
        InputError: the budget is smaller than the smallest that works (field ``--max-store-bytes``), naming it:
            the fixed arrays, the validation blocks and one step's blocks (``reextract``), or every block the run
            reads (``keep``); a full-context store's: their context blocks.
    """
    if policy not in POLICIES:
        raise InputError(f"--epoch-policy {policy!r}: expected one of {', '.join(POLICIES)}", field="--epoch-policy")
    T = max_steps * blocks_per_step
    order = plan_entries(sequence, T)
    val = tuple(int(b) for b in np.asarray(val_side)[:val_max_blocks])
    fixed = fixed_store_bytes(store, T)
    if store.has_views:
        return _windows_plan(store, order, val, fixed, blocks_per_step=blocks_per_step,
                             max_store_bytes=max_store_bytes, policy=policy, run=run)
    block_bytes = block_feature_bytes(store.block_size, len(store.layers), store.hidden_size, store.storage_dtype)
    window = window_for_budget(max_store_bytes, fixed, block_bytes, len(val))
    distinct = int(np.unique(order).size)
    need = distinct if policy == "keep" else blocks_per_step
    if window < need:
        smallest = fixed + (len(val) + need) * block_bytes
        what = (f"every one of the {distinct} blocks the run reads (--epoch-policy keep keeps them all)" if policy == "keep"
                else f"the {blocks_per_step} block(s) of one optimizer step")
        raise InputError(
            f"--max-store-bytes {max_store_bytes:,} is too small for this run: the store needs {fixed:,} bytes for its "
            f"token arrays, {len(val)} validation block(s) of {block_bytes:,} bytes kept all run, and room for {what}; "
            f"the smallest budget that works is {smallest:,} bytes (--max-store-bytes {format_size(smallest)})"
            + ("; or --epoch-policy reextract, which stays within a smaller budget" if policy == "keep" else ""),
            field="--max-store-bytes")
    if policy == "keep":
        window = T
    return StreamPlan(run=run, policy=policy, max_store_bytes=int(max_store_bytes), fixed_bytes=int(fixed),
                      block_bytes=int(block_bytes), window=int(min(window, max(T, 1))), val_blocks=val, order=order)


def _windows_plan(store: FeatureStore, order: np.ndarray, val: tuple[int, ...], fixed: int, *, blocks_per_step: int,
                  max_store_bytes: int, policy: str, run: dict[str, Any]) -> StreamPlan:
    """:func:`make_plan` of a full-context store: units are its context blocks (see there); ``fixed``: its
    :func:`fixed_store_bytes`."""
    T = int(order.size)
    reads = context_reads(store)
    ctx = store.contexts
    unit_bytes = block_feature_bytes(ctx.block_size, len(ctx.layers), ctx.hidden_size, ctx.storage_dtype)
    val_units = tuple(dict.fromkeys(u for b in val for u in reads[b]))
    capacity = (max_store_bytes - fixed) // unit_bytes - len(val_units)  # units beside the validation ones
    read = {u for b in np.unique(order).tolist() for u in reads[b]} - set(val_units)
    need = len(read) if policy == "keep" else step_units(order, reads, val_units, blocks_per_step)
    if capacity < need:
        smallest = fixed + (len(val_units) + need) * unit_bytes
        what = (f"every one of the {len(read)} context blocks the run reads (--epoch-policy keep keeps them all)"
                if policy == "keep" else f"the {need} context block(s) the {blocks_per_step} training block(s) of "
                "one optimizer step read (at the step that reads the most)")
        raise InputError(
            f"--max-store-bytes {max_store_bytes:,} is too small for this run: the store needs {fixed:,} bytes for its "
            f"token arrays and views, the {len(val_units)} context block(s) of {unit_bytes:,} bytes its validation "
            f"blocks read, kept all run, and room for {what}; the smallest budget that works is {smallest:,} bytes "
            f"(--max-store-bytes {format_size(smallest)})"
            + ("; or --epoch-policy reextract, which stays within a smaller budget" if policy == "keep" else ""),
            field="--max-store-bytes")
    window = T if policy == "keep" else window_for_reads(order, reads, val_units, capacity, blocks_per_step)
    return StreamPlan(run=run, policy=policy, max_store_bytes=int(max_store_bytes), fixed_bytes=int(fixed),
                      block_bytes=int(unit_bytes), window=int(max(1, min(window, T))), val_blocks=val, order=order,
                      reads=reads)


def planned_tokens(session: StreamSession, plan: StreamPlan) -> int:
    """Tokens the verifier runs for the plan's extractions (:meth:`StreamPlan.extraction_counts`, each unit's
    ``n_tokens``): the run's extraction work, to set against an offline extraction's (the units' tokens once)."""
    n_tokens = session.units.n_tokens_per_block()
    return int(sum(k * int(n_tokens[u]) for u, k in plan.extraction_counts().items()))


def rerun_note(session: StreamSession, plan: StreamPlan, epoch_entries: int, epoch_order: str) -> str | None:
    """A note when a full-context plan runs the verifier over more than 1.1x the offline extraction's tokens per
    epoch, counted over the training side's context blocks (the scored validation blocks' are extracted once a
    run and left out; epochs: ``T / epoch_entries``): a context block read again further apart than the window is
    extracted again. The note names the factor and what lowers it. None otherwise (a format-1 store's block is
    read once an epoch)."""
    if plan.reads is None or plan.policy != "reextract" or epoch_entries < 1:
        return None
    n_tokens = session.units.n_tokens_per_block()
    val = set(plan.val_units)
    counts = {u: k for u, k in plan.extraction_counts().items() if u not in val}
    once = sum(int(n_tokens[u]) for u in counts)
    epochs = max(1.0, plan.n_entries / epoch_entries)
    factor = sum(k * int(n_tokens[u]) for u, k in counts.items()) / max(1, once) / epochs
    if factor <= 1.1:
        return None
    fix = ("; --epoch-order conversations (a conversation's windows trained one after another, in the offline run "
           "you compare with too) keeps the training blocks that read a context block together, which brings it "
           "to about 1x at small budgets when context blocks are grouped by training block (--context-packing "
           "training_blocks); or a larger --max-store-bytes, or --epoch-policy keep" if epoch_order == "blocks"
           else "; a larger --max-store-bytes or --epoch-policy keep lowers it")
    return (f"this plan runs the verifier over {factor:.2f}x the tokens of one extraction of the training blocks' "
            f"context blocks, per epoch: context blocks read again further apart than the window ({plan.window} "
            f"entries) are extracted again{fix}")


READ_TRIES = 3
"""Reads of a streamed block before its chunk error is raised (:meth:`StreamingStore.read_block`)."""


class StreamingStore:
    """A store being extracted, read as the run reads it: each read waits for the block's done flag.

    Everything but :meth:`read_block`/:meth:`read_blocks` is the wrapped store's; its stream records (plan,
    cursor, heartbeat, evictions) are :attr:`session`'s.

    Args:
        store: the open ``FeatureStore`` (r+: the trainer writes the cursor and evicts at the end).
        timeout_s: seconds without the extraction's heartbeat and without any new done block (while waiting)
            before giving up (:class:`stores.stream.heartbeat.PeerWatch`).
        extraction_alive: returns None while the extraction runs, else why it stopped (its exit code);
            None: extraction runs elsewhere (split roles), its heartbeat alone tells.
        log_path: the extraction's log, named in the errors.
        heartbeat: beat the trainer's heartbeat from now until :meth:`close` (the main rank of a run).

    Raises (on read):
        ExtractionDied: the extraction exited or is dead (see the module doc).
    """

    def __init__(self, store: FeatureStore, timeout_s: float, extraction_alive: Callable[[], str | None] | None = None,
                 log_path: str | None = None, poll_s: float = 0.05, heartbeat: bool = False):
        self.store, self.timeout_s, self.alive, self.log_path, self.poll_s = store, timeout_s, extraction_alive, log_path, poll_s
        self.wait_s = 0.0
        """Seconds spent waiting for blocks to be extracted."""
        self.session = StreamSession(store)
        """The store's stream session: its plan once written or read, the cursor, the trainer's heartbeat."""
        if heartbeat:
            self.session.beat("trainer")

    def progress(self, step: int) -> None:
        """Record the trainer's step in its heartbeat (shown in the extraction's messages)."""
        self.session.progress(step)

    def close(self) -> None:
        """Stop the trainer's heartbeat (the run's reads are over)."""
        self.session.close()

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def _where(self) -> str:
        return f"; its log: {self.log_path}" if self.log_path else ""

    def wait_done(self, i: int) -> None:
        """Return once block ``i`` is done.

        Raises:
            ExtractionDied: see the class doc.
        """
        if self.store.is_done(i):
            return
        t0 = checked = time.monotonic()
        units = self.session.units  # progress: any unit done (a context block of a full-context store)
        seen = int(units.done_mask().sum())
        watch = self.session.watch("extraction", self.timeout_s)
        while not self.store.is_done(i):
            why = self.alive() if self.alive is not None else None
            if why is not None and not self.store.is_done(i):
                raise ExtractionDied(f"{self.store.path}: block {i} is not extracted and the extraction stopped "
                                     f"({why}){self._where()}")
            now = time.monotonic()
            if now - checked > 1.0:  # (the done flags and the heartbeat file: read once a second)
                checked, done = now, int(units.done_mask().sum())
                if done != seen:
                    seen = done
                    watch.progressed()
                dead = watch.dead()
                if dead is not None and not self.store.is_done(i):
                    raise ExtractionDied(
                        f"{self.store.path}: block {i} is not extracted and the extraction (`peagle-data extract ... "
                        f"--stream --output {self.store.path}`) is not running: {dead} (consumed cursor "
                        f"{self.session.consumed()}){self._where()}")
            time.sleep(self.poll_s)
        self.wait_s += time.monotonic() - t0

    def read_block(self, i: int, via: str = "auto", pin_memory: bool = False):
        """:meth:`FeatureStore.read_block` once block ``i`` is done (its crc32c checked by the read).

        A unit the extraction evicts between the done flag and the read (it evicts by the consumed cursor it read
        last, which the trainer may have moved past meanwhile) makes the read fail as a missing chunk; the read is
        then waited for and tried again, at most :data:`READ_TRIES` times in all: a chunk that is damaged fails
        every time and is raised.

        Raises:
            ChunkDamageError: the block's chunks fail :data:`READ_TRIES` reads.
            ExtractionDied: see :meth:`wait_done`.
        """
        for attempt in range(READ_TRIES):
            self.wait_done(int(i))
            try:
                return self.store.read_block(int(i), via=via, pin_memory=pin_memory)
            except ChunkDamageError:
                if attempt == READ_TRIES - 1:
                    raise
                time.sleep(self.poll_s)

    def read_blocks(self, ids, via: str = "auto", pin_memory: bool = False):
        """:meth:`read_block` of each id, in order."""
        return [self.read_block(int(i), via=via, pin_memory=pin_memory) for i in ids]

    def plan(self) -> StreamPlan | None:
        """The store's stream plan."""
        return self.session.read_plan()
