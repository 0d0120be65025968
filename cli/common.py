"""Helpers shared by the click commands: error handling, config errors, JSON output."""

from __future__ import annotations

import contextlib
import functools
import json
import sys

import click

from stores.errors import PeagleError

__all__ = ["handle_errors", "echo_json", "config_error"]


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
    click.echo(json.dumps(obj, indent=2, default=str))


@contextlib.contextmanager
def config_error(kind: type[click.ClickException] = click.UsageError):
    """Turn the ``ValueError`` of a config dataclass's checks into a click usage error (exit code 2)."""
    try:
        yield
    except ValueError as e:
        raise kind(str(e)) from None
