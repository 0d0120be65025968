"""``peagle-data merge``: join the outputs of a sharded tokenize, pack or extract run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import click

import stores.merge
from cli.common import OutputPath, Writes, config_error, echo_json, handle_errors
from cli.options import config_file_options, config_options
from stores.errors import InputError
from stores.files import is_zarr_store

__all__ = ["MergeConfig", "merge"]


@dataclass(frozen=True, kw_only=True)
class MergeConfig:
    """Which shard outputs ``peagle-data merge`` joins, and where."""

    shards: Sequence[str]
    """The N shard outputs (shard_index 0..N-1 of num_shards N) of one tokenize, pack or extract run: all
    token tables or all feature stores, each given once."""
    output: str
    """The merged token table or feature store (must not exist unless --force)."""
    force: bool = field(default=False, metadata={"action": True})
    """Overwrite an existing output."""


@click.command()
@config_options(MergeConfig, arguments=("shards",), overrides={
    "shards": {"metavar": "SHARD...", "nargs": -1, "required": True, "type": click.Path(exists=True)},
    "output": {"type": OutputPath(directory=True)}})
@config_file_options
@handle_errors(writes=Writes({"shards": "SHARDS"}))
def merge(**options):
    """Join the N shard outputs (--num-shards N, --shard-index 0..N-1) of one run into one.

    Token tables give one table whose manifest lists its shards; feature stores give one store equal
    to the unsharded extraction. Every shard must be given once. Check the result with
    `peagle-data verify OUTPUT`.
    """
    with config_error():
        cfg = MergeConfig(**{**options, "shards": list(options["shards"])})
    _merge(cfg)


def _merge(cfg: MergeConfig) -> None:
    """Merge feature stores (print the JSON summary) or token tables (print their counts)."""
    if _all_stores(cfg.shards):
        echo_json(stores.merge.merge_stores(list(cfg.shards), cfg.output, force=cfg.force))
    else:
        _echo_table_merge(stores.merge.merge_tables(list(cfg.shards), cfg.output, force=cfg.force), cfg.output)


def _all_stores(shards) -> bool:
    """True for feature stores, False for token tables; InputError for a mix."""
    is_store = [is_zarr_store(s) for s in shards]
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
