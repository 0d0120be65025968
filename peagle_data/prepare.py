"""``peagle-data tokenize`` and ``pack``: the I/O around readers, chat masks, windows and packing.

Rows are streamed in chunks of ``CHUNK_CONVERSATIONS`` conversations: the main process reads and
normalises them, a chunk is rendered and tokenized in one batched tokenizer call (in
``--num-workers`` processes when more than one, results taken in input order, so the output is
identical to one worker), and rows are written in bounded batches.

A template that rewrites history (see :mod:`peagle_data.chat`) turns a conversation into one
row per assistant turn, ids ``conversation_id@turn``; with ``--on-history-rewrite reject`` the
conversation is rejected instead. Counts are per input conversation.

Message content that the chat template does not render (tool calls, tool results, reasoning, a
system message, the tools list, content parts of unsupported types) rejects the conversation
("template drops tool_calls: ..."); with ``--on-dropped-content keep`` it is kept without that
content and counted (``conversations_with_dropped_content``, ``dropped_<part>``), and an assistant
turn of which nothing is rendered supervises nothing.

``pack`` holds only window lengths, offsets and ids in memory: window tokens are spilled to a
temporary file in the output directory (5 bytes per token) and read back block by block after
best-fit decreasing has placed them, so peak memory does not grow with the token count.

Packing (DESIGN.md §5 best-fit decreasing, :func:`peagle_data.packing.pack_blocks_flexible`):
windows of long conversations are all W tokens (the last one is aligned to the body's end, see
:mod:`peagle_data.windows`); with ``skip``, that last window may also be cut back (dropping
leading loss-0 context tokens, never below the unaligned layout's start) to fill the largest gap
a shorter conversation left in a block. Every supervised token is still trained exactly once;
``windows_trimmed`` counts the windows packed shorter.

Counts in every manifest satisfy ``used + rejected == read``; each rejected row is one line in
``rejects.jsonl``. A conversation that yields no supervised token is rejected ("no supervised
tokens"), so every written row has ``n_loss_tokens >= 1``. Ids repeated across or within inputs
are renamed ``id~k`` and counted (``duplicate_ids_renamed``).

Outputs are written into a hidden sibling directory and renamed into place at the end
(:func:`stores.staging.staged_output_dir`): a run that fails (``--strict``, a bad file)
leaves no partial output, and the staging directory of a killed run is removed by the next run
writing the same output. A run that uses no row still writes its manifest and rejects; the CLI
then warns and exits 1.

``pack`` of a tokenize output ignores the tokenize-only options (:data:`TOKENIZE_ONLY`); it says
so in one line on stderr when the caller set one of them to a non-default value.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from peagle_data.dedup import Deduplicator, dedup_items, duplicate_reject, filter_reason, rows_key
from peagle_data.shards import check_shard, shard_filter, shard_of_key
from peagle_data.sources import input_files, iter_source_groups, mixture_of, source_bump, source_rejected
from peagle_data.chat import ChatTemplateError, chat_template_sha256, render_rows, tokenize_rendered
from peagle_data.packing import make_packed_row, pack_blocks_flexible, packing_efficiency
from peagle_data.readers import FORMATS, Conversation, Reject, UniqueIds, read_conversations, resolve_inputs
from peagle_data.windows import OVERLAP_LOSS, SystemPrefixTooLongError, Window, count_windows, make_windows
from stores.errors import InputError, StoreMismatchError
from stores.staging import staged_output_dir
from stores.token_tables import (
    MANIFEST,
    RejectsWriter,
    TableWriter,
    TokenTable,
    manifest_sha256,
    write_manifest,
    write_token_freq,
)

__all__ = ["TokenizeConfig", "PackConfig", "run_tokenize", "run_pack", "iter_tokenized", "CHUNK_CONVERSATIONS",
           "HISTORY_REWRITE", "TOKENIZE_ONLY", "ignored_tokenize_options"]

CHUNK_CONVERSATIONS = 64
"""Conversations rendered and tokenized together (one batched tokenizer call, one worker task)."""

HISTORY_REWRITE = ("split", "reject")
DROPPED_CONTENT = ("reject", "keep")

TOKENIZE_ONLY = {"format": "--format", "num_workers": "--num-workers", "on_history_rewrite": "--on-history-rewrite",
                 "on_dropped_content": "--on-dropped-content"}
"""``TokenizeConfig`` fields (and their options) that only shape tokenizing raw conversations: ``pack``
of a tokenize output ignores them (``limit``, ``strict`` and ``chat_template`` still apply)."""


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
    num_workers: int = 1
    """Processes that render and tokenize; the output is the same for any number (--num-workers)."""
    on_history_rewrite: str = "split"
    """split: one row per assistant turn when the template rewrites history; reject: reject the
    conversation (--on-history-rewrite)."""
    dedup: bool = True
    """Reject exact duplicates (same normalised messages; for tokenize outputs, same tokens and
    mask) after their first occurrence across all inputs (--dedup/--no-dedup; :mod:`peagle_data.dedup`)."""
    max_tokens: int | None = None
    """Reject conversations of more tokens than this (--max-tokens, tokens; None: no limit)."""
    min_loss_tokens: int | None = None
    """Reject conversations with fewer supervised tokens than this (--min-loss-tokens; None: no limit)."""
    on_dropped_content: str = "reject"
    """reject: reject a conversation with content the chat template does not render (tool calls,
    tool results, reasoning, a system message, tools, content parts of unsupported types); keep:
    keep it without that content, counted in the manifest (--on-dropped-content)."""
    num_shards: int = 1
    """Split the run into this many shards by conversation content (--num-shards; :mod:`peagle_data.shards`)."""
    shard_index: int = 0
    """The shard this run writes, in [0, num_shards) (--shard-index)."""

    def __post_init__(self) -> None:
        check_shard(self.num_shards, self.shard_index)
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
    ``strict`` and ``chat_template``, which must match the table's, apply)."""

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


