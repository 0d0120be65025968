"""``peagle-data tokenize`` and ``pack``: the I/O around readers, chat masks, windows and packing.

Rows are streamed: conversations are read, tokenized and written one at a time (the writer holds
at most one batch). ``pack`` keeps every window in memory until it has packed them (best-fit
decreasing needs all lengths first): about 5 bytes per token plus ~200 bytes per window, so a few
hundred MB for the whole ShareGPT set; a disk-backed second pass is the way past that limit.

Counts in every manifest satisfy ``used + rejected == read``; each rejected row is one line in
``rejects.jsonl``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
from tqdm import tqdm

from peagle_data.chat import ChatTemplateError, chat_template_sha256, tokenize_conversation
from peagle_data.packing import make_packed_row, pack_blocks, packing_efficiency
from peagle_data.readers import FORMATS, Conversation, Reject, read_conversations, resolve_inputs
from peagle_data.windows import OVERLAP_LOSS, SystemPrefixTooLongError, count_windows, make_windows
from stores.errors import InputError, StoreMismatchError
from stores.token_tables import (
    MANIFEST,
    RejectsWriter,
    TableWriter,
    TokenTable,
    manifest_sha256,
    prepare_output_dir,
    write_manifest,
    write_token_freq,
)

__all__ = ["TokenizeConfig", "PackConfig", "run_tokenize", "run_pack", "iter_tokenized"]


@dataclass(frozen=True, kw_only=True)
class TokenizeConfig:
    """How conversations are read and tokenized (``peagle-data tokenize``)."""

    format: str = "auto"
    """Conversation format of the input rows: auto (detected per row), openai or sharegpt (--format)."""
    limit: int | None = None
    """Read at most this many input rows, usable or not; None reads all (--limit, rows)."""
    strict: bool = False
    """Stop with an error at the first bad row instead of writing it to rejects.jsonl (--strict)."""
    chat_template: str | None = None
    """Path of a Jinja chat template file replacing the tokenizer's own (--chat-template)."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"--limit must be >= 1 rows, got {self.limit}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(f"--chat-template {self.chat_template!r} is not a file")


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
    """How raw conversations are read and tokenized (ignored for a tokenize output)."""

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
    return None if path is None else Path(path).read_text(encoding="utf-8")


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
                   rejects: RejectsWriter, counts: dict[str, int]) -> Iterator[dict[str, Any]]:
    """Read, normalise and tokenize conversations one at a time.

    Rejected rows are written to ``rejects`` and counted; ``counts`` gains ``read``, ``rejected``,
    ``dropped_leading_assistant_turns``, ``merged_user_turns``, ``empty_assistant_turns``.

    Yields:
        ``{"conversation_id", "source", "input_ids" int32 [T], "loss_mask" uint8 [T],
        "system_len", "n_tokens", "n_loss_tokens"}`` (a tokenized-table row).

    Raises:
        InputError: with ``cfg.strict``, the first bad row (file, row and field where known).
    """
    template = _read_template(cfg.chat_template)
    bar = tqdm(total=cfg.limit, desc="tokenize", unit="conv", file=sys.stderr, disable=None)
    try:
        for item in read_conversations(inputs, fmt=cfg.format, strict=cfg.strict, limit=cfg.limit):
            _bump(counts, "read")
            bar.update(1)
            if isinstance(item, Reject):
                _reject(rejects, counts, item.source, item.reason, conversation_id=item.conversation_id,
                        field=item.field)
                continue
            row = _tokenize_one(item, tokenizer, template, cfg.strict, rejects, counts)
            if row is not None:
                yield row
    finally:
        bar.close()


def _tokenize_one(conv: Conversation, tokenizer, template, strict, rejects, counts) -> dict | None:
    try:
        tok = tokenize_conversation(tokenizer, conv.messages, tools=conv.tools, chat_template=template)
    except ChatTemplateError as e:
        if strict:
            file, row = _split_source(conv.source)
            raise InputError(str(e), file=file, row=row, field="messages") from None
        _reject(rejects, counts, conv.source, str(e), conversation_id=conv.conversation_id)
        return None
    _bump(counts, "dropped_leading_assistant_turns", conv.dropped_leading_assistant)
    _bump(counts, "conversations_with_dropped_leading_assistant", conv.dropped_leading_assistant > 0)
    _bump(counts, "merged_user_turns", conv.merged_user_turns)
    _bump(counts, "empty_assistant_turns", conv.empty_assistant_turns)
    n_loss = int(tok.loss_mask.sum())
    _bump(counts, "conversations_without_loss_tokens", n_loss == 0)
    return {"conversation_id": conv.conversation_id, "source": conv.source, "input_ids": tok.input_ids,
            "loss_mask": tok.loss_mask, "system_len": tok.system_len,
            "n_tokens": int(tok.input_ids.shape[0]), "n_loss_tokens": n_loss}


