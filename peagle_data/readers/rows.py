"""What a reader yields per input row: a :class:`Conversation`, a :class:`Reject`, a :class:`RowError`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["FORMATS", "SHAREGPT_ALIAS", "Conversation", "Reject", "RowError"]

FORMATS = ("auto", "openai", "sharegpt")
SHAREGPT_ALIAS = "sharegpt"


@dataclass
class Conversation:
    """One usable input row, normalised to OpenAI messages.

    Attributes:
        conversation_id: the row's ``id`` if it has one, else ``file:N`` (the path relative to the
            inputs' common parent, without extension); unique in a run (``~k`` suffix on repeats).
        source: ``file:N`` (N counts from 1).
        messages: ``[{"role", "content", ...}]`` with roles system/developer/user/assistant/tool;
            content is a string, None (an assistant turn with tool calls) or a list of
            ``{"type": "text", "text"}`` parts (two or more, or none).
        tools: tool definitions to pass to the chat template, or None.
        dropped_leading_assistant: assistant turns dropped from the start of the conversation.
        merged_user_turns: user turns merged into the preceding user turn.
        empty_assistant_turns: assistant turns with empty content (no supervised tokens).
        duplicate_id_renamed: 1 when ``conversation_id`` got a ``~k`` suffix, else 0.
        question: a question row (``read_conversations(questions=True)``): its assistant turns are
            empty places for the answers, after each user turn.
        chat_template_kwargs: the chat-template variables the row records it was answered with
            (``regenerate``'s per-row settings, its ``chat_template_kwargs`` key), or None.
        counts: other non-zero per-row counts, summed into the manifest: ``tool_arguments_decoded``
            (JSON-string tool-call arguments decoded), ``tool_calls_wrapped``, ``tool_schemas_decoded``,
            ``tool_schemas_wrapped``, ``sharegpt_function_calls``, ``sharegpt_observations``,
            ``dropped_content_parts`` (with ``keep_dropped``),
            ``null_keys_dropped_rows`` (1 for a Parquet row whose null keys were dropped),
            ``weight_zero_turns`` (assistant turns with ``"weight": 0``: context only),
            ``cut_assistant_turns`` (``"finish_reason": "length"``: no end-of-turn supervised).
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
    question: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


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


class RowError(Exception):
    """A row-level problem: the row cannot be used. Readers and the normaliser yield or raise it;
    :func:`peagle_data.readers.conversations.read_conversations` turns it into a :class:`Reject` (or, strict, an
    :class:`~stores.errors.InputError` naming file, row and field).

    Attributes:
        reason: starts with a short key before any ``:`` (``invalid JSON: ...``).
        field: the field of the row at fault (``messages[2].content``), or None.
    """

    def __init__(self, reason: str, field: str | None = None):
        super().__init__(reason)
        self.reason, self.field = reason, field
