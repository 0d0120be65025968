"""The store-backed block loader: split, block sequence, exact resume, prefetch (docs/design.md §7, §8).

Legend: T tokens in a block, L aux layers, H hidden size, n train-side blocks, W data-parallel
ranks, G ``grad_accum``.

The split and the order are decided over every block id of the store(s), extracted or not (a
store's block count is fixed when ``extract`` creates it), so neither moves when more blocks
become done (``--allow-incomplete``, then the extraction finishes): :mod:`peagle_train.data.split` of all
ids gives the train side and the validation side (whole groups of blocks sharing a conversation; the block
rule :func:`split_blocks` only for runs started before it), and a :class:`BlockSequence` lists the train side
in ``epoch_order(train side, seed, e)`` for epochs e = 0, 1, ..., skipping the blocks that are not
usable (not extracted) when the process starts. Entry i of epoch e has the cursor ``e * n + i``. With
``--epoch-order conversations`` an epoch permutes the groups of blocks that share a conversation instead, each
group's blocks one after another (:func:`epoch_order`).

One optimizer step takes the next ``G * W`` usable entries of the sequence (the step's blocks, in
sequence order); rank r trains entries ``r*G .. r*G + G - 1`` of them. The loader's state is the
cursor after the last step (global, not per rank), so a resume on any W' with ``G' * W' = G * W``
trains exactly the blocks of an uninterrupted run, each step pooling the same blocks
(:func:`resume_cursor` refuses anything else). Shuffling is a pure function of seed and epoch, as
in mosaicml/streaming.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import numpy as np
import torch

from stores.errors import InputError, StoreFormatError
from stores.features.feature_schema import Block

__all__ = ["Block", "derive_seed", "split_blocks", "epoch_order", "check_store_ready", "BlockSequence",
           "BlockLoader", "to_block", "data_state", "resume_cursor", "READ_REQUEST_BYTES", "DATA_STATE_FORMAT",
           "EPOCH_ORDERS", "order_warning", "LARGE_GROUP_SHARE"]

EPOCH_ORDERS = ("blocks", "conversations")
"""``--epoch-order``: each epoch a seeded permutation of the train-side blocks, or of their conversation groups
(each group's blocks one after another): :func:`epoch_order`."""

READ_REQUEST_BYTES = 16 * 2 ** 20
"""Bytes of stored blocks the loader asks the store for at once (small blocks are read several at a time)."""

DATA_STATE_FORMAT = 2
"""Version of the ``data`` entry of ``training_state.pt`` (:func:`data_state`). States without it
(peagle before the global cursor) counted one rank's steps and split only the done blocks; they
are refused on resume (:func:`resume_cursor`)."""


def to_block(block_id: int, feats: Block) -> Block:
    """A block as read from the store (``aux_hidden [T, L, H]``) -> as training consumes it
    (``aux_hidden [T, L*H]``, layers concatenated), with its ``block_id``."""
    return feats.flat_layers(block_id)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers: the first 8 bytes (little-endian) of sha256 of their ``repr``,
    the same on every platform and torch/numpy version."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") & ((1 << 63) - 1)


