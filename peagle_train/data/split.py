"""The validation split by conversation: whole groups of blocks that share a conversation (docs/design.md §8).

Legend: N blocks of a store, S_max the most segments in a block, G groups.

A packed block holds windows of several conversations, and one conversation reaches several blocks:
its windows (a conversation longer than ``--max-seq-len``), and its copies (a mixture weight above 1,
``--no-dedup`` with a repeated row), which have the same content key (the packed table's
``segment_keys``, kept in the store as ``segment_keys [N, S_max]``). Two blocks are in one **group** when
they hold a segment of one content key, directly or through other blocks (the connected components of the
graph of blocks linked by shared keys). The validation side is a set of whole groups, so no validation
block shares a conversation, or a copy of one, with a training block.

Which groups: the seeded permutation of the block ids that the block rule (:func:`split_blocks`,
:data:`SPLIT_BLOCKS`) uses is walked from its end; each block not yet decided brings its whole group,
which is held out if it fits in the ``ceil(val_fraction * N)`` blocks asked (at least 1 with N >= 2, at
most N - 1), else stays on the training side; the walk stops when exactly that many are held out. When
every group is one block this is the block rule's split, block for block. A pure function of
``(seed, val_fraction, the store's segment keys)``: keys are written with the token arrays when the store
is made, for every block, extracted or not, so ``--allow-incomplete``, resume and ``peagle-eval`` see the
same sides.

If whole groups cannot hold out at least half the blocks asked (a group larger than the split: a weight-2
mixture of short conversations packed into large blocks can link most blocks into one group), the split is
refused with the group sizes and the fixes, never cut through a group; except that a small store asked for
one block (the "at least one block" of the block rule) holds out its smallest group (the first of them in the
walk) when it leaves a training block, more than asked, as training then says.
"""

from __future__ import annotations

import numpy as np
import torch

from peagle_train.data.loader import derive_seed, split_blocks
from stores.errors import InputError, StoreFormatError

__all__ = ["SPLIT_BLOCKS", "SPLIT_CONVERSATIONS", "SPLIT_RULES", "block_groups", "block_leads", "split_by_groups", "split_store",
           "validation_size"]

SPLIT_BLOCKS = 1
"""Split rule 1 (peagle before conversation groups): :func:`split_blocks`, blocks drawn alone; copies and
windows of one conversation may fall on both sides. Kept only for resuming a run that was started with it."""
SPLIT_CONVERSATIONS = 2
"""Split rule 2 (:func:`split_by_groups`): whole groups of blocks that share a conversation's content."""
SPLIT_RULES = {SPLIT_BLOCKS: "blocks", SPLIT_CONVERSATIONS: "conversation_groups"}
"""Rule number -> name, as recorded in checkpoints (``peagle_training.split``) and ``training_state.pt``."""


