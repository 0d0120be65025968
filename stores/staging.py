"""Atomic writes (docs/design.md §6): every writer of peagle stages its output and renames it into place.

- :func:`staged_output_dir`: a command's output directory (token tables, merged stores) is built in
  a hidden sibling ``.NAME.partial-HOST-PID-XXXX`` renamed to ``NAME`` only when the command
  finishes, so a failed run leaves no half-written output behind; the directory of a killed run
  (SIGKILL) is removed by the next run writing the same output (:func:`remove_stale_partials`).
- :func:`replace_dir`: a directory written whole into ``.NAME.tmp`` then swapped in (checkpoints).
- :func:`fill_dir`: files written into a hidden temporary directory then moved into an existing
  directory (the model cache, filled in two steps).
- :func:`atomic_file` / :func:`write_text_atomic`: one file written as ``NAME.tmp`` then renamed
  (manifests, reports, training state).

``--force`` replaces only peagle's own output: :func:`ownership` is the one rule that says whether an output is
absent, peagle's or not, and :func:`check_replaceable` (:meth:`Ownership.refuse`) the one check every writer makes
through it before it removes or replaces an existing output. A directory is peagle's when the file that marks its kind
(:data:`OUTPUT_KINDS`: a token table's ``manifest.json``, a feature store's ``zarr.json``, a training run's
``train_config.json``) holds keys only peagle writes, and every file and directory below it, at any depth, is
one that kind writes (:func:`foreign_entries`); anything else (a user's ``notes.txt``, a ``README.md`` put in
``final/``) is foreign, and the run is refused naming it (:class:`~stores.errors.ForeignFilesError`), whatever
``--force`` says. :func:`check_output_apart` refuses an output that is, contains or lies inside an input.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from stores.errors import ForeignFilesError, InputError, OutputExistsError
from stores.files import disk_full_error, is_disk_full

__all__ = [
    "OutputKind",
    "OUTPUT_KINDS",
    "TABLE_KINDS",
    "RUN_CONFIG_KEYS",
    "foreign_entries",
    "ABSENT",
    "OURS",
    "FOREIGN",
    "Ownership",
    "ownership",
    "check_replaceable",
    "check_replaceable_file",
    "check_output_apart",
    "prepare_output_dir",
    "staged_output_dir",
    "remove_stale_partials",
    "restore_replaced_output",
    "replace_dir",
    "fill_dir",
    "atomic_file",
    "write_text_atomic",
]


@dataclass(frozen=True)
class OutputKind:
    """One kind of output directory peagle writes: the file that marks it and every path it writes below it.

    A directory is this kind's when its :attr:`marker` holds what only peagle writes there (:attr:`is_marker`);
    ``--force`` may then remove it only when every file and directory below it, at any depth, is one this kind
    writes (:func:`foreign_entries`)."""

    name: str
    """What the kind is called in messages (``token table``)."""
    marker: str
    """The file (a JSON object) that says peagle wrote the directory."""
    is_marker: Callable[[object], bool]
    """Whether the marker's JSON value is peagle's (its own keys, not merely a file of that name)."""
    files: tuple[str, ...]
    """The paths this kind writes, relative to the directory, ``/``-separated; each part an ``fnmatch`` pattern
    (``checkpoint-*/model.safetensors``); a last part ``**`` stands for anything below (trackers' own files)."""
    zarr_nodes: bool = False
    """The directory is a zarr v3 group: its sub-groups and arrays (a ``zarr.json`` each, an array's chunks under
    ``c/``) are this kind's too (:func:`_foreign_in_zarr_node`)."""
    new_nodes: tuple[str, ...] = ()
    """With :attr:`zarr_nodes`: while the group's ``attributes`` are empty (a store being created, or any user's
    zarr group), only the top-level zarr nodes of these names are this kind's."""
    kind_values: tuple[str, ...] = ()
    """For the record: the marker's ``kind`` values :attr:`is_marker` accepts (empty: no ``kind`` key)."""

    def marks(self, directory: Path) -> bool:
        """Whether ``directory``'s :attr:`marker` is a readable JSON value that :attr:`is_marker` accepts."""
        return self.is_marker(_marker_record(directory / self.marker))

    def new(self, directory: Path) -> bool:
        """Whether ``directory`` (one this kind marks) is a zarr group without attributes yet."""
        record = _marker_record(directory / self.marker) if self.zarr_nodes else None
        return isinstance(record, dict) and not record.get("attributes")


def _marker_record(path: Path):
    """The JSON value of the marker file ``path``, or None when it cannot be read (or is a link)."""
    if path.is_symlink():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None


TABLE_KINDS = ("tokenized", "packed")
"""The ``kind`` of a token table's manifest (stores/tables/token_tables.py's schemas)."""


def _is_table_manifest(record) -> bool:
    """A token table's ``manifest.json``: ``kind`` one of :data:`TABLE_KINDS` (another tool's manifest has a ``kind``
    too: ``Deployment``)."""
    return isinstance(record, dict) and record.get("kind") in TABLE_KINDS


def _is_store_group(record) -> bool:
    """A feature store's ``zarr.json``: a zarr group whose attributes hold ``peagle`` or ``peagle_stream``, or have
    none yet (a store being created; only the schema's arrays are then its, :attr:`OutputKind.new_nodes`)."""
    if not isinstance(record, dict) or record.get("node_type") != "group":
        return False
    attributes = record.get("attributes") or {}
    return isinstance(attributes, dict) and (not attributes or "peagle" in attributes or "peagle_stream" in attributes)


RUN_CONFIG_KEYS = {"data": "store", "model": "num_depths", "run": "output"}
"""A training run's ``train_config.json`` (peagle_train/train/config.py ``TrainConfig.to_dict``): these groups, each
holding this field; the flat form of earlier peagle versions holds the fields at its top level."""


def _is_run_config(record) -> bool:
    """A training run's ``train_config.json``: the grouped settings of peagle-train (:data:`RUN_CONFIG_KEYS`) or
    their flat form written by earlier versions (``store``, ``output``, ``num_depths`` at the top level)."""
    if not isinstance(record, dict):
        return False
    grouped = all(isinstance(record.get(g), dict) and k in record[g] for g, k in RUN_CONFIG_KEYS.items())
    return grouped or all(k in record for k in RUN_CONFIG_KEYS.values())


_TABLE_FILES = ("manifest.json", "manifest.json.tmp", "part-*.parquet", "rejects.jsonl", "token_freq.npy",
                ".windows-*.spill")
_CHECKPOINT_FILES = ("config.json", "model.safetensors", "training_state.pt", "training_state.pt.tmp",
                     "training_segments.npy")
_CHECKPOINT_DIRS = ("checkpoint-*", "final", ".checkpoint-*.tmp", ".checkpoint-*.old", ".final.tmp", ".final.old")

OUTPUT_KINDS = (
    # stores/tables/token_tables.py: part files, manifest.json (last), rejects.jsonl, token_freq.npy, and pack's
    # conversations/ sub-table (a tokenized table of the same files)
    OutputKind("token table", "manifest.json", _is_table_manifest,
               (*_TABLE_FILES, *(f"conversations/{f}" for f in _TABLE_FILES)), kind_values=TABLE_KINDS),
    # stores/features/feature_schema.py: a zarr v3 group whose attributes are peagle's (empty while being created)
    # and, streaming, stores/features/stream_heartbeat.py's stream_heartbeat/ (a group of ROLE.json files) and
    # stores/features/stream_plan.py's consumed.json in its stream group. A store
    # being created (attributes not written yet) holds only stores/features/feature_schema.py's arrays and the
    # contexts group (tests/stores/test_staging.py checks these names against the schema): a user's zarr group has
    # no attributes either, and is never replaced.
    OutputKind("feature store", "zarr.json", _is_store_group,
               ("stream_heartbeat/zarr.json", "stream_heartbeat/*.json", "stream_heartbeat/.*.tmp",
                "stream/consumed.json", "stream/.consumed.json.*.tmp"),
               zarr_nodes=True,
               new_nodes=("input_ids", "loss_mask", "position_ids", "n_tokens", "cu_seqlens", "aux_hidden",
                          "final_hidden", "aux_scale", "final_scale", "done", "token_freq", "window_views",
                          "segment_keys", "contexts", "stream")),
    # peagle_train/train: train_config.json first, then metrics, checkpoints (replace_dir: .NAME.tmp/.old, each
    # peagle_train/model/checkpoint.py's config.json, model.safetensors, training_state.pt), final/, the plot and
    # the trackers' own files under trackers/
    OutputKind("training run", "train_config.json", _is_run_config,
               ("train_config.json", "metrics.jsonl", "metrics.jsonl.tmp", "training.png", "trackers/**",
                *(f"{d}/{f}" for d in _CHECKPOINT_DIRS for f in _CHECKPOINT_FILES))),
)
"""Every kind of output directory peagle writes (the kinds ``--force`` may replace)."""


def _match(parts: tuple[str, ...], pattern: tuple[str, ...], prefix: bool) -> bool:
    """Whether ``parts`` (a path below the output) matches ``pattern`` part by part (``prefix``: is a directory on
    the way to a path that matches); a ``**`` part matches one or more parts."""
    for i, part in enumerate(parts):
        if i < len(pattern) and pattern[i] == "**":
            return True
        if i >= len(pattern) or not fnmatch.fnmatchcase(part, pattern[i]):
            return False
    return len(parts) < len(pattern) if prefix else len(parts) == len(pattern)


def _foreign_by_patterns(root: Path, rel: tuple[str, ...], patterns: list[tuple[str, ...]]) -> list[Path]:
    """The entries below ``root / rel`` (a directory of the output) that none of ``patterns`` names: a link, a
    file no pattern matches, a directory on the way to none (named once, not looked into)."""
    foreign = []
    for entry in sorted((root.joinpath(*rel)).iterdir()):
        parts = (*rel, entry.name)
        if entry.is_symlink():
            foreign.append(entry)
        elif entry.is_dir():
            if any(_match(parts, p, prefix=True) for p in patterns):
                foreign += _foreign_by_patterns(root, parts, patterns)
            else:
                foreign.append(entry)
        elif not any(_match(parts, p, prefix=False) for p in patterns):
            foreign.append(entry)
    return foreign


_CHUNK_NAME = re.compile(r"\d+(\.[0-9a-f]{32}\.partial)?")
"""A zarr v3 chunk key part (``c/0/3``), or the temporary name zarr's local store writes it under."""
_ZARR_META = re.compile(r"zarr(\.json|\.[0-9a-f]{32}\.partial)")
"""A node's ``zarr.json``, or the temporary name zarr's local store writes it under."""


def _foreign_in_chunks(directory: Path) -> list[Path]:
    """The entries below an array's ``c/`` that are no chunk key (digits, any depth)."""
    foreign = []
    for entry in sorted(directory.iterdir()):
        if entry.is_symlink() or not _CHUNK_NAME.fullmatch(entry.name):
            foreign.append(entry)
        elif entry.is_dir():
            foreign += _foreign_in_chunks(entry)
    return foreign


def _foreign_in_zarr_node(root: Path, directory: Path, patterns: list[tuple[str, ...]],
                          names: tuple[str, ...] = ()) -> list[Path]:
    """The entries below the zarr node ``directory`` (of the store ``root``) that are not the store's: a group holds
    its ``zarr.json`` and child nodes (of ``names`` only, when given), an array its ``zarr.json`` and its chunks
    under ``c/`` (a ``c`` file for a 0-d array); besides, the files and directories ``patterns`` name (relative to
    ``root``: the stream plan's cursor, the heartbeats). Anything else, a link, or a node of another type is
    foreign."""
    record = _marker_record(directory / "zarr.json")
    node_type = record.get("node_type") if isinstance(record, dict) else None
    foreign = []
    for entry in sorted(directory.iterdir()):
        rel = entry.relative_to(root).parts
        if entry.is_symlink():
            foreign.append(entry)
        elif entry.is_file() and (_ZARR_META.fullmatch(entry.name) or any(_match(rel, p, False) for p in patterns)):
            continue
        elif node_type == "array" and entry.name == "c":
            foreign += _foreign_in_chunks(entry) if entry.is_dir() else []
        elif (node_type == "group" and entry.is_dir() and (entry / "zarr.json").is_file()
              and (not names or entry.name in names)):
            foreign += _foreign_in_zarr_node(root, entry, patterns)
        elif entry.is_dir() and any(_match(rel, p, prefix=True) for p in patterns):
            foreign += _foreign_by_patterns(root, rel, patterns)
        else:
            foreign.append(entry)
    return foreign


def _foreign_in_kind(path: Path, kind: OutputKind) -> list[Path]:
    """The entries below ``path`` (a directory ``kind`` marks) that ``kind`` does not write, at any depth."""
    patterns = [tuple(p.split("/")) for p in kind.files]
    if not kind.zarr_nodes:
        return _foreign_by_patterns(path, (), patterns)
    return sorted(_foreign_in_zarr_node(path, path, patterns, kind.new_nodes if kind.new(path) else ()))


def foreign_entries(path: str | os.PathLike, kinds: tuple[OutputKind, ...] = OUTPUT_KINDS) -> list[Path]:
    """The paths under ``path`` that peagle did not write, sorted, at any depth: none for a missing or empty
    directory; ``[path]`` for a file (or link); in a directory, every entry when no kind of ``kinds`` marks it,
    else each file the marking kind does not write (``RUN/final/README.md``) and each directory on the way to
    none of its files (named, not looked into)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():
        return []
    if path.is_symlink() or not path.is_dir():
        return [path]
    for kind in kinds:
        if kind.marks(path):
            return _foreign_in_kind(path, kind)
    return sorted(path.iterdir())


ABSENT, OURS, FOREIGN = "absent", "ours", "foreign"
""":attr:`Ownership.state`: nothing at the path (missing, or an empty directory); a directory of one of the kinds
with only that kind's entries; anything else (a file, a link, a directory with an entry peagle did not write)."""


@dataclass(frozen=True)
class Ownership:
    """Whose an output path is (:func:`ownership`), read from the file system when first asked: whether something
    is there, then (only when asked: a large store has many files) which entries peagle did not write."""

    path: Path
    """The output path."""
    kinds: tuple[OutputKind, ...] = OUTPUT_KINDS
    """The kinds of output that may be replaced there."""

    @cached_property
    def present(self) -> bool:
        """Whether the path holds something (a non-empty directory, a file or a link)."""
        path = self.path
        return path.is_symlink() or (path.exists() and (not path.is_dir() or any(path.iterdir())))

    @cached_property
    def foreign(self) -> list[Path]:
        """The entries peagle did not write (:func:`foreign_entries`), sorted; none when absent."""
        return foreign_entries(self.path, self.kinds) if self.present else []

    @property
    def state(self) -> str:
        """:data:`ABSENT`, :data:`OURS` or :data:`FOREIGN`."""
        return ABSENT if not self.present else FOREIGN if self.foreign else OURS

    def refuse(self, force: bool, hint: str = "pass --force to overwrite it", option: str = "--output") -> bool:
        """The check before a writer removes or replaces the output (docs/design.md §6).

        Returns:
            True when the path holds something to replace (a non-empty directory or a file), False when it is
            missing or an empty directory.

        Raises:
            OutputExistsError: the path holds something and ``force`` is false (message ``hint``).
            ForeignFilesError: ``force`` is true but the path holds entries peagle did not write
                (:attr:`foreign`): they are named, and nothing is removed.
        """
        if not self.present:
            return False
        if not force:
            raise OutputExistsError(str(self.path), hint)
        if self.foreign:
            raise ForeignFilesError(str(self.path), [str(p) for p in self.foreign], option,
                                    [f"a {k.name} with its {k.marker}" for k in self.kinds])
        return True


def ownership(path: str | os.PathLike, kinds: tuple[OutputKind, ...] = OUTPUT_KINDS) -> Ownership:
    """The one rule for whose an output is: :data:`ABSENT`, :data:`OURS` (a directory one of ``kinds`` marks, holding
    only what that kind writes) or :data:`FOREIGN` (:class:`Ownership`)."""
    return Ownership(Path(path), tuple(kinds))


def check_replaceable(path: str | os.PathLike, force: bool,
                      hint: str = "pass --force to overwrite it",
                      kinds: tuple[OutputKind, ...] = OUTPUT_KINDS, option: str = "--output") -> bool:
    """The check before a writer removes or replaces an existing output ``path`` (docs/design.md §6):
    :meth:`Ownership.refuse` of :func:`ownership`.

    Returns:
        True when ``path`` holds something to replace (a non-empty directory or a file), False when it is
        missing or an empty directory.

    Raises:
        OutputExistsError: ``path`` holds something and ``force`` is false (message ``hint``).
        ForeignFilesError: ``force`` is true but ``path`` holds entries peagle did not write
            (:func:`foreign_entries`): they are named, and nothing is removed.
    """
    return ownership(path, kinds).refuse(force, hint, option)


def check_output_apart(output: str | os.PathLike, inputs: dict[str, list[str]], option: str = "--output",
                       directory: bool = True) -> None:
    """Refuse an output that is, contains or lies inside one of the command's inputs, compared by real path (links
    and ``..`` resolved): ``--force`` would remove the input, and a fresh run would write into it
    (``extract P --output P --force`` replaced the packed table it read). Made before anything is touched.

    Args:
        output: the output path (local; it need not exist).
        inputs: ``{option: [paths]}`` of what the command reads (``{"--store": [...]}``; a remote URL or a
            path that does not exist, e.g. a model hub name, is skipped).
        directory: the output is a directory; an output file (a report) is refused only when it is an input
            (written inside an input directory, it removes nothing of it).

    Raises:
        InputError: naming the option, both paths and how they overlap.
    """
    out = Path(os.path.realpath(output))
    for name, paths in inputs.items():
        for given in paths:
            if "://" in str(given) or not os.path.lexists(given):  # a URL, a hub name: nothing here to harm
                continue
            src = Path(os.path.realpath(given))
            how = ("is the input {} itself" if out == src else "contains the input {}" if out in src.parents
                   else "lies inside the input {}" if directory and src in out.parents else None)
            if how is not None:
                raise InputError(f"{output} {how.format(f'{name} {given}')}: the output would overwrite (with "
                                 f"--force, remove) what the command reads; give another {option}", field=option)


_MARKER_SCAN_BYTES = 1 << 20
"""How much of the start and of the end of a file :func:`check_replaceable_file` reads for its marker."""


def check_replaceable_file(path: str | os.PathLike, force: bool, marker: bytes, what: str, option: str,
                           hint: str = "pass --force to overwrite it") -> None:
    """The check before a command replaces the one file it writes (a plot, a page): it may replace only a file of
    its own, one holding ``marker`` (in its first or last MiB: a PNG's ``tEXt`` chunk, a PDF's ``/Creator``,
    an SVG's or HTML page's header).

    Raises:
        OutputExistsError: ``path`` exists and ``force`` is false (message ``hint``, the path shown as
            ``OPTION PATH``).
        ForeignFilesError: ``force`` with a ``path`` that lacks ``marker`` (a user's file, a link, a directory):
            nothing is removed.
    """
    path = Path(path)
    if not (path.exists() or path.is_symlink()):
        return
    if not force:
        raise OutputExistsError(f"{option} {path}", hint)
    ours = False
    if path.is_file() and not path.is_symlink():
        with path.open("rb") as f:
            head = f.read(_MARKER_SCAN_BYTES)
            size = f.seek(0, os.SEEK_END)
            f.seek(max(size - _MARKER_SCAN_BYTES, len(head)))
            ours = marker in head or marker in f.read()
    if not ours:
        raise ForeignFilesError(str(path), [str(path)], option, [what])


def prepare_output_dir(path: str | os.PathLike, force: bool) -> Path:
    """Create an empty output directory; refuse an existing non-empty one unless ``force``, and one that
    holds files peagle did not write even with ``force`` (:func:`check_replaceable`).

    Raises:
        OutputExistsError: ``path`` exists, is not empty, and ``force`` is false.
        ForeignFilesError: ``path`` holds files peagle did not write.
    """
    path = Path(path)
    if check_replaceable(path, force):
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
    path.mkdir(parents=True, exist_ok=True)
    return path


_STAGING_KINDS = ("partial", "old")


def _host_tag() -> str:
    """This host's name as it appears in staging directory names (no path separators)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64] or "localhost"


def _staging_prefix(path: Path, kind: str) -> str:
    return f".{path.name}.{kind}-"


def _pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (also when it belongs to another user)."""
    if pid <= 0:
        return True  # never a real owner: keep the directory
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by another user
        return True
    return True


def _dead_staging(path: Path, kind: str) -> list[tuple[Path, str]]:
    """``(entry, "HOST-PID")`` for each ``.NAME.KIND-HOST-PID-*`` of ``path`` whose process is gone
    (HOST this host, PID not alive), newest name first; an unreadable parent gives ``[]``."""
    prefix, host = _staging_prefix(path, kind), _host_tag()
    try:
        entries = sorted(path.parent.iterdir(), key=lambda e: e.name, reverse=True)
    except OSError:  # e.g. a parent we may write but not list
        return []
    dead = []
    for entry in entries:
        if not entry.name.startswith(prefix):
            continue
        owner = entry.name[len(prefix):].rsplit("-", 2)
        if len(owner) != 3 or owner[0] != host or not owner[1].isdigit() or _pid_alive(int(owner[1])):
            continue
        dead.append((entry, f"{owner[0]}-{owner[1]}"))
    return dead


def restore_replaced_output(path: str | os.PathLike) -> Path | None:
    """Put back the previous output of ``path`` when a ``--force`` run died between its two renames.

    :func:`staged_output_dir` replaces an output by renaming it to ``.NAME.old-HOST-PID-NS``, then
    renaming its finished staging directory ``.NAME.partial-HOST-PID-*`` to ``path``, then deleting
    the old copy. Only a run killed between the two renames leaves ``path`` missing with both hidden
    directories of one dead PID present: the old copy is then whole and is renamed back to ``path``
    (one line on stderr). An old copy without its partial was being deleted: it is left to
    :func:`remove_stale_partials`.

    Returns:
        The restored hidden directory's former path, or None.
    """
    path = Path(path)
    if path.exists() or path.is_symlink() or not path.parent.is_dir():
        return None
    partial_owners = {owner for _, owner in _dead_staging(path, "partial")}
    for entry, owner in _dead_staging(path, "old"):
        if owner not in partial_owners:
            continue
        try:
            os.rename(entry, path)
        except OSError:
            continue
        print(f"restored {path} from {entry.name}, left by a --force run killed while replacing it",
              file=sys.stderr)
        return entry
    return None


def remove_stale_partials(path: str | os.PathLike) -> list[Path]:
    """Remove the staging directories of ``path`` left by runs that were killed.

    :func:`staged_output_dir` names its hidden directories ``.NAME.partial-HOST-PID-XXXX`` (and,
    while replacing an output, ``.NAME.old-HOST-PID-NS``). One is stale when HOST is this host and
    no process PID exists any more; only those are removed (call :func:`restore_replaced_output`
    first, so an old copy that is the only one is put back rather than removed). Directories of a
    live process, of another host (a shared file system), or without an owner in their name (older
    peagle versions) are left alone. PIDs are those of this PID namespace: runs in containers that
    share a hostname and a volume but not a PID namespace must not write one output at a time.

    Returns:
        The removed directories.
    """
    path = Path(path)
    if not path.parent.is_dir():
        return []
    removed = []
    for kind in _STAGING_KINDS:
        for entry, _ in _dead_staging(path, kind):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:  # an output file or link being replaced by a killed --force run
                with contextlib.suppress(OSError):
                    entry.unlink()
            if not entry.exists() and not entry.is_symlink():
                removed.append(entry)
    return removed


@contextlib.contextmanager
def staged_output_dir(path: str | os.PathLike, force: bool) -> Iterator[Path]:
    """Build an output directory atomically: yield an empty hidden sibling directory
    (``.NAME.partial-HOST-PID-XXXX``), rename it to ``path`` when the block finishes, remove it
    when the block raises (``path`` is then left as it was).

    A previous output that a killed ``--force`` run left under its hidden name is restored first
    (:func:`restore_replaced_output`); staging directories of ``path`` left by killed runs on this
    host are then removed (:func:`remove_stale_partials`), with one line on stderr naming them.

    Raises:
        OutputExistsError: ``path`` exists, is not an empty directory, and ``force`` is false
            (checked before the block runs).
        ForeignFilesError: ``path`` holds files peagle did not write (:func:`check_replaceable`), also
            with ``force``.
        InputError: ``path`` is the current directory or one of its parents.
    """
    path = Path(os.path.abspath(path))  # "out/" names its directory; links are not followed
    cwd = Path.cwd()
    if path == cwd or path in cwd.parents:
        raise InputError(f"{path} is the current directory or contains it; the output is replaced by a "
                         "renamed directory, so name a new directory (e.g. ./out)", field="--output")
    restore_replaced_output(path)
    check_replaceable(path, force)
    path.parent.mkdir(parents=True, exist_ok=True)
    removed = remove_stale_partials(path)
    if removed:
        print(f"removed {len(removed)} stale partial output{'s' if len(removed) > 1 else ''} of killed runs "
              f"(their process is gone): {', '.join(str(p) for p in removed)}", file=sys.stderr)
    owner = f"{_host_tag()}-{os.getpid()}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{_staging_prefix(path, 'partial')}{owner}-", dir=path.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if path.exists() or path.is_symlink():
        old = path.parent / f"{_staging_prefix(path, 'old')}{owner}-{time.monotonic_ns()}"
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except OSError:
        if old is not None:  # put the previous output back; the new one stays in its staging dir
            with contextlib.suppress(OSError):
                os.rename(old, path)
        raise
    if old is not None:
        shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()


def replace_dir(directory: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp)`` on an empty sibling ``.NAME.tmp``, then swap it in place of ``directory``.

    An existing ``directory`` is renamed to ``.NAME.old`` for the swap and then deleted; leftovers of
    an earlier interrupted call under those names are removed first. When ``write`` raises,
    ``directory`` is left as it was and ``.NAME.tmp`` is removed.
    """
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        write(tmp)
    except BaseException as e:  # a full disk, a NaN refused: no half-written copy left beside the output
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e, directory.parent):  # torch.save's and safetensors' errors made a DiskFullError
            raise disk_full_error(e, directory) from e
        raise
    if directory.exists():
        old = directory.parent / f".{directory.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, directory)


def fill_dir(target: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp)`` on a hidden temporary directory beside ``target``, then move each file it
    wrote into ``target`` (created if needed; files of the same name are replaced, others kept).
    The temporary directory is removed whether ``write`` succeeds or raises."""
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.tmp") as tmp:
        write(Path(tmp))
        for f in Path(tmp).iterdir():
            os.replace(f, target / f.name)


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield ``NAME.tmp`` beside ``path`` to write; rename it to ``path`` when the block finishes
    (the parent directory must exist). A block that raises (a full disk) leaves ``path`` as it was and removes
    ``NAME.tmp``."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if is_disk_full(e, path.parent):
            raise disk_full_error(e, path) from e
        raise
    os.replace(tmp, path)


def write_text_atomic(path: str | os.PathLike, text: str, encoding: str | None = None) -> Path:
    """Write ``text`` to ``path`` through :func:`atomic_file`; returns ``path``."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding=encoding)
    return Path(path)