def split_blocks(block_ids: np.ndarray, seed: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Split blocks into train and validation by a seeded permutation, each block alone (split rule 1).

    The last ``ceil(val_fraction * n)`` blocks of the permutation are validation (at least 1 when
    ``val_fraction > 0`` and n >= 2; none when n < 2 or ``val_fraction == 0``). Blocks that share a
    conversation (its windows, its copies) may fall on both sides: new runs split by whole groups of such
    blocks (:func:`peagle_train.data.split.split_by_groups`, which walks the same permutation); this rule
    remains for resuming a run started with it and for checkpoints that record no ``val_blocks``.

    Args:
        block_ids: ``[n] int64`` block ids.
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
    g = torch.Generator().manual_seed(derive_seed(seed, -1))
    perm = ids[torch.randperm(n, generator=g).numpy()]
    return np.sort(perm[: n - n_val]), np.sort(perm[n - n_val:])


def epoch_order(train_ids: np.ndarray, seed: int, epoch: int, groups: np.ndarray | None = None,
                leads: np.ndarray | None = None) -> np.ndarray:
    """The order of ``train_ids`` in ``epoch``: a pure function of ``(seed, epoch)`` (and ``groups``, ``leads``);
    ``[n] int64``.

    Args:
        train_ids: ``[n] int64`` the train-side block ids.
        groups: None (``--epoch-order blocks``): the blocks in a seeded permutation, each alone. Else ``[n]
            int64`` each id's group (:func:`peagle_train.data.split.block_groups`: blocks that share a
            conversation, its windows or its copies) (``--epoch-order conversations``): the groups in a seeded
            permutation, each group's blocks one after another by ``leads`` (``[n] int64``,
            :func:`peagle_train.data.split.block_leads`; None: all 0), then id. A conversation's windows are then
            trained together, as a trainer that takes a whole conversation as one sample trains it, and a
            streaming run over a full-context store extracts each context about once an epoch at any budget.
    """
    ids = np.asarray(train_ids, dtype=np.int64)
    g = torch.Generator().manual_seed(derive_seed(seed, epoch))
    if groups is None:
        return ids[torch.randperm(len(ids), generator=g).numpy()]
    names, group_of = np.unique(np.asarray(groups, dtype=np.int64), return_inverse=True)
    place = np.empty(names.size, dtype=np.int64)
    place[torch.randperm(names.size, generator=g).numpy()] = np.arange(names.size)
    lead = np.zeros(ids.size, dtype=np.int64) if leads is None else np.asarray(leads, dtype=np.int64)
    return ids[np.lexsort((ids, lead, place[group_of]))]


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
            f"{store.repair_command()} finishes it, or pass --allow-incomplete to train on the done blocks only")
    ids = np.flatnonzero(done).astype(np.int64)
    if ids.size == 0:  # the store exists: a plain extract would refuse it, a resume fills it
        raise StoreFormatError(f"{store.path}: no block is done; {store.repair_command()} extracts them")
    return ids


