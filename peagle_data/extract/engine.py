"""The verifier engine interface of extraction: what an engine (``hf``, ``vllm``) provides.

Legend: T tokens in a block, L aux layers, H hidden size, S segments.

An engine turns packed blocks into the store's features; everything else (the packed table, the
store, resume and repair, shards, the writer thread) is :mod:`peagle_data.extract.run`'s and the same
for every engine, so stores of two engines differ only in their ``engine`` attribute and in the
numerics of the features. A new engine is one module with one :class:`VerifierEngine` subclass and
one entry in :data:`peagle_data.extract.config.ENGINES`. ``cfg`` is the run's
:class:`peagle_data.extract.config.ExtractConfig` (not imported here: that module imports the engines).

Layer ids are vLLM's aux ids, L the verifier's decoder layer count: ``0`` the embedding output, ``k``
in ``1..L-1`` the output of decoder layer ``k-1`` (transformers' ``hidden_states[k]`` for k < L),
``L`` the last decoder layer's output before the final norm; the final slot is the normed state
(the final-norm output).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Iterator, Mapping

import torch

__all__ = ["PackedFacts", "VerifierEngine", "timed"]


@dataclass(frozen=True)
class PackedFacts:
    """What an engine may need to know of the packed table (and of the store it continues) before it starts."""

    longest_segment: int
    """Tokens of the longest segment (a vLLM engine's ``max_model_len``)."""
    tokenizer: str | None
    """The tokenizer the table was made with (its manifest's ``name_or_path``), None if unrecorded."""
    offset_segment: tuple[int, int] | None = None
    """``(block, segment)`` of the first segment whose position ids are not ``0..n-1``, None if none
    (an engine that starts every request at position 0 refuses such a table)."""
    group_tokens: int | None = None
    """``--context full``: the packed table's block size. A context block holds up to ``--max-context``
    tokens of many conversations; an engine whose attention over a packed block costs its length
    squared (transformers' SDPA or eager with a block mask) runs the block's conversations in
    consecutive groups of at most this many tokens (a longer one alone), so that costs what the packed
    blocks would. None: whole blocks."""
    resumed_dtype: str | None = None
    """The compute dtype (e.g. ``"bfloat16"``) of the store ``--resume`` continues, None without one (a
    ``--server`` extraction computes in it)."""


class VerifierEngine(ABC):
    """One verifier engine: refusals before weights load, the verifier's description, block features.

    Lifecycle: :meth:`check` (config only, class method) → ``open`` (loads weights or starts the
    engine) → :meth:`features` over the blocks → :meth:`close`.
    """

    name: ClassVar[str]
    """The ``--engine`` value and the store's ``engine.name`` attribute."""
    multi_process: ClassVar[bool] = False
    """Whether the engine runs under ``accelerate launch`` with several processes (each rank opens its
    own engine); else it runs in one process (its parallelism is its own)."""
    positions_after_prompt: ClassVar[int] = 0
    """Positions the engine needs after a segment's last token within the verifier's
    ``max_position_embeddings``: a segment may have at most ``max_position_embeddings -
    positions_after_prompt`` tokens (vLLM generates one token after every request, and its
    ``max_model_len`` may not pass ``max_position_embeddings``)."""

    @classmethod
    @abstractmethod
    def check(cls, cfg, config, layers: list[int]) -> None:
        """Refuse what this engine cannot extract exactly, from the verifier's ``config`` and the options only.

        Raises:
            InputError: naming the option or the verifier and the fix.
            MissingDependencyError: the engine's package is not installed (names the set-up command).
        """

    @classmethod
    @abstractmethod
    def open(cls, cfg, directory: Path, layers: list[int], log: Callable[[str], None],
             device: str, packed: PackedFacts, identity: dict[str, Any]) -> "VerifierEngine":
        """Load the verifier from ``directory`` (or connect to it) for extracting ``layers``; ``device``
        is the accelerate process's device (hf); ``identity``, the directory's identity record
        (:func:`runtime.model_identity.model_identity`, read once before the weights load)."""

    desc: dict[str, Any]
    """The store's ``verifier`` attribute (:func:`peagle_data.extract.store.verifier_desc`)."""
    record: dict[str, Any]
    """The store's ``engine`` attribute: ``name`` and the settings that change the numerics."""

    @abstractmethod
    def features(self, rows: Iterable[tuple[int, Mapping[str, Any]]]) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Features of packed blocks ``(i, row)`` (a row has ``input_ids``, ``position_ids`` ``[T]``,
        ``cu_seqlens [S+1]``), yielded in order as ``(i, aux [T, L, H] bf16, final [T, H] bf16)``
        (CPU or the verifier's device), each segment as if run alone."""

    def timings(self) -> dict[str, float]:
        """Seconds this engine spent so far per phase of :meth:`features`, by phase name (``*_s``; the
        ``vllm`` engine: ``requests_s``, ``files_s``, ``check_s``, ``assemble_s``); empty for an engine
        that does not split its time (``hf``: its forward is the whole of it)."""
        return {}

    def close(self) -> None:
        """Release the engine (processes, temporary files)."""


def timed(items: Iterable, totals: dict[str, float], key: str) -> Iterator:
    """``items`` unchanged, adding to ``totals[key]`` the seconds (``time.perf_counter``) each ``next`` took:
    the time the consumer waited on the producer (e.g. an engine's :meth:`VerifierEngine.features`)."""
    it = iter(items)
    while True:
        t0 = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            totals[key] = totals.get(key, 0.0) + time.perf_counter() - t0
            return
        totals[key] = totals.get(key, 0.0) + time.perf_counter() - t0
        yield item
