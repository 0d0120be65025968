"""Typed rows of the token tables (docs/design.md §6): one dataclass per table kind.

Each field carries its Arrow type (``metadata["arrow"]``); :func:`arrow_schema` builds the table
schema from them, and ``tests/stores/tables/test_token_rows.py`` checks it equals the schemas that
:mod:`stores.tables.token_tables` writes and reads. Fields with a default are the optional columns
(written as nulls, absent from tables of older runs).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["TokenizedRow", "PackedRow", "arrow_schema", "optional_columns", "content_key"]


def _col(arrow_type: pa.DataType, **kw: Any) -> Any:
    return field(metadata={"arrow": arrow_type}, **kw)


@dataclass
class TokenizedRow:
    """One tokenized conversation (or one turn's row under ``--on-history-rewrite per-turn``).

    ``n`` = ``n_tokens``."""

    conversation_id: str = _col(pa.string())
    source: str = _col(pa.string())
    """``FILE:ROW`` of the input row."""
    input_ids: np.ndarray = _col(pa.large_list(pa.int32()))
    """``[n] int32``."""
    loss_mask: np.ndarray = _col(pa.large_list(pa.uint8()))
    """``[n] uint8``, 1 on tokens the verifier generates as the assistant."""
    system_len: int = _col(pa.int32())
    """Tokens of the leading system prompt (kept at the start of every window)."""
    n_tokens: int = _col(pa.int32())
    n_loss_tokens: int = _col(pa.int32())
    dataset: str | None = _col(pa.string(), default=None)
    """The mixture source; None outside mixtures."""

    def as_dict(self) -> dict[str, Any]:
        """The row as :class:`stores.tables.token_tables.TableWriter` writes it (no copies)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass
class PackedRow:
    """One packed block: windows of conversations laid end to end (``T`` = ``n_tokens``, S windows)."""

    block_id: int = _col(pa.int64())
    input_ids: np.ndarray = _col(pa.large_list(pa.int32()))
    """``[T] int32``."""
    loss_mask: np.ndarray = _col(pa.large_list(pa.uint8()))
    """``[T] uint8``."""
    position_ids: np.ndarray = _col(pa.large_list(pa.int32()))
    """``[T] int32``, restarting at 0 in every window."""
    cu_seqlens: np.ndarray = _col(pa.list_(pa.int32()))
    """``[S+1] int32``: ``[0, len_0, ..., T]``."""
    segment_ids: list[str] = _col(pa.list_(pa.string()))
    """``[S]`` the conversation id (``#window``) of each window."""
    n_tokens: int = _col(pa.int32())
    segment_datasets: list[str | None] | None = _col(pa.list_(pa.string()), default=None)
    """``[S]`` mixture source of each window; None outside mixtures."""
    segment_loss_tokens: list[int] | None = _col(pa.list_(pa.int32()), default=None)
    """``[S]`` supervised tokens of each window; None outside mixtures."""
    segment_prefix_lens: list[int] | None = _col(pa.list_(pa.int32()), default=None)
    """``[S]`` tokens of the system prefix at the front of each window (0 for a window that is its
    whole conversation); None in tables packed before peagle recorded where windows come from."""
    segment_starts: list[int] | None = _col(pa.list_(pa.int64()), default=None)
    """``[S]`` where each window continues in its conversation (a row of the packed table's
    ``conversations`` sub-table, named by the window id before ``#``): window token
    ``j < prefix_len`` is conversation token ``j``, token ``j >= prefix_len`` is conversation token
    ``segment_starts + j - prefix_len``; None in older tables (docs/design.md §6)."""
    segment_keys: list[int] | None = _col(pa.list_(pa.int64()), default=None)
    """``[S]`` the content key of each window's conversation: the first 8 bytes, little-endian signed, of
    the BLAKE2b digest of the token ids and loss masks of the conversation's rows that have a window in
    the table (:func:`stores.tables.token_rows.content_key`). Equal for every window of one conversation and for
    every copy of it (same tokens), so training keeps them on one side of the validation split
    (docs/design.md §8); None in tables packed before peagle recorded it."""

    def as_dict(self) -> dict[str, Any]:
        """The row as :class:`stores.tables.token_tables.TableWriter` writes it (no copies)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def content_key(digest: bytes) -> int:
    """A conversation's content key (``PackedRow.segment_keys``): the first 8 bytes of its 16-byte content
    digest read as a little-endian signed int64."""
    return int.from_bytes(digest[:8], "little", signed=True)


def arrow_schema(row_type: type) -> pa.Schema:
    """The Arrow schema of a row dataclass: its fields in order, with their ``arrow`` types."""
    return pa.schema([(f.name, f.metadata["arrow"]) for f in dataclasses.fields(row_type)])


def optional_columns(row_type: type) -> frozenset[str]:
    """The columns a row may leave out: the fields with a default."""
    return frozenset(f.name for f in dataclasses.fields(row_type) if f.default is not dataclasses.MISSING)
