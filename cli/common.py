"""Helpers shared by the click commands: error handling, config errors, JSON output."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import click

from stores.errors import DiskFullError, PeagleError
from stores.files import disk_full_error, is_disk_full, is_local, strict_json
from stores.output_lock import hold_output_lock
from stores.staging import check_output_apart

__all__ = ["peagle_version", "version_option", "handle_errors", "disk_full_message", "echo_json", "config_error", "OutputPath", "interrupted_message", "resume_command",
           "again_command", "Writes", "claim_output", "nothing_kept", "INTERRUPTED_EXIT"]

def peagle_version() -> str:
    """peagle's version from the installed package's metadata (``unknown (not installed)`` in a bare source tree)."""
    try:
        return importlib.metadata.version("peagle")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def version_option() -> click.Option:
    """``--version``: print ``PROGRAM, version V`` (click's message, peagle's version) and exit."""
    def show(ctx: click.Context, param, value) -> None:
        if value and not ctx.resilient_parsing:
            click.echo(f"{ctx.command_path}, version {peagle_version()}")
            ctx.exit()

    return click.Option(["--version"], is_flag=True, expose_value=False, is_eager=True, callback=show,
                        help="Show peagle's version and exit.")


INTERRUPTED_EXIT = 130
"""The exit status after Ctrl-C (128 + SIGINT, the shell's convention)."""

Kept = Callable[[str, list[str], dict[str, Any]], tuple[str, str]]
"""``(program, args, params) -> (what the output keeps, the command to run next)`` of one command
(:func:`handle_errors`); the command is :func:`resume_command`'s or :func:`again_command`'s."""


def again_command(program: str, args: list[str], force: bool = False) -> str:
    """``program args`` shell-quoted (``--resume`` dropped; with ``force``, ``--force`` added once): the
    invocation that runs an interrupted command again from the start."""
    kept = [a for a in args if a not in ("--force", "--resume")] if force else [a for a in args if a != "--resume"]
    return shlex.join([*shlex.split(program), *kept, *(["--force"] if force else [])])


def resume_command(program: str, args: list[str]) -> str:
    """``program args`` with ``--force`` dropped and ``--resume`` added (once), shell-quoted: the
    invocation that continues an interrupted run with the same settings."""
    kept = [a for a in args if a not in ("--force", "--resume")]
    return shlex.join([*shlex.split(program), *kept, "--resume"])


def nothing_kept(program: str, args: list[str], params: dict[str, Any]) -> tuple[str, str]:
    """The :data:`Kept` of a command that writes its output only at its end (or in a hidden directory
    renamed into place): nothing kept, run it again."""
    return "nothing: this command writes its output only when it finishes", again_command(program, args)


def _continuation(program: str, args: list[str], params: dict[str, Any], kept: Kept | None) -> tuple[str, str, str]:
    """``(what the output keeps, "resume with" | "run it again with", the exact command)`` of a stopped command."""
    try:
        what, command = (kept or nothing_kept)(program, args, params)
    except Exception as e:  # the output could not be read: say so rather than guess
        what, command = f"unknown: could not read the output ({type(e).__name__}: {e})", again_command(program, args)
    return what, ("resume with" if "--resume" in shlex.split(command) else "run it again with"), command


def interrupted_message(program: str, args: list[str], params: dict[str, Any], kept: Kept | None = None) -> str:
    """What Ctrl-C prints (:func:`handle_errors`): the command interrupted, what its output keeps and the
    exact command to run next (``resume with`` when it resumes, else ``run it again with``)."""
    what, verb, command = _continuation(program, args, params, kept)
    return f"Interrupted (Ctrl-C): {program}\n  kept: {what}\n  {verb}: {command}"


def disk_full_message(error: DiskFullError, program: str, args: list[str], params: dict[str, Any],
                      kept: Kept | None = None) -> str:
    """What a full disk prints (:func:`handle_errors`), one line: the disk (mount point, free bytes, the file being
    written), what the output keeps and the exact command to run once space is freed."""
    what, verb, command = _continuation(program, args, params, kept)
    return f"Error: {error}; kept: {what}; free space on {error.mount}, then {verb}: {command}"


def _invocation(ctx: click.Context | None) -> tuple[str, list[str], dict[str, Any]]:
    """``(command path, the command's own arguments, its resolved params)`` of the running command."""
    if ctx is None:
        return "the command", sys.argv[1:], {}
    depth = 0
    parent = ctx.parent
    while parent is not None:
        depth, parent = depth + 1, parent.parent
    return ctx.command_path, sys.argv[1 + depth:], dict(ctx.params)


@dataclass(frozen=True)
class Writes:
    """What a writing command writes and reads (:func:`handle_errors`'s ``writes``), by its parameters' names."""

    inputs: dict[str, str] = field(default_factory=dict)
    """``{parameter: what messages call it}`` of the paths it reads (``{"store": "--store"}``); a value may be one
    path, several or None."""
    output: str = "output"
    """The parameter holding its output path (None or a remote URL: nothing to claim)."""
    directory: bool = True
    """The output is a directory (a table, a store, a run), else one file (a report)."""


def _paths(value) -> list[str]:
    """A parameter's value as a list of paths (one path, several, or none)."""
    if value is None or value == "":
        return []
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]


