"""Rendered rows -> token ids and loss masks (docs/design.md §3, step 3): one batched tokenizer call
with offsets; a token is supervised when it starts inside its turn's span, up to the span's end-of-turn
token; a token across a span's boundary (:func:`straddling_token`), a last special token that is
followed by more of the reply (:func:`_unclear_end_of_turn`), or a turn that cannot be trained on the
ids the verifier generated (:func:`on_generated_ids`), makes the row a reject."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from stores.errors import InputError

if TYPE_CHECKING:
    from peagle_data.chat import RenderedRow

__all__ = ["TokenizedConversation", "tokenize_rendered", "straddling_token", "on_generated_ids"]


@dataclass(frozen=True)
class TokenizedConversation:
    """One conversation as tokens.

    Attributes:
        input_ids: int32 ``[T]``, identical to ``apply_chat_template(messages, tokenize=True)``, except
            a last turn trained on the verifier's generated ids (``on_generated_ids``).
        loss_mask: uint8 ``[T]``, 1 on assistant tokens as rendered and their end-of-turn token.
        system_len: leading tokens that form the system prefix (loss 0), ``0 <= system_len <= T``.
        problem: why no exact mask exists (a token that straddles a supervised span's boundary, see
            :func:`straddling_token`), or None; such a row is a reject.
        on_generated_ids: 1 when the row's last turn holds the verifier's generated ids in place of
            the re-tokenization of its text (the same text, another tokenization), else 0.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    system_len: int
    problem: str | None = None
    on_generated_ids: int = 0


def _special_ids(tokenizer) -> frozenset[int]:
    # Cached on the tokenizer, keyed by its size: adding tokens (or a deep copy that does) refreshes it.
    size = len(tokenizer)
    cached = getattr(tokenizer, "_peagle_special_ids", None)
    if cached is None or cached[0] != size:
        ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        ids.update(getattr(tokenizer, "added_tokens_decoder", {}).keys())
        cached = (size, frozenset(ids))
        try:
            tokenizer._peagle_special_ids = cached
        except AttributeError:
            pass
    return cached[1]


def tokenize_rendered(tokenizer, rows: Sequence[RenderedRow]) -> list[TokenizedConversation]:
    """Tokenize rendered rows in one batched call and build their loss masks.

    The ids equal ``apply_chat_template(messages, tokenize=True)``: that call tokenizes the same
    render with ``add_special_tokens=False``, as here (the tests check it on every template family).

    Raises:
        InputError: the tokenizer is not a fast tokenizer (offsets are needed).
    """
    if not rows:
        return []
    if not getattr(tokenizer, "is_fast", False):
        raise InputError("loss masks need a fast tokenizer (offset mapping); this one is not")
    enc = tokenizer([r.text for r in rows], add_special_tokens=False, return_offsets_mapping=True)
    special = _special_ids(tokenizer)
    out = []
    for row, row_ids, row_offsets in zip(rows, enc["input_ids"], enc["offset_mapping"]):
        ids = np.fromiter(row_ids, dtype=np.int32, count=len(row_ids))
        offsets = np.fromiter(itertools.chain.from_iterable(row_offsets), dtype=np.int64,
                              count=2 * len(row_offsets)).reshape(-1, 2)  # [T, 2] chars
        loss_mask = _mask_from_spans(ids, offsets[:, 0], list(row.spans), special, frozenset(row.cut))
        if row.empty_think:
            loss_mask[_mask_from_spans(ids, offsets[:, 0], list(row.empty_think), frozenset()) == 1] = 0
        system_len = int(np.searchsorted(offsets[:, 1], row.prefix_chars, side="right"))
        supervised = np.flatnonzero(loss_mask)
        if supervised.size:
            system_len = min(system_len, int(supervised[0]))
        problem = straddling_token(row, offsets, loss_mask) or _unclear_end_of_turn(row, ids, offsets, special)
        spliced = 0
        if problem is None and row.token_ids:
            ids, loss_mask, spliced, problem = on_generated_ids(tokenizer, row, ids, offsets, loss_mask, special)
        out.append(TokenizedConversation(input_ids=ids, loss_mask=loss_mask, system_len=system_len,
                                         problem=problem, on_generated_ids=spliced))
    return out