def _check_output_not_input(output, inputs) -> None:
    out = Path(output).resolve()
    for i in inputs:
        p = Path(i).resolve()
        if p == out or out in p.parents:
            raise InputError(f"--output {output} would overwrite the input {i}; choose another directory")


def _base_counts() -> dict[str, Any]:
    return {"read": 0, "used": 0, "rejected": 0}


# --------------------------------------------------------------------------------------------
# tokenize


def run_tokenize(inputs: Sequence[str | os.PathLike], tokenizer_name: str | os.PathLike,
                 output: str | os.PathLike, cfg: TokenizeConfig, force: bool = False,
                 tokenizer=None) -> dict[str, Any]:
    """``peagle-data tokenize``: conversations -> a tokenized table (DESIGN.md §6).

    Args:
        inputs: conversation files, globs or ``sharegpt``.
        tokenizer_name: MODEL (``smollm2-135m``, a local directory or a hub id), recorded in the manifest.
        output: the table directory to create.
        cfg: reading and tokenizing options.
        force: replace an existing output.
        tokenizer: an already loaded tokenizer to use instead of loading ``tokenizer_name``.

    Returns:
        A summary: ``output``, ``counts`` (as in the manifest).

    Raises:
        OutputExistsError: ``output`` exists and ``force`` is false.
        InputError: bad inputs; with ``cfg.strict`` the first bad row.
        ModelNotFoundError, MissingDependencyError: the tokenizer cannot be loaded.
    """
    files = resolve_inputs(inputs)  # fail on bad arguments before touching the output
    _check_output_not_input(output, files)
    out = prepare_output_dir(output, force)
    tokenizer = _load_tokenizer(tokenizer_name, tokenizer)
    template = _read_template(cfg.chat_template)
    counts = _base_counts()
    token_freq = np.zeros(len(tokenizer), dtype=np.int64)
    n_tokens = n_loss = 0
    with TableWriter(out, "tokenized") as writer, RejectsWriter(out) as rejects:
        for row in iter_tokenized(inputs, tokenizer, cfg, rejects, counts):
            writer.write(row)
            _bump(counts, "used")
            n_tokens += row["n_tokens"]
            n_loss += row["n_loss_tokens"]
            token_freq += np.bincount(row["input_ids"][row["loss_mask"] == 1], minlength=len(tokenizer))
        by_reason = dict(rejects.by_reason)
    counts.update(tokens=n_tokens, loss_tokens=n_loss, rejected_by_reason=by_reason)
    assert counts["used"] + counts["rejected"] == counts["read"], counts
    write_token_freq(out, token_freq)
    write_manifest(out, {
        "kind": "tokenized",
        "inputs": [str(i) for i in inputs],
        "files": [str(f) for f in files],
        "parameters": dataclasses.asdict(cfg),
        "tokenizer": _tokenizer_record(tokenizer_name, tokenizer, cfg.chat_template, template),
        "counts": dict(counts),
    })
    return {"output": str(out), "counts": dict(counts)}


# --------------------------------------------------------------------------------------------
# pack


