"""The files of ``peagle-data regenerate``: OpenAI-messages JSONL, its rejects and its manifest.

An output ``OUT.jsonl`` comes with two sibling files:

- ``OUT.manifest.json``: the run's settings (inputs, back end, model, generation settings), its
  counts and ``complete`` (false while the run is going);
- ``OUT.rejects.jsonl``: one line ``{"source", "reason", "conversation_id"}`` per input row that
  could not be regenerated (no ``messages`` key, so ``tokenize`` never reads one as a conversation).

While a run is going its rows go to ``OUT.jsonl.partial``; the finished run renames it to
``OUT.jsonl``, so a killed run never leaves an ``OUT.jsonl`` that ``tokenize`` could read as if
it were whole. Every input row is written as exactly one line of the partial file or of the
rejects file, in input order, and each line is flushed: after a kill the lines on disk are a
prefix of the input. The manifest is rewritten after each chunk with the number of lines of both
files (a checkpoint); ``--resume`` cuts the files back to the last checkpoint
(:meth:`ConversationWriter.resume_at`), so the counts of the manifest stay exact.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from stores.errors import ForeignFilesError, InputError, OutputExistsError, StoreFormatError
from stores.staging import write_text_atomic

__all__ = ["ConversationWriter", "check_output", "foreign_files", "regenerate_paths", "read_regenerate_manifest"]


def regenerate_paths(output: str | os.PathLike) -> dict[str, Path]:
    """The files of one output: ``rows``, ``partial``, ``rejects``, ``manifest`` -> paths.

    Raises:
        InputError: ``output`` does not end in ``.jsonl``.
    """
    out = Path(output)
    if out.suffix != ".jsonl":
        raise InputError(f"--output {output}: expected a .jsonl file name (the regenerated conversations)")
    stem = out.with_suffix("")
    return {"rows": out, "partial": Path(f"{out}.partial"), "rejects": Path(f"{stem}.rejects.jsonl"),
            "manifest": Path(f"{stem}.manifest.json")}


def read_regenerate_manifest(output: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of ``output`` (see :func:`regenerate_paths`), or None when there is none.

    Raises:
        StoreFormatError: the manifest is not a JSON object.
    """
    path = regenerate_paths(output)["manifest"]
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise StoreFormatError(f"{path}: unreadable manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise StoreFormatError(f"{path}: the manifest is not a JSON object")
    return manifest


def _keep_lines(path: Path, n: int) -> list[dict[str, Any]]:
    """The first ``n`` JSON lines of ``path``; the file is cut after them (lines written after the
    last checkpoint, or a last line that a kill left unfinished, are removed).

    Raises:
        StoreFormatError: the file holds fewer than ``n`` complete lines, or lines that are not JSON.
    """
    if not path.exists():
        if n:
            raise StoreFormatError(f"{path} is missing but the manifest counts {n} lines in it; rerun with --force")
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")[:-1]  # the text after the last newline is unfinished
    if len(lines) < n:
        raise StoreFormatError(f"{path} holds {len(lines)} complete lines but the manifest counts {n}; "
                               "rerun with --force")
    end = sum(len(line) + 1 for line in lines[:n])
    if end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)
    try:
        return [json.loads(line) for line in lines[:n]]
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreFormatError(f"{path}: not a file this command wrote ({e}); rerun with --force") from None


def foreign_files(output: str | os.PathLike) -> list[Path]:
    """The files of ``output`` (:func:`regenerate_paths`) that this command did not write: without a manifest
    of ``kind: regenerated``, ``OUT.jsonl``, ``OUT.rejects.jsonl`` and ``OUT.manifest.json`` are a user's
    (``OUT.jsonl.partial`` is this command's name alone)."""
    paths = regenerate_paths(output)
    try:
        ours = (read_regenerate_manifest(output) or {}).get("kind") == "regenerated"
    except StoreFormatError:
        ours = False
    if ours:
        return []
    return [p for name, p in paths.items() if name != "partial" and (p.exists() or p.is_symlink())]