def straddling_token(row: RenderedRow, offsets: np.ndarray, loss_mask: np.ndarray) -> str | None:
    """Why a supervised span of ``row`` has no exact mask, or None.

    A token that starts before a span and ends inside it holds the generation prompt's last
    characters (or the previous message's) and the reply's first ones (a generation prompt ending in a space, ``"ASSISTANT: "``,
    gives ``" Hello"``): the rule "supervised when it starts inside the span" would silently drop the
    reply's first word, and supervising it would train the prompt's text. Likewise a supervised
    token that ends past its span holds text of the next turn. Only straddles whose part on the
    other side of the boundary holds non-whitespace count: a merged whitespace run (``"\n\n"``)
    loses or adds only whitespace.

    Args:
        offsets: int64 ``[T, 2]`` character ``[start, end)`` of every token in ``row.text``.
        loss_mask: uint8 ``[T]`` built from ``row.spans``.
    """
    starts, ends = offsets[:, 0], offsets[:, 1]
    text = row.text
    for a, b in row.spans:
        i = int(np.searchsorted(starts, a, side="left")) - 1  # the last token starting before the span
        if i >= 0 and ends[i] > a and text[a:min(int(ends[i]), b)].strip():
            return (f"reply starts inside a token: {text[int(starts[i]):int(ends[i])]!r} holds "
                    f"{text[int(starts[i]):a]!r} rendered before an assistant reply (the generation prompt's end or "
                    f"the previous message's) and {text[a:int(ends[i])]!r} of the reply, so the reply's first token "
                    "has no exact mask (a generation prompt that ends in a space does this); pass --chat-template "
                    "FILE with a generation prompt that ends where a token ends")
        lo, hi = int(np.searchsorted(starts, a, side="left")), int(np.searchsorted(starts, b, side="left"))
        inside = np.flatnonzero(loss_mask[lo:hi])
        t = lo + int(inside[-1]) if inside.size else -1
        if t >= 0 and ends[t] > b and text[b:int(ends[t])].strip():
            return (f"a supervised token ends past its assistant turn: {text[int(starts[t]):int(ends[t])]!r} "
                    f"holds {text[b:int(ends[t])]!r} of what follows the turn, so the turn has no exact mask; pass "
                    "--chat-template FILE with a template that ends assistant turns with an end-of-turn token")
    return None


def _unclear_end_of_turn(row: RenderedRow, ids: np.ndarray, offsets: np.ndarray,
                         special: frozenset[int]) -> str | None:
    """Why a supervised span has no exact end, or None: its last special/added token (the one
    :func:`_mask_from_spans` ends the mask at) is followed by more than whitespace inside the span, so
    it is a token of the reply itself (``"a <file_sep> b"``, an inline ``</think>``) under a template
    that ends turns without one; masking up to it would silently drop the reply's rest."""
    starts, ends = offsets[:, 0], offsets[:, 1]
    text = row.text
    for k, (a, b) in enumerate(row.spans):
        if k in row.cut:  # ends with the reply's own text
            continue
        lo, hi = int(np.searchsorted(starts, a, side="left")), int(np.searchsorted(starts, b, side="left"))
        last = next((t for t in range(hi - 1, lo - 1, -1) if int(ids[t]) in special), None)
        if last is not None and text[int(ends[last]):b].strip():
            return (f"no end-of-turn token ends an assistant turn: its last special token "
                    f"{text[int(starts[last]):int(ends[last])]!r} is followed by {text[int(ends[last]):b][:40]!r} "
                    "inside the turn, so it is part of the reply and the turn has no exact mask; pass "
                    "--chat-template FILE with a template that ends assistant turns with an end-of-turn token")
    return None


