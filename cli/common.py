"""Helpers shared by the click commands: error handling, config errors, JSON output."""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path

import click

from stores.errors import PeagleError
from stores.files import strict_json

__all__ = ["handle_errors", "echo_json", "config_error", "OutputPath"]


def handle_errors(fn):
    """Turn a PeagleError into ``Error: ...`` on stderr and exit code 2 (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PeagleError as e:
            click.echo(f"Error: {e}", err=True)
            sys.exit(2)

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
