"""``peagle-data pack``: a tokenize output or conversations -> windows, best-fit packing, the packed table.

Modules: :mod:`peagle_data.prepare.config` (the typed options), :mod:`peagle_data.prepare.tokenizing`
(reading, rendering and tokenizing rows in chunks, ``run_tokenize``), this module (``run_pack``:
windows, spill, packing, the packed table) and :mod:`peagle_data.prepare.windows` (the window and trim policy).

Rows, rejects and counts: docs/design.md §5 (windows and packing, ``used + rejected == read``) and §6 (per-turn
rows of a template that rewrites history, dropped content). ``pack`` holds only window lengths, offsets and ids in
memory: window tokens are spilled to a temporary file in the output directory (5 bytes per token) and read back
block by block, so peak memory does not grow with the token count. Outputs are staged
(:func:`stores.staging.staged_output_dir`): a failed run leaves no partial output. ``pack`` of a tokenize output
ignores the tokenize-only options (:data:`TOKENIZE_ONLY`), saying so on stderr for one set to a non-default value.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Collection, Iterator

import numpy as np

from runtime.chat.chat_template import chat_template_sha256, check_chat_template_kwargs
from peagle_data.prepare.config import TOKENIZE_ONLY, PackConfig, PackRun, TokenizeConfig
from peagle_data.prepare.counts import Counts
from peagle_data.prepare.dedup import Deduplicator, copy_key, duplicate_reject, filter_reason, rows_key
from peagle_data.prepare.packing import make_packed_row, pack_blocks_flexible, packing_efficiency
from peagle_data.prepare.shards import shard_of_key
from peagle_data.prepare.sources import input_files, iter_source_groups, mixture_of, source_bump, source_rejected
from peagle_data.prepare.tokenizing import (
    TokenFreq,
    check_output_not_input,
    check_regenerated_mode,
    iter_tokenized,
    read_template,
    resolve_tokenizer,
    run_shard_filter,
    shard_record,
    split_source,
    tokenizer_record,
    write_reject,
)
from peagle_data.prepare.windows import SystemPrefixTooLongError, Window, conversation_windows, trim_window
from peagle_data.readers.inputs import UniqueIds
from stores.errors import InputError, StoreMismatchError
from runtime.progress import progress
from stores.staging import staged_output_dir
from stores.tables.token_rows import TokenizedRow, content_key
from stores.tables.token_tables import (
    MANIFEST,
    RejectsWriter,
    CONVERSATIONS,
    TableWriter,
    conversations_record,
    TokenTable,
    manifest_sha256,
    write_manifest,
    write_token_freq,
)
from runtime.verifier_match import check_tokenizer

__all__ = ["run_pack", "ignored_tokenize_options"]


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


def _iter_table_rows(tables: list[TokenTable], counts: Counts,
                     limit: int | None = None) -> Iterator[list[TokenizedRow]]:
    """Rows of tokenize outputs grouped by conversation (per-turn rows share their ``source``);
    the first ``limit`` conversations when given. An id already seen (the same table twice,
    tables of the same file) is renamed ``id~k`` and counted in ``duplicate_ids_renamed``."""
    ids = UniqueIds()
    n = 0
    for table in tables:
        rows = (TokenizedRow(**r) for r in table.iter_rows())
        for _, group in itertools.groupby(rows, key=lambda r: r.source):
            if limit is not None and n >= limit:
                return
            n += 1
            counts.read += 1
            group = list(group)
            renamed = False
            for row in group:
                row.conversation_id, was = ids.unique(row.conversation_id)
                renamed |= was
            counts.bump("duplicate_ids_renamed", renamed)
            yield group


def _filter_table_groups(groups: Iterator[list[TokenizedRow]], cfg: TokenizeConfig, rejects: RejectsWriter,
                         counts: Counts) -> Iterator[list[TokenizedRow]]:
    """Tokenize-output conversations with exact duplicates (same token ids and loss masks, with
    ``cfg.dedup``) and those outside ``--max-tokens``/``--min-loss-tokens`` rejected and counted."""
    dedup = Deduplicator() if cfg.dedup else None
    for group in groups:
        source, cid = group[0].source, group[0].conversation_id
        key = rows_key(group)
        source_bump(counts, group, read=1)
        if cfg.num_shards > 1 and shard_of_key(key, cfg.num_shards) != cfg.shard_index:
            counts.read -= 1  # read again by the shard that keeps it
            counts.bump("other_shards")
            source_bump(counts, group, other_shards=1)
            continue
        if dedup is not None:  # a weight's copies (source file:N*k) are not duplicates of their row
            first = dedup.first_of(copy_key(key, source), source)
            if first is not None:
                d = duplicate_reject(cid, source, first)
                counts.bump("duplicates")
                write_reject(rejects, counts, source, d.reason.replace("same messages", "same tokens"),
                        conversation_id=cid, duplicate_of=first)
                source_bump(counts, group, rejected=1, duplicates=1)
                continue
        filtered = filter_reason(max(len(r.input_ids) for r in group),
                                 sum(int(np.sum(r.loss_mask)) for r in group), cfg.max_tokens, cfg.min_loss_tokens)
        if filtered is not None:
            write_reject(rejects, counts, source, filtered, conversation_id=cid)
            source_bump(counts, group, rejected=1)
            continue
        source_bump(counts, group, used=1)
        yield group


def _open_tables(inputs, tokenizer, template, tokenizer_name, template_kwargs=None) -> list[TokenTable]:
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
        check_chat_template_kwargs(table.manifest.get("tokenizer", {}), f"the tokenize output {path}", template_kwargs,
                                   fix="pass the --chat-template-kwargs it was tokenized with, or re-run tokenize "
                                       "in this mode")
        check_tokenizer(table.manifest.get("tokenizer", {}), f"the tokenize output {path}", tokenizer,
                        f"--tokenizer {tokenizer_name or tokenizer.name_or_path}", "pass the tokenizer it was tokenized with, or re-run tokenize")
        tables.append(table)
    return tables


def run_pack(run: PackRun, tokenizer=None, explicit: Collection[str] | None = None,
             config: dict[str, Any] | None = None) -> dict[str, Any]:
    """``peagle-data pack``: conversations or a tokenize output -> windows -> packed blocks (§5, §6).

    Args:
        run: the inputs (conversation files / globs / ``sharegpt`` / one mixture file, or tokenize
            output directories, not mixed), the tokenizer MODEL (recorded in the manifest, and used to
            tokenize raw conversations), the packed table directory to create, ``force`` to replace
            an existing one, and the window, packing and (for raw inputs) tokenizing ``settings``.
        tokenizer: an already loaded tokenizer to use instead of loading ``run.tokenizer``.
        explicit: names of the ``settings.tokenize`` fields the caller set explicitly; with tokenize
            outputs as inputs, those of :data:`TOKENIZE_ONLY` set to a non-default value are named
            in one warning line on stderr (they are ignored). None counts every field.
        config: the command's resolved options, recorded as the manifest's ``config`` (as :func:`run_tokenize`).

    Returns:
        A summary: ``output``, ``counts`` (read/used/rejected, windows, windows_dropped, tokens,
        loss_tokens, n_blocks, packing_efficiency, ...).

    Raises:
        OutputExistsError: ``run.output`` exists and ``run.force`` is false.
        InputError: bad inputs, mixed raw and tokenized inputs; with strict, the first bad row.
        StoreMismatchError: a tokenize output (or a regenerate output) made with another chat template, its variables
            (--chat-template-kwargs) or tokenizer.
    """
    inputs, tokenizer_name, output, cfg = run.inputs, run.tokenizer, run.output, run.settings
    mixture, tables = _check_pack_inputs(inputs, output)
    template = read_template(cfg.tokenize.chat_template)
    tokenizer = resolve_tokenizer(tokenizer_name, tokenizer)
    counts = Counts()
    if tables is not None:
        tables = _open_tables(inputs, tokenizer, template, tokenizer_name,  # refuses packed tables and mismatches first
                              cfg.tokenize.chat_template_kwargs)
        ignored = ignored_tokenize_options(cfg.tokenize, explicit)
        if ignored:
            print(f"WARNING: ignoring {', '.join(ignored)}: the INPUT is a tokenize output, already tokenized "
                  "(these options only apply to raw conversations)", file=sys.stderr)
        files = [str(t.directory) for t in tables]
    else:
        files = input_files(inputs, mixture)
        check_regenerated_mode(files, cfg.tokenize.chat_template_kwargs)
    with staged_output_dir(output, run.force) as out:
        with RejectsWriter(out) as rejects:
            rows = (_filter_table_groups(_iter_table_rows(tables, counts, cfg.tokenize.limit), cfg.tokenize,
                                         rejects, counts) if tables is not None
                    else iter_source_groups(iter_tokenized, inputs, mixture, tokenizer, cfg.tokenize, rejects, counts,
                                            run_shard_filter(cfg.tokenize)))
            (out / CONVERSATIONS).mkdir()
            with _WindowSpill(out) as spill, TableWriter(out / CONVERSATIONS, "tokenized") as conversations:
                _collect_windows(rows, cfg, rejects, counts, spill, conversations)
                counts.rejected_by_reason = dict(rejects.by_reason)
                assert counts.used + counts.rejected == counts.read, counts
                token_freq = _write_blocks(out, spill, cfg.block_size_tokens, len(tokenizer), counts)
        write_token_freq(out, token_freq)
        write_manifest(out / CONVERSATIONS, {"kind": "tokenized", "of": "the rows the packed table's windows are cut from",
                                             "rows": conversations.n_rows})
        write_manifest(out, {**_pack_manifest(inputs, files, cfg, tokenizer_name, tokenizer, template, counts,
                                              mixture, tables, config), CONVERSATIONS: conversations_record(out)})
    return {"output": str(output), "counts": counts.to_manifest()}


def _check_pack_inputs(inputs, output) -> tuple[Any, list | None]:
    """``(mixture or None, [] for tokenize-output inputs else None)``, checked before the output is touched.

    Raises:
        InputError: no input, raw and tokenized inputs mixed, bad arguments, output inside an input.
    """
    if not inputs:
        raise InputError("no INPUT given")
    table_inputs = [_is_table(i) for i in inputs]
    if any(table_inputs) and not all(table_inputs):
        raise InputError("pack INPUTs must be all conversation files or all tokenize outputs, not a mix")
    mixture = None if all(table_inputs) else mixture_of(inputs)
    if not all(table_inputs):
        input_files(inputs, mixture)  # fail on bad arguments before touching the output
    check_output_not_input(output, inputs)
    return mixture, ([] if all(table_inputs) else None)


def _pack_manifest(inputs, files: list, cfg: PackConfig, tokenizer_name, tokenizer, template: str | None,
                   counts: Counts, mixture, tables: list[TokenTable] | None,
                   config: dict[str, Any] | None) -> dict[str, Any]:
    """The packed table's manifest (``upstream``: each tokenize output's manifest sha256 and counts)."""
    manifest = {
        "kind": "packed",
        "inputs": [str(i) for i in inputs],
        "files": files,
        "parameters": {**dataclasses.asdict(cfg), "block_size": cfg.block_size_tokens},
        **({"config": config} if config is not None else {}),
        "tokenizer": tokenizer_record(tokenizer_name, tokenizer, cfg.tokenize.chat_template, template,
                                      cfg.tokenize.chat_template_kwargs),
        "counts": counts.to_manifest(),
    }
    if tables is not None:
        manifest["upstream"] = {str(t.directory): {"manifest_sha256": manifest_sha256(t.directory),
                                                   "counts": t.manifest.get("counts")} for t in tables}
    if mixture is not None:
        manifest["mixture"] = mixture.record()
    elif tables is not None and len({json.dumps(t.manifest.get("mixture"), sort_keys=True) for t in tables}) == 1 \
            and tables[0].manifest.get("mixture"):
        manifest["mixture"] = tables[0].manifest["mixture"]  # the tokenize output's mixture
    manifest.update(shard_record(cfg.tokenize))
    return manifest


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
        self.body_starts: list[int] = []
        """Each window's first body token in its conversation (``system_len + Window.body_start``; 0
        for a whole conversation), before the packer trims it."""
        self.offsets: list[int] = []
        self.datasets: list[str | None] = []
        """Each window's mixture source (None outside mixtures)."""
        self.keys: list[int] = []
        """Each window's conversation content key (:func:`stores.tables.token_rows.content_key`)."""
        self.conversations: list[int] = []
        """Each window's conversation, numbered in input order (its per-turn rows are one conversation)."""
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
        self.body_starts.append(window.prefix_len + window.body_start)
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
        if n_tokens is not None and n_tokens != n:
            assert self.min_lengths[i] <= n_tokens < n, (i, n_tokens)
            ids, mask = trim_window(ids, mask, self.prefix_lens[i], n_tokens)
        return self.segment_ids[i], ids, mask

    def __enter__(self) -> "_WindowSpill":
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()
        os.unlink(self.path)


