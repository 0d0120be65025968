"""The ``hf`` extraction engine: the verifier's transformers forward over whole packed blocks (the reference).

Legend: T tokens in a block, L aux layers, H hidden size.

The forward itself (segments kept apart inside a block, chosen layers only) is
:mod:`peagle_data.extract.hf_forward`; this module loads the verifier with the attention backend of
``--attn-implementation`` and runs it block by block. Under ``accelerate launch`` every rank opens
its own engine (one whole model per process).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from peagle_data.extract.engine import PackedFacts, VerifierEngine
from peagle_data.extract.hf_forward import hybrid_kind, language_model, verifier_features
from peagle_data.extract.store import verifier_desc
from stores.errors import InputError
from runtime.model_cache import load_verifier

__all__ = ["HfEngine", "has_flash_attn", "segment_groups"]


def has_flash_attn() -> bool:
    """Whether the ``flash_attn`` package is installed."""
    return importlib.util.find_spec("flash_attn") is not None


def _load_for_extract(cfg, device: str, log: Callable[[str], None]):
    """The verifier with the attention backend of ``cfg.attn_implementation``.

    ``auto``: FlashAttention varlen on CUDA when installed and the model supports it, else
    transformers' choice (SDPA when the model supports it, else eager: Gemma-2, gpt-oss).

    Raises:
        InputError: an explicit backend the model does not support (names the alternatives).
    """
    impl = cfg.attn_implementation
    if impl == "auto":
        if device.startswith("cuda") and has_flash_attn():
            try:
                return load_verifier(cfg.verifier, device=device, attn_implementation="flash_attention_2")
            except (ValueError, ImportError) as e:
                log(f"flash_attention_2 is not available for this verifier ({e}); using transformers' default")
        return load_verifier(cfg.verifier, device=device)
    try:
        return load_verifier(cfg.verifier, device=device, attn_implementation=impl)
    except ValueError as e:
        if "support" not in str(e):
            raise
        raise InputError(f"the verifier cannot run with {impl}: {e}; pass --attn-implementation auto "
                         "(the model's own choice) or eager", field="--attn-implementation") from e


class HfEngine(VerifierEngine):
    """transformers on one device per process; packed blocks run whole (docs/design.md §4)."""

    name = "hf"
    multi_process = True

    def __init__(self, verifier, desc: dict[str, Any], layers: list[int], group_tokens: int | None = None):
        self.decoder = language_model(verifier)
        self.desc, self.layers = desc, layers
        self.record = {"name": self.name}
        varlen = getattr(self.decoder.config, "_attn_implementation", None) == "flash_attention_2"
        # varlen attention wastes nothing on a long block; a hybrid batches a whole block's segments by length
        self.group_tokens = None if varlen or hybrid_kind(self.decoder.config) else group_tokens

    @classmethod
    def check(cls, cfg, config, layers: list[int]) -> None:
        """Nothing beyond the engine-independent checks: transformers runs every packable verifier."""

    @classmethod
    def open(cls, cfg, directory: Path, layers: list[int], log: Callable[[str], None],
             device: str, packed: PackedFacts, identity: dict[str, Any]) -> "HfEngine":
        verifier = _load_for_extract(cfg, device, log)
        desc = verifier_desc(cfg.verifier, identity, verifier, next(verifier.parameters()).dtype)
        return cls(verifier, desc, layers, packed.group_tokens)

    def features(self, rows: Iterable[tuple[int, Mapping[str, Any]]]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """One verifier forward per block (:func:`verifier_features`), or per group of its segments
        (:func:`segment_groups` of ``group_tokens``); tensors stay on the verifier's device."""
        for i, r in rows:  # numpy arrays from Arrow are read-only: copy into tensors
            ids = torch.tensor(r["input_ids"], dtype=torch.long)
            pos = torch.tensor(r["position_ids"], dtype=torch.long)
            cu = torch.tensor(r["cu_seqlens"], dtype=torch.long)
            parts = []
            for first, last in segment_groups(cu.tolist(), self.group_tokens):
                lo, hi = int(cu[first]), int(cu[last])
                parts.append(verifier_features(self.decoder, ids[lo:hi], pos[lo:hi], cu[first:last + 1] - lo,
                                               self.layers, to_host=False))
            if len(parts) == 1:
                yield i, *parts[0]
            else:
                yield i, torch.cat([a for a, _ in parts]), torch.cat([f for _, f in parts])


def segment_groups(cu_seqlens: list[int], group_tokens: int | None) -> list[tuple[int, int]]:
    """Consecutive segments of a block in groups of at most ``group_tokens`` tokens (a longer segment
    alone): ``[(first segment, one past the last)]``; the whole block when ``group_tokens`` is None.

    ``cu_seqlens`` ``[S+1]``: ``[0, n_0, ..., T]``. Each group runs as a block of its own, its segments
    still computed as if alone, so the features are those of the whole block within float rounding.
    """
    S = len(cu_seqlens) - 1
    if group_tokens is None or cu_seqlens[-1] <= group_tokens:
        return [(0, S)]
    groups, first = [], 0
    for k in range(1, S):
        if cu_seqlens[k + 1] - cu_seqlens[first] > group_tokens:
            groups.append((first, k))
            first = k
    groups.append((first, S))
    return groups
