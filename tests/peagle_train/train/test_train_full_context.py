"""``peagle-train`` and ``peagle-eval`` on full-context stores (``extract --context full``, format 2): the
loader yields the store's blocks, a run trains on one alone and beside a window-context store (format 1),
offline evaluation scores its validation blocks, and a shard store (whose training blocks read context
blocks of the other shards) is refused before any weights with the merge command."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cli.eval import main as eval_main
from peagle_data.extract.config import ExtractConfig
from peagle_data.extract.run import run_extract
from peagle_train.data.loader import BlockLoader, BlockSequence
from peagle_train.data.multistore import open_stores
from peagle_train.evaluate.offline import select_eval_blocks
from peagle_train.train.config import TrainConfig
from peagle_train.train.run import run_train
from stores.errors import InputError, StoreFormatError, StoreMismatchError
from stores.features.feature_store import FeatureStore
from tests.long_conversations import pack_long

LAYERS = [1, 2, 4]
MERGE_HINT = "Join the shards first: peagle-data merge SHARD_0 ... SHARD_N-1 --output STORE"


@pytest.fixture(scope="module")
def stores(tmp_path_factory, tiny_verifier_dir):
    """``{"full": a full-context store, "same_windows": the window-context store of the same packed table,
    "window": a window-context store of another packing of the same conversations, "shard": shard 0 of 2
    of a full-context store}`` of the tiny verifier."""
    root = tmp_path_factory.mktemp("full_context")
    packed = pack_long(root / "packed", tiny_verifier_dir)
    other = pack_long(root / "packed48", tiny_verifier_dir, max_seq_len=48, block_size=96)
    common = dict(verifier=str(tiny_verifier_dir), layers=LAYERS, device="cpu")
    out = {"full": root / "full.zarr", "window": root / "window.zarr", "shard": root / "shard.zarr",
           "same_windows": root / "same_windows.zarr"}
    run_extract(ExtractConfig(packed=str(packed), output=str(out["full"]), context="full", max_context=256, **common),
                progress=False)
    run_extract(ExtractConfig(packed=str(packed), output=str(out["same_windows"]), context="window", **common),
                progress=False)
    run_extract(ExtractConfig(packed=str(other), output=str(out["window"]), context="window", **common),
                progress=False)
    run_extract(ExtractConfig(packed=str(packed), output=str(out["shard"]), context="full", max_context=256,
                              num_shards=2, shard_index=0, **common), progress=False)
    return {k: str(v) for k, v in out.items()}


def _cfg(store, out, **kw):
    base = dict(store=store, output=str(out), num_depths=3, lr=3e-3, warmup_steps=0, val_fraction=0.25, max_steps=4,
                loss_chunk_size=64, draft_vocab_size=64)
    return TrainConfig.from_flat(**{**base, **kw})


def _same(a, b) -> bool:
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in
               ("input_ids", "loss_mask", "position_ids", "cu_seqlens", "aux_hidden", "final_hidden"))


def test_the_loader_yields_the_full_context_stores_blocks(stores):
    full = FeatureStore.open(stores["full"])
    assert full.layout == "windows" and full.n_blocks == 16 and full.contexts.n_blocks == 5
    seq = BlockSequence(np.arange(16), np.arange(16), seed=1)
    loader = BlockLoader(full, seq, blocks_per_read=3)
    got = list(itertools.islice(iter(loader), 20))  # past one epoch
    loader.close()
    assert sorted(b.block_id for _, b in got[:16]) == list(range(16))
    for _, b in got:
        ref = full.read_block(b.block_id, via="zarr")  # the zarr path: another read than the loader's files
        assert b.aux_hidden.shape == (len(ref.input_ids), 3 * 64), b.block_id  # layers side by side
        assert _same(b, ref.flat_layers(b.block_id)), b.block_id
    # beside a format-1 store: global block 16 + k of the set is block k of the full-context store
    both = open_stores([stores["window"], stores["full"]])
    n = FeatureStore.open(stores["window"]).n_blocks
    assert both.n_blocks == n + 16 and both.done_mask().all()
    for k in (0, 7, 15):
        assert _same(both.read_block(n + k), full.read_block(k))


def test_training_on_a_full_context_store_alone_and_beside_a_window_store(tmp_path, stores):
    summary = run_train(_cfg(stores["full"], tmp_path / "one"))
    assert summary["last_step"] == 4 and np.isfinite(summary["last_step_loss"])
    config = json.loads((tmp_path / "one" / "final" / "config.json").read_text())
    assert [(s["n_blocks"], s["context"]) for s in config["peagle_training"]["stores"]] == [(16, "full")]
    # the window store packs the same conversations again (at --max-seq-len 48 into blocks of 96, so its windows
    # link all its blocks into one group): no validation split can keep them apart from the full store's
    with pytest.raises(InputError, match=r"holding \[23\] blocks"):
        run_train(_cfg([stores["window"], stores["full"]], tmp_path / "two", max_steps=6))
    mixed = run_train(_cfg([stores["window"], stores["full"]], tmp_path / "two", max_steps=6, val_fraction=0.0,
                           force=True))
    assert mixed["last_step"] == 6 and np.isfinite(mixed["last_step_loss"])
    config = json.loads((tmp_path / "two" / "final" / "config.json").read_text())
    n = FeatureStore.open(stores["window"]).n_blocks
    assert [(s["n_blocks"], s["first_block"]) for s in config["peagle_training"]["stores"]] == [(n, 0), (16, n)]

    # offline evaluation of the first drafter on its store: the run's validation blocks of it
    result = CliRunner().invoke(eval_main, ["--drafter", str(tmp_path / "one" / "final"), "--store", stores["full"],
                                            "--all-anchor"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    val = json.loads((tmp_path / "one" / "final" / "config.json").read_text())["peagle_training"]["val_blocks"]
    # 16 * 0.25 = 4 asked; whole groups of blocks sharing a conversation hold out 3
    assert report["split"] == "validation" and report["blocks"] == sorted(val) == [0, 1, 13]
    assert report["store_blocks_done"] == report["store_blocks_total"] == 16 and report["positions_scored"] > 0


def test_a_full_context_shard_store_is_refused_with_the_merge_command(tmp_path, stores, tiny_verifier_dir,
                                                                      monkeypatch):
    import transformers

    def no_weights(cls, *a, **k):
        raise AssertionError(f"{cls.__name__}.from_pretrained was called before the refusal")

    drafter = run_train(_cfg(stores["full"], tmp_path / "drafter", max_steps=1))["checkpoint"]
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(no_weights))
    with pytest.raises(StoreFormatError, match=f"shard 0 of 2 of a full-context store: .*{MERGE_HINT}"):
        run_train(_cfg(stores["shard"], tmp_path / "out"))
    with pytest.raises(StoreFormatError, match=MERGE_HINT):
        run_train(_cfg([stores["window"], stores["shard"]], tmp_path / "out2"))
    result = CliRunner().invoke(eval_main, ["--drafter", drafter, "--store", stores["shard"]])
    assert result.exit_code != 0 and MERGE_HINT in " ".join(result.output.split()), result.output


def test_resume_on_the_same_windows_with_other_features_is_refused(tmp_path, stores, monkeypatch):
    """A store extracted again at the run's path with the other --context holds the same windows (same
    packed table, block count, layers, verifier) but other features: the resume is refused before the
    weights; offline evaluation still recognises its validation blocks (the same windows were held out)."""
    import shutil

    import transformers

    path = tmp_path / "s.zarr"
    shutil.copytree(stores["same_windows"], path)
    run_train(_cfg(str(path), tmp_path / "out", max_steps=2, save_every=1))

    def no_weights(cls, *a, **k):
        raise AssertionError(f"{cls.__name__}.from_pretrained was called before the refusal")

    shutil.rmtree(path)
    shutil.copytree(stores["full"], path)
    with monkeypatch.context() as m:
        m.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(no_weights))
        with pytest.raises(StoreMismatchError, match="its context is 'full', the run's was 'window'"):
            run_train(_cfg(str(path), tmp_path / "out", max_steps=2, save_every=1, resume=True))
    config = json.loads((tmp_path / "out" / "final" / "config.json").read_text())
    chosen = select_eval_blocks(FeatureStore.open(path), config)
    assert chosen.split == "validation" and chosen.ids == sorted(config["peagle_training"]["val_blocks"])


def test_an_altered_context_chunk_stops_training_and_evaluation_naming_the_block(tmp_path, stores):
    """Issue 33, kind 1: a few hundred bytes overwritten inside a context block's aux_hidden chunk (same size,
    only the crc32c tells) were trained on (loss 14 on that step, val_loss NaN) and scored by peagle-eval
    with exit 0; now both stop at it, naming the training block, the context block, its chunk file and the
    repair command, and the refused training run leaves no output."""
    import shutil

    store = tmp_path / "full.zarr"
    shutil.copytree(stores["full"], store)
    chunk = store / "contexts" / "aux_hidden" / "c" / "1" / "0" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[1000:1300] = bytes(300)
    chunk.write_bytes(bytes(data))
    readers = [i for i in range(16) if 1 in FeatureStore.open(store).view_row(i)[:, 0].tolist()]
    assert readers
    with pytest.raises(StoreFormatError, match=rf"training block ({'|'.join(map(str, readers))}) cannot be trusted: "
                                               r"context block 1: .*contexts/aux_hidden/c/1/0/0/0: its crc32c "
                                               r"checksum does not match its data\. `peagle-data extract PACKED "
                                               r"--context full --resume --output"):
        run_train(_cfg(str(store), tmp_path / "out", max_steps=16, val_fraction=0.0))
    assert not (tmp_path / "out").exists()
    summary = run_train(_cfg(stores["full"], tmp_path / "good", max_steps=1, val_fraction=0.0))
    # no block held out: evaluation scores every done block, the readers of context block 1 among them
    result = CliRunner().invoke(eval_main, ["--drafter", summary["checkpoint"], "--store", str(store),
                                            "--output", str(tmp_path / "eval.json")])
    assert result.exit_code == 2, result.output
    assert "cannot be trusted: context block 1: " in result.output and "NaN" not in result.output
    assert not (tmp_path / "eval.json").exists()
