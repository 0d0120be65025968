"""Issue 33, kind 1: a damaged chunk or a NaN loss stops training and evaluation, naming the block and
the step; no NaN reaches a JSON file or a checkpoint; a refused run leaves no half-made output."""

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from peagle_train.train.run import run_train
from stores.errors import ChunkDamageError, NonFiniteError
from stores.features.feature_store import FeatureStore
from tests.peagle_train.train.test_train import _cfg, _store, verifier_dir  # noqa: F401 (fixture)


def _flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _aux_chunk(store, b):
    return FeatureStore.open(store).chunk_path("aux_hidden", b)


def test_a_chunk_altered_in_place_stops_training_naming_the_block_and_leaves_no_output(tmp_path, verifier_dir):
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=4)
    _flip(_aux_chunk(store, 2), at=300)  # same size: only the crc32c tells
    out = tmp_path / "out"
    with pytest.raises(ChunkDamageError, match=r"s\.zarr: block 2 cannot be trusted: .*aux_hidden/c/2/0/0/0: its "
                                               r"crc32c checksum does not match its data\. `peagle-data extract "):
        run_train(_cfg(store, out, max_steps=8))
    assert not out.exists()  # train_config.json and metrics.jsonl were this run's: removed


def test_cli_refuses_a_damaged_store_with_exit_2_and_no_output(tmp_path, verifier_dir):
    from cli.train import main

    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=3)
    _flip(_aux_chunk(store, 1), at=17)
    res = CliRunner().invoke(main, ["--store", store, "--output", str(tmp_path / "out"), "--max-steps", "6",
                                    "--num-depths", "2"])
    assert res.exit_code == 2 and "block 1 cannot be trusted" in res.output
    assert "NaN" not in res.output and not (tmp_path / "out").exists()


def _nan_block(store, b):
    """Rewrite block ``b``'s aux hidden states with a NaN at one token (a valid chunk: its crc32c matches)."""
    s = FeatureStore.open(store, mode="r+")
    blk = s.read_block(b)
    aux = blk.aux_hidden.clone()
    aux[5, 0, 0] = float("nan")
    s.write_features(b, aux, blk.final_hidden)


def test_a_nan_loss_stops_the_run_naming_step_and_block_before_any_json_or_checkpoint(tmp_path, verifier_dir):
    """Seed 0 reads blocks 0, 2, 1, 3: block 3's NaN is step 4's; steps 1-3 and their checkpoints stay."""
    from peagle_train.data.loader import epoch_order

    assert epoch_order(np.arange(4), 0, 0).tolist() == [0, 2, 1, 3]
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=4)
    _nan_block(store, 3)
    out = tmp_path / "out"
    with pytest.raises(NonFiniteError, match=r"step 4: the loss is nan and the gradient norm nan on blocks \[3\]"):
        run_train(_cfg(store, out, max_steps=4, save_every=1, seed=0))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # strict JSON
    assert [r["step"] for r in rows if r["split"] == "train"] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in rows)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert not (out / "final").exists()


def test_a_nan_loss_at_the_first_step_leaves_no_output(tmp_path, verifier_dir):
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=4)
    _nan_block(store, 0)  # seed 0: step 1
    with pytest.raises(NonFiniteError, match=r"step 1: .* on blocks \[0\]"):
        run_train(_cfg(store, tmp_path / "out", max_steps=4, save_every=1, seed=0))
    assert not (tmp_path / "out").exists()


def test_a_nan_validation_loss_stops_the_run_naming_the_held_out_block(tmp_path, verifier_dir):
    from peagle_train.data.loader import split_blocks

    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=6)
    _, val = split_blocks(np.arange(6), 0, 0.2)
    _nan_block(store, int(val[0]))
    with pytest.raises(NonFiniteError, match=rf"validation at step 3: the loss of held-out blocks \[{int(val[0])}\]"):
        run_train(_cfg(store, tmp_path / "out", max_steps=3, val_fraction=0.2, seed=0))


def test_strict_json_writers_refuse_nan(tmp_path):
    from cli.common import echo_json
    from peagle_train.evaluate.report import write_json
    from peagle_train.train.metrics import write_metrics

    with pytest.raises(NonFiniteError, match=r"row of step 7: loss, acc\[1\] are NaN or infinite"):
        write_metrics(tmp_path / "m.jsonl", [{"step": 6, "loss": 1.0}, {"step": 7, "loss": float("nan"),
                                                                      "acc": [0.5, float("inf")]}])
    assert not (tmp_path / "m.jsonl").exists() or (tmp_path / "m.jsonl").read_text() == ""
    with pytest.raises(NonFiniteError, match="offline.simulated_acceptance_length is NaN"):
        write_json({"offline": {"simulated_acceptance_length": float("nan")}}, tmp_path / "r.json")
    assert not (tmp_path / "r.json").exists()
    with pytest.raises(NonFiniteError, match="val_loss is NaN"):
        echo_json({"val_loss": float("nan")})


def test_a_drafter_with_nan_weights_is_not_saved(tmp_path):
    from peagle_train.model.checkpoint import save_drafter
    from tests.peagle_train.model.test_checkpoint import _model

    model = _model()
    with torch.no_grad():
        model.fc.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match=r"weights \['fc.weight'\] hold NaN or Inf"):
        save_drafter(model, tmp_path / "d")
    assert not (tmp_path / "d").exists()


def test_an_unfinished_store_names_the_resume_command_that_finishes_it(tmp_path, verifier_dir):
    """Issue 33, kind 9: "run `peagle-data extract` first" on an existing store would be refused (the output
    exists); the message names the resume."""
    from stores.errors import StoreFormatError

    partial = _store(tmp_path / "p.zarr", verifier_dir, n_blocks=3, done={0, 2})
    with pytest.raises(StoreFormatError, match=r"1 of 3 blocks are not done \(first: \[1\]\); `peagle-data extract "
                                               r"PACKED --context window --resume --output .*p\.zarr` \(with the packed"):
        run_train(_cfg(partial, tmp_path / "o1"))
    empty = _store(tmp_path / "e.zarr", verifier_dir, n_blocks=2, done=set())
    with pytest.raises(StoreFormatError, match=r"no block is done; `peagle-data extract PACKED --context window "
                                               r"--resume --output .*e\.zarr`"):
        run_train(_cfg(empty, tmp_path / "o2", allow_incomplete=True))
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_a_refused_run_into_an_existing_empty_directory_leaves_it_empty(tmp_path, verifier_dir):
    """The directory the user made stays (a mount point, say); what the run wrote in it goes."""
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    _flip(_aux_chunk(store, 0), at=5)
    _flip(_aux_chunk(store, 1), at=5)
    out = tmp_path / "mine"
    out.mkdir()
    with pytest.raises(ChunkDamageError):
        run_train(_cfg(store, out, max_steps=2))
    assert out.is_dir() and list(out.iterdir()) == []
