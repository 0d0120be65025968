"""peagle_train.data: seeds, the validation split, the epoch order, store readiness, Block, loader bounds.

(The loader's batched reads and resume are in test_data_loader.py.)
"""

import numpy as np
import pytest
import torch

from peagle_train.data import BlockLoader, _seed_of, check_store_ready, epoch_order, split_blocks, to_block
from stores.errors import StoreFormatError
from stores.feature_store import FeatureStore


def test_seeds_are_pinned_values():
    """A resumed run (or another torch/numpy version) must derive the same seeds: sha256 of the parts."""
    assert _seed_of(0, 1, 5) == 8796421597293617407
    assert _seed_of(7, -1) == 2950783808263510788
    assert _seed_of(0, 1, 5) != _seed_of(0, 1, 6) and 0 <= _seed_of(0, 1, 5) < 2 ** 63


def test_split_is_a_seeded_partition_with_pinned_values():
    tr, va = split_blocks(np.arange(10) * 3, 1, 0.2)
    assert va.tolist() == [9, 12] and tr.tolist() == [0, 3, 6, 15, 18, 21, 24, 27]
    assert tr.dtype == va.dtype == np.int64
    assert split_blocks(np.arange(10), 3, 0.2)[1].tolist() == [8, 9]  # another seed, another split
    assert split_blocks(np.arange(10), 0, 0.2)[1].tolist() == [6, 8]


@pytest.mark.parametrize(("n", "fraction", "n_val"), [(1, 0.5, 0), (2, 0.01, 1), (3, 0.9, 2), (10, 0.0, 0),
                                                      (10, 0.25, 3), (40, 0.05, 2)])
def test_split_sizes(n, fraction, n_val):
    """ceil(fraction * n), at least 1 when n >= 2 and fraction > 0, at most n - 1 (one block trains)."""
    tr, va = split_blocks(np.arange(n), 0, fraction)
    assert va.size == n_val and sorted([*tr, *va]) == list(range(n))


@pytest.mark.parametrize("fraction", [1.0, -0.1])
def test_split_refuses_a_fraction_outside_0_1(fraction):
    with pytest.raises(ValueError, match=r"--val-fraction"):
        split_blocks(np.arange(4), 0, fraction)


def test_epoch_order_is_a_pinned_permutation_per_seed_and_epoch():
    ids = np.array([10, 11, 12, 13, 14])
    assert epoch_order(ids, 1, 0).tolist() == [14, 10, 12, 11, 13]
    assert epoch_order(ids, 1, 0).tolist() == epoch_order(ids, 1, 0).tolist()
    assert sorted(epoch_order(ids, 1, 1).tolist()) == ids.tolist()
    assert epoch_order(ids, 1, 1).tolist() != epoch_order(ids, 1, 0).tolist()


def test_to_block_concatenates_the_layers_per_token():
    from peagle_train.data import Block

    T, L, H = 3, 2, 4
    aux = torch.arange(T * L * H, dtype=torch.float32).view(T, L, H).bfloat16()
    feats = Block(input_ids=torch.tensor([5, 6, 7]), loss_mask=torch.tensor([0, 1, 1]),
                  position_ids=torch.arange(3), cu_seqlens=torch.tensor([0, 3]), aux_hidden=aux,
                  final_hidden=torch.zeros(T, H).bfloat16())
    block = to_block(4, feats)
    assert block.block_id == 4 and block.n_tokens == 3 and block.aux_hidden.shape == (T, L * H)
    assert block.aux_hidden[1].tolist() == list(range(8, 16))  # token 1: layer 0's H values, then layer 1's
    assert block.input_ids.tolist() == [5, 6, 7]


def _store(tmp_path, n_blocks=3, done=(0, 2), C=4):
    store = FeatureStore.create(tmp_path / "s.zarr", n_blocks=n_blocks, block_size=C, max_segments=1, layers=[0],
                                hidden_size=2, vocab_size=16, verifier={"name_or_path": "tiny"})
    store.write_all_n_tokens(np.full(n_blocks, C))
    for i in done:
        store.write_tokens(i, [i] * C, [1] * C, list(range(C)), [0, C])
        store.write_features(i, torch.full((C, 1, 2), float(i)).bfloat16(), torch.zeros(C, 2).bfloat16())
        store.mark_done(i)
    return FeatureStore.open(tmp_path / "s.zarr")


def test_check_store_ready_names_the_missing_blocks_or_returns_the_done_ones(tmp_path):
    store = _store(tmp_path)
    with pytest.raises(StoreFormatError, match=r"1 of 3 blocks are not done \(first: \[1\]\).*--allow-incomplete"):
        check_store_ready(store, allow_incomplete=False)
    ids = check_store_ready(store, allow_incomplete=True)
    assert ids.tolist() == [0, 2] and ids.dtype == np.int64


def test_check_store_ready_refuses_a_store_without_a_done_block(tmp_path):
    with pytest.raises(StoreFormatError, match="no block is done"):
        check_store_ready(_store(tmp_path, done=()), allow_incomplete=True)


def test_loader_ranks_take_interleaved_flat_positions(tmp_path):
    """Global step s gives rank r the block at flat index s * world + r of the epoch sequence."""
    store = _store(tmp_path, n_blocks=3, done=(0, 1, 2))
    ids = np.array([0, 1, 2])
    flat = [*epoch_order(ids, 5, 0), *epoch_order(ids, 5, 1)]
    ranks = [BlockLoader(store, ids, seed=5, rank=r, world_size=2, prefetch=False) for r in (0, 1)]
    for s in range(3):
        assert [ranks[r].block_id_at(s) for r in (0, 1)] == [((2 * s + r) // 3, int(flat[2 * s + r])) for r in (0, 1)]
    loader = ranks[1]
    it = iter(loader)
    got = [next(it).block_id for _ in range(3)]
    assert got == [int(flat[1]), int(flat[3]), int(flat[5])]
    assert loader.state_dict() == {"position": 3, "seed": 5}


def test_loader_refuses_no_training_blocks_and_a_zero_read_size(tmp_path):
    store = _store(tmp_path, done=(0, 1, 2))
    with pytest.raises(StoreFormatError, match="no training blocks left after the validation split"):
        BlockLoader(store, np.array([], dtype=np.int64), seed=0)
    with pytest.raises(ValueError, match="blocks_per_read must be >= 1"):
        BlockLoader(store, np.arange(3), seed=0, blocks_per_read=0)