# --------------------------------------------------------------------------------------------
# Shared pieces


def _load_tokenizer(tokenizer_name, tokenizer):
    if tokenizer is not None:
        return tokenizer
    from stores.model_cache import load_tokenizer

    return load_tokenizer(tokenizer_name)


def _read_template(path: str | None) -> str | None:
    """The text of a --chat-template file, checked to compile as Jinja.

    Raises:
        InputError: the file cannot be read or is not a valid Jinja template (names the file).
    """
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--chat-template {path}: cannot read the file ({e})") from None
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:  # another transformers version: plain jinja with the same extension
        import jinja2

        def compile_template(t):
            return jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).from_string(t)
    try:
        compile_template(text)
    except Exception as e:  # noqa: BLE001 - jinja2.TemplateSyntaxError and friends
        line = getattr(e, "lineno", None)
        raise InputError(f"--chat-template {path} is not a valid Jinja template"
                         f"{f' (line {line})' if line else ''}: {type(e).__name__}: {e}") from None
    return text


def _tokenizer_record(tokenizer_name, tokenizer, template_path: str | None, template: str | None) -> dict:
    return {"name": str(tokenizer_name), "vocab_size": len(tokenizer),
            "chat_template_file": template_path,
            "chat_template_sha256": chat_template_sha256(tokenizer, template)}


def _split_source(source: str) -> tuple[str, int | None]:
    file, _, row = source.rpartition(":")
    return (file, int(row)) if row.isdigit() else (source, None)


def _bump(counts: dict[str, Any], key: str, n: int = 1) -> None:
    counts[key] = counts.get(key, 0) + int(n)


def _reject(rejects: RejectsWriter, counts: dict[str, Any], source: str, reason: str, **extra) -> None:
    rejects.write(source, reason, **{k: v for k, v in extra.items() if v is not None})
    _bump(counts, "rejected")