class BlockSequence:
    """The run's endless sequence of training blocks (see the module doc).

    Entry i of epoch e is ``epoch_order(train_side, seed, e, groups, leads)[i]``, at cursor ``e * n + i``; entries
    whose block is not in ``usable`` are skipped. A block that becomes usable later (a resume after
    the extraction went on) takes its fixed place: in the current epoch if the run's cursor has not
    passed it, else from the next epoch on. No block is trained twice in an epoch.

    Args:
        train_side: ``[n] int64`` every train-side block id of the split, extracted or not.
        usable: ``[m] int64`` the train-side blocks this run may read (extracted), a subset.
        seed: the run's seed.
        where: the store(s), for the message.
        split_rule: the validation split rule that gave ``train_side``.
        block_group: None (``--epoch-order blocks``), or ``(groups, leads)``, each ``[N] int64`` over every
            block id of the store(s) (``--epoch-order conversations``: :func:`epoch_order`,
            :func:`peagle_train.data.multistore.conversation_groups`).

    Raises:
        StoreFormatError: ``usable`` is empty.
        ValueError: ``usable`` holds an id that is not on the train side.
    """

    def __init__(self, train_side: np.ndarray, usable: np.ndarray, seed: int, where: str = "the store",
                 split_rule: int = 2, block_group: tuple[np.ndarray, np.ndarray] | None = None):
        self.train_side = np.unique(np.asarray(train_side, dtype=np.int64))
        self.groups = self.leads = None
        """``[n] int64`` each train-side block's group and lead (``--epoch-order conversations``), or None."""
        if block_group is not None:
            self.groups = np.asarray(block_group[0], dtype=np.int64)[self.train_side]
            self.leads = np.asarray(block_group[1], dtype=np.int64)[self.train_side]
        self.usable = np.unique(np.asarray(usable, dtype=np.int64))
        self.seed = int(seed)
        self.split_rule = int(split_rule)
        """The validation split rule that gave ``train_side`` (:data:`peagle_train.data.split.SPLIT_RULES`)."""
        if self.usable.size == 0:
            raise StoreFormatError(f"{where}: no training blocks left after the validation split (every extracted "
                                   "block is held out); extract more blocks, or lower --val-fraction")
        stray = np.setdiff1d(self.usable, self.train_side)
        if stray.size:
            raise ValueError(f"usable blocks {stray[:5].tolist()} are not on the train side")
        self._epoch: int | None = None
        self._order = self._keep = np.zeros(0, dtype=np.int64)

    @property
    def order_rule(self) -> str:
        """The epoch order (``--epoch-order``), one of :data:`EPOCH_ORDERS`."""
        return "blocks" if self.groups is None else "conversations"

    def __len__(self) -> int:
        """n, the entries of one epoch (usable or not)."""
        return int(self.train_side.size)

    def _epoch_entries(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order ``[n]``, indices ``[m]`` of its usable entries) of ``epoch``."""
        if epoch != self._epoch:
            order = epoch_order(self.train_side, self.seed, epoch, self.groups, self.leads)
            self._epoch, self._order = epoch, order
            self._keep = np.flatnonzero(np.isin(order, self.usable))
        return self._order, self._keep

    def entries(self, cursor: int = 0) -> Iterator[tuple[int, int]]:
        """``(cursor, block id)`` of every usable entry at or after ``cursor``, endless."""
        n = len(self)
        epoch, start = divmod(int(cursor), n)
        while True:
            order, keep = self._epoch_entries(epoch)
            for i in keep[np.searchsorted(keep, start):]:
                yield epoch * n + int(i), int(order[i])
            epoch, start = epoch + 1, 0


LARGE_GROUP_SHARE = 0.2
"""``--epoch-order conversations`` warns when one group holds more than this share of the train side."""


def order_warning(sequence: BlockSequence) -> str | None:
    """With ``--epoch-order conversations``, a warning when one group of blocks holds more than
    :data:`LARGE_GROUP_SHARE` of the train side (packing chains conversations: a block holding windows of
    several conversations links them all into one group): its blocks are trained in the same order every epoch,
    only the groups' order changes. None otherwise."""
    if sequence.groups is None or len(sequence) < 5:
        return None
    sizes = np.unique(sequence.groups, return_counts=True)[1]
    largest = int(sizes.max())
    if largest <= LARGE_GROUP_SHARE * len(sequence):
        return None
    return (f"--epoch-order conversations: {largest} of the {len(sequence)} train-side blocks "
            f"({100 * largest / len(sequence):.0f}%) are one group (blocks linked by the conversations they share: "
            "a block holding windows of several conversations links them), trained in the same order every epoch; "
            f"only the order of the {sizes.size} groups changes. Packing with --block-size equal to --max-seq-len "
            "links fewer; --epoch-order blocks shuffles every block")


def data_state(sequence: BlockSequence, cursor: int, world_size: int, grad_accum: int) -> dict[str, Any]:
    """The ``data`` entry of ``training_state.pt``: ``format`` (:data:`DATA_STATE_FORMAT`), ``cursor``
    (the sequence cursor after the last step, over all ranks), ``blocks_per_step`` (``grad_accum *
    world_size``), ``world_size``, ``grad_accum``, ``seed``, ``sequence_length`` (n) and ``usable``
    (the train-side block ids the run could read, a sorted list) and ``split`` (the validation split rule,
    ``sequence.split_rule``; a state without it was split by rule 1, blocks alone) and ``order`` (the epoch
    order, ``sequence.order_rule``; a state without it ordered blocks alone)."""
    return {"format": DATA_STATE_FORMAT, "cursor": int(cursor), "blocks_per_step": int(grad_accum * world_size),
            "world_size": int(world_size), "grad_accum": int(grad_accum), "seed": sequence.seed,
            "sequence_length": len(sequence), "usable": sequence.usable.tolist(), "split": sequence.split_rule,
            "order": sequence.order_rule}


