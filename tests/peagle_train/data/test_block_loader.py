"""BlockLoader: several blocks per store request give the same blocks, order and resume positions."""

import itertools

import numpy as np
import torch

from peagle_train.data.loader import BlockLoader, BlockSequence
from stores.feature_store import FeatureStore


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
