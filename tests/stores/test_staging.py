"""stores.staging.staged_output_dir: owner-named staging directories, and the cleanup of those of killed runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stores.errors import OutputExistsError
from stores.staging import _host_tag, remove_stale_partials, restore_replaced_output, staged_output_dir


RUN_CONFIG = {"data": {"store": "s.zarr", "down_sample_ratio": 0.5}, "model": {"num_depths": 4},
              "optim": {"lr": 3e-4}, "run": {"output": "run", "seed": 0}, "stream": {}}
"""A training run's train_config.json, trimmed (peagle_train's TrainConfig.to_dict has every field)."""


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped (so no process has it now)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def make_staging(parent: Path, output: str, kind: str, owner: str, suffix: str = "abc_12") -> Path:
    """A staging directory ``.OUTPUT.KIND-OWNER-SUFFIX`` with a token table's files in it, as a killed run leaves it."""
    d = parent / f".{output}.{kind}-{owner}-{suffix}"
    d.mkdir()
    (d / "part-00000.parquet").write_bytes(b"half written")
    (d / "manifest.json").write_text('{"kind": "packed"}')
    return d


def test_staging_directory_is_named_after_its_owner(tmp_path):
    out = tmp_path / "out"
    with staged_output_dir(out, force=False) as tmp:
        assert tmp.parent == tmp_path
        assert tmp.name.startswith(f".out.partial-{_host_tag()}-{os.getpid()}-")
        (tmp / "x").write_text("1")
    assert (out / "x").read_text() == "1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_stale_staging_of_dead_pids_removed_live_and_foreign_kept(tmp_path, capsys):
    host, dead = _host_tag(), dead_pid()
    stale = [make_staging(tmp_path, "out", "partial", f"{host}-{dead}"),
             make_staging(tmp_path, "out", "old", f"{host}-{dead}", suffix="123456789")]
    kept = [
        make_staging(tmp_path, "out", "partial", f"{host}-{os.getpid()}"),  # live: this process
        make_staging(tmp_path, "out", "partial", f"{host}-1"),  # live: pid 1
        make_staging(tmp_path, "out", "partial", f"other-host.example-{dead}"),  # another host: unknown
        make_staging(tmp_path, "out", "partial", "k3j", suffix="x9q1"),  # no owner: an older peagle's name
        make_staging(tmp_path, "other", "partial", f"{host}-{dead}"),  # another output
    ]
    (tmp_path / "out").mkdir()  # an empty output: the stale .old is then a leftover, not the only copy
    with staged_output_dir(tmp_path / "out", force=False) as tmp:
        (tmp / "manifest.json").write_text('{"kind": "packed"}')
    assert not any(p.exists() for p in stale)
    assert all(p.is_dir() for p in kept)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("removed 2 stale partial outputs of killed runs")
    assert all(str(p) in err[0] for p in stale)
    assert (tmp_path / "out" / "manifest.json").read_text() == '{"kind": "packed"}'

    assert remove_stale_partials(tmp_path / "out") == []  # nothing left to remove; no line then
    with staged_output_dir(tmp_path / "out", force=True):
        pass
    assert capsys.readouterr().err == ""


def test_hostname_with_dashes_and_odd_characters(tmp_path, monkeypatch):
    import socket

    monkeypatch.setattr(socket, "gethostname", lambda: "node-7/gpu 3")
    host, dead = _host_tag(), dead_pid()
    assert host == "node-7_gpu_3"
    stale = make_staging(tmp_path, "out", "partial", f"{host}-{dead}", suffix="42")
    live = make_staging(tmp_path, "out", "partial", f"{host}-{os.getpid()}", suffix="42")
    assert remove_stale_partials(tmp_path / "out") == [stale]
    assert live.is_dir()


def test_refused_output_touches_nothing(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "f").write_text("x")
    stale = make_staging(tmp_path, "out", "partial", f"{_host_tag()}-{dead_pid()}")
    with pytest.raises(OutputExistsError):
        with staged_output_dir(tmp_path / "out", force=False):
            pass
    assert stale.is_dir()


