"""The stream plan of a feature store trained while it is extracted (docs/design.md §7, "Streaming").

Legend: N training blocks of the store, T entries of the run (``max_steps * blocks_per_step``), B the window
(entries the budget holds at once), V validation blocks kept for the whole run, P blocks per optimizer step. A
**unit** is what the extraction writes and evicts: a block of a format-1 store (``--context window``), or a
context block of a full-context store (``--context full``, whose training blocks are views of context blocks).

A streaming run (``peagle-train --max-store-bytes``) trains on a store whose features are extracted while it
trains, in the order it reads them, and stays within a byte budget. This module defines the two records of such
a run inside the store, in the sub-group ``stream`` of the store's zarr group; they are read and written through
one :class:`stores.stream.session.StreamSession` per side:

- the **plan** (``stream/zarr.json`` attributes ``peagle_stream``, and the array ``stream/order``
  ``[T] int64``): written once by the trainer (rank 0) when the run starts, read by every extraction
  process: the run's identity (its output directory, seed, split, steps), the epoch ``policy``
  (:data:`POLICIES`), the budget, the bytes of one unit's features, the window ``B`` and the validation
  blocks, and ``order``: entry ``c`` of the run reads training block ``order[c]``. Format 1 is a format-1
  store's plan; format 2 a full-context store's (``layout: "windows"``): the units training block ``i`` reads
  are the context blocks of its views (:func:`context_reads`, read from the store, their digest recorded);
- the **consumed cursor** (``stream/consumed.json``): the number of entries the trainer has durably
  consumed, written (fsync'd, renamed) only after the checkpoint that holds the training state past them
  is itself on disk (:meth:`stores.stream.session.StreamSession.mark_consumed`). A crash can therefore never
  leave the trainer needing a unit that was deleted: deletion follows the cursor, the cursor follows a saved
  state.

The rules both sides follow (pure functions of the plan and the cursor ``K``):

- extraction writes entry ``c`` (the units of its training block not present, in their order) only when
  ``c < K + B`` (:meth:`StreamPlan.may_write`); the units of the validation blocks first;
- with policy ``reextract``, a present unit that no entry of ``[K, K + B)`` reads and no validation block
  reads is evicted (:meth:`StreamPlan.evictable`): its done flag cleared, then its feature chunk files
  deleted (:meth:`stores.features.feature_store.FeatureStore.evict_block`); it is extracted again when a later entry
  reads it. A context block shared by training blocks within one window is so extracted once. With ``keep``
  nothing is evicted (each unit is extracted once; the budget must hold every unit the run reads).

So the store holds at most the fixed arrays and the units of the validation blocks and of one window:
``fixed_bytes + |units(val) ∪ units(order[K:K+B])| * unit_bytes <= max_store_bytes`` for every cursor ``K``
(a multiple of P); for a format-1 store that is ``fixed_bytes + (V + B) * block_bytes`` (:func:`window_for_budget`),
for a full-context one B is the largest window that holds it at every K (:func:`window_for_reads`); sizes are
apparent file sizes (the sum of the files' lengths, chunk checksums included).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Iterable

import numpy as np

from stores.errors import InputError, StoreFormatError
from stores.features.feature_schema import ARRAYS, hidden_arrays

__all__ = ["STREAM_GROUP", "STREAM_FORMAT", "WINDOWS_STREAM_FORMAT", "POLICIES", "CONSUMED_FILE", "parse_size",
           "format_size", "block_feature_bytes", "flag_bytes", "fixed_bytes_estimate", "StreamPlan", "apparent_bytes",
           "window_for_budget", "window_for_reads", "step_units", "context_reads", "unit_store"]

STREAM_GROUP = "stream"
"""The store's sub-group holding the plan and the consumed cursor."""
STREAM_FORMAT = 1
"""Version of the plan record of a format-1 store (``--context window``: every training block is one unit)."""
WINDOWS_STREAM_FORMAT = 2
"""Version of the plan record of a full-context store (``--context full``: the units are context blocks, read
through the training blocks' views). A reader refuses a format it does not know."""
POLICIES = ("reextract", "keep")
"""Epoch policies: ``reextract`` (stay within the budget; a later epoch extracts its blocks again) and ``keep``
(every block stays once extracted: today's store, but training starts on the first block)."""
CONSUMED_FILE = "consumed.json"
"""The consumed cursor's file in the ``stream`` sub-group."""
CRC_BYTES = 4
"""The crc32c each chunk file ends with."""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE | re.ASCII)
_UNITS = {"": 1, "b": 1, "k": 10 ** 3, "kb": 10 ** 3, "m": 10 ** 6, "mb": 10 ** 6, "g": 10 ** 9, "gb": 10 ** 9,
          "t": 10 ** 12, "tb": 10 ** 12, "p": 10 ** 15, "pb": 10 ** 15, "kib": 2 ** 10, "mib": 2 ** 20,
          "gib": 2 ** 30, "tib": 2 ** 40, "pib": 2 ** 50, "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30,
          "ti": 2 ** 40, "pi": 2 ** 50}


