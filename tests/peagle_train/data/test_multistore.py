"""Training on several stores: one block space, summed token frequencies, a split per store, resume."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from peagle_train.data.loader import split_blocks
from peagle_train.data.multistore import (StoreSet, conversation_groups, expand_store_args, open_stores,
                                         split_per_store, usable_blocks)
from peagle_train.model.checkpoint import load_drafter
from peagle_train.train.run import run_train
from peagle_train.train.setup import build_draft_vocab
from stores.errors import InputError, StoreFormatError, StoreMismatchError
from stores.features.feature_store import FeatureStore
from tests.peagle_train.train.test_train import _cfg, _rows, _store, grown_run


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory, make_tiny_llama):
    from tests.peagle_train.train.test_train import H, V

    return make_tiny_llama(tmp_path_factory.mktemp("verifier"), hidden=H, vocab=V)


def _two(tmp_path, verifier_dir):
    a = _store(tmp_path / "a.zarr", verifier_dir, n_blocks=4, seed=1)
    b = _store(tmp_path / "b.zarr", verifier_dir, n_blocks=3, seed=2)
    fb = FeatureStore.open(b, mode="r+")
    freq = np.zeros(fb.vocab_size, dtype=np.int64)
    freq[[200, 201, 202]] = [10_000, 20_000, 30_000]  # only B's counts put 200..202 on top
    fb.set_token_freq(freq)
    return a, b


def test_store_set_reads_blocks_of_every_store_in_one_id_space(tmp_path, verifier_dir):
    a, b = _two(tmp_path, verifier_dir)
    s = open_stores([a, b])
    assert isinstance(s, StoreSet) and s.n_blocks == 7 and s.locate(4) == (1, 0) and s.locate(3) == (0, 3)
    fa, fb = FeatureStore.open(a), FeatureStore.open(b)
    assert np.array_equal(s.token_freq(), fa.token_freq() + fb.token_freq())
    got = s.read_blocks([5, 0, 6, 4])
    want = [fb.read_block(1), fa.read_block(0), fb.read_block(2), fb.read_block(0)]
    for x, y in zip(got, want):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.aux_hidden, y.aux_hidden)
    assert torch.equal(s.read_block(2).final_hidden, fa.read_block(2).final_hidden)
    with pytest.raises(IndexError):
        s.read_block(7)
    assert isinstance(open_stores([a]), FeatureStore) and isinstance(open_stores(a), FeatureStore)


def test_split_per_store_and_summed_draft_vocab(tmp_path, verifier_dir):
    a, b = _two(tmp_path, verifier_dir)
    s = open_stores([a, b])
    usable = usable_blocks(s, allow_incomplete=False)
    assert usable.tolist() == list(range(7))
    train, val = split_per_store(s, seed=5, val_fraction=0.25)
    ta, va = split_blocks(np.arange(4), 5, 0.25)
    tb, vb = split_blocks(np.arange(3), 5, 0.25)
    assert train.tolist() == [*ta, *(tb + 4)] and val.tolist() == [*va, *(vb + 4)]
    assert len(va) == 1 and len(vb) == 1  # each store holds out its own block
    assert val.tolist() == [0, 5]  # pinned
    d2t = build_draft_vocab(s.token_freq(), 4)
    top = (torch.arange(4) + d2t).tolist()
    assert {200, 201, 202} <= set(top)  # B's frequent tokens are in the draft vocab of the summed counts
    assert (torch.arange(4) + build_draft_vocab(FeatureStore.open(a).token_freq(), 4)).tolist() == [0, 1, 2, 4]


def test_stores_of_other_verifiers_or_layers_are_refused(tmp_path, verifier_dir, make_tiny_llama):
    a = _store(tmp_path / "a.zarr", verifier_dir, n_blocks=2)
    other = _store(tmp_path / "o.zarr", make_tiny_llama(tmp_path / "v2"), n_blocks=2)
    with pytest.raises(StoreMismatchError, match="one drafter trains on the features of one verifier"):
        open_stores([a, other])
    layers = FeatureStore.open(_store(tmp_path / "l.zarr", verifier_dir, n_blocks=2), mode="r+")
    layers.update_attrs(layers=[1, 3])
    with pytest.raises(StoreMismatchError, match=r"aux layers \[1, 3\]"):
        open_stores([a, str(tmp_path / "l.zarr")])
    with pytest.raises(InputError, match="given more than once"):
        open_stores([a, a])
    with pytest.raises(InputError, match="given more than once"):
        open_stores([a, str(tmp_path / "." / "a.zarr") + "/"])


def test_stores_of_other_template_modes_are_refused(tmp_path, verifier_dir):
    """The checkpoint records one mode (``--chat-template-kwargs``), which peagle-eval checks."""
    a = _store(tmp_path / "a.zarr", verifier_dir, n_blocks=2)
    off = FeatureStore.open(_store(tmp_path / "off.zarr", verifier_dir, n_blocks=2), mode="r+")
    off.update_attrs(tokenizer={**(off.attrs.get("tokenizer") or {}), "chat_template_kwargs": {"enable_thinking": False}})
    with pytest.raises(StoreMismatchError) as info:
        open_stores([a, str(tmp_path / "off.zarr")])
    assert str(info.value) == (
        f"{tmp_path / 'off.zarr'} holds data rendered with chat template kwargs {{\"enable_thinking\": false}}, {a} "
        "with none (the template's defaults); one drafter trains in the mode its verifier is served in: pack every "
        "store's data with the same --chat-template-kwargs")


def test_stores_holding_the_same_packed_blocks_are_refused(tmp_path, verifier_dir):
    # A copy of a store, a merged store beside one of its shards, the same shard twice: the same
    # features would train twice and validate on training blocks.
    a = _store(tmp_path / "a.zarr", verifier_dir, n_blocks=4, seed=1)
    shutil.copytree(a, tmp_path / "copy.zarr")
    with pytest.raises(StoreMismatchError, match=r"copy.zarr and .*a.zarr hold the same 4 block\(s\) of one packed "
                                                 r"table \(packed block 0 among them"):
        open_stores([a, str(tmp_path / "copy.zarr")])
    shards = []
    for i in range(2):  # extract --num-shards 2 of the same packed table: packed blocks i, i + 2
        path = _store(tmp_path / f"s{i}.zarr", verifier_dir, n_blocks=2, seed=1)
        s = FeatureStore.open(path, mode="r+")
        s.update_attrs(source=FeatureStore.open(a).attrs["source"], shard={"num_shards": 2, "shard_index": i})
        shards.append(path)
    with pytest.raises(StoreMismatchError, match=r"s1.zarr and .*a.zarr hold the same 2 block\(s\) .*packed block 1 "):
        open_stores([a, shards[1]])
    assert open_stores(shards).n_blocks == 4  # the two shards are disjoint: accepted
    third = FeatureStore.open(_store(tmp_path / "t.zarr", verifier_dir, n_blocks=2, seed=1), mode="r+")
    third.update_attrs(source=FeatureStore.open(a).attrs["source"], shard={"num_shards": 4, "shard_index": 2})
    with pytest.raises(StoreMismatchError, match=r"t.zarr and .*s0.zarr hold the same 1 block\(s\) .*packed block 2 "):
        open_stores([*shards, str(tmp_path / "t.zarr")])  # shard 2 of 4 holds packed blocks 2, 6; shard 0 of 2: 0, 2


def test_store_list_file(tmp_path):
    (tmp_path / "lists").mkdir()
    f = tmp_path / "lists" / "stores.txt"
    f.write_text("# my stores\n../a.zarr\n\n/abs/b.zarr\n")
    assert expand_store_args([str(f)]) == [str(tmp_path / "lists" / "../a.zarr"), "/abs/b.zarr"]
    assert expand_store_args(["x.zarr"]) == "x.zarr"
    assert expand_store_args(["x.zarr", str(f)])[0] == "x.zarr"
    f.write_text("# nothing\n")
    with pytest.raises(InputError, match="names no store"):
        expand_store_args([str(f)])


def test_training_on_two_stores_resumes_exactly(tmp_path, verifier_dir):
    a, b = _two(tmp_path, verifier_dir)
    full = tmp_path / "full"
    summary = run_train(_cfg([a, b], full, max_steps=8, save_every=4, val_fraction=0.25, draft_vocab_size=64))
    assert summary["draft_vocab_size"] == 64
    want = build_draft_vocab(open_stores([a, b]).token_freq(), 64)  # from the summed frequencies
    assert torch.equal(load_drafter(full / "final").d2t.cpu().long(), want)
    assert not torch.equal(want, build_draft_vocab(FeatureStore.open(a).token_freq(), 64))
    part = tmp_path / "part"
    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoint-8")
    shutil.rmtree(part / "final")
    resumed = run_train(_cfg([a, b], part, max_steps=8, save_every=4, val_fraction=0.25, draft_vocab_size=64,
                             resume=True))
    assert resumed["resumed_from"].endswith("checkpoint-4")
    x, y = _rows(full), _rows(part)
    assert [r["step"] for r in y] == list(range(1, 9))
    for r, q in zip(x, y):
        assert r["loss"] == pytest.approx(q["loss"], rel=1e-6, abs=1e-7) and r["n_elements"] == q["n_elements"]
    sa, sb = load_drafter(full / "final").state_dict(), load_drafter(part / "final").state_dict()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k])
    with pytest.raises(InputError, match="these differ from it: --store: saved"):  # other stores: not the same run
        run_train(_cfg([b, a], part, max_steps=8, save_every=4, val_fraction=0.25, draft_vocab_size=64, resume=True))


def test_split_sides_do_not_depend_on_which_blocks_are_extracted(tmp_path, verifier_dir):
    """The split is drawn over every block id of each store: finishing an extraction moves no block."""
    a = _store(tmp_path / "a.zarr", verifier_dir, n_blocks=4, seed=1)
    b = _store(tmp_path / "b.zarr", verifier_dir, n_blocks=6, seed=2, done={0, 3})
    s = open_stores([a, b])
    assert usable_blocks(s, allow_incomplete=True).tolist() == [0, 1, 2, 3, 4, 7]
    train, val = split_per_store(s, seed=0, val_fraction=0.25)
    assert val.tolist() == [1, 8, 9] and train.tolist() == [0, 2, 3, 4, 5, 6, 7]
    fb = FeatureStore.open(b, mode="r+")
    for i in range(6):
        fb.mark_done(i)
    again = split_per_store(open_stores([a, b]), seed=0, val_fraction=0.25)
    assert again[0].tolist() == train.tolist() and again[1].tolist() == val.tolist()


def test_two_stores_allow_incomplete_then_the_extraction_finishes_then_resume(tmp_path, verifier_dir, monkeypatch):
    """Issue 22 item 7 on a StoreSet: store 0 complete (6 blocks), store 1 with 4 of 10 extracted."""
    val_side, trained, val_rows = grown_run(tmp_path, verifier_dir, monkeypatch, (6, 10), (range(6), range(4)))
    assert val_side == [4, 5, 12, 14, 15]  # [4, 5] of store 0, [6, 8, 9] of store 1 (+ 6)
    assert [r["blocks"] for r in val_rows] == [[4, 5], val_side, val_side]


def test_cli_takes_repeated_stores_and_a_store_list(tmp_path, verifier_dir):
    import json

    from click.testing import CliRunner

    from cli.train import main

    a, b = _two(tmp_path, verifier_dir)
    (tmp_path / "stores.txt").write_text("a.zarr\nb.zarr\n")
    common = ["--max-steps", "2", "--num-depths", "2", "--val-fraction", "0", "--loss-chunk-size", "64"]
    r = CliRunner().invoke(main, ["--store", a, "--store", b, "--output", str(tmp_path / "o1"), *common])
    assert r.exit_code == 0, r.output
    r2 = CliRunner().invoke(main, ["--store", str(tmp_path / "stores.txt"), "--output", str(tmp_path / "o2"), *common])
    assert r2.exit_code == 0, r2.output
    saved = [json.loads((tmp_path / o / "train_config.json").read_text())["data"]["store"] for o in ("o1", "o2")]
    assert saved[0] == [a, b] and saved[1] == [str(tmp_path / "a.zarr"), str(tmp_path / "b.zarr")]
    summary = lambda res: json.loads(res.output[res.output.index("{\n"):])  # noqa: E731 - after the warnings
    assert summary(r)["last_step_loss"] == summary(r2)["last_step_loss"] and summary(r)["steps"] == 2


def test_a_store_without_blocks_is_named_as_such(tmp_path, verifier_dir):
    # A shard store of a table with fewer blocks than shards holds no blocks: extraction did run.
    a = _store(tmp_path / "a.zarr", verifier_dir, n_blocks=2, seed=1)
    empty = _store(tmp_path / "e.zarr", verifier_dir, n_blocks=0, seed=2)
    with pytest.raises(StoreFormatError, match=r"e.zarr: the store holds no blocks \(a shard store of a packed table "
                                               r"with fewer blocks than --num-shards, or of an empty table\); leave it "
                                               r"out of --store"):
        usable_blocks(open_stores([a, empty]), allow_incomplete=False)


def test_conversation_groups_join_blocks_sharing_a_conversation_also_across_stores(tmp_path, verifier_dir):
    a = _store(tmp_path / "a.zarr", verifier_dir, n_blocks=4, keys=[[1, 2], [3], [2, 9, 10], [11, 12]])
    b = _store(tmp_path / "b.zarr", verifier_dir, n_blocks=3, seed=2, keys=[[20, 21], [12], [30, 31, 32]])
    groups, leads = conversation_groups(FeatureStore.open(a))
    assert groups.tolist() == [0, 1, 0, 3] and leads.tolist() == [0, 1, 0, 3]
    groups, leads = conversation_groups(open_stores([a, b]))
    assert groups.tolist() == [0, 1, 0, 3, 4, 3, 6]  # key 12 in both stores
    assert leads.tolist() == [0, 1, 0, 3, 4, 3, 6]  # block 5's conversation 12 starts at block 3


def test_epoch_order_conversations_needs_segment_keys_and_is_refused_before_training(tmp_path, verifier_dir):
    path = _store(tmp_path / "old.zarr", verifier_dir, n_blocks=4)
    FeatureStore.open(path, mode="r+")._set_own_attr(segment_keys=False)  # as an old extraction left it
    with pytest.raises(StoreFormatError, match=r"old.zarr: the store does not record which conversation .* "
                                               r"--epoch-order conversations cannot group its blocks.*--epoch-order "
                                               r"blocks$"):
        run_train(_cfg(path, tmp_path / "out", epoch_order="conversations"))
    assert not (tmp_path / "out" / "final").exists()
    with pytest.raises(ValueError, match=r"--epoch-order must be one of blocks, conversations, got 'groups'"):
        _cfg(path, tmp_path / "out", epoch_order="groups")
