"""The effective chat template and one render of a conversation through it (docs/design.md §3)."""

from __future__ import annotations

import json
from typing import Any

from stores.errors import InputError

__all__ = ["ChatTemplateError", "effective_chat_template", "chat_template_sha256", "render"]


class ChatTemplateError(InputError):
    """A conversation cannot be rendered or masked exactly with this chat template (a reject reason)."""


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


def render(tokenizer, messages, tools, chat_template, add_generation_prompt=False) -> str:
    """``messages`` (and ``tools``) rendered as text by ``chat_template`` (None: the tokenizer's own).

    Raises:
        ChatTemplateError: the template fails on this conversation (names the error).
    """
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
