"""The ``file`` read path of a local uncompressed feature store (docs/design.md §7): each block's chunk files read
straight into freshly allocated arrays, each chunk's crc32c checked
(:class:`stores.features.chunk_files.ChunkFiles`). Returns the same tensors as the zarr API."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from stores.errors import ChunkDamageError
from stores.features.chunk_files import ChunkFiles
from stores.features.feature_schema import (
    SEGMENTS,
    TOKEN_ARRAYS,
    ArraySpec,
    Block,
    decode_hidden,
    hidden_arrays,
)

__all__ = ["StoreFileReader"]


class StoreFileReader:
    """The ``file`` read path of a local uncompressed :class:`~stores.features.feature_store.FeatureStore`
    ``store`` whose chunk files lie under the directory ``root``: each block's chunk files read straight into
    freshly allocated arrays (first T rows)."""

    def __init__(self, store, root: Path):
        self.store = store
        self.files = ChunkFiles(root)
        self._layout: list[tuple[ArraySpec, tuple[int, ...], int]] | None = None
        self._checked: dict[tuple[str, int], tuple[int, ...]] = {}
        """``{(array, block): file identity}`` of the chunks :meth:`read_runs` checked whole."""

    def read_tokens(self, i: int) -> dict[str, np.ndarray]:
        """Token arrays of block ``i`` from the chunk files: ``[T] int64`` each, ``cu_seqlens [S+1]``
        (each chunk read whole and its crc32c checked: :meth:`pread`)."""
        store = self.store
        T, C, width = store.n_tokens_of(i), store.block_size, int(store.attrs["max_segments"]) + 1
        out = {}
        for spec, n, full in [*((s, T, C) for s in TOKEN_ARRAYS), (SEGMENTS, width, width)]:
            a = np.empty(full, dtype=spec.dtype)  # numpy, not torch: a torch op costs several times more here
            self.pread(spec.name, i, 1, a)  # the whole chunk: its crc32c covers every slot
            out[spec.name] = a[:n].astype(np.int64)
        cu = out[SEGMENTS.name]
        out[SEGMENTS.name] = cu[: int(np.argmax(cu == cu[-1])) + 1]  # drop the padding repeats
        return out

    def read_block(self, i: int, pin_memory: bool) -> Block:
        """Block ``i``; hidden states in page-locked memory with ``pin_memory`` (bf16 stores, CUDA present).

        Every chunk is read whole (``C`` slots) and its crc32c checked before any of it is returned;
        the hidden states are views of their first ``T`` slots."""
        tok = self.read_tokens(i)
        pin_memory = pin_memory and torch.cuda.is_available()
        T = len(tok["input_ids"])
        raw = {}
        for spec, shape, _ in self._hidden_layout():
            if pin_memory and spec.dtype == "uint16":
                a = torch.empty(shape, dtype=torch.uint16, pin_memory=True).numpy()
            else:
                a = np.empty(shape, dtype=spec.dtype)
            self.pread(spec.name, i, len(shape), a)
            raw[spec.name] = a[:T]
        hidden = decode_hidden(self.store.storage_dtype, raw, copy=False)  # bf16 bit patterns viewed in place
        return Block(**{k: torch.from_numpy(v) for k, v in tok.items()}, **hidden)

    def read_runs(self, runs: list[tuple[int, int, int]], pin_memory: bool) -> dict[str, torch.Tensor]:
        """:meth:`stores.features.feature_store.FeatureStore.read_runs` from the chunk files: each run one ``preadv`` at its slot's
        byte offset (each block's chunk file opened once and its size checked).

        A run reads a part of its chunk, and a crc32c covers the whole chunk: each chunk is checked
        whole (:meth:`stores.features.chunk_files.ChunkFiles.check_crc`) the first time this reader reads it and
        again whenever its file changes (:meth:`stores.features.chunk_files.ChunkFiles.identity`: inode, size,
        mtime, ctime), so reading a context block for every training block that views it costs one
        check per chunk, not one per view.

        Raises:
            StoreFormatError: a chunk file missing, of the wrong size, short, or failing its checksum,
                naming the context block and the file.
        """
        T = sum(n for _, _, n in runs)
        pin_memory = pin_memory and torch.cuda.is_available()
        raw = {}
        for spec, shape, chunk_bytes in self._hidden_layout():
            if pin_memory and spec.dtype == "uint16":
                a = torch.empty((T, *shape[1:]), dtype=torch.uint16, pin_memory=True).numpy()
            else:
                a = np.empty((T, *shape[1:]), dtype=spec.dtype)
            slot_bytes = chunk_bytes // shape[0]
            fds: dict[int, int] = {}
            pos = 0
            try:
                for m, s, n in runs:
                    def where(name=spec.name, m=m):  # the path only for a message: building it costs a small read
                        return self.store.chunk_path(name, m)
                    if m not in fds:
                        try:
                            fds[m] = self.files.open(spec.name, m, len(shape))
                        except FileNotFoundError:
                            raise ChunkDamageError(f"context block {m}: {where()}: chunk file is missing") from None
                        try:
                            ChunkFiles.check_size(fds[m], chunk_bytes, where)
                            key, identity = (spec.name, m), ChunkFiles.identity(fds[m])
                            if self._checked.get(key) != identity:
                                ChunkFiles.check_crc(fds[m], chunk_bytes, where)
                                self._checked[key] = identity
                        except ChunkDamageError as e:
                            raise ChunkDamageError(f"context block {m}: {e}") from None
                    ChunkFiles.read_at(fds[m], a[pos:pos + n], s * slot_bytes, where)
                    pos += n
            finally:
                for fd in fds.values():
                    os.close(fd)
            raw[spec.name] = a
        return decode_hidden(self.store.storage_dtype, raw, copy=False)

    def _hidden_layout(self) -> list[tuple[ArraySpec, tuple[int, ...], int]]:
        """``(spec, block shape, chunk bytes)`` of each hidden array, computed once per store."""
        if self._layout is None:
            sizes = self.store.sizes()
            self._layout = [(s, s.block_shape(sizes), int(np.prod(s.block_shape(sizes))) * np.dtype(s.dtype).itemsize)
                            for s in hidden_arrays(self.store.storage_dtype)]
        return self._layout

    def pread(self, name: str, i: int, ndim: int, out: np.ndarray) -> None:
        """Fill ``out`` (C-contiguous, the whole chunk) from block ``i``'s chunk file of ``name``, an
        array whose blocks have ``ndim`` dimensions, and check its crc32c
        (:meth:`stores.features.chunk_files.ChunkFiles.read_checked`).

        Raises:
            StoreFormatError: the file is missing (a done block's missing chunk is damage), is not
                ``out.nbytes`` + the checksum long, reads short or fails its checksum.
        """
        try:
            fd = self.files.open(name, i, ndim)
        except FileNotFoundError:
            self.store.check_chunks_exist(i)
            raise ChunkDamageError(f"{self.store.chunk_path(name, i)}: chunk file is missing") from None
        try:
            ChunkFiles.read_checked(fd, out, lambda: self.store.chunk_path(name, i))
        finally:
            os.close(fd)

    def close(self) -> None:
        """Close the chunk-directory descriptors (reopened on demand)."""
        self.files.close()