@contextlib.contextmanager
def claim_output(writes: Writes, params: dict[str, Any], command: str):
    """What every writing command does first, before it touches anything (docs/guide-setup.md): refuse an output
    that is, contains or lies inside one of its inputs (:func:`stores.staging.check_output_apart`), then hold the
    output's lock for the whole run (:func:`stores.output_lock.hold_output_lock`; in a multi-process launch, rank
    0 holds it for all).

    Raises:
        InputError: the output overlaps an input.
        OutputLockedError: another run holds the output.
    """
    output = params.get(writes.output)
    if not output or not is_local(output):
        yield None
        return
    check_output_apart(output, {label: _paths(params.get(name)) for name, label in writes.inputs.items()},
                       directory=writes.directory)
    if os.environ.get("RANK", "0") != "0":
        yield None
        return
    with hold_output_lock(output, command) as lock:
        yield lock


def handle_errors(fn=None, *, kept: Kept | None = None, writes: Writes | None = None):
    """Turn a PeagleError into ``Error: ...`` on stderr and exit code 2 (no traceback), and Ctrl-C
    (KeyboardInterrupt) into what was kept and the exact command to run next (:func:`interrupted_message`;
    ``kept`` describes the command's output, default :func:`nothing_kept`) on stderr and exit code 130,
    instead of click's bare ``Aborted!``. A full disk (:class:`~stores.errors.DiskFullError`, or any
    ``OSError`` of ``ENOSPC``/``EDQUOT``, :func:`stores.files.is_disk_full`) is one line naming the disk and the
    command to run once space is freed (:func:`disk_full_message`), exit code 2.

    A writing command names what it writes and reads (``writes``, :class:`Writes`): before it runs, its output is
    claimed (:func:`claim_output`: the check that it is none of its inputs, and the lock held until it returns).

    Use as ``@handle_errors`` or ``@handle_errors(kept=describe, writes=Writes(...))``.
    """
    if fn is None:
        return functools.partial(handle_errors, kept=kept, writes=writes)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            if writes is None:
                return fn(*args, **kwargs)
            ctx = click.get_current_context(silent=True)
            with claim_output(writes, kwargs, ctx.command_path if ctx else fn.__name__):
                return fn(*args, **kwargs)
        except (DiskFullError, OSError) as e:
            if not is_disk_full(e):
                if isinstance(e, PeagleError):
                    click.echo(f"Error: {e}", err=True)
                    sys.exit(2)
                raise
            program, argv, params = _invocation(click.get_current_context(silent=True))
            full = disk_full_error(e, params.get("output") or params.get("store") or ".")
            click.echo(disk_full_message(full, program, argv, params, kept), err=True)
            sys.exit(2)
        except PeagleError as e:
            click.echo(f"Error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            if os.environ.get("RANK", "0") == "0":  # one message per launch (accelerate sets RANK per process)
                program, argv, params = _invocation(click.get_current_context(silent=True))
                click.echo(interrupted_message(program, argv, params, kept), err=True)
            sys.exit(INTERRUPTED_EXIT)

    return wrapper


def echo_json(obj) -> None:
    """Print ``obj`` on stdout as strict JSON (NonFiniteError, naming the keys, for a NaN or infinite value:
    ``NaN`` is not JSON, and a NaN metric printed as a number would read as a result)."""
    click.echo(strict_json(obj, "the command's JSON output", indent=2, default=str))


@contextlib.contextmanager
def config_error(kind: type[click.ClickException] = click.UsageError):
    """Turn the ``ValueError`` of a config dataclass's checks into a click usage error (exit code 2)."""
    try:
        yield
    except ValueError as e:
        raise kind(str(e)) from None


class OutputPath(click.Path):
    """An output path checked when the command line (or ``--config`` file) is parsed, before any work:
    its parent directory exists, and a file's name ends in one of ``suffixes``.

    Args:
        suffixes: the accepted extensions (lower case, with the dot); empty: any name.
        directory: the output is a directory (a store, a run directory) rather than a file.
    """

    def __init__(self, *, suffixes: tuple[str, ...] = (), directory: bool = False):
        super().__init__(file_okay=not directory, dir_okay=directory)
        self.suffixes = suffixes

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        path = Path(value)
        if self.suffixes and path.suffix.lower() not in self.suffixes:
            found = f"extension {path.suffix!r}" if path.suffix else "no extension"
            self.fail(f"{value} has {found}; the supported ones are {', '.join(self.suffixes)}", param, ctx)
        parent = path.absolute().parent
        if not parent.is_dir():
            what = "is not a directory" if parent.exists() else "does not exist (create it first)"
            self.fail(f"{value}: the parent directory {parent} {what}", param, ctx)
        return value