def test_output_replaced_by_a_killed_force_run_is_restored_not_removed(tmp_path, capsys):
    """Killed between 'rename the output aside' and 'rename the new one in': the previous output
    comes back under its name; a plain rerun then refuses to overwrite it, a --force rerun replaces it."""
    host, dead = _host_tag(), dead_pid()
    old = make_staging(tmp_path, "out", "old", f"{host}-{dead}", suffix="99")
    partial = make_staging(tmp_path, "out", "partial", f"{host}-{dead}")
    live_old = make_staging(tmp_path, "other", "old", f"{host}-{os.getpid()}", suffix="99")
    with pytest.raises(OutputExistsError):
        with staged_output_dir(tmp_path / "out", force=False):
            pass
    assert (tmp_path / "out" / "part-00000.parquet").read_bytes() == b"half written" and not old.exists()
    assert "restored" in capsys.readouterr().err
    assert restore_replaced_output(tmp_path / "other") is None and live_old.is_dir()  # live owner: untouched
    with staged_output_dir(tmp_path / "out", force=True) as tmp:
        (tmp / "new").write_text("1")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["new"] and not partial.exists()


def test_half_deleted_old_copy_without_its_partial_is_removed_not_restored(tmp_path, capsys):
    """A --force run killed while deleting the replaced output leaves only .old (its partial is
    already the output, since deleted by the user): that copy is garbage, never brought back."""
    host, dead = _host_tag(), dead_pid()
    old = make_staging(tmp_path, "out", "old", f"{host}-{dead}", suffix="7")
    other_partial = make_staging(tmp_path, "out", "partial", f"{host}-{dead_pid()}")  # another dead run
    assert restore_replaced_output(tmp_path / "out") is None
    with staged_output_dir(tmp_path / "out", force=False) as tmp:
        (tmp / "new").write_text("1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and not old.exists() and not other_partial.exists()
    assert "restored" not in capsys.readouterr().err


def test_output_dot_is_refused_and_trailing_slash_names_the_directory(tmp_path, monkeypatch):
    from stores.errors import InputError

    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    for bad in (".", "./", str(tmp_path)):  # the current directory, or one holding it
        with pytest.raises(InputError, match="current directory") as e:
            with staged_output_dir(bad, force=True):
                pass
        assert e.value.field == "--output"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here"] and not any((tmp_path / "here").iterdir())
    with staged_output_dir("sub/", force=False) as tmp:
        assert tmp.parent == tmp_path / "here" and tmp.name.startswith(".sub.partial-")
        (tmp / "x").write_text("1")
    assert (tmp_path / "here" / "sub" / "x").read_text() == "1"


def test_force_replaces_only_peagles_own_output_and_names_the_foreign_files(tmp_path):
    """Issue 44 item 1: ``--force`` into a directory holding a user's notes.txt deleted it. Only a directory that
    a kind's marker file says is peagle's, holding only that kind's entries, is replaced; else nothing is
    removed and the error names the foreign files."""
    from stores.errors import ForeignFilesError
    from stores.staging import check_replaceable, foreign_entries, prepare_output_dir

    users = tmp_path / "users"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    with pytest.raises(ForeignFilesError) as e:
        with staged_output_dir(users, force=True):
            pass
    assert (users / "notes.txt").read_text() == "mine" and e.value.foreign == [str(users / "notes.txt")]
    assert str(e.value).startswith(f"output {users} already exists and holds 1 file peagle did not write: notes.txt; "
                                   "--force replaces only peagle's own output (a token table with its manifest.json, ")
    assert str(e.value).endswith("never other files: move them away, or give another --output")
    with pytest.raises(ForeignFilesError):
        prepare_output_dir(users, force=True)
    assert (users / "notes.txt").read_text() == "mine"
    with pytest.raises(OutputExistsError) as plain:  # without --force: the usual message
        check_replaceable(users, force=False)
    assert str(plain.value) == f"output {users} already exists; pass --force to overwrite it"

    table = tmp_path / "table"  # a token table of peagle's, with a user's file put into it
    table.mkdir()
    (table / "manifest.json").write_text('{"kind": "packed", "format_version": 1}')
    (table / "part-00000.parquet").write_bytes(b"p")
    (table / "notes.txt").write_text("mine")
    assert foreign_entries(table) == [table / "notes.txt"]
    (table / "notes.txt").unlink()
    assert foreign_entries(table) == [] and check_replaceable(table, force=True)
    with staged_output_dir(table, force=True) as tmp:
        (tmp / "manifest.json").write_text('{"kind": "packed"}')
    assert sorted(p.name for p in table.iterdir()) == ["manifest.json"]

    fake = tmp_path / "fake"  # a manifest.json that is not a peagle manifest marks nothing
    fake.mkdir()
    (fake / "manifest.json").write_text('{"name": "my web app"}')
    assert foreign_entries(fake) == [fake / "manifest.json"]
    store = tmp_path / "s.zarr"  # a feature store: zarr.json with peagle's attributes, arrays below it
    (store / "hidden").mkdir(parents=True)
    (store / "zarr.json").write_text('{"node_type": "group", "attributes": {"peagle": {}}}')
    (store / "hidden" / "zarr.json").write_text('{"node_type": "array"}')
    (store / "plots").mkdir()
    assert foreign_entries(store) == [store / "plots"]
    run = tmp_path / "run"  # a training run
    (run / "checkpoint-4").mkdir(parents=True)
    (run / "train_config.json").write_text(json.dumps(RUN_CONFIG))
    (run / "metrics.jsonl").write_text("")
    assert foreign_entries(run) == []
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    with pytest.raises(ForeignFilesError, match="was not written by peagle"):
        prepare_output_dir(a_file, force=True)
    assert a_file.read_text() == "mine"
    assert not check_replaceable(tmp_path / "new", force=False) and foreign_entries(tmp_path / "new") == []


def test_a_failed_atomic_write_leaves_no_temporary_file_or_directory(tmp_path):
    """Issue 44 item 9: a write that fails (a full disk) leaves neither NAME.tmp nor .NAME.tmp beside the output."""
    import errno

    from stores.staging import atomic_file, replace_dir

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    (tmp_path / "state.json").write_text("old")
    with pytest.raises(OSError):
        with atomic_file(tmp_path / "state.json") as tmp:
            tmp.write_text("half")
            full()
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(OSError):
        replace_dir(tmp_path / "ckpt", lambda d: ((d / "w").write_text("half"), full()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "state.json"]
    assert (tmp_path / "state.json").read_text() == "old" and not any((tmp_path / "ckpt").iterdir())


def test_a_checkpoint_write_on_a_full_disk_is_a_disk_full_error(tmp_path, monkeypatch):
    """torch.save on a full disk says only "unexpected pos 576 vs 534" (a RuntimeError), safetensors "No space
    left on device (os error 28)" (its own error type): replace_dir and atomic_file, which write checkpoints and
    training state, make both the DiskFullError the commands print as one line (cli.common.handle_errors)."""
    import collections
    import shutil

    from stores.errors import DiskFullError
    from stores.staging import atomic_file, replace_dir

    class SafetensorError(Exception):
        pass

    def torch_full(_):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")

    with pytest.raises(RuntimeError, match="unexpected pos") as e:  # a disk with room: the error as it is
        replace_dir(tmp_path / "checkpoint-4", torch_full)
    assert type(e.value) is RuntimeError
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 512, 512))
    with pytest.raises(DiskFullError) as e:
        replace_dir(tmp_path / "checkpoint-4", torch_full)
    assert str(e.value).startswith("disk full: no space left on ") and "(512 bytes free) while writing " in str(e.value)
    assert str(e.value).endswith(str(tmp_path / "checkpoint-4"))
    monkeypatch.undo()
    with pytest.raises(DiskFullError, match="bytes free"):
        with atomic_file(tmp_path / "training_state.pt"):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert sorted(p.name for p in tmp_path.iterdir()) == []