def on_generated_ids(tokenizer, row: RenderedRow, ids: np.ndarray, offsets: np.ndarray, loss_mask: np.ndarray,
                     special: frozenset[int]) -> tuple[np.ndarray, np.ndarray, int, str | None]:
    """The row trained on the ids the verifier generated for its turns that carry them (``row.token_ids``).

    A turn's tokens (those of :func:`_mask_from_spans`, up to its end-of-turn token) usually are
    exactly its generated ids. When they are not:

    - the generated ids decode (no clean-up) to the same text, another tokenization of it (a verifier
      generates ``"\n\n"`` as one token where its tokenizer makes two): the row's last supervised
      turn is trained on the generated ids, spliced in place of its tokens (what the verifier computed
      and what vLLM serves: the prompt, then the generated ids), counted; an earlier turn is a reject,
      since the next turn's context, as the verifier saw it, was the re-tokenized text;
    - another text (a decode that cleaned up tokenization spaces, ``x!= y`` for ``x != y``; ids left
      over from an edited text; another tokenizer): a reject;
    - an id outside ``[0, len(tokenizer))``: a reject (it decodes to ``""``, so the text alone would match).

    Args:
        ids: int32 ``[T]`` of ``row.text``; offsets: int64 ``[T, 2]`` their characters;
            loss_mask: uint8 ``[T]``.

    Returns:
        ``(input_ids, loss_mask, spliced, problem)``: the ids and mask (new arrays when a turn was
        spliced), 1 when it was, and the reject reason or None.
    """
    starts, text = offsets[:, 0], row.text
    n_tokens = len(tokenizer)
    for k, msg_index, generated in row.token_ids:
        past = next((j for j, t in enumerate(generated) if not 0 <= t < n_tokens), None)
        if past is not None:  # decodes to "": the text would still match
            return ids, loss_mask, 0, (
                f"generated ids outside the tokenizer: assistant message {msg_index} token_ids[{past}] is "
                f"{generated[past]}, but the tokenizer has {n_tokens} tokens (ids 0..{n_tokens - 1}): the ids come "
                "from another tokenizer or were edited; tokenize with the tokenizer of the verifier that generated "
                "them")
        a, b = row.spans[k]
        lo, end = _span_tokens(ids, starts, a, b, special, k in row.cut)
        got = [int(t) for t in ids[lo:end]]
        if got == list(generated):
            continue
        at = next((j for j, (x, y) in enumerate(zip(got, generated)) if x != y), min(len(got), len(generated)))
        name = [repr(tokenizer.convert_ids_to_tokens(int(seq[at]))) if at < len(seq) else "(end)"
                for seq in (got, generated)]
        where = (f"assistant message {msg_index} re-tokenizes inside the chat template to {len(got)} ids, the "
                 f"verifier generated {len(generated)} (token_ids); first difference at token {at}: {name[0]} "
                 f"for the generated {name[1]}")
        same_text = end > lo and tokenizer.decode(list(generated), clean_up_tokenization_spaces=False) == \
            text[int(starts[lo]):int(offsets[end - 1, 1])]
        if not same_text:
            return ids, loss_mask, 0, (
                f"generated ids do not round-trip: {where}, and they decode to another text. Its text was decoded "
                "with clean_up_tokenization_spaces (peagle's regenerate never does), edited after regenerate, or "
                "tokenize runs with another tokenizer than the one that generated the ids")
        if k != len(row.spans) - 1 or any(a <= x < b for x, _ in row.empty_think):
            return ids, loss_mask, 0, (
                f"generated ids do not round-trip: {where} (the same text, another tokenization); the verifier "
                "saw the re-tokenized text as the context of the turns after it, so no tokenization trains both "
                "exactly")
        new_ids = np.concatenate([ids[:lo], np.asarray(generated, dtype=ids.dtype), ids[end:]])
        new_mask = np.concatenate([loss_mask[:lo], np.ones(len(generated), dtype=loss_mask.dtype), loss_mask[end:]])
        return new_ids, new_mask, 1, None
    return ids, loss_mask, 0, None


def _span_tokens(ids: np.ndarray, starts: np.ndarray, a: int, b: int, special: frozenset[int],
                 cut: bool) -> tuple[int, int]:
    """Tokens ``[lo, end)`` of the span ``[a, b)`` characters: those starting in it, up to and
    including its last special token (all of them when ``cut``: a reply cut at a token limit)."""
    lo = int(np.searchsorted(starts, a, side="left"))
    hi = int(np.searchsorted(starts, b, side="left"))  # tokens [lo, hi) start in [a, b)
    if not cut:
        for t in range(hi - 1, lo - 1, -1):
            if int(ids[t]) in special:
                return lo, t + 1
    return lo, max(hi, lo)


def _mask_from_spans(ids: np.ndarray, starts: np.ndarray, spans: list[tuple[int, int]],
                     special: frozenset[int], cut: frozenset[int] = frozenset()) -> np.ndarray:
    """uint8 ``[T]``: 1 for tokens starting in a span, up to and including its last special token
    (all of them for the spans whose position is in ``cut``: replies cut at a token limit, whose span
    already ends with the reply's text)."""
    mask = np.zeros(len(ids), dtype=np.uint8)
    for k, (a, b) in enumerate(spans):
        lo, end = _span_tokens(ids, starts, a, b, special, k in cut)
        mask[lo:end] = 1
    return mask