def iter_tokenized(inputs: Sequence[str | os.PathLike], tokenizer, cfg: TokenizeConfig,
                   rejects: RejectsWriter, counts: dict[str, int], *, dedup: Deduplicator | None = None,
                   select=None) -> Iterator[list[dict[str, Any]]]:
    """Read, normalise and tokenize conversations, in input order.

    ``dedup`` is shared across calls (the sources of a mixture); None makes a new one when
    ``cfg.dedup``. ``select`` maps the deduplicated reader items to those to tokenize (weights,
    shards: :mod:`peagle_data.sources`); None keeps all.

    Rejected rows are written to ``rejects`` and counted; ``counts`` gains ``read``, ``rejected``,
    ``dropped_leading_assistant_turns``, ``merged_user_turns``, ``empty_assistant_turns``,
    ``history_rewrite_conversations``, ``history_rewrite_rows``, the per-row reader counts
    (``null_keys_dropped_rows``, ``tool_arguments_decoded``, ``tool_arguments_not_json``,
    ``tool_schemas_decoded``, ``dropped_content_parts``) and, with ``on_dropped_content="keep"``,
    ``conversations_with_dropped_content`` and ``dropped_<part>`` (messages whose part the template
    does not render; ``dropped_tools`` counts conversations).

    Yields:
        For every usable conversation, its tokenized-table rows (one, or one per assistant turn
        when the template rewrites history): ``{"conversation_id", "source", "input_ids" int32 [T],
        "loss_mask" uint8 [T], "system_len", "n_tokens", "n_loss_tokens"}``.

    Raises:
        InputError: with ``cfg.strict``, the first bad row (file, row and field where known).
    """
    template = _read_template(cfg.chat_template)
    split = cfg.on_history_rewrite == "split"
    bar = tqdm(total=cfg.limit, desc="tokenize", unit="conv", file=sys.stderr, disable=None)
    keep = cfg.on_dropped_content == "keep"
    if dedup is None and cfg.dedup:
        dedup = Deduplicator()
    items = dedup_items(read_conversations(inputs, fmt=cfg.format, strict=cfg.strict, limit=cfg.limit,
                                           keep_dropped=keep), dedup)
    if select is not None:
        items = select(items)
    chunks = iter(lambda: list(itertools.islice(items, CHUNK_CONVERSATIONS)), [])
    pool = None
    try:
        if cfg.num_workers > 1:
            ctx = multiprocessing.get_context("fork")
            pool = ctx.Pool(cfg.num_workers, initializer=_init_worker,
                            initargs=(tokenizer, template, split, cfg.on_dropped_content))
            results = pool.imap(_worker_chunk, chunks)
        else:
            results = (_tokenize_chunk(tokenizer, chunk, template, split, cfg.on_dropped_content)
                       for chunk in chunks)
        for outcomes in results:
            for item, outcome in outcomes:
                _bump(counts, "read")
                bar.update(1)
                _bump(counts, "duplicate_ids_renamed", item.duplicate_id_renamed)
                if isinstance(item, Reject):
                    duplicate_of = getattr(item, "duplicate_of", None)
                    _bump(counts, "duplicates", duplicate_of is not None)
                    _reject(rejects, counts, item.source, item.reason, conversation_id=item.conversation_id,
                            field=item.field, duplicate_of=duplicate_of)
                    continue
                if not isinstance(outcome, str) and not any(tok.loss_mask.any() for _, tok, _ in outcome):
                    outcome = "no supervised tokens: the template renders no assistant token"
                filtered = None if isinstance(outcome, str) else filter_reason(
                    max(len(t.input_ids) for _, t, _ in outcome), sum(int(t.loss_mask.sum()) for _, t, _ in outcome),
                    cfg.max_tokens, cfg.min_loss_tokens)
                if filtered is not None:  # a filter, not a bad row: rejected also with --strict
                    _reject(rejects, counts, item.source, filtered, conversation_id=item.conversation_id)
                    continue
                if isinstance(outcome, str):
                    if cfg.strict:
                        file, row = _split_source(item.source)
                        raise InputError(outcome, file=file, row=row, field="messages")
                    _reject(rejects, counts, item.source, outcome, conversation_id=item.conversation_id)
                    continue
                yield _rows_of(item, outcome, counts)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer, template, split, on_dropped) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER.update(tokenizer=tokenizer, template=template, split=split, on_dropped=on_dropped)


def _worker_chunk(chunk):
    return _tokenize_chunk(_WORKER["tokenizer"], chunk, _WORKER["template"], _WORKER["split"],
                           _WORKER["on_dropped"])


def _tokenize_chunk(tokenizer, chunk: list[Conversation | Reject], template, split: bool,
                    on_dropped: str = "reject") -> list[tuple]:
    """``[(item, outcome)]``: outcome is ``[(turn, TokenizedConversation, dropped parts)]``, a reject
    reason, or None for a reader reject. Rows of the whole chunk are tokenized in one batched call."""
    rendered: list[tuple[int, list]] = []
    outcomes: list[Any] = []
    for item in chunk:
        if isinstance(item, Reject):
            outcomes.append(None)
            continue
        try:
            rows = render_rows(tokenizer, item.messages, item.tools, template, per_turn_fallback=split,
                               on_dropped=on_dropped)
        except ChatTemplateError as e:
            outcomes.append(str(e))
            continue
        rendered.append((len(outcomes), rows))
        outcomes.append([])
    flat = [r for _, rows in rendered for r in rows]
    tokenized = iter(tokenize_rendered(tokenizer, flat))
    for at, rows in rendered:
        outcomes[at] = [(r.turn, next(tokenized), r.dropped) for r in rows]
        problem = next((t.problem for _, t, _ in outcomes[at] if t.problem), None)
        if problem:  # no exact mask for one of its rows: the conversation is a reject
            outcomes[at] = problem
    return list(zip(chunk, outcomes))


