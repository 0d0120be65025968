"""The text of a generated answer: a think block split off into the reasoning, and an answer cut at the
token limit kept only up to its last complete character (never a U+FFFD the verifier did not say)."""

from __future__ import annotations

import re

__all__ = ["REPLACEMENT", "complete_prefix", "split_reasoning", "prompt_opens_think"]

REPLACEMENT = "\ufffd"
"""U+FFFD, what a lossy UTF-8 decode writes for bytes that are not a complete character."""


_THINK = re.compile(r"^\s*(?:<think>)?(.*?)</think>\s*(.*)$", re.DOTALL)


def split_reasoning(text: str, prompt_opened: bool | None = None) -> tuple[str, str | None]:
    """``(content, reasoning)`` of a decoded answer: a leading ``<think>...</think>`` block (or text
    up to ``</think>`` when the prompt opened the block) becomes the reasoning, stripped; the rest is
    the content with leading whitespace removed. A text without ``</think>`` is all content, except
    one that opens ``<think>`` and never closes it (cut by the token limit): all reasoning.

    Args:
        prompt_opened: whether the prompt ends inside an open ``<think>`` block (its last ``<think>``
            after its last ``</think>``). False: only a text that opens its own block has reasoning
            (``"The tag </think> closes it."`` stays content); None (a server's prompt, unknown):
            text up to a ``</think>`` is reasoning.
    """
    if prompt_opened is False and not text.lstrip().startswith("<think>"):
        return text, None
    m = _THINK.match(text)
    if m:
        return m.group(2), m.group(1).strip()
    if text.lstrip().startswith("<think>"):
        return "", text.lstrip()[len("<think>"):].strip()
    return text, None


def prompt_opens_think(prompt_text: str) -> bool:
    """Whether ``prompt_text`` ends inside an open think block (a generation prompt ending ``<think>\n``,
    DeepSeek-R1 style): its last ``<think>`` comes after its last ``</think>``."""
    return prompt_text.rfind("<think>") > prompt_text.rfind("</think>")


def _byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level BPE (GPT-2 style: every token is bytes)."""
    from tokenizers import decoders

    dec = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return isinstance(dec, decoders.ByteLevel)


def _token_bytes(tokenizer, ids: list[int]) -> bytes | None:
    """The bytes of ``ids`` (special tokens left out) for a byte-level BPE tokenizer; None otherwise."""
    if not _byte_level(tokenizer):
        return None
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    inverse = {c: b for b, c in bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids)
    out = bytearray()
    for tok in tokenizer.convert_ids_to_tokens([i for i in ids if i not in special]):
        if any(c not in inverse for c in tok):
            return None
        out += bytes(inverse[c] for c in tok)
    return bytes(out)


def complete_prefix(tokenizer, ids: list[int], cut: bool) -> tuple[int, str | None]:
    """How many of the generated ``ids`` an answer keeps, and why it cannot be kept at all.

    An answer ``cut`` at the token limit drops its last ids while their ``skip_special_tokens``
    decode ends in U+FFFD: the bytes of a character the limit cut (at most 3 ids for a 4-byte
    character; a trailing U+FFFD the verifier itself wrote goes too, the kept text is still a prefix
    of its answer). A U+FFFD left in the text must be the verifier's own character: for a
    byte-level BPE tokenizer the ids' bytes must be valid UTF-8 (else ``invalid UTF-8``); for other
    tokenizers the bytes cannot be read back and the answer is refused (``undecodable answer``).

    Returns:
        ``(n, error)``: keep ``ids[:n]``; ``error`` None or the reject reason.
    """
    n = len(ids)
    text = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    while cut and n and text.endswith(REPLACEMENT):
        n -= 1
        text = tokenizer.decode(ids[:n], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if REPLACEMENT not in text:
        return n, None
    raw = _token_bytes(tokenizer, ids[:n])
    if raw is None:
        return n, ("undecodable answer: the answer decodes to U+FFFD and this tokenizer's bytes cannot be "
                   "checked to tell the verifier's own U+FFFD from bytes that are not UTF-8")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return n, (f"invalid UTF-8: the answer's tokens hold bytes that are not UTF-8 (byte {e.start} of "
                   f"{len(raw)}: {raw[e.start:e.end]!r}); their decode would write U+FFFD the verifier did not say")
    return n, None
