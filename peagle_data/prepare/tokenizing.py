"""``peagle-data tokenize``: conversations -> rendered, tokenized rows with exact loss masks.

Rows are streamed in chunks of ``CHUNK_CONVERSATIONS`` conversations: the main process reads and
normalises them, a chunk is rendered and tokenized in one batched tokenizer call (in
``--num-workers`` processes when more than one, results taken in input order, so the output is
identical to one worker), and rows are written in bounded batches. The pieces shared with ``pack``
(:mod:`peagle_data.prepare.pack`) are here too: template and tokenizer loading, counts, rejects.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import multiprocessing
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from peagle_data.chat.render import render_rows, served_turn_rows
from peagle_data.chat.served import needs_turn_rows
from peagle_data.chat.tokens import tokenize_rendered
from runtime.chat.chat_template import (ChatTemplate, ChatTemplateError, chat_template_kwargs_record, chat_template_sha256,
                                  check_chat_template_kwargs, check_kwargs_read, effective_chat_template)
from stores.tables.conversation_files import read_regenerate_manifest
from peagle_data.prepare.config import CHUNK_CONVERSATIONS, TokenizeConfig, TokenizeRun
from peagle_data.prepare.counts import Counts
from peagle_data.prepare.dedup import Deduplicator, dedup_items, filter_reason
from peagle_data.prepare.shards import shard_filter
from peagle_data.prepare.sources import input_files, iter_source_groups, mixture_of
from peagle_data.readers.conversations import read_conversations
from peagle_data.readers.inputs import UniqueIds
from peagle_data.readers.rows import Conversation, Reject
from stores.errors import InputError
from runtime.model_cache import load_tokenizer
from runtime.progress import progress
from stores.staging import staged_output_dir
from stores.tables.token_rows import TokenizedRow
from stores.tables.token_tables import RejectsWriter, TableWriter, write_manifest, write_token_freq
from runtime.verifier_match import tokenizer_fingerprint

__all__ = ["iter_tokenized", "run_tokenize", "TokenFreq", "check_output_not_input", "check_regenerated_mode",
           "read_template", "resolve_tokenizer", "row_template", "run_shard_filter", "shard_record", "split_source",
           "tokenizer_record", "write_reject"]


def resolve_tokenizer(tokenizer_name, tokenizer):
    """``tokenizer`` when one is given, else the tokenizer ``tokenizer_name`` loaded."""
    if tokenizer is not None:
        return tokenizer
    return load_tokenizer(tokenizer_name)


def read_template(path: str | None) -> str | None:
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


def tokenizer_record(tokenizer_name, tokenizer, template_path: str | None, template: str | None,
                     template_kwargs: dict[str, Any] | None = None) -> dict:
    """The manifest's ``tokenizer`` record: name, vocabulary size, fingerprint, chat template and its
    variables (``chat_template_kwargs``, --chat-template-kwargs; ``{}`` for none). ``extract`` copies the
    record into the store and ``peagle-train`` into the checkpoint, so each later stage can check it."""
    return {"name": str(tokenizer_name), "vocab_size": len(tokenizer), "fingerprint": tokenizer_fingerprint(tokenizer),
            "chat_template_file": template_path,
            "chat_template_sha256": chat_template_sha256(tokenizer, template),
            "chat_template_kwargs": chat_template_kwargs_record(template_kwargs)}


def check_regenerated_mode(files: Sequence[str | os.PathLike], template_kwargs: dict[str, Any] | None) -> None:
    """Refuse an input conversation file that is a ``regenerate`` output (``NAME.manifest.json`` beside
    ``NAME.jsonl`` with its ``generation`` settings) whose answers were generated from prompts rendered with
    other fixed chat template variables (its ``--chat-template-kwargs``) than ``template_kwargs`` (rows
    rendered in another mode would train the drafter on answers to prompts the verifier is not served).

    A regenerate output of a mixture of modes (``--reasoning-effort``, ``--enable-thinking``,
    ``--template-mixture``: ``generation`` records them) passes with its fixed variables: each of its rows
    records all the variables it was answered with and is rendered with them (:func:`row_template`).

    Raises:
        StoreMismatchError: the fixed variables differ (names both, and the mixture when there is one).
    """
    for f in files:
        if not str(f).endswith(".jsonl"):
            continue
        manifest = read_regenerate_manifest(f) or {}
        generation = manifest.get("generation")
        if "model" not in manifest or not isinstance(generation, dict):
            continue
        drawn = {k: generation[k] for k in _MIXTURE_SETTINGS if generation.get(k) is not None}
        mixture = (f" (its rows also record the variables drawn per row from {json.dumps(drawn, sort_keys=True)}, "
                   "and each row is rendered with its own)") if drawn else ""
        check_chat_template_kwargs({"chat_template_kwargs": generation.get("chat_template_kwargs")},
                                   f"{f} (a regenerate output: the prompts its answers were generated from{mixture})",
                                   template_kwargs, fix="pass the --chat-template-kwargs it was regenerated with, or "
                                                        "regenerate it in this mode")


_MIXTURE_SETTINGS = ("reasoning_effort", "enable_thinking", "template_mixture")
"""The ``generation`` settings of a regenerate manifest that draw template variables per row (recorded in each row)."""


def split_source(source: str) -> tuple[str, int | None]:
    """``file:N`` -> ``(file, N)``; a source without a row number -> ``(source, None)``."""
    file, _, row = source.rpartition(":")
    return (file, int(row)) if row.isdigit() else (source, None)


def write_reject(rejects: RejectsWriter, counts: Counts, source: str, reason: str, **extra) -> None:
    """Write one reject (its ``extra`` fields that are not None) and count it."""
    rejects.write(source, reason, **{k: v for k, v in extra.items() if v is not None})
    counts.rejected += 1


def iter_tokenized(inputs: Sequence[str | os.PathLike], tokenizer, cfg: TokenizeConfig,
                   rejects: RejectsWriter, counts: Counts, *, dedup: Deduplicator | None = None,
                   sample=None, select=None, ids: UniqueIds | None = None) -> Iterator[list[TokenizedRow]]:
    """Read, normalise and tokenize conversations, in input order.

    ``dedup`` is shared across calls (the sources of a mixture); None makes a new one when
    ``cfg.dedup``. ``sample`` maps the reader items to the drawn ones before deduplication (a
    mixture source's weight: a row is a duplicate only of a copy that was drawn); ``select`` maps the
    deduplicated items to those to tokenize (shards: :mod:`peagle_data.prepare.sources`); None keeps all.
    ``ids`` (:class:`~peagle_data.readers.inputs.UniqueIds`), shared across calls like ``dedup``, keeps
    conversation ids unique over the sources of a mixture; None makes a new one.

    Rejected rows are written to ``rejects`` and counted; ``counts`` gains ``read``, ``rejected``,
    ``dropped_leading_assistant_turns``, ``merged_user_turns``, ``empty_assistant_turns``,
    ``history_rewrite_conversations``, ``history_rewrite_rows``, ``served_prompt_rows``, the per-row reader counts
    (``null_keys_dropped_rows``, ``tool_arguments_decoded``, ``tool_calls_wrapped``,
    ``tool_schemas_decoded``, ``tool_schemas_wrapped``, ``sharegpt_function_calls``,
    ``sharegpt_observations``, ``dropped_content_parts``) and, with ``on_dropped_content="keep"``,
    ``conversations_with_dropped_content`` and ``dropped_<part>`` (messages whose part the template
    does not render; ``dropped_tools`` counts conversations).

    Yields:
        For every usable conversation, its tokenized-table rows (one, or one per assistant turn
        when the template rewrites history): ``{"conversation_id", "source", "input_ids" int32 [T],
        "loss_mask" uint8 [T], "system_len", "n_tokens", "n_loss_tokens"}``.

    Raises:
        InputError: with ``cfg.strict``, the first bad row (file, row and field where known).
    """
    template = ChatTemplate(read_template(cfg.chat_template), cfg.chat_template_kwargs)
    check_kwargs_read(effective_chat_template(tokenizer, template.text), template.kwargs)  # before any row
    bar = progress(total=cfg.limit, desc="tokenize", unit="conv")
    if dedup is None and cfg.dedup:
        dedup = Deduplicator()
    items = read_conversations(inputs, fmt=cfg.format, strict=cfg.strict, limit=cfg.limit,
                               keep_dropped=cfg.on_dropped_content == "keep", ids=ids)
    if sample is not None:
        items = sample(items)
    items = dedup_items(items, dedup)
    if select is not None:
        items = select(items)
    chunks = iter(lambda: list(itertools.islice(items, CHUNK_CONVERSATIONS)), [])
    pool = None
    try:
        if cfg.num_workers > 1:
            ctx = multiprocessing.get_context("fork")
            pool = ctx.Pool(cfg.num_workers, initializer=_init_worker,
                            initargs=(tokenizer, template, cfg.on_history_rewrite == "split", cfg.on_dropped_content,
                                      cfg.on_special_token_text))
            results = pool.imap(_worker_chunk, chunks)
        else:
            results = (_tokenize_chunk(tokenizer, chunk, template, cfg.on_history_rewrite == "split",
                                       cfg.on_dropped_content, cfg.on_special_token_text) for chunk in chunks)
        for outcomes in results:
            for item, outcome in outcomes:
                bar.update(1)
                rows = _outcome_rows(item, outcome, cfg, rejects, counts)
                if rows is not None:
                    yield rows
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()


def _outcome_rows(item: Conversation | Reject, outcome, cfg: TokenizeConfig, rejects: RejectsWriter,
                  counts: Counts) -> list[TokenizedRow] | None:
    """The rows of one read item and its tokenizing outcome (:func:`_tokenize_chunk`), or None when
    it is rejected (written to ``rejects`` and counted)."""
    counts.read += 1
    counts.bump("duplicate_ids_renamed", item.duplicate_id_renamed)
    if isinstance(item, Reject):
        duplicate_of = getattr(item, "duplicate_of", None)
        counts.bump("duplicates", duplicate_of is not None)
        write_reject(rejects, counts, item.source, item.reason, conversation_id=item.conversation_id,
                field=item.field, duplicate_of=duplicate_of)
        return None
    if not isinstance(outcome, str) and not any(tok.loss_mask.any() for _, tok, *_ in outcome):
        outcome = "no supervised tokens: the template renders no assistant token"
    filtered = None if isinstance(outcome, str) else filter_reason(
        max(len(t.input_ids) for _, t, *_ in outcome), sum(int(t.loss_mask.sum()) for _, t, *_ in outcome),
        cfg.max_tokens, cfg.min_loss_tokens)
    if filtered is not None:  # a filter, not a bad row: rejected also with --strict
        write_reject(rejects, counts, item.source, filtered, conversation_id=item.conversation_id)
        return None
    if isinstance(outcome, str):
        if cfg.strict:
            file, row = split_source(item.source)
            raise InputError(outcome, file=file, row=row, field="messages")
        write_reject(rejects, counts, item.source, outcome, conversation_id=item.conversation_id)
        return None
    if cfg.on_special_token_text == "keep":
        counts.bump("conversations_with_special_token_text", any(special for *_, special in outcome))
    return _rows_of(item, outcome, counts, cfg.chat_template_kwargs)


_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer, template, split, on_dropped, on_special_text) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _WORKER.update(tokenizer=tokenizer, template=template, split=split, on_dropped=on_dropped,
                   on_special_text=on_special_text)


def _worker_chunk(chunk):
    return _tokenize_chunk(_WORKER["tokenizer"], chunk, _WORKER["template"], _WORKER["split"],
                           _WORKER["on_dropped"], _WORKER["on_special_text"])


def _tokenize_chunk(tokenizer, chunk: list[Conversation | Reject], template, split: bool,
                    on_dropped: str = "reject", on_special_text: str = "reject") -> list[tuple]:
    """``[(item, outcome)]``: outcome is ``[(turn, TokenizedConversation, dropped parts, special-token
    text)]``, a reject reason, or None for a reader reject. Rows of the whole chunk are tokenized in one
    batched call."""
    rendered: list[tuple[int, list]] = []
    outcomes: list[Any] = []
    for item in chunk:
        if isinstance(item, Reject):
            outcomes.append(None)
            continue
        row = row_template(template, item.chat_template_kwargs)
        if isinstance(row, str):
            outcomes.append(row)
            continue
        try:
            rows = render_rows(tokenizer, item.messages, item.tools, row, per_turn_fallback=split,
                               on_dropped=on_dropped, on_special_text=on_special_text)
        except ChatTemplateError as e:
            outcomes.append(str(e))
            continue
        rendered.append((len(outcomes), rows))
        outcomes.append([])
    flat = [r for _, rows in rendered for r in rows]
    tokenized = iter(tokenize_rendered(tokenizer, flat))
    for at, rows in rendered:
        outcomes[at] = [(r.turn, next(tokenized), r.dropped, r.special_text) for r in rows]
        if split and any(needs_turn_rows(t.problem) for _, t, *_ in outcomes[at]):  # one row per turn, as served
            item = chunk[at]
            try:
                rows = served_turn_rows(tokenizer, item.messages, item.tools,
                                        row_template(template, item.chat_template_kwargs), on_dropped, on_special_text)
            except ChatTemplateError as e:
                outcomes[at] = str(e)
                continue
            outcomes[at] = [(r.turn, dataclasses.replace(t, served_turn_row=1), r.dropped, r.special_text)
                            for r, t in zip(rows, tokenize_rendered(tokenizer, rows))]
        problem = next((t.problem for _, t, *_ in outcomes[at] if t.problem), None)
        if problem:  # no exact mask for one of its rows: the conversation is a reject
            outcomes[at] = problem
    return list(zip(chunk, outcomes))


def row_template(template: ChatTemplate, row_kwargs: dict[str, Any] | None) -> ChatTemplate | str:
    """The template a row is rendered with: ``template`` (the run's text and ``--chat-template-kwargs``) with
    the variables the row records it was answered with (``chat_template_kwargs``: ``regenerate``'s per-row
    settings, a mixture of modes) on top, so each row trains on the prompt the verifier answered.

    Returns:
        The :class:`ChatTemplate`, or the reject reason (``template variables: ...``) of a row that records
        a variable with another value than ``--chat-template-kwargs`` gives (the verifier answered another
        prompt than the one the run says it serves).
    """
    if not row_kwargs:
        return template
    clash = sorted(k for k in row_kwargs if k in template.kwargs and template.kwargs[k] != row_kwargs[k])
    if clash:
        return (f"template variables: the row was answered with chat_template_kwargs "
                f"{json.dumps(chat_template_kwargs_record(row_kwargs))} and --chat-template-kwargs gives "
                f"{json.dumps(chat_template_kwargs_record(template.kwargs))} ({', '.join(clash)} differ); pass the "
                "fixed variables the rows were regenerated with")
    return ChatTemplate(template.text, {**template.kwargs, **row_kwargs})


def _rows_of(conv: Conversation, outcome: list[tuple], counts: Counts,
             template_kwargs: dict[str, Any] | None = None) -> list[TokenizedRow]:
    if conv.chat_template_kwargs:
        counts.bump("conversations_with_own_template_kwargs")
    counts.mode({**(template_kwargs or {}), **(conv.chat_template_kwargs or {})})
    counts.bump("dropped_leading_assistant_turns", conv.dropped_leading_assistant)
    counts.bump("conversations_with_dropped_leading_assistant", conv.dropped_leading_assistant > 0)
    counts.bump("merged_user_turns", conv.merged_user_turns)
    counts.bump("empty_assistant_turns", conv.empty_assistant_turns)
    for key, n in conv.counts.items():
        counts.bump(key, n)
    dropped = {part for _, _, parts, _ in outcome for part in parts}  # per-turn rows repeat context parts
    counts.conversations_with_dropped_content += bool(dropped) or bool(conv.counts.get("dropped_content_parts"))
    for part in sorted(dropped):
        counts.drop(part.split(' of ')[0])
    if any(m.get("token_ids") is not None for m in conv.messages):  # regenerate's output: its ids are counted
        counts.bump("turns_on_generated_ids", sum(tok.on_generated_ids for _, tok, *_ in outcome))
    counts.bump("served_prompt_rows", sum(tok.served_pieces for _, tok, *_ in outcome))
    served_turns = any(tok.served_turn_row for _, tok, *_ in outcome)
    counts.bump("served_turn_conversations", served_turns)
    counts.bump("served_turn_rows", len(outcome) if served_turns else 0)
    per_turn = outcome[0][0] is not None and not served_turns
    counts.bump("history_rewrite_conversations", per_turn)
    counts.bump("history_rewrite_rows", len(outcome) if per_turn else 0)
    return [TokenizedRow(conversation_id=conv.conversation_id if turn is None else f"{conv.conversation_id}@{turn}",
                         source=conv.source, input_ids=tok.input_ids, loss_mask=tok.loss_mask,
                         system_len=tok.system_len, n_tokens=int(tok.input_ids.shape[0]),
                         n_loss_tokens=int(tok.loss_mask.sum()))
            for turn, tok, *_ in outcome]


def check_output_not_input(output, inputs) -> None:
    """Raises InputError when ``output`` is one of ``inputs`` or a directory above one."""
    out = Path(output).resolve()
    for i in inputs:
        p = Path(i).resolve()
        if p == out or out in p.parents:
            raise InputError(f"--output {output} would overwrite the input {i}; choose another directory")


def run_shard_filter(cfg: TokenizeConfig):
    """The reader-item filter of ``cfg``'s shard, or None for an unsharded run."""
    return shard_filter(cfg.num_shards, cfg.shard_index) if cfg.num_shards > 1 else None


def shard_record(cfg: TokenizeConfig) -> dict[str, Any]:
    """The manifest's ``shard`` entry of a sharded run, else nothing."""
    return {"shard": {"num_shards": cfg.num_shards, "shard_index": cfg.shard_index}} if cfg.num_shards > 1 else {}


def run_tokenize(run: TokenizeRun, tokenizer=None, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """``peagle-data tokenize``: conversations -> a tokenized table (docs/design.md §6).

    Args:
        run: the inputs (conversation files, globs, ``sharegpt`` or one mixture file), the tokenizer
            MODEL (recorded in the manifest), the table directory to create, ``force`` to replace an
            existing one, and the reading and tokenizing ``settings``.
        tokenizer: an already loaded tokenizer to use instead of loading ``run.tokenizer``.
        config: the command's resolved options (``--print-config``), recorded as the manifest's
            ``config`` so that ``--config`` can repeat the run.

    Returns:
        A summary: ``output``, ``counts`` (as in the manifest).

    Raises:
        OutputExistsError: ``run.output`` exists and ``run.force`` is false.
        InputError: bad inputs; with ``settings.strict`` the first bad row.
        ModelNotFoundError, MissingDependencyError: the tokenizer cannot be loaded.
        StoreMismatchError: a regenerate output whose prompts had other template variables
            (:func:`check_regenerated_mode`).
    """
    inputs, tokenizer_name, output, cfg = run.inputs, run.tokenizer, run.output, run.settings
    mixture = mixture_of(inputs)
    files = input_files(inputs, mixture)  # fail on bad arguments before touching the output
    check_output_not_input(output, files)
    check_regenerated_mode(files, cfg.chat_template_kwargs)
    template = read_template(cfg.chat_template)
    with staged_output_dir(output, run.force) as out:
        tokenizer = resolve_tokenizer(tokenizer_name, tokenizer)
        counts = Counts()
        token_freq = TokenFreq(len(tokenizer))
        n_tokens = n_loss = 0
        with TableWriter(out, "tokenized") as writer, RejectsWriter(out) as rejects:
            for group in iter_source_groups(iter_tokenized, inputs, mixture, tokenizer, cfg, rejects, counts,
                                            run_shard_filter(cfg)):
                counts.used += 1
                for row in group:
                    writer.write(row)
                    n_tokens += row.n_tokens
                    n_loss += row.n_loss_tokens
                    token_freq.add(row.input_ids[row.loss_mask == 1])
            by_reason = dict(rejects.by_reason)
        counts.tokens, counts.loss_tokens, counts.rejected_by_reason = n_tokens, n_loss, by_reason
        assert counts.used + counts.rejected == counts.read, counts
        write_token_freq(out, token_freq.counts())
        write_manifest(out, {
            "kind": "tokenized",
            "inputs": [str(i) for i in inputs],
            "files": [str(f) for f in files],
            "parameters": dataclasses.asdict(cfg),
            **({"config": config} if config is not None else {}),
            "tokenizer": tokenizer_record(tokenizer_name, tokenizer, cfg.chat_template, template,
                                          cfg.chat_template_kwargs),
            "counts": counts.to_manifest(),
            **({"mixture": mixture.record()} if mixture is not None else {}),
            **shard_record(cfg),
        })
    return {"output": str(output), "counts": counts.to_manifest()}


class TokenFreq:
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
            ids = np.concatenate(self._pending)
            if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= len(self.total)):
                raise ValueError(f"token id {int(ids.max()) if ids.max() >= len(self.total) else int(ids.min())} "
                                 f"outside the tokenizer's {len(self.total)} ids")  # an internal invariant
            self.total += np.bincount(ids, minlength=len(self.total))
        self._pending, self._n = [], 0

    def counts(self) -> np.ndarray:
        """int64 ``[vocab_size]``."""
        self._flush()
        return self.total
