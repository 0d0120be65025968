"""A model directory's identity: its content by part, never how the directory was made.

The identity (:func:`model_identity`) is a record of four parts, each a map from a name to a short hash:

- ``weights``: each weight file's size and its first and last ``sample_bytes`` (the safetensors header,
  which holds every tensor's name, dtype and shape, and the tensors at both ends), and a sharded
  checkpoint's ``weight_map``;
- ``config``: each field of ``config.json``, nested fields as dotted names (``text_config.hidden_size``);
- ``tokenizer``: each tokenizer file (``tokenizer.json`` by top-level key: ``model`` holds the vocabulary,
  ``added_tokens`` the added and special tokens; ``tokenizer_config.json`` and ``special_tokens_map.json``
  by field; ``vocab.json``, ``merges.txt``, ``tokenizer.model`` ... whole);
- ``chat_template``: each chat template by name (``default``), wherever it is kept
  (``chat_template.jinja``, ``chat_template.json``, ``tokenizer_config.json``).

Left out, because they say how a directory was made, not what the model computes
(:data:`NOT_CONTENT`): loader arguments (``local_files_only``, ``is_local``, ``cache_dir``, ...), paths
(``_name_or_path``, ``name_or_path``), versions (``transformers_version``) and every field whose name
starts with ``_``; also the config's ``dtype`` / ``torch_dtype``, since the weights part holds each
tensor's dtype (the safetensors header) and transformers writes the field under either name.
``generation_config.json`` (sampling defaults) and processor files are no part of it.

:func:`model_fingerprint` hashes the identity into 16 hex digits; :func:`legacy_model_fingerprint` is the
whole-file hash that :func:`compare_identity` uses for a store that records no identity (docs/design.md §2,
"The verifier's identity").
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

__all__ = ["NOT_CONTENT", "IDENTITY_PARTS", "strip_not_content", "model_identity", "identity_fingerprint",
           "model_fingerprint", "legacy_model_fingerprint", "identity_differences", "IdentityCheck",
           "compare_identity"]

NOT_CONTENT = frozenset({
    "transformers_version", "name_or_path", "dtype", "torch_dtype",
    "local_files_only", "is_local", "cache_dir", "revision", "token", "use_auth_token", "trust_remote_code",
    "force_download", "resume_download", "proxies", "subfolder", "gguf_file", "local_dir",
    "tokenizer_file", "vocab_file", "merges_file",
})
"""JSON fields that describe how a directory was loaded or saved (loader arguments, paths, versions), no
part of a model's identity; so is every field whose name starts with ``_``."""

