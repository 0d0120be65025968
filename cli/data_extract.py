"""``peagle-data extract``, ``inspect`` and ``verify``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from cli.common import OutputPath, Writes, again_command, config_error, echo_json, handle_errors, resume_command
from cli.options import config_file_options, config_options, run_config
from peagle_data.extract.config import ATTN_IMPLEMENTATIONS, CONTEXTS, ENGINES, ExtractConfig
from peagle_data.extract.contexts import PACKINGS
from peagle_data.extract.run import run_extract
import peagle_data.inspect.verify
from peagle_data.inspect.verify import EXIT_DAMAGED, EXIT_UNFINISHED, InspectConfig, VerifyConfig
from stores.features.feature_schema import STORAGE_DTYPES
from stores.features.feature_store import FeatureStore

__all__ = ["extract", "inspect_cmd", "verify", "kept_blocks"]


_EXTRACT_OVERRIDES = {
    "packed": {"type": click.Path(exists=True, file_okay=False), "metavar": "PACKED_DIR"},
    "output": {"type": OutputPath(directory=True)},
    "storage_dtype": {"type": click.Choice(STORAGE_DTYPES)},
    "compressor": {"type": click.Choice(["none", "zstd"]), "default": "none", "show_default": True,
                   "callback": lambda ctx, param, value: None if value in (None, "none") else value},
    "attn_implementation": {"type": click.Choice(ATTN_IMPLEMENTATIONS)},
    "engine": {"type": click.Choice(list(ENGINES))},
    "server": {"metavar": "URL"},
    "shared_storage": {"type": click.Path(file_okay=False), "metavar": "DIR"},
    "context": {"type": click.Choice(CONTEXTS)},
    "context_packing": {"type": click.Choice(PACKINGS)},
}
"""What ExtractConfig's annotations cannot say: paths, choices (the library's tuples), ``none`` for no compressor."""


def kept_blocks(program: str, args: list[str], params: dict[str, Any]) -> tuple[str, str]:
    """After Ctrl-C (cli.common.handle_errors): the blocks the store keeps, and ``--resume``, which extracts
    the others (a block is done only once its data is written)."""
    store = params.get("output")
    if not store or not Path(store).exists():
        return f"nothing: the store {store} was not created yet", again_command(program, args)
    opened = FeatureStore.open(store)
    done = int(opened.done_mask().sum())
    return f"{store}: {done} of {opened.n_blocks} blocks extracted", resume_command(program, args)


@click.command()
@config_options(ExtractConfig, skip=("writer_queue",), arguments=("packed",), overrides=_EXTRACT_OVERRIDES)
@config_file_options
@handle_errors(kept=kept_blocks, writes=Writes({"packed": "PACKED", "verifier": "--verifier"}))
def extract(**options):
    """Run the verifier over PACKED_DIR and write hidden states into a feature store."""
    with config_error():
        cfg = ExtractConfig(**options)
    echo_json(run_extract(cfg, log=lambda m: click.echo(m, err=True), config=run_config()))


@click.command()
@config_options(InspectConfig, arguments=("path",), overrides={"path": {"type": click.Path(exists=True)}})
@config_file_options
@handle_errors
def inspect_cmd(**options):
    """Describe a token table or a feature store, as JSON."""
    with config_error():
        cfg = InspectConfig(**options)
    echo_json(peagle_data.inspect.verify.inspect_output(cfg.path))  # JSON, like verify: scripts parse it


@click.command()
@config_options(VerifyConfig, arguments=("store",), overrides={
    "store": {"type": click.Path(exists=True)}, "packed": {"type": click.Path(exists=True, file_okay=False)}})
@config_file_options
@handle_errors
def verify(**options):
    """Check a feature store: shapes, dtypes, done flags, chunk files, checksums, NaN/Inf, token ids.

    STORE may also be a token table: its totals and unique row sources / window ids, and for a
    table made by `peagle-data merge` the union of its shards. Exit code 0: complete and intact; 1: damage
    found (or a table failed its checks); 2: not readable (no such path, or neither a store nor a table);
    3: unfinished, no damage (the message gives the resume command).
    """
    with config_error():
        cfg = VerifyConfig(**options)
    report, failure = peagle_data.inspect.verify.verify_output(cfg.store, packed=cfg.packed, repair=cfg.repair)
    echo_json(report)
    if failure is not None:
        click.echo(f"Error: {failure}", err=True)
        sys.exit(EXIT_UNFINISHED if report.get("state") == "unfinished" else EXIT_DAMAGED)


if __name__ == "__main__":  # `python -m cli.data_extract` (used by accelerate launch -m in tests)
    extract()
