"""``peagle-data show``: print a tokenized row or packed block with its supervised tokens marked."""

from __future__ import annotations

import sys
from pathlib import Path

import click

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
@handle_errors
def show(path, row, block, item_id, tokenizer_name, color, html_file, force):
    """Show a tokenized row or packed block of PATH with its supervised tokens (loss 1) marked.

    Segment boundaries (the windows packed into a block; a row's system prefix) get their own
    line, and the decoded text of every supervised span is listed after the tokens.
    """
    from peagle_data.show import render_html, render_text, select_items
    from stores.errors import InputError, OutputExistsError
    from stores.model_cache import load_tokenizer
    from stores.token_tables import TokenTable

    if sum(x is not None for x in (row, block, item_id)) > 1:
        raise click.UsageError("give at most one of --row, --block and --id")
    if html_file is not None and Path(html_file).exists() and not force:
        raise OutputExistsError(f"--html {html_file} exists; pass --force to overwrite it")
    table = TokenTable.open(path)
    if block is not None and table.kind != "packed":
        raise click.UsageError(f"--block needs a packed table; {path} is a {table.kind} table (use --row)")
    items = select_items(table, block if block is not None else row, item_id)
    recorded = table.manifest.get("tokenizer", {})
    tokenizer = load_tokenizer(tokenizer_name or recorded.get("name"))
    if recorded.get("vocab_size") not in (None, len(tokenizer)):
        raise InputError(f"--tokenizer {tokenizer_name}: {len(tokenizer)} tokens, but {path} was made with "
                         f"{recorded.get('name')} ({recorded['vocab_size']} tokens)")
    use_color = color == "always" or (color == "auto" and sys.stdout.isatty())
    click.echo("\n\n".join(render_text(item, tokenizer, use_color) for item in items), color=use_color)
    if html_file is not None:
        Path(html_file).write_text(render_html(items, tokenizer), encoding="utf-8")
        click.echo(f"html: {html_file}", err=True)