IDENTITY_PARTS = ("weights", "config", "tokenizer", "chat_template")
"""The parts of :func:`model_identity`, in the order a difference is named."""

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_TOKENIZER_JSON_BY_FIELD = ("tokenizer_config.json", "special_tokens_map.json")
_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def _short(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _hash_value(value: Any) -> str:
    return _short(json.dumps(value, sort_keys=True, ensure_ascii=False).encode())


def strip_not_content(value: Any) -> Any:
    """``value`` (parsed JSON) without the :data:`NOT_CONTENT` fields and ``_``-fields, at every depth."""
    if isinstance(value, dict):
        return {k: strip_not_content(v) for k, v in value.items() if k not in NOT_CONTENT and not k.startswith("_")}
    if isinstance(value, list):
        return [strip_not_content(v) for v in value]
    return value


def _flatten(value: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted names -> leaf values (a list or an empty dict is a leaf)."""
    out: dict[str, Any] = {}
    for k, v in value.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _feed_sampled(h, path: Path, sample_bytes: int) -> None:
    """Feed ``h`` a weight file's size, then its first and last ``sample_bytes``."""
    size = path.stat().st_size
    h.update(str(size).encode())
    with open(path, "rb") as fh:
        h.update(fh.read(sample_bytes))
        if size > 2 * sample_bytes:
            fh.seek(size - sample_bytes)
            h.update(fh.read(sample_bytes))


def _sampled(path: Path, sample_bytes: int) -> str:
    """Size plus the first and last ``sample_bytes`` of a weight file."""
    h = hashlib.sha256()
    _feed_sampled(h, path, sample_bytes)
    return h.hexdigest()[:16]


def _weights(files: list[Path], sample_bytes: int) -> dict[str, str]:
    out = {f.name: _sampled(f, sample_bytes) for f in files if f.suffix in _WEIGHT_SUFFIXES}
    for f in files:
        if f.name.endswith(".index.json"):
            out[f"{f.name}:weight_map"] = _hash_value(json.loads(f.read_text()).get("weight_map"))
    return out


def _templates(directory: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """Every chat template by name: ``default`` and named ones (a list of ``{name, template}``)."""
    found: dict[str, Any] = {}

    def add(value: Any) -> None:
        if isinstance(value, str):
            found["default"] = value
        elif isinstance(value, list):
            found.update({t["name"]: t["template"] for t in value if isinstance(t, dict) and "name" in t})
        elif isinstance(value, dict):
            found.update(value)

    add(tokenizer_config.get("chat_template"))
    if (directory / "chat_template.json").is_file():
        add(json.loads((directory / "chat_template.json").read_text()).get("chat_template"))
    if (directory / "chat_template.jinja").is_file():
        found["default"] = (directory / "chat_template.jinja").read_text()
    extra = directory / "additional_chat_templates"
    if extra.is_dir():
        found.update({f.stem: f.read_text() for f in sorted(extra.glob("*.jinja"))})
    return {name: _hash_value(text) for name, text in found.items()}


def _is_tokenizer_file(f: Path) -> bool:
    name = f.name
    return (name.startswith("tokenizer") or name.startswith("vocab.") or name in ("special_tokens_map.json",
            "added_tokens.json", "merges.txt") or f.suffix in (".model", ".tiktoken"))


def _tokenizer(files: list[Path]) -> tuple[dict[str, str], dict[str, Any]]:
    """The tokenizer part, and ``tokenizer_config.json`` as read (for its chat template)."""
    out: dict[str, str] = {}
    tokenizer_config: dict[str, Any] = {}
    for f in files:
        if not _is_tokenizer_file(f):
            continue
        if f.suffix != ".json":
            out[f.name] = _short(f.read_bytes())
            continue
        data = json.loads(f.read_text())
        if f.name == "tokenizer_config.json":
            tokenizer_config = data
            data = {k: v for k, v in data.items() if k != "chat_template"}
        data = strip_not_content(data)
        if f.name in _TOKENIZER_JSON_BY_FIELD or (f.name == "tokenizer.json" and isinstance(data, dict)):
            out.update({f"{f.name}:{k}": _hash_value(v) for k, v in data.items()})
        else:
            out[f.name] = _hash_value(data)
    return out, tokenizer_config


def model_identity(directory: str | Path, sample_bytes: int = 1 << 20) -> dict[str, dict[str, str]]:
    """The identity record of a model directory (module docstring): ``{part: {name: 16-hex hash}}`` for
    each of :data:`IDENTITY_PARTS`. Reads the JSON and tokenizer files whole and of each weight file
    ``2 * sample_bytes`` bytes at most.

    Raises:
        json.JSONDecodeError: a malformed JSON file.
    """
    directory = Path(directory)
    files = sorted(f for f in directory.iterdir() if f.is_file() and not f.name.startswith("."))
    tokenizer, tokenizer_config = _tokenizer(files)
    config_file = directory / "config.json"
    config = strip_not_content(json.loads(config_file.read_text())) if config_file.is_file() else {}
    return {"weights": _weights(files, sample_bytes),
            "config": {k: _hash_value(v) for k, v in _flatten(config).items()},
            "tokenizer": tokenizer,
            "chat_template": _templates(directory, tokenizer_config)}


def identity_fingerprint(identity: Mapping[str, Any]) -> str:
    """16 hex digits: the hash of an identity record (:func:`model_identity`)."""
    return _hash_value({part: identity.get(part, {}) for part in IDENTITY_PARTS})


def model_fingerprint(directory: str | Path, sample_bytes: int = 1 << 20) -> str:
    """A short content hash of a model directory (the verifier identity a store records): 16 hex digits,
    :func:`identity_fingerprint` of :func:`model_identity`. Two directories of one model, however made
    or saved, share it; two models of one shape with different weights, config, tokenizer or chat
    template differ."""
    return identity_fingerprint(model_identity(directory, sample_bytes))


def legacy_model_fingerprint(directory: str | Path, sample_bytes: int = 1 << 20) -> str:
    """The whole-file hash stores recorded before they recorded an identity: every JSON and Jinja file
    but ``generation_config.json`` whole (loader arguments and versions included), and each weight file
    sampled as in :func:`model_identity`. 16 hex digits."""
    h = hashlib.sha256()
    for f in sorted(Path(directory).glob("*")):
        if f.name.startswith(".") or not f.is_file():
            continue
        if f.suffix in (".json", ".jinja"):
            if f.name == "generation_config.json":
                continue
            h.update(f.name.encode())
            h.update(f.read_bytes())
        elif f.suffix in _WEIGHT_SUFFIXES:
            h.update(f.name.encode())
            _feed_sampled(h, f, sample_bytes)
    return h.hexdigest()[:16]


_PART_WORDS = {"weights": "weights", "config": "config fields", "tokenizer": "tokenizer",
               "chat_template": "chat template"}


def identity_differences(recorded: Mapping[str, Any], have: Mapping[str, Any], most: int = 6) -> list[str]:
    """What differs between two identity records, part by part (:data:`IDENTITY_PARTS` order), e.g.
    ``["weights (model.safetensors)", "config field num_hidden_layers", "chat template (default)"]``; each
    part names at most ``most`` entries (then ``... and N more``). Empty when the records are equal."""
    out = []
    for part in IDENTITY_PARTS:
        old, new = recorded.get(part) or {}, have.get(part) or {}
        names = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        if not names:
            continue
        shown = [n + (" (recorded only)" if n not in new else " (here only)" if n not in old else "")
                 for n in names[:most]]
        more = f", ... and {len(names) - most} more" if len(names) > most else ""
        out.append(f"{_PART_WORDS[part]} ({', '.join(shown)}{more})")
    return out


@dataclass(frozen=True)
class IdentityCheck:
    """How a model directory compared with a recorded verifier (:func:`compare_identity`)."""

    same: bool
    """Whether it is the recorded model."""
    comparison: str
    """``"identity"`` (by part, the record holds an identity) or ``"legacy"`` (the record holds only a
    whole-file fingerprint: :func:`legacy_model_fingerprint`)."""
    recorded: str
    """The recorded fingerprint."""
    have: str
    """The directory's fingerprint computed the same way."""
    differences: tuple[str, ...]
    """The parts that differ (:func:`identity_differences`); empty for a legacy comparison."""

    def describe(self) -> str:
        """One clause for a message: what differs, or the legacy comparison and both hashes."""
        if self.comparison == "legacy":
            return (f"compared by the whole-file fingerprint the store recorded (an older store, with no "
                    f"identity by part): {self.have} vs the store's {self.recorded}; that hash also covers "
                    "loader arguments, paths and versions written into its JSON files, so a copy of the same model "
                    "saved elsewhere may differ only there")
        what = "; ".join(self.differences) or "the same parts, another fingerprint"
        return f"differs in {what} (fingerprint {self.have} vs the store's {self.recorded})"


def compare_identity(recorded: Mapping[str, Any], directory: str | Path) -> IdentityCheck:
    """Compare a model directory with a recorded verifier (a store's ``verifier`` attribute: its
    ``fingerprint`` and, when the store records one, its ``identity``).

    With an ``identity`` the fingerprints are compared (:func:`model_fingerprint`) and the differing parts
    named; without one (an older store), the directory's :func:`legacy_model_fingerprint` is compared with
    the recorded fingerprint.
    """
    want = str(recorded.get("fingerprint"))
    identity = recorded.get("identity")
    if not isinstance(identity, Mapping):
        have = legacy_model_fingerprint(directory)
        return IdentityCheck(have == want, "legacy", want, have, ())
    mine = model_identity(directory)
    have = identity_fingerprint(mine)
    return IdentityCheck(have == want, "identity", want, have,
                         tuple(identity_differences(identity, mine)) if have != want else ())
