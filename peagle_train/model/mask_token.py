"""The drafter's mask token: the input id fed at depth > 0 (docs/design.md §8).

Its embedding row trains with the drafter, so it must not be a token the drafter also sees as real
content: a mask token equal to a supervised token (an end-of-turn token, say, as a tokenizer
without an unk token and with ``pad == eos`` gave) makes the drafter's placeholder and a token it
must predict share one embedding. The rule: never a token with a non-zero count in the store's
``token_freq`` (its supervised tokens). Preference, first unused wins:

1. ``--mask-token-id`` (validated; refused when out of range or supervised in the data);
2. the tokenizer's mask token;
3. an embedding row beyond the tokenizer (``len(tokenizer) <= id < V``: padding rows the tokenizer
   never produces, e.g. Qwen's), as speculators' ``resolve_mask_token_id`` adds ``<|MASK|>`` there;
4. the tokenizer's unk token;
5. added special tokens the tokenizer does not name (reserved tokens such as Llama 3's
   ``<|reserved_special_token_N|>``, SmolLM2's ``<repo_name>``), ascending id;
6. the pad token, then the named special tokens (bos, eos, additional special tokens);
7. without tokenizer files: the config's pad, bos and eos ids.

No candidate left is an :class:`InputError` that says to pass ``--mask-token-id``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stores.errors import InputError
from runtime.model_cache import resolve_model

__all__ = ["MaskToken", "mask_token_candidates", "choose_mask_token", "resolve_mask_token", "load_tokenizer_or_none"]


@dataclass(frozen=True)
class MaskToken:
    """The chosen mask token: ``id``, its ``token`` text (None without a tokenizer) and ``source``."""

    id: int
    token: str | None
    source: str

    def to_dict(self) -> dict:
        return {"id": self.id, "token": self.token, "source": self.source}


def load_tokenizer_or_none(model_dir: str | Path):
    """The tokenizer saved in ``model_dir``, or None when it has no tokenizer files."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, TypeError):  # no tokenizer files next to the weights
        return None


def _config_ids(config, name: str) -> list[int]:
    value = getattr(config, name, None)
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values if v is not None]


def mask_token_candidates(tokenizer, config, vocab_size: int) -> list[tuple[int, str]]:
    """``(id, source)`` in the order of preference of the module docstring (steps 2-7), each id once.

    Args:
        tokenizer: a transformers tokenizer or None.
        config: the verifier's transformers config.
        vocab_size: V, rows of the verifier's embedding.
    """
    out: list[tuple[int, str]] = []
    if tokenizer is not None:
        named = {int(i) for i in tokenizer.all_special_ids}
        added = sorted(int(i) for i, t in tokenizer.added_tokens_decoder.items() if t.special)
        out += [(tokenizer.mask_token_id, "the tokenizer's mask token")]
        out += [(i, "an embedding row beyond the tokenizer") for i in range(len(tokenizer), vocab_size)[:1]]
        out += [(tokenizer.unk_token_id, "the tokenizer's unk token")]
        out += [(i, "a reserved special token") for i in added if i not in named]
        out += [(tokenizer.pad_token_id, "the tokenizer's pad token")]
        out += [(i, "a special token of the tokenizer") for i in sorted(named)]
    else:
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            out += [(i, f"the config's {name}") for i in _config_ids(config, name)]
    seen: set[int] = set()
    result = []
    for tid, source in out:
        if tid is not None and 0 <= int(tid) < vocab_size and int(tid) not in seen:
            seen.add(int(tid))
            result.append((int(tid), source))
    return result


def choose_mask_token(tokenizer, config, vocab_size: int, token_freq: np.ndarray,
                      override: int | None = None) -> MaskToken:
    """The mask token of a drafter trained on a store with ``token_freq [V] int64``.

    Raises:
        InputError (``--mask-token-id``): ``override`` outside ``[0, V)`` or supervised in the data
            (the message gives its count), or no candidate is unused in the data.
    """
    freq = np.asarray(token_freq, dtype=np.int64)

    def text(tid: int) -> str | None:
        return tokenizer.convert_ids_to_tokens(tid) if tokenizer is not None and tid < len(tokenizer) else None

    if override is not None:
        if not 0 <= override < vocab_size:
            raise InputError(f"{override} is outside the verifier vocab [0, {vocab_size})", field="--mask-token-id")
        if freq[override] > 0:
            raise InputError(f"token {override} ({text(override)!r}) occurs {int(freq[override])} times as a "
                             "supervised token in the store; the mask token must be a token the data never "
                             "trains on", field="--mask-token-id")
        return MaskToken(override, text(override), "--mask-token-id")
    candidates = mask_token_candidates(tokenizer, config, vocab_size)
    for tid, source in candidates:
        if freq[tid] == 0:
            return MaskToken(tid, text(tid), source)
    tried = ", ".join(f"{tid} ({text(tid)!r}: {int(freq[tid])} supervised)" for tid, _ in candidates[:8])
    raise InputError(f"no special or reserved token is unused in the data to serve as the mask token (tried "
                     f"{tried or 'none: the tokenizer and config name no special token'}); pass "
                     "--mask-token-id with a token id that never occurs as a supervised token",
                     field="--mask-token-id")


def resolve_mask_token(verifier: str, store, override: int | None = None) -> MaskToken:
    """:func:`choose_mask_token` for ``verifier`` (a MODEL name) and a feature store, before any
    weights load: reads the tokenizer files (else the config) and the store's ``token_freq``.

    Raises:
        InputError: see :func:`choose_mask_token`.
        ModelNotFoundError / MissingDependencyError: from :func:`runtime.model_cache.resolve_model`.
    """
    model_dir = resolve_model(verifier, need_weights=False)
    tokenizer = load_tokenizer_or_none(model_dir)
    config = None
    if tokenizer is None:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
    return choose_mask_token(tokenizer, config, int(store.vocab_size), store.token_freq(), override)
