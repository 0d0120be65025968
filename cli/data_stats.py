"""``peagle-data stats``: totals, distributions and per-source shares of a table or store."""

from __future__ import annotations

import click

from cli.options import config_file_options
from cli.common import echo_json, handle_errors

__all__ = ["stats"]


@click.command()
@click.argument("path", type=click.Path(exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
@click.option("--png", metavar="FILE", type=click.Path(dir_okay=False),
              help="Also write a PNG: length histogram, supervised fraction, windows, per-source shares.")
@click.option("--max-seq-len", metavar="N", type=click.IntRange(min=2), default=None,
              help="For a tokenize output: count the windows `pack --max-seq-len N` would cut.")
@click.option("--overlap", metavar="F", type=click.FloatRange(0.0, 1.0, max_open=True), default=0.5,
              show_default=True, help="The `pack --overlap` of those windows.")
@config_file_options
@handle_errors
def stats(path, as_json, png, max_seq_len, overlap):
    """Statistics of a tokenize output, a pack output or a feature store.

    Totals, token and supervised token counts, length percentiles, supervised fraction, windows per
    conversation, per-source breakdown, packing efficiency. Streams the Parquet files (polars lazy
    scans), so memory stays flat however many rows there are.
    """
    from peagle_data.stats import collect_stats, plot_stats

    result = collect_stats(path, max_seq_len=max_seq_len, overlap=overlap)
    if png:
        result["png"] = str(plot_stats(result, png))
    _echo_stats(result, as_json)


def _echo_stats(result: dict, as_json: bool) -> None:
    """Print the statistics as JSON or as text (and where the plot went)."""
    from peagle_data.stats import format_stats

    if as_json:
        echo_json(result)
        return
    click.echo(format_stats(result))
    if result.get("png"):
        click.echo(f"plot: {result['png']}")