def parse_size(text: str | int, option: str = "--max-store-bytes") -> int:
    """Bytes of a size: plain bytes (``1048576``), SI (``20GB`` = 20·10⁹, ``500M``) or binary units
    (``512MiB`` = 512·2²⁰, ``1GiB``), case-insensitive, computed exactly in decimal (``2.01GB`` =
    2,010,000,000, not the float product's 2,009,999,999); a fraction of a byte is dropped (``1.5KiB`` = 1536,
    ``0.001KiB`` = 1).

    Raises:
        InputError: not a size, or less than one byte (field ``option``).
    """
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.match(str(text))
        if not m or m.group(2) is not None and m.group(2).lower() not in _UNITS:
            raise InputError(f"{option} {text!r} is not a size: give bytes (1048576), SI units (20GB, 500MB) or "
                             "binary units (512MiB, 1GiB)", field=option)
        value = math.floor(Fraction(m.group(1)) * _UNITS[(m.group(2) or "").lower()])  # exact, whole bytes
    if value <= 0:
        raise InputError(f"{option} must be positive, got {text!r}", field=option)
    return value


def format_size(n: int) -> str:
    """``n`` bytes as a size :func:`parse_size` reads back to at least ``n``: ``1.25GiB``-style, rounded up."""
    for unit, scale in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{math.ceil(100 * n / scale) / 100:g}{unit}"
    return str(int(n))


def block_feature_bytes(block_size: int, n_layers: int, hidden_size: int, storage_dtype: str) -> int:
    """Apparent bytes of one block's feature chunk files (hidden states, fp8 scales, each with its crc32c):
    what evicting a block frees and extracting it adds."""
    sizes = {"N": 1, "C": block_size, "L": n_layers, "H": hidden_size}
    return sum(math.prod(s.block_shape(sizes)) * np.dtype(s.dtype).itemsize + CRC_BYTES
               for s in hidden_arrays(storage_dtype))


def flag_bytes(n_blocks: int) -> int:
    """Apparent bytes of the chunk files of the ``done`` flags of ``n_blocks`` blocks (one file per block, its flag
    and crc32c). A block's file appears when it is first done and stays when it is evicted (flag 0), so a store's
    bytes grow by these as it is extracted: the budget counts them for every block from the start."""
    return n_blocks * sum(np.dtype(s.dtype).itemsize + CRC_BYTES for s in ARRAYS if s.role == "flag")


def fixed_bytes_estimate(n_blocks: int, block_size: int, max_segments: int, vocab_size: int) -> int:
    """A lower bound of a format-1 store's bytes without any feature chunk: its token arrays
    (``input_ids``, ``loss_mask``, ``position_ids``: 9 bytes a slot), ``cu_seqlens``, ``segment_keys``,
    ``token_freq`` and the done flags (:func:`flag_bytes`); the checksums and metadata files come on top (the
    measured value, ``peagle_train.data.stream.fixed_store_bytes``, counts them)."""
    return (n_blocks * (block_size * 9 + (max_segments + 1) * 4 + max_segments * 8) + vocab_size * 8
            + flag_bytes(n_blocks))


def window_for_budget(max_store_bytes: int, fixed_bytes: int, block_bytes: int, n_val: int) -> int:
    """B: the training blocks the budget holds beside the fixed arrays and the ``n_val`` validation blocks
    (may be < 1: too small a budget)."""
    return (max_store_bytes - fixed_bytes) // block_bytes - n_val


def _window_units(order: np.ndarray, reads: tuple[tuple[int, ...], ...], val_units: set[int], width: int,
                  step: int) -> int:
    """The most units outside ``val_units`` that the entries ``[K, K + width)`` read, over every cursor K that
    is a multiple of ``step`` (a sliding count: each entry's units added and removed once)."""
    T = int(order.size)
    counts: dict[int, int] = {}
    distinct = most = 0

    def add(c: int, d: int) -> None:
        nonlocal distinct
        for u in reads[int(order[c])]:
            if u in val_units:
                continue
            n = counts.get(u, 0) + d
            counts[u] = n
            distinct += (n == 1 and d == 1) - (n == 0 and d == -1)

    for c in range(min(width, T)):
        add(c, 1)
    for K in range(T):
        if K % step == 0:
            most = max(most, distinct)
        if K + width < T:
            add(K + width, 1)
        add(K, -1)
    return most


