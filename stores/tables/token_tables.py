"""Arrow token tables (docs/design.md §6): schemas, a bounded-memory writer, readers, manifests.

A table is a directory of Parquet (zstd) part files ``part-00000.parquet`` ... plus
``manifest.json`` written last (a table without a manifest is unfinished), and optionally
``rejects.jsonl`` and ``token_freq.npy``. Commands write a table with
:func:`stores.staging.staged_output_dir` (no half-written output after a failed run). Token columns are ``large_list`` so no table hits the
2^31 element limit.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stores.errors import StoreFormatError, StoreMismatchError
from stores.files import is_zarr_store
from stores.staging import write_text_atomic
from stores.tables.token_rows import PackedRow, TokenizedRow

if TYPE_CHECKING:
    import polars as pl

__all__ = [
    "FORMAT_VERSION",
    "TOKENIZED_SCHEMA",
    "PACKED_SCHEMA",
    "MANIFEST",
    "CONVERSATIONS",
    "conversations_record",
    "REJECTS",
    "read_first_reject",
    "TOKEN_FREQ",
    "TableWriter",
    "RejectsWriter",
    "TokenTable",
    "write_manifest",
    "read_manifest",
    "not_a_store_hint",
    "manifest_sha256",
    "library_versions",
    "write_token_freq",
    "read_token_freq",
]

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
REJECTS = "rejects.jsonl"
TOKEN_FREQ = "token_freq.npy"

TOKENIZED_SCHEMA = pa.schema([
    ("conversation_id", pa.string()),
    ("source", pa.string()),
    ("input_ids", pa.large_list(pa.int32())),
    ("loss_mask", pa.large_list(pa.uint8())),
    ("system_len", pa.int32()),
    ("n_tokens", pa.int32()),
    ("n_loss_tokens", pa.int32()),
    ("dataset", pa.string()),
])

PACKED_SCHEMA = pa.schema([
    ("block_id", pa.int64()),
    ("input_ids", pa.large_list(pa.int32())),
    ("loss_mask", pa.large_list(pa.uint8())),
    ("position_ids", pa.large_list(pa.int32())),
    ("cu_seqlens", pa.list_(pa.int32())),
    ("segment_ids", pa.list_(pa.string())),
    ("n_tokens", pa.int32()),
    ("segment_datasets", pa.list_(pa.string())),
    ("segment_loss_tokens", pa.list_(pa.int32())),
    ("segment_prefix_lens", pa.list_(pa.int32())),
    ("segment_starts", pa.list_(pa.int64())),
    ("segment_keys", pa.list_(pa.int64())),
])

SCHEMAS = {"tokenized": TOKENIZED_SCHEMA, "packed": PACKED_SCHEMA}

OPTIONAL_COLUMNS = frozenset({"dataset", "segment_datasets", "segment_loss_tokens", "segment_prefix_lens",
                              "segment_starts", "segment_keys"})
"""Columns a row may leave out (written as nulls) and a table may lack (tables of older runs):
the mixture source of a tokenized row (``dataset``), and of each window of a packed row with its
supervised tokens (``segment_datasets``, ``segment_loss_tokens``; null outside mixtures); where each
window of a packed row comes from in its conversation (``segment_prefix_lens``, ``segment_starts``;
absent from tables packed before peagle recorded it); each window's conversation content key
(``segment_keys``, docs/design.md §8; absent from older tables)."""

CONVERSATIONS = "conversations"
"""The sub-table of a packed table that holds the tokenized rows its windows were cut from (a
tokenized table in the directory ``PACKED/conversations``), read by full-context extraction; the packed
manifest records its digest under this key (:func:`conversations_record`)."""


def library_versions() -> dict[str, str]:
    """Versions of the libraries whose behaviour shapes the outputs (for manifests)."""
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "transformers", "tokenizers", "pyarrow", "zarr", "numpy"):
        m = sys.modules.get(mod)
        if m is None:
            try:
                m = __import__(mod)
            except ImportError:
                continue
        out[mod] = getattr(m, "__version__", "?")
    return out


def write_manifest(directory: str | os.PathLike, manifest: dict[str, Any]) -> Path:
    """Write ``manifest.json`` atomically (last, after every part file)."""
    directory = Path(directory)
    body = {"format_version": FORMAT_VERSION, "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "library_versions": library_versions(), **manifest}
    return write_text_atomic(directory / MANIFEST, json.dumps(body, indent=2, sort_keys=False, default=str) + "\n")


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    """Read a table's manifest.

    Raises:
        StoreFormatError: missing (the writer did not finish), unreadable, or of an unknown version.
    """
    path = Path(directory) / MANIFEST
    if not path.is_file():
        if is_zarr_store(directory):
            raise StoreFormatError(
                f"{directory} is a feature store (zarr.json), not a token table: this command reads tokenize or "
                "pack outputs. A feature store is read by `peagle-data inspect`, `verify` and `stats`, and by "
                "`peagle-train --store` and `peagle-eval --store`")
        raise StoreFormatError(
            f"{directory}: no {MANIFEST}; not a peagle table, or the command that wrote it did not finish"
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StoreFormatError(f"{path}: invalid JSON ({e})") from e
    if manifest.get("format_version") != FORMAT_VERSION:
        raise StoreFormatError(
            f"{path}: format_version {manifest.get('format_version')!r}, this peagle reads {FORMAT_VERSION}"
        )
    return manifest


def not_a_store_hint(directory: str | os.PathLike) -> str | None:
    """Why ``directory``, given where a feature store is expected, is a token table instead, and the
    command that makes a store of it; None when it holds no table manifest."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    try:
        kind = json.loads(path.read_text()).get("kind")
    except (json.JSONDecodeError, AttributeError):
        kind = None
    if kind == "packed":
        return (f"{directory} is a packed token table (manifest.json), not a feature store: extract its features "
                f"first with `peagle-data extract {directory} --verifier MODEL --output STORE`, then pass STORE")
    return (f"{directory} is a {kind or 'peagle'} token table (manifest.json), not a feature store: pack it "
            f"(`peagle-data pack {directory} --tokenizer MODEL --output PACKED`), extract the packed table "
            "(`peagle-data extract PACKED --verifier MODEL --output STORE`), then pass STORE")