def _collect_windows(groups: Iterator[list[TokenizedRow]], cfg: PackConfig, rejects: RejectsWriter,
                     counts: Counts, spill: _WindowSpill, conversations: TableWriter) -> None:
    """Cut every conversation's rows into windows, spilled to ``spill``; conversations with none are
    rejected. Each row a kept window comes from is written to ``conversations`` (the packed table's
    :data:`~stores.tables.token_tables.CONVERSATIONS` sub-table, read by full-context extraction). A row id
    another row of the run already has (an input id equal to another conversation's per-turn ``ID@k`` or
    mixture-copy ``ID*k`` id) is renamed ``~k`` and counted in ``duplicate_ids_renamed``, so that a window
    id names one row (a sharded run cannot see the other shards' ids: full-context extraction refuses
    the merged table then)."""
    counts.windows = counts.windows_dropped = counts.windows_capped = 0
    ids = UniqueIds()
    for group in groups:
        renamed = False
        for row in group:
            row.conversation_id, was = ids.unique(row.conversation_id)
            renamed |= was
        counts.bump("duplicate_ids_renamed", renamed)
        source, cid = group[0].source, group[0].conversation_id
        try:
            segments, dropped, candidates = conversation_windows(group, cfg.max_seq_len, cfg.overlap, cfg.overlap_loss)
        except SystemPrefixTooLongError as e:
            if cfg.tokenize.strict:
                file, r = split_source(source)
                raise InputError(str(e), file=file, row=r, field="system") from None
            write_reject(rejects, counts, source, str(e), conversation_id=cid)
            source_rejected(counts, group)
            continue
        counts.bump("windows_dropped", dropped)
        if cfg.max_windows is not None and len(segments) > cfg.max_windows:
            counts.bump("windows_capped", len(segments) - cfg.max_windows)
            segments = segments[: cfg.max_windows]
        if not segments:
            write_reject(rejects, counts, source, "no supervised tokens: no assistant token in any window",
                    conversation_id=cid)
            source_rejected(counts, group)
            continue
        counts.used += 1
        counts.bump("windows", len(segments))
        counts.bump("conversations_split", candidates > len(group))
        used = {sid.rpartition("#")[0] for sid, _ in segments}
        kept = [row for row in group if row.conversation_id in used]
        key = content_key(rows_key(kept))  # the same for every copy of the conversation (docs/design.md §8)
        for segment in segments:
            spill.append(*segment)
            spill.datasets.append(group[0].dataset)
            spill.keys.append(key)
            spill.conversations.append(counts.used)
        for row in kept:
            conversations.write(row)