def test_force_never_replaces_a_users_zarr_group_and_replaces_a_streamed_store(tmp_path):
    """A zarr group without attributes marked itself as a feature store being created, so ``extract --force`` deleted
    a user's zarr data set (``temperature`` under a group with no attributes); and a streamed store's
    ``stream_heartbeat/`` was foreign, so ``--force`` refused peagle's own store. A store being created holds only the
    schema's arrays (the names checked against stores/features/feature_schema.py)."""
    import zarr

    from stores.errors import ForeignFilesError
    from stores.features.feature_schema import ARRAYS, SEGMENT_KEYS, WINDOW_ARRAYS
    from stores.features.feature_store import CONTEXTS
    from stores.staging import OUTPUT_KINDS, check_replaceable, foreign_entries
    from stores.stream.heartbeat import HEARTBEAT_DIR
    from stores.stream.plan import STREAM_GROUP

    users = tmp_path / "users.zarr"
    group = zarr.open_group(str(users), mode="w")
    group.create_array("temperature", shape=(3,), dtype="float32")
    with pytest.raises(ForeignFilesError):
        check_replaceable(users, force=True)
    assert foreign_entries(users) == [users / "temperature"] and (users / "temperature" / "zarr.json").is_file()

    being_created = tmp_path / "new.zarr"  # killed before its attributes: its arrays are peagle's
    group = zarr.open_group(str(being_created), mode="w")
    for name in ("input_ids", "done"):
        group.create_array(name, shape=(3,), dtype="int32")
    group.create_group(CONTEXTS)
    assert foreign_entries(being_created) == [] and check_replaceable(being_created, force=True)

    streamed = tmp_path / "streamed.zarr"
    group = zarr.open_group(str(streamed), mode="w")
    group.attrs["peagle"] = {"format_version": 2}
    (streamed / HEARTBEAT_DIR).mkdir()
    (streamed / HEARTBEAT_DIR / "trainer.json").write_text("{}")
    assert foreign_entries(streamed) == [] and check_replaceable(streamed, force=True)

    store_kind = next(k for k in OUTPUT_KINDS if k.marker == "zarr.json")
    schema = {s.name for s in (*ARRAYS, *WINDOW_ARRAYS, SEGMENT_KEYS)} | {CONTEXTS, STREAM_GROUP}
    assert set(store_kind.new_nodes) == schema and f"{HEARTBEAT_DIR}/zarr.json" in store_kind.files


