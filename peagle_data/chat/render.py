"""A conversation rendered through its chat template, with the character spans of its assistant turns.

The prefix method (docs/design.md §3), on any template, without ``{% generation %}`` tags: the span of assistant
turn i is ``[len(P_i), len(Q_i))`` characters, ``P_i`` the render of ``messages[:i]`` with the generation prompt,
``Q_i`` of ``messages[:i+1]``; both must be string prefixes of the whole render. Where they are not, the template
rewrites history: :func:`render_rows` makes one row per assistant turn from ``messages[:i+1]``, or raises
:class:`~runtime.chat.chat_template.ChatTemplateError` naming the cause. ``prefix_chars`` (the system prefix) is the
common prefix of two renders with different sentinel user turns, minus the user-turn header.

Tokenizing rows into ids and loss masks: :mod:`peagle_data.chat.tokens`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, Sequence

from peagle_data.chat.dropped import dropped_content, dropped_reason, thought_in
from peagle_data.chat.special_text import special_text_reason, special_token_text
from peagle_data.readers.normalize import is_unsupervised
from runtime.chat.chat_template import (ChatTemplate, ChatTemplateError, as_chat_template, content_text, content_texts,
                                        describe_kwargs, render, template_messages, template_tools)

__all__ = ["RenderedRow", "render_rows", "served_turn_rows", "DROPPED", "SPECIAL_TEXT", "system_prefix_text",
           "common_prefix_len"]

_SENTINELS = ("Q7Xz sentinel alpha", "K3Jw sentinel beta", "Z9qv sentinel gamma")


def common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def system_prefix_text(tokenizer, system_messages: Sequence[dict[str, Any]], tools=None,
                       chat_template: str | ChatTemplate | None = None) -> str:
    """Text of the system prefix the template renders for these leading system messages.

    Returns the common prefix of ``render(system + [user S1])`` and ``render(system + [user S2])``
    with the user-turn header stripped when it ends that prefix (templates that put the system
    text inside the first user turn, like Gemma, keep the header: it belongs to the prefix).
    """
    system_messages = list(system_messages)
    r1 = render(tokenizer, system_messages + [{"role": "user", "content": _SENTINELS[0]}], tools, chat_template)
    r2 = render(tokenizer, system_messages + [{"role": "user", "content": _SENTINELS[1]}], tools, chat_template)
    prefix = r1[:common_prefix_len(r1, r2)]
    # The user-turn header: what a second user turn adds between the end of the assistant turn
    # before it and its content. The assistant turn's end is located by its (sentinel) content and
    # the glue the template closes it with, so templates that render a final assistant turn
    # differently (Qwen3's injected think block) still give the header.
    base_msgs = system_messages + [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINELS[2]}]
    try:
        base = render(tokenizer, base_msgs, tools, chat_template)
        h1 = render(tokenizer, base_msgs + [{"role": "user", "content": _SENTINELS[0]}], tools, chat_template)
        h2 = render(tokenizer, base_msgs + [{"role": "user", "content": _SENTINELS[1]}], tools, chat_template)
    except ChatTemplateError:
        return prefix
    if _SENTINELS[2] not in base:
        return prefix
    closing = _SENTINELS[2] + base[base.rindex(_SENTINELS[2]) + len(_SENTINELS[2]):]
    before_content = h1[:common_prefix_len(h1, h2)]
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
    key = json.dumps([system_messages, tools, as_chat_template(chat_template).key()], sort_keys=True, default=str)
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
        cut: positions in ``spans`` of turns marked ``"finish_reason": "length"`` (cut at a token
            limit); their span ends where the reply's own text ends, and is supervised whole.
        token_ids: ``(position in spans, message index, ids)`` of every supervised turn that carries
            the ids the verifier generated (``token_ids``, written by ``regenerate``): its span
            must tokenize to exactly them (:func:`~peagle_data.chat.tokens.tokenize_rendered`).
        texts: per span, the supervised message's own text parts and reasoning (``""`` when none), to
            tell a template that renders them otherwise from ids of another text.
        special_text: special-token text the supervised replies write (``on_special_text="keep"``):
            ``"'<|im_end|>' in the content of message <i>"``.
    """

    text: str
    spans: tuple[tuple[int, int], ...]
    prefix_chars: int
    turn: int | None = None
    empty_think: tuple[tuple[int, int], ...] = ()
    dropped: tuple[str, ...] = ()
    cut: tuple[int, ...] = ()
    token_ids: tuple[tuple[int, int, tuple[int, ...]], ...] = ()
    texts: tuple[tuple[str, ...], ...] = ()
    special_text: tuple[str, ...] = ()


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
            spec = as_chat_template(chat_template)
            template = tokenizer.get_chat_template(spec.text, tools)
            self._compiled = _compile_jinja_template(template)
            self._chat = _alias_reasoning_fields(_plain_template_data(template_messages(messages, template)))
            self._tools = _plain_template_data(template_tools(tools))
            self._kwargs = _plain_template_data({**tokenizer.special_tokens_map, **spec.kwargs})
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
        return render(tokenizer, messages[:n], tools, chat_template, add_generation_prompt)


