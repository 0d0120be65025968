"""Mixture files: several conversation sources, each with a weight or a row limit (YAML or TOML).

A mixture file names its sources in order::

    seed: 0                      # optional: the sampling seed (default 0)
    sources:
      - name: chat               # unique; recorded as each row's ``dataset``
        path: sharegpt           # a file, a glob, an embedded name, or a list of them
        weight: 0.5              # expected copies of each row (default 1)
      - name: tools
        path: data/tools.jsonl
        limit: 2000              # read at most the first 2000 rows of this source
        chat_template: tools.jinja   # optional; replaces the tokenizer's (and --chat-template)
        format: openai           # optional; replaces --format for this source

Relative paths are taken from the mixture file's directory. TOML writes the same keys as
``[[sources]]`` tables.

**Weights** are sampling rates (docs/guide-data.md, "Mixtures"): a weight ``w`` keeps ``floor(w)`` copies of a
row plus one more with probability ``w - floor(w)``, drawn from ``(seed, name, r)`` (BLAKE2b) for row ``r`` of
source ``name``, so sharded runs draw the same rows. Copies after the first get the id ``ID*k`` (k >= 2) and the
source ``file:N*k``; a row of a later source is a duplicate only of copy k of an earlier one.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

from peagle_data.prepare.counts import Counts
from peagle_data.readers.rows import FORMATS, Conversation, Reject
from stores.errors import InputError

__all__ = ["MixtureSource", "Mixture", "load_mixture", "is_mixture_file", "sample_copies", "sample_items"]

_KEYS = {"name", "path", "weight", "limit", "chat_template", "format"}


@dataclass(frozen=True)
class MixtureSource:
    """One source of a mixture."""

    name: str
    """Unique name, the ``dataset`` of every row it gives."""
    inputs: tuple[str, ...]
    """Files, globs or embedded names (paths resolved against the mixture file's directory)."""
    weight: float = 1.0
    """Expected copies of each row (>= 0); see the module doc."""
    limit: int | None = None
    """Read at most this many rows of the source (usable or not); None reads all."""
    chat_template: str | None = None
    """A Jinja chat template file for this source, or None for the run's."""
    format: str | None = None
    """auto, openai or sharegpt for this source, or None for the run's --format."""


@dataclass(frozen=True)
class Mixture:
    """A parsed mixture file."""

    path: str
    sources: tuple[MixtureSource, ...]
    seed: int = 0

    def record(self) -> dict[str, Any]:
        """The mixture as recorded in a manifest (with each source template's sha256: ``merge`` compares
        the records of shard runs)."""
        return {"file": self.path, "seed": self.seed,
                "sources": [{"name": s.name, "inputs": list(s.inputs), "weight": s.weight, "limit": s.limit,
                             "chat_template": s.chat_template, "format": s.format,
                             **({"chat_template_sha256": _file_sha256(s.chat_template)} if s.chat_template else {})}
                            for s in self.sources]}


def _file_sha256(path: str) -> str | None:
    """sha256 hex digest of a source's chat template file (so shard runs that read another text differ)."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def is_mixture_file(path: str | os.PathLike) -> bool:
    """Whether an INPUT argument is a mixture file (``.yaml``, ``.yml`` or ``.toml``)."""
    return Path(str(path)).suffix.lower() in (".yaml", ".yml", ".toml")


def load_mixture(path: str | os.PathLike) -> Mixture:
    """Read and check a mixture file.

    Raises:
        InputError: unreadable or invalid file, an unknown key, a missing or repeated name, no
            path, a negative weight, a limit < 1, an unknown format (names the file and source).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # noqa: BLE001 - OSError, yaml.YAMLError, tomllib.TOMLDecodeError
        raise InputError(f"mixture {path}: cannot read it ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("sources"), list) or not data["sources"]:
        raise InputError(f"mixture {path}: expected a mapping with a non-empty 'sources' list")
    unknown = set(data) - {"sources", "seed"}
    if unknown:
        raise InputError(f"mixture {path}: unknown top-level keys {sorted(unknown)} (expected sources, seed)")
    seed = data.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise InputError(f"mixture {path}: seed must be an integer, got {seed!r}")
    sources = tuple(_source(path, i, entry) for i, entry in enumerate(data["sources"], 1))
    names = [s.name for s in sources]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise InputError(f"mixture {path}: source names must be unique, repeated: {repeated}")
    return Mixture(path=str(path), sources=sources, seed=seed)


def _source(path: Path, i: int, entry: Any) -> MixtureSource:
    where = f"mixture {path}: source {i}"
    if not isinstance(entry, dict):
        raise InputError(f"{where}: expected a mapping with name and path, got {entry!r}")
    unknown = set(entry) - _KEYS
    if unknown:
        raise InputError(f"{where}: unknown keys {sorted(unknown)} (expected {sorted(_KEYS)})")
    name = entry.get("name")
    if not isinstance(name, str) or not name.strip():
        raise InputError(f"{where}: 'name' must be a non-empty string")
    where = f"mixture {path}: source {name!r}"
    raw = entry.get("path")
    raw = [raw] if isinstance(raw, str) else raw
    if not raw or not all(isinstance(p, str) and p for p in raw):
        raise InputError(f"{where}: 'path' must be a file, glob or embedded name, or a list of them")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
        raise InputError(f"{where}: 'weight' must be a number >= 0, got {weight!r}")
    limit = entry.get("limit")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise InputError(f"{where}: 'limit' must be an integer >= 1 rows, got {limit!r}")
    fmt = entry.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise InputError(f"{where}: 'format' must be one of {', '.join(FORMATS)}, got {fmt!r}")
    template = entry.get("chat_template")
    if template is not None:
        template = str(_relative(path, template))
        if not Path(template).is_file():
            raise InputError(f"{where}: chat_template {template!r} is not a file")
    return MixtureSource(name=name, inputs=tuple(str(_relative(path, p)) for p in raw), weight=float(weight),
                         limit=limit, chat_template=template, format=fmt)


def _relative(mixture: Path, p: str) -> str | Path:
    """``p`` against the mixture file's directory, unless absolute or an embedded name (no separator,
    no extension, not an existing file)."""
    if os.path.isabs(p) or ("/" not in p and "." not in p and not Path(p).exists()):
        return p
    return mixture.parent / p


def sample_copies(seed: int, name: str, row: int, weight: float) -> int:
    """How many copies of row ``row`` (1-based) of source ``name`` a weight keeps (see the module doc)."""
    whole = math.floor(weight)
    frac = weight - whole
    if frac == 0.0:
        return int(whole)
    digest = hashlib.blake2b(f"{seed}\x00{name}\x00{row}".encode(), digest_size=8).digest()
    u = int.from_bytes(digest, "little") / 2.0**64
    return int(whole) + (u < frac)


def sample_items(items: Iterable[Conversation | Reject], seed: int, name: str, weight: float,
                 counts: Counts) -> Iterator[Conversation | Reject]:
    """Apply a source's weight to reader items (rejects pass once); ``counts`` gains ``sampled_out``
    (conversations drawn 0 times) and ``copies`` (extra copies)."""
    for row, item in enumerate(items, 1):
        if isinstance(item, Reject) or weight == 1.0:
            yield item
            continue
        k = sample_copies(seed, name, row, weight)
        if k == 0:
            counts.bump("sampled_out")
            continue
        yield item
        for copy in range(2, k + 1):
            counts.bump("copies")
            yield replace(item, conversation_id=f"{item.conversation_id}*{copy}", source=f"{item.source}*{copy}")
