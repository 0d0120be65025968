"""Whether a verifier reads a table's or a store's token ids as the tokens they were made from
(docs/design.md §2, checks before weights).

A token table's manifest records the tokenizer that made its ids (``tokenizer``: ``name``,
``vocab_size`` = ``len(tokenizer)``, ``fingerprint`` = :func:`tokenizer_fingerprint`); a feature
store copies that record (attribute ``tokenizer``) and records its verifier's content fingerprint and
identity by part (:mod:`runtime.model_identity`).
These functions compare the records with a verifier before its weights load.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any, Mapping

import numpy as np

from stores.errors import StoreMismatchError
from runtime.model_cache import TOKENIZER_FILES, ModelFiles, resolve_model
from runtime.model_identity import compare_identity

__all__ = ["tokenizer_fingerprint", "check_tokenizer", "check_verifier_tokenizer", "check_token_ids",
           "check_store_verifier"]

_log = logging.getLogger(__name__)


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash (16 hex digits) of what a tokenizer's ids mean: every token string with its id,
    added tokens included (``tokenizer.get_vocab()``). Two tokenizers with one fingerprint map every
    id to the same token; one added token changes it."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def _made_with(recorded: Mapping[str, Any]) -> str:
    return (f"{recorded.get('name')!r} (tokenizer fingerprint {recorded.get('fingerprint')}, "
            f"{recorded.get('vocab_size')} tokens)")


def check_tokenizer(recorded: Mapping[str, Any], made: str, tokenizer, label: str, fix: str) -> None:
    """Raise unless ``tokenizer`` is the one ``recorded`` (a manifest's ``tokenizer`` record) describes.

    Compares the fingerprint and the vocab size where recorded (a table written before the
    fingerprint was recorded is compared by its vocab size only).

    Args:
        made: what holds the ids, e.g. ``the packed table PATH``.
        label: the tokenizer's name in the message, e.g. ``verifier 'MODEL'``.
        fix: the sentence that says what to do.

    Raises:
        StoreMismatchError: ``{made} was tokenized with NAME (fingerprint, n tokens), but LABEL has
            tokenizer fingerprint F and n tokens: ...; FIX``.
    """
    want_fp, want_n = recorded.get("fingerprint"), recorded.get("vocab_size")
    if want_fp is None and want_n is None:
        return
    fp, n = tokenizer_fingerprint(tokenizer), len(tokenizer)
    if (want_fp is not None and want_fp != fp) or (want_n is not None and int(want_n) != n):
        raise StoreMismatchError(
            f"{made} was tokenized with {_made_with(recorded)}, but {label} has tokenizer fingerprint {fp} and "
            f"{n} tokens: its token ids would mean other tokens; {fix}")


def check_verifier_tokenizer(recorded: Mapping[str, Any], made: str, verifier: ModelFiles) -> None:
    """:func:`check_tokenizer` of the verifier's tokenizer (``verifier``: resolved by
    :func:`runtime.model_cache.model_files`; no weights are read).

    Raises:
        StoreMismatchError: another tokenizer, or a recorded fingerprint and a verifier directory
            without tokenizer files to compare it with.
    """
    if recorded.get("fingerprint") is None and recorded.get("vocab_size") is None:
        return
    fix = (f"tokenize and pack the conversations with the verifier's tokenizer (`peagle-data pack ... --tokenizer "
           f"{verifier.name}`), or pass the verifier whose tokenizer made them")
    if verifier.tokenizer is None:
        if recorded.get("fingerprint") is None:
            return  # nothing to compare: the id range is still checked where the ids are read
        raise StoreMismatchError(
            f"{made} was tokenized with {_made_with(recorded)}, but verifier {verifier.name!r} ({verifier.directory}) "
            f"has no tokenizer files ({', '.join(TOKENIZER_FILES)}) to compare it with; copy the verifier's tokenizer "
            "into its directory")
    check_tokenizer(recorded, made, verifier.tokenizer, f"verifier {verifier.name!r}", fix)


def check_token_ids(rows, made: str, verifier: str, vocab_size: int, first_block: int = 0, step: int = 1) -> None:
    """Every ``input_ids`` of ``rows`` (packed rows) is a row of the verifier's embedding, ``[0, vocab_size)``.

    Args:
        rows: packed rows (``input_ids [T]`` each); row k is packed block ``first_block + k * step``.
        vocab_size: the verifier's embedding rows (its text config's ``vocab_size``).

    Raises:
        StoreMismatchError: names the packed block, the position in it and the id.
    """
    for k, r in enumerate(rows):
        ids = np.asarray(r["input_ids"])
        if ids.size == 0:
            continue
        bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
        if bad.size:
            t = int(bad[0])
            raise StoreMismatchError(
                f"{made}: block {first_block + k * step} holds token id {int(ids[t])} at position {t}, but verifier "
                f"{verifier!r} has {vocab_size} embedding rows (ids 0..{vocab_size - 1}): the table was made with "
                f"another tokenizer; pack it with the verifier's tokenizer (`peagle-data pack ... --tokenizer "
                f"{verifier}`), or pass the verifier whose tokenizer made it")


def check_store_verifier(store, files: ModelFiles) -> None:
    """The verifier MODEL (``files``: :func:`runtime.model_cache.model_files`) is the one ``store`` was extracted
    with: the same content (when the store records a fingerprint; :func:`runtime.model_identity.compare_identity`
    of its directory with the weights: by part when the store records an identity, else by the whole-file
    fingerprint of older stores, which the log names) and the tokenizer its ids were made with
    (:func:`check_verifier_tokenizer`).

    Raises:
        StoreMismatchError: names the store, both verifiers, the parts that differ (weights, config
            fields, tokenizer, chat template) or, for an older store, the whole-file comparison, and
            both fingerprints.
    """
    recorded, verifier = store.attrs.get("verifier", {}), files.name
    if recorded.get("fingerprint") is not None:
        check = compare_identity(recorded, resolve_model(verifier))
        if not check.same:
            raise StoreMismatchError(
                f"verifier {verifier!r} is not the model the store {store.path} was extracted with "
                f"({check.describe()}; the store's verifier {recorded.get('name_or_path')!r}): its targets would "
                "come from another model; pass --verifier with the extraction's model")
        _log.log(logging.WARNING if check.comparison == "legacy" else logging.INFO,
                 "verifier %r is the store %s's (%s fingerprint %s)", verifier, store.path,
                 "whole-file, as an older store records it:" if check.comparison == "legacy" else "identity",
                 check.have)
    check_verifier_tokenizer(store.attrs.get("tokenizer") or {}, f"the store {store.path}", files)
