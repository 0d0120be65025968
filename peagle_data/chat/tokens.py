"""Conversations -> token ids, loss mask and system prefix: rendered rows tokenized in one batched call with
offsets (docs/design.md §3).

The ids equal ``apply_chat_template(messages, tokenize=True)`` (the same render, ``add_special_tokens=False``),
except a row built as served (:func:`~peagle_data.chat.served.served_pieces`) or a last turn trained on the
verifier's generated ids (:func:`~peagle_data.chat.generated_ids.on_generated_ids`). A row with no exact mask
is a reject with the reason (``TokenizedConversation.problem``; raised as ``ChatTemplateError`` by
:func:`tokenize_conversation` and :func:`tokenize_turns`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np

from peagle_data.chat.generated_ids import on_generated_ids
from peagle_data.chat.loss_mask import (REPLY_STARTS_INSIDE, MaskedRow, row_masks, special_ids, straddling_token,
                                        unclear_end_of_turn)
from peagle_data.chat.render import RenderedRow, render_rows, served_turn_rows
from peagle_data.chat.served import (SERVED_PROMPT_CHANGED, as_served, needs_turn_rows, prompt_anchors,
                                     served_prompt_mismatch)
from runtime.chat.chat_template import ChatTemplate, ChatTemplateError
from stores.errors import InputError

__all__ = ["TokenizedConversation", "tokenize_conversation", "tokenize_turns", "tokenize_rendered"]

@dataclass(frozen=True)
class TokenizedConversation:
    """One conversation as tokens.

    Attributes:
        input_ids: int32 ``[T]``, identical to ``apply_chat_template(messages, tokenize=True)``, except
            a last turn trained on the verifier's generated ids (``on_generated_ids``).
        loss_mask: uint8 ``[T]``, 1 on assistant tokens as rendered and their end-of-turn token.
        system_len: leading tokens that form the system prefix (loss 0), ``0 <= system_len <= T``.
        problem: why no exact mask exists (a token that straddles a supervised span's boundary, see
            :func:`straddling_token`; a context that is not the served prompt's tokens, see
            :func:`served_prompt_mismatch`), or None; such a row is a reject.
        on_generated_ids: 1 when the row's last turn holds the verifier's generated ids in place of
            the re-tokenization of its text (the same text, another tokenization), else 0.
        served_pieces: 1 when the row is tokenized as served (:func:`~peagle_data.chat.served.served_pieces`:
            its generation prompt alone, then its reply), since tokenized whole its reply changed the prompt's
            last tokens; else 0.
        served_turn_row: 1 when the row is one of a conversation's per-turn rows made because no one sequence
            served all its turns exactly (:func:`served_turn_rows`); else 0.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    system_len: int
    problem: str | None = None
    on_generated_ids: int = 0
    served_pieces: int = 0
    served_turn_row: int = 0


def tokenize_conversation(tokenizer, messages: Sequence[dict[str, Any]], tools: list | None = None,
                          chat_template: str | ChatTemplate | None = None, on_dropped: str = "reject",
                          on_special_text: str = "reject") -> TokenizedConversation:
    """Tokenize one conversation with its chat template and find its loss mask and system prefix.

    Args:
        tokenizer: a fast Hugging Face tokenizer (offsets are needed).
        messages: OpenAI messages (``role`` in system/user/assistant/tool), at least one assistant.
        tools: tool definitions passed to the template, or None.
        chat_template: template text overriding ``tokenizer.chat_template``, or None; or a
            :class:`~runtime.chat.chat_template.ChatTemplate` (the text and its variables, --chat-template-kwargs).
        on_dropped: ``reject`` or ``keep`` message content the template does not render (see
            :func:`render_rows`).
        on_special_text: ``reject`` or ``keep`` a supervised reply that writes a special token's text
            (see :func:`~peagle_data.chat.special_text.special_token_text`).

    Returns:
        A :class:`TokenizedConversation` (``input_ids`` int32 ``[T]``, ``loss_mask`` uint8 ``[T]``,
        ``system_len``).

    Raises:
        ChatTemplateError: the template fails on the messages ("template error") or rewrites earlier
            turns once later ones exist ("template rewrites history"; see :func:`tokenize_turns`), its
            generation prompt adds text the rendered turn lacks ("generation prompt mismatch"), or it
            drops message content ("template drops <part>", with ``on_dropped="reject"``).
        InputError: the tokenizer has no chat template or is not a fast tokenizer.
    """
    rows = render_rows(tokenizer, messages, tools, chat_template, per_turn_fallback=False, on_dropped=on_dropped,
                       on_special_text=on_special_text)
    out = tokenize_rendered(tokenizer, rows)[0]
    if out.problem:
        raise ChatTemplateError(out.problem)
    return out


