"""tests/servers.py: a server a test starts ends with the test process, however that ends (a test run killed
mid-way once left a vLLM OpenAI server and its engine, 3.7 GB, running for 30 minutes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

CHILD_TEST = '''
import sys, time
import pytest
sys.path.insert(0, {tests!r})
from servers import start, stop

@pytest.fixture
def server():
    proc = start([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    stop(proc)

def test_waits(server):
    with open({pid_file!r}, "w") as f:
        f.write(str(server.pid))
    time.sleep(600)
'''


def _gone(pid: int) -> bool:
    """The process has exited (a zombie that no one reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _default_dispositions() -> None:
    """The child test process starts with the default action for the signals under test, whatever this process
    inherited (a runner's background job ignores SIGINT, ``nohup`` SIGHUP): the helper keeps what it finds."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def _signal_state(pid: int) -> str:
    """What /proc says of a process that did not end: its state, ignored and caught signals, where it waits."""
    try:
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError as e:
        return f"/proc unreadable: {e}"
    keep = [line for line in status if line.split(":")[0] in ("State", "SigIgn", "SigCgt", "SigPnd", "ShdPnd")]
    return "; ".join(keep + [f"wchan {wchan}"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_server_ends_when_the_test_process_is_killed(tmp_path, signum):
    """A pytest process whose fixture started a server (a stand-in: a sleeping Python, through the same helper) is
    killed mid-test; the server is gone within 5 s."""
    pid_file = tmp_path / "server.pid"
    (tmp_path / "test_child.py").write_text(CHILD_TEST.format(tests=str(TESTS), pid_file=str(pid_file)))
    child = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
                              str(tmp_path), "-c", os.devnull, str(tmp_path / "test_child.py")],
                             cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             preexec_fn=_default_dispositions)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and child.poll() is None:
            assert time.monotonic() < deadline, "the child test never started its server"
            time.sleep(0.05)
        server = int(pid_file.read_text())
        assert not _gone(server)
        child.send_signal(signum)
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the test process lived 60 s after {signal.Signals(signum).name}; server gone: "
                                 f"{_gone(server)}; {_signal_state(child.pid)}") from None
        deadline = time.monotonic() + 5
        while not _gone(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(server), f"the server {server} outlived its test process killed by {signal.Signals(signum).name}"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
