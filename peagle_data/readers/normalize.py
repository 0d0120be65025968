"""The adapter: one input record (OpenAI or ShareGPT) -> normalised OpenAI messages and tools.

The rules: docs/design.md §6, "Normalisation rules". A row that cannot be used raises
:class:`~peagle_data.readers.rows.RowError`.
"""

from __future__ import annotations

import json
from typing import Any

from peagle_data.readers.rows import FORMATS, RowError
from runtime.chat.chat_template import content_text, content_texts

__all__ = ["normalize_record", "drop_arrow_nulls", "is_empty_assistant", "is_unsupervised", "ROW_COUNTS"]

_SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "system": "system",
    "function_call": "function_call",
    "observation": "tool", "tool": "tool", "function": "tool",
}
_OPENAI_ROLES = {"system": "system", "developer": "developer", "user": "user", "assistant": "assistant",
                 "tool": "tool", "function": "tool", "ipython": "tool"}


def _check_text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise RowError(f"content not text: {where} is a {type(value).__name__}", where)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RowError(f"invalid UTF-8: {where} holds bytes that are not UTF-8", where) from None
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


_OTHER_ARGUMENT_KEYS = ("parameters", "params", "args", "input")
"""Keys some datasets hold a call's arguments under (Llama-3.1 ``parameters``, Anthropic ``input``):
vLLM reads ``arguments`` only and would render the call with ``{}``."""


def _check_argument_keys(call: dict[str, Any], where: str) -> None:
    """Raise RowError when ``call`` (a call or its ``function`` object) holds its arguments under another
    key than ``arguments`` (:data:`_OTHER_ARGUMENT_KEYS`): read as no arguments, the row would
    supervise a call with ``{}``."""
    for key in _OTHER_ARGUMENT_KEYS:
        if key in call:
            raise RowError(f"invalid tool call: {where} has the key {key!r} (a call's arguments go under "
                           "'arguments'; rename it)", f"{where}.{key}")


def _decode_arguments(entry: dict[str, Any], stats: dict[str, int], where: str) -> dict[str, Any]:
    """A tool call as an OpenAI ``tool_calls`` entry ``{"type": "function", "function": {"name",
    "arguments"}}`` with its arguments a mapping, as vLLM passes it to a template.

    The OpenAI wire form gives arguments as JSON text; templates render a string and a mapping
    differently (``tojson`` of a string is a quoted, escaped string), and vLLM decodes the text, so
    text holding a JSON object is decoded (``tool_arguments_decoded``); no arguments (null, ``""``)
    are ``{}``, as in vLLM. A flat call ``{"name", "arguments"}`` (no ``function`` object) is wrapped
    (``tool_calls_wrapped``).

    Raises:
        RowError: arguments that are no JSON object (vLLM renders them as ``{}``, so no row holds what
            the call said), a call of another type than ``function``, or one without a function name.
    """
    fn = entry.get("function")
    if not isinstance(fn, dict) and entry.get("type") is None and isinstance(entry.get("name"), str):
        _check_argument_keys(entry, where)
        fn = {key: entry[key] for key in ("name", "arguments") if key in entry}
        entry = {**{k: v for k, v in entry.items() if k not in ("name", "arguments")}, "function": fn}
        stats["tool_calls_wrapped"] += 1
    if entry.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RowError(f"invalid tool call: {where} is not a function call with a name (expected "
                       '{"type": "function", "function": {"name", "arguments"}})', where)
    _check_argument_keys(fn, f"{where}.function")
    if entry.get("id") is not None and not isinstance(entry["id"], str):  # vLLM's request model refuses it
        raise RowError(f"invalid tool call: {where}.id is a {type(entry['id']).__name__}, expected text",
                       f"{where}.id")
    args = fn.get("arguments")
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):
        decoded = _json_object(args)
        if decoded is None:
            raise RowError(f"invalid tool call: {where}.function.arguments is text that is not a JSON object (vLLM "
                           "renders such arguments as {}); fix or drop the call", f"{where}.function.arguments")
        args = decoded
        stats["tool_arguments_decoded"] += 1
    elif not isinstance(args, dict):
        raise RowError(f"invalid tool call: {where}.function.arguments is a {type(args).__name__}, not a JSON object "
                       "(vLLM renders such arguments as {})", f"{where}.function.arguments")
    return {**entry, "type": "function", "function": {**fn, "arguments": args}}


