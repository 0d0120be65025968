"""Typed errors shared by every peagle package.

Messages say what was expected, what was found and how to fix it. ``assert`` is kept for
internal invariants; user input always raises one of these.
"""

from __future__ import annotations

__all__ = [
    "PeagleError",
    "InputError",
    "OutputExistsError",
    "StoreFormatError",
    "ChunkDamageError",
    "StoreMismatchError",
    "NonFiniteError",
    "MissingDependencyError",
    "ModelNotFoundError",
    "DiskSpaceError",
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


class DiskSpaceError(PeagleError, OSError):
    """An output would not fit on its disk (``--force`` writes it anyway)."""


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