def _copies_of_windows(spill: _WindowSpill) -> list[list[list[int]]]:
    """The spilled windows by number of copies: entry k-1 lists, for every window of a conversation whose
    content (``spill.keys``) is in the table k times, the k windows at the same place in each copy (one
    list per window of the first copy, in spill order). Copies of one content have the same windows: the
    same tokens give the same cuts."""
    by_key: dict[int, dict[int, list[int]]] = {}
    for i, (conv, key) in enumerate(zip(spill.conversations, spill.keys)):
        by_key.setdefault(key, {}).setdefault(conv, []).append(i)

    def shape(c: list[int]) -> list[tuple[int, int]]:
        return [(spill.lengths[i], spill.min_lengths[i]) for i in c]

    classes: dict[int, list[list[int]]] = {}
    for convs in by_key.values():
        copies = list(convs.values())
        if any(shape(c) != shape(copies[0]) for c in copies):  # a key collision: conversations of their own
            copies = [[i] for c in copies for i in c]
            classes.setdefault(1, []).extend(copies)
            continue
        classes.setdefault(len(copies), []).extend([list(w) for w in zip(*copies)])
    return [sorted(classes[k]) for k in sorted(classes)]


def _pack_with_copies(spill: _WindowSpill, block_size: int) -> tuple[list[list[int]], list[int]]:
    """``(blocks, used_lengths)`` as :func:`pack_blocks_flexible` returns them, copies placed alike: the windows
    of conversations in the table once are packed by best-fit decreasing (so a table without copies is packed
    exactly as before); those of a content in the table k > 1 times (a mixture weight above 1, ``--no-dedup``)
    are packed once, among the windows of contents with as many copies, and every such block is written k times,
    the j-th time with the windows of copy j (trimmed alike). Copies of a conversation thus share their blocks'
    fate instead of linking many blocks, which keeps the groups of the validation split small
    (docs/design.md §5, §8)."""
    blocks: list[list[int]] = []
    used = list(spill.lengths)
    for windows in _copies_of_windows(spill):
        first = [w[0] for w in windows]
        packed, lengths = pack_blocks_flexible([spill.lengths[i] for i in first],
                                               [spill.min_lengths[i] for i in first], block_size)
        for w, n in zip(windows, lengths):
            for i in w:
                used[i] = n
        for members in packed:
            blocks += [[windows[m][j] for m in members] for j in range(len(windows[members[0]]))]
    return blocks, used


