"""A supervised turn trained on the ids the verifier generated (``token_ids``, written by ``regenerate``), in place
of the re-tokenization of its text, or the reason it cannot be (docs/design.md §3)."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from peagle_data.chat.loss_mask import span_tokens
from peagle_data.chat.render import RenderedRow, common_prefix_len

__all__ = ["on_generated_ids"]

def on_generated_ids(tokenizer, row: RenderedRow, ids: np.ndarray, offsets: np.ndarray, loss_mask: np.ndarray,
                     special: frozenset[int]) -> tuple[np.ndarray, np.ndarray, int, str | None]:
    """The row trained on the ids the verifier generated for its turns that carry them (``row.token_ids``).

    A turn's tokens (:func:`~peagle_data.chat.loss_mask.span_tokens`, up to its end-of-turn token) equal its
    generated ids, or (docs/design.md §3): the row's last supervised turn gets them spliced in place of its tokens
    where they decode to the same text (another tokenization, or a template that trims the reply's whitespace);
    an earlier cut turn whose last generated ids are whitespace the template does not render as generated
    supervises the tokens it shares with them; anything else is a reject (``generated ids do not round-trip``,
    naming where the render and the generated text part; ``generated ids outside the tokenizer`` for an id
    outside ``[0, len(tokenizer))``).

    Args:
        ids: int32 ``[T]`` of ``row.text``; offsets: int64 ``[T, 2]`` their characters;
            loss_mask: uint8 ``[T]``.

    Returns:
        ``(input_ids, loss_mask, spliced, problem)``: the ids and mask (new arrays when a turn was
        spliced or shortened), 1 when a turn was spliced, and the reject reason or None.
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
        lo, end = span_tokens(ids, starts, a, b, special, k in row.cut)
        got = [int(t) for t in ids[lo:end]]
        if got == list(generated):
            continue
        at = next((j for j, (x, y) in enumerate(zip(got, generated)) if x != y), min(len(got), len(generated)))
        decoded = tokenizer.decode(list(generated), clean_up_tokenization_spaces=False)
        rendered = text[int(starts[lo]):int(offsets[end - 1, 1])] if end > lo else ""
        trimmed = _trimmed_alike(tokenizer, generated, decoded, rendered, special)
        last = k == len(row.spans) - 1 and not any(a <= x < b for x, _ in row.empty_think)
        if last and (decoded == rendered or trimmed):  # the verifier's own ids for the same text: spliced in
            new_ids = np.concatenate([ids[:lo], np.asarray(generated, dtype=ids.dtype), ids[end:]])
            new_mask = np.concatenate([loss_mask[:lo], np.ones(len(generated), dtype=loss_mask.dtype),
                                       loss_mask[end:]])
            return new_ids, new_mask, 1, None
        if k in row.cut and _unrendered_whitespace(tokenizer, generated[at:], text[int(starts[lo + at]):b]
                                                   if lo + at < end else ""):
            loss_mask = loss_mask.copy()  # the tokens it shares with the generated ids: an exact subset
            loss_mask[lo + at:end] = 0
            continue
        name = [repr(tokenizer.convert_ids_to_tokens(int(seq[at]))) if at < len(seq) else "(end)"
                for seq in (got, generated)]
        where = (f"assistant message {msg_index} re-tokenizes inside the chat template to {len(got)} ids, the "
                 f"verifier generated {len(generated)} (token_ids); first difference at token {at}: {name[0]} "
                 f"for the generated {name[1]}")
        if decoded != rendered and not trimmed:
            own = tokenizer.decode(list(generated), skip_special_tokens=True, clean_up_tokenization_spaces=False)
            if all(part in own for part in row.texts[k] if part):
                c = common_prefix_len(decoded, rendered)
                return ids, loss_mask, 0, (
                    f"generated ids do not round-trip: {where}; they decode to the message's text, but the chat "
                    f"template renders it otherwise: {rendered[c:c + 24]!r} in the render where the generated "
                    f"text has {decoded[c:c + 24]!r} (after {decoded[max(0, c - 24):c]!r}), so the turn as "
                    "rendered is not what the verifier generated; pass --chat-template FILE with a template that "
                    "renders assistant content as it is")
            return ids, loss_mask, 0, (
                f"generated ids do not round-trip: {where}, and they decode to another text than the message's "
                "content: the text was decoded with clean_up_tokenization_spaces (peagle's regenerate never does) "
                "or edited after regenerate, or tokenize runs with another tokenizer than the one that generated "
                "the ids")
        how = ("the template trims the reply's whitespace); the verifier saw the trimmed text" if trimmed else
               "the same text, another tokenization); the verifier saw the re-tokenized text")
        return ids, loss_mask, 0, (
            f"generated ids do not round-trip: {where} ({how} as the context of the turns after it, so no "
            "tokenization trains both exactly")
    return ids, loss_mask, 0, None


def _trimmed_alike(tokenizer, generated: Sequence[int], decoded: str, rendered: str, special: frozenset[int]) -> bool:
    """Whether the rendered turn (``rendered``) is the generated text (``decoded``) with its leading and/or
    trailing whitespace trimmed, before a generated end-of-turn token both end with (a template that
    renders ``content | trim``): then the generated ids are the verifier's own for the same text."""
    tail = tokenizer.decode([generated[-1]], clean_up_tokenization_spaces=False) \
        if generated and int(generated[-1]) in special else ""
    if tail and decoded.endswith(tail) and rendered.endswith(tail):
        decoded, rendered = decoded[:-len(tail)], rendered[:-len(tail)]
    return decoded != rendered and rendered in (decoded.strip(), decoded.rstrip(), decoded.lstrip())


def _unrendered_whitespace(tokenizer, rest: Sequence[int], rendered: str) -> bool:
    """Whether the last generated ids ``rest`` of a cut reply, which its rendered tokens do not hold, are
    whitespace the template does not render as generated: ``rest`` decodes to whitespace only, and
    the span's text from the first differing token on (``rendered``) is whitespace only too (none when
    the template trims it, a token merging it with the text after the reply when it renders it so)."""
    tail = tokenizer.decode(list(rest), clean_up_tokenization_spaces=False)
    return bool(rest) and not tail.strip() and not rendered.strip()