def _assistant_span(tokenizer, messages, i, text, tools, chat_template,
                    renderer: _PrefixRenderer | None = None) -> tuple[int, int] | None:
    """Characters of assistant turn ``i`` in ``text`` by the prefix method, or None when the renders
    of ``messages[:i]`` (with the generation prompt) and ``messages[:i+1]`` are not prefixes of it."""
    if renderer is not None:
        before, through = renderer.render(i, True), renderer.render(i + 1, False)
        if text.startswith(before) and text.startswith(through) and len(through) >= len(before):
            return len(before), len(through)
    before = render(tokenizer, messages[:i], tools, chat_template, add_generation_prompt=True)
    through = render(tokenizer, messages[: i + 1], tools, chat_template)
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
        if m and "<think>" not in content_text(messages[i].get("content"))[:16]:
            out.append((a, m.end()))
    return tuple(out)


def _prefix_chars(tokenizer, messages, text, tools, chat_template) -> int:
    system_msgs = []
    for m in messages:
        if m.get("role") not in ("system", "developer"):
            break
        system_msgs.append(m)
    prefix = _cached_system_prefix(tokenizer, system_msgs, tools, chat_template)
    return common_prefix_len(prefix, text[: len(prefix)])


DROPPED = ("reject", "keep")
"""What :func:`render_rows` does with message content the template does not render."""

SPECIAL_TEXT = ("reject", "keep")
"""What :func:`render_rows` does with a supervised reply that writes a special token's text."""


def render_rows(tokenizer, messages: Sequence[dict[str, Any]], tools: list | None = None,
                chat_template: str | ChatTemplate | None = None, per_turn_fallback: bool = True,
                on_dropped: str = "reject", on_special_text: str = "reject") -> list[RenderedRow]:
    """Render one conversation and locate its assistant spans (no tokenization).

    The whole conversation is one row when every assistant turn's prefix renders are prefixes of
    the full render. Otherwise the template rewrites history (for example it drops earlier turns'
    reasoning): with ``per_turn_fallback`` the conversation becomes one row per assistant turn
    ``i``, rendered from ``messages[:i+1]`` (its own context, as the verifier saw it) and
    supervising only that last turn; each such row must pass the prefix check itself.

    Every row is then checked for content the template drops (:func:`dropped_content`): with
    ``on_dropped="reject"`` the first one raises; with ``"keep"`` the row is kept, the dropped
    parts are listed in ``RenderedRow.dropped``, and an assistant turn of which nothing is
    rendered supervises nothing (its span is only template glue); in the per-turn rows such a turn
    has no row, and its dropped parts are listed on the conversation's last row instead.

    Every supervised reply is checked for special-token text (:func:`special_token_text`): with
    ``on_special_text="reject"`` the first one raises; with ``"keep"`` the row is kept as the
    tokenizer reads it (the text as control ids, as vLLM reads it) and the occurrences are listed in
    ``RenderedRow.special_text``.

    Raises:
        ChatTemplateError: "template error"; "template rewrites history" or "generation prompt
            mismatch" when no exact mask exists; "template drops <part>" (``on_dropped="reject"``);
            "special-token text in a reply" (``on_special_text="reject"``).
    """
    if on_dropped not in DROPPED:
        raise ValueError(f"on_dropped must be one of {DROPPED}, got {on_dropped!r}")
    if on_special_text not in SPECIAL_TEXT:
        raise ValueError(f"on_special_text must be one of {SPECIAL_TEXT}, got {on_special_text!r}")
    messages = list(messages)
    text = render(tokenizer, messages, tools, chat_template)
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
                             None, on_dropped, on_special_text)]
    first_bad = indices[len(spans)]
    if not per_turn_fallback:
        raise ChatTemplateError(_no_prefix_reason(tokenizer, messages, first_bad, text, tools, chat_template,
                                                  "the render up to assistant turn {i} is not a prefix of the "
                                                  "whole conversation's render"))
    return _per_turn_rows(tokenizer, messages, indices, tools, chat_template, on_dropped, on_special_text)


