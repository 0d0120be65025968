"""One run per output: the lock every writing command holds on its output while it runs (docs/design.md §6).

The lock is the file ``.NAME.lock`` beside the output ``NAME`` (beside, not inside: a command replaces its output
directory whole, and ``--force`` removes it). :func:`hold_output_lock` takes an exclusive ``fcntl.flock`` on it,
which the kernel drops when the process ends, however it ends (``kill -9`` too), and writes into it what a refusal
names: ``{"host", "pid", "started", "command"}``. A second run on the same output, fresh, ``--force`` or
``--resume``, is refused (:class:`~stores.errors.OutputLockedError`) while the first lives.

- A lock file whose flock is free was left by a run that ended without removing it (killed): when it names this
  host it is taken over, with one line on stderr naming the dead run.
- When it names another host (a shared file system whose locks do not reach across hosts, or a run killed there),
  this host cannot tell whether that run lives: the run is refused, naming the host, pid and start time and the
  file to remove once that run is known to be gone. There is no time-out: a long run on another host is never
  taken over.

A run that finishes (or fails, or is interrupted) removes its lock file. Remote outputs (``s3://``) are not locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from stores.errors import InputError, OutputLockedError

__all__ = ["lock_path", "read_lock", "hold_output_lock"]


def lock_path(output: str | os.PathLike) -> Path:
    """The lock file of ``output``: ``.NAME.lock`` in its parent directory (the output's absolute path; links are
    not followed, so two names of one directory are two outputs: :func:`stores.staging.check_output_apart`
    resolves them)."""
    path = Path(os.path.abspath(output))
    return path.parent / f".{path.name}.lock"


def _read_fd(fd: int) -> dict:
    """The record of an open lock file (``{}`` when empty or unreadable)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        record = json.loads(os.read(fd, 1 << 16).decode("utf-8") or "{}")
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def read_lock(output: str | os.PathLike) -> dict:
    """What the lock file of ``output`` records (``{}`` when there is none)."""
    try:
        return json.loads(lock_path(output).read_text(encoding="utf-8") or "{}")
    except (OSError, UnicodeDecodeError, ValueError):
        return {}


def _open_locked(path: Path, output: Path) -> int:
    """An open descriptor of ``path`` under an exclusive flock, the file still at ``path`` (a run that ends removes
    its file: a lock taken on the removed file would lock nothing).

    Raises:
        OutputLockedError: a live process holds the flock.
        InputError: the lock file cannot be created (a parent directory this user may not write).
    """
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError as e:
            raise InputError(f"cannot create the lock file {path} ({e.strerror}): every writing command holds a lock "
                             f"beside its output; give an output in a directory you may write",
                             field="--output") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_fd(fd)
            os.close(fd)
            raise OutputLockedError(str(output), str(path), holder,
                                    "wait for it to finish, or stop it (its checkpoint is kept), then run again")
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _host() -> str:
    return socket.gethostname() or "localhost"


@contextlib.contextmanager
def hold_output_lock(output: str | os.PathLike, command: str) -> Iterator[Path]:
    """Hold the lock of ``output`` for the block (the lock file is yielded; removed when the block ends).

    Args:
        output: the output directory or file (it need not exist).
        command: what the lock file records as the holder (``peagle-train``), named in refusals.

    Raises:
        OutputLockedError: another live run holds it, or a lock file of another host is there.
        InputError: the lock file cannot be created (a parent directory this user may not write).
    """
    output = Path(os.path.abspath(output))
    path = lock_path(output)
    fd = _open_locked(path, output)
    try:
        left = _read_fd(fd)
        if left and left.get("host") != _host():
            raise OutputLockedError(str(output), str(path), left,
                                    f"that host's runs cannot be checked from {_host()}: once the run is known to be "
                                    f"gone, remove {path} and run again")
        if left:
            print(f"took over the lock of {output} left by a run that ended without releasing it (killed): pid "
                  f"{left.get('pid')}, started {left.get('started')}", file=sys.stderr)
        record = {"host": _host(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                  "command": command}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode("utf-8"), 0)
    except BaseException:
        os.close(fd)
        raise
    try:
        yield path
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)  # under the flock: a run waiting on this file sees it removed and opens a new one
        os.close(fd)
