"""Chat templates and loss masks (DESIGN.md §3) on any template, without ``{% generation %}`` tags.

Method, for one conversation of T tokens:

1. Render the whole conversation once as text (``apply_chat_template(..., tokenize=False)``).
2. For every assistant turn i, render ``messages[:i]`` with the generation prompt (``P_i``) and
   ``messages[:i+1]`` (``Q_i``) (jinja renders only: cheap next to tokenization). Both must be
   string prefixes of the full render. The assistant's span is the characters
   ``[len(P_i), len(Q_i))``: what the verifier generates after the generation prompt, as rendered
   (content, reasoning, tool-call text), and whatever the template appends to close the turn.
   When a check fails the template rewrites history (it renders earlier turns differently once
   later ones exist, like Qwen3 dropping earlier reasoning). A mask is never guessed:
   :func:`tokenize_conversation` rejects the row ("template rewrites history"), and
   :func:`tokenize_turns` / :func:`render_rows` make one row per assistant turn i from
   ``messages[:i+1]`` (the context the verifier saw when it generated that turn), each supervising
   only its last turn, or reject it if even that fails.
3. Tokenize the rendered texts in one batched call with offsets. A token is supervised (mask 1)
   when it starts inside the span and no later than the span's end-of-turn token, the last
   special/added token in the span (``<|im_end|>`` in ChatML). What follows the end-of-turn token
   inside the span (ChatML's trailing ``"\\n"``) is template glue the verifier never generates:
   mask 0. A span with no special token is supervised whole. An empty think block
   (``<think></think>`` with only whitespace) that opens the span of a turn without
   ``reasoning_content`` was injected by the template, not generated: mask 0. An assistant turn
   with empty content (no text, reasoning or tool calls), or marked ``"weight": 0``, supervises
   nothing, not even its end-of-turn token: all its tokens have mask 0 (it stays in the context).
4. ``apply_chat_template(messages, tokenize=True)`` tokenizes the same render with
   ``add_special_tokens=False``, so the ids are identical by construction (tests check it on five
   template families); they are not tokenized twice at run time.

Three more checks keep a mask from being silently wrong:

- a template whose generation prompt adds text the rendered assistant turn does not start with
  (R1-Distill: the prompt ends with ``<think>\n``, rendered turns keep only the text after
  ``</think>``) has no exact span: the row is rejected as "generation prompt mismatch", naming the
  injected text and the fix (``--chat-template`` with a training template that keeps the reasoning);
- every message's content must appear in the render (:func:`dropped_content`): tool calls, tool
  results, reasoning, a system message, the ``tools`` list. A template that drops one (SmolLM2's
  ChatML renders a tool-call turn as a bare ``<|im_end|>``) rejects the row ("template drops
  tool_calls: ..."), or, with ``on_dropped="keep"``, keeps it with the dropped parts listed; an
  assistant turn of which nothing is rendered then supervises nothing;
- a token across a span's boundary (:func:`straddling_token`: a generation prompt ending in a space
  makes ``" Hello"`` start in the prompt; a turn without an end-of-turn token can merge into the
  next one) rejects the row ("reply starts inside a token", "a supervised token ends past its
  assistant turn") instead of dropping the reply's first token or training the next turn's text.

``system_len`` is the number of leading tokens that form the system prefix (BOS, the system turn,
or the default system text a template injects): the common prefix of two renders of the
conversation's system messages plus a first user turn with different sentinel contents, minus the
user-turn header (what a second user turn adds before its content).
"""

from __future__ import annotations

import bisect
import itertools
import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from peagle_data.readers import is_unsupervised as _is_unsupervised
from stores.errors import InputError

__all__ = ["ChatTemplateError", "TokenizedConversation", "RenderedRow", "render_rows", "tokenize_rendered",
           "dropped_content", "DROPPED", "straddling_token",
           "tokenize_conversation", "tokenize_turns", "system_prefix_text",
           "chat_template_sha256",
           "effective_chat_template"]

_SENTINELS = ("Q7Xz sentinel alpha", "K3Jw sentinel beta", "Z9qv sentinel gamma")