def step_units(order: np.ndarray, reads: tuple[tuple[int, ...], ...], val_units: Iterable[int], step: int) -> int:
    """The most units (outside the validation blocks' ``val_units``) one optimizer step's ``step`` entries read:
    what a full-context run's budget must hold beside the fixed arrays and the validation units."""
    return _window_units(np.asarray(order), reads, set(val_units), step, step)


def window_for_reads(order: np.ndarray, reads: tuple[tuple[int, ...], ...], val_units: Iterable[int],
                     capacity: int, step: int) -> int:
    """B of a full-context store: the largest window (entries) such that, at every cursor K that is a multiple
    of ``step``, the units of ``order[K:K+B]`` not among ``val_units`` are at most ``capacity`` (the units the
    budget holds beside the fixed arrays and the validation units); at most T. 0 when not even one entry fits.

    Args:
        order: ``[T] int64`` the training block of each entry; reads: per training block, the units it reads.
    """
    order, val = np.asarray(order), set(val_units)
    lo, hi = 0, int(order.size)  # lo fits (0 entries read nothing), find the largest that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _window_units(order, reads, val, mid, step) <= capacity:
            lo = mid
        else:
            hi = mid - 1
    return lo


def context_reads(store) -> tuple[tuple[int, ...], ...]:
    """Per training block of a full-context store (``layout: "windows"``), the context blocks its views read,
    ascending (its units in a stream plan).

    Raises:
        StoreFormatError: another layout, or a shard store (its views read other shards' context blocks).
    """
    if not store.has_views or store.attrs.get("shard"):
        raise StoreFormatError(f"{store.path}: context blocks are read through the views of a whole full-context store")
    m = store.views()[..., 0]  # [N, S_max] context block per segment, -1 past the segments
    return tuple(tuple(sorted({int(u) for u in row if u >= 0})) for row in m)


def unit_store(store):
    """The store whose blocks are a streaming run's units: a full-context store's ``contexts`` sub-store, else
    the store itself."""
    return store.verifier_blocks


