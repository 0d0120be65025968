"""The liveness heartbeats of a streaming run's two sides (docs/design.md §7, "Streaming": liveness).

Each side of a streaming run waits on the other: the extraction for the trainer's consumed cursor (it moves only
when the trainer saves a checkpoint, every half window of steps), the trainer for blocks to be extracted. How
long a healthy peer takes to move is unbounded (a slow step, a long validation or save, a large unit), so a wait
must never time out on progress: it times out only when the peer is dead. Each side's process therefore keeps a
**heartbeat** in the store, independent of progress: a thread rewrites ``STORE/stream_heartbeat/ROLE.json``
every :data:`HEARTBEAT_S` seconds with

- ``pid``, ``host`` and ``started`` (the process's start time in clock ticks since boot, from ``/proc``; None
  elsewhere): which process beats, so a pid reused by another process is not taken for it;
- ``beat``: a counter increased at every write (what a watcher sees change while the process lives);
- ``progress``: the side's own count (the trainer's steps, the extraction's units), for the messages.

A watcher (:class:`PeerWatch`) gives up on its peer only when (a) the peer's beat did not change for the wait's
timeout (``--stream-timeout-s``), also when no heartbeat appeared at all (a peer that never started, or an
older peagle without heartbeats, is then judged by the progress the waiting side sees, which resets the clock
too), or (b) on one machine, the process whose beat it saw change is gone (exited, a zombie, or its pid now
another process's): at once, not after the timeout.

The files live beside the ``stream`` group, not in it: the plan's group is rewritten (``zarr`` mode ``w``
removes the directory) while both sides beat. The directory holds an empty zarr group's ``zarr.json`` (zarr warns
of a member it does not recognise whenever the store's arrays are listed). They count in the store's bytes within
the plan's allowance (``peagle_train.data.stream.PLAN_ALLOWANCE_BYTES``: two records of about 160 bytes, their
temporary twins and the group's metadata).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

__all__ = ["HEARTBEAT_DIR", "HEARTBEAT_S", "ROLES", "heartbeat_path", "read_heartbeat", "Heartbeat", "PeerWatch",
           "process_start"]

HEARTBEAT_DIR = "stream_heartbeat"
"""The store's directory of heartbeat files (not a zarr group)."""
HEARTBEAT_S = 1.0
"""Seconds between two beats. A ``--stream-timeout-s`` must be well above it (a few seconds at least)."""
ROLES = ("trainer", "extraction")
"""The two sides of a streaming run, one heartbeat file each."""


def heartbeat_path(store_path: str | os.PathLike, role: str) -> Path:
    """``STORE/stream_heartbeat/ROLE.json``.

    Raises:
        ValueError: ``role`` is not one of :data:`ROLES`.
    """
    if role not in ROLES:
        raise ValueError(f"heartbeat role {role!r}: expected one of {ROLES}")
    return Path(store_path) / HEARTBEAT_DIR / f"{role}.json"