class ChatTemplateError(InputError):
    """A conversation cannot be rendered or masked exactly with this chat template (a reject reason)."""


@dataclass(frozen=True)
class TokenizedConversation:
    """One conversation as tokens.

    Attributes:
        input_ids: int32 ``[T]``, identical to ``apply_chat_template(messages, tokenize=True)``.
        loss_mask: uint8 ``[T]``, 1 on assistant tokens as rendered and their end-of-turn token.
        system_len: leading tokens that form the system prefix (loss 0), ``0 <= system_len <= T``.
        problem: why no exact mask exists (a token that straddles a supervised span's boundary, see
            :func:`straddling_token`), or None; such a row is a reject.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    system_len: int
    problem: str | None = None


def effective_chat_template(tokenizer, chat_template: str | None = None) -> str:
    """The template text actually used (the override, else the tokenizer's own).

    Raises:
        InputError: the tokenizer has no chat template and none is given.
    """
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if template is None:
        raise InputError("the tokenizer has no chat template; pass one with --chat-template FILE")
    return template if isinstance(template, str) else json.dumps(template, sort_keys=True)


def chat_template_sha256(tokenizer, chat_template: str | None = None) -> str:
    """sha256 hex digest of the effective chat template text (recorded in manifests)."""
    import hashlib

    return hashlib.sha256(effective_chat_template(tokenizer, chat_template).encode("utf-8")).hexdigest()


def _render(tokenizer, messages, tools, chat_template, add_generation_prompt=False) -> str:
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if tools is not None:
        kwargs["tools"] = tools
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    try:
        if not messages:  # apply_chat_template refuses an empty history; the renderer does not
            from transformers.utils.chat_template_utils import render_jinja_template

            rendered, _ = render_jinja_template(
                conversations=[[]], tools=tools, chat_template=tokenizer.get_chat_template(chat_template, tools),
                add_generation_prompt=add_generation_prompt, **tokenizer.special_tokens_map)
            return rendered[0]
        return tokenizer.apply_chat_template(list(messages), **kwargs)
    except Exception as e:  # jinja errors, raise_exception() in templates, type errors on content
        raise ChatTemplateError(f"template error: {type(e).__name__}: {e}") from None


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _special_ids(tokenizer) -> frozenset[int]:
    # Cached on the tokenizer, keyed by its size: adding tokens (or a deep copy that does) refreshes it.
    size = len(tokenizer)
    cached = getattr(tokenizer, "_peagle_special_ids", None)
    if cached is None or cached[0] != size:
        ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids.update(getattr(tokenizer, "added_tokens_decoder", {}).keys())
        cached = (size, frozenset(ids))
        try:
            tokenizer._peagle_special_ids = cached
        except AttributeError:
            pass
    return cached[1]


def system_prefix_text(tokenizer, system_messages: Sequence[dict[str, Any]], tools=None,
                       chat_template: str | None = None) -> str:
    """Text of the system prefix the template renders for these leading system messages.

    Returns the common prefix of ``render(system + [user S1])`` and ``render(system + [user S2])``
    with the user-turn header stripped when it ends that prefix (templates that put the system
    text inside the first user turn, like Gemma, keep the header: it belongs to the prefix).
    """
    system_messages = list(system_messages)
    r1 = _render(tokenizer, system_messages + [{"role": "user", "content": _SENTINELS[0]}], tools, chat_template)
    r2 = _render(tokenizer, system_messages + [{"role": "user", "content": _SENTINELS[1]}], tools, chat_template)
    prefix = r1[:_common_prefix_len(r1, r2)]
    # The user-turn header: what a second user turn adds between the end of the assistant turn
    # before it and its content. The assistant turn's end is located by its (sentinel) content and
    # the glue the template closes it with, so templates that render a final assistant turn
    # differently (Qwen3's injected think block) still give the header.
    base_msgs = system_messages + [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINELS[2]}]
    try:
        base = _render(tokenizer, base_msgs, tools, chat_template)
        h1 = _render(tokenizer, base_msgs + [{"role": "user", "content": _SENTINELS[0]}], tools, chat_template)
        h2 = _render(tokenizer, base_msgs + [{"role": "user", "content": _SENTINELS[1]}], tools, chat_template)
    except ChatTemplateError:
        return prefix
    if _SENTINELS[2] not in base:
        return prefix
    closing = _SENTINELS[2] + base[base.rindex(_SENTINELS[2]) + len(_SENTINELS[2]):]
    before_content = h1[:_common_prefix_len(h1, h2)]
    at = before_content.rfind(closing)
    if at >= 0:
        header = before_content[at + len(closing):]
        if header and prefix.endswith(header):
            prefix = prefix[: len(prefix) - len(header)]
    return prefix


_PREFIX_CACHE_MAX = 256


def _cached_system_prefix(tokenizer, system_messages, tools, chat_template) -> str:
    cache = getattr(tokenizer, "_peagle_prefix_cache", None)
    if cache is None:
        cache = {}
        try:
            tokenizer._peagle_prefix_cache = cache
        except AttributeError:
            pass
    key = json.dumps([system_messages, tools, chat_template], sort_keys=True, default=str)
    if key not in cache:
        if len(cache) >= _PREFIX_CACHE_MAX:
            cache.clear()
        cache[key] = system_prefix_text(tokenizer, system_messages, tools, chat_template)
    return cache[key]


@dataclass(frozen=True)
class RenderedRow:
    """One row to tokenize: the rendered text and the character spans to supervise.

    Attributes:
        text: the chat template's render of the row's messages.
        spans: ``[(start, end)]`` characters of every supervised assistant turn, in order.
        prefix_chars: characters of ``text`` that form the system prefix.
        turn: index of the supervised assistant message for a per-turn row, else None.
        empty_think: ``[(start, end)]`` characters of template-injected empty think blocks (loss 0).
        dropped: message content the template does not render, kept by ``on_dropped="keep"``:
            ``"tools"`` or ``"<part> of message <i>"`` (part: content, reasoning_content, tool_calls).
    """

    text: str
    spans: tuple[tuple[int, int], ...]
    prefix_chars: int
    turn: int | None = None
    empty_think: tuple[tuple[int, int], ...] = ()
    dropped: tuple[str, ...] = ()


_EMPTY_THINK = re.compile(r"<think>\s*</think>\s*")


class _PrefixRenderer:
    """Renders prefixes ``messages[:n]`` of one conversation with the compiled template directly.

    ``apply_chat_template`` converts the whole message list on every call; here the conversion
    (transformers' own helpers) is done once per conversation and each prefix is one jinja render,
    with the same inputs ``apply_chat_template`` passes. Only used to locate spans: the full text
    always comes from ``apply_chat_template``, and a failed prefix check is re-checked with it.
    Any problem (another transformers version, callable tools) falls back to ``_render``.
    """

    def __init__(self, tokenizer, messages, tools, chat_template):
        self._fallback = (tokenizer, messages, tools, chat_template)
        self._compiled = None
        try:
            from transformers.utils.chat_template_utils import (
                _alias_reasoning_fields, _compile_jinja_template, _plain_template_data)

            if tools is not None and not all(isinstance(t, dict) for t in tools):
                return
            self._compiled = _compile_jinja_template(tokenizer.get_chat_template(chat_template, tools))
            self._chat = _alias_reasoning_fields(_plain_template_data(list(messages)))
            self._tools = _plain_template_data(tools)
            self._kwargs = _plain_template_data(dict(tokenizer.special_tokens_map))
        except Exception:  # noqa: BLE001 - any private-API mismatch means: use the public path
            self._compiled = None

    def render(self, n: int, add_generation_prompt: bool) -> str:
        if self._compiled is not None and n > 0:
            try:
                return self._compiled.render(messages=self._chat[:n], tools=self._tools, documents=None,
                                             add_generation_prompt=add_generation_prompt, **self._kwargs)
            except Exception:  # noqa: BLE001 - template errors are reported by the public path
                pass
        tokenizer, messages, tools, chat_template = self._fallback
        return _render(tokenizer, messages[:n], tools, chat_template, add_generation_prompt)


def _assistant_span(tokenizer, messages, i, text, tools, chat_template,
                    renderer: _PrefixRenderer | None = None) -> tuple[int, int] | None:
    """Characters of assistant turn ``i`` in ``text`` by the prefix method, or None when the renders
    of ``messages[:i]`` (with the generation prompt) and ``messages[:i+1]`` are not prefixes of it."""
    if renderer is not None:
        before, through = renderer.render(i, True), renderer.render(i + 1, False)
        if text.startswith(before) and text.startswith(through) and len(through) >= len(before):
            return len(before), len(through)
    before = _render(tokenizer, messages[:i], tools, chat_template, add_generation_prompt=True)
    through = _render(tokenizer, messages[: i + 1], tools, chat_template)
    if text.startswith(before) and text.startswith(through) and len(through) >= len(before):
        return len(before), len(through)
    return None


def _empty_think(messages, indices, text, spans) -> tuple[tuple[int, int], ...]:
    """Empty ``<think></think>`` blocks a template injected at the start of a turn without reasoning."""
    out = []
    for i, (a, b) in zip(indices, spans):
        if messages[i].get("reasoning_content"):
            continue
        m = _EMPTY_THINK.match(text, a, b)
        if m and "<think>" not in str(messages[i].get("content") or "")[:16]:
            out.append((a, m.end()))
    return tuple(out)


def _prefix_chars(tokenizer, messages, text, tools, chat_template) -> int:
    system_msgs = []
    for m in messages:
        if m.get("role") != "system":
            break
        system_msgs.append(m)
    prefix = _cached_system_prefix(tokenizer, system_msgs, tools, chat_template)
    return _common_prefix_len(prefix, text[: len(prefix)])


DROPPED = ("reject", "keep")
"""What :func:`render_rows` does with message content the template does not render."""


def render_rows(tokenizer, messages: Sequence[dict[str, Any]], tools: list | None = None,
                chat_template: str | None = None, per_turn_fallback: bool = True,
                on_dropped: str = "reject") -> list[RenderedRow]:
    """Render one conversation and locate its assistant spans (no tokenization).

    The whole conversation is one row when every assistant turn's prefix renders are prefixes of
    the full render. Otherwise the template rewrites history (for example it drops earlier turns'
    reasoning): with ``per_turn_fallback`` the conversation becomes one row per assistant turn
    ``i``, rendered from ``messages[:i+1]`` (its own context, as the verifier saw it) and
    supervising only that last turn; each such row must pass the prefix check itself.

    Every row is then checked for content the template drops (:func:`dropped_content`): with
    ``on_dropped="reject"`` the first one raises; with ``"keep"`` the row is kept, the dropped
    parts are listed in ``RenderedRow.dropped``, and an assistant turn of which nothing is
    rendered supervises nothing (its span is only template glue).

    Raises:
        ChatTemplateError: "template error"; "template rewrites history" or "generation prompt
            mismatch" when no exact mask exists; "template drops <part>" (``on_dropped="reject"``).
    """
    if on_dropped not in DROPPED:
        raise ValueError(f"on_dropped must be one of {DROPPED}, got {on_dropped!r}")
    messages = list(messages)
    text = _render(tokenizer, messages, tools, chat_template)
    indices = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    spans = []
    renderer = _PrefixRenderer(tokenizer, messages, tools, chat_template)
    for i in indices:
        span = _assistant_span(tokenizer, messages, i, text, tools, chat_template, renderer)
        if span is None:
            break
        spans.append(span)
    else:
        return [_checked_row(tokenizer, messages, tools, chat_template, text, dict(zip(indices, spans)),
                             None, on_dropped)]
    first_bad = indices[len(spans)]
    if not per_turn_fallback:
        raise ChatTemplateError(_no_prefix_reason(tokenizer, messages, first_bad, text, tools, chat_template,
                                                  "the render up to assistant turn {i} is not a prefix of the "
                                                  "whole conversation's render"))
    rows = []
    for i in indices:
        if _is_unsupervised(messages[i]):  # empty or weight 0: supervises nothing, no row of its own
            continue
        sub = messages[: i + 1]
        sub_text = _render(tokenizer, sub, tools, chat_template)
        span = _assistant_span(tokenizer, sub, i, sub_text, tools, chat_template)
        if span is None:
            raise ChatTemplateError(_no_prefix_reason(
                tokenizer, sub, i, sub_text, tools, chat_template,
                "even rendered alone, the context of assistant turn {i} is not a prefix of its own render"))
        row = _checked_row(tokenizer, sub, tools, chat_template, sub_text, {i: span}, i, on_dropped)
        if row.spans:
            rows.append(row)
    if not rows:
        raise ChatTemplateError("no supervised tokens: every assistant turn is empty")
    return rows


def _checked_row(tokenizer, messages, tools, chat_template, text: str, spans: dict[int, tuple[int, int]],
                 turn: int | None, on_dropped: str) -> RenderedRow:
    """The row of ``messages`` rendered as ``text`` supervising ``spans`` (assistant index -> span),
    after the dropped-content check; raises ChatTemplateError on a drop with ``on_dropped="reject"``."""
    dropped = dropped_content(tokenizer, messages, text, spans, tools, chat_template)
    if dropped and on_dropped == "reject":
        i, part, lost_all = dropped[0]
        raise ChatTemplateError(_dropped_reason(messages, i, part, len(dropped)))
    silent = {i for i, _, lost_all in dropped if lost_all}
    kept = [(i, span) for i, span in spans.items()
            if not _is_unsupervised(messages[i]) and i not in silent]
    kept_indices, kept_spans = [i for i, _ in kept], [span for _, span in kept]
    if not kept_spans and turn is None and dropped:
        raise ChatTemplateError("no supervised tokens: the template renders no content of any assistant turn")
    return RenderedRow(text, tuple(kept_spans), _prefix_chars(tokenizer, messages, text, tools, chat_template),
                       turn, _empty_think(messages, kept_indices, text, kept_spans),
                       tuple(("tools" if i is None else f"{part} of message {i}") for i, part, _ in dropped))


_ADVICE = {
    "tools": "the template ignores the tools list",
    "tool_calls": "the template has no tool-call support",
    "reasoning_content": "the template does not render reasoning",
}


def _dropped_reason(messages, i: int | None, part: str, n: int) -> str:
    what = "the tools passed with the conversation" if i is None else f"the {part} of message {i} ({messages[i]['role']})"
    why = _ADVICE.get(part, "the template does not render it")
    more = f" (and {n - 1} more dropped part{'s' if n > 2 else ''})" if n > 1 else ""
    return (f"template drops {part}: {what} {'do' if i is None else 'does'} not appear in the render ({why}){more}; "
            "pass --chat-template FILE with a template that renders it, or --on-dropped-content keep to keep "
            "the row without it (counted in the manifest)")


def _thought_in(content: Any) -> str:
    """The reasoning written inline in an assistant's content (``<think>...</think>``), stripped."""
    if not isinstance(content, str) or "</think>" not in content:
        return ""
    return content.split("</think>")[0].split("<think>")[-1].strip()


def _no_prefix_reason(tokenizer, messages, i: int, text: str, tools, chat_template, detail: str) -> str:
    """Why assistant turn ``i`` has no exact span in ``text``: the generation prompt adds text the
    rendered turn does not start with (R1-Distill style templates), else history is rewritten."""
    default = "template rewrites history: " + detail.format(i=i)
    if i == 0:
        return default
    try:
        history = _render(tokenizer, messages[:i], tools, chat_template)
        prompt = _render(tokenizer, messages[:i], tools, chat_template, add_generation_prompt=True)
    except ChatTemplateError:
        return default
    if not (text.startswith(history) and prompt.startswith(history)) or text.startswith(prompt):
        return default
    added, turn = prompt[len(history):], text[len(history):]
    thought = (messages[i].get("reasoning_content") or "").strip() or _thought_in(messages[i].get("content"))
    stripped = (f", and it drops the reasoning of assistant turn {i} (rendered turns keep only the text after "
                "</think>, as R1-Distill templates do)") if thought and thought not in turn else ""
    return (f"generation prompt mismatch: the template's generation prompt adds {added!r} after the history, "
            f"but assistant turn {i} renders as {turn[:len(added) + 24]!r}...{stripped}; no exact mask exists. "
            "Pass --chat-template FILE with a training template that keeps the reasoning: each assistant turn "
            "rendered as the generation prompt followed by its reasoning and answer")


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
    parts = []
    content = (msg.get("content") or "") if isinstance(msg.get("content") or "", str) else ""
    thought = _thought_in(content)
    answer = content.rsplit("</think>", 1)[-1].strip()
    needles = [_alternatives(answer)] if answer else []  # escaped: templates that apply tojson to content
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
                    tools: list | None = None, chat_template: str | None = None,
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
    if tools and _render(tokenizer, messages, None, chat_template) == text:
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


def tokenize_rendered(tokenizer, rows: Sequence[RenderedRow]) -> list[TokenizedConversation]:
    """Tokenize rendered rows in one batched call and build their loss masks.

    The ids equal ``apply_chat_template(messages, tokenize=True)``: that call tokenizes the same
    render with ``add_special_tokens=False``, as here (the tests check it on every template family).

    Raises:
        InputError: the tokenizer is not a fast tokenizer (offsets are needed).
    """
    if not rows:
        return []
    if not getattr(tokenizer, "is_fast", False):
        raise InputError("loss masks need a fast tokenizer (offset mapping); this one is not")
    enc = tokenizer([r.text for r in rows], add_special_tokens=False, return_offsets_mapping=True)
    special = _special_ids(tokenizer)
    out = []
    for row, row_ids, row_offsets in zip(rows, enc["input_ids"], enc["offset_mapping"]):
        ids = np.fromiter(row_ids, dtype=np.int32, count=len(row_ids))
        offsets = np.fromiter(itertools.chain.from_iterable(row_offsets), dtype=np.int64,
                              count=2 * len(row_offsets)).reshape(-1, 2)  # [T, 2] chars
        loss_mask = _mask_from_spans(ids, offsets[:, 0], list(row.spans), special)
        if row.empty_think:
            loss_mask[_mask_from_spans(ids, offsets[:, 0], list(row.empty_think), frozenset()) == 1] = 0
        system_len = int(np.searchsorted(offsets[:, 1], row.prefix_chars, side="right"))
        supervised = np.flatnonzero(loss_mask)
        if supervised.size:
            system_len = min(system_len, int(supervised[0]))
        out.append(TokenizedConversation(input_ids=ids, loss_mask=loss_mask, system_len=system_len,
                                         problem=straddling_token(row, offsets, loss_mask)))
    return out


def straddling_token(row: RenderedRow, offsets: np.ndarray, loss_mask: np.ndarray) -> str | None:
    """Why a supervised span of ``row`` has no exact mask, or None.

    A token that starts before a span and ends inside it holds the generation prompt's last
    characters (or the previous message's) and the reply's first ones (a generation prompt ending in a space, ``"ASSISTANT: "``,
    gives ``" Hello"``): the rule "supervised when it starts inside the span" would silently drop the
    reply's first word, and supervising it would train the prompt's text. Likewise a supervised
    token that ends past its span holds text of the next turn. Only straddles whose part on the
    other side of the boundary holds non-whitespace count: a merged whitespace run (``"\n\n"``)
    loses or adds only whitespace.

    Args:
        offsets: int64 ``[T, 2]`` character ``[start, end)`` of every token in ``row.text``.
        loss_mask: uint8 ``[T]`` built from ``row.spans``.
    """
    starts, ends = offsets[:, 0], offsets[:, 1]
    text = row.text
    for a, b in row.spans:
        i = int(np.searchsorted(starts, a, side="left")) - 1  # the last token starting before the span
        if i >= 0 and ends[i] > a and text[a:min(int(ends[i]), b)].strip():
            return (f"reply starts inside a token: {text[int(starts[i]):int(ends[i])]!r} holds "
                    f"{text[int(starts[i]):a]!r} rendered before an assistant reply (the generation prompt's end or "
                    f"the previous message's) and {text[a:int(ends[i])]!r} of the reply, so the reply's first token "
                    "has no exact mask (a generation prompt that ends in a space does this); pass --chat-template "
                    "FILE with a generation prompt that ends where a token ends")
        lo, hi = int(np.searchsorted(starts, a, side="left")), int(np.searchsorted(starts, b, side="left"))
        inside = np.flatnonzero(loss_mask[lo:hi])
        t = lo + int(inside[-1]) if inside.size else -1
        if t >= 0 and ends[t] > b and text[b:int(ends[t])].strip():
            return (f"a supervised token ends past its assistant turn: {text[int(starts[t]):int(ends[t])]!r} "
                    f"holds {text[b:int(ends[t])]!r} of what follows the turn, so the turn has no exact mask; pass "
                    "--chat-template FILE with a template that ends assistant turns with an end-of-turn token")
    return None


def tokenize_conversation(tokenizer, messages: Sequence[dict[str, Any]], tools: list | None = None,
                          chat_template: str | None = None, on_dropped: str = "reject") -> TokenizedConversation:
    """Tokenize one conversation with its chat template and find its loss mask and system prefix.

    Args:
        tokenizer: a fast Hugging Face tokenizer (offsets are needed).
        messages: OpenAI messages (``role`` in system/user/assistant/tool), at least one assistant.
        tools: tool definitions passed to the template, or None.
        chat_template: template text overriding ``tokenizer.chat_template``, or None.
        on_dropped: ``reject`` or ``keep`` message content the template does not render (see
            :func:`render_rows`).

    Returns:
        A :class:`TokenizedConversation` (``input_ids`` int32 ``[T]``, ``loss_mask`` uint8 ``[T]``,
        ``system_len``).

    Raises:
        ChatTemplateError: the template fails on the messages ("template error") or rewrites earlier
            turns once later ones exist ("template rewrites history"; see :func:`tokenize_turns`), its
            generation prompt adds text the rendered turn lacks ("generation prompt mismatch"), or it
            drops message content ("template drops <part>", with ``on_dropped="reject"``).
        InputError: the tokenizer has no chat template or is not a fast tokenizer.
    """
    rows = render_rows(tokenizer, messages, tools, chat_template, per_turn_fallback=False, on_dropped=on_dropped)
    out = tokenize_rendered(tokenizer, rows)[0]
    if out.problem:
        raise ChatTemplateError(out.problem)
    return out


def tokenize_turns(tokenizer, messages: Sequence[dict[str, Any]], tools: list | None = None,
                   chat_template: str | None = None,
                   on_dropped: str = "reject") -> list[tuple[int | None, TokenizedConversation]]:
    """Like :func:`tokenize_conversation`, but a template that rewrites history gives one row per
    assistant turn, ``(turn index, row)``; a conversation tokenized whole is ``[(None, row)]``."""
    rows = render_rows(tokenizer, messages, tools, chat_template, per_turn_fallback=True, on_dropped=on_dropped)
    out = [(r.turn, t) for r, t in zip(rows, tokenize_rendered(tokenizer, rows))]
    for _, t in out:
        if t.problem:
            raise ChatTemplateError(t.problem)
    return out


def _mask_from_spans(ids: np.ndarray, starts: np.ndarray, spans: list[tuple[int, int]],
                     special: frozenset[int]) -> np.ndarray:
    """uint8 ``[T]``: 1 for tokens starting in a span, up to and including its last special token."""
    mask = np.zeros(len(ids), dtype=np.uint8)
    for a, b in spans:
        lo = int(np.searchsorted(starts, a, side="left"))
        hi = int(np.searchsorted(starts, b, side="left"))  # tokens [lo, hi) start in [a, b)
        if hi <= lo:
            continue
        end = hi
        for t in range(hi - 1, lo - 1, -1):
            if int(ids[t]) in special:
                end = t + 1
                break
        mask[lo:end] = 1
    return mask
