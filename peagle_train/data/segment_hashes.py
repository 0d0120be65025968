"""Content hashes of stored segments: what a drafter was trained on, compared with what it is judged on.

A segment's hash is the first 8 bytes (little-endian ``uint64``) of the BLAKE2b digest of its ``input_ids`` as
little-endian int64: two segments hash alike exactly when their token ids are the same (up to a 2^-64 chance).
``peagle-train`` records the sorted hashes of its training side's segments in every checkpoint
(:data:`peagle_train.model.checkpoint.TRAINING_SEGMENTS_FILE`); ``peagle-eval --store`` hashes the judged
segments and counts those found there (:func:`count_in`). A segment is what the store holds: a whole
conversation in a judge store (``extract --context full``, ``pack --max-windows 1``), a window of one where a
training store windowed a long conversation (a window does not hash like the whole conversation).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import numpy as np

__all__ = ["segment_hashes", "store_segment_hashes", "training_segment_hashes", "count_in"]


def segment_hashes(input_ids, cu_seqlens) -> np.ndarray:
    """``[S] uint64`` the hash of each segment ``input_ids[cu[k]:cu[k+1]]`` (``input_ids [T]``,
    ``cu_seqlens [S+1]``)."""
    ids = np.asarray(input_ids, dtype="<i8")
    cu = [int(c) for c in np.asarray(cu_seqlens)]
    return np.array([int.from_bytes(hashlib.blake2b(ids[a:b].tobytes(), digest_size=8).digest(), "little")
                     for a, b in zip(cu[:-1], cu[1:])], dtype=np.uint64)


def store_segment_hashes(store, blocks: Iterable[int]) -> np.ndarray:
    """``[M] uint64`` sorted unique hashes of the segments of ``blocks`` of one ``FeatureStore`` (token arrays
    only: a block needs no extracted features)."""
    parts = [segment_hashes(t["input_ids"], t["cu_seqlens"]) for t in (store.read_tokens(int(i)) for i in blocks)]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)


def training_segment_hashes(store, val_side: np.ndarray) -> np.ndarray:
    """``[M] uint64`` sorted unique hashes of the training side's segments: every block of ``store`` (a
    ``FeatureStore`` or a ``StoreSet``, global block ids) outside ``val_side`` (the run's whole validation side),
    extracted or not."""
    stores = getattr(store, "stores", [store])
    held = set(int(i) for i in np.asarray(val_side).tolist())
    parts, first = [], 0
    for s in stores:
        parts.append(store_segment_hashes(s, [k for k in range(s.n_blocks) if first + k not in held]))
        first += s.n_blocks
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)


def count_in(hashes: np.ndarray, recorded: np.ndarray) -> int:
    """How many of ``hashes`` (``[S] uint64``) are in the sorted ``recorded`` ones."""
    return int(np.isin(np.asarray(hashes, np.uint64), np.asarray(recorded, np.uint64)).sum())
