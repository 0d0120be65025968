"""File-system helpers shared by the stores and their callers: permissions that follow the process umask,
local paths (:func:`is_local`), the zarr v3 probe (:func:`is_zarr_store`) and strict JSON
(:func:`strict_json`: no NaN or Infinity, which are not JSON)."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

from stores.errors import DiskFullError, NonFiniteError

__all__ = ["current_umask", "follow_umask", "is_local", "is_zarr_store", "nonfinite_paths", "strict_json",
           "is_disk_full", "disk_full_error", "json_error_text", "json_line_problem"]

_DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded")
"""What libraries that drop the errno say (pyarrow's ``OSError``: "... error: No space left on device";
safetensors' ``SafetensorError``: "I/O error: No space left on device (os error 28)")."""
NEARLY_FULL_BYTES = 1 << 20
"""Free bytes under which a failed write whose error says nothing of the disk counts as a full disk
(``torch.save`` on a full disk raises ``RuntimeError: ... unexpected pos 576 vs 534``)."""


def _nearest(path: str | os.PathLike) -> Path:
    """``path``, or its nearest parent that exists (absolute)."""
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def is_disk_full(e: BaseException, path: str | os.PathLike | None = None) -> bool:
    """Whether ``e`` is the error of a full disk or an exceeded quota: an ``OSError`` of ``ENOSPC``/``EDQUOT``, an
    error whose message says so without the errno (:data:`_DISK_FULL_TEXT`), or, given ``path`` (where the failed
    write went), any ``OSError``/``RuntimeError`` while that disk has under :data:`NEARLY_FULL_BYTES` free."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    if any(t in str(e) for t in _DISK_FULL_TEXT):
        return True
    if path is None or not isinstance(e, (OSError, RuntimeError)):
        return False
    try:
        return shutil.disk_usage(_nearest(path)).free < NEARLY_FULL_BYTES
    except OSError:
        return False


def disk_full_error(e: BaseException, path: str | os.PathLike) -> DiskFullError:
    """The :class:`~stores.errors.DiskFullError` of ``e`` (see :func:`is_disk_full`): the file it names, else
    ``path`` (the output being written), with the mount point and free bytes of the disk that holds it."""
    if isinstance(e, DiskFullError):
        return e
    filename = getattr(e, "filename", None)
    where = Path(os.path.abspath(filename if isinstance(filename, str) else path))
    probe = _nearest(where)
    mount = probe
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        free = shutil.disk_usage(probe).free
    except OSError:
        free = None
    quota = getattr(e, "errno", None) == errno.EDQUOT or "quota" in str(e).lower()
    return DiskFullError(str(where), str(mount), free, quota)


def nonfinite_paths(obj: Any, prefix: str = "") -> list[str]:
    """The keys (``a.b[2]``) of the NaN or infinite floats inside ``obj`` (dicts, lists, tuples, floats)."""
    if isinstance(obj, float):
        return [] if math.isfinite(obj) else [prefix or "the value"]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in nonfinite_paths(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(obj, (list, tuple)):
        return [p for i, v in enumerate(obj) for p in nonfinite_paths(v, f"{prefix}[{i}]")]
    return []


def strict_json(obj: Any, what: str, **kwargs: Any) -> str:
    """``json.dumps(obj, allow_nan=False, **kwargs)``: Python's ``NaN``/``Infinity`` are not JSON, and a NaN
    loss or metric written as a number would read as a result.

    Raises:
        NonFiniteError: naming ``what`` and the keys of the non-finite values.
    """
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError:
        bad = nonfinite_paths(obj)
        if not bad:
            raise
        raise NonFiniteError(f"{what}: {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} NaN or infinite; "
                             "not written") from None


def json_error_text(e: json.JSONDecodeError) -> str:
    """``e``'s message without the ``at`` some of Python's messages end in ("Invalid control character at"),
    which a caller adds with the position: never "at at"."""
    return e.msg[:-3] if e.msg.endswith(" at") else e.msg


def json_line_problem(line: str, e: json.JSONDecodeError, row: int) -> str:
    """Why JSON-lines line ``row`` (``line``, its text) failed to parse (``e``), as a reject reason: ``truncated
    JSON: line N is cut short ...`` when the record is still open where the line ends (an unterminated string, or
    the error at the line's end: a file cut mid-line, a line broken in two), else ``invalid JSON: MESSAGE at line
    N column C``."""
    content = line.rstrip()
    if e.msg.startswith("Unterminated") or e.pos >= len(content):
        detail = f"; {json_error_text(e)} at column {e.colno}" if e.pos < len(content) else ""
        return (f"truncated JSON: line {row} is cut short: its record is still open where the line ends "
                f"(column {len(content) + 1}{detail})")
    return f"invalid JSON: {json_error_text(e)} at line {row} column {e.colno}"


def is_local(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a local file or directory, not an fsspec URL (``s3://``, ``memory://``...)."""
    return "://" not in str(path)


def is_zarr_store(path: str | os.PathLike) -> bool:
    """Whether directory ``path`` holds a zarr v3 group, i.e. a feature store (its ``zarr.json``), not a
    token table (``manifest.json``)."""
    return (Path(path) / "zarr.json").is_file()


def current_umask() -> int:
    """The process umask, read without changing it (``Umask:`` of ``/proc/self/status`` on Linux).

    Elsewhere it falls back to ``os.umask`` set-and-restore, which is racy only against threads
    creating files in the same instant.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str | os.PathLike, mode: int = 0o666) -> None:
    """Set ``path``'s permissions to ``mode & ~umask``, what ``open()`` would have given it.

    For files written by libraries that create them private (safetensors' ``save_file`` and
    transformers' ``save_pretrained`` write ``0600``); e.g. ``0644`` under the usual umask ``022``.
    """
    os.chmod(path, mode & ~current_umask())
