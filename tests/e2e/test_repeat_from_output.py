"""A run repeated from its own output (issue 14 item 6): pack, extract and train record their resolved
options in the output (the manifest's ``config``, the store's ``config`` attribute as ``inspect``
prints it, ``train_config.json``); ``--config`` of that record plus a new ``--output`` makes the same
table, the same store and the same training losses."""

from __future__ import annotations

import json
import shutil

import pyarrow.parquet as pq
import torch
import yaml
from click.testing import CliRunner

from cli.data import main as data_main
from cli.eval import main as eval_main
from cli.train import main as train_main
from peagle_train.train.config import flat_settings
from stores.features.feature_store import FeatureStore
from tests.e2e.test_pipeline import CONVERSATIONS

RUN_CONFIG = '{"data": {"store": "s.zarr"}, "model": {"num_depths": 2}, "run": {"output": "out"}}'
"""A training run's train_config.json (peagle-train's settings, trimmed): it marks the folder as a run."""


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
    assert resolved["model"]["drafter_layer"] is None  # chosen by the run (the tiny Llama verifier's: llama)
    resolved["model"]["drafter_layer"] = "llama"
    assert resolved["data"]["epoch_order"] is None  # chosen by the run (a full-context store: conversations)
    resolved["data"]["epoch_order"] = "conversations"
    assert _printed(train_main, ["--config", tmp_path / "d1" / "train_config.json"]) == resolved


ACTIONS = {"force", "resume", "repair", "max_blocks"}
"""Options of one invocation (what it does with an existing output; extract's budget of blocks): never
in a recorded config (eval's ``max_blocks``, how many blocks it scores, is a setting)."""


def _invoke(cmd, args):
    return CliRunner().invoke(cmd, [str(a) for a in args], catch_exceptions=False)


def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_tokenize_pack_and_extract_started_with_force_are_repeated_and_resumed_from_their_records(
        tmp_path, tiny_verifier_dir):
    """Issue 22 item 8: a record holds no action. ``--config OUT/manifest.json`` over its own output
    refuses instead of overwriting it (``force`` was replayed before), overwrites with ``--force``;
    an extraction started with ``--force`` and stopped resumes with ``extract --config STORE.json --resume``."""
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    model = str(tiny_verifier_dir)
    for kind in ("tokenize", "pack"):
        out = tmp_path / kind
        out.mkdir()
        (out / "manifest.json").write_text('{"kind": "tokenized"}')  # an earlier output of peagle's to overwrite
        (out / "part-00001.parquet").write_bytes(b"stale")
        _run(data_main, [kind, data, "--tokenizer", model, "--output", out, "--max-tokens", 1000, "--force"]
             + (["--max-seq-len", 128] if kind == "pack" else []))
        assert not (out / "part-00001.parquet").exists()
        manifest = (out / "manifest.json").read_text()
        assert not ACTIONS & set(json.loads(manifest)["config"])
        again = _invoke(data_main, [kind, "--config", out / "manifest.json"])
        assert again.exit_code == 2 and f"{out} already exists" in again.stderr and "--force" in again.stderr
        assert (out / "manifest.json").read_text() == manifest  # not overwritten
        _run(data_main, [kind, "--config", out / "manifest.json", "--force"])
        assert json.loads((out / "manifest.json").read_text())["counts"] == json.loads(manifest)["counts"]

    whole = tmp_path / "whole.zarr"
    _run(data_main, ["extract", tmp_path / "pack", "--verifier", model, "--output", whole, "--layers", "1,3"])
    part = tmp_path / "part.zarr"
    part.mkdir()
    _run(data_main, ["extract", tmp_path / "pack", "--verifier", model, "--output", part, "--layers", "1,3",
                     "--max-blocks", 1, "--force"])  # stopped after one (context) block
    p, w = FeatureStore.open(part), FeatureStore.open(whole)
    assert p.layout == w.layout == "windows"  # the default, --context full: the verifier runs context blocks
    assert w.contexts.n_blocks > 1 and p.contexts.missing_blocks() == list(range(1, w.contexts.n_blocks))
    assert 0 < len(p.missing_blocks()) < p.n_blocks  # the training blocks that read only context block 0 are done
    (tmp_path / "part.json").write_text(_run(data_main, ["inspect", part]))
    assert not ACTIONS & set(json.loads((tmp_path / "part.json").read_text())["config"])
    _run(data_main, ["extract", "--config", tmp_path / "part.json", "--resume"])  # --max-blocks 1 was not recorded
    a, b = FeatureStore.open(whole), FeatureStore.open(part)
    assert b.n_blocks == a.n_blocks > 1 and b.missing_blocks() == [] and b.is_complete()
    for i in range(a.n_blocks):
        x, y = a.read_block(i), b.read_block(i)
        assert torch.equal(x.aux_hidden, y.aux_hidden) and torch.equal(x.input_ids, y.input_ids)