def conversations_record(packed: str | os.PathLike) -> dict[str, Any]:
    """What a packed table's manifest records of its :data:`CONVERSATIONS` sub-table (key
    ``conversations``): ``rows`` and ``sha256``, a digest of its part files' bytes in part order (each
    file's size first, names not included, so linked or renamed parts keep it). A feature store's
    ``source`` (:func:`manifest_sha256` of the packed table) then covers the conversations too."""
    directory = Path(packed) / CONVERSATIONS
    h = hashlib.sha256()
    for f in sorted(directory.glob("part-*.parquet")):
        h.update(f.stat().st_size.to_bytes(8, "little"))
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in sorted(directory.glob("part-*.parquet")))
    return {"rows": rows, "sha256": h.hexdigest()}


def manifest_sha256(directory: str | os.PathLike) -> str:
    """sha256 of a table's manifest bytes: the identity a feature store records as ``source``."""
    return hashlib.sha256((Path(directory) / MANIFEST).read_bytes()).hexdigest()


class TableWriter:
    """Write rows of one schema to Parquet part files in bounded batches.

    Memory is bounded by ``batch_rows`` rows; each full batch becomes one row group, and a part
    file is rolled over every ``rows_per_file`` rows.

    Args:
        directory: the table directory (already prepared).
        kind: ``"tokenized"`` or ``"packed"``.
    """

    def __init__(self, directory: str | os.PathLike, kind: str, batch_rows: int = 1024,
                 rows_per_file: int = 65536):
        if kind not in SCHEMAS:
            raise ValueError(f"unknown table kind {kind!r}")
        self.directory, self.kind, self.schema = Path(directory), kind, SCHEMAS[kind]
        self.batch_rows, self.rows_per_file = batch_rows, rows_per_file
        self._buffer: dict[str, list] = {name: [] for name in self.schema.names}
        self._writer: pq.ParquetWriter | None = None
        self._rows_in_file = 0
        self._part = 0
        self.n_rows = 0

    def write(self, row: dict[str, Any] | TokenizedRow | PackedRow) -> None:
        """Append one row: a :mod:`stores.tables.token_rows` dataclass, or a dict with every column (lists
        or 1-D numpy arrays for list columns)."""
        if not isinstance(row, dict):
            row = row.as_dict()
        for name in self.schema.names:
            self._buffer[name].append(row.get(name) if name in OPTIONAL_COLUMNS else row[name])
        self.n_rows += 1
        if len(self._buffer[self.schema.names[0]]) >= self.batch_rows:
            self._flush()

    def _flush(self) -> None:
        if not self._buffer[self.schema.names[0]]:
            return
        batch = pa.record_batch([_column(self._buffer[n], self.schema.field(n).type)
                                 for n in self.schema.names], schema=self.schema)
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.directory / f"part-{self._part:05d}.parquet",
                                            self.schema, compression="zstd")
        self._writer.write_batch(batch)
        self._rows_in_file += batch.num_rows
        self._buffer = {name: [] for name in self.schema.names}
        if self._rows_in_file >= self.rows_per_file:
            self._writer.close()
            self._writer, self._rows_in_file = None, 0
            self._part += 1

    def close(self) -> None:
        """Flush and close; writes an empty part file when no row was written."""
        self._flush()
        if self._writer is None and self.n_rows == 0:
            pq.write_table(self.schema.empty_table(), self.directory / "part-00000.parquet")
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> "TableWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _column(values: list, type_: pa.DataType) -> pa.Array:
    """One column of a batch; numeric list columns of numpy rows are built from one concatenation."""
    is_list = pa.types.is_large_list(type_) or pa.types.is_list(type_)
    if not is_list or pa.types.is_string(type_.value_type) or \
            not all(isinstance(v, np.ndarray) for v in values):
        return pa.array([v.tolist() if isinstance(v, np.ndarray) else v for v in values], type=type_)
    offsets = np.zeros(len(values) + 1, dtype=np.int64 if pa.types.is_large_list(type_) else np.int32)
    np.cumsum([len(v) for v in values], out=offsets[1:])
    flat = (np.concatenate(values) if values else np.zeros(0)).astype(type_.value_type.to_pandas_dtype(), copy=False)
    array_cls = pa.LargeListArray if pa.types.is_large_list(type_) else pa.ListArray
    return array_cls.from_arrays(pa.array(offsets), pa.array(flat, type=type_.value_type))


