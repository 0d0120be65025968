"""Question rows: the prompt-set lines that ask without answering (MT-Bench, plain prompt lists).

One row format, read by ``peagle-eval --prompts`` (the prompts it decodes) and by ``peagle-data
regenerate`` (questions the verifier answers into training conversations), so both accept the same files:

- MT-Bench: ``{"question_id": 81, "turns": ["first question", "follow-up", ...]}`` (a non-empty list
  of strings: user turns, each answered before the next is asked);
- a single prompt: ``{"prompt": "..."}`` or ``{"question": "..."}`` (a string).

The row's id is ``question_id``, else ``id`` (:func:`question_id`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["QUESTION_FIELDS", "QuestionRowError", "question_turns", "question_id"]

QUESTION_FIELDS = ("turns", "prompt", "question")
"""The fields that make a row a question row, in the order they are looked for."""


class QuestionRowError(ValueError):
    """A question field of the wrong shape; ``field`` names it."""

    def __init__(self, reason: str, field: str):
        super().__init__(reason)
        self.reason, self.field = reason, field


def question_turns(record: dict[str, Any]) -> list[str] | None:
    """The user turns of a question row, or None when ``record`` has no question field.

    Raises:
        QuestionRowError: ``turns`` is not a non-empty list of strings, or ``prompt``/``question`` not a
            non-empty string.
    """
    if record.get("turns") is not None:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise QuestionRowError("expected a non-empty list of strings", "turns")
        return list(turns)
    for name in ("prompt", "question"):
        if record.get(name) is not None:
            text = record[name]
            if not isinstance(text, str) or not text.strip():
                raise QuestionRowError(f"expected a non-empty string, got {type(text).__name__}"
                                       + (" (a list of messages goes in 'messages')" if isinstance(text, list) else ""),
                                       name)
            return [text]
    return None


def question_id(record: dict[str, Any]) -> str | None:
    """The row's id: ``question_id``, else ``id``, else None."""
    for key in ("question_id", "id"):
        if record.get(key) is not None:
            return str(record[key])
    return None
