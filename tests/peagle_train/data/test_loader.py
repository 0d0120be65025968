"""peagle_train.data.loader: seeds, the validation split, the epoch order, store readiness, Block, the block
sequence, the ranks' share of a step, the resume checks.

(The loader's batched reads and resume are in test_data_loader.py.)
"""

import itertools

import numpy as np
import pytest
import torch

from peagle_train.data.loader import (
    BlockLoader, BlockSequence, check_store_ready, data_state, derive_seed, epoch_order, order_warning, resume_cursor,
    split_blocks, to_block,
)
from stores.errors import InputError, StoreFormatError
from stores.features.feature_store import FeatureStore


def test_seeds_are_pinned_values():
    """A resumed run (or another torch/numpy version) must derive the same seeds: sha256 of the parts."""
    assert derive_seed(0, 1, 5) == 8796421597293617407
    assert derive_seed(7, -1) == 2950783808263510788
    assert derive_seed(0, 1, 5) != derive_seed(0, 1, 6) and 0 <= derive_seed(0, 1, 5) < 2 ** 63


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


def test_epoch_order_by_conversations_shuffles_whole_groups_each_by_lead_then_id():
    ids = np.array([3, 4, 5, 7, 8, 9, 11])
    groups = np.array([3, 3, 5, 3, 8, 8, 11])  # (the smallest id of each group names it)
    leads = np.array([3, 4, 5, 3, 8, 8, 11])  # block 7 holds a later window of block 3's conversation
    for epoch in range(4):
        order = epoch_order(ids, 2, epoch, groups, leads)
        assert sorted(order.tolist()) == ids.tolist()
        runs = [list(g) for _, g in itertools.groupby(order.tolist(), key=lambda b: groups[ids.tolist().index(b)])]
        assert sorted(map(tuple, runs)) == [(3, 7, 4), (5,), (8, 9), (11,)]  # each group once, by lead then id
    orders = {tuple(epoch_order(ids, 2, e, groups).tolist()) for e in range(6)}
    assert len(orders) > 1 and epoch_order(ids, 2, 1, groups).tolist() == epoch_order(ids, 2, 1, groups).tolist()
    assert [b for b in epoch_order(ids, 2, 0, groups) if groups[ids.tolist().index(b)] == 3] == [3, 4, 7]  # no leads
    assert epoch_order(ids, 1, 0, None).tolist() == epoch_order(ids, 1, 0).tolist()  # blocks: as before
    every = np.arange(12)
    seq = BlockSequence(ids, ids, seed=2, block_group=(every // 4 * 4, every))  # groups [3], [4-7], [8-11]
    assert seq.order_rule == "conversations" and seq.groups.tolist() == [0, 4, 4, 4, 8, 8, 8]
    first = [b for _, b in itertools.islice(seq.entries(), 7)]
    assert first == epoch_order(ids, 2, 0, seq.groups, seq.leads).tolist()


def test_one_group_holding_much_of_the_train_side_is_warned_about():
    ids = np.arange(20)
    chained = (np.where(ids < 5, 0, ids), ids)  # blocks 0-4 one group: 25% of 20
    assert order_warning(BlockSequence(ids, ids, seed=0, block_group=chained)) == (
        "--epoch-order conversations: 5 of the 20 train-side blocks (25%) are one group (blocks linked by the "
        "conversations they share: a block holding windows of several conversations links them), trained in the "
        "same order every epoch; only the order of the 16 groups changes. Packing with --block-size equal to "
        "--max-seq-len links fewer; --epoch-order blocks shuffles every block")
    assert order_warning(BlockSequence(ids, ids, seed=0, block_group=(np.where(ids < 4, 0, ids), ids))) is None
    assert order_warning(BlockSequence(ids, ids, seed=0)) is None


def test_resume_refuses_another_epoch_order():
    ids = np.arange(8)
    blocks, conv = BlockSequence(ids, ids, seed=0), BlockSequence(ids, ids, seed=0, block_group=(ids // 2, ids))
    assert data_state(conv, 3, 1, 1)["order"] == "conversations"
    assert resume_cursor(data_state(conv, 3, 1, 1), conv, 1, 1) == 3
    assert resume_cursor({k: v for k, v in data_state(blocks, 2, 1, 1).items() if k != "order"}, blocks, 1, 1) == 2
    with pytest.raises(InputError, match=r"field '--epoch-order': ckpt ordered its epochs by blocks, this run by "
                                         r"conversations: .*resume with --epoch-order blocks"):
        resume_cursor(data_state(blocks, 2, 1, 1), conv, 1, 1, checkpoint="ckpt")


def test_to_block_concatenates_the_layers_per_token():
    from peagle_train.data.loader import Block

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


def _filtered(order, usable, epoch):
    """(cursor, id) of the usable entries of one epoch's order, written out independently."""
    return [(epoch * len(order) + i, int(b)) for i, b in enumerate(order) if b in set(usable)]


def test_block_sequence_skips_blocks_not_usable_and_keeps_their_cursors():
    side, usable = np.arange(10, 16), [10, 12, 13, 15]
    seq = BlockSequence(side, usable, seed=1)
    o0, o1 = epoch_order(side, 1, 0), epoch_order(side, 1, 1)
    assert o0.tolist() == [10, 11, 14, 13, 12, 15]  # pinned: the order never depends on what is usable
    got = list(itertools.islice(seq.entries(0), 8))
    assert got == _filtered(o0, usable, 0) + _filtered(o1, usable, 1)
    assert got[:5] == [(0, 10), (3, 13), (4, 12), (5, 15), (7, 13)]  # epoch 1: [14, 13, 11, ...]
    assert list(itertools.islice(seq.entries(1), 2)) == [(3, 13), (4, 12)]  # a cursor between entries
    assert list(itertools.islice(seq.entries(6), 1)) == [(7, 13)]  # the next epoch


def test_a_block_extracted_later_joins_the_sequence_at_its_place_never_twice_in_an_epoch():
    side = np.arange(8)
    assert epoch_order(side, 4, 0).tolist() == [4, 7, 5, 0, 2, 6, 3, 1]
    before = BlockSequence(side, [0, 1, 2, 3], seed=4)
    first = list(itertools.islice(before.entries(0), 2))  # two steps of one block
    assert first == [(3, 0), (4, 2)]
    cursor = first[-1][0] + 1
    after = BlockSequence(side, np.arange(8), seed=4)  # the extraction finished
    rest = list(itertools.takewhile(lambda e: e[0] < 8, after.entries(cursor)))
    assert rest == [(5, 6), (6, 3), (7, 1)]  # 6 lies after the cursor: it joins now; 4, 7, 5 in epoch 1
    epoch0 = [b for _, b in first + rest]
    assert sorted(epoch0) == [0, 1, 2, 3, 6] and len(set(epoch0)) == len(epoch0)
    assert [b for _, b in itertools.islice(after.entries(8), 8)] == epoch_order(side, 4, 1).tolist()


def _steps(loader, n):
    return list(itertools.islice(loader.steps(), n))


def test_each_rank_takes_a_contiguous_slice_of_every_step_of_the_global_sequence(tmp_path):
    """A step takes the next grad_accum * world entries; rank r trains entries r*G .. r*G+G-1; the cursor
    is global, so 1 x 4, 2 x 2 and 4 x 1 (ranks x grad_accum) read the same blocks step by step."""
    store = _store(tmp_path, n_blocks=6, done=range(6))
    seq = BlockSequence(np.arange(6), [0, 1, 2, 4, 5], seed=5)
    flat = list(itertools.islice(seq.entries(0), 12))
    for world, accum in ((1, 4), (2, 2), (4, 1)):
        loaders = [BlockLoader(store, seq, rank=r, world_size=world, grad_accum=accum, prefetch=False)
                   for r in range(world)]
        assert _steps(loaders[0], 3) == [(flat[4 * s:4 * s + 4], flat[4 * s + 3][0] + 1) for s in range(3)]
        for r, loader in enumerate(loaders):
            it = iter(loader)
            got = [next(it) for _ in range(2 * accum)]  # two steps
            want = [flat[4 * s + r * accum + g] for s in range(2) for g in range(accum)]
            assert [(c, b.block_id) for c, b in got] == want
            assert loader.cursor == flat[7][0] + 1  # after the second step: the same on every rank
            assert loader.state_dict() == {"format": 2, "cursor": flat[7][0] + 1, "blocks_per_step": 4,
                                           "world_size": world, "grad_accum": accum, "seed": 5,
                                           "sequence_length": 6, "usable": [0, 1, 2, 4, 5], "split": 2,
                                           "order": "blocks"}
            resumed = BlockLoader(store, seq, cursor=loader.cursor, rank=r, world_size=world, grad_accum=accum,
                                  prefetch=False)
            c, b = next(iter(resumed))
            assert (c, b.block_id) == flat[8 + r * accum]


def test_resume_cursor_continues_only_the_same_blocks_per_step():
    seq = BlockSequence(np.arange(16), np.arange(16), seed=0)
    saved = data_state(seq, 4, world_size=1, grad_accum=1)
    assert resume_cursor(saved, seq, world_size=1, grad_accum=1) == 4
    assert resume_cursor(data_state(seq, 8, world_size=1, grad_accum=2), seq, world_size=2, grad_accum=1) == 8
    assert resume_cursor(data_state(seq, 8, world_size=2, grad_accum=1), seq, world_size=1, grad_accum=2) == 8
    with pytest.raises(InputError) as e:  # the case: 1 process, then 2 ranks, 1 block each
        resume_cursor(saved, seq, world_size=2, grad_accum=1, checkpoint="out/checkpoint-4")
    assert str(e.value) == (
        "field '--grad-accum': out/checkpoint-4 was trained on 1 process(es) with --grad-accum 1, 1 block(s) per "
        "optimizer step; this launch has 2 process(es) with --grad-accum 1, 2 per step: every step would pool "
        "other blocks, and the run would not be the saved one continued; 2 processes cannot share 1 block(s) per "
        "step: resume on a number of processes that divides 1 (with --grad-accum 1 / processes), e.g. 1 with "
        "--grad-accum 1")
    with pytest.raises(InputError, match=r"2 process\(es\) with --grad-accum 1, 2 block\(s\) per optimizer step; "
                                         r"this launch has 1 process\(es\) with --grad-accum 1, 1 per step.*; resume "
                                         r"with --grad-accum 2 on these 1 process\(es\), or on 2 with --grad-accum 1$"):
        resume_cursor(data_state(seq, 8, world_size=2, grad_accum=1), seq, world_size=1, grad_accum=1)
    with pytest.raises(InputError, match=r"field '--resume': the checkpoint was saved by an earlier peagle"):
        resume_cursor({"position": 4, "seed": 0}, seq, world_size=1, grad_accum=1)
    with pytest.raises(InputError, match=r"ordered 16 train-side blocks with seed 0, this run 12 with seed 0"):
        resume_cursor(saved, BlockSequence(np.arange(12), np.arange(12), seed=0), world_size=1, grad_accum=1)
    with pytest.raises(StoreFormatError, match=r"2 block\(s\) the run saved in the checkpoint trained on are not "
                                               r"done now \(first: \[3, 9\]\)"):
        resume_cursor(saved, BlockSequence(np.arange(16), np.setdiff1d(np.arange(16), [3, 9]), seed=0), 1, 1)


def test_sequence_refuses_no_training_blocks_and_the_loader_a_zero_read_size(tmp_path):
    store = _store(tmp_path, done=(0, 1, 2))
    with pytest.raises(StoreFormatError, match="s.zarr: no training blocks left after the validation split"):
        BlockSequence(np.arange(3), np.array([], dtype=np.int64), seed=0, where=str(store.path))
    with pytest.raises(ValueError, match=r"usable blocks \[5\] are not on the train side"):
        BlockSequence(np.arange(3), [0, 5], seed=0)
    with pytest.raises(ValueError, match="blocks_per_read must be >= 1"):
        BlockLoader(store, BlockSequence(np.arange(3), np.arange(3), seed=0), blocks_per_read=0)