def read_heartbeat(store_path: str | os.PathLike, role: str) -> dict[str, Any] | None:
    """The heartbeat record of ``role`` (see the module doc), or None: no file (yet), or one unreadable."""
    try:
        rec = json.loads(heartbeat_path(store_path, role).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def process_start(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (``/proc/PID/stat`` field 22); None when there
    is no ``/proc`` (not Linux) or no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[19])


def _gone(pid: int, started: int | None) -> bool:
    """Whether process ``pid`` (started at ``started``, when known) no longer runs on this machine: no such
    process, a zombie, or another process under that pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's process holds the pid: not the peer, unless it is (started tells)
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # no /proc: os.kill said it exists
    fields = stat[stat.rindex(")") + 2:].split()
    return fields[0] in ("Z", "X") or (started is not None and int(fields[19]) != started)


_GROUP_META = '{"zarr_format":3,"node_type":"group","attributes":{}}'
"""The heartbeat directory's ``zarr.json``: an empty zarr group, so that listing the store's members (zarr warns
of a directory it does not recognise) sees a group, not a stranger."""


def _write(path: Path, rec: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = path.parent / "zarr.json"
    if not meta.exists():
        meta.write_text(_GROUP_META)
    tmp = path.with_name(f".{path.name}.{rec['pid']}.tmp")
    tmp.write_text(json.dumps(rec, separators=(",", ":")))
    os.replace(tmp, path)


def _beat(path: Path, rec: dict[str, Any], progress: list[int], stop: threading.Event, period_s: float) -> None:
    """The heartbeat thread: a write every ``period_s`` until ``stop`` (no reference to its :class:`Heartbeat`, so
    a heartbeat that is dropped without :meth:`Heartbeat.stop` stops too)."""
    while True:
        rec["beat"] += 1
        rec["progress"] = progress[0]
        rec["time"] = round(time.time(), 3)
        try:
            _write(path, rec)
        except OSError:  # the store's directory removed or full for a moment: the next beat tries again
            pass
        if stop.wait(period_s):
            return


class Heartbeat:
    """This process's heartbeat as ``role`` in the store at ``store_path`` (see the module doc): started at once,
    stopped by :meth:`stop` (or when the object is dropped).

    Args:
        store_path: the store's directory (local).
        role: one of :data:`ROLES`.
        period_s: seconds between beats.
    """

    def __init__(self, store_path: str | os.PathLike, role: str, period_s: float = HEARTBEAT_S):
        self.path = heartbeat_path(store_path, role)
        self._progress = [0]
        self._stop = threading.Event()
        rec = {"role": role, "pid": os.getpid(), "host": socket.gethostname(), "started": process_start(os.getpid()),
               "beat": 0, "progress": 0, "time": 0.0}
        self._thread = threading.Thread(target=_beat, args=(self.path, rec, self._progress, self._stop, period_s),
                                        name=f"peagle-heartbeat-{role}", daemon=True)
        weakref.finalize(self, self._stop.set)
        self._thread.start()

    def progress(self, n: int) -> None:
        """Record the side's progress count (steps, units): written with the next beat."""
        self._progress[0] = int(n)

    def stop(self) -> None:
        """Stop beating (the file stays: a watcher sees its beat stop)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()


class PeerWatch:
    """Whether the peer ``role`` of a wait is alive (see the module doc); one per wait: the timeout counts from
    its creation, from the last change of the peer's beat, or from the last :meth:`progressed`.

    Args:
        store_path: the store's directory.
        role: the peer's role (one of :data:`ROLES`).
        timeout_s: seconds without a beat (nor progress) before the peer is given up.
        clock: monotonic seconds (tests).
    """

    def __init__(self, store_path: str | os.PathLike, role: str, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.store_path, self.role, self.timeout_s, self.clock = store_path, role, timeout_s, clock
        self.since = clock()
        self.last = read_heartbeat(store_path, role)
        self.alive_seen: dict[str, Any] | None = None
        """The last record whose beat was seen to change (a process seen alive), or None."""

    def progressed(self) -> None:
        """The waiting side saw progress of the peer (a block done, the cursor moved): the timeout starts again."""
        self.since = self.clock()

    def dead(self) -> str | None:
        """None while the peer may be alive; else why it is judged dead (for the error message)."""
        rec, now = read_heartbeat(self.store_path, self.role), self.clock()
        key = None if rec is None else (rec.get("pid"), rec.get("started"), rec.get("beat"))
        last = None if self.last is None else (self.last.get("pid"), self.last.get("started"), self.last.get("beat"))
        if key is not None and key != last:
            self.since, self.alive_seen = now, rec
        self.last = rec if rec is not None else self.last
        seen = self.alive_seen
        if seen is not None and seen.get("host") == socket.gethostname() and _gone(int(seen["pid"]), seen.get("started")):
            return (f"its process {seen['pid']} on this machine is gone (the {self.role}'s heartbeat, "
                    f"{heartbeat_path(self.store_path, self.role)}, last at progress {seen.get('progress')})")
        if now - self.since > self.timeout_s:
            what = ("no heartbeat of it appeared" if self.last is None else
                    f"its heartbeat ({heartbeat_path(self.store_path, self.role)}, pid {self.last.get('pid')} on "
                    f"{self.last.get('host')}) stopped")
            return f"{what} for {self.timeout_s:g} s, nor did it make progress"
        return None
