"""The served checks: a row's tokens before each supervised turn must be the generation prompt ``P_i`` tokenized
alone, as vLLM serves it (docs/design.md §3, "The served prompt's tokens"); where the reply changes how the
prompt's last characters tokenize, the row is built as served (:func:`served_pieces`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from peagle_data.chat.loss_mask import MaskedRow, row_masks, straddling_token, unclear_end_of_turn
from peagle_data.chat.render import RenderedRow

__all__ = ["SERVED_PROMPT_CHANGED", "needs_turn_rows", "served_pieces", "prompt_anchors", "served_prompt_mismatch",
           "as_served"]

SERVED_PROMPT_CHANGED = "the prompt's last tokens change when the reply follows"
"""How :func:`served_prompt_mismatch`'s reason begins."""


_PIECES_NOT_EXACT = ("; tokenized in pieces (each generation prompt alone, then its reply) the row is not the same "
                     "text (the tokenizer marks a piece's start, e.g. a SentencePiece prefix space), so no row is "
                     "exact")
_ONE_SEQUENCE_NOT_EXACT = ("; tokenized in pieces (each generation prompt alone, then its reply) a later turn's "
                           "prompt tokenized alone is still not the earlier turns' ids, so no one sequence holds "
                           "every turn as served: per-turn rows (--on-history-rewrite split, the default) give each "
                           "turn its served prompt and reply")


def needs_turn_rows(problem: str | None) -> bool:
    """Whether ``problem`` (a :class:`~peagle_data.chat.tokens.TokenizedConversation`'s) says that no one
    sequence serves every turn of the row exactly, while each turn alone can be
    (:func:`~peagle_data.chat.render.served_turn_rows`)."""
    return bool(problem) and problem.endswith(_ONE_SEQUENCE_NOT_EXACT)