def _is_table(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def _iter_table_rows(tables: list[TokenTable], counts: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for table in tables:
        for row in table.iter_rows():
            _bump(counts, "read")
            yield row


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
             tokenizer=None) -> dict[str, Any]:
    """``peagle-data pack``: conversations or a tokenize output -> windows -> packed blocks (§5, §6).

    Args:
        inputs: conversation files / globs / ``sharegpt``, or tokenize output directories (not mixed).
        tokenizer_name: MODEL, recorded in the manifest (and used to tokenize raw conversations).
        output: the packed table directory to create.
        cfg: window, packing and (for raw inputs) tokenizing options.
        force: replace an existing output.
        tokenizer: an already loaded tokenizer to use instead of loading ``tokenizer_name``.

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
    if not all(table_inputs):
        resolve_inputs(inputs)  # fail on bad arguments before touching the output
    _check_output_not_input(output, inputs)
    out = prepare_output_dir(output, force)
    tokenizer = _load_tokenizer(tokenizer_name, tokenizer)
    template = _read_template(cfg.tokenize.chat_template)
    counts = _base_counts()
    if all(table_inputs):
        tables = _open_tables(inputs, tokenizer, template)
        files = [str(t.directory) for t in tables]
        upstream = {str(t.directory): {"manifest_sha256": manifest_sha256(t.directory),
                                       "counts": t.manifest.get("counts")} for t in tables}
    else:
        files = [str(f) for f in resolve_inputs(inputs)]
        upstream = None
    with RejectsWriter(out) as rejects:
        rows = (_iter_table_rows(tables, counts) if upstream is not None
                else iter_tokenized(inputs, tokenizer, cfg.tokenize, rejects, counts))
        segments = _collect_windows(rows, cfg, rejects, counts)
        by_reason = dict(rejects.by_reason)
    counts["rejected_by_reason"] = by_reason
    assert counts["used"] + counts["rejected"] == counts["read"], counts
    token_freq = _write_blocks(out, segments, cfg.block_size_tokens, len(tokenizer), counts)
    write_token_freq(out, token_freq)
    manifest = {
        "kind": "packed",
        "inputs": [str(i) for i in inputs],
        "files": files,
        "parameters": {**dataclasses.asdict(cfg), "block_size": cfg.block_size_tokens},
        "tokenizer": _tokenizer_record(tokenizer_name, tokenizer, cfg.tokenize.chat_template, template),
        "counts": dict(counts),
    }
    if upstream is not None:
        manifest["upstream"] = upstream
    write_manifest(out, manifest)
    return {"output": str(out), "counts": dict(counts)}


def _collect_windows(rows: Iterator[dict[str, Any]], cfg: PackConfig, rejects: RejectsWriter,
                     counts: dict[str, Any]) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """Windows of every row as ``(segment_id, input_ids, loss_mask)``; rows with none are rejected."""
    segments: list[tuple[str, np.ndarray, np.ndarray]] = []
    counts.update(windows=0, windows_dropped=0, windows_capped=0)
    for row in rows:
        ids, mask, system_len = row["input_ids"], row["loss_mask"], int(row["system_len"])
        try:
            n_candidates = count_windows(len(ids), system_len, cfg.max_seq_len, cfg.overlap)
            windows = make_windows(ids, mask, system_len, cfg.max_seq_len, cfg.overlap, cfg.overlap_loss)
        except SystemPrefixTooLongError as e:
            if cfg.tokenize.strict:
                file, r = _split_source(row["source"])
                raise InputError(str(e), file=file, row=r, field="system") from None
            _reject(rejects, counts, row["source"], str(e), conversation_id=row["conversation_id"])
            continue
        _bump(counts, "windows_dropped", n_candidates - len(windows))
        if cfg.max_windows is not None and len(windows) > cfg.max_windows:
            _bump(counts, "windows_capped", len(windows) - cfg.max_windows)
            windows = windows[: cfg.max_windows]
        if not windows:
            _reject(rejects, counts, row["source"], "no supervised tokens: no assistant token in any window",
                    conversation_id=row["conversation_id"])
            continue
        _bump(counts, "used")
        _bump(counts, "windows", len(windows))
        _bump(counts, "conversations_split", n_candidates > 1)
        for w in windows:
            segments.append((f"{row['conversation_id']}#{w.index}", w.input_ids, w.loss_mask))
    return segments


def _write_blocks(out: Path, segments, block_size: int, vocab_size: int, counts: dict[str, Any]) -> np.ndarray:
    """Pack the segments, write the packed table; returns token_freq int64 [vocab_size]."""
    blocks = pack_blocks([len(s[1]) for s in segments], block_size)
    token_freq = np.zeros(vocab_size, dtype=np.int64)
    n_tokens = n_loss = 0
    with TableWriter(out, "packed") as writer:
        for block_id, members in enumerate(tqdm(blocks, desc="pack", unit="block", file=sys.stderr,
                                                disable=None)):
            row = make_packed_row(block_id, [segments[i] for i in members])
            writer.write(row)
            ids, mask = row["input_ids"], row["loss_mask"]
            n_tokens += row["n_tokens"]
            n_loss += int(mask.sum())
            token_freq += np.bincount(ids[mask == 1], minlength=vocab_size)
    counts.update(tokens=n_tokens, loss_tokens=n_loss, n_blocks=len(blocks), block_size=block_size,
                  packing_efficiency=round(packing_efficiency(n_tokens, len(blocks), block_size), 6))
    return token_freq
