"""The zarr v3 feature store (docs/design.md §7): one type per layout, opened by :func:`open_store`
(:meth:`FeatureStore.open`), which reads ``format_version`` and ``layout`` from the attributes.

- :class:`BlockStore` (format 1, ``layout: "blocks"``, ``extract --context window``): its blocks are the packed
  table's blocks, each extracted as it is.
- :class:`FullContextStore` (format 2, ``layout: "windows"``, ``extract --context full``): its training blocks
  hold token arrays and, per segment, a view into the :class:`ContextBlocks` of its ``contexts`` sub-store
  (``layout: "contexts"``), whose blocks are the whole conversations the verifier ran.

Callers ask the type (:attr:`FeatureStore.context`, :attr:`FeatureStore.has_views`,
:attr:`FeatureStore.contexts`, :attr:`FeatureStore.verifier_blocks`), never the layout string.

Legend: N blocks, C ``block_size`` (tokens), T a block's ``n_tokens`` (≤ C), L aux layers,
H hidden size, S segments in a block.

The arrays are those of the schema table :data:`stores.features.feature_schema.ARRAYS`; create, write,
read and verify (:mod:`stores.features.feature_repair`) all iterate it. One block is one chunk row of every
per-block array, so two writers never touch one chunk. A block's ``done`` flag is written only
after its data. Hidden states have no compressor but a crc32c checksum codec, so each chunk file of
a local store is read straight into the result tensors (the ``file`` path,
:class:`stores.features.file_reader.StoreFileReader`); any other store (compressed, remote) is read through the
zarr API. Both paths return identical tensors.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any, ClassVar, Mapping

import numpy as np
import torch
import zarr
import zarr.errors

from stores.features.chunk_files import uncompressed
from stores.errors import ChunkDamageError, StoreFormatError
from stores.features.feature_schema import (
    SEGMENT_KEYS,
    SEGMENTS,
    STORAGE_DTYPES,
    TOKEN_ARRAYS,
    VIEW_FIELDS,
    WINDOW_ARRAYS,
    WINDOW_VIEWS,
    ArraySpec,
    Block,
    array_ndim,
    block_arrays,
    bytes_per_token,
    create_arrays,
    new_group,
    decode_hidden,
    dim_sizes,
    encode_hidden,
    hidden_arrays,
    store_arrays,
)
from stores.features.file_reader import StoreFileReader
from stores.files import is_local, is_zarr_store
from stores.tables.token_tables import not_a_store_hint

__all__ = [
    "FORMAT_VERSION",
    "WINDOWS_FORMAT_VERSION",
    "CONTEXTS",
    "STORAGE_DTYPES",
    "Block",
    "FeatureStore",
    "BlockStore",
    "FullContextStore",
    "ContextBlocks",
    "open_store",
    "StoreFileReader",
    "bytes_per_token",
    "LAYER_CONVENTION",
    "check_layer_convention",
]

FORMAT_VERSION = 1
"""The format of a store whose blocks are the packed table's blocks, each extracted as it is
(``layout: "blocks"``, ``extract --context window``)."""

WINDOWS_FORMAT_VERSION = 2
"""The format of a full-context store (``extract --context full``): the root holds the training
blocks' token arrays and, per segment, a view into the ``contexts`` sub-store, whose blocks are the
whole conversations the verifier ran (``layout: "windows"`` at the root, ``"contexts"`` below)."""

CONTEXTS = "contexts"
"""The sub-store of a full-context store."""

LAYER_CONVENTION = "vllm_aux"
"""The ``layer_convention`` attribute of a store made now: aux layer 0 is the embedding output, layer
l ≥ 1 the output of decoder layer l-1, so layer L (the verifier's number of decoder layers) is the
last layer's output **before** the final norm, as vLLM captures it for EAGLE-3 drafters
(``hidden_states + residual``). The ``final_hidden`` array is after the final norm (``final:
"post_norm"``). Stores made before had ``"hf_hidden_states"``, where layer L was the normed state."""

_LEGACY_CONVENTION = "hf_hidden_states"
_ZARR_TEMP = re.compile(r"\.[0-9a-f]{32}\.partial")
"""The tail zarr's local store gives a file while it writes it (``NAME.<uuid4 hex>.partial``, renamed to ``NAME``
when the write ends; zarr 3.1 ``storage/_local.py``): a write killed by SIGKILL leaves it behind."""


def check_layer_convention(attrs: Mapping[str, Any], path: str) -> None:
    """Refuse a store whose aux layers are not what vLLM feeds a drafter (see :data:`LAYER_CONVENTION`).

    A store of the old ``hf_hidden_states`` convention holds the same values for every layer below L,
    so it passes unless its layers include L (the normed final state there, the un-normed one in vLLM:
    a drafter trained on it would lose most of its accepted drafts when served).

    Raises:
        StoreFormatError: naming the store, the layer and the command that re-extracts it.
    """
    convention = attrs.get("layer_convention")
    layers = list(attrs.get("layers") or [])
    L = (attrs.get("verifier") or {}).get("num_hidden_layers")
    if convention == LAYER_CONVENTION:
        return
    if convention == _LEGACY_CONVENTION and L is not None and int(L) not in layers:
        return
    if convention == _LEGACY_CONVENTION:
        verifier = (attrs.get("verifier") or {}).get("name_or_path", "VERIFIER")
        L = "L (the verifier's layer count, not recorded)" if L is None else L
        raise StoreFormatError(
            f"{path}: aux layer {L} of this store is the verifier's final normed state (stored by peagle "
            f"before layer {L} meant what vLLM feeds a drafter: the last decoder layer's output before the "
            "final norm); a drafter trained on it would draft from another feature when served. Re-extract "
            f"it: peagle-data extract PACKED --verifier {verifier} --layers {','.join(map(str, layers))} "
            "--output NEW_STORE")
    raise StoreFormatError(f"{path}: unknown layer_convention {convention!r} (expected {LAYER_CONVENTION!r}); "
                           "made by another tool or a newer peagle?")


class FeatureStore:
    """A peagle feature store: one zarr v3 group with the arrays and attributes of docs/design.md §7.

    The base of the layout types :class:`BlockStore`, :class:`FullContextStore` and :class:`ContextBlocks`: open an
    existing store with :meth:`open` (:func:`open_store`), which returns the type of its layout; make a new one
    with :meth:`BlockStore.create` or :meth:`FullContextStore.create` (:meth:`create` and :meth:`create_windows`
    here forward to them). What callers ask of a store's layout are attributes: :attr:`context`,
    :attr:`has_views`, :attr:`contexts`, :attr:`verifier_blocks`.
    """

    layout: ClassVar[str] = ""
    """The type's ``layout`` attribute on disk: ``"blocks"``, ``"windows"`` (a full-context store's root) or
    ``"contexts"`` (its sub-store); tests of the format read it, callers ask the attributes below."""
    format_version: ClassVar[int] = 0
    """The type's ``format_version`` attribute on disk."""
    context: ClassVar[str] = "window"
    """The ``--context`` the store was extracted with, as the CLI spells it: ``"window"`` or ``"full"``."""
    has_views: ClassVar[bool] = False
    """Whether the blocks are training blocks whose segments are views into context blocks (a full-context
    store's root): their done state, hidden states and damage are those of the context blocks they read."""
    holds_segments: ClassVar[bool] = True
    """Whether the blocks hold the packed table's segments (false for context blocks: whole conversations)."""
    block_word: ClassVar[str] = "block"
    """What a block is called in a message."""
    contexts: FeatureStore | None = None
    """A full-context store's sub-store of context blocks (None for other layouts)."""

    def __init__(self, group: zarr.Group, path: str):
        """Open ``group`` as this type (use :meth:`open` or :meth:`of_group`, which pick the type).

        Raises:
            StoreFormatError: not a peagle store, or its ``format_version`` and ``layout`` are not this type's.
        """
        self.group = group
        self.path = path
        attrs = _peagle_attrs(group, path)
        if _layout_key(attrs) != (self.format_version, self.layout):
            raise StoreFormatError(f"{path}: format_version {attrs.get('format_version')!r} layout "
                                   f"{_layout_key(attrs)[1]!r} is not a {type(self).__name__}")
        self.attrs: dict[str, Any] = attrs
        self._local_root = Path(path) if is_local(path) else None
        self.raw_chunks = self._has_raw_chunks()
        """Chunk files readable directly (the ``file`` read path)."""
        self._n_tokens_cache: np.ndarray | None = None
        self._array_cache: dict[str, zarr.Array] = {}
        self._files = StoreFileReader(self, self._local_root) if self.raw_chunks else None

    def _has_raw_chunks(self) -> bool:
        return self._local_root is not None and uncompressed(self.group["aux_hidden"])

    @property
    def verifier_blocks(self) -> FeatureStore:
        """The store whose blocks the verifier runs (extracts, marks done, repairs, evicts): a full-context
        store's :attr:`contexts`, else the store itself."""
        return self

    # ---------------------------------------------------------------- properties
    @property
    def n_blocks(self) -> int:
        return int(self.attrs["n_blocks"])

    @property
    def block_size(self) -> int:
        return int(self.attrs["block_size"])

    @property
    def layers(self) -> list[int]:
        return list(self.attrs["layers"])

    @property
    def hidden_size(self) -> int:
        return int(self.attrs["verifier"]["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.attrs["verifier"]["vocab_size"])

    @property
    def n_tokens(self) -> int:
        return int(self.attrs["n_tokens"])

    @property
    def storage_dtype(self) -> str:
        return str(self.attrs["storage_dtype"])

    def sizes(self) -> dict[str, int]:
        """The sizes of the schema's dimension symbols (:class:`stores.features.feature_schema.ArraySpec`)."""
        return dim_sizes(self.n_blocks, self.block_size, int(self.attrs["max_segments"]), len(self.layers),
                      self.hidden_size, self.vocab_size)

    def array(self, name: str) -> zarr.Array:
        """Array ``name``, opened once per store (opening reads its metadata)."""
        if name not in self._array_cache:
            self._array_cache[name] = self.group[name]
        return self._array_cache[name]

    def bytes_per_token(self) -> int:
        """Stored bytes per token slot (hidden states + token arrays), excluding checksums."""
        return bytes_per_token(len(self.layers), self.hidden_size, self.storage_dtype)

    # ---------------------------------------------------------------- create / open
    @classmethod
    def open(cls, path: str | os.PathLike, mode: str = "r") -> FeatureStore:
        """Open a store (``mode`` ``"r"`` or ``"r+"``) as the type of its layout (:meth:`of_group`).

        Raises:
            StoreFormatError: missing, not a zarr group, not a peagle store, unknown version, a full-context
                store's ``contexts`` sub-store, or (called on a layout type) a store of another layout.
        """
        path = str(path)
        if path.startswith("file://"):
            path = path[len("file://"):]
        if is_local(path) and not is_zarr_store(path):
            raise StoreFormatError(not_a_store_hint(path) or f"{path}: no feature store here (no zarr.json)")
        try:
            group = zarr.open_group(path, mode=mode)
        except Exception as e:  # zarr raises several types for a bad path
            raise StoreFormatError(f"{path}: cannot open as a zarr v3 group ({e})") from e
        store = FeatureStore.of_group(group, path)
        store._refuse_opened_alone()
        if not isinstance(store, cls):
            raise StoreFormatError(f"{path}: a --context {store.context} store ({type(store).__name__}), "
                                   f"not a {cls.__name__}")
        return store

    @staticmethod
    def of_group(group: zarr.Group, path: str) -> FeatureStore:
        """``group`` opened as the type its ``format_version`` and ``layout`` attributes name.

        Raises:
            StoreFormatError: not a peagle store, or a version and layout this peagle does not read.
        """
        attrs = _peagle_attrs(group, path)
        kind = LAYOUT_TYPES.get(_layout_key(attrs))
        if kind is None:
            raise StoreFormatError(
                f"{path}: feature store format_version {attrs.get('format_version')!r} (layout "
                f"{_layout_key(attrs)[1]!r}); this peagle reads {FORMAT_VERSION} (window-context stores) and "
                f"{WINDOWS_FORMAT_VERSION} (full-context stores): made by a newer peagle?")
        return kind(group, path)

    def _refuse_opened_alone(self) -> None:
        """Raise StoreFormatError where this store is part of another (:meth:`open` of a sub-store)."""

    @classmethod
    def create(cls, path: str | os.PathLike, **kwargs: Any) -> BlockStore:
        """:meth:`BlockStore.create` (a ``--context window`` store)."""
        return BlockStore.create(path, **kwargs)

    @classmethod
    def create_windows(cls, path: str | os.PathLike, **kwargs: Any) -> FullContextStore:
        """:meth:`FullContextStore.create` (a ``--context full`` store)."""
        return FullContextStore.create(path, **kwargs)

    def update_attrs(self, **values: Any) -> None:
        """Merge values into the ``peagle`` attributes (a full-context store's: also its sub-store's,
        :meth:`FullContextStore.update_attrs`)."""
        self.attrs = {**self.attrs, **values}
        self.group.attrs["peagle"] = self.attrs

    def views(self) -> np.ndarray:
        """A full-context store's segment views (:meth:`FullContextStore.views`).

        Raises:
            StoreFormatError: not a full-context store.
        """
        raise StoreFormatError(f"{self.path}: a {self.layout} store has no segment views")

    def view_row(self, i: int) -> np.ndarray:
        """A full-context store's views of block ``i`` (:meth:`FullContextStore.view_row`).

        Raises:
            StoreFormatError: not a full-context store.
        """
        return self.views()[i]

    def whole_conversations(self, i: int, cu_seqlens) -> np.ndarray | None:
        """None: the conversations of a store's segments are recorded only in a full-context store
        (:meth:`FullContextStore.whole_conversations`)."""
        return None

    # ---------------------------------------------------------------- writes
    def _writable(self, name: str) -> zarr.Array:
        """Array ``name`` configured to write every chunk, all-fill-value ones included: zarr keeps
        ``write_empty_chunks`` per array object, not in the store, so ``group[name]`` would skip an
        all-zero chunk (a loss_mask of zeros, a one-token block's position_ids) and a done block
        would read as damaged."""
        return self.group[name].with_config({"write_empty_chunks": True})

    def write_tokens(self, i: int, input_ids, loss_mask, position_ids, cu_seqlens) -> None:
        """:meth:`write_token_row` of block ``i`` from its arrays (``[T]`` each; ``cu_seqlens [S+1]``)."""
        self.write_token_row(i, {"input_ids": input_ids, "loss_mask": loss_mask, "position_ids": position_ids,
                                 "cu_seqlens": cu_seqlens})

    def write_token_row(self, i: int, values: Mapping[str, Any]) -> None:
        """Write block ``i``'s token arrays, padded to C: ``values`` maps every per-token array of the
        schema (:data:`~stores.features.feature_schema.TOKEN_ARRAYS`, ``[T]`` each) and ``cu_seqlens [S+1]``
        (a packed row, or :meth:`read_tokens`)."""
        T = len(values[TOKEN_ARRAYS[0].name])
        C = self.block_size
        if T > C:
            raise ValueError(f"block {i}: {T} tokens > block_size {C}")
        for spec in TOKEN_ARRAYS:
            row = np.zeros(C, dtype=spec.dtype)
            row[:T] = np.asarray(values[spec.name], dtype=spec.dtype)
            self._writable(spec.name)[i] = row
        cu = np.asarray(values[SEGMENTS.name], dtype=np.int32)
        width = int(self.attrs["max_segments"]) + 1
        if len(cu) > width:
            raise ValueError(f"block {i}: {len(cu) - 1} segments > max_segments {width - 1}")
        self._writable("cu_seqlens")[i] = np.concatenate([cu, np.full(width - len(cu), cu[-1], np.int32)])

    def write_all_n_tokens(self, n_tokens: np.ndarray) -> None:
        """Write the ``n_tokens [N] int32`` array in one go (it is a single chunk)."""
        self._writable("n_tokens")[:] = np.asarray(n_tokens, dtype=np.int32)

    def write_features(self, i: int, aux_hidden: torch.Tensor, final_hidden: torch.Tensor) -> None:
        """Write block ``i``'s hidden states.

        Args:
            aux_hidden: ``[T, L, H] bfloat16``; final_hidden: ``[T, H] bfloat16``.
        """
        T = aux_hidden.shape[0]
        L, H = len(self.layers), self.hidden_size
        if tuple(aux_hidden.shape[1:]) != (L, H) or tuple(final_hidden.shape) != (T, H):
            raise ValueError(f"block {i}: got aux {tuple(aux_hidden.shape)}, final {tuple(final_hidden.shape)}; "
                             f"expected [T, {L}, {H}] and [T, {H}]")
        encoded = encode_hidden(self.storage_dtype, aux_hidden, final_hidden)
        for spec in hidden_arrays(self.storage_dtype):
            row = np.zeros(spec.block_shape(self.sizes()), dtype=spec.dtype)
            row[:T] = encoded[spec.name]
            self._writable(spec.name)[i] = row

    def mark_done(self, i: int) -> None:
        """Set block ``i``'s done flag; call only after its data is written."""
        self._writable("done")[i] = 1

    def clear_done(self, i: int) -> None:
        """Clear block ``i``'s done flag (rewriting its flag chunk, damaged or not): it is extracted again.

        In a local store, block ``i``'s chunks are removed first (a damaged chunk may be a directory
        or a file that cannot be replaced); the block's data must then be written again.
        """
        if self._local_root is not None:
            for name in [*self.block_arrays(), "done"]:
                path = self.chunk_path(name, i)
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                elif path.exists() or path.is_symlink():
                    path.unlink()
        self.group["done"][i] = 0

    def is_done(self, i: int) -> bool:
        """Block ``i``'s done flag, read now from the store (not cached: another process may set or clear it); a
        full-context store's training block: whether every context block its views read is done."""
        return bool(self.group["done"][i])

    def write_leftovers(self, blocks) -> list[Path]:
        """zarr's temporary files of the chunks of ``blocks`` (every per-block array and the done flags) that a
        killed write left behind (:data:`_ZARR_TEMP`); none for a remote store. Only the writer of a block may
        remove them, and only while the block is not done: a live write of the flag of a done block (a trainer
        evicting it) has its temporary file while the flag still reads done. Lists each block's chunk directory
        and the flags' directory once."""
        if self._local_root is None:
            return []
        blocks = {int(i) for i in blocks}
        found = []
        for name in self.block_arrays():
            for i in blocks:
                path = self.chunk_path(name, i)
                if path.parent.is_dir():
                    found += [p for p in path.parent.glob(f"{path.name}.*.partial")
                              if _ZARR_TEMP.fullmatch(p.name[len(path.name):])]
        flags = self._local_root / "done" / "c"
        if flags.is_dir():
            with os.scandir(flags) as entries:
                for e in entries:
                    head, _, tail = e.name.partition(".")
                    if head.isdigit() and int(head) in blocks and _ZARR_TEMP.fullmatch(f".{tail}"):
                        found.append(Path(e.path))
        return found

    def feature_chunk_paths(self, i: int) -> list[Path]:
        """Local paths of block ``i``'s feature chunk files (hidden states, fp8 scales), present or not."""
        if self._local_root is None:
            raise StoreFormatError(f"{self.path}: chunk files of a remote store cannot be listed")
        return [self.chunk_path(s.name, i) for s in hidden_arrays(self.storage_dtype)]

    def evict_block(self, i: int) -> None:
        """Delete block ``i``'s features (a streaming run, docs/design.md §7): its done flag cleared first, then
        its feature chunk files removed; the token arrays stay, so extracting it again makes it done again. A
        full-context store evicts context blocks (its ``contexts`` sub-store's), never its training blocks.

        Raises:
            StoreFormatError: a remote store or a full-context store's root.
        """
        paths = self.feature_chunk_paths(i)
        self._writable("done")[i] = 0
        for path in paths:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)

    def write_segment_keys(self, keys: list[np.ndarray]) -> None:
        """Write every block's segment content keys (``keys[i]``: ``[S_i] int64``, the packed row's
        ``segment_keys``) into :data:`~stores.features.feature_schema.SEGMENT_KEYS`, a short row padded by
        repeating its last key, and set the ``segment_keys`` attribute.

        A store made before peagle recorded them gets the array first (``extract --resume`` records the keys
        of such a store from a packed table that has them).

        Raises:
            StoreFormatError: a ``contexts`` sub-store, a block with no key or more keys than ``max_segments``,
                or another number of blocks.
        """
        width = int(self.attrs["max_segments"])
        if SEGMENT_KEYS.name not in self.group.array_keys():
            create_arrays(self.group, (SEGMENT_KEYS,), {"N": self.n_blocks, "S": width}, self.attrs.get("compressor"))
        if len(keys) != self.n_blocks:
            raise StoreFormatError(f"{self.path}: {len(keys)} rows of segment keys for {self.n_blocks} blocks")
        out = np.zeros((self.n_blocks, width), dtype=np.int64)
        for i, k in enumerate(keys):
            k = np.asarray(k, dtype=np.int64)
            if not 1 <= k.size <= width:
                raise StoreFormatError(f"{self.path}: block {i} has {k.size} segment keys (1..{width} expected)")
            out[i, : k.size] = k
            out[i, k.size:] = k[-1]
        self._writable(SEGMENT_KEYS.name)[:] = out
        self._set_own_attr(segment_keys=True)  # not a contexts sub-store's: its blocks are conversations

    def _set_own_attr(self, **values: Any) -> None:
        """Merge values into this group's ``peagle`` attributes only (not a sub-store's)."""
        self.attrs = {**self.attrs, **values}
        self.group.attrs["peagle"] = self.attrs

    def record_generation(self, max_new_tokens: int, temperature: float, seed: int) -> None:
        """Record how the store's assistant turns were generated (attribute ``generation``: ``max_new_tokens``,
        ``temperature``, ``seed``), so a replay walks its turns with the same limit (``peagle-eval --store``).
        The store must be open ``"r+"``; written by ``scripts/judge_set.py`` once the store is complete.

        Raises:
            ValueError: ``max_new_tokens < 1``.
        """
        if int(max_new_tokens) < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self._set_own_attr(generation={"max_new_tokens": int(max_new_tokens), "temperature": float(temperature),
                                       "seed": int(seed)})

    def generation(self) -> dict[str, Any] | None:
        """``{"max_new_tokens", "temperature", "seed"}`` the assistant turns were generated with
        (:meth:`record_generation`), or None when the store does not record it."""
        recorded = self.attrs.get("generation")
        return dict(recorded) if isinstance(recorded, dict) else None

    def segment_keys(self) -> np.ndarray | None:
        """``[N, S_max] int64``: each block's segment content keys, short rows padded by repeating their last
        key (:data:`~stores.features.feature_schema.SEGMENT_KEYS`); None for a store made before peagle recorded them or
        from a packed table without them (attribute ``segment_keys`` unset)."""
        if not self.attrs.get("segment_keys") or SEGMENT_KEYS.name not in self.group.array_keys():
            return None
        return np.asarray(self.group[SEGMENT_KEYS.name][:], dtype=np.int64)

    def set_token_freq(self, token_freq: np.ndarray) -> None:
        """Write ``token_freq [V] int64``."""
        self._writable("token_freq")[:] = np.asarray(token_freq, dtype=np.int64)


    # ---------------------------------------------------------------- reads
    def done_mask(self) -> np.ndarray:
        """``[N] bool``: which blocks are done; a full-context store's training block is done when
        every context block its segments read is done."""
        return self.group["done"][:].astype(bool)

    def missing_blocks(self) -> list[int]:
        """Ids of blocks whose done flag is 0."""
        return np.flatnonzero(~self.done_mask()).tolist()

    def is_complete(self) -> bool:
        return bool(self.done_mask().all())

    def token_freq(self) -> np.ndarray:
        """``[V] int64`` counts of loss-masked tokens."""
        return self.group["token_freq"][:]

    def n_tokens_per_block(self) -> np.ndarray:
        """``[N] int32``."""
        return self.group["n_tokens"][:]

    def n_tokens_of(self, i: int) -> int:
        """Block ``i``'s ``n_tokens`` (the array is read once per open store)."""
        # n_tokens is one small chunk written before any block: read it once per open store
        if self._n_tokens_cache is None:
            self._n_tokens_cache = self.group["n_tokens"][:]
        return int(self._n_tokens_cache[i])

    def forget_n_tokens(self) -> None:
        """Drop the cached ``n_tokens`` array (read again on the next block read)."""
        self._n_tokens_cache = None

    def _use_file(self, via: str) -> bool:
        if via not in ("auto", "file", "mmap", "zarr"):
            raise ValueError(f"via must be 'auto', 'file' or 'zarr', got {via!r}")
        use_file = self.raw_chunks if via == "auto" else via in ("file", "mmap")
        if use_file and not self.raw_chunks:
            raise StoreFormatError(f"{self.path}: direct chunk-file reads need a local uncompressed store")
        return use_file

    def read_tokens(self, i: int, via: str = "auto") -> dict[str, np.ndarray]:
        """Block ``i``'s token arrays as numpy (unpadded): input_ids, loss_mask, position_ids, cu_seqlens.

        ``via`` as in :meth:`read_block`.
        """
        if self._use_file(via):
            return self._files.read_tokens(i)
        T = self.n_tokens_of(i)
        cu = self.zarr_chunk(SEGMENTS.name, i)
        out = {spec.name: np.array(self.zarr_chunk(spec.name, i)[:T]) for spec in TOKEN_ARRAYS}
        out[SEGMENTS.name] = cu[: int(np.argmax(cu == cu[-1])) + 1]  # drop the padding repeats
        return out

    def read_block(self, i: int, via: str = "auto", pin_memory: bool = False) -> Block:
        """Read block ``i``.

        Args:
            via: ``"file"`` (local uncompressed stores: each chunk file read straight into its
                tensor; ``"mmap"`` is its earlier name), ``"zarr"`` (the zarr API), or ``"auto"``.
            pin_memory: allocate the hidden-state tensors in page-locked memory (for asynchronous
                copies to a CUDA device; ``file`` path of bf16 stores with CUDA present, else ignored).

        Returns:
            :class:`~stores.features.feature_schema.Block` with ``aux_hidden [T, L, H]`` and ``final_hidden [T, H]`` in bf16.

        Raises:
            IndexError: ``i`` out of range.
            ChunkDamageError: a chunk the block reads (a full-context store: also the context blocks' chunks
                it reads) is missing, of the wrong size, short or fails its crc32c checksum, naming the
                block, the chunk and the repair command (:meth:`damage_message`).
            StoreFormatError: a view that does not fit (full-context stores), a shard store.
        """
        if not 0 <= i < self.n_blocks:
            raise IndexError(f"block {i} out of range [0, {self.n_blocks})")
        use_file = self._use_file(via)  # ValueError: an unknown via
        try:
            return self._read_block(i, via, use_file, pin_memory)
        except ChunkDamageError as e:
            raise ChunkDamageError(self.damage_message(i, str(e))) from None
        except StoreFormatError:
            raise
        except (ValueError, OSError) as e:  # zarr: a checksum that does not match, an undecodable chunk
            raise ChunkDamageError(self.damage_message(i, f"a chunk is unreadable ({type(e).__name__}: {e})")) from None

    def _read_block(self, i: int, via: str, use_file: bool, pin_memory: bool) -> Block:
        """:meth:`read_block` of an ``i`` in range, its errors not yet named."""
        if use_file:
            return self._files.read_block(i, pin_memory)
        if self._local_root is not None:
            self.check_chunks_exist(i)
        tok = self.read_tokens(i, via="zarr")
        T = len(tok["input_ids"])
        raw = {spec.name: self.zarr_chunk(spec.name, i)[:T] for spec in hidden_arrays(self.storage_dtype)}
        tensors = {k: torch.from_numpy(np.asarray(a, dtype=np.int64)) for k, a in tok.items()}
        return Block(**tensors, **decode_hidden(self.storage_dtype, raw))

    def zarr_chunk(self, name: str, i: int) -> np.ndarray:
        """Block ``i``'s chunk of array ``name`` through the zarr API, which checks its crc32c.

        Raises:
            ChunkDamageError: zarr cannot decode it (a checksum that does not match, undecodable or
                unreadable bytes), naming the array and the chunk.
        """
        try:
            return self.array(name)[i]
        except (ValueError, OSError) as e:
            path = self.chunk_path(name, i)
            raise ChunkDamageError(f"{name} chunk {path if path is not None else i} is unreadable "
                                   f"({type(e).__name__}: {e})") from None

    def damage_message(self, i: int, reason: str) -> str:
        """The error of block ``i`` whose chunk ``reason`` names cannot be trusted: the store, the block,
        the reason and the command that re-extracts the damaged blocks (:meth:`repair_command`)."""
        return (f"{self.path}: {self.block_word} {i} cannot be trusted: {reason}. {self.repair_command()} re-extracts the "
                f"damaged blocks (`peagle-data verify {self.path}` lists them all)")

    def repair_command(self) -> str:
        """The command that re-extracts this store's damaged and unfinished blocks, in backquotes:
        ``extract --resume`` with the options recorded in the store (attribute ``config``, written by
        ``peagle-data extract``), else the packed table and options the user must give again."""
        if "config" in self.attrs:
            return (f"`peagle-data inspect {self.path} > store.json && peagle-data extract --config store.json "
                    "--resume`")
        return (f"`peagle-data extract PACKED --context {self.context} --resume --output {self.path}` (with the "
                "packed table, --verifier and --layers it was extracted with)")

    def read_runs(self, runs: list[tuple[int, int, int]], via: str = "auto",
                  pin_memory: bool = False) -> dict[str, torch.Tensor]:
        """The hidden states of ``runs`` (``[(block, first slot, tokens)]``) laid end to end:
        ``{"aux_hidden": [T, L, H], "final_hidden": [T, H]}`` bf16, T the runs' tokens summed
        (a full-context store's sub-store; ``via`` as :meth:`read_block`)."""
        if self._use_file(via):
            return self._files.read_runs(runs, pin_memory)
        raw, chunks = {}, {}
        for spec in hidden_arrays(self.storage_dtype):
            parts = []
            for m, s, n in runs:
                if (spec.name, m) not in chunks:  # a compressed chunk decodes whole: once per block
                    try:
                        chunks[spec.name, m] = self.zarr_chunk(spec.name, m)
                    except ChunkDamageError as e:
                        raise ChunkDamageError(f"context block {m}: {e}") from None
                parts.append(chunks[spec.name, m][s:s + n])
            shape = spec.block_shape(self.sizes())[1:]
            raw[spec.name] = np.concatenate(parts) if parts else np.zeros((0, *shape), dtype=spec.dtype)
        return decode_hidden(self.storage_dtype, raw)

    def read_blocks(self, ids, via: str = "auto", pin_memory: bool = False) -> list[Block]:
        """:meth:`read_block` of each id in ``ids`` (one request for several blocks), in order."""
        return [self.read_block(int(i), via=via, pin_memory=pin_memory) for i in ids]

    def close(self) -> None:
        """Close the chunk-directory descriptors the ``file`` read path keeps (reopened on demand)."""
        if self._files is not None:
            self._files.close()

    def __del__(self):
        if getattr(self, "_files", None) is not None:
            self.close()


    # ---------------------------------------------------------------- damage
    def block_arrays(self) -> list[str]:
        """Names of the arrays holding one chunk per block (the ``done`` flag excluded)."""
        return block_arrays(self.storage_dtype)

    def chunk_path(self, name: str, i: int) -> Path | None:
        """Local path of block ``i``'s chunk of array ``name`` (None for a remote store)."""
        if self._local_root is None:
            return None
        ndim = array_ndim(name)
        return self._local_root / name / "/".join(["c", str(i)] + ["0"] * (ndim - 1))

    def check_chunks_exist(self, i: int) -> None:
        """Every chunk of a done block is written (``write_empty_chunks``); a missing one is damage."""
        if not self._chunks_due(i):
            return
        missing = [n for n in self.block_arrays() if not self.chunk_path(n, i).is_file()]
        if missing:
            raise ChunkDamageError(f"block {i} is marked done but its chunk files of {missing} are missing")

    def _chunks_due(self, i: int) -> bool:
        """Whether every chunk of block ``i`` must exist: its done flag is set (read from the flag's raw chunk
        where the store has raw chunks)."""
        if self.raw_chunks:
            done = self.chunk_path("done", i)  # raw chunk: the flag's byte + the crc32c
            return done.is_file() and done.read_bytes()[:1] == b"\x01"
        return bool(self.group["done"][i])

    def array_specs(self) -> tuple[ArraySpec, ...]:
        """The schema's arrays of this store (:func:`stores.features.feature_schema.store_arrays`)."""
        return store_arrays(self.storage_dtype)

    def summary(self) -> dict[str, Any]:
        """Facts for ``peagle-data inspect`` (a full-context store's: :meth:`FullContextStore.summary`)."""
        done = self.done_mask()
        return {
            "path": self.path,
            "format_version": self.attrs["format_version"],
            "verifier": self.attrs["verifier"].get("name_or_path"),
            "layers": self.layers,
            "hidden_size": self.hidden_size,
            "storage_dtype": self.attrs["storage_dtype"],
            "block_size": self.block_size,
            "n_blocks": self.n_blocks,
            "n_tokens": self.n_tokens,
            "blocks_done": int(done.sum()),
            "percent_done": round(100.0 * float(done.mean()), 2) if len(done) else 100.0,
            "bytes_per_token": self.bytes_per_token(),
            "stored_bytes": self.n_blocks * self.block_size * self.bytes_per_token(),
            **({"config": self.attrs["config"]} if "config" in self.attrs else {}),  # extract's options
        }



# ==================== BLOCKSTORE ====================

# ==================== CONTEXTBLOCKS


class BlockStore(FeatureStore):
    """A ``--context window`` store (format 1, ``layout: "blocks"``): its blocks are the packed table's blocks,
    each extracted as it is."""

    layout = "blocks"
    format_version = FORMAT_VERSION

    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        *,
        n_blocks: int,
        block_size: int,
        max_segments: int,
        layers: list[int],
        hidden_size: int,
        vocab_size: int,
        verifier: dict[str, Any],
        tokenizer: dict[str, Any] | None = None,
        source: str = "",
        storage_dtype: str = "bf16",
        compressor: str | None = None,
        n_tokens: int = 0,
        extra: dict[str, Any] | None = None,
        force: bool = False,
    ) -> BlockStore:
        """Create an empty ``--context window`` store (``layout: "blocks"``); every block starts not done.

        Args:
            n_blocks: N; block_size: C tokens; max_segments: S_max (cu_seqlens width - 1).
            layers: aux layer ids (:data:`LAYER_CONVENTION`); hidden_size: H; vocab_size: V.
            verifier: ``name_or_path``, ``revision``, ``architecture``, ``num_hidden_layers``,
                ``hidden_size``, ``vocab_size``, ``dtype``.
            source: sha256 of the packed table's manifest.
            compressor: None (raw chunks, memory-mappable) or ``"zstd"`` (read through zarr).
            path: a local directory, or any fsspec URL zarr accepts (``memory://``, ``s3://``...).

        Raises:
            OutputExistsError: ``path`` exists and ``force`` is false.
            ValueError: an unsupported ``storage_dtype`` or ``compressor``.
        """
        specs = store_arrays(storage_dtype)  # ValueError: an unsupported storage dtype
        if compressor not in (None, "zstd"):
            raise ValueError(f"--compressor {compressor!r}: expected zstd or none")
        group = new_group(str(path), force)
        sizes = dim_sizes(n_blocks, block_size, max_segments, len(layers), hidden_size, vocab_size)
        create_arrays(group, (*specs, SEGMENT_KEYS), sizes, compressor)
        group.attrs["peagle"] = _store_attrs(
            cls.format_version, cls.layout, verifier=verifier, layers=layers, hidden_size=hidden_size,
            vocab_size=vocab_size, storage_dtype=storage_dtype, compressor=compressor, block_size=block_size,
            max_segments=max_segments, n_blocks=n_blocks, n_tokens=n_tokens, tokenizer=tokenizer, source=source,
            extra=extra)
        return cls(group, str(path))


