"""The options of ``peagle-data tokenize`` and ``pack`` as typed configs (docs/design.md §6)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence
from pathlib import Path

from peagle_data.prepare.shards import check_shard
from peagle_data.prepare.windows import OVERLAP_LOSS
from peagle_data.readers.rows import FORMATS
from runtime.chat.chat_template import check_kwargs_names

__all__ = ["TokenizeConfig", "PackConfig", "TokenizeRun", "PackRun", "CHUNK_CONVERSATIONS", "HISTORY_REWRITE", "DROPPED_CONTENT",
           "SPECIAL_TOKEN_TEXT", "TOKENIZE_ONLY"]

CHUNK_CONVERSATIONS = 64
"""Conversations rendered and tokenized together (one batched tokenizer call, one worker task)."""

HISTORY_REWRITE = ("split", "reject")
DROPPED_CONTENT = ("reject", "keep")
SPECIAL_TOKEN_TEXT = ("reject", "keep")

TOKENIZE_ONLY = {"format": "--format", "num_workers": "--num-workers", "on_history_rewrite": "--on-history-rewrite",
                 "on_dropped_content": "--on-dropped-content", "on_special_token_text": "--on-special-token-text"}
"""``TokenizeConfig`` fields (and their options) that only shape tokenizing raw conversations: ``pack``
of a tokenize output ignores them (``limit``, ``strict``, ``chat_template`` and ``chat_template_kwargs`` still
apply: the last two must match the table's)."""


@dataclass(frozen=True, kw_only=True)
class TokenizeConfig:
    """How conversations are read and tokenized (``peagle-data tokenize``)."""

    format: str = "auto"
    """Conversation format of the input rows: auto (detected per row), openai or sharegpt (--format)."""
    limit: int | None = None
    """Read at most this many input rows, usable or not; None reads all (--limit, rows). For
    ``pack`` of a tokenize output: the first N conversations of the table(s)."""
    strict: bool = False
    """Stop with an error at the first bad row instead of writing it to rejects.jsonl (--strict)."""
    chat_template: str | None = None
    """Path of a Jinja chat template file replacing the tokenizer's own (--chat-template)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """The chat template's variables, as vLLM's ``chat_template_kwargs`` (--chat-template-kwargs, a JSON
    object such as ``{"enable_thinking": false}``): the mode the verifier is served in. Recorded in the
    manifest; ``pack`` of a tokenize output made with other variables is refused."""
    num_workers: int = 1
    """Processes that render and tokenize; the output is the same for any number (--num-workers)."""
    on_history_rewrite: str = "split"
    """split: one row per assistant turn when the template rewrites history; reject: reject the
    conversation (--on-history-rewrite)."""
    dedup: bool = True
    """Reject exact duplicates (same normalised messages; for tokenize outputs, same tokens and
    mask) after their first occurrence across all inputs; rejects.jsonl names the kept row (--dedup/--no-dedup)."""
    max_tokens: int | None = None
    """Reject conversations of more tokens than this (--max-tokens, tokens; None: no limit)."""
    min_loss_tokens: int | None = None
    """Reject conversations with fewer supervised tokens than this (--min-loss-tokens; None: no limit)."""
    on_dropped_content: str = "reject"
    """reject: reject a conversation with content the chat template does not render (tool calls,
    tool results, reasoning, a system message, tools, content parts of unsupported types); keep:
    keep it without that content, counted in the manifest (--on-dropped-content)."""
    on_special_token_text: str = "reject"
    """reject: reject a conversation whose supervised assistant reply writes a special token's text
    (<|im_end|>, <file_sep>), which the tokenizer reads as the control id, so the drafter would learn
    a control token inside an answer; keep: keep it as the tokenizer (and vLLM) reads it, counted in
    the manifest as conversations_with_special_token_text (--on-special-token-text)."""
    num_shards: int = 1
    """Split the run into this many shards by conversation content (--num-shards): a conversation's shard is its
    content digest modulo N, so duplicates stay together, as do the copies of a row that a mixture source's weight
    above 1 draws (a mixture file's ``weight``: the expected copies of each of the source's rows); the N outputs
    hold exactly the rows of the unsharded run."""
    shard_index: int = 0
    """The shard this run writes, in [0, num_shards) (--shard-index)."""

    def __post_init__(self) -> None:
        check_shard(self.num_shards, self.shard_index)
        object.__setattr__(self, "chat_template_kwargs", check_kwargs_names(self.chat_template_kwargs or {}))
        for name, option in (("max_tokens", "--max-tokens"), ("min_loss_tokens", "--min-loss-tokens")):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{option} must be >= 1 tokens, got {getattr(self, name)}")
        if self.num_workers < 1:
            raise ValueError(f"--num-workers must be >= 1 processes, got {self.num_workers}")
        if self.on_history_rewrite not in HISTORY_REWRITE:
            raise ValueError(f"--on-history-rewrite must be one of {', '.join(HISTORY_REWRITE)}, "
                             f"got {self.on_history_rewrite!r}")
        if self.on_dropped_content not in DROPPED_CONTENT:
            raise ValueError(f"--on-dropped-content must be one of {', '.join(DROPPED_CONTENT)}, "
                             f"got {self.on_dropped_content!r}")
        if self.on_special_token_text not in SPECIAL_TOKEN_TEXT:
            raise ValueError(f"--on-special-token-text must be one of {', '.join(SPECIAL_TOKEN_TEXT)}, "
                             f"got {self.on_special_token_text!r}")
        if self.format not in FORMATS:
            raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1 rows, got {self.limit}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            state = "is not a regular file" if Path(self.chat_template).exists() else "does not exist"
            raise ValueError(f"--chat-template {self.chat_template!r} {state}")


@dataclass(frozen=True, kw_only=True)
class PackConfig:
    """How tokenized conversations become windows and packed blocks (``peagle-data pack``)."""

    max_seq_len: int = 2048
    """Most tokens in a window (--max-seq-len, tokens)."""
    block_size: int | None = None
    """Most tokens in a packed block, >= max_seq_len; None means max_seq_len (--block-size, tokens)."""
    overlap: float = 0.5
    """Fraction of a window's body shared with the next window of a long conversation, in [0, 1) (--overlap)."""
    overlap_loss: str = "skip"
    """skip: a token supervised by an earlier window gets loss 0; keep: train the overlap twice (--overlap-loss)."""
    max_windows: int | None = None
    """Keep at most this many windows per conversation, the first ones; the rest are counted as
    ``windows_capped`` (--max-windows; None keeps all). Bounds the share of very long conversations."""
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    """How raw conversations are read and tokenized (for a tokenize output only ``limit``,
    ``strict``, ``chat_template`` and ``chat_template_kwargs``, the last two matching the table's, apply)."""

    def __post_init__(self) -> None:
        if self.max_seq_len < 2:
            raise ValueError(f"--max-seq-len must be >= 2 tokens, got {self.max_seq_len}")
        if self.block_size is not None and self.block_size < self.max_seq_len:
            raise ValueError(f"--block-size ({self.block_size}) must be >= --max-seq-len ({self.max_seq_len})")
        if not 0.0 <= self.overlap < 1.0:
            raise ValueError(f"--overlap must be in [0, 1), got {self.overlap}")
        if self.max_windows is not None and self.max_windows < 1:
            raise ValueError(f"--max-windows must be >= 1, got {self.max_windows}")
        if self.overlap_loss not in OVERLAP_LOSS:
            raise ValueError(f"--overlap-loss must be one of {', '.join(OVERLAP_LOSS)}, got {self.overlap_loss!r}")

    @property
    def block_size_tokens(self) -> int:
        """The effective block size in tokens."""
        return self.block_size if self.block_size is not None else self.max_seq_len


@dataclass(frozen=True, kw_only=True)
class _PrepareRun:
    """What one tokenize or pack run reads, with which tokenizer, and where it writes."""

    inputs: Sequence[str]
    """Conversation files (globs allowed), 'sharegpt', one mixture file, or (pack) tokenize outputs."""
    tokenizer: str
    """smollm2-135m, a local model directory or a Hugging Face id."""
    output: str
    """Output table directory (must not exist unless --force)."""
    force: bool = field(default=False, metadata={"action": True})
    """Overwrite an existing output."""


@dataclass(frozen=True, kw_only=True)
class TokenizeRun(_PrepareRun):
    """One ``peagle-data tokenize`` run: its inputs, tokenizer and output, and how (``settings``)."""

    settings: TokenizeConfig = field(default_factory=TokenizeConfig)
    """How conversations are read and tokenized."""


@dataclass(frozen=True, kw_only=True)
class PackRun(_PrepareRun):
    """One ``peagle-data pack`` run: its inputs, tokenizer and output, and how (``settings``)."""

    settings: PackConfig = field(default_factory=PackConfig)
    """How conversations are tokenized, cut into windows and packed."""