def test_a_run_started_with_force_resumes_from_its_train_config_and_eval_repeats(tmp_path, tiny_verifier_dir):
    """Issue 22 item 8: ``peagle-train --config OUTPUT/train_config.json --resume`` continues a run
    started with ``--force`` (it exited 2, "--resume/--force must be used one at a time", when the record
    held ``force: true``), with the losses of the uninterrupted run; a record written before this rule
    (``force: true`` in it) resumes too, with a warning; an eval report's config holds no ``force``."""
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    model, store, out = str(tiny_verifier_dir), tmp_path / "s.zarr", tmp_path / "drafter"
    _run(data_main, ["pack", data, "--tokenizer", model, "--output", tmp_path / "p", "--max-seq-len", 128])
    _run(data_main, ["extract", tmp_path / "p", "--verifier", model, "--output", store, "--layers", "1,3"])
    (out / "checkpoint-9").mkdir(parents=True)  # an earlier training run's output (--force replaces only peagle's)
    (out / "train_config.json").write_text(RUN_CONFIG)
    first = json.loads(_run(train_main, ["--store", store, "--output", out, "--max-steps", 4, "--save-every", 2,
                                         "--num-depths", 2, "--draft-vocab-size", 32, "--val-fraction", 0, "--force"]))
    assert first["steps"] == 4 and not (out / "checkpoint-9").exists()
    saved = out / "train_config.json"
    record = json.loads(saved.read_text())
    assert not ACTIONS & set(record["run"]) and record["optim"]["max_steps"] == 4
    assert record["run"]["output"] == str(out)
    uninterrupted = [r["loss"] for r in _metrics(out) if r.get("split") == "train"]

    for old_record in (False, True):
        if old_record:  # as train_config.json was written before actions were left out (and flat)
            saved.write_text(json.dumps({**flat_settings(record), "resume": False, "force": True}))
        shutil.rmtree(out / "checkpoint-4")
        shutil.rmtree(out / "final")  # as if stopped after checkpoint-2
        result = _invoke(train_main, ["--config", saved, "--resume"])
        assert result.exit_code == 0, result.output
        summary = json.loads(result.stdout)
        assert summary["steps"] == 4 and summary["resumed_from"] == str(out / "checkpoint-2")
        assert [r["loss"] for r in _metrics(out) if r.get("split") == "train"] == uninterrupted
        assert ("ignoring force: True" in result.stderr) is old_record
        assert json.loads(saved.read_text()) == record  # rewritten without the actions

    report = tmp_path / "eval.json"
    report.write_text('{"template_mode": {}}')  # an earlier report of peagle-eval's
    _run(eval_main, ["--drafter", out, "--store", store, "--output", report, "--max-blocks", 2, "--force"])
    assert not (ACTIONS - {"max_blocks"}) & set(json.loads(report.read_text())["config"])
    assert json.loads(report.read_text())["config"]["max_blocks"] == 2
    again = _invoke(eval_main, ["--config", report])
    assert again.exit_code == 2 and str(report) in again.stderr  # not overwritten without --force
    _run(eval_main, ["--config", report, "--force"])


def test_regenerate_started_with_force_resumes_from_its_manifest(tmp_path, tiny_verifier_dir):
    """Issue 22 item 8: ``peagle-data regenerate --config OUT.manifest.json --resume`` continues a run
    started with ``--force`` (the record held ``force: true``: "--resume and --force" refused it)."""
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    out = tmp_path / "r.jsonl"
    out.write_text("stale\n")  # an earlier output of regenerate's (its manifest says so)
    (tmp_path / "r.manifest.json").write_text('{"kind": "regenerated"}')
    _run(data_main, ["regenerate", data, "--verifier", tiny_verifier_dir, "--output", out, "--max-new-tokens", 3,
                     "--limit", 2, "--turns", "last", "--force"])
    manifest = tmp_path / "r.manifest.json"
    assert not ACTIONS & set(json.loads(manifest.read_text())["config"])
    rows = out.read_text()
    assert len(rows.splitlines()) == 2 and "stale" not in rows
    resumed = _run(data_main, ["regenerate", "--config", manifest, "--resume"])
    assert "resumed after 2 rows" in resumed and out.read_text() == rows
