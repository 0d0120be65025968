"""``peagle-train --method dflash`` on the tiny synthetic store of test_train.py (vocab 256, hidden 64): the same
loop, loader, checkpoints and resume as P-EAGLE, with the DFlash kind's samples, loss and checkpoint format."""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle_train.model.checkpoint import load_drafter
from peagle_train.model.dflash import DFlashDrafter
from peagle_train.model.dflash_checkpoint import load_dflash
from peagle_train.train.config import TrainConfig
from peagle_train.model.warm_start import read_init_source
from peagle_train.train.run import build_trainer, run_train
from stores.errors import InputError, StoreFormatError
from stores.staging import check_replaceable, foreign_entries
from tests.peagle_train.train.test_train import H, V, _store


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory, make_tiny_llama):
    return make_tiny_llama(tmp_path_factory.mktemp("verifier"), hidden=H, vocab=V)


def _cfg(store, out, **kw):
    base = dict(store=store, output=str(out), method="dflash", block_size=4, lr=3e-3, warmup_steps=0,
                val_fraction=0.0, max_steps=8, loss_chunk_size=64)
    base.update(kw)
    return TrainConfig.from_flat(**base)


def _rows(out, split="train"):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def test_dflash_loss_decreases_and_the_run_records_its_kind(tmp_path, verifier_dir):
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=1)
    summary = run_train(_cfg(store, tmp_path / "out", max_steps=12, draft_vocab_size=100))
    rows = _rows(tmp_path / "out")
    losses = [r["loss"] for r in rows]
    assert len(rows) == 12 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3])
    assert len(rows[0]["acc"]) == 3  # B - 1 drafts per block
    # every depth is fed by every block whose slot lies in a supervised span: the decay weights, not fewer elements
    assert all(f[0] >= f[1] >= f[2] > 0 for f in (r["depth_elements"] for r in rows))
    saved = json.loads((tmp_path / "out" / "train_config.json").read_text())["model"]
    assert (saved["method"], saved["block_size"], saved["num_depths"], saved["drafter_layer"]) == ("dflash", 4, 3,
                                                                                                  "qwen3")
    config = json.loads((tmp_path / "out" / "final" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    assert config["peagle_training"]["method"] == "dflash"
    drafter = load_dflash(summary["checkpoint"])
    assert isinstance(drafter, DFlashDrafter) and drafter.config.draft_vocab_size == 100
    assert drafter.config.mask_token_id == 3
    with pytest.raises(StoreFormatError, match="dflash"):
        load_drafter(summary["checkpoint"])  # P-EAGLE's reader names the kind it found
    # every file the run wrote is one --force may replace (training_segments.npy once made --force refuse it)
    assert (tmp_path / "out" / "final" / "training_segments.npy").is_file()
    assert foreign_entries(tmp_path / "out") == [] and check_replaceable(tmp_path / "out", force=True)


def test_dflash_resume_continues_exactly(tmp_path, verifier_dir):
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=3)
    run_train(_cfg(store, tmp_path / "full", max_steps=4))
    full = _rows(tmp_path / "full")
    run_train(_cfg(store, tmp_path / "part", max_steps=4, save_every=2))
    for name in ("final", "checkpoint-4"):  # as if the run had stopped after step 2's checkpoint
        shutil.rmtree(tmp_path / "part" / name)
    run_train(_cfg(store, tmp_path / "part", max_steps=4, save_every=2, resume=True))
    part = _rows(tmp_path / "part")
    assert [r["step"] for r in part] == [1, 2, 3, 4]
    assert [r["loss"] for r in part] == pytest.approx([r["loss"] for r in full], rel=1e-5)


@pytest.mark.parametrize("kw, option", [
    (dict(method="peagle", block_size=4), "--block-size"),
    (dict(method="dflash", block_size=4, num_depths=4), "--num-depths"),
    (dict(method="dflash", block_size=1), "--block-size"),
    (dict(method="dflash", drafter_layer="llama"), "--drafter-layer"),
    (dict(method="dflash", init_from="x", block_size=4, num_depths=4), "--num-depths"),
    (dict(method="dflash", init_from="x", init_layers="verifier"), "--init-layers"),
    (dict(method="eagle"), "--method"),
    (dict(method="dflash", down_sample_ratio=0.9), "--down-sample-ratio"),  # COD's: ignored by DFlash, refused
    (dict(method="dflash", down_sample_ratio_min=0.9), "--down-sample-ratio-min"),
    (dict(method="dflash", draft_vocab_size=1), "--draft-vocab-size"),  # loss 0, accuracy 1: a metric that misleads
    (dict(draft_vocab_size=1), "--draft-vocab-size"),
])
def test_bad_dflash_settings_name_the_option(kw, option):
    with pytest.raises(ValueError, match=option):
        TrainConfig.from_flat(store="s", output="o", **kw)


def test_a_block_longer_than_the_stores_rows_is_refused_before_the_weights(tmp_path, verifier_dir):
    """--block-size 300 on 256-token rows was killed for memory (22 GB) without a word."""
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=1)  # rows of 48 tokens
    with pytest.raises(InputError, match=r"--block-size 49 is longer than the store's rows \(48 tokens") as e:
        run_train(_cfg(store, tmp_path / "out", block_size=49))
    assert e.value.field == "--block-size" and not (tmp_path / "out" / "final").exists()
    run_train(_cfg(store, tmp_path / "ok", block_size=48, max_steps=1, max_anchors=2))  # a row's length trains