def _per_turn_rows(tokenizer, messages: list, indices: list[int], tools, chat_template,
                   on_dropped: str, on_special_text: str = "reject") -> list[RenderedRow]:
    """One row per supervised assistant turn ``i`` (``indices``), rendered from ``messages[:i+1]``
    (see :func:`render_rows`); a turn of which nothing renders has no row, and its dropped parts are
    listed on the conversation's last row."""
    rows, lost = [], []
    for i in indices:
        if is_unsupervised(messages[i]):  # empty or weight 0: supervises nothing, no row of its own
            continue
        sub = messages[: i + 1]
        sub_text = render(tokenizer, sub, tools, chat_template)
        span = _assistant_span(tokenizer, sub, i, sub_text, tools, chat_template)
        if span is None:
            raise ChatTemplateError(_no_prefix_reason(
                tokenizer, sub, i, sub_text, tools, chat_template,
                "even rendered alone, the context of assistant turn {i} is not a prefix of its own render"))
        row = _checked_row(tokenizer, sub, tools, chat_template, sub_text, {i: span}, i, on_dropped, on_special_text)
        if row.spans:
            rows.append(row)
        else:  # nothing of the turn is rendered (on_dropped="keep"): no row, but its drops still count
            lost += [part for part in row.dropped if part not in lost]
    if not rows:
        raise ChatTemplateError("no supervised tokens: the template renders no content of any assistant turn"
                                if lost else "no supervised tokens: every assistant turn is empty")
    if lost:  # the conversation's dropped parts are the union over its rows: carried by its last row
        rows[-1] = replace(rows[-1], dropped=rows[-1].dropped + tuple(p for p in lost if p not in rows[-1].dropped))
    return rows


def _checked_row(tokenizer, messages, tools, chat_template, text: str, spans: dict[int, tuple[int, int]],
                 turn: int | None, on_dropped: str, on_special_text: str = "reject") -> RenderedRow:
    """The row of ``messages`` rendered as ``text`` supervising ``spans`` (assistant index -> span),
    after the dropped-content check; raises ChatTemplateError on a drop with ``on_dropped="reject"``."""
    dropped = dropped_content(tokenizer, messages, text, spans, tools, chat_template)
    if dropped and on_dropped == "reject":
        i, part, lost_all = dropped[0]
        raise ChatTemplateError(dropped_reason(messages, i, part, len(dropped)))
    silent = {i for i, _, lost_all in dropped if lost_all}
    kept = [(i, span) for i, span in spans.items()
            if not is_unsupervised(messages[i]) and i not in silent]
    kept_indices, kept_spans = [i for i, _ in kept], [span for _, span in kept]
    if not kept_spans and turn is None and dropped:
        raise ChatTemplateError("no supervised tokens: the template renders no content of any assistant turn")
    special_text = special_token_text(tokenizer, messages, kept_indices)
    if special_text and on_special_text == "reject":
        raise ChatTemplateError(special_text_reason(tokenizer, special_text))
    cut = tuple(k for k, i in enumerate(kept_indices) if messages[i].get("finish_reason") == "length")
    for k in cut:  # a cut reply ends where its text ends: what the template renders after it was not generated
        glue = _closing_text(tokenizer, messages, kept_indices[k], tools, chat_template)
        kept_spans[k] = (kept_spans[k][0], _cut_end(messages[kept_indices[k]], text, *kept_spans[k], glue))
    generated = tuple((k, i, tuple(messages[i]["token_ids"])) for k, i in enumerate(kept_indices)
                      if messages[i].get("token_ids") is not None)
    texts = tuple(tuple(content_texts(messages[i].get("content"))) + (str(messages[i].get("reasoning_content") or ""),)
                  for i in kept_indices)
    return RenderedRow(text, tuple(kept_spans), _prefix_chars(tokenizer, messages, text, tools, chat_template),
                       turn, _empty_think(messages, kept_indices, text, kept_spans),
                       tuple(("tools" if i is None else f"{part} of message {i}") for i, part, _ in dropped), cut,
                       generated, texts,
                       tuple(f"{token!r} in the {part} of message {i}" for i, part, token in special_text))


