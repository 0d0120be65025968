"""Ctrl-C (issue 34 item 7): every command names what its output kept and the exact command to run next,
exit 130, instead of click's bare ``Aborted!``."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from click.testing import CliRunner

import cli.data_extract
import cli.data_prepare
import cli.data_regenerate
import cli.train
from cli.common import INTERRUPTED_EXIT, interrupted_message, resume_command
from cli.data import main as data_main
from cli.train import main as train_main
from peagle_data.extract.run import run_extract
from tests.peagle_data.extract.test_run import write_packed


def _invoke(monkeypatch, command, prog: str, args: list[str]):
    monkeypatch.setattr(sys, "argv", [prog, *args])  # what the handler quotes back
    return CliRunner().invoke(command, args, prog_name=prog)


def test_resume_command_drops_force_and_quotes():
    assert resume_command("peagle-data extract", ["my dir", "--force", "-o", "s"]) == \
        "peagle-data extract 'my dir' -o s --resume"


def test_extract_names_the_blocks_kept_and_the_resume_command(tmp_path, tiny_verifier_dir, monkeypatch):
    packed = write_packed(tmp_path / "packed", n_blocks=3, block_size=48)
    store = tmp_path / "f.zarr"

    def interrupted(cfg, **kwargs):  # one block extracted, then Ctrl-C
        run_extract(dataclasses.replace(cfg, max_blocks=1), progress=False, log=lambda m: None)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.data_extract, "run_extract", interrupted)
    args = ["extract", str(packed), "--verifier", str(tiny_verifier_dir), "--output", str(store), "--layers", "1",
            "--context", "window", "--force"]
    result = _invoke(monkeypatch, data_main, "peagle-data", args)
    assert result.exit_code == INTERRUPTED_EXIT, result.output
    assert "Aborted!" not in result.output
    assert f"kept: {store}: 1 of 3 blocks extracted" in result.output
    assert (f"resume with: peagle-data extract {packed} --verifier {tiny_verifier_dir} --output {store} --layers 1 "
            "--context window --resume") in result.output


def test_train_names_the_newest_checkpoint_and_the_short_resume_form(tmp_path, monkeypatch):
    out = tmp_path / "drafter"

    def interrupted(cfg):
        for step in (20, 40):
            (out / f"checkpoint-{step}").mkdir(parents=True)
            (out / f"checkpoint-{step}" / "training_state.pt").write_bytes(b"")
        (out / "train_config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.train, "run_train", interrupted)
    result = _invoke(monkeypatch, train_main, "peagle-train",
                     ["--store", str(tmp_path / "s.zarr"), "--output", str(out), "--max-steps", "60"])
    assert result.exit_code == INTERRUPTED_EXIT, result.output
    assert f"kept: {out / 'checkpoint-40'} (step 40" in result.output
    assert f"resume with: peagle-train --config {out / 'train_config.json'} --resume" in result.output


def test_train_without_a_checkpoint_says_so_and_repeats_with_force(tmp_path, monkeypatch):
    out = tmp_path / "drafter"

    def interrupted(cfg):
        out.mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.train, "run_train", interrupted)
    result = _invoke(monkeypatch, train_main, "peagle-train", ["--store", str(tmp_path / "s.zarr"), "--output", str(out)])
    assert result.exit_code == INTERRUPTED_EXIT
    assert f"kept: no checkpoint in {out} yet" in result.output
    assert f"run it again with: peagle-train --store {tmp_path / 's.zarr'} --output {out} --force" in result.output


def test_regenerate_names_the_rows_written(tmp_path, monkeypatch):
    out = tmp_path / "regen.jsonl"
    (tmp_path / "regen.manifest.json").write_text('{"checkpoint": {"rows": 7, "rejects": 0}, "complete": false}')
    message = interrupted_message("peagle-data regenerate", ["in.jsonl", "--output", str(out)], {"output": str(out)},
                                  cli.data_regenerate.kept_rows)
    assert f"kept: 7 regenerated rows in {out}.partial" in message
    assert f"resume with: peagle-data regenerate in.jsonl --output {out} --resume" in message


def test_tokenize_keeps_nothing_and_repeats_the_command(tmp_path, monkeypatch):
    def interrupted(run, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.data_prepare, "run_tokenize", interrupted)
    inputs = tmp_path / "in.jsonl"
    inputs.write_text("{}\n")
    args = ["tokenize", str(inputs), "--tokenizer", "smollm2-135m", "--output", str(tmp_path / "tok")]
    result = _invoke(monkeypatch, data_main, "peagle-data", args)
    assert result.exit_code == INTERRUPTED_EXIT, result.output
    assert "kept: nothing" in result.output
    assert f"run it again with: peagle-data {' '.join(args)}" in result.output


def test_a_failing_output_read_says_unknown_rather_than_guessing(tmp_path):
    store = tmp_path / "broken.zarr"
    store.mkdir()
    message = interrupted_message("peagle-data extract", ["p", "--output", str(store)], {"output": str(store)},
                                  cli.data_extract.kept_blocks)
    assert "kept: unknown: could not read the output" in message and "run it again with" in message
    assert Path(store).exists()
