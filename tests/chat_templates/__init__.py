"""Chat templates of reasoning verifiers, written for peagle's tests (not shipped in the package).

- ``qwen3_hybrid.jinja``: Qwen3-style hybrid thinking; ``enable_thinking`` false closes an empty
  think block after the generation prompt (``<think>\\n\\n</think>\\n\\n``), true or unset adds nothing.
- ``qwen35_open_think.jinja``: Qwen3.5-style; the generation prompt opens ``<think>\\n`` by default,
  ``enable_thinking`` false closes an empty block instead.
- ``harmony.jinja``: Harmony-style (gpt-oss); ``reasoning_effort`` (default ``medium``) in the system
  message, reasoning as the analysis channel, content as the final channel.

:func:`template` reads one; :func:`qwen_tokenizer` / :func:`harmony_tokenizer` copy a tokenizer with the
markup tokens each family ships (Qwen's ``<think>`` tokens are added, not special; Harmony's are special,
:data:`runtime.chat.answer_parsing.HARMONY_TOKENS`); :func:`think_tokenizer` is the Qwen copy with
``qwen3_hybrid`` as its template, :func:`harmony_tokenizer`'s has ``harmony`` (the reasoning-parser tests).
"""

from __future__ import annotations

import copy
from pathlib import Path

from tokenizers import Regex, pre_tokenizers

from runtime.chat.answer_parsing import HARMONY_TOKENS

__all__ = ["TEMPLATES_DIR", "template", "template_path", "newline_runs_whole", "NEWLINE_RUNS_PATTERN", "qwen_tokenizer",
           "think_tokenizer", "harmony_tokenizer",
           "QWEN_ADDED", "HARMONY_SPECIAL"]

TEMPLATES_DIR = Path(__file__).parent

QWEN_ADDED = ["<think>", "</think>"]
HARMONY_SPECIAL = list(HARMONY_TOKENS)


def template_path(name: str) -> Path:
    """The file of template ``name`` (``qwen3_hybrid``, ``qwen35_open_think``, ``harmony``)."""
    return TEMPLATES_DIR / f"{name}.jinja"


def template(name: str) -> str:
    """The text of template ``name``."""
    return template_path(name).read_text(encoding="utf-8")


NEWLINE_RUNS_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                        r"|\s*[\r\n]+|\s+(?!\S)|\s+")
"""The pre-tokenizer split of Qwen2/Qwen3 and Llama 3 (Llama 3 groups digits by three): a newline run is one
pre-token whatever follows it, where SmolLM2's GPT-2 split ends it one newline before a letter."""


def newline_runs_whole(tok):
    """A copy of the fast tokenizer ``tok`` with the pre-tokenizer Qwen and Llama 3 ship
    (:data:`NEWLINE_RUNS_PATTERN`, then byte-level without its own split), so a generation prompt ending in
    ``"\n\n"`` tokenizes to the same ids alone and before the reply, as with those families' own
    tokenizers (SmolLM2's vocabulary, another split)."""
    out = copy.deepcopy(tok)
    out.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(NEWLINE_RUNS_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    return out


def qwen_tokenizer(tok):
    """A copy of ``tok`` with Qwen's pre-tokenizer (:func:`newline_runs_whole`) and think tokens added (not
    special, as Qwen ships them)."""
    out = newline_runs_whole(tok)
    out.add_tokens(list(QWEN_ADDED))
    return out


def think_tokenizer(tok):
    """:func:`qwen_tokenizer` with the ``qwen3_hybrid`` template as its own."""
    out = qwen_tokenizer(tok)
    out.chat_template = template("qwen3_hybrid")
    return out


def harmony_tokenizer(tok):
    """A copy of ``tok`` with Harmony's control tokens added as special tokens (as gpt-oss ships them) and the
    ``harmony`` template as its own."""
    out = copy.deepcopy(tok)
    out.add_special_tokens({"additional_special_tokens": list(HARMONY_SPECIAL)})
    out.chat_template = template("harmony")
    return out
