"""The picture of ``peagle-data stats``: a 2x2 figure of the statistics :func:`peagle_data.inspect.stats.collect_stats`
returns (lengths, supervised fractions, windows per conversation, per-source shares)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from peagle_data.inspect.stats import FRACTION_BINS
from stores.errors import InputError, OutputExistsError

__all__ = ["PLOT_SUFFIXES", "check_plot_output", "plot_stats"]

PLOT_SUFFIXES = (".png", ".svg", ".pdf")
"""The file types :func:`plot_stats` writes (matplotlib picks the format from the extension)."""


def check_plot_output(png: str | os.PathLike, force: bool = False) -> None:
    """Raise before any work when :func:`plot_stats` could not write ``png``.

    Raises:
        InputError: the extension is not one of :data:`PLOT_SUFFIXES`, or the directory is missing.
        OutputExistsError: ``png`` exists and ``force`` is false.
    """
    png = Path(png)
    if png.suffix.lower() not in PLOT_SUFFIXES:
        raise InputError(f"--png {png}: a plot is {', '.join(PLOT_SUFFIXES)}, not {png.suffix or 'a name without extension'!r}")
    if not png.absolute().parent.is_dir():
        raise InputError(f"--png {png}: the directory {png.absolute().parent} does not exist")
    if png.exists() and not force:
        raise OutputExistsError(str(png))


def plot_stats(stats: dict[str, Any], png: str | os.PathLike, force: bool = False) -> Path:
    """Write a 2x2 PNG: length histogram with p50/p90/p99, supervised fraction histogram, windows
    per conversation (segments per block for a store), per-source shares of tokens and supervised tokens.

    Returns:
        The PNG path.

    Raises:
        InputError, OutputExistsError: see :func:`check_plot_output` (checked before drawing).
    """
    check_plot_output(png, force)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), dpi=80)
    _plot_lengths(axes[0][0], stats)
    _plot_fractions(axes[0][1], stats)
    _plot_windows(axes[1][0], stats)
    _plot_sources(axes[1][1], stats)
    t = stats["totals"]
    fig.suptitle(f"{Path(stats['path']).name} ({stats['kind']}): {t['rows']:,} "
                 f"{'conversations' if stats['kind'] == 'tokenized' else 'blocks'}, {t['tokens']:,} tokens, "
                 f"{t['supervised_fraction']:.1%} supervised", fontsize=11)
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png)
    plt.close(fig)
    return png


def _plot_lengths(ax, stats) -> None:
    lengths = stats["lengths"]
    values, counts = np.asarray(lengths["values"]), np.asarray(lengths["counts"])
    title = "length"
    if len(values):
        cap = max(int(lengths["percentiles"]["p99"] * 1.25), 1)
        shown = values <= cap
        ax.hist(values[shown], bins=60, weights=counts[shown], color="#4477aa")
        if not shown.all():
            title += f" ({int(counts[~shown].sum()):,} above {cap:,} not shown; max {int(values.max()):,})"
        for name, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
            v = lengths["percentiles"][name]
            ax.axvline(v, color="#cc3311", linestyle=style, label=f"{name} {v}")
        ax.legend(fontsize=8)
    ax.set_xlabel(f"tokens per {lengths['of']}")
    ax.set_ylabel(f"{lengths['of']}s")
    ax.set_title(title, fontsize=10)


def _plot_fractions(ax, stats) -> None:
    sf = stats["supervised_fraction"]
    edges = np.linspace(0, 1, FRACTION_BINS + 1)
    ax.bar(edges[:-1], sf["histogram"], width=1 / FRACTION_BINS, align="edge", color="#228833")
    ax.set_xlabel(f"supervised fraction per {sf['of']}")
    ax.set_ylabel(f"{sf['of']}s")
    ax.set_title(f"supervision (overall {stats['totals']['supervised_fraction']:.3f})", fontsize=10)


def _plot_windows(ax, stats) -> None:
    w = stats.get("windows_per_conversation")
    hist, label = (w["histogram"], "windows per conversation") if w else (stats.get("segments_per_block"),
                                                                        "windows per block")
    title = "windows"
    if hist:
        ks = np.array([int(k) for k in hist])
        cs = np.array([hist[k] for k in hist])
        shown = ks <= 16
        ax.bar(ks[shown], cs[shown], color="#aa3377")
        ax.set_yscale("log")
        if not shown.all():
            title += f" ({int(cs[~shown].sum()):,} above 16 not shown; max {int(ks.max())})"
    else:
        ax.text(0.5, 0.5, "not known (give --max-seq-len)", ha="center", va="center", transform=ax.transAxes)
    if stats.get("packing"):
        label += f"  (packing efficiency {stats['packing']['efficiency']})"
    ax.set_xlabel(label)
    ax.set_title(title, fontsize=10)


def _plot_sources(ax, stats) -> None:
    sources = stats.get("sources")
    if not sources:
        ax.text(0.5, 0.5, "one source / not recorded", ha="center", va="center", transform=ax.transAxes)
        ax.set_title("sources", fontsize=10)
        return
    names = [Path(str(s["source"])).name[:24] for s in sources[:12]]
    y = np.arange(len(names))
    ax.barh(y - 0.2, [s["token_share"] for s in sources[:12]], height=0.4, label="tokens", color="#4477aa")
    ax.barh(y + 0.2, [s["loss_share"] for s in sources[:12]], height=0.4, label="supervised", color="#228833")
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("share")
    ax.legend(fontsize=8)
    ax.set_title("sources", fontsize=10)