def validation_size(n: int, val_fraction: float) -> int:
    """Blocks to hold out of ``n``: ``ceil(val_fraction * n)``, at least 1 when ``val_fraction > 0`` and
    n >= 2, at most n - 1; 0 when n < 2 or ``val_fraction == 0``.

    Raises:
        ValueError: ``val_fraction`` outside [0, 1).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1) (--val-fraction), got {val_fraction}")
    return 0 if n < 2 or val_fraction == 0 else min(n - 1, max(1, int(np.ceil(val_fraction * n))))


def block_groups(keys: np.ndarray) -> np.ndarray:
    """The group of every block: blocks sharing a segment key, directly or through others, are one group.

    Args:
        keys: ``[N, S] int64`` each block's segment content keys (a short row padded by repeating a key of
            its own, so padding adds no link).

    Returns:
        ``[N] int64``: each block's group, named by the smallest block id in it.

    Label propagation with pointer jumping: each key takes the smallest label of its blocks, each block the
    smallest label of its keys, then labels follow their own block's label, until nothing changes.
    """
    keys = np.asarray(keys, dtype=np.int64)
    n = keys.shape[0]
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    _, key_index = np.unique(keys.reshape(-1), return_inverse=True)
    key_index = key_index.reshape(keys.shape)
    n_keys = int(key_index.max()) + 1
    label = np.arange(n, dtype=np.int64)
    while True:
        key_label = np.full(n_keys, n, dtype=np.int64)
        np.minimum.at(key_label, key_index.reshape(-1), np.repeat(label, keys.shape[1]))
        new = np.minimum(label, key_label[key_index].min(axis=1))
        while True:  # pointer jumping: a label is a block id, whose own label may be smaller
            jumped = new[new]
            if np.array_equal(jumped, new):
                break
            new = jumped
        if np.array_equal(new, label):
            return label
        label = new


def block_leads(keys: np.ndarray) -> np.ndarray:
    """The lead of every block: the first block (smallest id) of the earliest of its conversations, i.e. the
    smallest first-block id over its segment keys (at most its own id). Ordering a group's blocks by lead, then
    id, puts the blocks that hold the later windows of a conversation (packed beside other conversations' windows)
    next to that conversation's first ones (``--epoch-order conversations``).

    Args:
        keys: ``[N, S] int64`` each block's segment content keys (padded as for :func:`block_groups`).

    Returns:
        ``[N] int64``.
    """
    keys = np.asarray(keys, dtype=np.int64)
    if keys.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    _, key_index = np.unique(keys.reshape(-1), return_inverse=True)
    key_index = key_index.reshape(keys.shape)
    first = np.full(int(key_index.max()) + 1, keys.shape[0], dtype=np.int64)
    np.minimum.at(first, key_index.reshape(-1), np.repeat(np.arange(keys.shape[0], dtype=np.int64), keys.shape[1]))
    return first[key_index].min(axis=1)


def split_by_groups(groups: np.ndarray, seed: int, val_fraction: float, where: str = "the store"
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Split block ids ``0..N-1`` into train and validation by whole groups (see the module doc).

    Args:
        groups: ``[N] int64`` each block's group (:func:`block_groups`).
        seed: the run's seed.
        val_fraction: in [0, 1).
        where: the store, for the message.

    Returns:
        (train ids, validation ids), each sorted ``int64``; no group has blocks on both sides.

    Raises:
        ValueError: ``val_fraction`` outside [0, 1).
        InputError: whole groups hold out fewer than half the blocks asked (field ``--val-fraction``).
    """
    groups = np.asarray(groups, dtype=np.int64)
    n = groups.size
    n_val = validation_size(n, val_fraction)
    ids = np.arange(n, dtype=np.int64)
    if n_val == 0:
        return ids, ids[:0]
    uniq, group_of, sizes = np.unique(groups, return_inverse=True, return_counts=True)
    g = torch.Generator().manual_seed(derive_seed(seed, -1))  # the block rule's permutation
    perm = torch.randperm(n, generator=g).numpy()
    decided = np.zeros(uniq.size, dtype=bool)
    held = np.zeros(uniq.size, dtype=bool)
    taken = 0
    for b in perm[::-1]:
        k = group_of[b]
        if decided[k]:
            continue
        decided[k] = True
        if taken + sizes[k] <= n_val:
            held[k] = True
            taken += int(sizes[k])
            if taken == n_val:
                break
    if taken == 0 and n_val == 1:  # "at least one block" of a small store: at least its smallest group
        walked = [group_of[b] for b in perm[::-1]]
        first = {}
        for k in walked:
            first.setdefault(k, len(first))
        k = min((int(sizes[k]), first[k], k) for k in first if sizes[k] < n)[2] if (sizes < n).any() else None
        if k is not None:
            held[k] = True
            taken = int(sizes[k])
    if 2 * taken < n_val:
        largest = np.sort(sizes)[::-1][:5].tolist()
        raise InputError(
            f"{where}: --val-fraction {val_fraction:g} asks to hold out {n_val} of its {n} blocks, but its blocks "
            f"form {uniq.size} group(s) that share a conversation (its windows, or copies of it: a mixture weight "
            f"above 1, --no-dedup), the largest holding {largest} blocks, and whole groups hold out only {taken}; "
            "a validation block sharing a conversation with a training block would score memorisation. Raise "
            f"--val-fraction (the smallest group holds {int(sizes.min())} block(s)), pack with a smaller "
            "--block-size or without repeated copies so that the groups are smaller, or pass --val-fraction 0",
            field="--val-fraction")
    val = np.flatnonzero(held[group_of]).astype(np.int64)
    return np.flatnonzero(~held[group_of]).astype(np.int64), val


def split_store(store, seed: int, val_fraction: float, rule: int = SPLIT_CONVERSATIONS
                ) -> tuple[np.ndarray, np.ndarray]:
    """The train and validation sides of one feature store's block ids ``0..N-1`` (sorted ``int64``).

    Args:
        store: a ``FeatureStore``.
        seed, val_fraction: the run's.
        rule: :data:`SPLIT_CONVERSATIONS` (every new run), or :data:`SPLIT_BLOCKS` (only a resumed run
            that started with it keeps it).

    Raises:
        StoreFormatError: rule 2 with ``val_fraction > 0`` on a store without segment keys (made before
            peagle recorded them: ``extract --resume`` records them; or from a packed table without a
            ``conversations/`` sub-table): which blocks share a conversation is unknown.
        InputError: see :func:`split_by_groups`.
    """
    if rule == SPLIT_BLOCKS:
        return split_blocks(np.arange(store.n_blocks, dtype=np.int64), seed, val_fraction)
    if rule != SPLIT_CONVERSATIONS:
        raise ValueError(f"unknown split rule {rule!r}")
    if validation_size(store.n_blocks, val_fraction) == 0:
        ids = np.arange(store.n_blocks, dtype=np.int64)
        return ids, ids[:0]
    keys = store.segment_keys()
    if keys is None:
        raise StoreFormatError(
            f"{store.path}: the store does not record which conversation each segment comes from (extracted by a "
            "peagle before the store kept segment_keys, or from a packed table without a conversations/ "
            "sub-table), so a validation split cannot keep the copies and windows of one conversation on one "
            "side. Record them with `peagle-data extract PACKED --output STORE ... --resume` (the store's own "
            "options; nothing is extracted again), or for a table without conversations/ pack the data again "
            "and extract it again, or train with --val-fraction 0")
    return split_by_groups(block_groups(keys), seed, val_fraction, str(store.path))
