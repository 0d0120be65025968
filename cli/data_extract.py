"""``peagle-data extract``, ``inspect`` and ``verify``."""

from __future__ import annotations

import sys
import click

from cli.common import OutputPath, config_error, echo_json, handle_errors
from cli.options import config_file_options, config_options, run_config
from peagle_data.extract.config import ATTN_IMPLEMENTATIONS, CONTEXTS, ENGINES, ExtractConfig
from peagle_data.extract.run import run_extract
import peagle_data.inspect.verify
from peagle_data.inspect.verify import EXIT_DAMAGED, EXIT_UNFINISHED, InspectConfig, VerifyConfig
from stores.feature_schema import STORAGE_DTYPES

__all__ = ["extract", "inspect_cmd", "verify"]


_EXTRACT_OVERRIDES = {
    "packed": {"type": click.Path(exists=True, file_okay=False), "metavar": "PACKED_DIR"},
    "verifier": {"metavar": "MODEL"},
    "output": {"type": OutputPath(directory=True)},
    "storage_dtype": {"type": click.Choice(STORAGE_DTYPES)},
    "compressor": {"type": click.Choice(["none", "zstd"]), "default": "none", "show_default": True,
                   "callback": lambda ctx, param, value: None if value in (None, "none") else value},
    "attn_implementation": {"type": click.Choice(ATTN_IMPLEMENTATIONS)},
    "num_shards": {"metavar": "N"},
    "engine": {"type": click.Choice(list(ENGINES))},
    "server": {"metavar": "URL"},
    "shared_storage": {"type": click.Path(file_okay=False), "metavar": "DIR"},
    "shard_index": {"metavar": "I"},
    "context": {"type": click.Choice(CONTEXTS)},
    "max_context": {"metavar": "TOKENS"},
}
"""What ExtractConfig's annotations cannot say: paths, choices (the library's tuples), ``none`` for no compressor."""


@click.command()
@config_options(ExtractConfig, skip=("writer_queue",), arguments=("packed",), overrides=_EXTRACT_OVERRIDES)
@config_file_options
@handle_errors
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
    found (or a table failed its checks); 3: unfinished, no damage (the message gives the resume command).
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
