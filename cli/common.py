"""Helpers shared by the click commands: error handling and integer-list options."""

from __future__ import annotations

import contextlib
import functools
import json
import sys

import click

from stores.errors import PeagleError

__all__ = ["handle_errors", "parse_int_list", "echo_json", "config_error"]


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


def parse_int_list(ctx, param, value: str | None) -> list[int] | None:
    """click callback: ``"2,18,33"`` -> ``[2, 18, 33]``."""
    if value is None:
        return None
    parts = [v.strip() for v in value.split(",")]
    try:
        if not parts or any(p == "" for p in parts):
            raise ValueError
        return [int(v) for v in parts]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers such as 2,18,33, got {value!r}") from None


def echo_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


@contextlib.contextmanager
def config_error(kind: type[click.ClickException] = click.UsageError):
    """Turn the ``ValueError`` of a config dataclass's checks into a click usage error (exit code 2)."""
    try:
        yield
    except ValueError as e:
        raise kind(str(e)) from None