def _tool_call_part(part: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``{"type": "tool_call"}`` content part as an OpenAI ``tool_calls`` entry.

    Accepted shapes: ``{"function": {"name", "arguments"}}``, ``{"name", "arguments"}``, or the
    call as JSON text under ``text``/``value``.
    """
    _check_argument_keys(part, where)
    call: Any = part.get("function") or ({"name": part["name"], "arguments": _first(part, "arguments")}
                                         if part.get("name") is not None else _first(part, "text", "value"))
    if isinstance(call, str):
        try:
            call = json.loads(call)
        except json.JSONDecodeError as e:
            raise RowError(f"invalid tool call: {where} is not JSON ({e.msg})", where) from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise RowError(f"invalid tool call: {where} has no function name", where)
    _check_argument_keys(call, where)
    entry = {"type": "function", "function": {"name": call["name"], "arguments": _first(call, "arguments")}}
    if part.get("id") is not None:
        entry["id"] = part["id"]
    return entry


_TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
"""Content-part types that are text (vLLM's text parts, but ``thinking``) -> the key holding the text."""


def _parts_content(texts: list[str]) -> str | list[dict[str, str]]:
    """Normalised content of a list of text parts: one part is its string (vLLM renders both alike in
    either content format), more stay a list of ``{"type": "text", "text"}`` parts (none: ``[]``)."""
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts]


def _openai_content(msg: dict[str, Any], where: str,
                    stats: dict[str, int]) -> tuple[str | list | None, str | None, list]:
    """(content, reasoning, tool calls) of an OpenAI message's ``content`` (string, null or list of parts).

    Content is None (null), a string, or, for a list of parts, its text parts (``text``,
    ``input_text``, ``output_text``, ``refusal``, bare strings) as :func:`_parts_content` keeps them:
    the chat template gets them as vLLM passes them (joined with ``"\n"``, or the list;
    :func:`runtime.chat.chat_template.template_messages`). ``reasoning``/``thinking`` parts become the
    reasoning, ``tool_call``/``function_call`` parts tool calls. A part of another type (image, audio,
    file) rejects the row, or, when ``stats`` has the key ``dropped_content_parts`` (``keep_dropped``),
    is left out and counted there.
    """
    content = msg.get("content")
    if content is None or isinstance(content, str):
        return (None if content is None else _check_text(content, f"{where}.content")), None, []
    if not isinstance(content, list):
        raise RowError(f"content not text: {where}.content is a {type(content).__name__}", f"{where}.content")
    texts, reasoning, calls = [], [], []
    for j, part in enumerate(content):
        pw = f"{where}.content[{j}]"
        if isinstance(part, str):
            texts.append(_check_text(part, pw))
            continue
        if not isinstance(part, dict):
            raise RowError(f"content not text: {pw} is a {type(part).__name__}", pw)
        kind = _first(part, "type") or "text"
        if kind in _TEXT_PARTS:
            texts.append(_check_text(_first(part, _TEXT_PARTS[kind], "value"), pw))
        elif kind in ("reasoning", "thinking"):
            reasoning.append(_check_text(_first(part, kind, "text", "value"), pw))
        elif kind in ("tool_call", "function_call"):
            calls.append(_tool_call_part(part, pw))
        elif "dropped_content_parts" in stats:
            stats["dropped_content_parts"] += 1
        else:
            raise RowError(f"unsupported content part: {pw} has type {kind!r} (the chat template renders "
                          "text only; --on-dropped-content keep leaves such parts out and counts them)", pw)
    return _parts_content(texts), ("".join(reasoning) if reasoning else None), calls


def _message_tool_calls(msg: dict[str, Any], where: str, part_calls: list,
                        stats: dict[str, int]) -> list[dict[str, Any]]:
    """An assistant message's tool calls: ``tool_calls``, the legacy ``function_call`` and
    ``tool_call`` content parts, with JSON-string arguments decoded (:func:`_decode_arguments`)."""
    calls = msg.get("tool_calls") or []
    if not isinstance(calls, list):
        raise RowError(f"invalid tool call: {where}.tool_calls is a {type(calls).__name__}", f"{where}.tool_calls")
    located = [(call, f"{where}.tool_calls[{k}]") for k, call in enumerate(calls)]
    legacy = msg.get("function_call")
    if legacy is not None:
        if not isinstance(legacy, dict) or not isinstance(legacy.get("name"), str):
            raise RowError(f"invalid tool call: {where}.function_call has no function name", f"{where}.function_call")
        _check_argument_keys(legacy, f"{where}.function_call")
        located.append(({"type": "function", "function": {"name": legacy["name"],
                                                          "arguments": _first(legacy, "arguments")}},
                        f"{where}.function_call"))
    located += [(call, f"{where}.content") for call in part_calls]
    out = []
    for call, at in located:
        if not isinstance(call, dict):
            raise RowError(f"invalid tool call: {at} is a {type(call).__name__}", at)
        out.append(_decode_arguments(call, stats, at))
    return out


def _normalize_openai(messages: Any, stats: dict[str, int]) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise RowError(f"not a list: 'messages' is a {type(messages).__name__}", "messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise RowError(f"turn not an object: {where} is a {type(msg).__name__}", where)
        role = msg.get("role")
        if role not in _OPENAI_ROLES:
            raise RowError(f"unknown role: {role!r} in {where}.role", f"{where}.role")
        role = _OPENAI_ROLES[role]
        text, reasoning, part_calls = _openai_content(msg, where, stats)
        reasoning = reasoning or _message_reasoning(msg, where)
        tool_calls = _message_tool_calls(msg, where, part_calls, stats) if role == "assistant" else None
        if role != "assistant" and (msg.get("tool_calls") or part_calls):
            raise RowError(f"tool calls in a {role} turn: {where} (only assistant turns make tool calls)", where)
        if text is None and not tool_calls and not reasoning:  # vLLM renders null content as ""
            state = "is null" if "content" in msg else "is missing"
            raise RowError(f"turn with no content: {where}.content {state}", f"{where}.content")
        if role == "tool" and isinstance(text, list):  # vLLM joins a tool message's text parts in both formats
            text = content_text(text)
        new: dict[str, Any] = {"role": role, "content": text}
        if reasoning:
            new["reasoning_content"] = _check_text(reasoning, f"{where}.reasoning_content")
        if tool_calls:
            new["tool_calls"] = tool_calls
        for key in ("tool_call_id", "name"):
            if msg.get(key) is not None:
                if not isinstance(msg[key], str):  # vLLM's request model refuses it
                    raise RowError(f"invalid {key}: {where}.{key} is a {type(msg[key]).__name__}, expected text",
                                   f"{where}.{key}")
                new[key] = msg[key]
        _copy_weight(msg, new, where)
        _copy_finish_reason(msg, new, where)
        _copy_token_ids(msg, new, where)
        out.append(new)
    return out


def _message_reasoning(msg: dict[str, Any], where: str) -> Any:
    """A message's reasoning field: ``reasoning`` (vLLM's request field) or ``reasoning_content`` (its
    deprecated name, which vLLM renames to ``reasoning``); None when neither is set.

    Raises:
        RowError: both are set and differ (vLLM would keep ``reasoning`` and drop the other silently).
    """
    reasoning, legacy = msg.get("reasoning"), msg.get("reasoning_content")
    if reasoning is not None and legacy is not None and reasoning != legacy:
        raise RowError(f"conflicting reasoning: {where} has both 'reasoning' and 'reasoning_content' and they "
                       "differ; keep one", f"{where}.reasoning")
    return reasoning if reasoning is not None else legacy


def _copy_token_ids(turn: dict[str, Any], new: dict[str, Any], where: str) -> None:
    """An assistant turn's ``token_ids`` (``peagle-data regenerate`` writes the ids the verifier
    generated): kept, a list of ints >= 0, so that ``tokenize`` checks the turn's text re-tokenizes
    to exactly them; anything else rejects the row."""
    ids = turn.get("token_ids")
    if ids is None or new["role"] != "assistant":
        return
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise RowError(f"invalid token_ids: {where}.token_ids must be a list of token ids (ints >= 0)",
                       f"{where}.token_ids")
    new["token_ids"] = ids


def _copy_weight(turn: dict[str, Any], new: dict[str, Any], where: str) -> None:
    """An assistant turn's ``weight`` (OpenAI fine-tuning format; axolotl's ShareGPT turns): 0 keeps
    the turn as context without supervising it (``"weight": 0`` on ``new``), 1 or absent supervises
    it; anything else rejects the row."""
    weight = turn.get("weight")
    if weight is None or new["role"] != "assistant":
        return
    if isinstance(weight, bool) or weight not in (0, 1):
        raise RowError(f"invalid weight: {where}.weight is {weight!r} (0 leaves an assistant turn unsupervised, "
                       "1 supervises it)", f"{where}.weight")
    if weight == 0:
        new["weight"] = 0


def _copy_finish_reason(turn: dict[str, Any], new: dict[str, Any], where: str) -> None:
    """An assistant turn's ``finish_reason`` (OpenAI's name; ``peagle-data regenerate`` writes it):
    ``"length"`` marks a reply cut at a token limit, so the end-of-turn token the template renders
    after it is not the verifier's and is not supervised (``"finish_reason": "length"`` on ``new``);
    ``"stop"``, ``"tool_calls"``, ``"function_call"`` or absent is a complete reply; anything else
    (``"content_filter"``: cut by a filter) rejects the row."""
    reason = turn.get("finish_reason")
    if reason in (None, "stop", "tool_calls", "function_call") or new["role"] != "assistant":
        return
    if reason != "length":
        raise RowError(f"invalid finish_reason: {where}.finish_reason is {reason!r} (\"length\": the reply was "
                       "cut at a token limit; \"stop\", \"tool_calls\": it is complete)", f"{where}.finish_reason")
    new["finish_reason"] = "length"


def _sharegpt_calls(value: str, where: str, stats: dict[str, int]) -> list[dict[str, Any]]:
    """The OpenAI ``tool_calls`` of a ShareGPT ``function_call`` turn (Glaive, LLaMA-Factory): its value
    is a JSON object ``{"name", "arguments"}`` or a list of them (parallel calls); ``arguments`` may be
    JSON text (decoded, :func:`_decode_arguments`). Counted as ``sharegpt_function_calls``.

    Raises:
        RowError: the value is not JSON, or a call has no function name (names the turn).
    """
    try:
        calls = json.loads(value)
    except (json.JSONDecodeError, RecursionError):
        raise RowError(f"invalid tool call: {where}.value of a function_call turn is not JSON (expected "
                       '{"name": ..., "arguments": {...}} or a list of them)', f"{where}.value") from None
    out = []
    for k, call in enumerate(calls if isinstance(calls, list) else [calls]):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            at = f"{where}.value" if not isinstance(calls, list) else f"{where}.value[{k}]"
            raise RowError(f"invalid tool call: {at} of a function_call turn has no function name", at)
        _check_argument_keys(call, f"{where}.value" if not isinstance(calls, list) else f"{where}.value[{k}]")
        entry = {"type": "function", "function": {"name": call["name"], "arguments": _first(call, "arguments")}}
        if call.get("id") is not None:
            entry["id"] = call["id"]
        out.append(_decode_arguments(entry, stats, f"{where}.value" if not isinstance(calls, list)
                                     else f"{where}.value[{k}]"))
    if not out:
        raise RowError(f"invalid tool call: {where}.value of a function_call turn is an empty list", f"{where}.value")
    stats["sharegpt_function_calls"] += len(out)
    return out


def _normalize_sharegpt(turns: Any, system: Any, stats: dict[str, int]) -> list[dict[str, Any]]:
    """ShareGPT turns as OpenAI messages; a ``function_call`` turn is an assistant message with
    ``tool_calls`` (content null), an ``observation`` (``tool``, ``function``) turn a ``tool`` message, so
    the verifier's own template renders them as it renders the same conversation in OpenAI form."""
    if not isinstance(turns, list):
        raise RowError(f"not a list: 'conversations' is a {type(turns).__name__}", "conversations")
    out: list[dict[str, Any]] = []
    if system is not None and system != "":
        out.append({"role": "system", "content": _check_text(system, "system")})
    for i, turn in enumerate(turns):
        where = f"conversations[{i}]"
        if not isinstance(turn, dict):
            raise RowError(f"turn not an object: {where} is a {type(turn).__name__}", where)
        speaker = _first(turn, "from", "role")
        role = _SHAREGPT_ROLES.get(speaker.lower() if isinstance(speaker, str) else speaker)
        if role is None:
            raise RowError(f"unknown role: {speaker!r} in {where}.from", f"{where}.from")
        value = _first(turn, "value", "content")
        if value is None:
            state = "is null" if ("value" in turn or "content" in turn) else "is missing"
            raise RowError(f"turn with no content: {where}.value {state}", f"{where}.value")
        value = _check_text(value, f"{where}.value")
        if role == "function_call":
            out.append({"role": "assistant", "content": None, "tool_calls": _sharegpt_calls(value, where, stats)})
        else:
            out.append({"role": role, "content": value})
            stats["sharegpt_observations"] += role == "tool"
        _copy_weight(turn, out[-1], where)
        _copy_finish_reason(turn, out[-1], where)
        _copy_token_ids(turn, out[-1], where)
    return out


def _parse_tools(tools: Any, stats: dict[str, int]) -> list[Any] | None:
    """The row's tool list. A list entry, or a function's ``parameters``, given as JSON text is
    decoded when it holds a JSON object (``tool_schemas_decoded``), like tool-call arguments; an
    entry that is not a JSON object rejects the row. A bare function schema ``{"name", "description",
    "parameters"}`` (Glaive, LLaMA-Factory) is wrapped as ``{"type": "function", "function": ...}``, the
    form an OpenAI client sends and vLLM passes to the template (``tool_schemas_wrapped``); a tool
    vLLM's request model refuses rejects the row (:func:`_check_tool`)."""
    if tools is None or tools == "" or tools == []:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise RowError(f"invalid tools: not JSON ({e.msg})", "tools") from None
    if isinstance(tools, dict):
        tools = [tools]
    if not isinstance(tools, list):
        raise RowError(f"invalid tools: a {type(tools).__name__}, expected a list", "tools")
    out = []
    for k, tool in enumerate(tools):
        if isinstance(tool, str):
            tool = _json_object(tool)
            if tool is None:
                raise RowError(f"invalid tools: tools[{k}] is text that is not a JSON object", f"tools[{k}]")
            stats["tool_schemas_decoded"] += 1
        if not isinstance(tool, dict):
            raise RowError(f"invalid tools: tools[{k}] is a {type(tool).__name__}, expected an object", f"tools[{k}]")
        if tool.get("function") is None and tool.get("type") is None and isinstance(tool.get("name"), str):
            tool = {"type": "function", "function": tool}  # a bare schema (Glaive): as a client sends it to vLLM
            stats["tool_schemas_wrapped"] += 1
        fn = tool.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("parameters"), str) and _json_object(fn["parameters"]):
            tool = {**tool, "function": {**fn, "parameters": _json_object(fn["parameters"])}}
            stats["tool_schemas_decoded"] += 1
        out.append(_check_tool(tool, f"tools[{k}]"))
    return out or None


def _check_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """``tool`` when vLLM's request model takes it (``{"type": "function", "function": {"name": str,
    "description": str, "parameters": object}}``, the type optional, description and parameters
    optional), else a RowError naming the field: vLLM refuses such a request, so no template render
    of it is the served one."""
    fn = tool.get("function")
    if tool.get("type", "function") != "function" or not isinstance(fn, dict):
        raise RowError(f"invalid tools: {where} is not a function tool (expected {{\"type\": \"function\", "
                       f"\"function\": {{\"name\", \"description\", \"parameters\"}}}} or a bare "
                       f"{{\"name\", \"parameters\"}} schema)", where)
    if not isinstance(fn.get("name"), str):
        raise RowError(f"invalid tools: {where}.function has no name", f"{where}.function.name")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise RowError(f"invalid tools: {where}.function.description is a {type(fn['description']).__name__}, "
                       "expected text", f"{where}.function.description")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise RowError(f"invalid tools: {where}.function.parameters is not a JSON object",
                       f"{where}.function.parameters")
    return tool


def _merged(first: str | list, second: str | list) -> str | list:
    """The content of two consecutive user turns merged into one: their texts joined with ``"\n\n"``
    (the last part of the first and the first part of the second, for lists of text parts)."""
    if isinstance(first, str) and isinstance(second, str):
        return first + "\n\n" + second
    a, b = content_texts(first), content_texts(second)
    if not a or not b:
        return _parts_content(a + b)
    return _parts_content(a[:-1] + [a[-1] + "\n\n" + b[0]] + b[1:])


def _tidy(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Drop leading assistant turns, merge consecutive user turns, check there is a non-empty assistant."""
    counts = {"dropped_leading_assistant": 0, "merged_user_turns": 0, "empty_assistant_turns": 0,
              "weight_zero_turns": 0, "cut_assistant_turns": 0}
    if not messages:
        raise RowError("empty conversation")
    out: list[dict[str, Any]] = []
    seen_user = False
    for msg in messages:
        role = msg["role"]
        if role == "assistant" and not seen_user:
            counts["dropped_leading_assistant"] += 1
            continue
        if role == "user":
            if seen_user and out and out[-1]["role"] == "user":
                out[-1] = {**out[-1], "content": _merged(out[-1]["content"], msg["content"])}
                counts["merged_user_turns"] += 1
                continue
            seen_user = True
        if role == "assistant" and is_empty_assistant(msg):
            counts["empty_assistant_turns"] += 1
        elif role == "assistant" and msg.get("weight") == 0:
            counts["weight_zero_turns"] += 1
        elif role == "assistant" and msg.get("finish_reason") == "length":
            counts["cut_assistant_turns"] += 1
        out.append(msg)
    assistants = [m for m in out if m["role"] == "assistant"]
    if not assistants:
        raise RowError("only a leading assistant turn (dropped)" if counts["dropped_leading_assistant"]
                      else "no assistant turn")
    if all(is_empty_assistant(m) for m in assistants):
        raise RowError("no supervised tokens: every assistant turn is empty")
    if all(is_unsupervised(m) for m in assistants):
        raise RowError("no supervised tokens: every assistant turn is empty or has weight 0")
    return out, counts


def is_empty_assistant(msg: dict[str, Any]) -> bool:
    """An assistant message with no text, reasoning or tool calls: it supervises no token.

    Whitespace-only text or reasoning is empty too: templates that trim render such a turn as a bare
    end-of-turn token, others as whitespace and end-of-turn; neither is a reply to learn.
    """
    def blank(value: Any) -> bool:
        return value is None or (isinstance(value, str) and not value.strip())

    return blank(content_text(msg.get("content"))) and blank(msg.get("reasoning_content")) and not msg.get("tool_calls")


def is_unsupervised(msg: dict[str, Any]) -> bool:
    """An assistant message that supervises no token: empty, or marked ``"weight": 0`` (context only)."""
    return is_empty_assistant(msg) or msg.get("weight") == 0


ROW_COUNTS = ("tool_arguments_decoded", "tool_calls_wrapped", "tool_schemas_decoded", "tool_schemas_wrapped",
              "sharegpt_function_calls", "sharegpt_observations", "dropped_content_parts")
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
        RowError: the row cannot be used; ``read_conversations`` turns it into a Reject.
    """
    stats = {k: 0 for k in ROW_COUNTS if keep_dropped or k != "dropped_content_parts"}
    if fmt == "auto":
        if "messages" in record and record["messages"] is not None:
            fmt = "openai"
        elif "conversations" in record and record["conversations"] is not None:
            fmt = "sharegpt"
        else:
            raise RowError("unknown format: the row has neither 'messages' nor 'conversations'", "messages")
    if fmt == "openai":
        if "messages" not in record:
            raise RowError("missing field: --format openai needs 'messages'", "messages")
        msgs = record["messages"]
        # Some datasets store ShareGPT turns under "messages".
        if isinstance(msgs, list) and msgs and isinstance(msgs[0], dict) and msgs[0].get("from") is not None \
                and msgs[0].get("role") is None:
            messages = _normalize_sharegpt(msgs, record.get("system"), stats)
        else:
            messages = _normalize_openai(msgs, stats)
    elif fmt == "sharegpt":
        if "conversations" not in record:
            raise RowError("missing field: --format sharegpt needs 'conversations'", "conversations")
        messages = _normalize_sharegpt(record["conversations"], record.get("system"), stats)
    else:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    tools = _parse_tools(record.get("tools"), stats)
    messages, counts = _tidy(messages)
    stats["weight_zero_turns"] = counts.pop("weight_zero_turns")
    stats["cut_assistant_turns"] = counts.pop("cut_assistant_turns")
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
