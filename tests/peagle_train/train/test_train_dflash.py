"""``peagle-train --method dflash`` on the tiny synthetic store of test_train.py (vocab 256, hidden 64): the same
loop, loader, checkpoints and resume as P-EAGLE, with the DFlash kind's samples, loss and checkpoint format."""

import json
import shutil

import numpy as np
import pytest

from peagle_train.model.checkpoint import load_drafter
from peagle_train.model.dflash import DFlashDrafter
from peagle_train.model.dflash_checkpoint import load_dflash
from peagle_train.train.config import TrainConfig
from peagle_train.train.run import run_train
from stores.errors import StoreFormatError
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
    (dict(method="dflash", init_from="x"), "--init-from"),
    (dict(method="eagle"), "--method"),
])
def test_bad_dflash_settings_name_the_option(kw, option):
    with pytest.raises(ValueError, match=option):
        TrainConfig.from_flat(store="s", output="o", **kw)


def test_defaults_per_method():
    peagle = TrainConfig.from_flat(store="s", output="o")
    assert (peagle.model.method, peagle.model.num_depths, peagle.model.block_size) == ("peagle", 4, None)
    assert peagle.depth_weights is None
    dflash = TrainConfig.from_flat(store="s", output="o", method="dflash")
    assert (dflash.model.block_size, dflash.model.num_depths) == (8, 7)
    assert dflash.depth_weights == pytest.approx([np.exp(-d / 4) for d in range(7)])  # speculators' decay, γ = 4
