"""A model's transformers config, read without loading (or downloading) its weights.

Every command checks its options against the verifier's config with it before the weights load
(docs/design.md §2: checks that need no weights run first).
"""

from __future__ import annotations

import os
from pathlib import Path

from runtime.model_cache import EMBEDDED_MODELS, gguf_path, peagle_home, resolve_model

__all__ = ["load_model_config", "text_config"]


def load_model_config(name: str | os.PathLike):
    """The ``transformers`` config of MODEL (see :func:`runtime.model_cache.resolve_model`).

    An embedded model uses its converted ``config.json`` when present, else the GGUF file's
    metadata (no conversion); a hub id fetches the JSON files only; a directory reads its
    ``config.json``.

    Raises:
        ModelNotFoundError / MissingDependencyError: from ``resolve_model``.
        OSError / ValueError: from transformers, for a directory without a usable ``config.json``.
    """
    from transformers import AutoConfig

    text = str(name)
    if text in EMBEDDED_MODELS:
        converted = peagle_home() / "models" / text / "config.json"
        if converted.is_file():
            return AutoConfig.from_pretrained(converted.parent)
        gguf = gguf_path(text)
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    directory = resolve_model(name, need_weights=False)
    if not (Path(directory) / "config.json").is_file():  # a hub snapshot without it: fetch everything
        directory = resolve_model(name, need_weights=True)
    return AutoConfig.from_pretrained(directory)


def text_config(config):
    """The language model's config: ``config.get_text_config()`` for multimodal wrappers, else ``config``."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config
