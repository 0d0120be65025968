"""One run per output: the lock of stores/output_lock.py, held by a live process, dropped when it dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from stores.errors import OutputLockedError
from stores.output_lock import hold_output_lock, lock_path, read_lock

REPO = Path(__file__).resolve().parents[2]

HOLD = ("import sys, time\n"
        "from stores.output_lock import hold_output_lock\n"
        "with hold_output_lock(sys.argv[1], 'peagle-train'):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(120)\n")
"""A run that holds the lock of ``argv[1]`` and sleeps."""


def start_holder(output: Path) -> subprocess.Popen:
    """A child process holding the lock of ``output`` (returns once it holds it)."""
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(output)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_second_run_is_refused_while_the_first_lives_and_proceeds_after_kill_9(tmp_path, capsys):
    """Two runs on one output wrote beside each other (a ``--resume`` beside the live run truncated its metrics).
    The lock refuses the second while the first lives, naming it; after ``kill -9`` the next run takes it over."""
    out = tmp_path / "run"
    child = start_holder(out)
    try:
        holder = read_lock(out)
        assert holder["pid"] == child.pid and holder["command"] == "peagle-train"
        with pytest.raises(OutputLockedError) as e:
            with hold_output_lock(out, "peagle-train"):
                pass
        assert f"output {out} is in use by another run: pid {child.pid} on " in str(e.value)
        assert f"lock {lock_path(out)}; wait for it to finish" in str(e.value)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert lock_path(out).is_file(), "a killed run leaves its lock file"
    with hold_output_lock(out, "peagle-train") as lock:
        assert read_lock(out)["pid"] == os.getpid() and lock == tmp_path / ".run.lock"
    assert f"took over the lock of {out} left by a run that ended without releasing it (killed): pid {child.pid}" \
        in capsys.readouterr().err
    assert not lock_path(out).exists(), "a run that ends removes its lock file"
    with hold_output_lock(out, "peagle-train"):  # released: taken again, silently
        pass
    assert capsys.readouterr().err == ""


def test_a_lock_file_of_another_host_is_refused_naming_how_to_remove_it(tmp_path):
    """Another host's run cannot be checked from here: its lock file refuses, saying which file to remove."""
    out = tmp_path / "run"
    lock_path(out).write_text(json.dumps({"host": "node-7", "pid": 4242, "started": "2026-12-07T10:00:00+0000",
                                          "command": "peagle-train"}))
    with pytest.raises(OutputLockedError) as e:
        with hold_output_lock(out, "peagle-train"):
            pass
    assert "in use by another run: pid 4242 on node-7, started 2026-12-07T10:00:00+0000 (peagle-train)" in str(e.value)
    assert str(e.value).endswith(f"once the run is known to be gone, remove {lock_path(out)} and run again")
    assert read_lock(out)["host"] == "node-7", "left as it was"


def test_a_parent_directory_without_write_permission_is_one_line(tmp_path, monkeypatch):
    """The lock file beside the output cannot be made (a directory this user may not write): an InputError naming
    it, not a traceback."""
    import errno

    import stores.output_lock
    from stores.errors import InputError

    def denied(path, *_):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(stores.output_lock.os, "open", denied)
    with pytest.raises(InputError) as e:
        with hold_output_lock(tmp_path / "run", "peagle-train"):
            pass
    assert str(e.value) == (f"field '--output': cannot create the lock file {tmp_path / '.run.lock'} (Permission "
                            "denied): every writing command holds a lock beside its output; give an output in a "
                            "directory you may write")
