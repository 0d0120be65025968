"""Sharded runs: ``--num-shards N --shard-index I`` keeps the conversations of shard I of N.

A conversation's shard is its content digest modulo N (:func:`peagle_data.prepare.dedup.conversation_key`
of its normalised messages; for a tokenize output given to ``pack``, the digest of its tokens and
loss masks), so every copy and every duplicate of a conversation lands in the same shard as the
conversation itself, and the duplicate verdicts of a shard equal the unsharded run's. A reader
reject (a row that is not a conversation) goes to the shard of its file name and row number. Every
shard reads every input row and draws the same samples (deduplication and weights come first), so
the union of the N shard outputs holds exactly the rows of the unsharded run. Shards do not depend
on the machine, the order they run in, or ``--num-workers``.
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterable, Iterator

from peagle_data.prepare.counts import Counts
from peagle_data.prepare.dedup import conversation_key
from peagle_data.readers.rows import Conversation, Reject

__all__ = ["shard_of_key", "item_shard", "shard_filter", "check_shard"]


def check_shard(num_shards: int, shard_index: int) -> None:
    """Raises ValueError unless ``num_shards >= 1`` and ``0 <= shard_index < num_shards``."""
    if num_shards < 1:
        raise ValueError(f"--num-shards must be >= 1, got {num_shards}")
    if not 0 <= shard_index < num_shards:
        raise ValueError(f"--shard-index must be in [0, {num_shards - 1}] for --num-shards {num_shards}, "
                         f"got {shard_index}")


def shard_of_key(key: bytes, num_shards: int) -> int:
    """The shard of a 16-byte content digest."""
    return int.from_bytes(key[:8], "little") % num_shards


def item_shard(item: Conversation | Reject, num_shards: int) -> int:
    """The shard of a reader item: content digest for conversations and duplicates, else file name and row."""
    key = getattr(item, "key", None)
    if isinstance(item, Conversation):
        key = conversation_key(item)
    elif key is None:
        file, _, row = item.source.rpartition(":")
        key = hashlib.blake2b(f"{os.path.basename(file)}:{row}".encode(), digest_size=16).digest()
    return shard_of_key(key, num_shards)


def shard_filter(num_shards: int, shard_index: int):
    """A filter ``(items, counts) -> items`` keeping shard ``shard_index``; counts ``other_shards``."""
    check_shard(num_shards, shard_index)

    def keep(items: Iterable[Conversation | Reject], counts: Counts) -> Iterator[Conversation | Reject]:
        for item in items:
            if item_shard(item, num_shards) == shard_index:
                yield item
            else:
                counts.bump("other_shards")
    return keep
