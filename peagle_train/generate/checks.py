"""The checks of a drafter against its verifier that need no verifier weights, run before the Python API or
``peagle-eval`` loads any (docs/design.md §2)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from peagle_train.generate.speculative import check_compatible
from peagle_train.generate.tree import check_tree_config
from runtime.chat.chat_template import chat_template_kwargs_record
from runtime.model_cache import ModelFiles
from runtime.model_config import load_model_config, text_config
from runtime.verifier_match import check_verifier_tokenizer

__all__ = ["check_verifier_config", "check_tree_verifier", "check_drafter_tokenizer", "trained_template_kwargs"]


def check_verifier_config(name: str, drafter):
    """:func:`~peagle_train.generate.speculative.check_compatible` on MODEL ``name``'s config alone, before its
    weights load; returns that config (``transformers.PretrainedConfig``).

    Raises:
        InputError: the drafter does not fit the verifier. ModelNotFoundError: unknown MODEL.
    """
    config = load_model_config(name)
    check_compatible(SimpleNamespace(config=text_config(config)), drafter)
    return config


def check_tree_verifier(name: str) -> None:
    """:func:`~peagle_train.generate.tree.check_tree_config` on MODEL ``name``'s config alone, before its weights
    load: a tree is refused for a verifier with recurrent layers (a hybrid) or layer types without a tree mask.

    Raises:
        InputError: with the reason. ModelNotFoundError: unknown MODEL.
    """
    check_tree_config(load_model_config(name))


def check_drafter_tokenizer(drafter_dir: str | Path, verifier: ModelFiles) -> None:
    """The verifier's tokenizer (``verifier``: :func:`runtime.model_cache.model_files`) is the one the drafter's
    training data was tokenized with (the store's ``tokenizer`` record, which ``peagle-train`` keeps in
    ``config.json`` as ``peagle_training.tokenizer``; a checkpoint without it, e.g. another tool's, is not
    checked): the drafter's embedding rows and ``d2t`` mean that tokenizer's tokens.

    Raises:
        StoreMismatchError: another tokenizer (:func:`runtime.verifier_match.check_tokenizer`).
    """
    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    recorded = (config.get("peagle_training") or {}).get("tokenizer") or {}
    check_verifier_tokenizer(recorded, f"the training data of the drafter {drafter_dir}", verifier)


def trained_template_kwargs(drafter_dir: str | Path) -> dict | None:
    """The chat template variables the drafter's training data was rendered with (``config.json``'s
    ``peagle_training.tokenizer.chat_template_kwargs``; ``{}`` when its record predates them), or None for
    a checkpoint without peagle's tokenizer record (another tool's: nothing to check)."""
    config = json.loads((Path(drafter_dir) / "config.json").read_text())
    recorded = (config.get("peagle_training") or {}).get("tokenizer")
    if not recorded:
        return None
    return chat_template_kwargs_record(recorded.get("chat_template_kwargs"))

