"""Every output path of every command is checked when the options are parsed (missing parent
directory, wrong extension) and never overwritten without --force; the messages are exact."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cli.data_extract import extract
from cli.data_merge import merge
from cli.data_prepare import pack, tokenize
from cli.data_regenerate import regenerate
from cli.data_show import show
from cli.data_stats import stats
from cli.eval import main as eval_main
from cli.train import main as train_main


def invoke(cmd, args):
    return CliRunner().invoke(cmd, [str(a) for a in args])


@pytest.fixture()
def packed(tmp_path, monkeypatch, smollm2_tokenizer):
    """A pack output of two tiny conversations (the session's SmolLM2 tokenizer, no reload)."""
    import runtime.model_cache

    monkeypatch.setattr(runtime.model_cache, "load_tokenizer", lambda name: smollm2_tokenizer)
    convs = tmp_path / "convs.jsonl"
    convs.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": f"Hello {i}!"}]}) + "\n" for i in range(2)))
    out = tmp_path / "packed"
    result = invoke(pack, [convs, "--tokenizer", "smollm2-135m", "--output", out, "--max-seq-len", 64])
    assert result.exit_code == 0, result.output
    return out


def _cases(d):
    """(command, arguments before the output option, output option) for every output path."""
    return [
        (stats, [d], "--png"), (show, [d], "--html"),
        (tokenize, [d, "--tokenizer", "m"], "--output"), (pack, [d, "--tokenizer", "m"], "--output"),
        (extract, [d, "--verifier", "m"], "--output"), (merge, [d, d], "--output"),
        (regenerate, [d, "--verifier", "m"], "--output"), (train_main, ["--store", d], "--output"),
        (eval_main, ["--drafter", d, "--store", d], "--output"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_a_missing_parent_directory_is_refused_before_any_work(tmp_path, monkeypatch, case):
    cmd, args, opt = _cases(tmp_path)[case]
    name = {"--png": "x.png", "--html": "x.html", "--output": "x"}[opt]
    if cmd is regenerate:
        name = "x.jsonl"
    elif cmd is eval_main:
        name = "x.json"
    monkeypatch.chdir(tmp_path)
    result = invoke(cmd, [*args, opt, f"nodir/{name}"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert (f"Invalid value for '{opt}': nodir/{name}: the parent directory {tmp_path / 'nodir'} does not exist "
            "(create it first)") in result.output, result.output


@pytest.mark.parametrize("cmd, args, opt, name, supported", [
    (stats, [], "--png", "out.txt", ".png, .svg, .pdf"),
    (show, [], "--html", "page.txt", ".html, .htm"),
    (regenerate, ["--verifier", "m"], "--output", "out.json", ".jsonl"),
    (eval_main, ["--store", "."], "--output", "report.png", ".json"),
])
def test_an_unsupported_extension_is_refused_naming_the_supported_ones(tmp_path, monkeypatch, cmd, args, opt, name, supported):
    monkeypatch.chdir(tmp_path)
    first = ["--drafter", "."] if cmd is eval_main else ["."]
    result = invoke(cmd, [*first, *args, opt, name])
    ext = name[name.rindex("."):]
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"Invalid value for '{opt}': {name} has extension '{ext}'; the supported ones are {supported}" \
        in result.output, result.output


def test_stats_png_is_not_overwritten_without_force(tmp_path, packed):
    png = tmp_path / "plot.png"
    png.write_bytes(b"mine")
    refused = invoke(stats, [packed, "--png", png])
    assert refused.exit_code == 2
    assert refused.output == f"Error: output --png {png} already exists; pass --force to overwrite it\n"
    assert png.read_bytes() == b"mine"
    forced = invoke(stats, [packed, "--png", png, "--force"])  # issue 44 item 1: not a plot of stats: kept
    assert forced.exit_code == 2 and forced.output == (
        f"Error: output {png} already exists and was not written by peagle; --force replaces only peagle's own "
        "output (a plot of peagle-data stats), never other files: move them away, or give another --png\n")
    assert png.read_bytes() == b"mine"
    png.unlink()
    for name in ("plot.png", "plot.svg", "plot.pdf"):  # a plot of its own (its metadata says so) is replaced
        first = invoke(stats, [packed, "--png", tmp_path / name, "--force"])
        assert first.exit_code == 0, first.output
        forced = invoke(stats, [packed, "--png", tmp_path / name, "--force"])
        assert forced.exit_code == 0 and f"plot: {tmp_path / name}" in forced.output, forced.output
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_show_html_overwrite_message_says_it_once(tmp_path, packed):
    page = tmp_path / "multi.html"
    page.write_text("mine")
    refused = invoke(show, [packed, "--html", page, "--color", "never"])
    assert refused.exit_code == 2
    assert refused.output == f"Error: output --html {page} already exists; pass --force to overwrite it\n"
    assert page.read_text() == "mine"
    forced = invoke(show, [packed, "--html", page, "--color", "never", "--force"])  # not a page of show's: kept
    assert forced.exit_code == 2 and "was not written by peagle" in forced.output and page.read_text() == "mine"
    page.unlink()
    for _ in range(2):  # a page of its own is replaced
        result = invoke(show, [packed, "--html", page, "--color", "never", "--force"])
        assert result.exit_code == 0 and page.read_text().startswith("<!doctype html>"), result.output


def test_the_library_checks_the_plot_and_page_paths_too(tmp_path, packed):
    """From Python (no click): a missing directory or extension is an InputError naming it, not a
    traceback from matplotlib or from the atomic writer's NAME.tmp."""
    from peagle_data.inspect.show import show as show_text
    from peagle_data.inspect.stats_plot import check_plot_output
    from stores.errors import InputError

    with pytest.raises(InputError) as e:
        check_plot_output(tmp_path / "out.txt")
    assert str(e.value) == f"--png {tmp_path / 'out.txt'}: a plot is .png, .svg, .pdf, not '.txt'"
    with pytest.raises(InputError) as e:
        check_plot_output(tmp_path / "nodir" / "x.png")
    assert str(e.value) == f"--png {tmp_path / 'nodir' / 'x.png'}: the directory {tmp_path / 'nodir'} does not exist"
    with pytest.raises(InputError) as e:
        show_text(str(packed), None, None, None, None, False, str(tmp_path / "nodir" / "x.html"))
    assert str(e.value) == (f"--html {tmp_path / 'nodir' / 'x.html'}: the directory {tmp_path / 'nodir'} "
                            "does not exist")


def test_a_config_file_output_path_is_checked_like_the_option(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.yaml").write_text("png: nodir/x.png\n")
    result = invoke(stats, [tmp_path, "--config", tmp_path / "c.yaml"])
    assert result.exit_code == 2
    assert f"nodir/x.png: the parent directory {tmp_path / 'nodir'} does not exist" in result.output, result.output


@pytest.mark.parametrize("cmd", ["tokenize", "pack", "merge", "extract", "regenerate"])
def test_force_never_deletes_a_users_file(tmp_path, packed, cmd):
    """Issue 44 item 1: ``pack --force``/``tokenize --force`` into a directory holding only a user's notes.txt
    deleted it (exit 0). Every command refuses instead, naming the file, before any work; nothing is removed."""
    convs = tmp_path / "convs.jsonl"
    out = tmp_path / ("out.jsonl" if cmd == "regenerate" else "out")
    if cmd == "regenerate":  # the output file itself is a user's (no manifest of regenerate beside it)
        out.write_text('{"mine": true}\n')
        mine = out
    else:
        out.mkdir()
        mine = out / "notes.txt"
        mine.write_text("mine")
    args = {"tokenize": lambda: (tokenize, [convs, "--tokenizer", "smollm2-135m"]),
            "pack": lambda: (pack, [convs, "--tokenizer", "smollm2-135m", "--max-seq-len", 64]),
            "merge": lambda: (merge, [_shard(tmp_path, 0), _shard(tmp_path, 1)]),
            "extract": lambda: (extract, [packed, "--verifier", tmp_path / "no-verifier", "--context", "window"]),
            "regenerate": lambda: (regenerate, [convs, "--verifier", tmp_path / "no-verifier"])}[cmd]()
    result = invoke(args[0], [*args[1], "--output", out, "--force"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    found = "was not written by peagle" if cmd == "regenerate" else "holds 1 file peagle did not write: notes.txt"
    assert f"Error: output {out} already exists and {found}; --force replaces only peagle's own output (" \
        in result.output, result.output
    assert mine.read_text() in ("mine", '{"mine": true}\n')
    shards = ["shard0", "shard1", "many.jsonl"] if cmd == "merge" else []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["convs.jsonl", "packed", out.name, *shards]), \
        "nothing staged is left behind"


def _shard(tmp_path, index: int):
    """Shard ``index`` of 2 of a pack of 12 tiny conversations."""
    convs, out = tmp_path / "many.jsonl", tmp_path / f"shard{index}"
    convs.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": f"Hello {i}!"}]}) + "\n" for i in range(12)))
    result = invoke(pack, [convs, "--tokenizer", "smollm2-135m", "--output", out, "--max-seq-len", 64,
                           "--num-shards", 2, "--shard-index", index])
    assert result.exit_code == 0, result.output
    return out


def test_a_full_disk_while_packing_is_one_line_and_leaves_nothing(tmp_path, packed, monkeypatch):
    """Issue 44 item 9 in the Parquet writer: pyarrow says a full disk without an errno ("... No space left on
    device"). One error line naming the disk and the command to run again, exit code 2, no staging directory."""
    import sys

    import pyarrow.parquet as pq

    def full(self, *a, **k):
        raise OSError("IOError: Failed to write: No space left on device")

    monkeypatch.setattr(pq.ParquetWriter, "write_batch", full)
    convs, out = tmp_path / "convs.jsonl", tmp_path / "again"
    args = [str(convs), "--tokenizer", "smollm2-135m", "--output", str(out), "--max-seq-len", "64"]
    monkeypatch.setattr(sys, "argv", ["peagle-data pack", *args])
    result = CliRunner().invoke(pack, args, prog_name="peagle-data pack")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and errors[0].startswith("Error: disk full: no space left on "), errors
    assert errors[0].endswith("; kept: nothing: this command writes its output only when it finishes; free space on "
                              f"{errors[0].split(' on ')[1].split(' (')[0]}, then run it again with: peagle-data pack "
                              f"{convs} --tokenizer smollm2-135m --output {out} --max-seq-len 64"), errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["convs.jsonl", "packed"]  # no staging directory left


def _listing(path) -> dict[str, bytes]:
    """Every file under ``path`` with its bytes."""
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_an_output_that_is_the_commands_input_is_refused_and_the_input_kept(tmp_path, packed):
    """``extract P --output P --force`` replaced the packed table with a store (exit 0), ``peagle-train --store S
    --output S --force`` deleted the store, then died on a KeyError. Both are refused before anything is touched."""
    import zarr

    before = _listing(packed)
    result = invoke(extract, [packed, "--verifier", tmp_path / "no-verifier", "--output", packed, "--force"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert (f"Error: field '--output': {packed} is the input PACKED {packed} itself: the output would overwrite "
            "(with --force, remove) what the command reads; give another --output") in result.output
    assert _listing(packed) == before

    store = tmp_path / "s.zarr"
    zarr.open_group(str(store), mode="w").attrs["peagle"] = {"format_version": 2}
    before = _listing(store)
    for output in (store, store / "run"):
        result = invoke(train_main, ["--store", store, "--output", output, "--force"])
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert f"the input --store {store}" in result.output and "give another --output" in result.output
    assert _listing(store) == before


def test_a_resume_beside_a_live_run_is_refused_and_proceeds_once_it_is_killed(tmp_path):
    """A ``--resume`` started while the first run lived resumed beside it and truncated its metrics.jsonl. The
    output's lock refuses it, naming the live run; after ``kill -9`` the next ``--resume`` goes on (the lock taken
    over, one line saying so)."""
    import signal

    from tests.stores.test_output_lock import start_holder

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    child = start_holder(run)
    try:
        result = invoke(train_main, ["--store", tmp_path / "s.zarr", "--output", run, "--resume"])
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert f"Error: output {run} is in use by another run: pid {child.pid} on " in result.output
        assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    result = invoke(train_main, ["--store", tmp_path / "s.zarr", "--output", run, "--resume"])
    assert f"took over the lock of {run} left by a run that ended without releasing it (killed): pid {child.pid}" \
        in result.output
    assert "in use by another run" not in result.output and not (tmp_path / ".run.lock").exists()
