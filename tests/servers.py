"""Real servers the tests start on 127.0.0.1 (``transformers serve``, ``vllm serve``): a free port, the
wait until one answers, and the stop. Every wait is bounded; a server that exits or never answers fails
the test with the end of its log."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from typing import Callable


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
    """Stop a server started with ``start_new_session=True``: SIGTERM its process group, SIGKILL after
    ``grace_s`` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
