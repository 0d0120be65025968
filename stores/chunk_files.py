"""Raw chunk files of a local, uncompressed zarr v3 store (docs/design.md §7).

With no compressor but zarr's crc32c checksum codec, each chunk file is ``raw little-endian bytes
+ 4 checksum bytes``: it is read straight into a result array with ``preadv`` (each array's chunk
directory is opened once; a chunk costs openat + fstat + preadv + close) and its checksum is
checked without zarr.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import zarr

from stores.errors import StoreFormatError

__all__ = ["CHECKSUM_BYTES", "ChunkFiles", "raw_chunk_damage", "uncompressed"]

CHECKSUM_BYTES = 4  # crc32c codec appends 4 bytes to each chunk


def uncompressed(array: zarr.Array) -> bool:
    """Whether ``array``'s chunks are raw bytes (optionally + crc32c): readable as files."""
    codecs = array.metadata.to_dict().get("codecs", [])
    names = [c["name"] if isinstance(c, dict) else getattr(c, "name", "") for c in codecs]
    return names in (["bytes"], ["bytes", "crc32c"])


def raw_chunk_damage(path: Path, where: str) -> str | None:
    """Check a raw chunk file's trailing crc32c (little-endian, as zarr's codec writes it) against its data."""
    import google_crc32c  # zarr's own crc32c dependency

    try:
        data = path.read_bytes()
    except OSError as e:
        return f"{where} is unreadable ({type(e).__name__}: {e})"
    body = np.frombuffer(data, dtype=np.uint8, count=len(data) - CHECKSUM_BYTES)
    if google_crc32c.extend(0, body) != int.from_bytes(data[-CHECKSUM_BYTES:], "little"):
        return f"{where} is unreadable (its checksum does not match its data)"
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
    def read(fd: int, out: np.ndarray, chunk_bytes: int, where: Path) -> None:
        """Fill ``out`` (C-contiguous) from the start of the open chunk file ``fd`` (closed after).

        Raises:
            StoreFormatError: the file is not ``chunk_bytes`` + the checksum long, or reads short.
        """
        try:
            ChunkFiles.check_size(fd, chunk_bytes, where)
            ChunkFiles.read_at(fd, out, 0, where)
        finally:
            os.close(fd)

    @staticmethod
    def check_size(fd: int, chunk_bytes: int, where: Path) -> None:
        """Raise StoreFormatError unless the open chunk file ``fd`` is ``chunk_bytes`` + the checksum long."""
        size = os.fstat(fd).st_size
        if size != chunk_bytes + CHECKSUM_BYTES:
            raise StoreFormatError(f"{where}: {size} bytes, expected {chunk_bytes + CHECKSUM_BYTES} "
                                   "(truncated or foreign chunk; run `peagle-data verify`)")

    @staticmethod
    def read_at(fd: int, out: np.ndarray, offset: int, where: Path) -> None:
        """Fill ``out`` (C-contiguous) from byte ``offset`` of the open chunk file ``fd`` (left open).

        Raises:
            StoreFormatError: a short read.
        """
        if out.nbytes and os.preadv(fd, [out], offset) != out.nbytes:
            raise StoreFormatError(f"{where}: short read at byte {offset} (file changed while read)")

    def close(self) -> None:
        """Close the chunk-directory descriptors."""
        fds, self._dir_fds = self._dir_fds, {}
        for fd in fds.values():
            os.close(fd)