def resume_cursor(saved: dict[str, Any], sequence: BlockSequence, world_size: int, grad_accum: int,
                  checkpoint: str = "the checkpoint") -> int:
    """The cursor a resumed run starts from, after checking it continues the saved run exactly.

    Args:
        saved: the ``data`` entry of the checkpoint's ``training_state.pt`` (:func:`data_state`).
        sequence: this process's :class:`BlockSequence`.
        world_size, grad_accum: this launch's processes and ``--grad-accum``.
        checkpoint: the checkpoint's name, for the messages.

    Raises:
        InputError: a state written before :data:`DATA_STATE_FORMAT` (field ``--resume``); another
            number of blocks per optimizer step (``grad_accum * world_size``), naming both world sizes
            and the ``--grad-accum`` that keeps it, or saying that no ``--grad-accum`` can (field
            ``--grad-accum``); another seed or sequence length (field ``--resume``); another epoch order
            (field ``--epoch-order``).
        StoreFormatError: blocks the saved run could read are not done now.
    """
    if saved.get("format") != DATA_STATE_FORMAT:
        raise InputError(
            f"{checkpoint} was saved by an earlier peagle, whose training state counts one rank's steps and whose "
            "validation split was drawn from the blocks done when the run started: it cannot be continued "
            "exactly. Start a new run (a new --output, or --force); its final/ and checkpoints still evaluate "
            "and serve", field="--resume")
    per_step, old_world, old_accum = int(saved["blocks_per_step"]), int(saved["world_size"]), int(saved["grad_accum"])
    if grad_accum * world_size != per_step:
        if per_step % world_size == 0:
            fix = f"resume with --grad-accum {per_step // world_size} on these {world_size} process(es)" + (
                f", or on {old_world} with --grad-accum {old_accum}" if old_world != world_size else "")
        else:
            fix = (f"{world_size} processes cannot share {per_step} block(s) per step: resume on a number of "
                   f"processes that divides {per_step} (with --grad-accum {per_step} / processes), e.g. {old_world} "
                   f"with --grad-accum {old_accum}")
        raise InputError(
            f"{checkpoint} was trained on {old_world} process(es) with --grad-accum {old_accum}, {per_step} block(s) "
            f"per optimizer step; this launch has {world_size} process(es) with --grad-accum {grad_accum}, "
            f"{grad_accum * world_size} per step: every step would pool other blocks, and the run would not be "
            f"the saved one continued; {fix}", field="--grad-accum")
    if int(saved["seed"]) != sequence.seed or int(saved["sequence_length"]) != len(sequence):
        raise InputError(
            f"{checkpoint} ordered {saved['sequence_length']} train-side blocks with seed {saved['seed']}, this run "
            f"{len(sequence)} with seed {sequence.seed}: the stores or the split differ from the saved run's",
            field="--resume")
    saved_order = saved.get("order", "blocks")
    if saved_order != sequence.order_rule:
        raise InputError(f"{checkpoint} ordered its epochs by {saved_order}, this run by {sequence.order_rule}: the "
                         f"resumed run would read other blocks next; resume with --epoch-order {saved_order}",
                         field="--epoch-order")
    gone = np.setdiff1d(np.asarray(saved["usable"], dtype=np.int64), sequence.usable)
    if gone.size:
        raise StoreFormatError(
            f"{gone.size} block(s) the run saved in {checkpoint} trained on are not done now (first: "
            f"{gone[:5].tolist()}): an uninterrupted run would train them again; finish the extraction "
            "(`peagle-data extract ... --resume`) before resuming")
    return int(saved["cursor"])