class RejectsWriter:
    """Append-only ``rejects.jsonl``: one line ``{"source", "reason", ...}`` per unused input row."""

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / REJECTS
        self._f = self.path.open("w", encoding="utf-8")
        self.count = 0
        self.by_reason: dict[str, int] = {}

    def write(self, source: str, reason: str, **extra: Any) -> None:
        self._f.write(json.dumps({"source": source, "reason": reason, **extra}, ensure_ascii=False) + "\n")
        self.count += 1
        key = reason.split(":")[0]
        self.by_reason[key] = self.by_reason.get(key, 0) + 1

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "RejectsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_first_reject(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The first line of ``rejects.jsonl`` in ``directory`` (``{"source", "reason", ...}``), or None when
    the file is absent or empty.

    Raises:
        StoreFormatError: the first line is not a JSON object.
    """
    path = Path(directory) / REJECTS
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as f:
        line = f.readline()
    if not line.strip():
        return None
    try:
        first = json.loads(line)
    except json.JSONDecodeError as e:
        raise StoreFormatError(f"{path}: line 1 is not JSON ({e})") from e
    if not isinstance(first, dict):
        raise StoreFormatError(f"{path}: line 1 is not a JSON object")
    return first


def write_token_freq(directory: str | os.PathLike, token_freq: np.ndarray) -> None:
    """Write ``token_freq.npy``: int64 ``[vocab_size]`` counts of loss-masked tokens."""
    np.save(Path(directory) / TOKEN_FREQ, np.asarray(token_freq, dtype=np.int64))


def read_token_freq(directory: str | os.PathLike) -> np.ndarray | None:
    """Read ``token_freq.npy`` (int64 ``[vocab_size]``) or None when absent."""
    path = Path(directory) / TOKEN_FREQ
    return np.load(path) if path.is_file() else None


@dataclass
class TokenTable:
    """A finished token table on disk (tokenized or packed), read lazily.

    Attributes:
        directory: the table directory.
        kind: ``"tokenized"`` or ``"packed"``.
        manifest: the parsed ``manifest.json``.
    """

    directory: Path
    kind: str
    manifest: dict[str, Any]

    @classmethod
    def open(cls, directory: str | os.PathLike) -> "TokenTable":
        """Open a table directory.

        Raises:
            StoreFormatError: no manifest, unknown version or kind, or columns not of the schema.
        """
        directory = Path(directory)
        manifest = read_manifest(directory)
        kind = manifest.get("kind")
        if kind not in SCHEMAS:
            raise StoreFormatError(f"{directory}: manifest kind {kind!r} is not one of {sorted(SCHEMAS)}")
        table = cls(directory, kind, manifest)
        names = set(table._dataset().schema.names)
        missing = set(SCHEMAS[kind].names) - names - OPTIONAL_COLUMNS
        if missing:
            raise StoreFormatError(f"{directory}: {kind} table lacks columns {sorted(missing)}")
        return table

    def _files(self) -> list[Path]:
        return sorted(self.directory.glob("part-*.parquet"))

    def _dataset(self) -> pq.ParquetDataset:
        return pq.ParquetDataset([str(f) for f in self._files()])

    def columns(self) -> list[str]:
        """The table's column names (a table of an older run may lack optional ones)."""
        return list(self._dataset().schema.names)

    @property
    def num_rows(self) -> int:
        return sum(pq.ParquetFile(f).metadata.num_rows for f in self._files())

    def iter_batches(self, columns: list[str] | None = None, batch_rows: int = 256) -> Iterator[pa.RecordBatch]:
        """Record batches in row order, at most ``batch_rows`` rows each (bounded memory)."""
        for f in self._files():
            yield from pq.ParquetFile(f).iter_batches(batch_size=batch_rows, columns=columns)

    def iter_rows(self, columns: list[str] | None = None) -> Iterator[dict[str, Any]]:
        """Rows as dicts; list columns come back as numpy arrays."""
        for batch in self.iter_batches(columns):
            cols = {name: batch.column(name) for name in batch.schema.names}
            for i in range(batch.num_rows):
                yield {name: _value(col, i) for name, col in cols.items()}

    def scan(self) -> "pl.LazyFrame":
        """A polars lazy scan over every part file (nothing is read until it is collected; collect
        with ``engine="streaming"`` to keep memory bounded by a row group, not the table)."""
        import polars as pl

        return pl.scan_parquet([str(f) for f in self._files()])

    def read_all(self, columns: list[str] | None = None) -> pa.Table:
        """The whole table in memory (for small tables and tests)."""
        return pa.concat_tables([pq.read_table(f, columns=columns) for f in self._files()])

    @property
    def rejects_path(self) -> Path:
        return self.directory / REJECTS

    def token_freq(self) -> np.ndarray | None:
        return read_token_freq(self.directory)

    def conversations(self) -> "TokenTable | None":
        """The :data:`CONVERSATIONS` sub-table of a packed table, None when it has none (packed
        before peagle kept it).

        Raises:
            StoreFormatError: the sub-table is there but unfinished or not a tokenized table.
            StoreMismatchError: its part files are not those the packed manifest records (``conversations``:
                :func:`conversations_record`), for a table whose manifest records them.
        """
        path = self.directory / CONVERSATIONS
        if self.kind != "packed" or not path.is_dir():
            return None
        table = TokenTable.open(path)
        if table.kind != "tokenized":
            raise StoreFormatError(f"{path}: a {table.kind} table where the conversations of {self.directory} belong")
        recorded = self.manifest.get(CONVERSATIONS)
        if recorded is not None and conversations_record(self.directory) != recorded:
            raise StoreMismatchError(
                f"{path}: its part files are not those {self.directory / MANIFEST} records (rows and sha256 under "
                f"{CONVERSATIONS!r}): the sub-table was edited or copied from another pack run, and its conversations "
                "may not be the ones the windows were cut from; pack the table again")
        return table


def _value(column: pa.Array, i: int):
    if not column[i].is_valid:
        return None
    if pa.types.is_large_list(column.type) or pa.types.is_list(column.type):
        if pa.types.is_string(column.type.value_type):
            return column[i].as_py()
        return column[i].values.to_numpy(zero_copy_only=False)
    return column[i].as_py()
