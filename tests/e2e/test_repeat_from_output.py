"""A run repeated from its own output (issue 14 item 6): pack, extract and train record their resolved
options in the output (the manifest's ``config``, the store's ``config`` attribute as ``inspect``
prints it, ``train_config.json``); ``--config`` of that record plus a new ``--output`` makes the same
table, the same store and the same training losses."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import torch
import yaml
from click.testing import CliRunner

from cli.data import main as data_main
from cli.train import main as train_main
from stores.feature_store import FeatureStore
from tests.e2e.test_pipeline import CONVERSATIONS


def _run(cmd, args) -> str:
    result = CliRunner().invoke(cmd, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


def _printed(cmd, args) -> dict:
    return yaml.safe_load(_run(cmd, [*args, "--print-config"]))


def test_pack_extract_and_train_repeat_from_their_outputs(tmp_path, tiny_verifier_dir):
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    model = str(tiny_verifier_dir)

    pack_args = ["pack", data, "--tokenizer", model, "--output", tmp_path / "p1", "--max-seq-len", 128]
    _run(data_main, pack_args)
    manifest = json.loads((tmp_path / "p1" / "manifest.json").read_text())
    assert manifest["config"] == _printed(data_main, pack_args)
    _run(data_main, ["pack", "--config", tmp_path / "p1" / "manifest.json", "--output", tmp_path / "p2"])
    assert json.loads((tmp_path / "p2" / "manifest.json").read_text())["parameters"] == manifest["parameters"]
    for part in sorted(p.name for p in (tmp_path / "p1").glob("*.parquet")):
        assert pq.read_table(tmp_path / "p1" / part).equals(pq.read_table(tmp_path / "p2" / part))

    extract_args = ["extract", tmp_path / "p1", "--verifier", model, "--output", tmp_path / "s1.zarr",
                    "--layers", "1,3"]
    _run(data_main, extract_args)
    (tmp_path / "s1.json").write_text(_run(data_main, ["inspect", tmp_path / "s1.zarr"]))
    assert json.loads((tmp_path / "s1.json").read_text())["config"] == _printed(data_main, extract_args)
    _run(data_main, ["extract", "--config", tmp_path / "s1.json", "--output", tmp_path / "s2.zarr"])
    s1, s2 = FeatureStore.open(tmp_path / "s1.zarr"), FeatureStore.open(tmp_path / "s2.zarr")
    assert s2.layers == [1, 3] and s1.n_blocks == s2.n_blocks
    for i in range(s1.n_blocks):
        a, b = s1.read_block(i), s2.read_block(i)
        assert torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.input_ids, b.input_ids)

    train_args = ["--store", tmp_path / "s1.zarr", "--output", tmp_path / "d1", "--max-steps", 3, "--num-depths", 2,
                  "--draft-vocab-size", 32]
    first = json.loads(_run(train_main, train_args))
    again = json.loads(_run(train_main, ["--config", tmp_path / "d1" / "train_config.json", "--output",
                                         tmp_path / "d2"]))
    assert again["last_step_loss"] == first["last_step_loss"] > 0
    resolved = _printed(train_main, train_args)
    assert _printed(train_main, ["--config", tmp_path / "d1" / "train_config.json"]) == resolved
