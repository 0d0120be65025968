"""Typed errors shared by every peagle package.

Messages say what was expected, what was found and how to fix it. ``assert`` is kept for
internal invariants; user input always raises one of these.
"""

from __future__ import annotations

import os

__all__ = [
    "PeagleError",
    "InputError",
    "OutputExistsError",
    "ForeignFilesError",
    "OutputLockedError",
    "StoreFormatError",
    "ChunkDamageError",
    "StoreMismatchError",
    "NonFiniteError",
    "MissingDependencyError",
    "ModelNotFoundError",
    "DiskSpaceError",
    "DiskFullError",
]


class PeagleError(Exception):
    """Base class of every error peagle raises on purpose (the CLI turns it into exit code 2)."""


class InputError(PeagleError, ValueError):
    """Bad user input, located by file, row and field where known."""

    def __init__(self, message: str, *, file: str | None = None, row: int | None = None,
                 field: str | None = None):
        self.file, self.row, self.field = file, row, field
        where = ", ".join(
            p for p in (
                f"file {file}" if file is not None else None,
                f"row {row}" if row is not None else None,
                f"field {field!r}" if field is not None else None,
            ) if p
        )
        super().__init__(f"{where}: {message}" if where else message)


class OutputExistsError(PeagleError, FileExistsError):
    """An output path exists and ``--force`` (or ``--resume``) was not given.

    The message is ``output {path} already exists; {hint}``: ``path`` is only the path (or
    ``--option path``), ``hint`` only the remedy; neither repeats "exists".
    """

    def __init__(self, path: str, hint: str = "pass --force to overwrite it"):
        self.path = path
        super().__init__(f"output {path} already exists; {hint}")


class ForeignFilesError(OutputExistsError):
    """An output that ``--force`` would replace holds files peagle did not write: nothing is removed.

    Attributes:
        path: the output.
        foreign: the entries peagle did not write (paths).
    """

    def __init__(self, path: str, foreign: list[str], option: str = "--output", kinds: list[str] | None = None):
        self.path, self.foreign = path, list(foreign)
        inside = path.rstrip(os.sep) + os.sep
        names = [os.path.relpath(f, path) if f.startswith(inside) else f for f in self.foreign]
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        what = ", ".join(kinds or ["peagle output"])
        found = ("was not written by peagle" if self.foreign == [path]
                 else f"holds {len(names)} file{'s' if len(names) > 1 else ''} peagle did not write: {shown}")
        PeagleError.__init__(self, f"output {path} already exists and {found}; --force replaces only peagle's own "
                                   f"output ({what}), never other files: move them away, or give another {option}")


class OutputLockedError(PeagleError):
    """Another run holds the output's lock (:mod:`stores.output_lock`): a second run on one output would write
    beside it (a ``--resume`` beside the live run truncated its ``metrics.jsonl``). Nothing was touched.

    Attributes:
        path: the output.
        lock: the lock file.
        holder: what the lock file records (``host``, ``pid``, ``started``, ``command``), or ``{}``.
    """

    def __init__(self, path: str, lock: str, holder: dict, remedy: str):
        self.path, self.lock, self.holder = path, lock, dict(holder)
        who = (f"pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')}"
               f" ({holder.get('command')})" if holder else "a run that has not written its name yet")
        super().__init__(f"output {path} is in use by another run: {who}; lock {lock}; {remedy}")


class DiskSpaceError(PeagleError, OSError):
    """An output would not fit on its disk (``--force`` writes it anyway)."""


class DiskFullError(DiskSpaceError):
    """A write found its disk full (``ENOSPC``, or a quota: ``EDQUOT``) in the middle of a run; the writer removed
    what it had half written (:func:`stores.files.disk_full_error` makes one from the ``OSError``).

    Attributes:
        path: the file or output being written.
        mount: the mount point of the disk holding ``path``.
        free_bytes: the bytes free on it when the error was made (None: unknown).
    """

    def __init__(self, path: str, mount: str, free_bytes: int | None, quota: bool = False):
        self.path, self.mount, self.free_bytes = path, mount, free_bytes
        free = f"{free_bytes:,} bytes free" if free_bytes is not None else "free bytes unknown"
        full = "the disk quota is exceeded" if quota else "no space left"
        super().__init__(28, f"disk full: {full} on {mount} ({free}) while writing {path}")

    def __str__(self) -> str:
        return self.args[1]


class StoreFormatError(PeagleError, ValueError):
    """A table or feature store is missing, corrupt, or of an unknown format version."""


class ChunkDamageError(StoreFormatError):
    """A feature store's chunk is missing, truncated, reads short or fails its crc32c checksum: its bytes
    cannot be trusted (a read that feeds training or evaluation stops at it)."""


class StoreMismatchError(PeagleError, ValueError):
    """A store does not match what the caller expects (verifier, layers, packed table)."""


class NonFiniteError(PeagleError, ArithmeticError):
    """A loss, metric or weight is NaN or Inf: the run stops, naming the step and the blocks, rather than
    write it into a JSON file or a checkpoint."""


class MissingDependencyError(PeagleError, ImportError):
    """An optional dependency is not installed; the message names the install command."""


class ModelNotFoundError(PeagleError, FileNotFoundError):
    """A model name is neither an embedded default, a local directory, nor reachable on a hub."""
