"""The counts of one ``tokenize`` or ``pack`` run (the manifest's ``counts``; docs/design.md §6).

A fixed field per fixed counter, a mapping for the counters named by the data (``dropped_<part>``),
the per-source entries of a mixture and the rejects by reason. A counter that is None was never counted in the run and is left out of
:meth:`Counts.to_manifest` (a counter counted zero times is written as 0), so a manifest holds the
same keys as the run touched.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Counts"]


@dataclass
class Counts:
    """Counters of a tokenize or pack run; :meth:`to_manifest` is the manifest's ``counts``."""

    read: int = 0
    """Input conversations read (rows of the input files, or conversations of tokenize outputs)."""
    used: int = 0
    """Conversations written (tokenize) or cut into at least one window (pack)."""
    rejected: int = 0
    """Conversations written to rejects.jsonl; ``used + rejected == read``."""
    null_keys_dropped_rows: int = 0
    """Rows where a null key counted as absent (Parquet rows have every key of every row)."""
    tool_arguments_decoded: int = 0
    """Tool-call arguments given as a JSON string and decoded."""
    tool_schemas_decoded: int = 0
    """Tool schemas given as JSON strings and decoded."""
    conversations_with_dropped_content: int = 0
    """Conversations kept without content the chat template drops (``--on-dropped-content keep``)."""
    conversations_with_special_token_text: int | None = None
    """Conversations kept whose supervised replies write a special token's text, read as its control
    id (``--on-special-token-text keep``; counted only then)."""
    tool_calls_wrapped: int | None = None
    """Flat tool calls ``{"name", "arguments"}`` wrapped as ``{"type": "function", "function": ...}``."""
    tool_schemas_wrapped: int | None = None
    """Bare tool schemas ``{"name", "parameters"}`` wrapped as ``{"type": "function", "function": ...}``."""
    sharegpt_function_calls: int | None = None
    """Tool calls of ShareGPT ``function_call`` turns, made OpenAI ``tool_calls`` entries."""
    sharegpt_observations: int | None = None
    """ShareGPT ``observation`` (``tool``, ``function``) turns, made ``tool`` messages."""
    duplicate_ids_renamed: int | None = None
    """Conversations whose id was seen before, renamed ``id~k``."""
    duplicates: int | None = None
    """Exact duplicates rejected after their first occurrence (``--dedup``)."""
    dropped_leading_assistant_turns: int | None = None
    """Assistant turns before the first user turn, dropped."""
    conversations_with_dropped_leading_assistant: int | None = None
    """Conversations that had such turns."""
    merged_user_turns: int | None = None
    """Consecutive user turns merged into one."""
    empty_assistant_turns: int | None = None
    """Assistant turns with no text, reasoning or tool call (unsupervised)."""
    dropped_content_parts: int | None = None
    """Content parts of unsupported types left out (``--on-dropped-content keep``)."""
    weight_zero_turns: int | None = None
    """Assistant turns marked ``"weight": 0`` (context only)."""
    cut_assistant_turns: int | None = None
    """Assistant turns marked ``"finish_reason": "length"`` (cut at a token limit): their text is
    supervised, the end-of-turn token after it is not."""
    turns_on_generated_ids: int | None = None
    """Last assistant turns trained on the ids the verifier generated (``token_ids``) in place of the
    re-tokenization of their text: the same text, another tokenization."""
    dropped: dict[str, int] = field(default_factory=dict)
    """Conversations kept without each kind of content the template drops: ``{part: n}``, written
    as ``dropped_<part>`` keys (``dropped_tools``, ``dropped_reasoning``, ...)."""
    served_prompt_rows: int | None = None
    """Rows tokenized as served, the generation prompt alone and then the reply, since tokenized whole the
    reply changed the prompt's last tokens (``peagle_data.chat.served.served_pieces``: a prompt ending in
    ``</think>\n\n`` under a tokenizer that splits a newline run before a letter)."""
    served_turn_conversations: int | None = None
    """Conversations split into one row per assistant turn because no one sequence holds every turn's served
    prompt (each tokenized alone) and reply (``peagle_data.chat.render.served_turn_rows``)."""
    served_turn_rows: int | None = None
    """The rows of those conversations."""
    history_rewrite_conversations: int | None = None
    """Conversations split into one row per assistant turn (the template rewrites history)."""
    history_rewrite_rows: int | None = None
    """The rows of those conversations."""
    other_shards: int | None = None
    """Input items of other shards (``--num-shards``)."""
    sampled_out: int | None = None
    """Mixture rows not drawn by a source's weight below 1."""
    copies: int | None = None
    """Extra copies of mixture rows drawn by a source's weight above 1."""
    windows: int | None = None
    """Windows written (pack)."""
    windows_dropped: int | None = None
    """Windows with no supervised token left (pack)."""
    windows_capped: int | None = None
    """Windows after the first ``--max-windows`` of a conversation (pack)."""
    conversations_split: int | None = None
    """Conversations cut into more windows than they have rows (pack)."""
    tokens: int | None = None
    """Tokens written."""
    loss_tokens: int | None = None
    """Supervised tokens written."""
    rejected_by_reason: dict[str, int] | None = None
    """Rejected conversations by reason (rejects.jsonl)."""
    n_blocks: int | None = None
    """Packed blocks (pack)."""
    block_size: int | None = None
    """Tokens per packed block (pack)."""
    packing_efficiency: float | None = None
    """Used tokens / (blocks x block_size), rounded to 6 digits (pack)."""
    windows_trimmed: int | None = None
    """Windows packed shorter than cut (pack)."""
    sources: dict[str, dict[str, int]] | None = None
    """Per-source counts of a mixture: ``{name: {read, used, rejected, duplicates, ...}}``."""
    conversations_with_own_template_kwargs: int | None = None
    """Conversations rendered with the chat-template variables they record (``chat_template_kwargs``:
    ``regenerate``'s per-row settings, a mixture of modes) on top of --chat-template-kwargs."""
    template_modes: dict[str, int] = field(default_factory=dict)
    """Conversations kept per chat-template variables they were rendered with: ``{JSON of the variables:
    n}``; written only when some conversation records its own (the table is a mixture of modes)."""

    def bump(self, name: str, n: int = 1) -> None:
        """Add ``n`` (an int or a bool) to the counter ``name``, counting it from 0 if it never was.

        Raises:
            AttributeError: ``name`` is no integer counter of this class.
        """
        if name not in _COUNTERS:
            raise AttributeError(f"Counts has no counter {name!r}")
        setattr(self, name, (getattr(self, name) or 0) + int(n))

    def drop(self, part: str) -> None:
        """Count one conversation kept without ``part`` (``dropped_<part>``)."""
        self.dropped[part] = self.dropped.get(part, 0) + 1

    def source(self, name: str) -> dict[str, int]:
        """The per-source counts of ``name`` (a new zero entry the first time)."""
        if self.sources is None:
            self.sources = {}
        return self.sources.setdefault(name, {"read": 0, "used": 0, "rejected": 0, "duplicates": 0,
                                              "other_shards": 0})

    def add(self, other: Counts) -> None:
        """Add every counter of ``other`` (a mixture source's run) except ``used``."""
        for name in _COUNTERS - {"used"}:
            if getattr(other, name) is not None:
                self.bump(name, getattr(other, name))
        for part, n in other.dropped.items():
            self.dropped[part] = self.dropped.get(part, 0) + n
        for mode, n in other.template_modes.items():
            self.template_modes[mode] = self.template_modes.get(mode, 0) + n

    def mode(self, kwargs: dict[str, Any]) -> None:
        """Count one conversation kept, rendered with the template variables ``kwargs``."""
        key = json.dumps(kwargs, sort_keys=True)
        self.template_modes[key] = self.template_modes.get(key, 0) + 1

    def to_manifest(self) -> dict[str, Any]:
        """The manifest's ``counts``: the counted fields in field order, ``dropped`` as ``dropped_<part>``
        keys in the order first counted."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "dropped":
                out.update({f"dropped_{part}": n for part, n in value.items()})
            elif f.name == "template_modes":
                if self.conversations_with_own_template_kwargs:
                    out[f.name] = dict(sorted(value.items()))
            elif value is not None:
                out[f.name] = dict(value) if isinstance(value, dict) else value
        if self.sources is not None:
            out["sources"] = {name: dict(c) for name, c in self.sources.items()}
        return out


_COUNTERS = frozenset(f.name for f in dataclasses.fields(Counts)
                      if f.name not in ("dropped", "rejected_by_reason", "sources", "packing_efficiency",
                                    "template_modes"))
