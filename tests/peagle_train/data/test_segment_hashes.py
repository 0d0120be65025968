"""Segment hashes (peagle_train/data/segment_hashes.py): equal token ids hash alike, any other differ; a store's
training side is every block outside the validation side."""

from __future__ import annotations

import numpy as np

from peagle_train.data.segment_hashes import count_in, segment_hashes, store_segment_hashes, training_segment_hashes


class Tokens:
    """A store of blocks given as lists of segments (only what the hashes read)."""

    def __init__(self, blocks: list[list[list[int]]]):
        self.blocks, self.n_blocks = blocks, len(blocks)

    def read_tokens(self, i: int) -> dict:
        segs = self.blocks[i]
        return {"input_ids": np.array(sum(segs, []), np.int32), "cu_seqlens": np.cumsum([0] + [len(s) for s in segs])}


def test_equal_token_ids_hash_alike_in_any_dtype_and_block():
    a = segment_hashes(np.array([1, 2, 3, 4, 5], np.int32), [0, 3, 5])
    b = segment_hashes(np.array([4, 5, 1, 2, 3], np.int64), [0, 2, 5])
    assert a.dtype == np.uint64 and a.tolist() == b[::-1].tolist() and a[0] != a[1]
    assert segment_hashes([1, 2], [0, 2])[0] != segment_hashes([1, 2, 0], [0, 3])[0]  # a window is not the whole
    assert count_in(b, np.sort(a[:1])) == 1


def test_the_training_side_is_every_block_outside_the_validation_side():
    one, two, three = [[7, 8, 9]], [[1, 2], [3, 4, 5]], [[6]]
    store = Tokens([one, two, three])
    assert store_segment_hashes(store, [1]).tolist() == sorted(segment_hashes([1, 2, 3, 4, 5], [0, 2, 5]).tolist())
    trained = training_segment_hashes(store, np.array([1]))
    assert trained.tolist() == sorted(np.concatenate([segment_hashes([7, 8, 9], [0, 3]),
                                                      segment_hashes([6], [0, 1])]).tolist())

    class Set:  # a StoreSet: global block ids run over its stores
        stores = [Tokens([one]), Tokens([two, three])]

    assert training_segment_hashes(Set(), np.array([1])).tolist() == trained.tolist()