def check_output(output: str | os.PathLike, force: bool, resume: bool) -> None:
    """The check before a run writes ``output``: its files may be replaced (``force``) or continued
    (``resume``) only when they are this command's (:func:`foreign_files`).

    Raises:
        OutputExistsError: a file of ``output`` exists and neither ``force`` nor ``resume`` is set.
        ForeignFilesError: ``force`` or ``resume`` with files this command did not write (named).
        InputError: ``output`` is not a ``.jsonl`` name.
    """
    existing = [p for p in regenerate_paths(output).values() if p.exists()]
    if existing and not (force or resume):
        raise OutputExistsError(str(existing[0]), "pass --resume to continue it or --force to overwrite it")
    foreign = foreign_files(output)
    if existing and foreign:
        raise ForeignFilesError(str(output), [str(p) for p in foreign], "--output", ["regenerated conversations"])


class ConversationWriter:
    """Write (or continue) one regenerate output; see the module docstring for the files.

    Args:
        output: ``OUT.jsonl``.
        force: delete an existing output (all its files) first.
        resume: continue an unfinished output (its partial and rejects files are kept).

    Raises:
        OutputExistsError: a file of the output exists and neither ``force`` nor ``resume`` is set.
        ForeignFilesError: files of the output that this command did not write (:func:`check_output`).
    """

    def __init__(self, output: str | os.PathLike, force: bool = False, resume: bool = False):
        self.paths = regenerate_paths(output)
        check_output(output, force, resume)
        existing = [p for p in self.paths.values() if p.exists()]
        if force and not resume:
            for p in existing:
                p.unlink()
        self.paths["rows"].parent.mkdir(parents=True, exist_ok=True)
        self._rows = self._rejects = None

    def resume_at(self, n_rows: int, n_rejects: int) -> list[str]:
        """Cut the partial and rejects files back to the checkpoint the manifest records (``n_rows``
        and ``n_rejects`` lines) and return the ids of those rows (rows, then rejects).

        Raises:
            StoreFormatError: a file holds fewer lines than the checkpoint counts.
        """
        rows = _keep_lines(self.paths["partial"], n_rows)
        rejects = _keep_lines(self.paths["rejects"], n_rejects)
        return [r.get("id") for r in rows] + [r.get("conversation_id") for r in rejects]

    def open(self) -> None:
        """Open the partial and rejects files for appending (line buffered)."""
        self._rows = self.paths["partial"].open("a", encoding="utf-8", buffering=1)
        self._rejects = self.paths["rejects"].open("a", encoding="utf-8", buffering=1)

    def write_row(self, row: dict[str, Any]) -> None:
        """Append one regenerated conversation ``{"id", "messages", "tools"?}`` as a line."""
        self._rows.write(json.dumps(row, ensure_ascii=False) + "\n")

    def write_reject(self, source: str, reason: str, conversation_id: str | None) -> None:
        """Append one rejected input row (``reason`` starts with its key, e.g. ``empty answer: ...``)."""
        self._rejects.write(json.dumps({"source": source, "reason": reason, "conversation_id": conversation_id},
                                       ensure_ascii=False) + "\n")

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        """Write ``OUT.manifest.json`` atomically."""
        path = self.paths["manifest"]
        body = {"kind": "regenerated", "updated_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **manifest}
        write_text_atomic(path, json.dumps(body, indent=2, default=str) + "\n", encoding="utf-8")

    def close(self) -> None:
        """Close the files (safe to call twice)."""
        for f in (self._rows, self._rejects):
            if f is not None:
                f.close()
        self._rows = self._rejects = None

    def finish(self) -> None:
        """Close the files and rename the partial rows file to ``OUT.jsonl``."""
        self.close()
        os.replace(self.paths["partial"], self.paths["rows"])
