"""Real servers the tests start on 127.0.0.1 (``transformers serve``, ``vllm serve``): the start, a free port, the
wait until one answers, and the stop. Every wait is bounded; a server that exits or never answers fails
the test with the end of its log.

A server started with :func:`start` ends with the test process however that ends: it runs in its own session
(process group, so the stop takes its engine processes too), the test process stops every live one at exit
(``atexit``) and on SIGTERM, SIGINT and SIGHUP, and the kernel sends it SIGTERM when the test process dies without
running either (``kill -9``: ``PR_SET_PDEATHSIG``, Linux)."""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Callable

_LIVE: dict[int, subprocess.Popen] = {}
"""Servers started by :func:`start` and not stopped yet, by pid (their process group id)."""
_HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PREVIOUS: dict[int, object] = {}
PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A ``preexec_fn`` that asks the kernel for SIGTERM when the process that forked it dies (Linux), and ends the
    child at once when that process is already gone (it died between the fork and here)."""

    def preexec() -> None:
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def _stop_all(grace_s: float = 10) -> None:
    """Stop every live server (:func:`stop`), each given ``grace_s`` seconds after SIGTERM."""
    for proc in list(_LIVE.values()):
        stop(proc, grace_s)


def _on_signal(signum, frame) -> None:
    """Stop the servers, then let the signal do what it did before (SIGINT: KeyboardInterrupt; the default: die)."""
    _stop_all()
    previous = _PREVIOUS.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL if previous is None else previous)
    if previous in (signal.SIG_DFL, None):
        os.kill(os.getpid(), signum)


def _install_handlers() -> None:
    """atexit and the signal handlers, once, from the main thread (where Python allows signal handlers)."""
    if _PREVIOUS:
        return
    atexit.register(_stop_all)
    for signum in _HANDLED:
        _PREVIOUS[signum] = signal.signal(signum, _on_signal)


def start(args: list[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(args, **popen_kwargs)`` in a new session, stopped with this process (module docstring)."""
    _install_handlers()
    proc = subprocess.Popen(args, start_new_session=True, preexec_fn=_die_with_parent(os.getpid()), **popen_kwargs)
    _LIVE[proc.pid] = proc
    return proc


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(proc: subprocess.Popen, url: str, what: str, log_tail: Callable[[], str],
                  timeout_s: float, poll_s: float = 1.0) -> None:
    """Return once ``url`` answers; raise ``AssertionError`` naming ``what`` and ``log_tail()`` when the
    process exits first or ``timeout_s`` seconds pass."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                state = f"exited with {proc.returncode}" if proc.poll() is not None else f"not up in {timeout_s:.0f} s"
                raise AssertionError(f"{what} {state}: {log_tail()}")
            time.sleep(poll_s)


def stop(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """Stop a server started by :func:`start` (or with ``start_new_session=True``): SIGTERM its process group,
    SIGKILL after ``grace_s`` seconds."""
    _LIVE.pop(proc.pid, None)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        proc.poll()
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
