"""The validation split by conversation (docs/design.md §8): whole groups of blocks that share a conversation's
content (its windows, its copies) are held out, never split; stores without the provenance are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from cli.data import main as data_main
from peagle_data.extract.config import ExtractConfig
from peagle_data.extract.run import run_extract
from peagle_train.data.loader import split_blocks
from peagle_train.data.multistore import open_stores, split_per_store
from peagle_train.data.split import block_groups, split_by_groups, split_store
from peagle_train.evaluate.offline import select_eval_blocks
from peagle_train.train.run import resumed_split_rule, run_train
from stores.errors import InputError, StoreFormatError, StoreMismatchError
from stores.features.feature_store import FeatureStore
from stores.tables.token_tables import TokenTable
from tests.long_conversations import long_conversations
from tests.peagle_train.train.test_train import _cfg, _store


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory, make_tiny_llama):
    from tests.peagle_train.train.test_train import H, V

    return make_tiny_llama(tmp_path_factory.mktemp("verifier"), hidden=H, vocab=V)


def test_block_groups_join_blocks_that_share_a_key_directly_or_through_others():
    keys = np.array([[1, 2], [3, 3], [2, 4], [5, 5], [4, 4], [6, 7]])  # 0-2 share 2, 2-4 share 4
    assert block_groups(keys).tolist() == [0, 1, 0, 3, 0, 5]
    chain = np.array([[k, k + 1] for k in range(50)])[::-1]  # a chain of 50 blocks, one group
    assert block_groups(chain).tolist() == [0] * 50


@pytest.mark.parametrize("n, seed, fraction", [(10, 0, 0.2), (10, 3, 0.2), (37, 5, 0.05), (2, 0, 0.01), (1, 0, 0.5)])
def test_one_block_groups_give_the_block_rules_split(n, seed, fraction):
    """Every block its own group: the same sides as split_blocks, block for block."""
    train, val = split_by_groups(np.arange(n), seed, fraction)
    want = split_blocks(np.arange(n), seed, fraction)
    assert train.tolist() == want[0].tolist() and val.tolist() == want[1].tolist()


def test_groups_are_held_out_whole_in_the_seeded_order():
    groups = np.array([0, 0, 2, 3, 3, 3, 6, 7, 8, 9])  # blocks 0-1 and 3-5 are groups of 2 and 3
    # seed 3 walks blocks 9, 8, 3, 4, 1, 0, 2, ... (its permutation from the end): 9 and 8 are held out, 3 brings
    # its group of 3 and 1 its group of 2, which do not fit in the 3 blocks asked, then 2 completes the split
    train, val = split_by_groups(groups, 3, 0.3)
    assert val.tolist() == [2, 8, 9] and train.tolist() == [0, 1, 3, 4, 5, 6, 7]
    assert split_by_groups(groups, 3, 0.3)[1].tolist() == val.tolist()  # a pure function of the seed
    assert split_by_groups(groups, 1, 0.3)[1].tolist() == [3, 4, 5]  # seed 1 starts at block 4: its whole group
    with pytest.raises(InputError, match=r"--val-fraction.*hold out 2 of its 8 blocks.*largest holding \[4, 4\]"):
        split_by_groups(np.array([0, 0, 0, 0, 4, 4, 4, 4]), 0, 0.25)


def _packed_content(packed) -> list[set[bytes]]:
    """Per packed block, the contents (the conversation's token ids, from the conversations sub-table) of its
    segments: the identity the split must respect, computed without the table's segment_keys."""
    tokens = {r["conversation_id"]: np.asarray(r["input_ids"], dtype=np.int32).tobytes()
              for r in TokenTable.open(packed).conversations().iter_rows(["conversation_id", "input_ids"])}
    return [{tokens[sid.rpartition("#")[0]] for sid in r["segment_ids"]}
            for r in TokenTable.open(packed).iter_rows(["segment_ids"])]


def _leaks(content: list[set[bytes]], train, val) -> int:
    """Validation blocks sharing a conversation's content with a training block."""
    seen = set().union(*(content[i] for i in train))
    return sum(bool(content[i] & seen) for i in val)


@pytest.fixture(scope="module")
def twice(tmp_path_factory, tiny_verifier_dir):
    """A weight-2 mixture (the README's "repeats it twice") of six long conversations and eight short ones,
    packed at --max-seq-len 64 into blocks of 64 and extracted by the tiny verifier (full context)."""
    root = tmp_path_factory.mktemp("twice")
    short = [{"id": f"s{i}", "messages": [{"role": "user", "content": f"Say {i}."},
                                          {"role": "assistant", "content": f"{i} " * (1 + i)}]} for i in range(8)]
    (root / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in long_conversations(6) + short))
    (root / "mix.yaml").write_text("sources:\n  - {name: twice, path: c.jsonl, weight: 2}\n")
    result = CliRunner().invoke(data_main, ["pack", str(root / "mix.yaml"), "--tokenizer", str(tiny_verifier_dir),
                                            "--output", str(root / "packed"), "--max-seq-len", "64",
                                            "--block-size", "64"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    run_extract(ExtractConfig(packed=str(root / "packed"), verifier=str(tiny_verifier_dir), output=str(root / "s.zarr"),
                              layers=[1, 2, 4], device="cpu", max_context=256), progress=False)
    return root / "packed", root / "s.zarr"


def test_a_weight_2_mixture_keeps_every_copy_and_window_on_one_side(twice):
    packed, path = twice
    content = _packed_content(packed)
    store = FeatureStore.open(path)
    assert store.n_blocks == len(content) == 76 and store.segment_keys().shape == (76, 2)
    groups = block_groups(store.segment_keys())  # a short conversation's 2 copies, a long one's windows of both
    assert sorted(np.unique(groups, return_counts=True)[1].tolist()) == [2] * 8 + [4, 8, 12, 16, 20]
    for seed in range(6):
        train, val = split_per_store(open_stores(str(path)), seed, 0.25)
        assert 10 <= val.size <= 19 and sorted(train.tolist() + val.tolist()) == list(range(76))  # 19 asked
        assert _leaks(content, train, val) == 0
    # the block rule (peagle before) holds out copies and windows of conversations that training reads
    assert [_leaks(content, *split_blocks(np.arange(76), seed, 0.25)) for seed in range(3)] == [19, 19, 17]  # of 19
    assert split_per_store(open_stores(str(path)), 0, 0.25)[1].tolist() == [*range(18, 32), 58, 59, 74, 75]


def test_training_records_the_split_and_eval_holds_out_the_same_blocks(twice, tmp_path):
    _, path = twice
    out = tmp_path / "run"
    run_train(_cfg(str(path), out, max_steps=1, val_fraction=0.25, num_depths=3, draft_vocab_size=64))
    config = json.loads((out / "final" / "config.json").read_text())
    training = config["peagle_training"]
    val = split_per_store(open_stores(str(path)), 0, 0.25)[1].tolist()
    assert training["val_blocks"] == val and training["split"] == {"rule": "conversation_groups", "version": 2}
    selection = select_eval_blocks(FeatureStore.open(path), config)
    assert selection.split == "validation" and selection.ids == val and not selection.warnings
    # a checkpoint of a run split over blocks alone (an earlier peagle): eval counts the leaking blocks
    training.pop("split")
    leaky = [int(b) for b in split_blocks(np.arange(76), 2, 0.25)[1]]
    training["val_blocks"] = leaky
    warned = select_eval_blocks(FeatureStore.open(path), config).warnings
    assert len(warned) == 1 and "drew its validation split" in warned[0] and "share a conversation" in warned[0]


def test_a_store_without_segment_keys_is_refused_unless_nothing_is_held_out(tmp_path, verifier_dir):
    path = _store(tmp_path / "old.zarr", verifier_dir, n_blocks=4)
    store = FeatureStore.open(path, mode="r+")
    store._set_own_attr(segment_keys=False)  # as a store extracted before peagle recorded them
    with pytest.raises(StoreFormatError, match=r"Record them with `peagle-data extract PACKED --output STORE \.\.\. "
                                               r"--resume`.*or train with --val-fraction 0"):
        split_store(FeatureStore.open(path), 0, 0.25)
    assert split_store(FeatureStore.open(path), 0, 0.0)[1].tolist() == []
    assert split_store(FeatureStore.open(path), 0, 0.25, rule=1)[1].tolist() == \
        split_blocks(np.arange(4), 0, 0.25)[1].tolist()  # a resumed run of the block rule keeps it


def test_one_group_too_large_for_the_split_is_refused_before_training(tmp_path, verifier_dir):
    path = _store(tmp_path / "one.zarr", verifier_dir, n_blocks=6, keys=[[1, 2], [2], [2, 3, 4], [5], [5, 1], [4]])
    with pytest.raises(InputError, match=r"form 1 group\(s\).*largest holding \[6\] blocks.*--val-fraction 0"):
        run_train(_cfg(path, tmp_path / "out", max_steps=1, val_fraction=0.2))
    assert not (tmp_path / "out").exists()


def test_a_conversation_held_out_in_one_store_and_trained_in_another_is_refused(tmp_path, verifier_dir):
    a = _store(tmp_path / "a.zarr", verifier_dir, n_blocks=4, keys=[[1, 2], [3], [4, 5, 6], [7, 8]])
    b = _store(tmp_path / "b.zarr", verifier_dir, n_blocks=4, seed=1, keys=[[11, 12], [13], [14, 15, 16], [17, 18]])
    val_a = split_per_store(open_stores([a, b]), 0, 0.25)[1]
    held = [[1, 2], [3], [4, 5, 6], [7, 8]][int(val_a[0])][0]
    c = _store(tmp_path / "c.zarr", verifier_dir, n_blocks=4, seed=2, keys=[[21, 22], [23], [24, 25, 26], [27, 28]])
    fc = FeatureStore.open(c, mode="r+")
    val_c = split_per_store(open_stores(c), 0, 0.25)[1]
    rows = [[21, 22], [23], [24, 25, 26], [27, 28]]
    train_c = next(i for i in range(4) if i not in val_c.tolist())
    rows[train_c] = [held] + rows[train_c][1:]  # store c trains on a conversation store a holds out
    fc.write_segment_keys(rows)
    with pytest.raises(StoreMismatchError, match="holds out 1 conversation"):
        split_per_store(open_stores([a, c]), 0, 0.25)


def test_a_resumed_run_keeps_the_split_it_started_with(capsys):
    assert resumed_split_rule(None, 0.05, "ckpt") == 2
    assert resumed_split_rule({"data": {"format": 2, "split": 2}}, 0.05, "ckpt") == 2
    assert resumed_split_rule({"data": {"format": 2}}, 0.05, "ckpt-7") == 1
    assert "ckpt-7 was started by a peagle that drew the validation split over blocks alone" in capsys.readouterr().err


def test_a_small_store_asked_for_one_block_holds_out_its_smallest_group():
    groups = np.array([0, 0, 2, 2, 2, 5, 5])  # groups of 2, 3, 2; 5% of 7 blocks asks 1
    train, val = split_by_groups(groups, 0, 0.05)
    assert val.tolist() == [0, 1] and train.tolist() == [2, 3, 4, 5, 6]
    # the smallest groups (0-1 and 5-6), the one the seed's walk meets first
    assert [split_by_groups(groups, s, 0.05)[1].tolist() for s in range(4)] == [[0, 1], [5, 6], [0, 1], [0, 1]]
    with pytest.raises(InputError, match="whole groups hold out only 0"):
        split_by_groups(np.array([0, 0, 0]), 0, 0.05)  # one group: none can be held out
