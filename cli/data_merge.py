"""``peagle-data merge``: join the outputs of a sharded tokenize, pack or extract run."""

from __future__ import annotations

from pathlib import Path

import click

from cli.options import config_file_options
from cli.common import echo_json, handle_errors

__all__ = ["merge"]


@click.command()
@click.argument("shards", metavar="SHARD...", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--output", metavar="PATH", required=True, type=click.Path(),
              help="The merged token table or feature store (must not exist unless --force).")
@click.option("--force", is_flag=True, help="Overwrite an existing output.")
@config_file_options
@handle_errors
def merge(shards, output, force):
    """Join the N shard outputs (--num-shards N, --shard-index 0..N-1) of one run into one.

    Token tables give one table whose manifest lists its shards; feature stores give one store equal
    to the unsharded extraction. Every shard must be given once. Check the result with
    `peagle-data verify OUTPUT`.
    """
    from stores.merge import merge_stores, merge_tables

    if _all_stores(shards):
        echo_json(merge_stores(list(shards), output, force=force))
    else:
        _echo_table_merge(merge_tables(list(shards), output, force=force), output)


def _all_stores(shards) -> bool:
    """True for feature stores, False for token tables; InputError for a mix."""
    from stores.errors import InputError

    is_store = [(Path(s) / "zarr.json").is_file() for s in shards]
    if any(is_store) and not all(is_store):
        raise InputError("merge SHARDs must be all token tables or all feature stores, not a mix")
    return all(is_store)


def _echo_table_merge(manifest: dict, output: str) -> None:
    """Print the merged table's counts and its path."""
    c = manifest["counts"]
    click.echo(f"merged {manifest['num_shards']} shards: {c.get('used', 0)} conversations used, "
               f"{c.get('tokens', 0)} tokens, {c.get('loss_tokens', 0)} supervised"
               + (f", {c['n_blocks']} blocks, packing efficiency {c['packing_efficiency']}" if "n_blocks" in c else ""))
    click.echo(f"output: {output}")
