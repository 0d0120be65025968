"""The feature store's schema as data (docs/design.md §7): one table of array specs, one block type.

Legend: N blocks, C ``block_size`` (tokens), T a block's ``n_tokens`` (≤ C), L aux layers, H hidden
size, W ``max_segments + 1`` (the ``cu_seqlens`` width), V verifier vocab, S segments in a block.

:data:`ARRAYS` lists every array of a store once (zarr's metadata-as-frozen-dataclasses style):
:meth:`stores.features.feature_store.FeatureStore.create` creates them, the writers pad and write them, the
readers read them back into a :class:`Block`, and ``verify`` checks their shapes and dtypes, all by
iterating this table. A new per-token array is one :class:`ArraySpec` entry with role ``"token"``
plus its :class:`Block` field; extraction (``FeatureStore.write_token_row``) copies it from the packed row of the same name (a column
of :data:`stores.tables.token_tables.PACKED_SCHEMA` / :class:`stores.tables.token_rows.PackedRow`, made by
:func:`peagle_data.prepare.packing.make_packed_row`).

Hidden states are stored as the uint16 bit patterns of bf16 (zarr has no bfloat16) or, with
``storage_dtype="fp8"``, as float8_e4m3fn codes with one float32 scale per vector.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import shutil
from pathlib import Path

import numpy as np
import torch
import zarr
import zarr.errors
from zarr.codecs import BytesCodec, Crc32cCodec, ZstdCodec

from stores.errors import OutputExistsError
from stores.files import is_local
from stores.staging import check_replaceable

__all__ = [
    "STORAGE_DTYPES",
    "ArraySpec",
    "ARRAYS",
    "TOKEN_ARRAYS",
    "VIEW_FIELDS",
    "WINDOW_VIEWS",
    "WINDOW_ARRAYS",
    "SEGMENT_KEYS",
    "Block",
    "store_arrays",
    "block_arrays",
    "hidden_arrays",
    "array_ndim",
    "bytes_per_token",
    "dim_sizes",
    "create_arrays",
    "new_group",
    "bf16_to_uint16",
    "uint16_to_bf16",
    "quantize_fp8",
    "dequantize_fp8",
    "encode_hidden",
    "decode_hidden",
]

STORAGE_DTYPES = ("bf16", "fp8")
FP8_MAX = 448.0  # largest finite float8_e4m3fn
ROLES = ("token", "segments", "hidden", "flag", "shared", "views")


@dataclass(frozen=True)
class ArraySpec:
    """One array of a feature store.

    Attributes:
        name: the zarr array name (and, for role ``"token"``, the :class:`Block` field).
        dtype: the stored numpy dtype.
        dims: the array's dimensions as symbols of the legend (``("N", "C")``: one row of C per block).
        chunking: ``"block"``: one chunk per block (chunks ``(1, *dims[1:])``, so two writers never
            touch one chunk); ``"whole"``: the whole array is one chunk.
        role: ``"token"`` per-token values of a block, padded to C (read back as ``[T] int64``);
            ``"segments"`` ``cu_seqlens`` padded to W with its last value; ``"hidden"`` hidden states
            (or their fp8 scales); ``"flag"`` the ``done`` flag; ``"shared"`` one array for the store;
            ``"views"`` where a window store's segments read their features (:data:`WINDOW_VIEWS`).
        storage: the ``storage_dtype`` the array belongs to; None: every store has it.
    """

    name: str
    dtype: str
    dims: tuple[str, ...]
    chunking: str
    role: str
    storage: str | None = None

    def __post_init__(self) -> None:
        if self.chunking not in ("block", "whole") or self.role not in ROLES:
            raise ValueError(f"{self.name}: chunking {self.chunking!r}, role {self.role!r}")

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """The array's shape for ``sizes`` (symbol -> size)."""
        return tuple(int(sizes[d]) for d in self.dims)

    def block_shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """One block's row (the shape after the leading N) of a ``"block"``-chunked array."""
        return tuple(int(sizes[d]) for d in self.dims[1:])

    def chunks(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        """The chunk shape: ``(1, *block_shape)``, or the whole array (at least 1 element)."""
        if self.chunking == "block":
            return (1, *self.block_shape(sizes))
        return tuple(max(n, 1) for n in self.shape(sizes))


ARRAYS: tuple[ArraySpec, ...] = (
    ArraySpec("input_ids", "int32", ("N", "C"), "block", "token"),
    ArraySpec("loss_mask", "uint8", ("N", "C"), "block", "token"),
    ArraySpec("position_ids", "int32", ("N", "C"), "block", "token"),
    ArraySpec("n_tokens", "int32", ("N",), "whole", "shared"),
    ArraySpec("cu_seqlens", "int32", ("N", "W"), "block", "segments"),
    ArraySpec("aux_hidden", "uint16", ("N", "C", "L", "H"), "block", "hidden", storage="bf16"),
    ArraySpec("final_hidden", "uint16", ("N", "C", "H"), "block", "hidden", storage="bf16"),
    ArraySpec("aux_hidden", "uint8", ("N", "C", "L", "H"), "block", "hidden", storage="fp8"),
    ArraySpec("aux_scale", "float32", ("N", "C", "L"), "block", "hidden", storage="fp8"),
    ArraySpec("final_hidden", "uint8", ("N", "C", "H"), "block", "hidden", storage="fp8"),
    ArraySpec("final_scale", "float32", ("N", "C"), "block", "hidden", storage="fp8"),
    ArraySpec("done", "uint8", ("N",), "block", "flag"),
    ArraySpec("token_freq", "int64", ("V",), "whole", "shared"),
)
"""Every array of a store, in creation order."""

TOKEN_ARRAYS: tuple[ArraySpec, ...] = tuple(s for s in ARRAYS if s.role == "token")
SEGMENTS = next(s for s in ARRAYS if s.role == "segments")

VIEW_FIELDS = ("context_block", "prefix_slot", "prefix_len", "body_slot")
"""The four int32 of a segment's view (docs/design.md §7, full-context stores): segment token
``j < prefix_len`` reads context-grid block ``context_block`` at slot ``prefix_slot + j``, token
``j >= prefix_len`` at slot ``body_slot + j - prefix_len``."""

WINDOW_VIEWS = ArraySpec("window_views", "int32", ("N", "S", "F"), "block", "views")
"""``[N, S_max, 4]``: the view of each segment of a training block (:data:`VIEW_FIELDS`); rows past a
block's segments are -1."""

WINDOW_ARRAYS: tuple[ArraySpec, ...] = (
    *(s for s in ARRAYS if s.role in ("token", "segments") or s.name == "n_tokens"),
    WINDOW_VIEWS,
    next(s for s in ARRAYS if s.name == "token_freq"),
)
"""The arrays at the root of a full-context store (``layout: "windows"``): the training blocks' token
arrays and their views into the ``contexts`` sub-store, which holds :data:`ARRAYS` for the context
blocks the verifier ran."""


SEGMENT_KEYS = ArraySpec("segment_keys", "int64", ("N", "S"), "whole", "shared")
"""``[N, S_max]``: the content key of each training segment's conversation (the packed table's
``segment_keys``, docs/design.md §6), a short row padded by repeating its last key; one chunk, written
with the token arrays from the packed rows. Training groups blocks that share a key on one side of the
validation split (§8). Made at the root of every store since peagle recorded it (attribute
``segment_keys: true`` once written); absent from older stores and from a ``contexts`` sub-store."""


def store_arrays(storage_dtype: str) -> tuple[ArraySpec, ...]:
    """The arrays of a store with ``storage_dtype``, in creation order."""
    if storage_dtype not in STORAGE_DTYPES:
        raise ValueError(f"--storage-dtype {storage_dtype!r}: expected one of {STORAGE_DTYPES}")
    return tuple(s for s in ARRAYS if s.storage in (None, storage_dtype))


def hidden_arrays(storage_dtype: str) -> tuple[ArraySpec, ...]:
    """The hidden-state arrays (and fp8 scales) of a store with ``storage_dtype``."""
    return tuple(s for s in store_arrays(storage_dtype) if s.role == "hidden")


def block_arrays(storage_dtype: str) -> list[str]:
    """Names of the arrays holding one chunk per block of data (the ``done`` flag excluded)."""
    return [s.name for s in store_arrays(storage_dtype) if s.chunking == "block" and s.role != "flag"]


def array_ndim(name: str) -> int:
    """Dimensions of array ``name`` (chunk keys are ``c/i/0/...``); the same for every storage dtype."""
    return next(len(s.dims) for s in (*ARRAYS, WINDOW_VIEWS, SEGMENT_KEYS) if s.name == name)


def dim_sizes(n_blocks: int, block_size: int, max_segments: int, n_layers: int, hidden_size: int,
              vocab_size: int) -> dict[str, int]:
    """The sizes of the dimension symbols of :class:`ArraySpec` for a store."""
    return {"N": n_blocks, "C": block_size, "W": max_segments + 1, "S": max_segments, "F": len(VIEW_FIELDS),
            "L": n_layers, "H": hidden_size, "V": vocab_size}


def create_arrays(group: zarr.Group, specs: tuple[ArraySpec, ...], sizes: dict[str, int],
                  compressor: str | None) -> None:
    """Create every array of ``specs``: raw little-endian bytes, optional zstd, a crc32c checksum,
    fill value 0, and every chunk written even when it holds only zeros."""
    codecs = ([ZstdCodec(level=3)] if compressor == "zstd" else []) + [Crc32cCodec()]
    raw = dict(serializer=BytesCodec(endian="little"), compressors=codecs,
               fill_value=0, config={"write_empty_chunks": True})
    for spec in specs:
        group.create_array(spec.name, shape=spec.shape(sizes), chunks=spec.chunks(sizes), dtype=spec.dtype, **raw)


def new_group(path: str, force: bool) -> zarr.Group:
    """An empty zarr group at ``path``: an existing local store is removed with ``force`` when it is peagle's
    (:func:`stores.staging.check_replaceable`).

    Raises:
        OutputExistsError: ``path`` exists and ``force`` is false.
        ForeignFilesError: ``path`` holds files peagle did not write (also with ``force``).
    """
    if is_local(path) and Path(path).exists():
        if check_replaceable(path, force, "pass --resume to continue it or --force to overwrite it"):
            shutil.rmtree(path) if Path(path).is_dir() and not Path(path).is_symlink() else Path(path).unlink()
    try:
        return zarr.open_group(path, mode="w" if force or is_local(path) else "w-")
    except (FileExistsError, zarr.errors.ContainsGroupError, zarr.errors.ContainsArrayError) as e:
        raise OutputExistsError(path, "pass --resume to continue it or --force to overwrite it") from e


def bytes_per_token(n_layers: int, hidden_size: int, storage_dtype: str) -> int:
    """Stored bytes per token slot: hidden states (+ fp8 scales) and the per-token arrays."""
    sizes = {"C": 1, "L": n_layers, "H": hidden_size}
    return sum(math.prod(s.block_shape(sizes)) * np.dtype(s.dtype).itemsize
               for s in store_arrays(storage_dtype) if s.role in ("token", "hidden"))


@dataclass
class Block:
    """One block of a feature store (T = the block's ``n_tokens``): what the store reads and the
    trainer consumes.

    Attributes:
        input_ids: ``[T] int64``.
        loss_mask: ``[T] int64`` (0/1).
        position_ids: ``[T] int64``, restarting at 0 in every segment.
        cu_seqlens: ``[S+1] int64``, ``[0, len_0, ..., T]``.
        aux_hidden: ``[T, L, H] bfloat16`` as read from the store, verifier hidden states at the
            store's layers; ``[T, L*H]`` (layers concatenated) after :meth:`flat_layers`.
        final_hidden: ``[T, H] bfloat16``, the verifier's post-norm final hidden state.
        block_id: index in the store (-1 when unknown).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    aux_hidden: torch.Tensor
    final_hidden: torch.Tensor
    block_id: int = -1

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor field by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), torch.Tensor)}

    def to(self, device, non_blocking: bool = False) -> "Block":
        """A copy with every tensor on ``device``."""
        return dataclasses.replace(self, **{k: v.to(device, non_blocking=non_blocking)
                                            for k, v in self.tensors().items()})

    def flat_layers(self, block_id: int | None = None) -> "Block":
        """This block with ``aux_hidden [T, L*H]`` (a view), optionally with its ``block_id`` set."""
        T = self.aux_hidden.shape[0]
        return dataclasses.replace(self, aux_hidden=self.aux_hidden.reshape(T, -1),
                                   block_id=self.block_id if block_id is None else block_id)


# ------------------------------------------------------------------------------------ encodings
def bf16_to_uint16(t: torch.Tensor) -> np.ndarray:
    """bf16 tensor -> numpy uint16 bit patterns (bit-exact; never through float16)."""
    if t.dtype != torch.bfloat16:
        raise TypeError(f"expected a bfloat16 tensor, got {t.dtype}")
    return t.detach().contiguous().cpu().view(torch.uint16).numpy()


def uint16_to_bf16(a: np.ndarray) -> torch.Tensor:
    """numpy uint16 bit patterns -> bf16 tensor (copies, so the result owns its memory)."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.uint16).copy()).view(torch.bfloat16)


def quantize_fp8(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Per-vector float8_e4m3fn quantisation over the last dim.

    Args:
        x: ``[..., H]`` any float dtype.

    Returns:
        ``(codes [..., H] uint8`` (float8_e4m3fn bit patterns), ``scale [...] float32)`` with
        ``x ≈ codes.float() * scale``; an all-zero vector gets scale 1.
    """
    xf = x.detach().float().cpu()
    amax = xf.abs().amax(dim=-1)  # [...]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(torch.uint8).numpy(), scale.numpy()


def dequantize_fp8(codes: np.ndarray, scale: np.ndarray) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``[..., H] uint8`` and ``[...] float32`` -> ``[..., H] bf16``."""
    q = torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8).copy()).view(torch.float8_e4m3fn)
    s = torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).copy())
    return (q.float() * s[..., None]).to(torch.bfloat16)