def _rows_of(conv: Conversation, outcome: list[tuple], counts: dict[str, Any]) -> list[dict[str, Any]]:
    _bump(counts, "dropped_leading_assistant_turns", conv.dropped_leading_assistant)
    _bump(counts, "conversations_with_dropped_leading_assistant", conv.dropped_leading_assistant > 0)
    _bump(counts, "merged_user_turns", conv.merged_user_turns)
    _bump(counts, "empty_assistant_turns", conv.empty_assistant_turns)
    for key, n in conv.counts.items():
        _bump(counts, key, n)
    dropped = {part for _, _, parts in outcome for part in parts}  # per-turn rows repeat context parts
    _bump(counts, "conversations_with_dropped_content", bool(dropped) or bool(conv.counts.get("dropped_content_parts")))
    for part in dropped:
        _bump(counts, f"dropped_{part.split(' of ')[0]}")
    per_turn = outcome[0][0] is not None
    _bump(counts, "history_rewrite_conversations", per_turn)
    _bump(counts, "history_rewrite_rows", len(outcome) if per_turn else 0)
    rows = []
    for turn, tok, _ in outcome:
        n_loss = int(tok.loss_mask.sum())
        rows.append({"conversation_id": conv.conversation_id if turn is None else f"{conv.conversation_id}@{turn}",
                     "source": conv.source, "input_ids": tok.input_ids, "loss_mask": tok.loss_mask,
                     "system_len": tok.system_len, "n_tokens": int(tok.input_ids.shape[0]),
                     "n_loss_tokens": n_loss})
    return rows


def _check_output_not_input(output, inputs) -> None:
    out = Path(output).resolve()
    for i in inputs:
        p = Path(i).resolve()
        if p == out or out in p.parents:
            raise InputError(f"--output {output} would overwrite the input {i}; choose another directory")


def _shard(cfg: TokenizeConfig):
    """The reader-item filter of ``cfg``'s shard, or None for an unsharded run."""
    return shard_filter(cfg.num_shards, cfg.shard_index) if cfg.num_shards > 1 else None


def _shard_record(cfg: TokenizeConfig) -> dict[str, Any]:
    return {"shard": {"num_shards": cfg.num_shards, "shard_index": cfg.shard_index}} if cfg.num_shards > 1 else {}


def _base_counts() -> dict[str, Any]:
    return {"read": 0, "used": 0, "rejected": 0, "null_keys_dropped_rows": 0, "tool_arguments_decoded": 0,
            "tool_arguments_not_json": 0, "tool_schemas_decoded": 0, "conversations_with_dropped_content": 0}


# --------------------------------------------------------------------------------------------
# tokenize


