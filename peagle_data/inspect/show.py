"""``peagle-data show``: one tokenized row or packed block, with its loss mask made visible.

The tokens are decoded in runs of equal (segment, mask): a supervised run (loss 1) is
highlighted, as colour on a terminal, as ``[[...]]`` in plain text, or as ``<mark>`` in an HTML
page. Segment boundaries (the windows packed into a block; the system prefix of a tokenized row)
are marked on their own line, and every supervised span is listed with its token range and its
decoded text, so a mask can be checked by reading it.

Rows and blocks are numbered from 0 in table order (the ``block_id`` of a packed table).
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from runtime.chat.chat_template import describe_kwargs
from stores.errors import InputError
from runtime.model_cache import load_tokenizer
from stores.staging import check_replaceable_file, write_text_atomic
from stores.tables.token_tables import TokenTable
from runtime.verifier_match import check_tokenizer

__all__ = ["Segment", "ShownItem", "show", "select_items", "supervised_spans", "render_text", "render_html",
           "OPEN", "CLOSE",
           "ShowConfig", "COLORS"]

COLORS = ("auto", "always", "never")
"""``show --color``: auto colours on a terminal only."""


@dataclass(frozen=True, kw_only=True)
class ShowConfig:
    """Which rows or blocks ``peagle-data show`` prints, and how."""

    path: str
    """A tokenize or pack output directory."""
    row: int | None = None
    """Row N of a tokenized table (from 0; default 0 when neither a block nor an id is given); for
    a packed table, block N."""
    block: int | None = None
    """Block N of a packed table (its block_id, from 0)."""
    item_id: str | None = None
    """A conversation id (its per-turn rows ID@turn too), or a window id ID#k: the rows or blocks
    that hold it."""
    tokenizer: str | None = None
    """Tokenizer to decode with (smollm2-135m, a local model directory or a Hugging Face id); None:
    the one in the table's manifest."""
    color: str = "auto"
    """Colour supervised tokens (auto: on a terminal); without colour they are [[bracketed]]."""
    html: str | None = None
    """Also write an HTML page with the supervised tokens highlighted."""
    force: bool = field(default=False, metadata={"action": True})
    """Overwrite an existing --html FILE."""

    def __post_init__(self) -> None:
        for name in ("row", "block"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.color not in COLORS:
            raise ValueError(f"--color must be one of {', '.join(COLORS)}, got {self.color!r}")

OPEN, CLOSE = "[[", "]]"
"""Markers around a supervised run in the plain-text form."""


@dataclass(frozen=True)
class Segment:
    """A marked stretch of an item: ``[start, end)`` tokens and its label (a window's id)."""

    start: int
    end: int
    label: str


@dataclass(frozen=True)
class ShownItem:
    """One row or block to show.

    Attributes:
        title: ``row N: <conversation_id>`` or ``block N``.
        input_ids: int32 ``[T]``.
        loss_mask: uint8 ``[T]``.
        segments: the windows of a block, or for a row its system prefix and its body.
    """

    title: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    segments: tuple[Segment, ...]


def _row_item(index: int, row: dict[str, Any]) -> ShownItem:
    n, system_len = len(row["input_ids"]), int(row["system_len"])
    segments = ((Segment(0, system_len, "system prefix (loss 0)"),) if system_len else ()) + (
        Segment(system_len, n, "conversation"),)
    return ShownItem(f"row {index}: {row['conversation_id']} ({row['source']})", row["input_ids"],
                     row["loss_mask"], segments)


def _block_item(row: dict[str, Any]) -> ShownItem:
    cu = [int(c) for c in row["cu_seqlens"]]
    segments = tuple(Segment(a, b, label) for a, b, label in zip(cu[:-1], cu[1:], row["segment_ids"]))
    return ShownItem(f"block {row['block_id']}", row["input_ids"], row["loss_mask"], segments)


def select_items(table: TokenTable, row: int | None = None, item_id: str | None = None) -> list[ShownItem]:
    """The rows (tokenized table) or blocks (packed table) to show.

    Args:
        table: an open token table.
        row: the row or block number (from 0, table order); None with ``item_id`` None means 0.
        item_id: a conversation id (a tokenized row's ``conversation_id``, or its per-turn rows
            ``ID@turn``), or for a packed table a window id ``ID#k`` or a conversation id: every
            block holding one of its windows.

    Raises:
        InputError: the row is out of range, or no row holds the id.
    """
    if item_id is None:
        row = 0 if row is None else row
        for index, values in enumerate(table.iter_rows()):
            if index == row:
                return [_row_item(index, values) if table.kind == "tokenized" else _block_item(values)]
        what = "rows" if table.kind == "tokenized" else "blocks"
        if table.num_rows == 0:
            raise InputError(f"{table.directory}: the table has no {what} (see its rejects.jsonl for why)")
        raise InputError(f"{table.directory}: {what[:-1]} {row} is out of range: the table has {table.num_rows} "
                         f"{what} (0..{table.num_rows - 1})")
    items = list(_items_with_id(table, item_id))
    if not items:
        raise InputError(f"{table.directory}: no {'row' if table.kind == 'tokenized' else 'block'} holds id "
                         f"{item_id!r}")
    return items


def _is_turn_of(row_id: str, conversation_id: str) -> bool:
    """``row_id`` is ``conversation_id`` or one of its per-turn rows ``conversation_id@turn``."""
    rest = row_id[len(conversation_id) + 1:]
    return row_id == conversation_id or (row_id.startswith(conversation_id + "@") and rest.isdigit())


def _items_with_id(table: TokenTable, item_id: str) -> Iterator[ShownItem]:
    for index, values in enumerate(table.iter_rows()):
        if table.kind == "tokenized":
            if _is_turn_of(values["conversation_id"], item_id):
                yield _row_item(index, values)
        elif any(s == item_id or _is_turn_of(s.rsplit("#", 1)[0], item_id) for s in values["segment_ids"]):
            yield _block_item(values)


def supervised_spans(loss_mask: np.ndarray) -> list[tuple[int, int]]:
    """``[start, end)`` token ranges of the runs of loss 1 in ``loss_mask`` (uint8 ``[T]``)."""
    padded = np.concatenate([[0], (np.asarray(loss_mask) != 0).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def _runs(item: ShownItem) -> Iterator[tuple[Segment, int, int, bool]]:
    """``(segment, start, end, supervised)`` runs of equal mask inside each segment."""
    mask = np.asarray(item.loss_mask) != 0
    for seg in item.segments:
        start = seg.start
        while start < seg.end:
            end = start + 1
            while end < seg.end and mask[end] == mask[start]:
                end += 1
            yield seg, start, end, bool(mask[start])
            start = end


def _spans_listing(item: ShownItem, tokenizer) -> list[tuple[str, str]]:
    """``(where, decoded text)`` of every supervised span, split at segment boundaries."""
    out = []
    for seg, a, b, supervised in _runs(item):
        if supervised:
            out.append((f"tokens {a}-{b - 1} ({b - a}) in {seg.label}",
                        tokenizer.decode(item.input_ids[a:b], clean_up_tokenization_spaces=False)))
    return out


def _summary(item: ShownItem) -> str:
    n, n_loss = len(item.input_ids), int((np.asarray(item.loss_mask) != 0).sum())
    return f"{item.title}: {n} tokens, {n_loss} supervised, {len(item.segments)} segment(s)"


def render_text(item: ShownItem, tokenizer, color: bool = False) -> str:
    """The item as text: supervised runs in colour (``color``) or between ``[[`` and ``]]``, a
    ``--- segment ... ---`` line before each segment, then the list of supervised spans."""
    import click

    lines = [_summary(item), f"legend: {'green' if color else OPEN + 'supervised' + CLOSE} = loss 1, "
                             "plain = loss 0 (context)", ""]
    body: list[str] = []
    current = None
    for seg, a, b, supervised in _runs(item):
        if seg is not current:
            current = seg
            body.append(f"\n--- segment {seg.label}: tokens {seg.start}-{seg.end - 1} ---\n")
        text = tokenizer.decode(item.input_ids[a:b], clean_up_tokenization_spaces=False)
        if supervised:
            text = click.style(text, fg="black", bg="green") if color else f"{OPEN}{text}{CLOSE}"
        body.append(text)
    lines.append("".join(body).lstrip("\n"))
    spans = _spans_listing(item, tokenizer)
    lines += ["", f"supervised spans ({len(spans)}):"]
    lines += [f"  {k}. {where}: {json.dumps(text, ensure_ascii=False)}" for k, (where, text) in enumerate(spans, 1)]
    return "\n".join(lines)


PAGE_TITLE = "<title>peagle-data show: "
"""The start of every page's title: how ``--force`` tells a page of its own from another file
(:func:`stores.staging.check_replaceable_file`)."""

_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>peagle-data show: {title}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
pre {{ white-space: pre-wrap; font-family: monospace; background: #f6f6f6; padding: 1em; }}
mark {{ background: #9be39b; }}
.seg {{ display: block; color: #555; border-top: 2px solid #888; margin-top: .5em; font-style: italic; }}
</style></head><body>
{body}
</body></html>
"""


def render_html(items: list[ShownItem], tokenizer) -> str:
    """A self-contained HTML page: each item with ``<mark>`` on supervised runs, a rule at each
    segment boundary, and the list of supervised spans."""
    parts = []
    for item in items:
        pre, current = [], None
        for seg, a, b, supervised in _runs(item):
            if seg is not current:
                current = seg
                pre.append(f'<span class="seg">segment {html.escape(seg.label)}: tokens {seg.start}-{seg.end - 1}'
                           "</span>")
            text = html.escape(tokenizer.decode(item.input_ids[a:b], clean_up_tokenization_spaces=False))
            pre.append(f"<mark>{text}</mark>" if supervised else text)
        spans = "".join(f"<li>{html.escape(where)}: <code>{html.escape(text)}</code></li>"
                        for where, text in _spans_listing(item, tokenizer))
        parts.append(f"<h2>{html.escape(_summary(item))}</h2><p><mark>highlighted</mark> = supervised (loss 1)</p>"
                     f"<pre>{''.join(pre)}</pre><h3>supervised spans</h3><ol>{spans}</ol>")
    return _PAGE.format(title=html.escape(items[0].title if items else ""), body="\n".join(parts))


def show(path: str, row: int | None = None, block: int | None = None, item_id: str | None = None,
         tokenizer_name: str | None = None, color: bool = False, html_file: str | None = None,
         force: bool = False) -> str:
    """``peagle-data show``: the text of the chosen rows or blocks of the table at ``path`` (row 0
    when nothing is chosen), after a line naming the chat template variables the rows were rendered with
    when the manifest records some (``--chat-template-kwargs``); with ``html_file`` also an HTML page of them.

    Args:
        path: a tokenized or packed table. row, block, item_id: at most one of them (see
            :func:`select_items`; ``block`` needs a packed table).
        tokenizer_name: decode with this tokenizer; None: the one in the table's manifest.
        color: ANSI colours instead of ``[[...]]`` markers.
        html_file: write the page here (atomically); it must not exist unless ``force``.

    Raises:
        InputError: more than one of row, block and item_id; no directory for ``html_file``; ``block`` of a tokenized table;
            no such row, block or id.
        StoreMismatchError: a tokenizer other than the table's (fingerprint or vocab size).
        OutputExistsError: ``html_file`` exists and ``force`` is not set.
        ForeignFilesError: ``force`` with an ``html_file`` that is no page of this command's (:data:`PAGE_TITLE`).
    """
    if sum(x is not None for x in (row, block, item_id)) > 1:
        raise InputError("give at most one of --row, --block and --id")
    if html_file is not None and not Path(html_file).absolute().parent.is_dir():
        raise InputError(f"--html {html_file}: the directory {Path(html_file).absolute().parent} does not exist")
    if html_file is not None:  # "output --html F already exists; pass --force ..."; a page of another's: refused
        check_replaceable_file(html_file, force, PAGE_TITLE.encode(), "a page of peagle-data show", "--html")
    table = TokenTable.open(path)
    if block is not None and table.kind != "packed":
        raise InputError(f"--block needs a packed table; {path} is a {table.kind} table (use --row)")
    items = select_items(table, block if block is not None else row, item_id)
    recorded = table.manifest.get("tokenizer", {})
    tokenizer = load_tokenizer(tokenizer_name or recorded.get("name"))
    check_tokenizer(recorded, str(path), tokenizer, f"--tokenizer {tokenizer_name or recorded.get('name')}",
                    "pass the tokenizer it was made with (--tokenizer), or none to use the recorded one")
    if html_file is not None:
        write_text_atomic(html_file, render_html(items, tokenizer), encoding="utf-8")
    mode = recorded.get("chat_template_kwargs")
    header = [f"rendered with chat template kwargs {describe_kwargs(mode)}"] if mode else []
    return "\n\n".join(header + [render_text(item, tokenizer, color) for item in items])
