"""Content a chat template does not render (docs/design.md §3): every message's parts must appear in
the render; a dropped part rejects the row, or with ``on_dropped="keep"`` is listed and kept."""

from __future__ import annotations

import bisect
import json
from typing import Any, Sequence

from runtime.chat.chat_template import ChatTemplate, content_texts, render

__all__ = ["dropped_content", "dropped_reason", "thought_in"]


_ADVICE = {
    "tools": "the template ignores the tools list",
    "tool_calls": "the template has no tool-call support",
    "reasoning_content": "the template does not render reasoning",
}


_TOKENIZE_ADVICE = ("pass --chat-template FILE with a template that renders it, or --on-dropped-content keep to keep "
                    "the row without it (counted in the manifest)")


def dropped_reason(messages, i: int | None, part: str, n: int, advice: str = _TOKENIZE_ADVICE) -> str:
    """The reject reason of ``n`` dropped parts, naming the first: ``part`` of message ``i`` (None: the tools)."""
    what = "the tools passed with the conversation" if i is None else f"the {part} of message {i} ({messages[i]['role']})"
    why = _ADVICE.get(part, "the template does not render it")
    more = f" (and {n - 1} more dropped part{'s' if n > 2 else ''})" if n > 1 else ""
    return f"template drops {part}: {what} {'do' if i is None else 'does'} not appear in the render ({why}){more}; {advice}"


def thought_in(content: Any) -> str:
    """The reasoning written inline in an assistant's content (``<think>...</think>``), stripped."""
    if not isinstance(content, str) or "</think>" not in content:
        return ""
    return content.split("</think>")[0].split("<think>")[-1].strip()


def _alternatives(value: Any) -> tuple[str, ...]:
    """Ways a scalar may appear in a render: as is, JSON-escaped, or as Python prints it."""
    if isinstance(value, str):
        return (value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1])
    return (json.dumps(value), str(value))


def _leaves(value: Any) -> list[tuple[str, ...]]:
    """The keys and non-empty scalars of a JSON value, each as its alternatives."""
    if isinstance(value, dict):
        return [a for k, v in value.items() for a in [_alternatives(str(k))] + _leaves(v)]
    if isinstance(value, list):
        return [a for v in value for a in _leaves(v)]
    return [] if value == "" else [_alternatives(value)]


def _message_parts(msg: dict[str, Any], supervised: bool) -> list[tuple[str, list[tuple[str, ...]]]]:
    """``[(part, needles)]`` of one message: a part is rendered when each needle (a tuple of
    alternative strings) appears. Reasoning is checked on supervised assistant turns only."""
    parts, needles = [], []
    for text in content_texts(msg.get("content")):  # each text part: templates join parts their own way
        thought = thought_in(text)
        answer = text.rsplit("</think>", 1)[-1].strip()
        needles += [_alternatives(answer)] if answer else []  # escaped: templates that apply tojson to content
        if thought and supervised:
            needles.append(_alternatives(thought))
    if needles:
        parts.append(("content", needles))
    if msg.get("role") != "assistant":
        return parts
    reasoning = (msg.get("reasoning_content") or "").strip()
    if reasoning and supervised:
        parts.append(("reasoning_content", [_alternatives(reasoning)]))
    calls = []
    for call in msg.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call.get("function"), dict) else call
        if isinstance(fn.get("name"), str):
            calls.append((fn["name"],))
        args = fn.get("arguments")
        calls += [(args.strip(), json.dumps(args)[1:-1])] if isinstance(args, str) and args.strip() else \
            _leaves(args) if isinstance(args, (dict, list)) else []
    if calls:
        parts.append(("tool_calls", calls))
    return parts


def dropped_content(tokenizer, messages: Sequence[dict[str, Any]], text: str, spans: dict[int, tuple[int, int]],
                    tools: list | None = None, chat_template: str | ChatTemplate | None = None,
                    ) -> list[tuple[int | None, str, bool]]:
    """Message content that the chat template does not render.

    A message's part (``content``, ``reasoning_content``, ``tool_calls``) is rendered when its text
    appears in the render: for a supervised assistant turn (``i in spans``) inside its own span,
    for any other message anywhere in ``text`` (templates move a system message into a user
    turn). Text is compared stripped (templates trim); a tool call needs its name and every key
    and scalar of its arguments (as is, JSON-escaped or printed by Python). Each needle claims the
    characters it is found at, and a later needle must be found in characters nobody claimed: text
    that appears twice in a conversation (a tool result "Sunny" that the answer repeats, a
    repeated user message, a tool name the turn's own text mentions) is rendered only when it
    appears as often as the messages hold it. Supervised turns claim first, inside their spans
    (longest needle first); then the other messages' needles, longest first, outside every
    supervised span. The reasoning of an assistant turn that is only context (earlier turns of a
    per-turn row) is not checked: templates drop earlier reasoning by design. ``tools`` are
    dropped when the render without them is the same.

    Args:
        messages, tools, chat_template: what was rendered.
        text: the render of ``messages``.
        spans: assistant message index -> ``(start, end)`` characters of its supervised span.

    Returns:
        ``[(message index or None for tools, part, lost_all)]``; ``lost_all`` is True for a
        supervised assistant turn none of whose parts appear (its span is template glue only).
    """
    out: list[tuple[int | None, str, bool]] = []
    if tools and render(tokenizer, messages, None, chat_template) == text:
        out.append((None, "tools", False))
    parts_of = [_message_parts(msg, i in spans) for i, msg in enumerate(messages)]
    longest_first = lambda item: -max(len(alt) for alt in item[2])  # noqa: E731
    needles = [sorted(((i, part, needle) for part, ns in parts_of[i] for needle in ns), key=longest_first)
               for i in sorted(spans)]
    needles.append(sorted(((i, part, needle) for i in range(len(messages)) if i not in spans
                           for part, ns in parts_of[i] for needle in ns), key=longest_first))
    claimed = _Claims(sorted(spans.values()))
    missing = {(i, part) for group in needles for i, part, needle in group
               if not claimed.claim(text, needle, *(spans[i] if i in spans else (0, len(text))), i in spans)}
    for i in range(len(messages)):
        lost = [part for part, _ in parts_of[i] if (i, part) in missing]
        lost_all = i in spans and bool(parts_of[i]) and len(lost) == len(parts_of[i])
        out += [(i, part, lost_all) for part in lost]
    return out


class _Claims:
    """Disjoint claimed character intervals of a render (:func:`dropped_content`).

    ``spans`` are the supervised turns' spans: closed to other messages' needles, open to their
    own turn's needles, which claim inside them.
    """

    def __init__(self, spans: list[tuple[int, int]]):
        self._spans = spans
        self._taken: list[tuple[int, int]] = []  # sorted, disjoint

    def _free(self, a: int, b: int, inside_span: bool) -> bool:
        k = bisect.bisect_right(self._taken, (a, b))
        if k > 0 and self._taken[k - 1][1] > a:
            return False
        if k < len(self._taken) and self._taken[k][0] < b:
            return False
        return inside_span or not any(s < b and a < e for s, e in self._spans)

    def claim(self, text: str, needle: tuple[str, ...], lo: int, hi: int, inside_span: bool) -> bool:
        """Claim the first unclaimed occurrence in ``text[lo:hi]`` of any alternative of ``needle``."""
        for alt in needle:
            if not alt:
                return True
            at = text.find(alt, lo, hi)
            while at >= 0:
                if self._free(at, at + len(alt), inside_span):
                    bisect.insort(self._taken, (at, at + len(alt)))
                    return True
                at = text.find(alt, at + 1, hi)
        return False
