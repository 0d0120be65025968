"""``peagle-data stats``: totals, distributions and per-source shares of a table or store."""

from __future__ import annotations

import click

import peagle_data.inspect.stats
from cli.common import OutputPath, config_error, echo_json, handle_errors
from cli.options import config_file_options, config_options
from peagle_data.inspect.stats import StatsConfig, format_stats
from peagle_data.inspect.stats_plot import PLOT_SUFFIXES, check_plot_output, plot_stats

__all__ = ["stats"]


_OVERRIDES = {
    "path": {"type": click.Path(exists=True)},
    "png": {"metavar": "FILE", "type": OutputPath(suffixes=PLOT_SUFFIXES)},
    "max_seq_len": {"metavar": "N", "type": click.IntRange(min=2)},
    "overlap": {"type": click.FloatRange(0.0, 1.0, max_open=True)},
}


@click.command()
@config_options(StatsConfig, arguments=("path",), overrides=_OVERRIDES)
@config_file_options
@handle_errors
def stats(**options):
    """Statistics of a tokenize output, a pack output or a feature store.

    Totals, token and supervised token counts, length percentiles, supervised fraction, windows per
    conversation, per-source breakdown, packing efficiency. Reads the table in a stream, so memory stays flat however
    many rows there are.
    """
    with config_error():
        cfg = StatsConfig(**options)
    if cfg.png:  # before the scan: an existing plot is refused at once
        check_plot_output(cfg.png, cfg.force)
    result = peagle_data.inspect.stats.collect_stats(cfg.path, max_seq_len=cfg.max_seq_len, overlap=cfg.overlap)
    _echo_stats(result, cfg.json, cfg.png and plot_stats(result, cfg.png, force=cfg.force))


def _echo_stats(result: dict, as_json: bool, png=None) -> None:
    """Print the statistics as JSON or as text (and where the plot ``png`` went, if one was written)."""
    if png:
        result["png"] = str(png)
    if as_json:
        echo_json(result)
        return
    click.echo(format_stats(result))
    if result.get("png"):
        click.echo(f"plot: {result['png']}")
