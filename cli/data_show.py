"""``peagle-data show``: print a tokenized row or packed block with its supervised tokens marked."""

from __future__ import annotations

import sys
import click

import peagle_data.inspect.show
from cli.common import OutputPath, config_error, handle_errors
from cli.options import config_file_options, config_options
from peagle_data.inspect.show import COLORS, ShowConfig

__all__ = ["show"]


_OVERRIDES = {
    "path": {"type": click.Path(exists=True, file_okay=False)},
    "row": {"type": click.IntRange(min=0), "metavar": "N"},
    "block": {"type": click.IntRange(min=0), "metavar": "N"},
    "item_id": {"decls": ["--id"], "metavar": "ID"},
    "tokenizer": {"metavar": "MODEL"},
    "color": {"type": click.Choice(COLORS)},
    "html": {"type": OutputPath(suffixes=(".html", ".htm")), "metavar": "FILE"},
}


@click.command()
@config_options(ShowConfig, arguments=("path",), overrides=_OVERRIDES)
@config_file_options
@handle_errors
def show(**options):
    """Show a tokenized row or packed block of PATH with its supervised tokens (loss 1) marked.

    Segment boundaries (the windows packed into a block; a row's system prefix) get their own
    line, and the decoded text of every supervised span is listed after the tokens.
    """
    with config_error():
        c = ShowConfig(**options)
    use_color = c.color == "always" or (c.color == "auto" and sys.stdout.isatty())
    click.echo(peagle_data.inspect.show.show(c.path, c.row, c.block, c.item_id, c.tokenizer, use_color, c.html, c.force), color=use_color)
    if c.html is not None:
        click.echo(f"html: {c.html}", err=True)
