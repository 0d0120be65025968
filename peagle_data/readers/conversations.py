"""Reading conversations: files, globs and the ``sharegpt`` alias -> normalised OpenAI messages.

Every input row becomes either a :class:`Conversation` (OpenAI messages with roles ``system``,
``developer``, ``user``, ``assistant``, ``tool``) or a :class:`Reject` (the row's ``file:row`` source and a
reason). Nothing is dropped silently: a row that cannot be used is a ``Reject``, and with
``strict=True`` the first bad row raises :class:`stores.errors.InputError` naming file, row and
field instead.

Rows are numbered from 1 in every format, like ``peagle-eval`` and text editors: ``file:N`` is
the N-th line of a ``.jsonl`` file (blank lines are skipped but keep their number), the N-th
element of a ``.json`` array, the N-th row of a ``.parquet`` file.

A file that cannot be read at all (a ``.parquet`` that is not Parquet, a ``.json`` that is not a
JSON array or object, an unreadable file) is an :class:`stores.errors.InputError` naming it, not
a row reject.

Conversation ids are unique within one run: a row's own ``id``, else ``<file>:<N>`` where
``<file>`` is the path (without extension) relative to the common parent directory of all
inputs. An id seen before (the same file given twice, a repeated explicit ``id``) gets the suffix
``~2``, ``~3``, ... and is counted (``duplicate_ids_renamed`` in the manifest).

Normalisation (roles, ShareGPT turns, content parts, tool arguments, Parquet nulls, leading assistant
turns, merged user turns, ``weight``, ``finish_reason``; each counted in the manifest): docs/design.md §6,
"Normalisation rules".

Modules of :mod:`peagle_data.readers`: :mod:`.rows` (what a row becomes), :mod:`.inputs` (INPUT
arguments, ids), :mod:`.formats` (one reader per file format), :mod:`.normalize` (OpenAI/ShareGPT ->
messages), this module (:func:`read_conversations`, the stream of all of them).
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

from peagle_data.readers.formats import iter_records
from peagle_data.readers.inputs import UniqueIds, id_stems, resolve_inputs
from peagle_data.readers.normalize import drop_arrow_nulls, normalize_record
from peagle_data.readers.rows import FORMATS, Conversation, Reject, RowError
from runtime.chat.chat_template import check_kwargs_names
from stores.errors import InputError
from stores.tables.question_rows import QuestionRowError, question_id, question_turns

__all__ = ["read_conversations"]


def read_conversations(inputs: Sequence[str | os.PathLike], fmt: str = "auto", strict: bool = False,
                       limit: int | None = None, keep_dropped: bool = False,
                       ids: UniqueIds | None = None, questions: bool = False) -> Iterator[Conversation | Reject]:
    """Stream normalised conversations (and rejects) from INPUT arguments, in input order.

    Args:
        inputs: files, globs or ``sharegpt`` (see :func:`resolve_inputs`).
        fmt: ``auto``, ``openai`` or ``sharegpt``.
        strict: raise on the first bad row instead of yielding a Reject.
        limit: stop after this many input rows (usable or not); None reads everything.
        keep_dropped: leave content parts of unsupported types out (counted) instead of
            rejecting the row (``--on-dropped-content keep``).
        ids: the ids already given in this run (the sources of a mixture share one, so an id two sources
            use is renamed too); None starts afresh.
        questions: also read question rows (:mod:`stores.tables.question_rows`: MT-Bench ``turns``, ``prompt``,
            ``question``; a row with ``messages`` or ``conversations`` is a conversation): each becomes a
            :class:`Conversation` with ``question`` set, a user message per turn each followed by an empty
            assistant message (``regenerate`` answers them); their id is ``question_id``, else ``id``.

    Yields:
        One :class:`Conversation` or :class:`Reject` per input row. A Parquet row's null keys
        below the message level are dropped first (:func:`drop_arrow_nulls`; a row with any is
        counted in ``Conversation.counts["null_keys_dropped_rows"]``).

    Raises:
        InputError: bad arguments; with ``strict``, the first bad row (names file, row and field).
    """
    if fmt not in FORMATS:
        raise InputError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    n = 0
    files = resolve_inputs(inputs)
    names = id_stems(files)
    ids = UniqueIds() if ids is None else ids
    for path, name in zip(files, names):
        for row, record in iter_records(path):
            if limit is not None and n >= limit:
                return
            n += 1
            source = f"{path}:{row}"
            cid = f"{name}:{row}"
            asks = questions and isinstance(record, dict) and not _is_conversation(record)
            if isinstance(record, dict) and record.get("id") is not None:
                cid = str(record["id"])
            if asks and question_id(record) is not None:
                cid = question_id(record)
            cid, renamed = ids.unique(cid)
            try:
                if isinstance(record, RowError):
                    raise record
                nulls = 0
                if path.suffix.lower() == ".parquet":
                    record, nulls = drop_arrow_nulls(record)
                if asks and (conv := _question(record, cid, source, int(renamed))) is not None:
                    yield conv
                    continue
                messages, tools, counts = normalize_record(record, fmt, keep_dropped)
                kwargs = record.get("chat_template_kwargs")
                if kwargs is not None:
                    try:
                        kwargs = check_kwargs_names(kwargs, "chat_template_kwargs")
                    except ValueError as e:
                        raise RowError(f"bad chat_template_kwargs: {e}", "chat_template_kwargs") from None
            except RowError as bad:
                if strict:
                    raise InputError(bad.reason, file=str(path), row=row, field=bad.field) from None
                yield Reject(source=source, reason=bad.reason, conversation_id=cid, field=bad.field,
                             duplicate_id_renamed=int(renamed))
                continue
            row_counts = {**counts["row"], **({"null_keys_dropped_rows": 1} if nulls else {})}
            yield Conversation(conversation_id=cid, source=source, messages=messages, tools=tools,
                               duplicate_id_renamed=int(renamed), counts=row_counts, chat_template_kwargs=kwargs or None,
                               **counts["tidy"])


def _is_conversation(record: dict[str, Any]) -> bool:
    """Whether a row holds a conversation (``messages`` or ``conversations``), not a question."""
    return record.get("messages") is not None or record.get("conversations") is not None


def _question(record: dict[str, Any], cid: str, source: str, renamed: int) -> Conversation | None:
    """The :class:`Conversation` of a question row (user turns, each followed by an empty assistant
    turn), or None when ``record`` has no question field.

    Raises:
        RowError: a question field of the wrong shape.
    """
    try:
        turns = question_turns(record)
    except QuestionRowError as e:
        raise RowError(f"bad question row: {e.reason}", e.field) from None
    if turns is None:
        return None
    messages: list[dict[str, Any]] = []
    for turn in turns:
        messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": ""}]
    return Conversation(conversation_id=cid, source=source, messages=messages, duplicate_id_renamed=renamed,
                        question=True)