class BlockLoader:
    """This rank's endless blocks of the run's :class:`BlockSequence`, read several per request on a
    prefetch thread; yields ``(cursor, block)`` (the cursor seeds the block's COD sampling).

    Args:
        store: an open ``FeatureStore`` (or ``StoreSet``).
        sequence: the run's block sequence.
        cursor: the sequence cursor of the first step (0 for a fresh run; :func:`resume_cursor`).
        rank, world_size: this process among the data-parallel ranks.
        grad_accum: blocks per optimizer step and rank.
        prefetch: read the next request's blocks while the current steps run.
        blocks_per_read: blocks per store request; None: as many as fit in
            :data:`READ_REQUEST_BYTES` (at least 1, at most 8).
        pin_memory: read hidden states into page-locked memory (for asynchronous copies to CUDA).
        n_steps: the steps to read from ``cursor`` (the run's steps left), then the iteration ends; None:
            endless. Bounded, the prefetch never asks for a block past the run's last step (a streaming run's
            store never gets one: a read of it would wait until its timeout, keeping the process alive).

    Raises:
        ValueError: ``blocks_per_read`` < 1.
    """

    def __init__(self, store, sequence: BlockSequence, cursor: int = 0, rank: int = 0, world_size: int = 1,
                 grad_accum: int = 1, prefetch: bool = True, blocks_per_read: int | None = None,
                 pin_memory: bool = False, n_steps: int | None = None):
        self.store, self.sequence, self.cursor, self.n_steps = store, sequence, int(cursor), n_steps
        self.rank, self.world_size, self.grad_accum = rank, world_size, grad_accum
        if blocks_per_read is None:
            block_bytes = max(1, store.block_size * store.bytes_per_token())
            blocks_per_read = max(1, min(8, READ_REQUEST_BYTES // block_bytes))
        if blocks_per_read < 1:
            raise ValueError(f"blocks_per_read must be >= 1, got {blocks_per_read}")
        self.blocks_per_read, self.pin_memory = int(blocks_per_read), pin_memory
        self._pool = ThreadPoolExecutor(max_workers=1) if prefetch else None
        self.wait_s = 0.0
        """Seconds spent waiting for a block (for the data-wait fraction)."""

    def steps(self, cursor: int | None = None) -> Iterator[tuple[list[tuple[int, int]], int]]:
        """``(the step's (cursor, block id) entries [grad_accum * world_size], cursor after the step)``
        of every step from ``cursor`` (default: the loader's), all ranks' blocks in sequence order; ``n_steps``
        of them, or endless."""
        per_step = self.grad_accum * self.world_size
        entries = self.sequence.entries(self.cursor if cursor is None else cursor)
        for _ in range(self.n_steps) if self.n_steps is not None else itertools.count():
            step = [next(entries) for _ in range(per_step)]
            yield step, step[-1][0] + 1

    def _mine(self) -> Iterator[tuple[int, int, int | None]]:
        """This rank's ``(cursor, block id, cursor after the step or None)``: entries ``r*G .. r*G+G-1``
        of each step, the last one carrying the step's end."""
        G, r = self.grad_accum, self.rank
        for step, after in self.steps():
            mine = step[r * G:(r + 1) * G]
            for k, (cursor, block_id) in enumerate(mine):
                yield cursor, block_id, after if k == G - 1 else None

    def _read(self, ids: list[int]) -> list[Block]:
        """The blocks ``ids``, one store request."""
        return [to_block(bid, f) for bid, f in zip(ids, self.store.read_blocks(ids, pin_memory=self.pin_memory))]

    def __iter__(self) -> Iterator[tuple[int, Block]]:
        items = self._mine()

        def take() -> tuple[list[tuple[int, int, int | None]], Any]:
            batch = list(itertools.islice(items, self.blocks_per_read))  # fewer (none) at the end of n_steps
            ids = [bid for _, bid, _ in batch]
            return batch, (self._pool.submit(self._read, ids) if self._pool and ids else ids)

        batch, pending = take()
        while batch:
            t0 = time.perf_counter()
            blocks = pending.result() if self._pool else self._read(pending)
            self.wait_s += time.perf_counter() - t0
            current, (batch, pending) = batch, take()
            for (cursor, _, after), block in zip(current, blocks):
                if after is not None:
                    self.cursor = after  # before the yield: a checkpoint after this step saves it
                yield cursor, block

    def state_dict(self) -> dict[str, Any]:
        """:func:`data_state` at the cursor after the last step this rank completed reading."""
        return data_state(self.sequence, self.cursor, self.world_size, self.grad_accum)

    def close(self) -> None:
        if self._pool:
            self._pool.shutdown(wait=False, cancel_futures=True)