class ContextBlocks(FeatureStore):
    """The :data:`CONTEXTS` sub-store of a :class:`FullContextStore` (``layout: "contexts"``): its blocks are the
    whole conversations the verifier ran, each up to ``--max-context`` tokens; opened through its root only."""

    layout = "contexts"
    format_version = WINDOWS_FORMAT_VERSION
    context = "full"
    holds_segments = False

    def _refuse_opened_alone(self) -> None:
        parent = self.path.rstrip("/").rpartition("/")[0] or "."
        raise StoreFormatError(f"{self.path} is the context sub-store of the full-context store {parent}: "
                               f"pass {parent}")

    def write_segment_keys(self, keys: list[np.ndarray]) -> None:
        """Refused: context blocks hold conversations, not the packed table's segments.

        Raises:
            StoreFormatError: always.
        """
        raise StoreFormatError(f"{self.path}: a contexts sub-store holds conversations, not segments")


class FullContextStore(FeatureStore):
    """A ``--context full`` store (format 2, ``layout: "windows"``, docs/design.md §7): its root holds the
    training blocks' token arrays and, per segment, a view (:data:`~stores.features.feature_schema.VIEW_FIELDS`)
    into :attr:`contexts`, the :class:`ContextBlocks` the verifier ran. A training block has no features or done
    flag of its own: it reads and is done through the context blocks its views name. A shard store (attribute
    ``shard``) holds every ``num_shards``-th context block: its training blocks are read once the shards are
    merged."""

    layout = "windows"
    format_version = WINDOWS_FORMAT_VERSION
    context = "full"
    has_views = True
    block_word = "training block"

    def __init__(self, group: zarr.Group, path: str):
        """Open ``group`` and its :data:`CONTEXTS` sub-store.

        Raises:
            StoreFormatError: as :meth:`FeatureStore.__init__`; no ``contexts`` sub-store.
        """
        if CONTEXTS not in group:
            raise StoreFormatError(f"{path}: full-context store without its {CONTEXTS!r} sub-store")
        self.contexts: ContextBlocks = ContextBlocks(group[CONTEXTS], f"{path}/{CONTEXTS}")
        self._views_cache: np.ndarray | None = None
        super().__init__(group, path)

    def _has_raw_chunks(self) -> bool:
        return self.contexts.raw_chunks and uncompressed(self.group["input_ids"])

    @property
    def verifier_blocks(self) -> ContextBlocks:
        """:attr:`contexts`: the verifier runs the context blocks; the training blocks are views of them."""
        return self.contexts

    def update_attrs(self, **values: Any) -> None:
        """Merge values into the ``peagle`` attributes of the root and of its :attr:`contexts`."""
        super().update_attrs(**values)
        self.contexts.update_attrs(**values)

    @classmethod
    def create(
        cls,
        path: str | os.PathLike,
        *,
        n_blocks: int,
        block_size: int,
        max_segments: int,
        n_context_blocks: int,
        context_size: int,
        context_segments: int,
        layers: list[int],
        hidden_size: int,
        vocab_size: int,
        verifier: dict[str, Any],
        tokenizer: dict[str, Any] | None = None,
        source: str = "",
        storage_dtype: str = "bf16",
        compressor: str | None = None,
        n_tokens: int = 0,
        n_context_tokens: int = 0,
        extra: dict[str, Any] | None = None,
        force: bool = False,
    ) -> FullContextStore:
        """Create an empty full-context store (docs/design.md §7, ``layout: "windows"``).

        The root gets :data:`~stores.features.feature_schema.WINDOW_ARRAYS` for ``n_blocks`` training blocks of
        ``block_size`` slots; the :data:`CONTEXTS` sub-store gets every array of :meth:`BlockStore.create` for
        ``n_context_blocks`` context blocks of ``context_size`` slots holding at most
        ``context_segments`` conversations each; every context block starts not done. ``extra``
        goes to both attribute sets; other arguments as :meth:`BlockStore.create`.

        Raises:
            OutputExistsError: ``path`` exists and ``force`` is false.
            ValueError: an unsupported ``storage_dtype`` or ``compressor``.
        """
        specs = store_arrays(storage_dtype)
        if compressor not in (None, "zstd"):
            raise ValueError(f"--compressor {compressor!r}: expected zstd or none")
        group = new_group(str(path), force)
        L = len(layers)
        create_arrays(group, (*WINDOW_ARRAYS, SEGMENT_KEYS),
                      dim_sizes(n_blocks, block_size, max_segments, L, hidden_size, vocab_size), compressor)
        sub = group.create_group(CONTEXTS)
        create_arrays(sub, specs, dim_sizes(n_context_blocks, context_size, context_segments, L, hidden_size,
                                            vocab_size), compressor)
        common = dict(verifier=verifier, layers=layers, hidden_size=hidden_size, vocab_size=vocab_size,
                      storage_dtype=storage_dtype, compressor=compressor, tokenizer=tokenizer, source=source,
                      extra=extra)
        sub.attrs["peagle"] = _store_attrs(ContextBlocks.format_version, ContextBlocks.layout, block_size=context_size,
                                           max_segments=context_segments, n_blocks=n_context_blocks,
                                           n_tokens=n_context_tokens, **common)
        group.attrs["peagle"] = _store_attrs(cls.format_version, cls.layout, block_size=block_size,
                                             max_segments=max_segments, n_blocks=n_blocks, n_tokens=n_tokens, **common)
        return cls(group, str(path))

    def write_views(self, i: int, views) -> None:
        """Write training block ``i``'s segment views (full-context stores): ``views [S, 4]`` int
        (:data:`~stores.features.feature_schema.VIEW_FIELDS`), padded to ``max_segments`` with -1."""
        v = np.asarray(views, dtype=np.int32).reshape(-1, len(VIEW_FIELDS))
        S = int(self.attrs["max_segments"])
        if len(v) > S:
            raise ValueError(f"block {i}: {len(v)} segment views > max_segments {S}")
        row = np.full((S, len(VIEW_FIELDS)), -1, dtype=np.int32)
        row[: len(v)] = v
        self._writable(WINDOW_VIEWS.name)[i] = row
        self._views_cache = None

    def views(self) -> np.ndarray:
        """``[N, S_max, 4] int32``: every training block's segment views (read once per open store; rows past a
        block's segments are -1)."""
        if self._views_cache is None:
            self._views_cache = np.asarray(self.group[WINDOW_VIEWS.name][:], dtype=np.int32)
        return self._views_cache

    def view_row(self, i: int) -> np.ndarray:
        """``[S_max, 4] int32``: training block ``i``'s views (:meth:`views`), read alone when another
        block's chunk of the array is damaged (``verify`` and repair read the undamaged ones).

        Raises:
            an exception of zarr: block ``i``'s chunk is damaged.
        """
        if self._views_cache is None:
            try:
                self.views()
            except Exception:  # a damaged chunk of another block (checksum, size, missing file)
                return np.asarray(self.group[WINDOW_VIEWS.name][i], dtype=np.int32)
        return self._views_cache[i]

    def clear_done(self, i: int) -> None:
        """Refused: training blocks have no done flags.

        Raises:
            StoreFormatError: always (clear those of the context blocks, :attr:`contexts`).
        """
        raise StoreFormatError(f"{self.path}: a full-context store's blocks have no done flags; "
                               "clear those of its context blocks (store.contexts)")

    def is_done(self, i: int) -> bool:
        """Whether every context block training block ``i``'s views read is done, read now from the store.

        Raises:
            StoreFormatError: a shard store.
        """
        self._refuse_shard()
        m = self.view_row(i)[:, 0]
        return all(self.contexts.is_done(int(u)) for u in np.unique(m[m >= 0]))

    def evict_block(self, i: int) -> None:
        """Refused: training blocks are views; a streaming run evicts context blocks (:attr:`contexts`).

        Raises:
            StoreFormatError: always.
        """
        raise StoreFormatError(f"{self.path}: a full-context store's training blocks are views; evict its context "
                               "blocks (store.contexts)")

    def done_mask(self) -> np.ndarray:
        """``[N] bool``: which training blocks are done: those whose segments read only done context blocks.

        Raises:
            StoreFormatError: a shard store.
        """
        self._refuse_shard()
        context_done = self.contexts.done_mask()
        m = self.views()[..., 0]
        return np.where(m >= 0, context_done[np.clip(m, 0, None)], True).all(axis=1)

    def _read_block(self, i: int, via: str, use_file: bool, pin_memory: bool) -> Block:
        """Training block ``i``: its token arrays, and its hidden states read from the context blocks
        (:meth:`runs`)."""
        tok = self.read_tokens(i, via)
        hidden = self.contexts.read_runs(self.runs(i, tok[SEGMENTS.name]), via, pin_memory)
        return Block(**{k: torch.from_numpy(np.asarray(v, dtype=np.int64)) for k, v in tok.items()}, **hidden)

    def runs(self, i: int, cu_seqlens) -> list[tuple[int, int, int]]:
        """Where training block ``i``'s tokens lie in the context blocks (full-context stores):
        ``[(context block, first slot, tokens)]`` in token order, one or two per segment.

        Raises:
            StoreFormatError: a view that does not fit its segment or its context block; a shard store
                (:meth:`view_runs` reads its views).
        """
        self._refuse_shard()
        return self.view_runs(i, cu_seqlens)

    def n_context_blocks(self) -> int:
        """The context blocks of the whole extraction (full-context stores): a shard store's sub-store
        holds every ``num_shards``-th of them (attribute ``shard``)."""
        shard = self.attrs.get("shard")
        return int(shard["context_blocks"]) if shard else self.contexts.n_blocks

    def view_runs(self, i: int, cu_seqlens) -> list[tuple[int, int, int]]:
        """:meth:`runs` of a full-context store or shard store, context blocks numbered in the whole
        extraction (:meth:`n_context_blocks`; a shard holds block m when ``m % num_shards == shard_index``,
        as its sub-store's block ``m // num_shards``).

        Raises:
            StoreFormatError: a view that does not fit its segment or its context block.
        """
        views, lengths = self.view_row(i), np.diff(np.asarray(cu_seqlens, dtype=np.int64))
        out = []
        C, M = self.contexts.block_size, self.n_context_blocks()
        for k, n in enumerate(lengths.tolist()):
            m, prefix_slot, prefix_len, body_slot = (int(x) for x in views[k])
            if not (0 <= m < M and 0 <= prefix_len <= n and prefix_slot >= 0
                    and prefix_slot + prefix_len <= C and body_slot >= 0 and body_slot + n - prefix_len <= C):
                raise StoreFormatError(f"{self.path}: block {i} segment {k}: view {views[k].tolist()} does not fit "
                                       f"a segment of {n} tokens in {M} context blocks of {C} "
                                       "slots (run `peagle-data verify`)")
            if prefix_len:
                out.append((m, prefix_slot, prefix_len))
            if n > prefix_len:
                out.append((m, body_slot, n - prefix_len))
        return out

    def whole_conversations(self, i: int, cu_seqlens) -> np.ndarray | None:
        """``[S] bool``: whether segment k of training block ``i`` is a whole conversation the verifier ran (no
        prefix, one run from its first token to its last, not a window of it).

        Raises:
            StoreFormatError: a view that does not fit (:meth:`runs`), a shard store.
        """
        self.runs(i, cu_seqlens)  # the views fit (StoreFormatError otherwise); a shard store refused
        views, lengths = self.view_row(i), np.diff(np.asarray(cu_seqlens, dtype=np.int64))
        out = np.zeros(lengths.size, dtype=bool)
        starts: dict[int, np.ndarray] = {}
        for k, n in enumerate(lengths.tolist()):
            m, _, prefix_len, body = (int(x) for x in views[k][:4])
            if prefix_len:
                continue
            if m not in starts:
                starts[m] = np.asarray(self.contexts.read_tokens(m)[SEGMENTS.name], dtype=np.int64)
            cu = starts[m]
            j = int(np.searchsorted(cu, body))
            out[k] = j + 1 < cu.size and cu[j] == body and cu[j + 1] - cu[j] == n
        return out

    def _refuse_shard(self) -> None:
        shard = self.attrs.get("shard")
        if shard:
            raise StoreFormatError(
                f"{self.path} is shard {shard['shard_index']} of {shard['num_shards']} of a full-context store: its "
                "training blocks read context blocks of the other shards too. Join the shards first: "
                "peagle-data merge SHARD_0 ... SHARD_N-1 --output STORE")

    def block_arrays(self) -> list[str]:
        """Names of the root's arrays holding one chunk per training block."""
        return [s.name for s in WINDOW_ARRAYS if s.chunking == "block"]

    def array_specs(self) -> tuple[ArraySpec, ...]:
        """The root's arrays (:data:`~stores.features.feature_schema.WINDOW_ARRAYS`)."""
        return WINDOW_ARRAYS

    def _chunks_due(self, i: int) -> bool:
        """Whether every root chunk of training block ``i`` must exist: all are written once the token arrays are
        (attribute ``tokens_written``)."""
        return bool(self.attrs.get("tokens_written"))

    def summary(self) -> dict[str, Any]:
        """Facts for ``peagle-data inspect``, its context blocks' also under ``contexts`` (the tokens the
        verifier ran, and the bytes of both parts); a shard store's ``blocks_done``/``percent_done`` are None,
        its training blocks being done once merged."""
        contexts = self.contexts.summary()
        token_bytes = self.n_blocks * (self.block_size * 9 + (int(self.attrs["max_segments"]) * 5 + 1) * 4)
        # a shard's training blocks read the other shards' context blocks too: done once merged
        done = None if self.attrs.get("shard") else self.done_mask()
        return {
            "path": self.path, "format_version": self.attrs["format_version"], "layout": self.layout,
            "verifier": self.attrs["verifier"].get("name_or_path"), "layers": self.layers,
            "hidden_size": self.hidden_size, "storage_dtype": self.storage_dtype, "block_size": self.block_size,
            "n_blocks": self.n_blocks, "n_tokens": self.n_tokens,
            "blocks_done": None if done is None else int(done.sum()),
            "percent_done": None if done is None else round(100.0 * float(done.mean()), 2) if len(done) else 100.0,
            "stored_bytes": contexts["stored_bytes"] + token_bytes,
            "contexts": {k: contexts[k] for k in ("block_size", "n_blocks", "n_tokens", "blocks_done",
                                                  "percent_done", "bytes_per_token", "stored_bytes")},
            **{k: self.attrs[k] for k in ("context", "shard", "merged_from") if k in self.attrs},
            **({"config": self.attrs["config"]} if "config" in self.attrs else {}),
        }


