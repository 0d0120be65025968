"""Full-context extraction's plan (docs/design.md §7, ``extract --context full``): which contexts the
verifier runs, how they are packed into context blocks, and where each training window reads its
features.

Legend: T tokens of a conversation (a row of the packed table's ``conversations`` sub-table), P its
``system_len``, X ``--max-context``, W a window, n its tokens, ``prefix_len`` the system-prefix tokens
at its front (0 for a window that is its whole conversation), ``start`` the conversation token its
body continues at (the packed table's ``segment_starts``).

- A window of a conversation is its tokens ``[0, prefix_len)`` followed by ``[start, start + n -
  prefix_len)``; each is checked against the conversation (a mismatch is refused, naming block and
  segment), so a view can never point at other tokens than the window holds.
- A conversation runs up to the last token a window of it reads (``R``: its whole ``T`` tokens unless
  its last windows were dropped or capped, e.g. by ``pack --max-windows``); the tokens after that
  change no feature before them (causal attention) and are not run. A conversation of ``R ≤ X`` is one
  **context**: the verifier runs it once, and every window of it reads its features there. Each token's
  features are then those of one forward of the conversation up to that token, as the verifier
  computes them when it serves.
- A longer one (``R > X``) is cut the way ``pack`` cuts windows (:func:`peagle_data.prepare.windows.window_starts`
  with X and overlap 0.5): pieces of P + (X - P) body tokens. Each window reads the first piece that
  holds all of it (the most history before it); a window no piece holds (X < 2 W) gets a piece of its
  own that ends where the window ends. Pieces no window reads are not run. Such conversations are
  counted (``conversations_split``), and their windows' features have the piece's context, not the
  whole conversation's.
- Contexts are packed into context blocks of ``context_size`` slots (``min(X, max(C, longest
  context))``, C the packed ``block_size``) **grouped by the training block that reads them first**
  (packing ``"training_blocks"``, :data:`PACKINGS`): the contexts first read by training block 0 are packed
  by best-fit decreasing (:func:`peagle_data.prepare.packing.pack_blocks`) into context blocks of their
  own, then those of block 1, and so on. A context block is then read by the training block it was made
  for (and by the later windows of its long conversations): a streaming run (docs/design.md §7
  "Streaming") extracts, for each training block it reads, about that block's tokens, whatever the order.
  Stores made before hold packing ``"best_fit"`` (every context of the table packed at once, fewer and
  fuller context blocks, each read by training blocks all over an epoch); a resume keeps the store's.
  Either is deterministic for a packed table and X, so a resumed or sharded run makes the same blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import numpy as np

from peagle_data.prepare.packing import make_packed_row, pack_blocks
from peagle_data.prepare.windows import window_starts
from stores.errors import InputError, StoreMismatchError

__all__ = ["ContextPlan", "plan_contexts", "CONTEXT_OVERLAP", "PACKINGS"]

CONTEXT_OVERLAP = 0.5
"""The overlap of the pieces of a conversation longer than ``--max-context`` (as ``pack``'s default)."""
PACKINGS = ("training_blocks", "best_fit")
"""How contexts are packed into context blocks (module doc): ``training_blocks`` (grouped by the training block
that reads them first; stores made now, recorded in the ``context`` counts as ``packing``) or ``best_fit`` (all
at once; stores made before, whose counts have no ``packing``)."""


@dataclass
class ContextPlan:
    """What full-context extraction runs and writes.

    Attributes:
        rows: the context blocks as packed rows (``input_ids`` int32, ``loss_mask`` uint8 (the
            conversation's), ``position_ids`` int32 from 0 in every context, ``cu_seqlens`` int32,
            ``n_tokens``), the rows the engines extract.
        views: per training block, ``[S, 4] int32`` (:data:`stores.features.feature_schema.VIEW_FIELDS`).
        context_size: slots of a context block.
        training_rows: the packed table's blocks the plan was made for.
        counts: ``conversations``, ``conversations_split``, ``contexts``, ``tokens_extracted``,
            ``context_blocks``, ``context_packing_efficiency``, ``max_context``, ``packing`` (absent for
            ``best_fit``, as in the stores made before it existed).
    """

    rows: list[dict[str, Any]]
    views: list[np.ndarray]
    context_size: int
    training_rows: list[Mapping[str, Any]]
    counts: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Window:
    block: int
    segment: int
    prefix_len: int
    start: int
    end: int


def _windows_of(packed_rows: Iterable[Mapping[str, Any]], conversations: Mapping[str, Mapping[str, Any]],
                packed: str) -> dict[str, list[_Window]]:
    """Every window of the packed rows by conversation id (first-seen order), each checked against its
    conversation's tokens.

    Raises:
        InputError: a table without ``segment_starts`` (packed by an older peagle).
        StoreMismatchError: a window's conversation is missing or holds other tokens there.
    """
    by_conversation: dict[str, list[_Window]] = {}
    for b, r in enumerate(packed_rows):
        if r.get("segment_starts") is None or r.get("segment_prefix_lens") is None:
            raise InputError(f"{packed} was packed by an older peagle, which did not record where its windows "
                             "come from: pack it again with `peagle-data pack`, or extract it with --context window",
                             field="--context")
        cu = np.asarray(r["cu_seqlens"], dtype=np.int64)
        ids = np.asarray(r["input_ids"])
        for k, sid in enumerate(r["segment_ids"]):
            cid = sid.rpartition("#")[0]
            conv = conversations.get(cid)
            lo, hi = int(cu[k]), int(cu[k + 1])
            p, start = int(r["segment_prefix_lens"][k]), int(r["segment_starts"][k])
            end = start + (hi - lo) - p
            if conv is None:
                raise StoreMismatchError(f"{packed}: block {b} segment {k} ({sid}): its conversation {cid!r} is not "
                                         "in the table's conversations sub-table; pack it again")
            cids = np.asarray(conv["input_ids"])
            window = ids[lo:hi]
            if (p > start or end > len(cids) or not np.array_equal(window[:p], cids[:p])
                    or not np.array_equal(window[p:], cids[start:end])):
                raise StoreMismatchError(f"{packed}: block {b} segment {k} ({sid}) does not hold conversation "
                                         f"tokens [0, {p}) + [{start}, {end}) of {cid!r}; pack it again")
            by_conversation.setdefault(cid, []).append(_Window(b, k, p, start, end))
    return by_conversation


def _pieces(n_tokens: int, system_len: int, max_context: int, windows: list[_Window]) -> list[tuple[int, list[_Window]]]:
    """``[(first body token of the piece in the conversation, its windows)]`` of a conversation longer
    than ``max_context`` (module docstring); only pieces some window reads."""
    body = max_context - system_len
    starts = [system_len + s for s in window_starts(n_tokens, system_len, max_context, CONTEXT_OVERLAP)]
    chosen: dict[int, list[_Window]] = {}
    for w in windows:
        fits = [s for s in starts if s <= w.start and w.end <= s + body]
        s = fits[0] if fits else w.end - body  # ends where the window ends: as much history as fits
        if s > w.start:  # a window longer than a piece's body: no piece holds it whole
            raise InputError(f"--max-context {max_context}: a window of {w.end - w.start} body tokens (block "
                             f"{w.block} segment {w.segment}) does not fit a piece of {body} body tokens after the "
                             f"{system_len}-token system prefix; raise --max-context", field="--max-context")
        chosen.setdefault(s, []).append(w)
    return sorted(chosen.items())


def plan_contexts(packed_rows: list[Mapping[str, Any]], conversations: Mapping[str, Mapping[str, Any]],
                  max_context: int, block_size: int, packed: str = "the packed table",
                  packing: str = "best_fit") -> ContextPlan:
    """The plan of full-context extraction for a packed table (module docstring).

    Args:
        packed_rows: every block of the packed table (``input_ids``, ``cu_seqlens``, ``segment_ids``,
            ``segment_prefix_lens``, ``segment_starts``), in order.
        conversations: conversation id -> its row of the ``conversations`` sub-table (``input_ids``,
            ``loss_mask``, ``system_len``).
        max_context: X, the most tokens the verifier runs at once.
        block_size: C, the packed table's block size (at most X).
        packed: the table's path, for messages.
        packing: one of :data:`PACKINGS`.

    Raises:
        ValueError: an unknown ``packing``.
        InputError: ``max_context`` below the packed table's windows, or a table packed before peagle
            recorded where windows come from.
        StoreMismatchError: a window that is not the tokens of its conversation it says it is.
    """
    if packing not in PACKINGS:
        raise ValueError(f"packing {packing!r}: expected one of {PACKINGS}")
    longest_window = max((int(np.diff(np.asarray(r["cu_seqlens"])).max()) for r in packed_rows), default=1)
    if max_context < longest_window:
        raise InputError(f"--max-context {max_context} is shorter than the longest window of {packed} "
                         f"({longest_window} tokens): give at least that", field="--max-context")
    by_conversation = _windows_of(packed_rows, conversations, packed)
    contexts: list[tuple[np.ndarray, np.ndarray]] = []  # (input_ids, loss_mask) per context
    first_reader: list[int] = []  # per context: the first training block reading it
    placement: dict[tuple[int, int], tuple[int, int, int, int]] = {}  # (block, segment) -> (context, prefix, body)
    split = 0
    for cid, windows in by_conversation.items():
        conv = conversations[cid]
        ids, mask = np.asarray(conv["input_ids"], dtype=np.int32), np.asarray(conv["loss_mask"], dtype=np.uint8)
        # R: the tokens past the last one a window reads are never run (they change no feature before them)
        T, P = max(w.end for w in windows), int(conv["system_len"])
        ids, mask = ids[:T], mask[:T]
        if T <= max_context:
            c = len(contexts)
            contexts.append((ids, mask))
            first_reader.append(min(w.block for w in windows))
            for w in windows:
                placement[w.block, w.segment] = (c, 0, w.prefix_len, w.start)
            continue
        split += 1
        odd = next((w for w in windows if w.prefix_len != P), None)
        if odd is not None:  # pack gives every window of a long conversation its whole system prefix
            raise StoreMismatchError(f"{packed}: block {odd.block} segment {odd.segment} of {cid!r} starts with "
                                     f"{odd.prefix_len} prefix tokens, but the conversation's system prefix has {P}: "
                                     "its place in a piece is unknown; pack it again")
        for s, members in _pieces(T, P, max_context, windows):
            c = len(contexts)
            keep = np.r_[0:P, s:min(s + max_context - P, T)]
            contexts.append((ids[keep], mask[keep]))
            first_reader.append(min(w.block for w in members))
            for w in members:  # conversation token s is piece slot P
                placement[w.block, w.segment] = (c, 0, w.prefix_len, P + w.start - s)
    lengths = [len(ids) for ids, _ in contexts]
    context_size = min(max_context, max([block_size, *lengths]))
    blocks = _pack_contexts(lengths, first_reader, context_size, packing)
    where: dict[int, tuple[int, int]] = {}  # context -> (context block, first slot)
    rows = []
    for m, members in enumerate(blocks):
        row = make_packed_row(m, [(str(c), *contexts[c]) for c in members])
        for c, offset in zip(members, row.cu_seqlens[:-1].tolist()):
            where[c] = (m, offset)
        rows.append({"input_ids": row.input_ids, "loss_mask": row.loss_mask, "position_ids": row.position_ids,
                     "cu_seqlens": row.cu_seqlens, "n_tokens": row.n_tokens})
    views = []
    for b, r in enumerate(packed_rows):
        v = np.zeros((len(r["segment_ids"]), 4), dtype=np.int32)
        for k in range(len(r["segment_ids"])):
            c, prefix, prefix_len, body = placement[b, k]
            m, offset = where[c]
            v[k] = (m, offset + prefix, prefix_len, offset + body)
        views.append(v)
    extracted = int(sum(lengths))
    counts = {"max_context": max_context, "conversations": len(by_conversation), "conversations_split": split,
              "contexts": len(contexts), "tokens_extracted": extracted, "context_blocks": len(blocks),
              "context_packing_efficiency": round(extracted / (len(blocks) * context_size), 6) if blocks else 0.0}
    if packing != "best_fit":  # a store made before packings existed records none: best_fit
        counts["packing"] = packing
    return ContextPlan(rows, views, context_size, list(packed_rows), counts)


def _pack_contexts(lengths: list[int], first_reader: list[int], context_size: int, packing: str) -> list[list[int]]:
    """Context blocks as lists of context indices (module doc): ``best_fit`` packs every context at once;
    ``training_blocks`` packs, training block by training block (ascending), the contexts it reads first."""
    if packing == "best_fit":
        return pack_blocks(lengths, context_size)
    groups: dict[int, list[int]] = {}
    for c, b in enumerate(first_reader):
        groups.setdefault(b, []).append(c)
    blocks: list[list[int]] = []
    for b in sorted(groups):
        members = groups[b]
        blocks += [[members[k] for k in block] for block in pack_blocks([lengths[c] for c in members], context_size)]
    return blocks