def test_force_never_replaces_a_manifest_json_of_another_kind(tmp_path):
    """Any ``manifest.json`` with a ``kind`` key marked a token table: ``tokenize --force`` into a user's directory
    holding ``{"kind": "Deployment"}`` and a ``rejects.jsonl`` of theirs replaced both. Only peagle's table kinds
    mark one (checked against stores/tables/token_tables.py's schemas)."""
    from stores.errors import ForeignFilesError
    from stores.staging import OUTPUT_KINDS, check_replaceable, foreign_entries
    from stores.tables.token_tables import SCHEMAS

    users = tmp_path / "users"
    users.mkdir()
    (users / "manifest.json").write_text('{"kind": "Deployment"}')
    (users / "rejects.jsonl").write_text("mine\n")
    with pytest.raises(ForeignFilesError):
        check_replaceable(users, force=True)
    assert foreign_entries(users) == [users / "manifest.json", users / "rejects.jsonl"]
    (users / "manifest.json").write_text('{"kind": "packed"}')
    assert foreign_entries(users) == [] and check_replaceable(users, force=True)
    table_kind = next(k for k in OUTPUT_KINDS if k.marker == "manifest.json")
    assert set(table_kind.kind_values) == set(SCHEMAS)


def _run_dir(tmp_path) -> Path:
    """A training run as peagle-train leaves it: settings, metrics, the plot, trackers, two checkpoints and final/."""
    run = tmp_path / "run"
    for d in ("checkpoint-4", "checkpoint-8", "final", "trackers/peagle"):
        (run / d).mkdir(parents=True)
    (run / "train_config.json").write_text(json.dumps(RUN_CONFIG))
    for f in ("metrics.jsonl", "training.png", "trackers/peagle/events.out.tfevents.1.host"):
        (run / f).write_text("x")
    for d in ("checkpoint-4", "checkpoint-8", "final"):
        state = ("training_state.pt",) if d != "final" else ()
        for f in ("config.json", "model.safetensors", "training_segments.npy", *state):
            (run / d / f).write_text("x")
    return run