def tokenize_turns(tokenizer, messages: Sequence[dict[str, Any]], tools: list | None = None,
                   chat_template: str | ChatTemplate | None = None,
                   on_dropped: str = "reject",
                   on_special_text: str = "reject") -> list[tuple[int | None, TokenizedConversation]]:
    """Like :func:`tokenize_conversation`, but a template that rewrites history gives one row per
    assistant turn, ``(turn index, row)``; a conversation tokenized whole is ``[(None, row)]``."""
    rows = render_rows(tokenizer, messages, tools, chat_template, per_turn_fallback=True, on_dropped=on_dropped,
                       on_special_text=on_special_text)
    out = [(r.turn, t) for r, t in zip(rows, tokenize_rendered(tokenizer, rows))]
    if any(needs_turn_rows(t.problem) for _, t in out):
        rows = served_turn_rows(tokenizer, messages, tools, chat_template, on_dropped, on_special_text)
        out = [(r.turn, replace(t, served_turn_row=1)) for r, t in zip(rows, tokenize_rendered(tokenizer, rows))]
    for _, t in out:
        if t.problem:
            raise ChatTemplateError(t.problem)
    return out


def tokenize_rendered(tokenizer, rows: Sequence[RenderedRow]) -> list[TokenizedConversation]:
    """Tokenize rendered rows in one batched call and build their loss masks.

    The ids equal ``apply_chat_template(messages, tokenize=True)``: that call tokenizes the same
    render with ``add_special_tokens=False``, as here (the tests check it on every template family).
    A second batched call tokenizes every supervised turn's generation prompt from its last added token
    on (:func:`served_prompt_mismatch`).

    Raises:
        InputError: the tokenizer is not a fast tokenizer (offsets are needed).
    """
    if not rows:
        return []
    if not getattr(tokenizer, "is_fast", False):
        raise InputError("loss masks need a fast tokenizer (offset mapping); this one is not")
    enc = tokenizer([r.text for r in rows], add_special_tokens=False, return_offsets_mapping=True)
    special = special_ids(tokenizer)
    added = np.fromiter(getattr(tokenizer, "added_tokens_decoder", {}).keys(), dtype=np.int64)
    tokenized, tails = [], []
    for row, row_ids, row_offsets in zip(rows, enc["input_ids"], enc["offset_mapping"]):
        ids = np.fromiter(row_ids, dtype=np.int32, count=len(row_ids))
        offsets = np.fromiter(itertools.chain.from_iterable(row_offsets), dtype=np.int64,
                              count=2 * len(row_offsets)).reshape(-1, 2)  # [T, 2] chars
        anchors = prompt_anchors(row, ids, offsets, added)
        tokenized.append((ids, offsets, anchors))
        tails += [row.text[int(offsets[t, 0]) if t else 0:a] for t, (a, _) in zip(anchors, row.spans)]
    served = iter(tokenizer(tails, add_special_tokens=False)["input_ids"] if tails else [])  # one batched call
    drafts = [_whole_row(tokenizer, row, ids, offsets, [(t, next(served)) for t in anchors], special)
              for row, (ids, offsets, anchors) in zip(rows, tokenized)]
    redo = [k for k, d in enumerate(drafts) if d.problem and d.problem.startswith((SERVED_PROMPT_CHANGED,
                                                                                  REPLY_STARTS_INSIDE))]
    for k, draft in zip(redo, as_served(tokenizer, [rows[k] for k in redo], [drafts[k] for k in redo], special)):
        drafts[k] = draft
    return [_finished(tokenizer, row, d, special) for row, d in zip(rows, drafts)]


def _whole_row(tokenizer, row: RenderedRow, ids: np.ndarray, offsets: np.ndarray,
               served: list[tuple[int, Sequence[int]]], special: frozenset[int]) -> MaskedRow:
    """``row`` tokenized whole: its mask and the first reason it has no exact one (the checks of
    :func:`tokenize_rendered`; ``served`` as :func:`served_prompt_mismatch` takes it)."""
    loss_mask, system_len = row_masks(row, ids, offsets, special)
    problem = (straddling_token(row, offsets, loss_mask) or unclear_end_of_turn(row, ids, offsets, special)
               or served_prompt_mismatch(tokenizer, row, ids, offsets, served))
    return MaskedRow(ids, offsets, loss_mask, system_len, problem)


def _finished(tokenizer, row: RenderedRow, draft: MaskedRow, special: frozenset[int]) -> TokenizedConversation:
    """The row's :class:`TokenizedConversation`: ``draft`` trained on its generated ids (:func:`on_generated_ids`)
    where it carries them."""
    ids, loss_mask, spliced, problem = draft.ids, draft.loss_mask, 0, draft.problem
    if problem is None and row.token_ids:
        ids, loss_mask, spliced, problem = on_generated_ids(tokenizer, row, ids, draft.offsets, loss_mask, special)
    return TokenizedConversation(input_ids=ids, loss_mask=loss_mask, system_len=draft.system_len, problem=problem,
                                 on_generated_ids=spliced, served_pieces=draft.pieces if problem is None else 0)
