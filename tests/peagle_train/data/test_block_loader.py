"""BlockLoader: several blocks per store request give the same blocks, order and resume positions."""

import itertools

import numpy as np
import pytest
import torch

from peagle_train.data.loader import BlockLoader, BlockSequence
from stores.features.feature_store import FeatureStore


def _store(tmp_path, n_blocks=5, C=6, L=2, H=4):
    store = FeatureStore.create(tmp_path / "s.zarr", n_blocks=n_blocks, block_size=C, max_segments=2,
                                layers=list(range(L)), hidden_size=H, vocab_size=32,
                                verifier={"name_or_path": "tiny"})
    store.write_all_n_tokens(np.full(n_blocks, C))
    for i in range(n_blocks):
        store.write_tokens(i, [i] * C, [1] * C, list(range(C)), [0, C])
        store.write_features(i, torch.full((C, L, H), float(i), dtype=torch.bfloat16),
                             torch.full((C, H), float(-i), dtype=torch.bfloat16))
        store.mark_done(i)
    return FeatureStore.open(tmp_path / "s.zarr")


def _take(loader, n):
    out = [(c, b.block_id, int(b.input_ids[0]), float(b.aux_hidden[0, 0]), float(b.final_hidden[0, 0]))
           for c, b in itertools.islice(iter(loader), n)]
    loader.close()
    return out


def test_batched_reads_match_single_reads_and_resume(tmp_path):
    store = _store(tmp_path)
    seq = BlockSequence(np.arange(5), np.arange(5), seed=3)
    one = BlockLoader(store, seq, prefetch=False, blocks_per_read=1)
    ref = _take(one, 12)  # crosses two epoch boundaries
    assert one.cursor == 12 and [c for c, *_ in ref] == list(range(12))
    assert all(bid == tok == aux == -fin for _, bid, tok, aux, fin in ref)  # each block's own data
    assert sorted(b for _, b, *_ in ref[:5]) == [0, 1, 2, 3, 4]
    four = BlockLoader(store, seq, blocks_per_read=4)
    assert _take(four, 12) == ref and four.cursor == 12
    resumed = BlockLoader(store, seq, cursor=7, blocks_per_read=3)
    assert _take(resumed, 5) == ref[7:12] and resumed.cursor == 12


def test_blocks_per_read_defaults_to_a_byte_budget(tmp_path):
    store = _store(tmp_path)
    seq = BlockSequence(np.arange(5), np.arange(5), seed=0)
    assert BlockLoader(store, seq, prefetch=False).blocks_per_read == 8  # tiny blocks


class _Recording:
    """A store that records the ids each read asks for."""

    def __init__(self, store):
        self.store, self.asked = store, []

    def __getattr__(self, name):
        return getattr(self.store, name)

    def read_blocks(self, ids, pin_memory=False):
        self.asked += list(ids)
        return self.store.read_blocks(ids, pin_memory=pin_memory)


@pytest.mark.parametrize("blocks_per_read", [1, 3])
def test_n_steps_ends_the_iteration_and_reads_no_block_past_it(tmp_path, blocks_per_read):
    """Rank 1 of 2, two blocks per rank and step, 3 steps from cursor 4: entries 4..15 of the sequence, this
    rank's 6, 7, 10, 11, 14, 15; the prefetch asks for none past them (a streaming store never extracts
    them: the read would wait until its timeout)."""
    store = _Recording(_store(tmp_path))
    seq = BlockSequence(np.arange(5), np.arange(5), seed=3)
    blocks = [b for _, b in itertools.islice(seq.entries(0), 16)]  # the first 4 steps' entries, 4 a step
    loader = BlockLoader(store, seq, cursor=4, rank=1, world_size=2, grad_accum=2, blocks_per_read=blocks_per_read,
                         n_steps=3)
    got = list(loader)
    loader.close()
    assert [c for c, _ in got] == [6, 7, 10, 11, 14, 15]
    assert [b.block_id for _, b in got] == [blocks[c] for c in (6, 7, 10, 11, 14, 15)]
    assert store.asked == [blocks[c] for c in (6, 7, 10, 11, 14, 15)] and loader.cursor == 16
