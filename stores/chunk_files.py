"""Raw chunk files of a local, uncompressed zarr v3 store (docs/design.md §7).

With no compressor but zarr's crc32c checksum codec, each chunk file is ``raw little-endian bytes
+ 4 checksum bytes``: it is read straight into a result array with ``preadv`` (each array's chunk
directory is opened once; a chunk costs openat + fstat + preadv + close) and its checksum is
checked without zarr.
"""

from __future__ import annotations

import os
from pathlib import Path

from typing import TYPE_CHECKING

import numpy as np
import torch
import zarr

from stores.errors import StoreFormatError
from stores.feature_schema import SEGMENTS, TOKEN_ARRAYS, ArraySpec, Block, decode_hidden, hidden_arrays

if TYPE_CHECKING:
    from stores.feature_store import FeatureStore

__all__ = ["CHECKSUM_BYTES", "ChunkFiles", "StoreFileReader", "raw_chunk_damage", "uncompressed"]

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
            size = os.fstat(fd).st_size
            if size != chunk_bytes + CHECKSUM_BYTES:
                raise StoreFormatError(f"{where}: {size} bytes, expected {chunk_bytes + CHECKSUM_BYTES} "
                                       "(truncated or foreign chunk; run `peagle-data verify`)")
            if out.nbytes and os.preadv(fd, [out], 0) != out.nbytes:
                raise StoreFormatError(f"{where}: short read (file changed while read)")
        finally:
            os.close(fd)

    def close(self) -> None:
        """Close the chunk-directory descriptors."""
        fds, self._dir_fds = self._dir_fds, {}
        for fd in fds.values():
            os.close(fd)


class StoreFileReader:
    """The ``file`` read path of a local uncompressed :class:`~stores.feature_store.FeatureStore`:
    each block's chunk files read straight into freshly allocated arrays (first T rows)."""

    def __init__(self, store: FeatureStore):
        self.store = store
        self.files = ChunkFiles(store._local_root)
        self._layout: list[tuple[ArraySpec, tuple[int, ...], int]] | None = None

    def read_tokens(self, i: int) -> dict[str, np.ndarray]:
        """Token arrays of block ``i`` from the chunk files: ``[T] int64`` each, ``cu_seqlens [S+1]``."""
        store = self.store
        T, C, width = store.n_tokens_of(i), store.block_size, int(store.attrs["max_segments"]) + 1
        out = {}
        for spec, n, full in [*((s, T, C) for s in TOKEN_ARRAYS), (SEGMENTS, width, width)]:
            a = np.empty(n, dtype=spec.dtype)  # numpy, not torch: a torch op costs several times more here
            self.pread(spec.name, i, 1, a, full * a.itemsize)
            out[spec.name] = a.astype(np.int64)
        cu = out[SEGMENTS.name]
        out[SEGMENTS.name] = cu[: int(np.argmax(cu == cu[-1])) + 1]  # drop the padding repeats
        return out

    def read_block(self, i: int, pin_memory: bool) -> Block:
        """Block ``i``; hidden states in page-locked memory with ``pin_memory`` (bf16 stores, CUDA present)."""
        tok = self.read_tokens(i)
        pin_memory = pin_memory and torch.cuda.is_available()
        T = len(tok["input_ids"])
        raw = {}
        for spec, shape, chunk_bytes in self._hidden_layout():
            if pin_memory and spec.dtype == "uint16":
                a = torch.empty((T, *shape[1:]), dtype=torch.uint16, pin_memory=True).numpy()
            else:
                a = np.empty((T, *shape[1:]), dtype=spec.dtype)
            self.pread(spec.name, i, len(shape), a, chunk_bytes)
            raw[spec.name] = a
        hidden = decode_hidden(self.store.storage_dtype, raw, copy=False)  # bf16 bit patterns viewed in place
        return Block(**{k: torch.from_numpy(v) for k, v in tok.items()}, **hidden)

    def _hidden_layout(self) -> list[tuple[ArraySpec, tuple[int, ...], int]]:
        """``(spec, block shape, chunk bytes)`` of each hidden array, computed once per store."""
        if self._layout is None:
            sizes = self.store.sizes()
            self._layout = [(s, s.block_shape(sizes), int(np.prod(s.block_shape(sizes))) * np.dtype(s.dtype).itemsize)
                            for s in hidden_arrays(self.store.storage_dtype)]
        return self._layout

    def pread(self, name: str, i: int, ndim: int, out: np.ndarray, chunk_bytes: int) -> None:
        """Fill ``out`` (C-contiguous) from the start of block ``i``'s chunk file of ``name``, an
        array whose blocks have ``ndim`` dimensions.

        Raises:
            StoreFormatError: the file is missing (a done block's missing chunk is damage), is not
                ``chunk_bytes`` + the checksum long, or reads short.
        """
        try:
            fd = self.files.open(name, i, ndim)
        except FileNotFoundError:
            self.store.check_chunks_exist(i)
            raise StoreFormatError(f"{self.store.chunk_path(name, i)}: chunk file is missing "
                                   "(run `peagle-data verify`)") from None
        ChunkFiles.read(fd, out, chunk_bytes, self.store.chunk_path(name, i))

    def close(self) -> None:
        """Close the chunk-directory descriptors (reopened on demand)."""
        self.files.close()
