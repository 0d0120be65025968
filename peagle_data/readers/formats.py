"""One reader per input format: ``.jsonl``, ``.json`` (streamed), ``.parquet`` -> ``(row, record)``.

Rows count from 1; a row that is not a JSON object (or not JSON) is yielded as a
:class:`~peagle_data.readers.rows.RowError`; a file that cannot be read at all raises
:class:`~stores.errors.InputError`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from peagle_data.readers.rows import RowError
from stores.errors import InputError
from stores.files import json_error_text, json_line_problem

__all__ = ["iter_records"]


def iter_records(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any] | RowError]]:
    """Yield ``(row, record)`` for every row of one file, or ``(row, error)`` for a bad row.

    ``row`` counts from 1 (the line of a ``.jsonl``, the element of a ``.json`` array, the row of a
    ``.parquet``).

    Raises:
        InputError: the file cannot be read as its extension says (names the file).

    ``.json`` files are streamed object by object, so a huge array needs no more memory than one
    record, and a file truncated mid-record (like the ShareGPT V3 file) yields its complete
    records followed by one error row for the truncated tail.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    readers = {".jsonl": _iter_jsonl, ".json": _iter_json_array, ".parquet": _iter_parquet}
    if suffix not in readers:
        raise InputError(f"unsupported extension {suffix!r}", file=str(path))
    try:
        yield from readers[suffix](path)
    except OSError as e:
        raise InputError(f"cannot read the file: {e.strerror or e}", file=str(path)) from None


def _iter_jsonl(path: Path):
    with path.open("rb") as f:
        for row, raw in enumerate(f, start=1):
            if row == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark
                raw = raw[3:]
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield row, RowError(f"invalid UTF-8: {e.reason} at byte {e.start}")
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:  # the line is the row; the column counts characters from 1
                yield row, RowError(json_line_problem(text, e, row))
                continue
            yield row, record if isinstance(record, dict) else RowError(
                f"not a JSON object: a {type(record).__name__}")


_CHUNK_CHARS = 1 << 20


class _TextPosition:
    """Line and column (both from 1) in a file of a position in a buffer whose start moves on."""

    def __init__(self) -> None:
        self.line, self.column = 1, 1  # of the buffer's first character

    def advance(self, dropped: str) -> None:
        """Move the buffer start past ``dropped`` (text removed from the buffer's front)."""
        n = dropped.count("\n")
        if n:
            self.line += n
            self.column = len(dropped) - dropped.rindex("\n")
        else:
            self.column += len(dropped)

    def at(self, buf: str, pos: int) -> str:
        """``line L column C`` of ``buf[pos]``."""
        n = buf.count("\n", 0, pos)
        column = pos - buf.rindex("\n", 0, pos) if n else self.column + pos
        return f"line {self.line + n} column {column}"


class _JsonStream:
    """A growing text buffer over a JSON file, with the file position of its start (``where``)."""

    def __init__(self, f) -> None:
        self.f, self.where = f, _TextPosition()
        self.buf, self.pos, self.eof = f.read(_CHUNK_CHARS), 0, False

    def skip(self, chars: str) -> None:
        """Move past ``chars``, reading on while the buffer runs out (sets ``eof`` at the file's end)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in chars:
                self.pos += 1
            if self.pos < len(self.buf) or self.eof:
                return
            self.where.advance(self.buf)
            self.buf, self.pos = self.f.read(_CHUNK_CHARS), 0
            self.eof = not self.buf

    def decode(self, decoder: json.JSONDecoder) -> Any:
        """The JSON value at ``pos`` (reading more text while it is incomplete), or a RowError that
        ends the file: truncated, or invalid."""
        while True:
            try:
                record, self.pos = decoder.raw_decode(self.buf, self.pos)
                return record
            except json.JSONDecodeError as e:
                # An error well inside the buffer is bad JSON; near its end, more text may fix it.
                needs_more = e.msg.startswith("Unterminated") or e.pos >= len(self.buf) - 32
                more = self.f.read(max(_CHUNK_CHARS, len(self.buf) - self.pos)) if needs_more else ""
                if not more:
                    truncated = e.msg.startswith("Unterminated") or not self.buf[e.pos:].strip()
                    reason = ("truncated JSON: the file ends mid-record" if truncated
                              else f"invalid JSON: {json_error_text(e)} at {self.where.at(self.buf, e.pos)}")
                    return RowError(f"{reason}; the rest of the file is not read")
                self.where.advance(self.buf[:self.pos])
                self.buf, self.pos = self.buf[self.pos:] + more, 0

    def trim(self) -> None:
        """Drop consumed text so the buffer stays bounded."""
        if self.pos > _CHUNK_CHARS:
            self.where.advance(self.buf[:self.pos])
            self.buf, self.pos = self.buf[self.pos:], 0


def _iter_json_array(path: Path):
    """Stream a JSON array with raw_decode over a growing buffer; tolerate a truncated tail.

    An invalid record is reported with its line and column in the file; a record cut off by the
    end of the file is "truncated JSON". Either way the rest of the file is not read.
    """
    # surrogateescape keeps invalid UTF-8 bytes as lone surrogates; the row is rejected later.
    with path.open("r", encoding="utf-8-sig", errors="surrogateescape") as f:
        s = _JsonStream(f)
        s.skip(" \t\r\n")
        if s.pos >= len(s.buf):
            return
        if s.buf[s.pos] == "{":  # a single object, not an array: one row
            yield from _single_object(s)
            return
        if s.buf[s.pos] != "[":
            raise InputError(f"not a readable JSON file: a .json input must be an array of objects "
                             f"(or one object), found {s.buf[s.pos]!r} at its start", file=str(path))
        s.pos += 1
        yield from _array_items(s)


def _single_object(s: _JsonStream):
    rest = s.buf + s.f.read()
    try:
        record = json.loads(rest[s.pos:])
    except json.JSONDecodeError as e:
        yield 1, RowError(f"invalid JSON: {json_error_text(e)} at {s.where.at(rest, s.pos + e.pos)}")
        return
    yield 1, record


def _array_items(s: _JsonStream):
    """The items of the array whose ``[`` was just read."""
    decoder, row = json.JSONDecoder(), 1
    while True:
        s.skip(" \t\r\n,")
        if s.pos < len(s.buf) and s.buf[s.pos] == "]":  # the end: only whitespace may follow
            s.pos += 1
            s.skip(" \t\r\n")
            if s.pos < len(s.buf):
                yield row, RowError(f"invalid JSON: extra data after the array's closing ']' at "
                                    f"{s.where.at(s.buf, s.pos)} (two arrays in one file?); the rest of the file "
                                    "is not read")
            return
        if s.pos >= len(s.buf):
            return
        record = s.decode(decoder)
        if isinstance(record, RowError):
            yield row, record
            return
        yield row, record if isinstance(record, dict) else RowError(
            f"not a JSON object: a {type(record).__name__}")
        row += 1
        s.trim()


def _iter_parquet(path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 1
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=256)
        for batch in batches:
            records = batch.to_pylist()
            for record in records:
                yield row, record
                row += 1
    except (pa.ArrowException, OSError) as e:
        where = "" if row == 1 else f" after row {row - 1}"
        raise InputError(f"not a readable Parquet file{where} ({type(e).__name__}: {e})", file=str(path)) from None