def encode_hidden(storage_dtype: str, aux_hidden: torch.Tensor, final_hidden: torch.Tensor) -> dict[str, np.ndarray]:
    """``aux_hidden [T, L, H]``, ``final_hidden [T, H]`` (bf16) -> the stored arrays of
    :func:`hidden_arrays` by name (``[T, ...]`` each)."""
    if storage_dtype == "bf16":
        return {"aux_hidden": bf16_to_uint16(aux_hidden), "final_hidden": bf16_to_uint16(final_hidden)}
    encoded = {}
    encoded["aux_hidden"], encoded["aux_scale"] = quantize_fp8(aux_hidden)
    encoded["final_hidden"], encoded["final_scale"] = quantize_fp8(final_hidden)
    return encoded


def decode_hidden(storage_dtype: str, raw: Mapping[str, np.ndarray], copy: bool = True) -> dict[str, torch.Tensor]:
    """Inverse of :func:`encode_hidden`: ``{"aux_hidden": [T, L, H], "final_hidden": [T, H]}`` bf16.

    ``copy=False`` views bf16 bit patterns in place (the arrays must then be C-contiguous uint16).
    """
    if storage_dtype == "bf16":
        view = uint16_to_bf16 if copy else (lambda a: torch.from_numpy(a).view(torch.bfloat16))
        return {n: view(raw[n]) for n in ("aux_hidden", "final_hidden")}
    return {"aux_hidden": dequantize_fp8(raw["aux_hidden"], raw["aux_scale"]),
            "final_hidden": dequantize_fp8(raw["final_hidden"], raw["final_scale"])}
