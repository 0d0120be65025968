"""A generated answer parsed as the serving stack parses it: content, reasoning, tool calls (docs/design.md §6,
"Answers parsed as served", which gives each parser's rules).

The one parser of ``peagle-eval``'s later turns and ``regenerate``'s rows: an answer becomes the message a client
of ``vllm serve --reasoning-parser NAME`` receives and sends back, not the flat decode of the tokens. The parsers
(:data:`REASONING_PARSERS`, vLLM 0.32's names) read the text vLLM parses (the answer's ids without the
end-of-sequence id, decoded with ``skip_special_tokens`` and without cleaning up spaces): ``deepseek_r1``,
``deepseek_v3``, ``qwen3`` (think blocks; reasoning and content keep their whitespace, a block-less
``deepseek_r1`` answer is all reasoning) and ``openai_gptoss`` (Harmony messages, read from the ids). Without a
parser the content is the whole decoded text. Where vLLM would fall back to the flat decode (a Harmony answer cut
inside a header, a message to a built-in tool, Harmony markers without a parser) this module raises
:class:`AnswerFormatError` with the reason.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from stores.errors import InputError

__all__ = ["REASONING_PARSERS", "THINK_PARSERS", "HARMONY_TOKENS", "ParsedAnswer", "AnswerFormatError",
           "HarmonyMessage", "check_reasoning_parser", "parse_answer", "parse_think", "harmony_messages",
           "answer_message"]

THINK_PARSERS = ("deepseek_r1", "deepseek_v3", "qwen3")
"""The ``<think>...</think>`` parsers (vLLM's names)."""

REASONING_PARSERS = (*THINK_PARSERS, "openai_gptoss")
"""vLLM ``--reasoning-parser`` names peagle parses as vLLM does (``--reasoning-parser``)."""

THINK_START, THINK_END = "<think>", "</think>"

HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|return|>", "<|call|>")
"""The Harmony markers (gpt-oss's special tokens), in the order a message uses them."""

_MESSAGE_ENDS = ("<|end|>", "<|return|>", "<|call|>")


class AnswerFormatError(InputError):
    """A generated answer that cannot be parsed exactly as the serving stack parses it (a reject reason)."""


@dataclass(frozen=True)
class ParsedAnswer:
    """An answer as a served client receives it.

    Attributes:
        content: the answer text (vLLM's ``content``; ``""`` where vLLM says None).
        reasoning: the reasoning (vLLM's ``reasoning``), None when there is none.
        tool_calls: OpenAI ``tool_calls`` entries (``{"type": "function", "function": {"name",
            "arguments": JSON string}}``), or None.
    """

    content: str
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class HarmonyMessage:
    """One Harmony message of an answer: its header fields and text; ``complete``: it ended with
    ``<|end|>``, ``<|return|>`` or ``<|call|>`` (False: cut at the token limit in its text)."""

    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None
    text: str
    complete: bool


def check_reasoning_parser(name: str | None) -> None:
    """Raise ValueError (naming ``--reasoning-parser``) unless ``name`` is None or one of :data:`REASONING_PARSERS`."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)} (vLLM's names), "
                         f"got {name!r}")


def parse_think(text: str, parser: str, chat_template_kwargs: dict[str, Any] | None = None
                ) -> tuple[str | None, str | None]:
    """``(reasoning, content)`` of a decoded answer as vLLM's ``parser`` returns them (module docstring);
    None where vLLM returns None."""
    kwargs = chat_template_kwargs or {}
    if parser == "deepseek_v3":
        if not (bool(kwargs.get("thinking", False)) or bool(kwargs.get("enable_thinking", False))):
            return None, text
        parser = "deepseek_r1"
    if parser == "deepseek_r1":
        before, opened, after = text.partition(THINK_START)
        text = after if opened else before
        if THINK_END not in text:
            return text, None
        reasoning, _, content = text.partition(THINK_END)
        return reasoning, content or None
    if parser == "qwen3":
        if kwargs.get("enable_thinking", True) is False:
            return None, text
        reasoning, closed, content = text.partition(THINK_END)
        reasoning = reasoning.replace(THINK_START, "")
        content = content.replace(THINK_END, "") if closed else ""
        return reasoning or None, content or None
    raise ValueError(f"not a think-block parser: {parser!r} (one of {', '.join(THINK_PARSERS)})")


def _token_id(tokenizer, token: str) -> int | None:
    """The id of ``token`` when the tokenizer has it as one token, else None."""
    tid = tokenizer.convert_tokens_to_ids(token)
    return None if tid is None or tid == tokenizer.unk_token_id and token != tokenizer.unk_token else int(tid)


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def harmony_messages(tokenizer, ids: Sequence[int]) -> list[HarmonyMessage]:
    """The Harmony messages of generated ``ids`` (after a prompt ending ``<|start|>assistant``).

    Args:
        ids: int token ids ``[N]`` as generated (the stop id ``<|return|>`` / ``<|call|>`` included
            or not; other end-of-sequence ids must be removed first).

    Raises:
        AnswerFormatError: the tokenizer lacks the Harmony markers, a marker out of place (text
            between messages, a header without ``<|message|>``, a message of another role), or the
            answer cut inside a header.
    """
    marks = {t: _token_id(tokenizer, t) for t in HARMONY_TOKENS}
    missing = [t for t in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>") if marks[t] is None]
    if missing:
        raise AnswerFormatError(f"unparsed answer format: --reasoning-parser openai_gptoss needs the Harmony tokens, "
                                f"and this tokenizer has no {', '.join(missing)}")
    by_id = {tid: t for t, tid in marks.items() if tid is not None}
    messages: list[HarmonyMessage] = []
    state, header, body, role = "header", [], [], "assistant"  # the prompt opened the first header

    def bad(what: str) -> AnswerFormatError:
        return AnswerFormatError(f"unparsed answer format: Harmony {what} (message {len(messages) + 1} of the answer)")

    for tid in ids:
        mark = by_id.get(int(tid))
        if state == "stopped":
            raise bad("tokens after <|return|> or <|call|>, which end the answer")
        if state == "between":
            if mark != "<|start|>":
                raise bad(f"text or {mark or 'a token'} after a message's end where <|start|> belongs")
            state, header, role = "role", [], None
        elif state in ("role", "header"):
            if mark == "<|message|>":
                fields = _harmony_header(_decode(tokenizer, header), role)
                if fields is None:
                    raise bad(f"header {_decode(tokenizer, header)!r} without a channel")
                state, body = "body", []
                role, channel, recipient, content_type = fields
            elif mark in (None, "<|channel|>", "<|constrain|>"):
                header.append(tid)
            else:
                raise bad(f"{mark} inside a header")
        else:  # body
            if mark in _MESSAGE_ENDS:
                messages.append(HarmonyMessage(role, channel, recipient, content_type, _decode(tokenizer, body), True))
                state = "between" if mark == "<|end|>" else "stopped"
            elif mark is None:
                body.append(tid)
            else:
                raise bad(f"{mark} inside a message's text")
    if state == "body":  # cut at the token limit in the text: Harmony's process_eos keeps it
        messages.append(HarmonyMessage(role, channel, recipient, content_type, _decode(tokenizer, body), False))
    elif state == "role" or (state == "header" and header):
        raise bad(f"answer cut inside a header ({_decode(tokenizer, header)!r})")
    return messages


_RECIPIENT = re.compile(r"\bto=(\S+)")


def _harmony_header(text: str, role: str | None) -> tuple[str, str, str | None, str | None] | None:
    """``(role, channel, recipient, content_type)`` of a header's text (markers kept), or None without a channel."""
    before, has_channel, after = text.partition("<|channel|>")
    if not has_channel:
        return None
    words = before.split()
    role = role or (words[0] if words else "")
    after, _, constrain = after.partition("<|constrain|>")
    channel = after.split()[0] if after.split() else ""
    m = _RECIPIENT.search(before + " " + after)
    return role, channel, m.group(1) if m else None, constrain.strip() or None


def _harmony_answer(messages: list[HarmonyMessage]) -> ParsedAnswer:
    """vLLM's ``HarmonyParser.parse`` over the messages (module docstring); a message vLLM ignores is refused."""
    reasoning, content, calls = [], [], []
    for k, msg in enumerate(messages, start=1):
        if msg.role != "assistant":
            raise AnswerFormatError(f"unparsed answer format: Harmony message {k} has role {msg.role!r}, "
                                    "not assistant")
        if msg.recipient and msg.recipient.startswith("functions."):
            args = msg.text
            if msg.content_type is None or "json" in msg.content_type:
                try:
                    args = json.dumps(json.loads(msg.text))
                except json.JSONDecodeError:
                    pass
            calls.append({"type": "function", "function": {"name": msg.recipient[len("functions."):],
                                                           "arguments": args}})
        elif msg.channel == "analysis":
            reasoning.append(msg.text)
        elif msg.channel == "final" or (msg.channel == "commentary" and msg.recipient is None):
            content.append(msg.text)
        else:
            raise AnswerFormatError(f"unparsed answer format: Harmony message {k} (channel {msg.channel!r}, "
                                    f"recipient {msg.recipient!r}) is neither reasoning, content nor a function "
                                    "call; vLLM drops it, peagle does not keep a half answer")
    return ParsedAnswer("\n".join(t for t in content if t), "\n".join(t for t in reasoning if t) or None,
                        calls or None)


def parse_answer(tokenizer, ids: Sequence[int], parser: str | None, eos_ids: Iterable[int] = (),
                 chat_template_kwargs: dict[str, Any] | None = None) -> ParsedAnswer:
    """The answer ``ids`` as a client of ``vllm serve --reasoning-parser parser`` receives it.

    Args:
        tokenizer: the verifier's tokenizer.
        ids: int token ids ``[N]`` the verifier generated; everything from the first ``eos_ids`` id on
            is left out (for Harmony a stop id that is a marker, ``<|return|>``/``<|call|>``, is read
            as the message end it is).
        parser: one of :data:`REASONING_PARSERS`, or None (no reasoning parser: all content).
        chat_template_kwargs: the template variables of the request (``enable_thinking``, ``thinking``:
            ``qwen3`` and ``deepseek_v3`` read them, as vLLM's parsers do).

    Raises:
        AnswerFormatError: the answer cannot be parsed exactly (see the module docstring): Harmony
            markers without ``openai_gptoss``; a think parser whose tags are not single tokens of this
            tokenizer (vLLM refuses to start), or are special tokens a decode drops.
        ValueError: an unknown parser name.
    """
    check_reasoning_parser(parser)
    eos = set(int(e) for e in eos_ids)
    if parser == "openai_gptoss":
        stops = {_token_id(tokenizer, t) for t in ("<|return|>", "<|call|>")} - {None}
        cut = next((k for k, t in enumerate(ids) if int(t) in eos), len(ids))
        kept = list(ids[:cut + 1]) if cut < len(ids) and int(ids[cut]) in stops else list(ids[:cut])
        return _harmony_answer(harmony_messages(tokenizer, kept))
    cut = next((k for k, t in enumerate(ids) if int(t) in eos), len(ids))
    kept = [int(t) for t in ids[:cut]]
    harmony = {_token_id(tokenizer, t) for t in ("<|channel|>", "<|message|>")} - {None}
    if harmony & set(kept):
        raise AnswerFormatError("unparsed answer format: the answer holds Harmony channels (<|channel|>, "
                                "<|message|>) that a plain decode drops; pass --reasoning-parser openai_gptoss")
    text = tokenizer.decode(kept, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if parser is None:
        return ParsedAnswer(text)
    special = set(tokenizer.all_special_tokens)
    for tag in (THINK_START, THINK_END):
        if _token_id(tokenizer, tag) is None:
            raise AnswerFormatError(f"unparsed answer format: --reasoning-parser {parser} needs {tag} as one token, "
                                    "and this tokenizer has none (vLLM refuses to start such a parser)")
        if tag in special:
            raise AnswerFormatError(f"unparsed answer format: {tag} is a special token of this tokenizer, which a "
                                    f"decode drops; --reasoning-parser {parser} cannot see it")
    reasoning, content = parse_think(text, parser, chat_template_kwargs)
    return ParsedAnswer(content or "", reasoning)


def answer_message(answer: ParsedAnswer) -> dict[str, Any]:
    """The assistant message a client sends back for ``answer``: ``content``, and ``reasoning_content``
    when there is reasoning (the chat template decides whether it renders it, as with vLLM's
    ``reasoning_content``/``reasoning`` fields), ``tool_calls`` when there are."""
    msg: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.reasoning is not None:
        msg["reasoning_content"] = answer.reasoning
    if answer.tool_calls:
        msg["tool_calls"] = answer.tool_calls
    return msg
