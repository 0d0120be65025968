"""The options of the tool commands ``peagle-data inspect``, ``verify``, ``stats``, ``show`` and
``merge`` as typed configs (docs/design.md §6): the command line generates its options from these
fields (cli/options.py) and calls the library with one of them.

Light on purpose (no torch, no polars): ``peagle-data --help`` imports these through the commands.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["InspectConfig", "VerifyConfig", "StatsConfig", "ShowConfig", "MergeConfig", "COLORS"]

COLORS = ("auto", "always", "never")
"""``show --color``: auto colours on a terminal only."""


@dataclass(frozen=True, kw_only=True)
class InspectConfig:
    """What ``peagle-data inspect`` describes."""

    path: str
    """A token table (tokenize or pack output) or a feature store."""


@dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    """What ``peagle-data verify`` checks, and whether it repairs."""

    store: str
    """A feature store, or a token table (its totals, unique row sources and window ids, and for a
    merged table the union of its shards)."""
    packed: str | None = None
    """Also check token ids against this packed table."""
    repair: bool = field(default=False, metadata={"action": True})
    """Clear the done flag of every bad block, so that extract with its resume option extracts them again."""


@dataclass(frozen=True, kw_only=True)
class StatsConfig:
    """What ``peagle-data stats`` measures and how it prints."""

    path: str
    """A tokenize output, a pack output or a feature store."""
    json: bool = False
    """Print the statistics as JSON."""
    png: str | None = None
    """Also write a PNG: length histogram, supervised fraction, windows, per-source shares."""
    max_seq_len: int | None = None
    """For a tokenize output: count the windows `pack --max-seq-len N` would cut (tokens, >= 2)."""
    overlap: float = 0.5
    """The `pack --overlap` of those windows, in [0, 1)."""
    force: bool = field(default=False, metadata={"action": True})
    """Overwrite an existing --png file."""

    def __post_init__(self) -> None:
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"--max-seq-len must be >= 2 tokens, got {self.max_seq_len}")
        if not 0.0 <= self.overlap < 1.0:
            raise ValueError(f"--overlap must be in [0, 1), got {self.overlap}")


@dataclass(frozen=True, kw_only=True)
class ShowConfig:
    """Which rows or blocks ``peagle-data show`` prints, and how."""

    path: str
    """A tokenize or pack output directory."""
    row: int | None = None
    """Row N of a tokenized table (from 0; default 0 when neither a block nor an id is given); for
    a packed table, block N."""
    block: int | None = None
    """Block N of a packed table (its block_id, from 0)."""
    item_id: str | None = None
    """A conversation id (its per-turn rows ID@turn too), or a window id ID#k: the rows or blocks
    that hold it."""
    tokenizer: str | None = None
    """Tokenizer to decode with (smollm2-135m, a local model directory or a Hugging Face id); None:
    the one in the table's manifest."""
    color: str = "auto"
    """Colour supervised tokens (auto: on a terminal); without colour they are [[bracketed]]."""
    html: str | None = None
    """Also write an HTML page with the supervised tokens highlighted."""
    force: bool = field(default=False, metadata={"action": True})
    """Overwrite an existing --html FILE."""

    def __post_init__(self) -> None:
        for name in ("row", "block"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.color not in COLORS:
            raise ValueError(f"--color must be one of {', '.join(COLORS)}, got {self.color!r}")


@dataclass(frozen=True, kw_only=True)
class MergeConfig:
    """Which shard outputs ``peagle-data merge`` joins, and where."""

    shards: Sequence[str]
    """The N shard outputs (shard_index 0..N-1 of num_shards N) of one tokenize, pack or extract run: all
    token tables or all feature stores, each given once."""
    output: str
    """The merged token table or feature store (must not exist unless --force)."""
    force: bool = field(default=False, metadata={"action": True})
    """Overwrite an existing output."""
