"""Chat messages to token ids and generated token ids to text, as the decoders and the Python API render
them (docs/design.md §9); evaluation prompts render through these too (:mod:`peagle_train.evaluate.prompts`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any

from runtime.chat.chat_template import ChatTemplate, prompt_ids
from runtime.model_cache import load_generation_config, load_tokenizer
from stores.errors import InputError

__all__ = ["check_messages", "eos_ids", "verifier_eos_ids", "turn_text", "render_messages"]


def check_messages(msgs: Any, file: str, row: int) -> None:
    """Raise InputError unless ``msgs`` is a list of ``{"role": str, "content": str}`` without tool calls,
    naming the first message that is not (docs/design.md §9: evaluation prompts are plain chat)."""
    def bad(message: str):
        return InputError(message, file=file, row=row, field="messages")

    if not isinstance(msgs, list):
        raise bad(f"expected a list of {{'role': str, 'content': str}}, got {type(msgs).__name__}")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"message {i}: expected {{'role': str, 'content': str}}")
        if m["role"] == "tool" or m.get("tool_calls") or m.get("function_call"):
            raise bad(f"message {i} ({m['role']}): tool calls and tool results are not supported in evaluation "
                      "prompts, which are plain system/user/assistant messages with string content; drop the "
                      "row or its tool turns")
        if not isinstance(m.get("content"), str):
            raise bad(f"message {i} ({m['role']}): content must be a string, got "
                      f"{type(m.get('content')).__name__} (lists of content parts are not supported)")


def eos_ids(tokenizer, verifier) -> list[int]:
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None),
                  getattr(getattr(verifier, "generation_config", None), "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


def verifier_eos_ids(name: str) -> list[int]:
    """:func:`eos_ids` of MODEL ``name`` from its tokenizer and generation config alone (no weights): the ids a
    loaded verifier's ``generate`` stops at."""
    return eos_ids(load_tokenizer(name), SimpleNamespace(generation_config=load_generation_config(name)))


def turn_text(tokenizer, tokens: Sequence[int], eos: Iterable[int]) -> str:
    """A generated turn's text: its tokens decoded with special tokens kept (a template token in the
    output stays visible), without the EOS that ends the turn (``finish_reason`` says it was there)."""
    cut = list(tokens[:-1]) if tokens and tokens[-1] in set(eos) else list(tokens)
    return tokenizer.decode(cut, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def render_messages(tokenizer, messages: Any, chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of chat ``messages`` with the chat template and a generation prompt, as :func:`render_turn`
    renders an evaluation turn; ``chat_template_kwargs`` are the template's variables (vLLM's
    ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}``).

    Raises:
        InputError: messages that are not plain ``{"role": str, "content": str}`` (tool calls, tool results,
            content-part lists), or none at all.
    """
    check_messages(messages, None, None)
    if not messages:
        raise InputError("no messages to render", field="messages")
    return prompt_ids(tokenizer, list(messages), None, ChatTemplate(None, dict(chat_template_kwargs or {})))

