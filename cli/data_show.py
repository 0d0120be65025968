"""``peagle-data show``: print a tokenized row or packed block with its supervised tokens marked."""

from __future__ import annotations

import sys
import click

from cli.options import config_file_options
from cli.common import handle_errors

__all__ = ["show"]


@click.command()
@click.argument("path", type=click.Path(exists=True, file_okay=False))
@click.option("--row", type=click.IntRange(min=0), default=None, metavar="N",
              help="Row N of a tokenized table (from 0; default 0); for a packed table, block N.")
@click.option("--block", type=click.IntRange(min=0), default=None, metavar="N",
              help="Block N of a packed table (its block_id, from 0).")
@click.option("--id", "item_id", default=None, metavar="ID",
              help="A conversation id (its per-turn rows ID@turn too), or a window id ID#k: the rows or blocks "
                   "that hold it.")
@click.option("--tokenizer", "tokenizer_name", default=None, metavar="MODEL",
              help="Tokenizer to decode with  [default: the one in the table's manifest]")
@click.option("--color", type=click.Choice(["auto", "always", "never"]), default="auto", show_default=True,
              help="Colour supervised tokens (auto: on a terminal); without colour they are [[bracketed]].")
@click.option("--html", "html_file", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Also write an HTML page with the supervised tokens highlighted.")
@click.option("--force", is_flag=True, help="Overwrite an existing --html FILE.")
@config_file_options
@handle_errors
def show(path, row, block, item_id, tokenizer_name, color, html_file, force):
    """Show a tokenized row or packed block of PATH with its supervised tokens (loss 1) marked.

    Segment boundaries (the windows packed into a block; a row's system prefix) get their own
    line, and the decoded text of every supervised span is listed after the tokens.
    """
    from peagle_data.show import show as show_text

    use_color = color == "always" or (color == "auto" and sys.stdout.isatty())
    click.echo(show_text(path, row, block, item_id, tokenizer_name, use_color, html_file, force), color=use_color)
    if html_file is not None:
        click.echo(f"html: {html_file}", err=True)