def _table_dir(tmp_path) -> Path:
    """A packed token table with its conversations/ sub-table."""
    table = tmp_path / "packed"
    (table / "conversations").mkdir(parents=True)
    for d in (table, table / "conversations"):
        (d / "manifest.json").write_text('{"kind": "packed", "format_version": 1}')
        (d / "part-00000.parquet").write_bytes(b"p")
    (table / "token_freq.npy").write_bytes(b"n")
    return table


def _store_dir(tmp_path) -> Path:
    """A feature store of peagle's: attributes, an array with chunks, the contexts group with an array, a stream
    plan (its order array and consumed cursor) and a heartbeat."""
    import numpy as np
    import zarr

    store = tmp_path / "s.zarr"
    group = zarr.open_group(str(store), mode="w")
    group.attrs["peagle"] = {"format_version": 2}
    group.create_array("aux_hidden", shape=(4, 2), chunks=(2, 2), dtype="uint16")[:] = np.ones((4, 2), "uint16")
    group.create_group("contexts").create_array("input_ids", shape=(3,), dtype="int64")[:] = 7
    group.create_group("stream").create_array("order", shape=(2,), dtype="int64")[:] = 1
    (store / "stream" / "consumed.json").write_text('{"consumed": 1}')  # streamed: the cursor and a heartbeat
    (store / "stream_heartbeat").mkdir()
    (store / "stream_heartbeat" / "zarr.json").write_text('{"node_type": "group", "zarr_format": 3}')
    (store / "stream_heartbeat" / "trainer.json").write_text("{}")
    return store


@pytest.mark.parametrize("where", ["run final", "run checkpoint", "run trackers", "table conversations",
                                   "store array", "store chunks", "store contexts", "store stream"])
def test_force_refuses_a_users_file_nested_in_peagles_own_folders(tmp_path, where):
    """``--force`` checked only an output's top-level names: a user's RUN/final/README.md, a file in a checkpoint, in
    a table's conversations/ or in a store's array folders went with the rest. Every file below, at any depth, must
    be one peagle writes; a user's is named (its path below the output) and nothing is removed."""
    from stores.errors import ForeignFilesError
    from stores.staging import check_replaceable, foreign_entries, prepare_output_dir, staged_output_dir

    build, rel = {"run final": (_run_dir, "final/README.md"), "run checkpoint": (_run_dir, "checkpoint-8/notes.txt"),
                  "run trackers": (_run_dir, "trackers/peagle/mine.txt"),
                  "table conversations": (_table_dir, "conversations/README.md"),
                  "store array": (_store_dir, "aux_hidden/notes.txt"), "store chunks": (_store_dir, "aux_hidden/c/x"),
                  "store contexts": (_store_dir, "contexts/input_ids/mine.npy"),
                  "store stream": (_store_dir, "stream/notes.txt")}[where]
    out = build(tmp_path)
    if where != "run trackers":  # the trackers' own files are theirs: any file below trackers/
        assert foreign_entries(out) == [] and check_replaceable(out, force=True)
    mine = out / rel
    mine.write_text("mine")
    if where == "run trackers":
        assert foreign_entries(out) == []
        return
    assert foreign_entries(out) == [mine]
    with pytest.raises(ForeignFilesError) as e:
        if where.startswith("table"):
            with staged_output_dir(out, force=True):
                pass
        else:
            prepare_output_dir(out, force=True)
    assert f"holds 1 file peagle did not write: {rel}; " in str(e.value) and mine.read_text() == "mine"
    assert "move them away, or give another --output" in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name], "nothing staged or removed"