def _closing_text(tokenizer, messages, i: int, tools, chat_template) -> str | None:
    """What the template renders after assistant message ``i``'s own text to close the turn (``"</think>"``
    for a reply cut in its reasoning, the end-of-turn token and glue): the text after a sentinel put in
    place of the reply's content (else of its reasoning) in the render of ``messages[:i+1]``; None when
    the sentinel is not rendered once."""
    msg = dict(messages[i])
    key = "content" if any(t.strip() for t in content_texts(msg.get("content"))) else "reasoning_content"
    msg[key] = _SENTINELS[2]
    try:
        through = render(tokenizer, list(messages[:i]) + [msg], tools, chat_template)
    except ChatTemplateError:
        return None
    if through.count(_SENTINELS[2]) != 1:
        return None
    return through[through.index(_SENTINELS[2]) + len(_SENTINELS[2]):]


def _cut_end(msg: dict[str, Any], text: str, a: int, b: int, closing: str | None = None) -> int:
    """The end (characters) of a cut reply's own text in its span ``[a, b)``: where the text the template
    closes the turn with (``closing``, :func:`_closing_text`) begins, when the span ends with it; else
    after the last occurrence of the final characters of its content, else of its reasoning (a reply cut
    inside its think block, whose closing ``</think>`` the template adds), with the reply's trailing
    whitespace where the template renders it.

    Raises:
        ChatTemplateError: the reply has no text, or its end is not found in the render.
    """
    if closing is not None and text.endswith(closing, a, b) and text[a:b - len(closing)].strip():
        return b - len(closing)  # exact: "<<" then "<|im_end|>" ends at the first "<<", not the overlapping one
    texts = [t for t in content_texts(msg.get("content")) if t.strip()]  # the last text part: a template may
    own = texts[-1] if texts else str(msg.get("reasoning_content") or "")  # join parts its way
    last = own.rstrip()
    at = text.rfind(last[-16:], a, b) if last else -1
    if at < 0:
        raise ChatTemplateError("a reply cut at a token limit (finish_reason: length) whose text's end is not "
                                "found in the render: the turn has no exact mask")
    end = at + len(last[-16:])
    # the reply's trailing whitespace ("...0];\n", a cut after " * ") is its own text where the template
    # renders it (ChatML); a template that trims it renders none, and the span ends before it
    tail = own[len(last):]
    return end + common_prefix_len(tail, text[end:b])


def _no_prefix_reason(tokenizer, messages, i: int, text: str, tools, chat_template, detail: str) -> str:
    """Why assistant turn ``i`` has no exact span in ``text`` (the render of ``messages``): the generation
    prompt adds text the rendered turn does not start with (R1-Distill style templates), the system
    message is rendered only while a user turn is last (Mistral-v3's ``loop.last``), else history is
    rewritten, with the cause named where it is known (:func:`_rewrite_cause`)."""
    default = "template rewrites history: " + detail.format(i=i)
    try:
        prompt = render(tokenizer, messages[:i], tools, chat_template, add_generation_prompt=True)
        through = render(tokenizer, messages[: i + 1], tools, chat_template)
        history = render(tokenizer, messages[:i], tools, chat_template) if i else ""
    except ChatTemplateError:
        return default
    system = _system_text(messages)
    if system and system in prompt and system not in through:
        return ("template renders the system message only in the last user turn: the system message (message 0) "
                f"is rendered in the prompt of assistant turn {i}, where a user turn is the last message, but not "
                f"once that turn's reply follows (a Mistral-v3 style `loop.last` test), so no row holds the context "
                "the verifier is served. Pass --chat-template FILE with a training template that renders the "
                "system message in the last user turn whatever follows it (the index of the last user message "
                "instead of `loop.last`); each assistant turn then gets its own row (--on-history-rewrite split, "
                "the default) whose context is the prompt the verifier is served")
    if i and text.startswith(history) and prompt.startswith(history) and not text.startswith(prompt):
        added, turn = prompt[len(history):], text[len(history):]
        thought = ((messages[i].get("reasoning_content") or "").strip()
                   or thought_in(content_text(messages[i].get("content"))))
        mode = _thinking_mode_reason(added, i, bool(thought), chat_template)
        if mode:
            return mode
        stripped = (f", and it drops the reasoning of assistant turn {i} (rendered turns keep only the text after "
                    "</think>, as R1-Distill templates do)") if thought and thought not in turn else ""
        return (f"generation prompt mismatch: the template's generation prompt adds {added!r} after the history, "
                f"but assistant turn {i} renders as {turn[:len(added) + 24]!r}...{stripped}; no exact mask exists. "
                "Pass --chat-template FILE with a training template that keeps the reasoning: each assistant turn "
                "rendered as the generation prompt followed by its reasoning and answer"
                + _open_think_hint(added, chat_template))
    return default + _rewrite_cause(messages, i, prompt, through, text, system)