def run_tokenize(inputs: Sequence[str | os.PathLike], tokenizer_name: str | os.PathLike,
                 output: str | os.PathLike, cfg: TokenizeConfig, force: bool = False,
                 tokenizer=None, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """``peagle-data tokenize``: conversations -> a tokenized table (DESIGN.md §6).

    Args:
        inputs: conversation files, globs or ``sharegpt``.
        tokenizer_name: MODEL (``smollm2-135m``, a local directory or a hub id), recorded in the manifest.
        output: the table directory to create.
        cfg: reading and tokenizing options.
        force: replace an existing output.
        tokenizer: an already loaded tokenizer to use instead of loading ``tokenizer_name``.
        config: the command's resolved options (``--print-config``), recorded as the manifest's
            ``config`` so that ``--config`` can repeat the run.

    Returns:
        A summary: ``output``, ``counts`` (as in the manifest).

    Raises:
        OutputExistsError: ``output`` exists and ``force`` is false.
        InputError: bad inputs; with ``cfg.strict`` the first bad row.
        ModelNotFoundError, MissingDependencyError: the tokenizer cannot be loaded.
    """
    mixture = mixture_of(inputs)
    files = input_files(inputs, mixture)  # fail on bad arguments before touching the output
    _check_output_not_input(output, files)
    template = _read_template(cfg.chat_template)
    with staged_output_dir(output, force) as out:
        tokenizer = _load_tokenizer(tokenizer_name, tokenizer)
        counts = _base_counts()
        token_freq = _TokenFreq(len(tokenizer))
        n_tokens = n_loss = 0
        with TableWriter(out, "tokenized") as writer, RejectsWriter(out) as rejects:
            for group in iter_source_groups(iter_tokenized, inputs, mixture, tokenizer, cfg, rejects, counts,
                                            _shard(cfg)):
                _bump(counts, "used")
                for row in group:
                    writer.write(row)
                    n_tokens += row["n_tokens"]
                    n_loss += row["n_loss_tokens"]
                    token_freq.add(row["input_ids"][row["loss_mask"] == 1])
            by_reason = dict(rejects.by_reason)
        counts.update(tokens=n_tokens, loss_tokens=n_loss, rejected_by_reason=by_reason)
        assert counts["used"] + counts["rejected"] == counts["read"], counts
        write_token_freq(out, token_freq.counts())
        write_manifest(out, {
            "kind": "tokenized",
            "inputs": [str(i) for i in inputs],
            "files": [str(f) for f in files],
            "parameters": dataclasses.asdict(cfg),
            **({"config": config} if config is not None else {}),
            "tokenizer": _tokenizer_record(tokenizer_name, tokenizer, cfg.chat_template, template),
            "counts": dict(counts),
            **({"mixture": mixture.record()} if mixture is not None else {}),
            **_shard_record(cfg),
        })
    return {"output": str(output), "counts": dict(counts)}


# --------------------------------------------------------------------------------------------
# pack


def ignored_tokenize_options(cfg: TokenizeConfig, explicit: Collection[str] | None = None) -> list[str]:
    """The tokenize-only options that ``pack`` of a tokenize output ignores, as ``--option value``.

    Args:
        cfg: the tokenizing options given to pack.
        explicit: names of the ``cfg`` fields the caller set explicitly (the CLI: options given on
            the command line); None counts every field. Only those that also differ from their
            default are named.
    """
    default = TokenizeConfig()
    return [f"{option} {getattr(cfg, name)}" for name, option in TOKENIZE_ONLY.items()
            if (explicit is None or name in explicit) and getattr(cfg, name) != getattr(default, name)]


def _is_table(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def _iter_table_rows(tables: list[TokenTable], counts: dict[str, Any],
                     limit: int | None = None) -> Iterator[list[dict[str, Any]]]:
    """Rows of tokenize outputs grouped by conversation (per-turn rows share their ``source``);
    the first ``limit`` conversations when given. An id already seen (the same table twice,
    tables of the same file) is renamed ``id~k`` and counted in ``duplicate_ids_renamed``."""
    ids = UniqueIds()
    n = 0
    for table in tables:
        for _, group in itertools.groupby(table.iter_rows(), key=lambda r: r["source"]):
            if limit is not None and n >= limit:
                return
            n += 1
            _bump(counts, "read")
            group = list(group)
            renamed = False
            for row in group:
                row["conversation_id"], was = ids.unique(row["conversation_id"])
                renamed |= was
            _bump(counts, "duplicate_ids_renamed", renamed)
            yield group


def _filter_table_groups(groups: Iterator[list[dict[str, Any]]], cfg: TokenizeConfig, rejects: RejectsWriter,
                         counts: dict[str, Any]) -> Iterator[list[dict[str, Any]]]:
    """Tokenize-output conversations with exact duplicates (same token ids and loss masks, with
    ``cfg.dedup``) and those outside ``--max-tokens``/``--min-loss-tokens`` rejected and counted."""
    dedup = Deduplicator() if cfg.dedup else None
    for group in groups:
        source, cid = group[0]["source"], group[0]["conversation_id"]
        key = rows_key(group)
        source_bump(counts, group, read=1)
        if cfg.num_shards > 1 and shard_of_key(key, cfg.num_shards) != cfg.shard_index:
            counts["read"] -= 1  # read again by the shard that keeps it
            _bump(counts, "other_shards")
            source_bump(counts, group, other_shards=1)
            continue
        if dedup is not None:  # a weight's copies (source file:N*k) are not duplicates of their row
            copy = re.search(r":\d+\*(\d+)$", source)
            first = dedup.first_of(key + copy.group(1).encode() if copy else key, source)
            if first is not None:
                d = duplicate_reject(cid, source, first)
                _bump(counts, "duplicates")
                _reject(rejects, counts, source, d.reason.replace("same messages", "same tokens"),
                        conversation_id=cid, duplicate_of=first)
                source_bump(counts, group, rejected=1, duplicates=1)
                continue
        filtered = filter_reason(max(len(r["input_ids"]) for r in group),
                                 sum(int(np.sum(r["loss_mask"])) for r in group), cfg.max_tokens, cfg.min_loss_tokens)
        if filtered is not None:
            _reject(rejects, counts, source, filtered, conversation_id=cid)
            source_bump(counts, group, rejected=1)
            continue
        source_bump(counts, group, used=1)
        yield group


def _open_tables(inputs, tokenizer, template) -> list[TokenTable]:
    tables = []
    want = chat_template_sha256(tokenizer, template)
    for path in inputs:
        table = TokenTable.open(path)
        if table.kind != "tokenized":
            raise InputError(f"{path} is a {table.kind} table; pack reads conversations or a tokenize output")
        have = table.manifest.get("tokenizer", {}).get("chat_template_sha256")
        if have != want:
            raise StoreMismatchError(
                f"{path} was tokenized with chat template sha256 {have}, but --tokenizer/--chat-template "
                f"give {want}; pass the same tokenizer and template, or re-run tokenize")
        tables.append(table)
    return tables


def run_pack(inputs: Sequence[str | os.PathLike], tokenizer_name: str | os.PathLike,
             output: str | os.PathLike, cfg: PackConfig, force: bool = False,
             tokenizer=None, explicit: Collection[str] | None = None,
             config: dict[str, Any] | None = None) -> dict[str, Any]:
    """``peagle-data pack``: conversations or a tokenize output -> windows -> packed blocks (§5, §6).

    Args:
        inputs: conversation files / globs / ``sharegpt``, or tokenize output directories (not mixed).
        tokenizer_name: MODEL, recorded in the manifest (and used to tokenize raw conversations).
        output: the packed table directory to create.
        cfg: window, packing and (for raw inputs) tokenizing options.
        force: replace an existing output.
        tokenizer: an already loaded tokenizer to use instead of loading ``tokenizer_name``.
        explicit: names of the ``cfg.tokenize`` fields the caller set explicitly; with tokenize
            outputs as inputs, those of :data:`TOKENIZE_ONLY` set to a non-default value are named
            in one warning line on stderr (they are ignored). None counts every field.
        config: the command's resolved options, recorded as the manifest's ``config`` (as :func:`run_tokenize`).

    Returns:
        A summary: ``output``, ``counts`` (read/used/rejected, windows, windows_dropped, tokens,
        loss_tokens, n_blocks, packing_efficiency, ...).

    Raises:
        OutputExistsError: ``output`` exists and ``force`` is false.
        InputError: bad inputs, mixed raw and tokenized inputs; with strict, the first bad row.
        StoreMismatchError: a tokenize output made with another chat template.
    """
    if not inputs:
        raise InputError("no INPUT given")
    table_inputs = [_is_table(i) for i in inputs]
    if any(table_inputs) and not all(table_inputs):
        raise InputError("pack INPUTs must be all conversation files or all tokenize outputs, not a mix")
    mixture = None if all(table_inputs) else mixture_of(inputs)
    if not all(table_inputs):
        input_files(inputs, mixture)  # fail on bad arguments before touching the output
    _check_output_not_input(output, inputs)
    template = _read_template(cfg.tokenize.chat_template)
    tokenizer = _load_tokenizer(tokenizer_name, tokenizer)
    counts = _base_counts()
    if all(table_inputs):
        tables = _open_tables(inputs, tokenizer, template)  # refuses packed tables and mismatches first
        ignored = ignored_tokenize_options(cfg.tokenize, explicit)
        if ignored:
            print(f"WARNING: ignoring {', '.join(ignored)}: the INPUT is a tokenize output, already tokenized "
                  "(these options only apply to raw conversations)", file=sys.stderr)
        files = [str(t.directory) for t in tables]
        upstream = {str(t.directory): {"manifest_sha256": manifest_sha256(t.directory),
                                       "counts": t.manifest.get("counts")} for t in tables}
    else:
        files = input_files(inputs, mixture)
        upstream = None
    with staged_output_dir(output, force) as out:
        with RejectsWriter(out) as rejects:
            rows = (_filter_table_groups(_iter_table_rows(tables, counts, cfg.tokenize.limit), cfg.tokenize,
                                         rejects, counts) if upstream is not None
                    else iter_source_groups(iter_tokenized, inputs, mixture, tokenizer, cfg.tokenize, rejects, counts,
                                            _shard(cfg.tokenize)))
            with _WindowSpill(out) as spill:
                _collect_windows(rows, cfg, rejects, counts, spill)
                by_reason = dict(rejects.by_reason)
                counts["rejected_by_reason"] = by_reason
                assert counts["used"] + counts["rejected"] == counts["read"], counts
                token_freq = _write_blocks(out, spill, cfg.block_size_tokens, len(tokenizer), counts)
        write_token_freq(out, token_freq)
        manifest = {
            "kind": "packed",
            "inputs": [str(i) for i in inputs],
            "files": files,
            "parameters": {**dataclasses.asdict(cfg), "block_size": cfg.block_size_tokens},
            **({"config": config} if config is not None else {}),
            "tokenizer": _tokenizer_record(tokenizer_name, tokenizer, cfg.tokenize.chat_template, template),
            "counts": dict(counts),
        }
        if upstream is not None:
            manifest["upstream"] = upstream
        if mixture is not None:
            manifest["mixture"] = mixture.record()
        elif upstream is not None and len({json.dumps(t.manifest.get("mixture"), sort_keys=True) for t in tables}) == 1 \
                and tables[0].manifest.get("mixture"):
            manifest["mixture"] = tables[0].manifest["mixture"]  # the tokenize output's mixture
        manifest.update(_shard_record(cfg.tokenize))
        write_manifest(out, manifest)
    return {"output": str(output), "counts": dict(counts)}


class _TokenFreq:
    """Counts of loss-masked token ids, binned in batches (one ``bincount`` per ~1M tokens)."""

    def __init__(self, vocab_size: int, batch_tokens: int = 1 << 20):
        self.total = np.zeros(vocab_size, dtype=np.int64)
        self._pending: list[np.ndarray] = []
        self._n = 0
        self._batch = batch_tokens

    def add(self, ids: np.ndarray) -> None:
        self._pending.append(ids)
        self._n += len(ids)
        if self._n >= self._batch:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            self.total += np.bincount(np.concatenate(self._pending), minlength=len(self.total))[: len(self.total)]
        self._pending, self._n = [], 0

    def counts(self) -> np.ndarray:
        """int64 ``[vocab_size]``."""
        self._flush()
        return self.total


class _WindowSpill:
    """Window tokens on disk (ids int32 then mask uint8 per window); ids, lengths and offsets in memory.

    The file lives in the output directory and is removed on close.
    """

    def __init__(self, directory: Path):
        fd, self.path = tempfile.mkstemp(prefix=".windows-", suffix=".spill", dir=directory)
        self._f = os.fdopen(fd, "w+b")
        self.segment_ids: list[str] = []
        self.lengths: list[int] = []
        self.min_lengths: list[int] = []
        self.prefix_lens: list[int] = []
        self.offsets: list[int] = []
        self.datasets: list[str | None] = []
        """Each window's mixture source (None outside mixtures)."""
        self._end = 0
        self._dirty = False

    def append(self, segment_id: str, window: Window) -> None:
        data = window.input_ids.astype(np.int32).tobytes() + window.loss_mask.astype(np.uint8).tobytes()
        self._f.write(data)
        self._dirty = True
        self.segment_ids.append(segment_id)
        self.lengths.append(window.n_tokens)
        self.min_lengths.append(window.n_tokens - window.trimmable)
        self.prefix_lens.append(window.prefix_len)
        self.offsets.append(self._end)
        self._end += len(data)

    def read(self, i: int, n_tokens: int | None = None) -> tuple[str, np.ndarray, np.ndarray]:
        """``(segment_id, input_ids int32 [n], loss_mask uint8 [n])`` of window ``i``, cut to
        ``n_tokens`` (prefix kept, leading body tokens dropped; at least its minimum length)."""
        if self._dirty:
            self._f.flush()
            self._dirty = False
        n = self.lengths[i]
        data = os.pread(self._f.fileno(), 5 * n, self.offsets[i])
        ids = np.frombuffer(data, dtype=np.int32, count=n)
        mask = np.frombuffer(data, dtype=np.uint8, offset=4 * n, count=n)
        cut = 0 if n_tokens is None else n - n_tokens
        if cut:
            assert 0 < cut <= n - self.min_lengths[i], (i, n_tokens)
            keep = np.r_[0:self.prefix_lens[i], self.prefix_lens[i] + cut:n]
            ids, mask = ids[keep], mask[keep]
        return self.segment_ids[i], ids, mask

    def __enter__(self) -> "_WindowSpill":
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()
        os.unlink(self.path)


def _group_windows(group: list[dict[str, Any]], cfg: PackConfig) -> tuple[list[tuple], int, int]:
    """Windows ``(segment_id, Window)`` of one conversation's rows, candidates dropped, candidates."""
    segments, dropped, candidates = [], 0, 0
    for row in group:
        ids, mask, system_len = row["input_ids"], row["loss_mask"], int(row["system_len"])
        n_candidates = count_windows(len(ids), system_len, cfg.max_seq_len, cfg.overlap)
        windows = make_windows(ids, mask, system_len, cfg.max_seq_len, cfg.overlap, cfg.overlap_loss)
        dropped += n_candidates - len(windows)
        candidates += n_candidates
        segments += [(f"{row['conversation_id']}#{w.index}", w) for w in windows]
    return segments, dropped, candidates


def _collect_windows(groups: Iterator[list[dict[str, Any]]], cfg: PackConfig, rejects: RejectsWriter,
                     counts: dict[str, Any], spill: _WindowSpill) -> None:
    """Cut every conversation's rows into windows, spilled to ``spill``; conversations with none are rejected."""
    counts.update(windows=0, windows_dropped=0, windows_capped=0)
    for group in groups:
        source, cid = group[0]["source"], group[0]["conversation_id"]
        try:
            segments, dropped, candidates = _group_windows(group, cfg)
        except SystemPrefixTooLongError as e:
            if cfg.tokenize.strict:
                file, r = _split_source(source)
                raise InputError(str(e), file=file, row=r, field="system") from None
            _reject(rejects, counts, source, str(e), conversation_id=cid)
            source_rejected(counts, group)
            continue
        _bump(counts, "windows_dropped", dropped)
        if cfg.max_windows is not None and len(segments) > cfg.max_windows:
            _bump(counts, "windows_capped", len(segments) - cfg.max_windows)
            segments = segments[: cfg.max_windows]
        if not segments:
            _reject(rejects, counts, source, "no supervised tokens: no assistant token in any window",
                    conversation_id=cid)
            source_rejected(counts, group)
            continue
        _bump(counts, "used")
        _bump(counts, "windows", len(segments))
        _bump(counts, "conversations_split", candidates > len(group))
        for segment in segments:
            spill.append(*segment)
            spill.datasets.append(group[0].get("dataset"))


def _write_blocks(out: Path, spill: _WindowSpill, block_size: int, vocab_size: int,
                  counts: dict[str, Any]) -> np.ndarray:
    """Pack the spilled windows, write the packed table; returns token_freq int64 [vocab_size]."""
    blocks, used_lengths = pack_blocks_flexible(spill.lengths, spill.min_lengths, block_size)
    token_freq = _TokenFreq(vocab_size)
    n_tokens = n_loss = 0
    mixed = any(d is not None for d in spill.datasets)
    with TableWriter(out, "packed") as writer:
        for block_id, members in enumerate(tqdm(blocks, desc="pack", unit="block", file=sys.stderr,
                                                disable=None)):
            segments = [spill.read(i, used_lengths[i]) for i in members]
            row = make_packed_row(block_id, segments)
            if mixed:  # per-window sources and supervised tokens (peagle-data stats per source)
                row["segment_datasets"] = [spill.datasets[i] for i in members]
                row["segment_loss_tokens"] = [int(m.sum()) for _, _, m in segments]
            writer.write(row)
            ids, mask = row["input_ids"], row["loss_mask"]
            n_tokens += row["n_tokens"]
            n_loss += int(mask.sum())
            token_freq.add(ids[mask == 1])
    efficiency = packing_efficiency(n_tokens, len(blocks), block_size)
    counts.update(tokens=n_tokens, loss_tokens=n_loss, n_blocks=len(blocks), block_size=block_size,
                  packing_efficiency=round(efficiency, 6),
                  windows_trimmed=sum(u < n for u, n in zip(used_lengths, spill.lengths)))
    return token_freq.counts()