def _reads_digest(reads: tuple[tuple[int, ...], ...] | None) -> str | None:
    if reads is None:
        return None
    return hashlib.sha256(json.dumps([list(r) for r in reads], separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class StreamPlan:
    """A streaming run's plan (see the module doc).

    Attributes:
        run: the run's identity: ``output`` (absolute path), ``seed``, ``val_fraction``, ``max_steps``,
            ``blocks_per_step``; two runs of one identity read the same blocks in the same order.
        policy: one of :data:`POLICIES`.
        max_store_bytes: the budget (bytes).
        fixed_bytes: the store's bytes without feature chunks (measured after its creation, or estimated).
        block_bytes: one unit's feature bytes (:func:`block_feature_bytes`; a full-context store's: of a
            context block).
        window: B, the entries extraction may run ahead of the consumed cursor (``keep``: every entry).
        val_blocks: the validation blocks the run scores, extracted first and kept.
        order: ``[T] int64`` entry c reads training block ``order[c]``.
        reads: a full-context store's units per training block (:func:`context_reads`); None for a format-1
            store, whose training block ``i`` is unit ``i``.
    """

    run: dict[str, Any]
    policy: str
    max_store_bytes: int
    fixed_bytes: int
    block_bytes: int
    window: int
    val_blocks: tuple[int, ...]
    order: np.ndarray = field(repr=False)
    reads: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False)

    @property
    def n_entries(self) -> int:
        """T, the entries of the run."""
        return int(self.order.size)

    def units_of(self, block: int) -> tuple[int, ...]:
        """The units training block ``block`` reads (its context blocks; a format-1 store's: itself)."""
        return (int(block),) if self.reads is None else self.reads[int(block)]

    @property
    def val_units(self) -> tuple[int, ...]:
        """The units the validation blocks read, in their order, each once: extracted first, never evicted."""
        return tuple(dict.fromkeys(u for b in self.val_blocks for u in self.units_of(b)))

    def may_write(self, entry: int, consumed: int) -> bool:
        """Whether extraction may write entry ``entry`` with ``consumed`` entries durably consumed."""
        return self.policy == "keep" or entry < consumed + self.window

    def needed(self, consumed: int) -> set[int]:
        """The units read by the entries of the window ``[consumed, consumed + B)``."""
        return {u for b in self.order[consumed: consumed + self.window].tolist() for u in self.units_of(b)}

    def evictable(self, present: Iterable[int], consumed: int) -> list[int]:
        """The present units to evict at cursor ``consumed``: with ``reextract``, those no entry of the window
        reads and no validation block reads; with ``keep``, none. Sorted."""
        if self.policy == "keep":
            return []
        keep = self.needed(consumed) | set(self.val_units)
        return sorted(u for u in present if u not in keep)

    def extraction_counts(self) -> dict[int, int]:
        """Unit -> how many times the plan extracts it from an empty store (validation units included), when
        the extraction runs as far ahead as the window lets it: ``keep`` once each; ``reextract`` once, plus once
        per entry reading it whose previous reader is more than B entries before. (A unit read again at most B
        entries later is never evicted in between: every cursor the extraction evicts at has the earlier or
        the later reader in its window. One read more than B entries later is evicted when the extraction is
        that far ahead; a slower extraction may still find it.)"""
        kept = set(self.val_units)  # never evicted
        counts = dict.fromkeys(self.val_units, 1)
        last: dict[int, int] = {}
        for c, b in enumerate(self.order.tolist()):
            for u in self.units_of(b):
                if u not in counts:
                    counts[u] = 1
                elif self.policy == "reextract" and u not in kept and c - last[u] > self.window:
                    counts[u] += 1
                last[u] = c
        return counts

    def extractions(self) -> int:
        """Unit extractions the plan makes from an empty store (:meth:`extraction_counts`): what the run costs
        in verifier work."""
        return sum(self.extraction_counts().values())

    def record(self) -> dict[str, Any]:
        """The plan's attributes as stored (everything but ``order``)."""
        rec = {"format": STREAM_FORMAT if self.reads is None else WINDOWS_STREAM_FORMAT, "run": self.run,
               "policy": self.policy, "max_store_bytes": int(self.max_store_bytes), "fixed_bytes": int(self.fixed_bytes),
               "block_bytes": int(self.block_bytes), "window": int(self.window),
               "val_blocks": [int(b) for b in self.val_blocks], "n_entries": self.n_entries,
               "order_sha256": _order_digest(self.order)}
        if self.reads is not None:
            rec.update(layout="windows", units="context_blocks", reads_sha256=_reads_digest(self.reads))
        return rec

    @classmethod
    def from_record(cls, rec: dict[str, Any], order: np.ndarray, store) -> "StreamPlan":
        """The plan of the record ``rec`` (:meth:`record`) and its ``order`` (``[T] int64``) as stored in
        ``store`` (the root of a full-context store: its units read from its views, :func:`context_reads`).

        Raises:
            StoreFormatError: a plan of a format this peagle does not read, one of the other store layout, or
                whose order or units (a full-context store's views) do not match their digests.
        """
        fmt = rec.get("format")
        if fmt not in (STREAM_FORMAT, WINDOWS_STREAM_FORMAT):
            raise StoreFormatError(f"{store.path}: stream plan format {fmt!r}; this peagle reads {STREAM_FORMAT} "
                                   f"(--context window) and {WINDOWS_STREAM_FORMAT} (--context full): made by a newer "
                                   "peagle?")
        if (fmt == WINDOWS_STREAM_FORMAT) != store.has_views:
            raise StoreFormatError(f"{store.path}: a stream plan of format {fmt} in a {store.layout} store (format "
                                   f"{WINDOWS_STREAM_FORMAT} plans a full-context store, {STREAM_FORMAT} a format-1 "
                                   "one)")
        if _order_digest(order) != rec["order_sha256"]:
            raise StoreFormatError(f"{store.path}/{STREAM_GROUP}: the plan's order does not match its digest (damaged)")
        reads = context_reads(store) if fmt == WINDOWS_STREAM_FORMAT else None
        if reads is not None and _reads_digest(reads) != rec.get("reads_sha256"):
            raise StoreFormatError(f"{store.path}/{STREAM_GROUP}: the context blocks the store's views read do not "
                                   "match its stream plan's (another store's plan, or damaged views: run `peagle-data "
                                   "verify`)")
        return cls(run=rec["run"], policy=rec["policy"], max_store_bytes=int(rec["max_store_bytes"]),
                   fixed_bytes=int(rec["fixed_bytes"]), block_bytes=int(rec["block_bytes"]), window=int(rec["window"]),
                   val_blocks=tuple(int(b) for b in rec["val_blocks"]), order=order, reads=reads)

    def same_run(self, other: "StreamPlan") -> bool:
        """Whether ``other`` plans the same reads (identity, policy, blocks, order and units); its budget and
        window may differ (they set the pace, not what is read)."""
        a, b = self.record(), other.record()
        return all(a.get(k) == b.get(k) for k in ("format", "run", "policy", "val_blocks", "n_entries",
                                                  "order_sha256", "reads_sha256"))


def _order_digest(order: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(order, dtype="<i8").tobytes()).hexdigest()


def apparent_bytes(directory: str | os.PathLike) -> int:
    """The sum of the lengths of the files under ``directory`` (what the budget counts)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # evicted while walking
                pass
    return total