_OPEN_THINK_END = re.compile(r"<think>\s*$")


def _thinking_mode_reason(added: str, i: int, has_reasoning: bool, chat_template) -> str | None:
    """The reason of a generation prompt mismatch where the generation prompt closes an empty think block
    (a hybrid template with thinking off, e.g. ``enable_thinking: false``: the verifier answers without
    reasoning) and turn ``i`` has reasoning, so it was not generated in this mode; else None."""
    if not (_EMPTY_THINK.search(added) and has_reasoning):
        return None
    return (f"generation prompt mismatch: the generation prompt closes an empty think block ({added!r}, chat "
            f"template kwargs {describe_kwargs(as_chat_template(chat_template).kwargs)}), so the verifier answers "
            f"without reasoning in this mode, but assistant turn {i} has reasoning; no exact mask exists. Tokenize in "
            "the mode the answers were generated in (--chat-template-kwargs), or regenerate them in this mode")


def _open_think_hint(added: str, chat_template) -> str:
    """A sentence for a generation prompt that ends inside an open think block (thinking on: the verifier
    reasons first), naming the template variables in effect; ``""`` for any other prompt."""
    if not _OPEN_THINK_END.search(added):
        return ""
    return (f". The generation prompt opens a think block (chat template kwargs "
            f"{describe_kwargs(as_chat_template(chat_template).kwargs)}), so the verifier reasons first: if it is "
            "served with thinking off, say so with --chat-template-kwargs (e.g. '{\"enable_thinking\": false}')")


def _system_text(messages) -> str:
    """The stripped text of a leading system message, or ``""``."""
    if not messages or messages[0].get("role") not in ("system", "developer"):
        return ""
    return content_text(messages[0].get("content")).strip()


def _rewrite_cause(messages, i: int, prompt: str, through: str, text: str, system: str) -> str:
    """``": <cause>"`` of a history rewrite at assistant turn ``i``: ``prompt`` (the render of
    ``messages[:i]`` with the generation prompt) or ``through`` (of ``messages[:i+1]``) is not a prefix
    of ``text``. Named causes: the system message moves to a later user turn (Mistral-v3 style), the
    reasoning of an assistant turn is dropped once later turns follow (Qwen3 style), assistant turn
    ``i`` renders differently when it is the last message; else where the renders part."""
    early = prompt if not text.startswith(prompt) else through
    at = common_prefix_len(early, text)
    if system and early.find(system) >= at and text.find(system) != early.find(system):
        return (f"; it moves the system message into the last user turn (Mistral style): rendered in the user turn "
                f"before assistant turn {i} while that turn is last, and in a later user turn in the whole "
                "conversation; per-turn rows (--on-history-rewrite split, the default) give each assistant turn "
                "a row with the context the verifier is served")
    for k in range(i + 1):
        reasoning = (messages[k].get("reasoning_content") or "").strip() if messages[k].get("role") == "assistant" \
            else ""
        if reasoning and reasoning in through and reasoning not in text:
            return (f"; it drops the reasoning of assistant turn {k} once later turns follow (Qwen3 style); "
                    "per-turn rows (--on-history-rewrite split, the default) give each assistant turn a row with "
                    "the context the verifier saw")
    where = (f"assistant turn {i} renders as {early[at:at + 40]!r} when it is the last message, as "
             f"{text[at:at + 40]!r} once later messages follow" if at >= len(prompt) and early is through else
             f"the renders part at character {at}: {early[at:at + 40]!r} up to assistant turn {i}, "
             f"{text[at:at + 40]!r} in the longer render")
    return f" ({where})"


def served_turn_rows(tokenizer, messages: Sequence[dict[str, Any]], tools: list | None = None,
                     chat_template: str | ChatTemplate | None = None, on_dropped: str = "reject",
                     on_special_text: str = "reject") -> list[RenderedRow]:
    """One row per supervised assistant turn ``i``, rendered from ``messages[:i+1]`` as for a template that
    rewrites history (:func:`render_rows`), for a conversation whose turns no one sequence serves exactly
    (:func:`~peagle_data.chat.served.needs_turn_rows`): each row is then its turn's served prompt, tokenized
    alone, and the reply.

    Raises:
        ChatTemplateError: as :func:`render_rows`.
    """
    messages = list(messages)
    indices = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    return _per_turn_rows(tokenizer, messages, indices, tools, chat_template, on_dropped, on_special_text)