def test_a_train_config_json_of_another_tool_marks_nothing(tmp_path):
    """Any train_config.json marked a training run (``{}`` passed): another tool's train_config.json and its
    checkpoint-500/ were replaced whole by ``peagle-train --force``. Only peagle-train's settings mark a run: the
    grouped form it writes (checked against TrainConfig.to_dict) or the flat form of earlier versions."""
    from peagle_train.train.config import TrainConfig
    from stores.errors import ForeignFilesError
    from stores.staging import RUN_CONFIG_KEYS, check_replaceable, foreign_entries

    other = tmp_path / "other"
    (other / "checkpoint-500").mkdir(parents=True)
    (other / "checkpoint-500" / "pytorch_model.bin").write_bytes(b"w")
    for config in ({}, {"learning_rate": 1e-4, "output_dir": "other"}, {"data": {}, "model": {}, "run": {}}):
        (other / "train_config.json").write_text(json.dumps(config))
        assert foreign_entries(other) == [other / "checkpoint-500", other / "train_config.json"]
        with pytest.raises(ForeignFilesError):
            check_replaceable(other, force=True)
    assert (other / "checkpoint-500" / "pytorch_model.bin").read_bytes() == b"w"

    run = _run_dir(tmp_path)
    written = TrainConfig.from_flat(store="s.zarr", output=str(run)).to_dict()
    assert all(k in written[g] for g, k in RUN_CONFIG_KEYS.items())
    (run / "train_config.json").write_text(json.dumps(written, default=str))
    assert foreign_entries(run) == []
    flat = {"store": "s.zarr", "output": str(run), "num_depths": 8, "down_sample_ratio": 0.7, "lr": 3e-4}
    (run / "train_config.json").write_text(json.dumps(flat))  # written by peagle before the settings were grouped
    assert foreign_entries(run) == [] and check_replaceable(run, force=True)


def test_output_apart_from_inputs_by_real_path(tmp_path):
    """An output that is, contains or lies inside an input is refused (through links too); a report file may lie
    inside an input directory; a model hub name is no path."""
    from stores.errors import InputError
    from stores.staging import check_output_apart

    (tmp_path / "data" / "p").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "data" / "p")
    for output, how in ((tmp_path / "link", "is the input PACKED"), (tmp_path / "data", "contains the input PACKED"),
                        (tmp_path / "data" / "p" / "out", "lies inside the input PACKED")):
        with pytest.raises(InputError, match=how):
            check_output_apart(output, {"PACKED": [str(tmp_path / "data" / "p")]})
    check_output_apart(tmp_path / "data" / "p" / "eval.json", {"--drafter": [str(tmp_path / "data" / "p")]},
                       directory=False)
    check_output_apart(tmp_path / "out", {"PACKED": [str(tmp_path / "data" / "p")], "--verifier": ["org/model"]})


def test_ownership_is_one_rule_absent_ours_or_foreign(tmp_path):
    """stores.staging.ownership decides whose an output is, once: absent (missing, an empty directory), ours (a
    kind's marker and only that kind's entries) or foreign (anything else); check_replaceable refuses through it;
    the entries are looked at only when asked (a large store's files are listed once, under --force)."""
    from stores.errors import ForeignFilesError
    from stores.staging import ABSENT, FOREIGN, OURS, check_replaceable, ownership

    empty = tmp_path / "empty"
    empty.mkdir()
    assert ownership(tmp_path / "missing").state == ABSENT and ownership(empty).state == ABSENT
    assert ownership(empty).refuse(force=False) is False and check_replaceable(empty, False) is False
    table = tmp_path / "table"
    table.mkdir()
    (table / "manifest.json").write_text('{"kind": "packed"}')
    (table / "part-00000.parquet").write_bytes(b"rows")
    owner = ownership(table)
    assert owner.state == OURS and owner.foreign == [] and owner.refuse(force=True) is True
    with pytest.raises(OutputExistsError) as e:
        owner.refuse(force=False, hint="pass --resume to continue it or --force to overwrite it")
    assert str(e.value) == f"output {table} already exists; pass --resume to continue it or --force to overwrite it"
    (table / "notes.txt").write_text("mine")
    assert ownership(table).state == FOREIGN and ownership(table).foreign == [table / "notes.txt"]
    with pytest.raises(ForeignFilesError) as e:
        ownership(table).refuse(force=True, option="--store")
    assert e.value.foreign == [str(table / "notes.txt")]
    with pytest.raises(ForeignFilesError) as same:
        check_replaceable(table, True, option="--store")
    assert str(same.value) == str(e.value)
    file = tmp_path / "file"
    file.write_text("x")
    assert ownership(file).state == FOREIGN and ownership(file).foreign == [file]
    owner = ownership(table)
    assert owner.present and "foreign" not in vars(owner)  # not listed until asked
    assert owner.foreign == [table / "notes.txt"] and vars(owner)["foreign"] is owner.foreign  # then kept
