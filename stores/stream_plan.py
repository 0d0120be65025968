"""The stream plan of a feature store trained while it is extracted (docs/design.md §7, "Streaming").

Legend: N blocks of the store, T entries of the run (``max_steps * blocks_per_step``), B the window
(train blocks the budget holds at once), V validation blocks kept for the whole run.

A streaming run (``peagle-train --max-store-bytes``) trains on a store whose features are extracted while it
trains, in the order it reads them, and stays within a byte budget. This module is the one place that knows
the two records of such a run inside the store, in the sub-group ``stream`` of the store's zarr group:

- the **plan** (``stream/zarr.json`` attributes ``peagle_stream``, and the array ``stream/order``
  ``[T] int64``): written once by the trainer (rank 0) when the run starts, read by every extraction
  process: the run's identity (its output directory, seed, split, steps), the epoch ``policy``
  (:data:`POLICIES`), the budget, the bytes of one block's features, the window ``B`` and the validation
  blocks, and ``order``: entry ``c`` of the run reads block ``order[c]``;
- the **consumed cursor** (``stream/consumed.json``): the number of entries the trainer has durably
  consumed, written (fsync'd, renamed) only after the checkpoint that holds the training state past them
  is itself on disk (:func:`fsync_tree`). A crash can therefore never leave the trainer needing a block that
  was deleted: deletion follows the cursor, the cursor follows a saved state.

The rules both sides follow (pure functions of the plan and the cursor ``K``):

- extraction writes entry ``c`` only when ``c < K + B`` (:meth:`StreamPlan.may_write`); the validation
  blocks first;
- with policy ``reextract``, a present training block that no entry of ``[K, K + B)`` reads is evicted
  (:meth:`StreamPlan.evictable`): its done flag cleared, then its feature chunk files deleted
  (:meth:`stores.feature_store.FeatureStore.evict_block`); it is extracted again when a later epoch reads
  it. With ``keep`` nothing is evicted (each block is extracted once, at its first entry; the budget must
  hold every block the run reads).

So the store holds at most the fixed arrays, the V validation blocks and the B distinct blocks of one window:
``fixed_bytes + (V + B) * block_bytes <= max_store_bytes``, the budget; sizes are apparent file sizes (the
sum of the files' lengths, chunk checksums included).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import zarr

from stores.errors import InputError, StoreFormatError
from stores.feature_schema import ARRAYS, hidden_arrays
from stores.files import is_local

__all__ = ["STREAM_GROUP", "STREAM_FORMAT", "POLICIES", "CONSUMED_FILE", "parse_size", "format_size",
           "block_feature_bytes", "flag_bytes", "fixed_bytes_estimate", "StreamPlan", "write_plan", "read_plan",
           "remove_plan", "has_plan", "plan_record", "read_consumed", "write_consumed", "fsync_tree",
           "apparent_bytes", "window_for_budget"]

STREAM_GROUP = "stream"
"""The store's sub-group holding the plan and the consumed cursor."""
STREAM_FORMAT = 1
"""Version of the plan record; a reader refuses another."""
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


@dataclass(frozen=True)
class StreamPlan:
    """A streaming run's plan (see the module doc).

    Attributes:
        run: the run's identity: ``output`` (absolute path), ``seed``, ``val_fraction``, ``max_steps``,
            ``blocks_per_step``; two runs of one identity read the same blocks in the same order.
        policy: one of :data:`POLICIES`.
        max_store_bytes: the budget (bytes).
        fixed_bytes: the store's bytes without feature chunks (measured after its creation, or estimated).
        block_bytes: one block's feature bytes (:func:`block_feature_bytes`).
        window: B, the entries extraction may run ahead of the consumed cursor (``keep``: every entry).
        val_blocks: the validation blocks the run scores, extracted first and kept.
        order: ``[T] int64`` entry c reads block ``order[c]``.
    """

    run: dict[str, Any]
    policy: str
    max_store_bytes: int
    fixed_bytes: int
    block_bytes: int
    window: int
    val_blocks: tuple[int, ...]
    order: np.ndarray = field(repr=False)

    @property
    def n_entries(self) -> int:
        """T, the entries of the run."""
        return int(self.order.size)

    def may_write(self, entry: int, consumed: int) -> bool:
        """Whether extraction may write entry ``entry`` with ``consumed`` entries durably consumed."""
        return self.policy == "keep" or entry < consumed + self.window

    def needed(self, consumed: int) -> set[int]:
        """The blocks read by the entries of the window ``[consumed, consumed + B)``."""
        return set(self.order[consumed: consumed + self.window].tolist())

    def evictable(self, present: Iterable[int], consumed: int) -> list[int]:
        """The present blocks to evict at cursor ``consumed``: with ``reextract``, training blocks no entry of
        the window reads (never a validation block); with ``keep``, none. Sorted."""
        if self.policy == "keep":
            return []
        keep = self.needed(consumed) | set(self.val_blocks)
        return sorted(b for b in present if b not in keep)

    def extractions(self) -> int:
        """Block extractions the plan makes from an empty store (validation blocks included), when every
        window is written before it is consumed: what the run costs in verifier work."""
        if self.policy == "keep":
            return len(set(self.order.tolist()) | set(self.val_blocks))
        # an entry re-extracts its block unless the entry before with the same block is in its window
        last: dict[int, int] = {}
        n = 0
        for c, b in enumerate(self.order.tolist()):
            if b not in last or c - last[b] >= self.window:
                n += 1
            last[b] = c
        return n + len(self.val_blocks)

    def record(self) -> dict[str, Any]:
        """The plan's attributes as stored (everything but ``order``)."""
        return {"format": STREAM_FORMAT, "run": self.run, "policy": self.policy,
                "max_store_bytes": int(self.max_store_bytes), "fixed_bytes": int(self.fixed_bytes),
                "block_bytes": int(self.block_bytes), "window": int(self.window),
                "val_blocks": [int(b) for b in self.val_blocks], "n_entries": self.n_entries,
                "order_sha256": _order_digest(self.order)}

    def same_run(self, other: "StreamPlan") -> bool:
        """Whether ``other`` plans the same reads (identity, policy, blocks and order); its budget and window
        may differ (they set the pace, not what is read)."""
        a, b = self.record(), other.record()
        return all(a[k] == b[k] for k in ("run", "policy", "val_blocks", "n_entries", "order_sha256"))