LAYOUT_TYPES: dict[tuple[int, str], type[FeatureStore]] = {
    (t.format_version, t.layout): t for t in (BlockStore, FullContextStore, ContextBlocks)}
"""The store type of each ``(format_version, layout)`` this peagle reads."""


def open_store(path: str | os.PathLike, mode: str = "r") -> FeatureStore:
    """:meth:`FeatureStore.open`: the store at ``path`` as the type of its layout."""
    return FeatureStore.open(path, mode)


def _peagle_attrs(group: zarr.Group, path: str) -> dict[str, Any]:
    attrs = dict(group.attrs).get("peagle")
    if not isinstance(attrs, dict):
        raise StoreFormatError(f"{path}: not a peagle feature store (no 'peagle' attributes)")
    return attrs


def _layout_key(attrs: Mapping[str, Any]) -> tuple[Any, str]:
    """``(format_version, layout)`` of a store's attributes (a format-1 store records no layout: ``blocks``)."""
    return attrs.get("format_version"), str(attrs.get("layout", "blocks"))


def _store_attrs(format_version: int, layout: str, *, verifier, layers, hidden_size, vocab_size, storage_dtype,
                 compressor, block_size, max_segments, n_blocks, n_tokens, tokenizer, source, extra) -> dict[str, Any]:
    """The ``peagle`` attributes of a new store or sub-store (docs/design.md §7)."""
    return {
        "format_version": format_version,
        **({"layout": layout} if layout != "blocks" else {}),
        "verifier": dict(verifier, hidden_size=hidden_size, vocab_size=vocab_size),
        "layers": list(layers),
        "layer_convention": LAYER_CONVENTION,
        "final": "post_norm",
        "storage_dtype": storage_dtype,
        "compressor": compressor,
        "block_size": block_size,
        "max_segments": max_segments,
        "n_blocks": n_blocks,
        "n_tokens": n_tokens,
        "tokenizer": tokenizer or {},
        "source": source,
        "created_by": _created_by(),
        **(extra or {}),
    }


def _created_by() -> str:
    try:
        from importlib.metadata import version

        return f"peagle {version('peagle')}"
    except Exception:
        return "peagle"


