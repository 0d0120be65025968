"""Raw chunk files of a local, uncompressed zarr v3 store (docs/design.md §7).

With no compressor but zarr's crc32c checksum codec, each chunk file is ``raw little-endian bytes
+ 4 checksum bytes``: it is read straight into a result array with ``preadv`` (each array's chunk
directory is opened once; a chunk costs openat + fstat + preadv + close) and its checksum is
checked without zarr: :meth:`ChunkFiles.read_checked` reads a whole chunk and its crc32c in one
``preadv``, :meth:`ChunkFiles.check_crc` checks a chunk whose slots are read apart (cost measured in
docs/benchmarks.md, "Checked reads").
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import google_crc32c  # zarr's crc32c codec needs it: installed with zarr
import numpy as np
import zarr

from stores.errors import ChunkDamageError

__all__ = ["CHECKSUM_BYTES", "CHECKSUM_MISMATCH", "ChunkFiles", "raw_chunk_damage", "uncompressed"]

CHECKSUM_BYTES = 4  # crc32c codec appends 4 bytes to each chunk
CHECKSUM_MISMATCH = "its crc32c checksum does not match its data"
"""The words of a chunk whose bytes changed after zarr wrote them (read path, ``verify`` and repair)."""
_CRC_PIECE = 8 << 20
"""Bytes :meth:`ChunkFiles.check_crc` reads at a time (bounds its memory on a large context chunk)."""


def uncompressed(array: zarr.Array) -> bool:
    """Whether ``array``'s chunks are raw bytes (optionally + crc32c): readable as files."""
    codecs = array.metadata.to_dict().get("codecs", [])
    names = [c["name"] if isinstance(c, dict) else getattr(c, "name", "") for c in codecs]
    return names in (["bytes"], ["bytes", "crc32c"])


def raw_chunk_damage(path: Path, where: str) -> str | None:
    """Check a raw chunk file's trailing crc32c (little-endian, as zarr's codec writes it) against its data."""
    try:
        data = path.read_bytes()
    except OSError as e:
        return f"{where} is unreadable ({type(e).__name__}: {e})"
    body = np.frombuffer(data, dtype=np.uint8, count=len(data) - CHECKSUM_BYTES)
    if google_crc32c.extend(0, body) != int.from_bytes(data[-CHECKSUM_BYTES:], "little"):
        return f"{where} is unreadable ({CHECKSUM_MISMATCH})"
    return None


class ChunkFiles:
    """Reads chunk ``(i, 0, ...)`` files of the arrays under ``root``, keeping one descriptor per
    array's chunk directory ``name/c`` (closed by :meth:`close`, reopened on demand)."""

    def __init__(self, root: Path):
        self.root = root
        self._dir_fds: dict[str, int] = {}

    def _dir_fd(self, name: str) -> int:
        fd = self._dir_fds.get(name)
        if fd is None:
            fd = os.open(self.root / name / "c", os.O_RDONLY | os.O_DIRECTORY)  # FileNotFoundError
            self._dir_fds[name] = fd
        return fd

    def open(self, name: str, i: int, ndim: int) -> int:
        """A descriptor of block ``i``'s chunk of ``name``, an array whose blocks have ``ndim``
        dimensions. Raises FileNotFoundError when it is missing."""
        key = "/".join([str(i)] + ["0"] * ndim)  # chunk (i, 0, ...) of an array of ndim + 1 dims
        return os.open(key, os.O_RDONLY, dir_fd=self._dir_fd(name))

    @staticmethod
    def check_size(fd: int, chunk_bytes: int, where: Callable[[], Path]) -> None:
        """Raise ChunkDamageError unless the open chunk file ``fd`` is ``chunk_bytes`` + the checksum
        long (``where()``: its path, for the message)."""
        size = os.fstat(fd).st_size
        if size != chunk_bytes + CHECKSUM_BYTES:
            raise ChunkDamageError(f"{where()}: {size} bytes, expected {chunk_bytes + CHECKSUM_BYTES} "
                                   "(truncated or foreign chunk)")

    @staticmethod
    def read_at(fd: int, out: np.ndarray, offset: int, where: Callable[[], Path]) -> None:
        """Fill ``out`` (C-contiguous) from byte ``offset`` of the open chunk file ``fd`` (left open;
        ``where()``: its path, for the message).

        Raises:
            ChunkDamageError: a short read.
        """
        if out.nbytes and os.preadv(fd, [out], offset) != out.nbytes:
            raise ChunkDamageError(f"{where()}: short read at byte {offset} (file changed while read)")

    @staticmethod
    def read_checked(fd: int, out: np.ndarray, where: Callable[[], Path]) -> None:
        """Fill ``out`` (C-contiguous, the whole chunk: its ``nbytes`` are the chunk's data bytes) from the
        open chunk file ``fd`` (left open) with the 4 checksum bytes after it, in one ``preadv``, and
        check the crc32c (little-endian, as zarr's codec writes it) of those bytes.

        Raises:
            ChunkDamageError: the file is not ``out.nbytes`` + the checksum long, reads short, or its
                checksum does not match (:data:`CHECKSUM_MISMATCH`).
        """
        ChunkFiles.check_size(fd, out.nbytes, where)
        stored = bytearray(CHECKSUM_BYTES)
        if os.preadv(fd, [out, stored], 0) != out.nbytes + CHECKSUM_BYTES:
            raise ChunkDamageError(f"{where()}: short read (file changed while read)")
        if google_crc32c.value(out.reshape(-1).view(np.uint8)) != int.from_bytes(stored, "little"):
            raise ChunkDamageError(f"{where()}: {CHECKSUM_MISMATCH}")

    @staticmethod
    def check_crc(fd: int, chunk_bytes: int, where: Callable[[], Path]) -> None:
        """Check the crc32c of the open chunk file ``fd`` (``chunk_bytes`` of data + the checksum,
        left open), read in pieces of at most 8 MiB.

        Raises:
            ChunkDamageError: the file is not ``chunk_bytes`` + the checksum long, reads short, or its
                checksum does not match (:data:`CHECKSUM_MISMATCH`).
        """
        ChunkFiles.check_size(fd, chunk_bytes, where)
        buf = np.empty(min(chunk_bytes, _CRC_PIECE), dtype=np.uint8)
        crc, pos = 0, 0
        while pos < chunk_bytes:
            piece = buf[: min(len(buf), chunk_bytes - pos)]
            ChunkFiles.read_at(fd, piece, pos, where)
            crc = google_crc32c.extend(crc, piece)
            pos += len(piece)
        stored = os.pread(fd, CHECKSUM_BYTES, chunk_bytes)
        if len(stored) != CHECKSUM_BYTES:
            raise ChunkDamageError(f"{where()}: short read at byte {chunk_bytes} (file changed while read)")
        if crc != int.from_bytes(stored, "little"):
            raise ChunkDamageError(f"{where()}: {CHECKSUM_MISMATCH}")

    @staticmethod
    def identity(fd: int) -> tuple[int, ...]:
        """What tells a chunk file's bytes apart over time: ``(device, inode, size, mtime ns, ctime ns)``
        (any write or replacement of the file changes one of them)."""
        st = os.fstat(fd)
        return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns

    def close(self) -> None:
        """Close the chunk-directory descriptors."""
        fds, self._dir_fds = self._dir_fds, {}
        for fd in fds.values():
            os.close(fd)
