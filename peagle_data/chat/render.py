"""Chat templates and loss masks (docs/design.md §3) on any template, without ``{% generation %}`` tags.

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
   A turn marked ``"finish_reason": "length"`` (a reply cut at a token limit) is supervised up to the
   end of its own text (its content, else its reasoning): the closing text the template renders after
   it (``</think>``, the end-of-turn token) is not what the verifier generated.
4. ``apply_chat_template(messages, tokenize=True)`` tokenizes the same render with
   ``add_special_tokens=False``, so the ids are identical by construction (tests check it on five
   template families); they are not tokenized twice at run time. Exception: a last turn that
   carries the verifier's generated ``token_ids``, another tokenization of its text, holds those ids
   (:func:`on_generated_ids`).

Four more checks keep a mask from being silently wrong:

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
  assistant turn") instead of dropping the reply's first token or training the next turn's text; a
  token across a turn's start is not a reject where the row can be built as served (the prompt
  tokenized alone, then the reply: :func:`served_pieces`, below);
  likewise a last special token followed by more of the reply (a template without an end-of-turn
  token, a reply holding an added token): "no end-of-turn token ends an assistant turn";
- the row's tokens before every supervised turn i must be the generation prompt ``P_i`` tokenized
  alone (:func:`served_prompt_mismatch`), what vLLM serves before the verifier generates: a reply
  can change how the prompt's last characters tokenize without any token straddling the span
  (SmolLM2's GPT-2 split makes ``"</think>\n\n"``'s newline run one token alone, two before
  ``"Hello"``), which would train the drafter on a context the verifier never sees. ``P_i`` is tokenized
  from its last added token on, one batched call per :func:`tokenize_rendered` (exact: a fast
  tokenizer encodes the pieces between added tokens independently). Where they differ the row is built
  as served (:func:`served_pieces`: the text cut at each supervised turn's start, each piece tokenized
  alone, counted ``served_prompt_rows``); a conversation that no one such sequence serves exactly
  (:func:`needs_turn_rows`) gets one row per turn (:func:`served_turn_rows`); a row whose pieces are not
  exact either is a reject, "the prompt's last tokens change when the reply follows: served [...] vs
  trained [...]; ...". It runs before :func:`on_generated_ids`, so a turn trained on its generated ids
  is the served prompt's ids, then the generated ids.

``system_len`` is the number of leading tokens that form the system prefix (BOS, the system turn,
or the default system text a template injects): the common prefix of two renders of the
conversation's system messages plus a first user turn with different sentinel contents, minus the
user-turn header (what a second user turn adds before its content).

Modules: :mod:`runtime.chat.chat_template` (the template, rendering; shared with ``peagle-eval``), this module
(spans, rows, and tokenizing rendered rows into ids and masks), :mod:`peagle_data.chat.dropped` (content a
template does not render).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from peagle_data.chat.dropped import dropped_content, dropped_reason, thought_in
from peagle_data.readers.normalize import is_unsupervised
from runtime.chat.chat_template import (ChatTemplate, ChatTemplateError, as_chat_template, content_text, content_texts,
                                 describe_kwargs, render, template_messages, template_tools)
from stores.errors import InputError

__all__ = ["TokenizedConversation", "RenderedRow", "render_rows", "tokenize_rendered", "DROPPED", "SPECIAL_TEXT",
           "straddling_token", "served_prompt_mismatch", "served_pieces", "SERVED_PROMPT_CHANGED", "REPLY_STARTS_INSIDE", "needs_turn_rows",
           "served_turn_rows",
           "on_generated_ids", "tokenize_conversation", "tokenize_turns",
           "system_prefix_text",
           "special_token_text", "special_text_reason"]

_SENTINELS = ("Q7Xz sentinel alpha", "K3Jw sentinel beta", "Z9qv sentinel gamma")


def _common_prefix_len(a: str, b: str) -> int:
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
    prefix = r1[:_common_prefix_len(r1, r2)]
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
            must tokenize to exactly them (:func:`tokenize_rendered`).
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
    return _common_prefix_len(prefix, text[: len(prefix)])


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


def _special_texts(tokenizer) -> tuple[re.Pattern | None, dict[str, int]]:
    """A pattern matching the text of every special token of ``tokenizer`` (``all_special_tokens`` and
    the added tokens marked special), longest first, and each text's id; cached on the tokenizer, keyed
    by its size."""
    size = len(tokenizer)
    cached = getattr(tokenizer, "_peagle_special_texts", None)
    if cached is not None and cached[0] == size:
        return cached[1]
    ids: dict[str, int] = {}
    read_as_text = getattr(tokenizer, "split_special_tokens", False)  # then special text tokenizes as text
    for i, added in ([] if read_as_text else sorted(getattr(tokenizer, "added_tokens_decoder", {}).items())):
        if getattr(added, "special", False) and str(added):
            ids.setdefault(str(added), int(i))
    for token in [] if read_as_text else getattr(tokenizer, "all_special_tokens", []) or []:
        if token and token not in ids:
            ids[token] = int(tokenizer.convert_tokens_to_ids(token))
    pattern = re.compile("|".join(re.escape(t) for t in sorted(ids, key=len, reverse=True))) if ids else None
    try:
        tokenizer._peagle_special_texts = (size, (pattern, ids))
    except AttributeError:
        pass
    return pattern, ids


def special_token_text(tokenizer, messages, indices: Sequence[int]) -> list[tuple[int, str, str]]:
    """Special-token text written inside the supervised replies ``indices`` of ``messages``.

    Which text counts: the text of a special token of the tokenizer (``all_special_tokens``, added
    tokens marked special: ``<|im_end|>``, ``<file_sep>``, ``<s>``) in an assistant message's own text,
    its content parts, ``reasoning_content`` or tool calls (their JSON). The tokenizer reads such text
    as the control id, not as characters (vLLM reads a prompt the same way), so a supervised reply
    holding it would train the drafter on a control token inside an answer (an end-of-turn mid-reply),
    where the verifier never generates one. Added tokens not marked special (``<think>``,
    ``<tool_call>`` in Qwen's vocabulary) are markup models generate as ids: they do not count. A turn
    that carries its generated ``token_ids`` is not checked: it is trained on the ids the verifier
    generated (:func:`on_generated_ids`). Context turns (system, user, tool, unsupervised assistant
    turns) are not checked: they render as vLLM renders them.

    Returns:
        ``[(message index, part, token text)]``, part ``content``, ``reasoning_content`` or ``tool_calls``.
    """
    pattern, _ = _special_texts(tokenizer)
    if pattern is None:
        return []
    found = []
    for i in indices:
        msg = messages[i]
        if msg.get("token_ids") is not None:
            continue
        parts = [("content", t) for t in content_texts(msg.get("content"))]
        parts.append(("reasoning_content", str(msg.get("reasoning_content") or "")))
        if msg.get("tool_calls"):
            parts.append(("tool_calls", json.dumps(msg["tool_calls"], ensure_ascii=False)))
        for part, text in parts:
            m = pattern.search(text)
            if m:
                found.append((i, part, m.group(0)))
                break
    return found


def special_text_reason(tokenizer, found: list[tuple[int, str, str]]) -> str:
    """The reject reason of :func:`special_token_text`'s ``found`` (non-empty), naming the first."""
    i, part, token = found[0]
    _, ids = _special_texts(tokenizer)
    more = f" ({len(found)} replies in this row)" if len(found) > 1 else ""
    return (f"special-token text in a reply: the {part} of assistant message {i} writes {token!r}{more}, which the "
            f"tokenizer reads as the special token id {ids.get(token)}, not as text, so the row would supervise a "
            "control token inside the reply (the verifier never generates it there); pass --on-special-token-text "
            "keep to keep such rows as the tokenizer reads them (counted as conversations_with_special_token_text), "
            "or remove the text")


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
    return end + _common_prefix_len(tail, text[end:b])


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
    at = _common_prefix_len(early, text)
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


def tokenize_conversation(tokenizer, messages: Sequence[dict[str, Any]], tools: list | None = None,
                          chat_template: str | ChatTemplate | None = None, on_dropped: str = "reject",
                          on_special_text: str = "reject") -> TokenizedConversation:
    """Tokenize one conversation with its chat template and find its loss mask and system prefix.

    Args:
        tokenizer: a fast Hugging Face tokenizer (offsets are needed).
        messages: OpenAI messages (``role`` in system/user/assistant/tool), at least one assistant.
        tools: tool definitions passed to the template, or None.
        chat_template: template text overriding ``tokenizer.chat_template``, or None; or a
            :class:`~runtime.chat.chat_template.ChatTemplate` (the text and its variables, --chat-template-kwargs).
        on_dropped: ``reject`` or ``keep`` message content the template does not render (see
            :func:`render_rows`).
        on_special_text: ``reject`` or ``keep`` a supervised reply that writes a special token's text
            (see :func:`special_token_text`).

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
    rows = render_rows(tokenizer, messages, tools, chat_template, per_turn_fallback=False, on_dropped=on_dropped,
                       on_special_text=on_special_text)
    out = tokenize_rendered(tokenizer, rows)[0]
    if out.problem:
        raise ChatTemplateError(out.problem)
    return out


def tokenize_turns(tokenizer, messages: Sequence[dict[str, Any]], tools: list | None = None,
                   chat_template: str | ChatTemplate | None = None,
                   on_dropped: str = "reject",
                   on_special_text: str = "reject") -> list[tuple[int | None, TokenizedConversation]]:
    """Like :func:`tokenize_conversation`, but a template that rewrites history gives one row per
    assistant turn, ``(turn index, row)``; a conversation tokenized whole is ``[(None, row)]``."""
    rows = render_rows(tokenizer, messages, tools, chat_template, per_turn_fallback=True, on_dropped=on_dropped,
                       on_special_text=on_special_text)
    out = [(r.turn, t) for r, t in zip(rows, tokenize_rendered(tokenizer, rows))]
    if any(needs_turn_rows(t.problem) for _, t in out):
        rows = served_turn_rows(tokenizer, messages, tools, chat_template, on_dropped, on_special_text)
        out = [(r.turn, replace(t, served_turn_row=1)) for r, t in zip(rows, tokenize_rendered(tokenizer, rows))]
    for _, t in out:
        if t.problem:
            raise ChatTemplateError(t.problem)
    return out


# Rendered rows -> token ids and loss masks (docs/design.md §3, step 3): one batched tokenizer call
# with offsets; a token is supervised when it starts inside its turn's span, up to the span's end-of-turn
# token; a token across a span's boundary (straddling_token), a last special token that is followed by
# more of the reply (_unclear_end_of_turn), tokens before a turn that are not its generation prompt
# tokenized alone (served_prompt_mismatch), or a turn that cannot be trained on the ids the verifier
# generated (on_generated_ids), makes the row a reject.

@dataclass(frozen=True)
class TokenizedConversation:
    """One conversation as tokens.

    Attributes:
        input_ids: int32 ``[T]``, identical to ``apply_chat_template(messages, tokenize=True)``, except
            a last turn trained on the verifier's generated ids (``on_generated_ids``).
        loss_mask: uint8 ``[T]``, 1 on assistant tokens as rendered and their end-of-turn token.
        system_len: leading tokens that form the system prefix (loss 0), ``0 <= system_len <= T``.
        problem: why no exact mask exists (a token that straddles a supervised span's boundary, see
            :func:`straddling_token`; a context that is not the served prompt's tokens, see
            :func:`served_prompt_mismatch`), or None; such a row is a reject.
        on_generated_ids: 1 when the row's last turn holds the verifier's generated ids in place of
            the re-tokenization of its text (the same text, another tokenization), else 0.
        served_pieces: 1 when the row is tokenized as served (:func:`served_pieces`: its generation prompt
            alone, then its reply), since tokenized whole its reply changed the prompt's last tokens; else 0.
        served_turn_row: 1 when the row is one of a conversation's per-turn rows made because no one sequence
            served all its turns exactly (:func:`served_turn_rows`); else 0.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    system_len: int
    problem: str | None = None
    on_generated_ids: int = 0
    served_pieces: int = 0
    served_turn_row: int = 0


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


def tokenize_rendered(tokenizer, rows: Sequence[RenderedRow]) -> list[TokenizedConversation]:
    """Tokenize rendered rows in one batched call and build their loss masks.

    The ids equal ``apply_chat_template(messages, tokenize=True)``: that call tokenizes the same
    render with ``add_special_tokens=False``, as here (the tests check it on every template family).
    A second batched call tokenizes every supervised turn's generation prompt from its last added token
    on (:func:`served_prompt_mismatch`).

    Raises:
        InputError: the tokenizer is not a fast tokenizer (offsets are needed).
    """
    if not rows:
        return []
    if not getattr(tokenizer, "is_fast", False):
        raise InputError("loss masks need a fast tokenizer (offset mapping); this one is not")
    enc = tokenizer([r.text for r in rows], add_special_tokens=False, return_offsets_mapping=True)
    special = _special_ids(tokenizer)
    added = np.fromiter(getattr(tokenizer, "added_tokens_decoder", {}).keys(), dtype=np.int64)
    tokenized, tails = [], []
    for row, row_ids, row_offsets in zip(rows, enc["input_ids"], enc["offset_mapping"]):
        ids = np.fromiter(row_ids, dtype=np.int32, count=len(row_ids))
        offsets = np.fromiter(itertools.chain.from_iterable(row_offsets), dtype=np.int64,
                              count=2 * len(row_offsets)).reshape(-1, 2)  # [T, 2] chars
        anchors = _prompt_anchors(row, ids, offsets, added)
        tokenized.append((ids, offsets, anchors))
        tails += [row.text[int(offsets[t, 0]) if t else 0:a] for t, (a, _) in zip(anchors, row.spans)]
    served = iter(tokenizer(tails, add_special_tokens=False)["input_ids"] if tails else [])  # one batched call
    drafts = [_whole_row(tokenizer, row, ids, offsets, [(t, next(served)) for t in anchors], special)
              for row, (ids, offsets, anchors) in zip(rows, tokenized)]
    redo = [k for k, d in enumerate(drafts) if d.problem and d.problem.startswith((SERVED_PROMPT_CHANGED,
                                                                                  REPLY_STARTS_INSIDE))]
    for k, draft in zip(redo, _as_served(tokenizer, [rows[k] for k in redo], [drafts[k] for k in redo], special)):
        drafts[k] = draft
    return [_finished(tokenizer, row, d, special) for row, d in zip(rows, drafts)]


@dataclass
class _Draft:
    """A row tokenized, before :func:`on_generated_ids`: ids int32 ``[T]``, offsets int64 ``[T, 2]``, loss_mask
    uint8 ``[T]``, the system prefix's tokens, the reject reason or None, and whether it is cut in pieces."""

    ids: np.ndarray
    offsets: np.ndarray
    loss_mask: np.ndarray
    system_len: int
    problem: str | None
    pieces: int = 0


def _row_masks(row: RenderedRow, ids: np.ndarray, offsets: np.ndarray,
               special: frozenset[int]) -> tuple[np.ndarray, int]:
    """``(loss_mask uint8 [T], system_len)`` of ``row`` tokenized as ``ids`` / ``offsets`` (step 3)."""
    loss_mask = _mask_from_spans(ids, offsets[:, 0], list(row.spans), special, frozenset(row.cut))
    if row.empty_think:
        loss_mask[_mask_from_spans(ids, offsets[:, 0], list(row.empty_think), frozenset()) == 1] = 0
    system_len = int(np.searchsorted(offsets[:, 1], row.prefix_chars, side="right"))
    supervised = np.flatnonzero(loss_mask)
    if supervised.size:
        system_len = min(system_len, int(supervised[0]))
    return loss_mask, system_len


def _whole_row(tokenizer, row: RenderedRow, ids: np.ndarray, offsets: np.ndarray,
               served: list[tuple[int, Sequence[int]]], special: frozenset[int]) -> _Draft:
    """``row`` tokenized whole: its mask and the first reason it has no exact one (the checks of
    :func:`tokenize_rendered`; ``served`` as :func:`served_prompt_mismatch` takes it)."""
    loss_mask, system_len = _row_masks(row, ids, offsets, special)
    problem = (straddling_token(row, offsets, loss_mask) or _unclear_end_of_turn(row, ids, offsets, special)
               or served_prompt_mismatch(tokenizer, row, ids, offsets, served))
    return _Draft(ids, offsets, loss_mask, system_len, problem)


def _as_served(tokenizer, rows: Sequence[RenderedRow], drafts: Sequence[_Draft],
               special: frozenset[int]) -> list[_Draft]:
    """``rows``, whose replies change how their prompts' last characters tokenize (``drafts``: tokenized whole),
    tokenized as served (:func:`served_pieces`), each checked again: every turn's context against its whole
    prompt tokenized alone (the pieces cut the text between added tokens, so the tails of :func:`_prompt_anchors`
    do not apply; the first turn's is its first piece by construction). Two batched calls: the pieces, and the
    prompts of the turns after the first. A row not exact in pieces keeps its reason, with why."""
    split = served_pieces(tokenizer, rows, [d.ids for d in drafts])
    prompts = [r.text[:a] for r, cut in zip(rows, split) if cut is not None for a, _ in r.spans[1:]]
    later = iter(tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else [])
    out = []
    for row, draft, cut in zip(rows, drafts, split):
        if cut is None:
            out.append(replace(draft, problem=draft.problem + _PIECES_NOT_EXACT))
            continue
        ids, offsets = cut
        loss_mask, system_len = _row_masks(row, ids, offsets, special)
        first = int(np.searchsorted(offsets[:, 0], row.spans[0][0], side="left"))
        served = [(0, ids[:first].tolist())] + [(0, next(later)) for _ in row.spans[1:]]
        again = (straddling_token(row, offsets, loss_mask) or _unclear_end_of_turn(row, ids, offsets, special)
                 or served_prompt_mismatch(tokenizer, row, ids, offsets, served))
        out.append(replace(draft, problem=draft.problem + _ONE_SEQUENCE_NOT_EXACT) if again else
                   _Draft(ids, offsets, loss_mask, system_len, None, pieces=1))
    return out


def _finished(tokenizer, row: RenderedRow, draft: _Draft, special: frozenset[int]) -> TokenizedConversation:
    """The row's :class:`TokenizedConversation`: ``draft`` trained on its generated ids (:func:`on_generated_ids`)
    where it carries them."""
    ids, loss_mask, spliced, problem = draft.ids, draft.loss_mask, 0, draft.problem
    if problem is None and row.token_ids:
        ids, loss_mask, spliced, problem = on_generated_ids(tokenizer, row, ids, draft.offsets, loss_mask, special)
    return TokenizedConversation(input_ids=ids, loss_mask=loss_mask, system_len=draft.system_len, problem=problem,
                                 on_generated_ids=spliced, served_pieces=draft.pieces if problem is None else 0)


SERVED_PROMPT_CHANGED = "the prompt's last tokens change when the reply follows"
"""How :func:`served_prompt_mismatch`'s reason begins."""
REPLY_STARTS_INSIDE = "reply starts inside a token"
"""How :func:`straddling_token`'s reason begins for a token across a turn's start (served, the prompt ends
before it: the row is built in pieces, :func:`served_pieces`)."""

_PIECES_NOT_EXACT = ("; tokenized in pieces (each generation prompt alone, then its reply) the row is not the same "
                     "text (the tokenizer marks a piece's start, e.g. a SentencePiece prefix space), so no row is "
                     "exact")
_ONE_SEQUENCE_NOT_EXACT = ("; tokenized in pieces (each generation prompt alone, then its reply) a later turn's "
                           "prompt tokenized alone is still not the earlier turns' ids, so no one sequence holds "
                           "every turn as served: per-turn rows (--on-history-rewrite split, the default) give each "
                           "turn its served prompt and reply")


def needs_turn_rows(problem: str | None) -> bool:
    """Whether ``problem`` (a :class:`TokenizedConversation`'s) says that no one sequence serves every turn of the
    row exactly, while each turn alone can be (:func:`served_turn_rows`)."""
    return bool(problem) and problem.endswith(_ONE_SEQUENCE_NOT_EXACT)


def served_turn_rows(tokenizer, messages: Sequence[dict[str, Any]], tools: list | None = None,
                     chat_template: str | ChatTemplate | None = None, on_dropped: str = "reject",
                     on_special_text: str = "reject") -> list[RenderedRow]:
    """One row per supervised assistant turn ``i``, rendered from ``messages[:i+1]`` as for a template that
    rewrites history (:func:`render_rows`), for a conversation whose turns no one sequence serves exactly
    (:func:`needs_turn_rows`): each row is then its turn's served prompt, tokenized alone, and the reply.

    Raises:
        ChatTemplateError: as :func:`render_rows`.
    """
    messages = list(messages)
    indices = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    return _per_turn_rows(tokenizer, messages, indices, tools, chat_template, on_dropped, on_special_text)


def served_pieces(tokenizer, rows: Sequence[RenderedRow],
                  whole: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Each row's text tokenized as vLLM serves its turns: cut at every supervised span's start ``a`` (the
    generation prompt ``P_i = text[:a]`` ends there), each piece tokenized alone (``add_special_tokens=False``;
    all pieces of all rows in one batched call), so the tokens before the first turn are its served prompt's ids
    and each reply's ids are its text's own tokenization, generated after them. Exact for a row with one
    supervised turn (a one-turn conversation, a per-turn row); a row of several turns is exact only when each
    later prompt, tokenized alone, is the pieces before it (:func:`served_prompt_mismatch` checks it again).

    Args:
        rows: the rows to cut; whole: per row, its text tokenized at once (int32 ``[T]``), compared as decoded text.

    Returns:
        Per row, ``(ids int32 [T'], offsets int64 [T', 2])`` in ``row.text``'s characters, or None when the pieces
        do not decode to the text the whole tokenization decodes to (a tokenizer that marks a text's start, such
        as SentencePiece's prefix space, would add characters).
    """
    cuts = [sorted({0, len(r.text), *(a for a, _ in r.spans)}) for r in rows]
    pieces = [(k, c, r.text[c:d]) for k, (r, row_cuts) in enumerate(zip(rows, cuts))
              for c, d in zip(row_cuts[:-1], row_cuts[1:])]
    enc = tokenizer([p for *_, p in pieces], add_special_tokens=False, return_offsets_mapping=True) if pieces \
        else {"input_ids": [], "offset_mapping": []}
    ids: list[list[int]] = [[] for _ in rows]
    offsets: list[list[tuple[int, int]]] = [[] for _ in rows]
    for (k, c, _), piece_ids, piece_offsets in zip(pieces, enc["input_ids"], enc["offset_mapping"]):
        ids[k] += piece_ids
        offsets[k] += [(c + x, c + y) for x, y in piece_offsets]
    decoded = tokenizer.batch_decode(ids + [w.tolist() for w in whole], clean_up_tokenization_spaces=False)
    return [(np.asarray(i, dtype=np.int32), np.asarray(o, dtype=np.int64).reshape(-1, 2))
            if decoded[k] == decoded[len(rows) + k] else None for k, (i, o) in enumerate(zip(ids, offsets))]


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
            return (f"{REPLY_STARTS_INSIDE}: {text[int(starts[i]):int(ends[i])]!r} holds "
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


def _prompt_anchors(row: RenderedRow, ids: np.ndarray, offsets: np.ndarray, added: np.ndarray) -> list[int]:
    """Per span ``(a, b)`` of ``row``, the last token of the row that is an added token (``added``: ids of
    ``tokenizer.added_tokens_decoder``) and ends by ``a`` (0 when there is none, or it is the first token:
    then the whole ``P_i`` from character 0): where the served prompt's tokenization is compared from
    (:func:`served_prompt_mismatch`)."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    is_added = np.isin(ids, added) if added.size else np.zeros(len(ids), dtype=bool)
    out = []
    for a, _ in row.spans:
        lo = int(np.searchsorted(starts, a, side="left"))
        cand = np.flatnonzero(is_added[:lo] & (ends[:lo] <= a))
        out.append(int(cand[-1]) if cand.size else 0)
    return out


def served_prompt_mismatch(tokenizer, row: RenderedRow, ids: np.ndarray, offsets: np.ndarray,
                           served: Sequence[tuple[int, Sequence[int]]]) -> str | None:
    """Why a supervised turn of ``row`` is trained on another context than the verifier is served, or None.

    vLLM serves the generation prompt ``P_i`` (``row.text[:a]`` for the span ``(a, b)``) tokenized alone,
    and the verifier generates after those ids; the row is the whole render tokenized once. Where the
    reply's first characters change how the prompt's last characters tokenize (SmolLM2's byte-level BPE
    keeps ``"</think>\n\n"``'s newline run one token at the end of a text but splits it in two before
    ``"Hello"``), no token straddles the span, yet the row's tokens before the turn differ from the served
    ids: the drafter would be trained on verifier features of a context the verifier never sees. The
    check: the row's tokens before the span's first token (those starting before ``a``) equal the
    served ids of ``P_i``. A turn trained on its generated ids (:func:`on_generated_ids`) is then exact
    by construction: the served prompt ids, then the generated ids.

    Cost: ``P_i`` is tokenized from its last added token on (:func:`_prompt_anchors`), not whole (the
    prompts of a long conversation sum to about twice its text; the tails are a few tokens). Exact for
    the fast tokenizers peagle accepts: a Hugging Face fast tokenizer cuts the text at added tokens
    (leftmost-longest, before normalization: ``AddedVocabulary::extract_and_normalize`` in ``tokenizers``)
    and normalizes, pre-tokenizes and encodes each piece on its own, so the tokens before an added token that both texts hold at the same place are the same
    (``P_i`` is a prefix of the row's text; an added-token match the longer text extends past ``a`` is
    not an anchor, since the anchor ends by ``a``). The tail starts with the anchor itself, so the piece
    after it is not the text's first (Metaspace's ``prepend_scheme="first"``). With no added token
    before ``a`` the whole ``P_i`` is tokenized.

    Args:
        ids: int32 ``[T]`` of ``row.text``; offsets: int64 ``[T, 2]`` their characters.
        served: per span of ``row``, ``(first, tail ids)``: the row's token ``first`` (the anchor) and the
            ids of ``P_i`` from that token's start on, tokenized alone (``add_special_tokens=False``, as
            the row's ids are made), from one batched call in :func:`tokenize_rendered`.
    """
    starts = offsets[:, 0]
    for k, ((a, _), (first, prompt)) in enumerate(zip(row.spans, served)):
        lo = int(np.searchsorted(starts, a, side="left"))  # tokens [0, lo) start before the turn
        if lo - first == len(prompt) and np.array_equal(ids[first:lo], np.asarray(prompt, dtype=ids.dtype)):
            continue
        trained, prompt = [int(t) for t in ids[first:lo]], [int(t) for t in prompt]
        at = next((j for j, (x, y) in enumerate(zip(trained, prompt)) if x != y), min(len(trained), len(prompt)))
        at = max(0, min(at, len(trained) - 1, len(prompt) - 1))  # show at least the last token of each
        shown = [[tokenizer.decode([t], clean_up_tokenization_spaces=False) for t in seq[at:at + 8]]
                 for seq in (prompt, trained)]
        which = f"assistant message {row.turn}" if row.turn is not None else \
            f"supervised reply {k + 1} of {len(row.spans)}"
        return (f"the prompt's last tokens change when the reply follows: served {shown[0]} vs trained "
                f"{shown[1]} before {which} (from token {first + at}): vLLM tokenizes the generation prompt alone "
                f"and the verifier generates after those ids, but tokenized with the reply "
                f"({row.text[a:a + 16]!r}...) the prompt's last characters form other tokens, so the row's "
                "context is not the served one; pass --chat-template FILE with a generation prompt that ends "
                "where a token ends whatever follows it (a special token, or text the tokenizer never merges "
                "across), or use the tokenizer the verifier is served with")
    return None


def _unclear_end_of_turn(row: RenderedRow, ids: np.ndarray, offsets: np.ndarray,
                         special: frozenset[int]) -> str | None:
    """Why a supervised span has no exact end, or None: its last special/added token (the one
    :func:`_mask_from_spans` ends the mask at) is followed by more than whitespace inside the span, so
    it is a token of the reply itself (``"a <file_sep> b"``, an inline ``</think>``) under a template
    that ends turns without one; masking up to it would silently drop the reply's rest."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    text = row.text
    for k, (a, b) in enumerate(row.spans):
        if k in row.cut:  # ends with the reply's own text
            continue
        lo, hi = int(np.searchsorted(starts, a, side="left")), int(np.searchsorted(starts, b, side="left"))
        last = next((t for t in range(hi - 1, lo - 1, -1) if int(ids[t]) in special), None)
        if last is not None and text[int(ends[last]):b].strip():
            return (f"no end-of-turn token ends an assistant turn: its last special token "
                    f"{text[int(starts[last]):int(ends[last])]!r} is followed by {text[int(ends[last]):b][:40]!r} "
                    "inside the turn, so it is part of the reply and the turn has no exact mask; pass "
                    "--chat-template FILE with a template that ends assistant turns with an end-of-turn token")
    return None


def on_generated_ids(tokenizer, row: RenderedRow, ids: np.ndarray, offsets: np.ndarray, loss_mask: np.ndarray,
                     special: frozenset[int]) -> tuple[np.ndarray, np.ndarray, int, str | None]:
    """The row trained on the ids the verifier generated for its turns that carry them (``row.token_ids``).

    A turn's tokens (those of :func:`_mask_from_spans`, up to its end-of-turn token) usually are
    exactly its generated ids. When they are not:

    - the generated ids decode (no clean-up) to the same text, another tokenization of it (a verifier
      generates ``"\n\n"`` as one token where its tokenizer makes two): the row's last supervised
      turn is trained on the generated ids, spliced in place of its tokens (what the verifier computed
      and what vLLM serves: the prompt, then the generated ids), counted; an earlier turn is a reject,
      since the next turn's context, as the verifier saw it, was the re-tokenized text;
    - an earlier reply cut at the token limit (or a last one whose text the template renders otherwise)
      whose tokens are the generated ids but for its last generated ids, whitespace the template does not
      render as generated (it trims the reply, or merges its last whitespace with the text it renders after
      the reply): the turn supervises the tokens it shares with the generated ids, each the verifier's own
      at its own position (an exact subset), and not the whitespace;
    - a template that trims the reply's leading or trailing whitespace (``content | trim``) renders the
      generated text without it: the row's last supervised turn is trained on the generated ids,
      spliced in place of its tokens, as for another tokenization; an earlier turn is a reject;
    - the ids decode to the message's own text but the template renders that text otherwise: a reject
      naming where the render and the generated text part;
    - the ids decode to another text than the message's (a decode that cleaned up tokenization spaces,
      ``x!= y`` for ``x != y``; ids left over from an edited text; another tokenizer): a reject;
    - an id outside ``[0, len(tokenizer))``: a reject (it decodes to ``""``, so the text alone would match).

    Args:
        ids: int32 ``[T]`` of ``row.text``; offsets: int64 ``[T, 2]`` their characters;
            loss_mask: uint8 ``[T]``.

    Returns:
        ``(input_ids, loss_mask, spliced, problem)``: the ids and mask (new arrays when a turn was
        spliced or shortened), 1 when a turn was spliced, and the reject reason or None.
    """
    starts, text = offsets[:, 0], row.text
    n_tokens = len(tokenizer)
    for k, msg_index, generated in row.token_ids:
        past = next((j for j, t in enumerate(generated) if not 0 <= t < n_tokens), None)
        if past is not None:  # decodes to "": the text would still match
            return ids, loss_mask, 0, (
                f"generated ids outside the tokenizer: assistant message {msg_index} token_ids[{past}] is "
                f"{generated[past]}, but the tokenizer has {n_tokens} tokens (ids 0..{n_tokens - 1}): the ids come "
                "from another tokenizer or were edited; tokenize with the tokenizer of the verifier that generated "
                "them")
        a, b = row.spans[k]
        lo, end = _span_tokens(ids, starts, a, b, special, k in row.cut)
        got = [int(t) for t in ids[lo:end]]
        if got == list(generated):
            continue
        at = next((j for j, (x, y) in enumerate(zip(got, generated)) if x != y), min(len(got), len(generated)))
        decoded = tokenizer.decode(list(generated), clean_up_tokenization_spaces=False)
        rendered = text[int(starts[lo]):int(offsets[end - 1, 1])] if end > lo else ""
        trimmed = _trimmed_alike(tokenizer, generated, decoded, rendered, special)
        last = k == len(row.spans) - 1 and not any(a <= x < b for x, _ in row.empty_think)
        if last and (decoded == rendered or trimmed):  # the verifier's own ids for the same text: spliced in
            new_ids = np.concatenate([ids[:lo], np.asarray(generated, dtype=ids.dtype), ids[end:]])
            new_mask = np.concatenate([loss_mask[:lo], np.ones(len(generated), dtype=loss_mask.dtype),
                                       loss_mask[end:]])
            return new_ids, new_mask, 1, None
        if k in row.cut and _unrendered_whitespace(tokenizer, generated[at:], text[int(starts[lo + at]):b]
                                                   if lo + at < end else ""):
            loss_mask = loss_mask.copy()  # the tokens it shares with the generated ids: an exact subset
            loss_mask[lo + at:end] = 0
            continue
        name = [repr(tokenizer.convert_ids_to_tokens(int(seq[at]))) if at < len(seq) else "(end)"
                for seq in (got, generated)]
        where = (f"assistant message {msg_index} re-tokenizes inside the chat template to {len(got)} ids, the "
                 f"verifier generated {len(generated)} (token_ids); first difference at token {at}: {name[0]} "
                 f"for the generated {name[1]}")
        if decoded != rendered and not trimmed:
            own = tokenizer.decode(list(generated), skip_special_tokens=True, clean_up_tokenization_spaces=False)
            if all(part in own for part in row.texts[k] if part):
                c = _common_prefix_len(decoded, rendered)
                return ids, loss_mask, 0, (
                    f"generated ids do not round-trip: {where}; they decode to the message's text, but the chat "
                    f"template renders it otherwise: {rendered[c:c + 24]!r} in the render where the generated "
                    f"text has {decoded[c:c + 24]!r} (after {decoded[max(0, c - 24):c]!r}), so the turn as "
                    "rendered is not what the verifier generated; pass --chat-template FILE with a template that "
                    "renders assistant content as it is")
            return ids, loss_mask, 0, (
                f"generated ids do not round-trip: {where}, and they decode to another text than the message's "
                "content: the text was decoded with clean_up_tokenization_spaces (peagle's regenerate never does) "
                "or edited after regenerate, or tokenize runs with another tokenizer than the one that generated "
                "the ids")
        how = ("the template trims the reply's whitespace); the verifier saw the trimmed text" if trimmed else
               "the same text, another tokenization); the verifier saw the re-tokenized text")
        return ids, loss_mask, 0, (
            f"generated ids do not round-trip: {where} ({how} as the context of the turns after it, so no "
            "tokenization trains both exactly")
    return ids, loss_mask, 0, None


def _trimmed_alike(tokenizer, generated: Sequence[int], decoded: str, rendered: str, special: frozenset[int]) -> bool:
    """Whether the rendered turn (``rendered``) is the generated text (``decoded``) with its leading and/or
    trailing whitespace trimmed, before a generated end-of-turn token both end with (a template that
    renders ``content | trim``): then the generated ids are the verifier's own for the same text."""
    tail = tokenizer.decode([generated[-1]], clean_up_tokenization_spaces=False) \
        if generated and int(generated[-1]) in special else ""
    if tail and decoded.endswith(tail) and rendered.endswith(tail):
        decoded, rendered = decoded[:-len(tail)], rendered[:-len(tail)]
    return decoded != rendered and rendered in (decoded.strip(), decoded.rstrip(), decoded.lstrip())


def _unrendered_whitespace(tokenizer, rest: Sequence[int], rendered: str) -> bool:
    """Whether the last generated ids ``rest`` of a cut reply, which its rendered tokens do not hold, are
    whitespace the template does not render as generated: ``rest`` decodes to whitespace only, and
    the span's text from the first differing token on (``rendered``) is whitespace only too (none when
    the template trims it, a token merging it with the text after the reply when it renders it so)."""
    tail = tokenizer.decode(list(rest), clean_up_tokenization_spaces=False)
    return bool(rest) and not tail.strip() and not rendered.strip()


def _span_tokens(ids: np.ndarray, starts: np.ndarray, a: int, b: int, special: frozenset[int],
                 cut: bool) -> tuple[int, int]:
    """Tokens ``[lo, end)`` of the span ``[a, b)`` characters: those starting in it, up to and
    including its last special token (all of them when ``cut``: a reply cut at a token limit)."""
    lo = int(np.searchsorted(starts, a, side="left"))
    hi = int(np.searchsorted(starts, b, side="left"))  # tokens [lo, hi) start in [a, b)
    if not cut:
        for t in range(hi - 1, lo - 1, -1):
            if int(ids[t]) in special:
                return lo, t + 1
    return lo, max(hi, lo)


def _mask_from_spans(ids: np.ndarray, starts: np.ndarray, spans: list[tuple[int, int]],
                     special: frozenset[int], cut: frozenset[int] = frozenset()) -> np.ndarray:
    """uint8 ``[T]``: 1 for tokens starting in a span, up to and including its last special token
    (all of them for the spans whose position is in ``cut``: replies cut at a token limit, whose span
    already ends with the reply's text)."""
    mask = np.zeros(len(ids), dtype=np.uint8)
    for k, (a, b) in enumerate(spans):
        lo, end = _span_tokens(ids, starts, a, b, special, k in cut)
        mask[lo:end] = 1
    return mask
