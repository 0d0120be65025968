"""The store-backed block loader: split, per-epoch shuffle, exact resume, prefetch (docs/design.md §7, §8).

Legend: T tokens in a block, L aux layers, H hidden size.

One training step reads one packed block. The order is a pure function of ``(seed, epoch)``, and the
loader's only state is ``position``, the number of global steps already taken, so a resumed run sees
the same blocks in the same order as an uninterrupted one (mosaicml/streaming's rule: shuffle is a
pure function of seed and epoch). With ``world_size`` data-parallel ranks, global step ``s`` gives
rank ``r`` the block at flat index ``s * world_size + r`` of the endless epoch sequence.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import numpy as np
import torch

from stores.errors import StoreFormatError
from stores.feature_schema import Block

__all__ = ["Block", "split_blocks", "epoch_order", "check_store_ready", "BlockLoader", "to_block",
           "READ_REQUEST_BYTES"]

READ_REQUEST_BYTES = 16 * 2 ** 20
"""Bytes of stored blocks the loader asks the store for at once (small blocks are read several at a time)."""


def to_block(block_id: int, feats: Block) -> Block:
    """A block as read from the store (``aux_hidden [T, L, H]``) -> as training consumes it
    (``aux_hidden [T, L*H]``, layers concatenated), with its ``block_id``."""
    return feats.flat_layers(block_id)


def _seed_of(*parts: int) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & ((1 << 63) - 1)


def split_blocks(block_ids: np.ndarray, seed: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Split blocks into train and validation by a seeded permutation.

    The last ``ceil(val_fraction * n)`` blocks of the permutation are validation (at least 1 when
    ``val_fraction > 0`` and n >= 2; none when n < 2 or ``val_fraction == 0``).

    Args:
        block_ids: ``[n] int64`` usable block ids.
        seed: the run's seed.
        val_fraction: in [0, 1).

    Returns:
        (train ids, validation ids), each sorted ``int64``.

    Raises:
        ValueError: ``val_fraction`` outside [0, 1).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1) (--val-fraction), got {val_fraction}")
    ids = np.asarray(block_ids, dtype=np.int64)
    n = ids.size
    n_val = 0 if n < 2 or val_fraction == 0 else min(n - 1, max(1, int(np.ceil(val_fraction * n))))
    g = torch.Generator().manual_seed(_seed_of(seed, -1))
    perm = ids[torch.randperm(n, generator=g).numpy()]
    return np.sort(perm[: n - n_val]), np.sort(perm[n - n_val:])


def epoch_order(train_ids: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """The order of ``train_ids`` in ``epoch``: a pure function of ``(seed, epoch)``; ``[n] int64``."""
    g = torch.Generator().manual_seed(_seed_of(seed, epoch))
    return np.asarray(train_ids, dtype=np.int64)[torch.randperm(len(train_ids), generator=g).numpy()]


def check_store_ready(store, allow_incomplete: bool) -> np.ndarray:
    """Ids of the blocks training may read.

    Raises:
        StoreFormatError: the store holds no blocks, some blocks are not done and
            ``allow_incomplete`` is false, or no block is done.
    """
    done = store.done_mask()
    if done.size == 0:
        raise StoreFormatError(f"{store.path}: the store holds no blocks (a shard store of a packed table with fewer "
                               "blocks than --num-shards, or of an empty table); leave it out of --store")
    missing = np.flatnonzero(~done)
    if missing.size and not allow_incomplete:
        raise StoreFormatError(
            f"{store.path}: {missing.size} of {done.size} blocks are not done (first: {missing[:5].tolist()}); "
            "finish it with `peagle-data extract ... --resume`, or pass --allow-incomplete to train on the "
            "done blocks only")
    ids = np.flatnonzero(done).astype(np.int64)
    if ids.size == 0:
        raise StoreFormatError(f"{store.path}: no block is done; run `peagle-data extract` first")
    return ids


class BlockLoader:
    """Endless iterator of training blocks, read several per request on a prefetch thread.

    Args:
        store: an open ``FeatureStore``.
        train_ids: ``[n] int64`` the training blocks.
        seed: the run's seed.
        position: global steps already taken (0 for a fresh run).
        rank, world_size: this process among the data-parallel ranks.
        prefetch: read the next request's blocks while the current steps run.
        blocks_per_read: blocks per store request; None: as many as fit in
            :data:`READ_REQUEST_BYTES` (at least 1, at most 8).
        pin_memory: read hidden states into page-locked memory (for asynchronous copies to CUDA).
    """

    def __init__(self, store, train_ids: np.ndarray, seed: int, position: int = 0, rank: int = 0,
                 world_size: int = 1, prefetch: bool = True, blocks_per_read: int | None = None,
                 pin_memory: bool = False):
        if len(train_ids) == 0:
            raise StoreFormatError(f"{store.path}: no training blocks left after the validation split")
        self.store, self.train_ids, self.seed = store, np.asarray(train_ids, dtype=np.int64), seed
        self.position, self.rank, self.world_size = position, rank, world_size
        if blocks_per_read is None:
            block_bytes = max(1, store.block_size * store.bytes_per_token())
            blocks_per_read = max(1, min(8, READ_REQUEST_BYTES // block_bytes))
        if blocks_per_read < 1:
            raise ValueError(f"blocks_per_read must be >= 1, got {blocks_per_read}")
        self.blocks_per_read, self.pin_memory = int(blocks_per_read), pin_memory
        self._pool = ThreadPoolExecutor(max_workers=1) if prefetch else None
        self._orders: dict[int, np.ndarray] = {}
        self.wait_s = 0.0
        """Seconds spent waiting for a block (for the data-wait fraction)."""

    def block_id_at(self, position: int) -> tuple[int, int]:
        """(epoch, block id) this rank reads at global step ``position``."""
        flat = position * self.world_size + self.rank
        n = len(self.train_ids)
        epoch = flat // n
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(self.train_ids, self.seed, epoch)}
        return epoch, int(self._orders[epoch][flat % n])

    def _read(self, position: int) -> list[Block]:
        """The blocks of positions ``position .. position + blocks_per_read - 1``, one store request."""
        ids = [self.block_id_at(p)[1] for p in range(position, position + self.blocks_per_read)]
        return [to_block(bid, f) for bid, f in zip(ids, self.store.read_blocks(ids, pin_memory=self.pin_memory))]

    def __iter__(self) -> Iterator[Block]:
        import time

        start = self.position
        pending = self._pool.submit(self._read, start) if self._pool else None
        while True:
            t0 = time.perf_counter()
            blocks = pending.result() if pending else self._read(start)
            self.wait_s += time.perf_counter() - t0
            start += self.blocks_per_read
            pending = self._pool.submit(self._read, start) if self._pool else None
            for block in blocks:
                self.position += 1
                yield block

    def state_dict(self) -> dict[str, int]:
        """``{"position": steps taken, "seed": seed}``; enough to resume exactly."""
        return {"position": self.position, "seed": self.seed}

    def close(self) -> None:
        if self._pool:
            self._pool.shutdown(wait=False, cancel_futures=True)