def served_pieces(tokenizer, rows: Sequence[RenderedRow],
                  whole: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Each row's text tokenized as vLLM serves its turns: cut at every supervised span's start ``a`` (the
    generation prompt ``P_i = text[:a]`` ends there), each piece tokenized alone (``add_special_tokens=False``;
    all pieces of all rows in one batched call), so the tokens before the first turn are its served prompt's ids
    and each reply's ids are its text's own tokenization, generated after them. Exact for a row with one
    supervised turn (a one-turn conversation, a per-turn row); a row of several turns is exact only when each
    later prompt, tokenized alone, is the pieces before it (:func:`served_prompt_mismatch` checks it again).

    Args:
        rows: the rows to cut; whole: per row, its text tokenized at once (int32 ``[T]``), compared as decoded text.

    Returns:
        Per row, ``(ids int32 [T'], offsets int64 [T', 2])`` in ``row.text``'s characters, or None when the pieces
        do not decode to the text the whole tokenization decodes to (a tokenizer that marks a text's start, such
        as SentencePiece's prefix space, would add characters).
    """
    cuts = [sorted({0, len(r.text), *(a for a, _ in r.spans)}) for r in rows]
    pieces = [(k, c, r.text[c:d]) for k, (r, row_cuts) in enumerate(zip(rows, cuts))
              for c, d in zip(row_cuts[:-1], row_cuts[1:])]
    enc = tokenizer([p for *_, p in pieces], add_special_tokens=False, return_offsets_mapping=True) if pieces \
        else {"input_ids": [], "offset_mapping": []}
    ids: list[list[int]] = [[] for _ in rows]
    offsets: list[list[tuple[int, int]]] = [[] for _ in rows]
    for (k, c, _), piece_ids, piece_offsets in zip(pieces, enc["input_ids"], enc["offset_mapping"]):
        ids[k] += piece_ids
        offsets[k] += [(c + x, c + y) for x, y in piece_offsets]
    decoded = tokenizer.batch_decode(ids + [w.tolist() for w in whole], clean_up_tokenization_spaces=False)
    return [(np.asarray(i, dtype=np.int32), np.asarray(o, dtype=np.int64).reshape(-1, 2))
            if decoded[k] == decoded[len(rows) + k] else None for k, (i, o) in enumerate(zip(ids, offsets))]


def prompt_anchors(row: RenderedRow, ids: np.ndarray, offsets: np.ndarray, added: np.ndarray) -> list[int]:
    """Per span ``(a, b)`` of ``row``, the last token of the row that is an added token (``added``: ids of
    ``tokenizer.added_tokens_decoder``) and ends by ``a`` (0 when there is none, or it is the first token:
    then the whole ``P_i`` from character 0): where the served prompt's tokenization is compared from
    (:func:`served_prompt_mismatch`)."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    is_added = np.isin(ids, added) if added.size else np.zeros(len(ids), dtype=bool)
    out = []
    for a, _ in row.spans:
        lo = int(np.searchsorted(starts, a, side="left"))
        cand = np.flatnonzero(is_added[:lo] & (ends[:lo] <= a))
        out.append(int(cand[-1]) if cand.size else 0)
    return out


def served_prompt_mismatch(tokenizer, row: RenderedRow, ids: np.ndarray, offsets: np.ndarray,
                           served: Sequence[tuple[int, Sequence[int]]]) -> str | None:
    """Why a supervised turn of ``row`` is trained on another context than the verifier is served, or None.

    vLLM serves the generation prompt ``P_i`` (``row.text[:a]`` for the span ``(a, b)``) tokenized alone, and the
    verifier generates after those ids; the row's tokens before the span's first token must equal them
    (docs/design.md §3, "The served prompt's tokens"). ``P_i`` is compared from its last added token on
    (:func:`prompt_anchors`; whole when there is none): exact for a Hugging Face fast tokenizer, which encodes
    the text between added tokens piece by piece.

    Args:
        ids: int32 ``[T]`` of ``row.text``; offsets: int64 ``[T, 2]`` their characters.
        served: per span of ``row``, ``(first, tail ids)``: the row's token ``first`` (the anchor) and the
            ids of ``P_i`` from that token's start on, tokenized alone (``add_special_tokens=False``, as
            the row's ids are made), from one batched call in :func:`~peagle_data.chat.tokens.tokenize_rendered`.
    """
    starts = offsets[:, 0]
    for k, ((a, _), (first, prompt)) in enumerate(zip(row.spans, served)):
        lo = int(np.searchsorted(starts, a, side="left"))  # tokens [0, lo) start before the turn
        if lo - first == len(prompt) and np.array_equal(ids[first:lo], np.asarray(prompt, dtype=ids.dtype)):
            continue
        trained, prompt = [int(t) for t in ids[first:lo]], [int(t) for t in prompt]
        at = next((j for j, (x, y) in enumerate(zip(trained, prompt)) if x != y), min(len(trained), len(prompt)))
        at = max(0, min(at, len(trained) - 1, len(prompt) - 1))  # show at least the last token of each
        shown = [[tokenizer.decode([t], clean_up_tokenization_spaces=False) for t in seq[at:at + 8]]
                 for seq in (prompt, trained)]
        which = f"assistant message {row.turn}" if row.turn is not None else \
            f"supervised reply {k + 1} of {len(row.spans)}"
        return (f"the prompt's last tokens change when the reply follows: served {shown[0]} vs trained "
                f"{shown[1]} before {which} (from token {first + at}): vLLM tokenizes the generation prompt alone "
                f"and the verifier generates after those ids, but tokenized with the reply "
                f"({row.text[a:a + 16]!r}...) the prompt's last characters form other tokens, so the row's "
                "context is not the served one; pass --chat-template FILE with a generation prompt that ends "
                "where a token ends whatever follows it (a special token, or text the tokenizer never merges "
                "across), or use the tokenizer the verifier is served with")
    return None


def as_served(tokenizer, rows: Sequence[RenderedRow], drafts: Sequence[MaskedRow],
               special: frozenset[int]) -> list[MaskedRow]:
    """``rows``, whose replies change how their prompts' last characters tokenize (``drafts``: tokenized whole),
    tokenized as served (:func:`served_pieces`), each checked again: every turn's context against its whole
    prompt tokenized alone (the pieces cut the text between added tokens, so the tails of :func:`prompt_anchors`
    do not apply; the first turn's is its first piece by construction). Two batched calls: the pieces, and the
    prompts of the turns after the first. A row not exact in pieces keeps its reason, with why."""
    split = served_pieces(tokenizer, rows, [d.ids for d in drafts])
    prompts = [r.text[:a] for r, cut in zip(rows, split) if cut is not None for a, _ in r.spans[1:]]
    later = iter(tokenizer(prompts, add_special_tokens=False)["input_ids"] if prompts else [])
    out = []
    for row, draft, cut in zip(rows, drafts, split):
        if cut is None:
            out.append(replace(draft, problem=draft.problem + _PIECES_NOT_EXACT))
            continue
        ids, offsets = cut
        loss_mask, system_len = row_masks(row, ids, offsets, special)
        first = int(np.searchsorted(offsets[:, 0], row.spans[0][0], side="left"))
        served = [(0, ids[:first].tolist())] + [(0, next(later)) for _ in row.spans[1:]]
        again = (straddling_token(row, offsets, loss_mask) or unclear_end_of_turn(row, ids, offsets, special)
                 or served_prompt_mismatch(tokenizer, row, ids, offsets, served))
        out.append(replace(draft, problem=draft.problem + _ONE_SEQUENCE_NOT_EXACT) if again else
                   MaskedRow(ids, offsets, loss_mask, system_len, None, pieces=1))
    return out