def test_defaults_per_method():
    peagle = TrainConfig.from_flat(store="s", output="o")
    assert (peagle.model.method, peagle.model.num_depths, peagle.model.block_size) == ("peagle", 4, None)
    assert peagle.depth_weights is None
    dflash = TrainConfig.from_flat(store="s", output="o", method="dflash")
    assert (dflash.model.block_size, dflash.model.num_depths) == (8, 7)
    warm = TrainConfig.from_flat(store="s", output="o", method="dflash", init_from="x")  # the source's, once read
    assert (warm.model.block_size, warm.model.num_depths) == (None, None)
    given = TrainConfig.from_flat(store="s", output="o", method="dflash", init_from="x", num_depths=3)
    assert (given.model.block_size, given.model.num_depths) == (4, 3)
    assert dflash.depth_weights == pytest.approx([np.exp(-d / 4) for d in range(7)])  # speculators' decay, γ = 4


@pytest.fixture(scope="module")
def dflash_source(tmp_path_factory, verifier_dir):
    """(store, the output of a 6-step DFlash run: block 4, draft vocab 100, 1 layer, validation on)."""
    root = tmp_path_factory.mktemp("dflash_src")
    store = _store(root / "s.zarr", verifier_dir, n_blocks=3)
    run_train(_cfg(store, root / "x", max_steps=6, draft_vocab_size=100, val_fraction=0.3))
    return store, root / "x"


def _as_speculators(src, dst):
    """``src`` as speculators' DFlash trainer writes it: no ``peagle`` block, ``sliding_window_non_causal``
    false (its default), no ``embed_tokens`` (speculators reloads the verifier's)."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    for key in ("peagle", "peagle_training", "embed_requires_grad"):
        cfg.pop(key, None)
    cfg["sliding_window_non_causal"] = False
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in load_file(str(src / "model.safetensors")).items() if k != "embed_tokens.weight"},
              str(dst / "model.safetensors"))
    return dst


def test_a_dflash_warm_start_loads_every_weight_and_takes_the_sources_block_size(tmp_path, dflash_source):
    store, x = dflash_source
    trainer = build_trainer(_cfg(store, tmp_path / "w", block_size=None, init_from=str(x)))
    source = load_dflash(x / "final")
    assert trainer.cfg.model.block_size == 4 and trainer.cfg.model.num_depths == 3  # the source's, not 8
    ours = trainer.unwrapped.state_dict()
    assert sorted(ours) == sorted(source.state_dict())
    for name, tensor in source.state_dict().items():
        assert torch.equal(ours[name], tensor), name


def test_a_dflash_warm_start_continues_at_the_sources_validation_loss_and_is_recorded(tmp_path, dflash_source):
    """A run from X with lr 1e-30 (its one update moves no float32 weight): its validation scores X's final
    weights on the same held-out blocks, so its validation loss is X's final one, bit for bit."""
    store, x = dflash_source
    summary = run_train(_cfg(store, tmp_path / "w", block_size=None, init_from=str(x), max_steps=1, lr=1e-30,
                             val_fraction=0.3, draft_vocab_size=100))
    ours, theirs = _rows(tmp_path / "w", "val")[-1], _rows(x, "val")[-1]
    assert (ours["val_loss"], ours["val_acc"], ours["blocks"]) == (theirs["val_loss"], theirs["val_acc"],
                                                                  theirs["blocks"])
    record = json.loads((tmp_path / "w" / "final" / "config.json").read_text())["peagle_training"]["init_from"]
    assert record["format"] == "dflash" and record["path"] == str((x / "final").resolve())
    assert record["from_verifier"] == [] and summary["init_from"] == record
    assert json.loads((tmp_path / "w" / "train_config.json").read_text())["model"]["block_size"] == 4