def _order_digest(order: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(order, dtype="<i8").tobytes()).hexdigest()


def _stream_dir(store) -> Path:
    if not is_local(store.path):
        raise StoreFormatError(f"{store.path}: streaming needs a local store (the consumed cursor is a file)")
    return Path(store.path) / STREAM_GROUP


def has_plan(store) -> bool:
    """Whether ``store`` (a local ``FeatureStore``) holds a stream plan."""
    return (Path(store.path) / STREAM_GROUP / "zarr.json").is_file()


def write_plan(store, plan: StreamPlan, keep_consumed: bool = False, consumed: int = 0) -> None:
    """Write ``plan`` into ``store``'s ``stream`` sub-group (replacing one there) and set the consumed cursor
    to ``consumed`` (0: a new run; a resumed run whose store has no plan: its checkpoint's cursor, once that
    checkpoint is on disk), or with ``keep_consumed`` (the same run with another budget) keep it; the
    attributes last, so a reader never sees a plan without its order and cursor."""
    consumed = read_consumed(store) if keep_consumed else consumed
    path = _stream_dir(store)
    group = zarr.open_group(str(path), mode="w")
    order = np.ascontiguousarray(plan.order, dtype=np.int64)
    arr = group.create_array("order", shape=order.shape, dtype="int64", chunks=(max(1, order.size),))
    arr[:] = order
    write_consumed(store, consumed)
    group.attrs["peagle_stream"] = plan.record()


def remove_plan(store) -> None:
    """Delete ``store``'s stream plan and consumed cursor (a new run of the same output replaces its plan; the
    features present stay, they are the same for any plan)."""
    path = Path(store.path) / STREAM_GROUP
    if path.is_dir():
        shutil.rmtree(path)


def read_plan(store) -> StreamPlan | None:
    """The stream plan of ``store``, or None when it has none (yet).

    Raises:
        StoreFormatError: a plan of another format, or whose order does not match its digest.
    """
    if not has_plan(store):
        return None
    group = zarr.open_group(str(_stream_dir(store)), mode="r")
    rec = dict(group.attrs).get("peagle_stream")
    if rec is None:  # the attributes come last: a plan being written
        return None
    if rec.get("format") != STREAM_FORMAT:
        raise StoreFormatError(f"{store.path}: stream plan format {rec.get('format')!r}; this peagle reads "
                               f"{STREAM_FORMAT} (made by a newer peagle?)")
    order = np.asarray(group["order"][:], dtype=np.int64)
    if _order_digest(order) != rec["order_sha256"]:
        raise StoreFormatError(f"{store.path}/{STREAM_GROUP}: the plan's order does not match its digest (damaged)")
    return StreamPlan(run=rec["run"], policy=rec["policy"], max_store_bytes=int(rec["max_store_bytes"]),
                      fixed_bytes=int(rec["fixed_bytes"]), block_bytes=int(rec["block_bytes"]),
                      window=int(rec["window"]), val_blocks=tuple(int(b) for b in rec["val_blocks"]), order=order)


def plan_record(store) -> dict[str, Any] | None:
    """The attributes of ``store``'s plan as written now (:meth:`StreamPlan.record`; None: no plan, or one being
    written), read from its metadata file alone: cheap enough for an extraction to check before each block that
    its plan was not rewritten."""
    try:
        return json.loads((_stream_dir(store) / "zarr.json").read_text())["attributes"]["peagle_stream"]
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        return None


def read_consumed(store) -> int:
    """The consumed cursor of ``store``'s plan (0 when none was written)."""
    path = _stream_dir(store) / CONSUMED_FILE
    try:
        return int(json.loads(path.read_text())["consumed"])
    except FileNotFoundError:
        return 0


def write_consumed(store, consumed: int) -> None:
    """Durably set the consumed cursor: a temporary file written and fsync'd, renamed over the old one, the
    directory fsync'd. Call only once the training state past ``consumed`` entries is on disk."""
    directory = _stream_dir(store)
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{CONSUMED_FILE}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps({"consumed": int(consumed), "time": time.time()}))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / CONSUMED_FILE)
    _fsync_dir(directory)


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