def _write_blocks(out: Path, spill: _WindowSpill, block_size: int, vocab_size: int,
                  counts: Counts) -> np.ndarray:
    """Pack the spilled windows (:func:`_pack_with_copies`), write the packed table; returns token_freq int64
    [vocab_size]."""
    blocks, used_lengths = _pack_with_copies(spill, block_size)
    token_freq = TokenFreq(vocab_size)
    n_tokens = n_loss = 0
    mixed = any(d is not None for d in spill.datasets)
    with TableWriter(out, "packed") as writer:
        for block_id, members in enumerate(progress(blocks, desc="pack", unit="block")):
            segments = [spill.read(i, used_lengths[i]) for i in members]
            row = make_packed_row(block_id, segments)
            row.segment_prefix_lens = [spill.prefix_lens[i] for i in members]
            # a trimmed window lost leading body tokens: it continues that much later in its conversation
            row.segment_starts = [spill.body_starts[i] + spill.lengths[i] - used_lengths[i] for i in members]
            row.segment_keys = [spill.keys[i] for i in members]
            if mixed:  # per-window sources and supervised tokens (peagle-data stats per source)
                row.segment_datasets = [spill.datasets[i] for i in members]
                row.segment_loss_tokens = [int(m.sum()) for _, _, m in segments]
            writer.write(row)
            ids, mask = row.input_ids, row.loss_mask
            n_tokens += row.n_tokens
            n_loss += int(mask.sum())
            token_freq.add(ids[mask == 1])
    efficiency = packing_efficiency(n_tokens, len(blocks), block_size)
    counts.tokens, counts.loss_tokens, counts.n_blocks, counts.block_size = n_tokens, n_loss, len(blocks), block_size
    counts.packing_efficiency = round(efficiency, 6)
    counts.windows_trimmed = sum(u < n for u, n in zip(used_lengths, spill.lengths))
    return token_freq.counts()