def test_a_speculators_dflash_checkpoint_is_read_with_the_verifiers_embedding(tmp_path, dflash_source):
    store, x = dflash_source
    spec = _as_speculators(x / "final", tmp_path / "spec")
    init = read_init_source(spec, "dflash")
    assert (init.format, init.block_size, init.num_depths, init.from_verifier) == ("dflash", 4, 3,
                                                                                  ("embed_tokens.weight",))
    assert init.config.draft_vocab_size == 100 and init.d2t is not None and init.mask_token_id == 3
    trainer = build_trainer(_cfg(store, tmp_path / "w", block_size=None, init_from=str(spec)))
    source = load_dflash(x / "final")
    ours = trainer.unwrapped.state_dict()
    for name, tensor in source.state_dict().items():
        if name != "embed_tokens.weight":  # the verifier's, as speculators and vLLM take it
            assert torch.equal(ours[name], tensor), name


def test_a_drafter_of_the_other_kind_is_refused_naming_both(tmp_path, dflash_source, verifier_dir):
    store, x = dflash_source
    with pytest.raises(InputError, match=r"a dflash drafter .*--method peagle.*pass --method dflash") as e:
        build_trainer(TrainConfig.from_flat(store=store, output=str(tmp_path / "p"), init_from=str(x), max_steps=1))
    assert e.value.field == "--init-from"
    peagle = tmp_path / "peagle"
    run_train(TrainConfig.from_flat(store=store, output=str(peagle), max_steps=1, num_depths=3, val_fraction=0.0))
    with pytest.raises(InputError, match=r"a peagle drafter .*--method dflash.*pass --method peagle"):
        build_trainer(_cfg(store, tmp_path / "d", block_size=None, init_from=str(peagle)))


def _edited(src, dst, config=None, drop=(), add=None):
    """A copy of checkpoint ``src`` with ``config`` merged into its config.json, tensors ``drop`` left out and
    ``add`` written besides."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k not in drop}
    save_file({**tensors, **(add or {})}, str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("edit, kw, option, match", [
    (None, dict(block_size=8), "--block-size", r"block_size is 4 but --block-size is 8.*--block-size 4"),
    (None, dict(block_size=None, num_layers=2), "--num-layers", r"num_hidden_layers is 1 but --num-layers is 2"),
    (None, dict(block_size=None, mask_token_id=5), "--mask-token-id", r"mask token is 3 but --mask-token-id is 5"),
    (None, dict(block_size=None, draft_vocab_size=90), "--draft-vocab-size", r"draft_vocab_size is 100 but"),
    (dict(config={"aux_hidden_state_layer_ids": [0, 2]}), dict(block_size=None), "--init-from",
     r"drafter's aux_hidden_state_layer_ids \(2 layers\) is \[0, 2\] but the store's layers \(2\) is \[1, 2\]; "
     r"extract a store with --layers 0,2"),
    (dict(drop=("norm.weight",)), dict(block_size=None), "--init-from", r"missing \['norm.weight'\]"),
    (dict(add={"extra.weight": torch.zeros(2)}), dict(block_size=None), "--init-from", r"unknown \['extra.weight'\]"),
    (dict(config={"sample_from_anchor": True}), dict(block_size=None), "--init-from", r"sample_from_anchor"),
])
def test_a_dflash_source_that_does_not_fit_the_run_is_refused_naming_the_option(tmp_path, dflash_source, edit, kw,
                                                                                option, match):
    store, x = dflash_source
    src = x / "final" if edit is None else _edited(x / "final", tmp_path / "src", **edit)
    with pytest.raises(InputError, match=match) as e:
        build_trainer(_cfg(store, tmp_path / "w", init_from=str(src), **kw))
    assert e.value.field == option


def test_the_resume_of_a_dflash_warm_start_takes_its_block_size_and_continues_exactly(tmp_path, dflash_source):
    """Resumed without --block-size (the warm start's own options), the run takes the block size from its own
    checkpoint and trains the uninterrupted run's losses."""
    store, x = dflash_source
    out = tmp_path / "w"
    opts = dict(block_size=None, init_from=str((x / "final").resolve()), max_steps=4, save_every=2)
    run_train(_cfg(store, out, **opts))
    uninterrupted = [r["loss"] for r in _rows(out)]
    for name in ("final", "checkpoint-4"):
        shutil.rmtree(out / name)
    summary = run_train(_cfg(store, out, resume=True, **opts))
    assert summary["resumed_from"].endswith("checkpoint-2")
    assert [r["loss"] for r in _rows(out)] == pytest.approx(uninterrupted, rel=1e-6)
    assert json.loads((out / "final" / "config.json").read_text())["block_size"] == 4
