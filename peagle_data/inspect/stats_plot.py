"""The picture of ``peagle-data stats``: the statistics :func:`peagle_data.inspect.stats.collect_stats` returns
(lengths, supervised fractions, windows per conversation, per-source shares), one panel each that shows something."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from peagle_data.inspect.stats import FRACTION_BINS, KIND_NAMES
from stores.errors import InputError
from stores.staging import check_replaceable_file

__all__ = ["PLOT_SUFFIXES", "check_plot_output", "plot_stats", "plot_title", "panels"]

PLOT_SUFFIXES = (".png", ".svg", ".pdf")
"""The file types :func:`plot_stats` writes (matplotlib picks the format from the extension)."""
PLOT_CREATOR = "peagle-data stats"
"""The plot's creator in its metadata (PNG ``Software``, SVG and PDF ``Creator``): how ``--force`` tells a plot of
its own from another file (:func:`stores.staging.check_replaceable_file`)."""


def check_plot_output(png: str | os.PathLike, force: bool = False) -> None:
    """Raise before any work when :func:`plot_stats` could not write ``png``.

    Raises:
        InputError: the extension is not one of :data:`PLOT_SUFFIXES`, or the directory is missing.
        OutputExistsError: ``png`` exists and ``force`` is false.
        ForeignFilesError: ``force`` with a ``png`` that is no plot of this command's (:data:`PLOT_CREATOR`).
    """
    png = Path(png)
    if png.suffix.lower() not in PLOT_SUFFIXES:
        raise InputError(f"--png {png}: a plot is {', '.join(PLOT_SUFFIXES)}, not {png.suffix or 'a name without extension'!r}")
    if not png.absolute().parent.is_dir():
        raise InputError(f"--png {png}: the directory {png.absolute().parent} does not exist")
    check_replaceable_file(png, force, PLOT_CREATOR.encode(), "a plot of peagle-data stats", "--png")


def plot_stats(stats: dict[str, Any], png: str | os.PathLike, force: bool = False) -> Path:
    """Write a PNG of the panels that show something: the length histogram with p50/p90/p99 and the
    supervised fraction histogram always; windows per conversation (segments per block for a store) when they
    take two values or more; per-source shares of tokens and supervised tokens when there are two sources or
    more. A panel left out (one value, one source, not known) is said in a line under the title instead of
    drawn empty or as one bar (:func:`panels`).

    Returns:
        The PNG path.

    Raises:
        InputError, OutputExistsError, ForeignFilesError: see :func:`check_plot_output` (checked before drawing).
    """
    check_plot_output(png, force)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn, notes = panels(stats)
    rows, cols = (1, len(drawn)) if len(drawn) <= 3 else (2, 2)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows + 0.4 * bool(notes)), dpi=80, squeeze=False)
    for ax, draw in zip(axes.flat, drawn):
        draw(ax, stats)
    title = plot_title(stats)
    fig.suptitle("\n".join([title, "; ".join(notes)] if notes else [title]), fontsize=11)
    fig.tight_layout()
    png = Path(png)
    fig.savefig(png, metadata={"Software" if png.suffix.lower() == ".png" else "Creator": PLOT_CREATOR})
    plt.close(fig)
    return png


def plot_title(stats: dict[str, Any]) -> str:
    """The plot's title: ``NAME (WHAT): N conversations|blocks, T tokens, F supervised`` (``packed (pack output):
    90 blocks, ...``), WHAT from :data:`KIND_NAMES`, so a directory named after its kind repeats no word."""
    t = stats["totals"]
    what = KIND_NAMES.get(stats["kind"], stats["kind"])
    return (f"{Path(stats['path']).name} ({what}): {t['rows']:,} "
            f"{'conversations' if stats['kind'] == 'tokenized' else 'blocks'}, {t['tokens']:,} tokens, "
            f"{t['supervised_fraction']:.1%} supervised")


def panels(stats: dict[str, Any]) -> tuple[list, list[str]]:
    """``(the panel functions to draw, the facts said instead of a panel)`` for :func:`plot_stats`."""
    drawn, notes = [_plot_lengths, _plot_fractions], []
    hist, label = _windows(stats)
    if hist and len(hist) > 1:
        drawn.append(_plot_windows)
    elif hist:
        (k, n), = hist.items()
        notes.append(f"{label}: {k} for all {int(n):,}")
    else:
        notes.append(f"{label}: not known (give --max-seq-len)")
    if stats.get("packing"):
        notes.append(f"packing efficiency {stats['packing']['efficiency']}")
    sources = stats.get("sources") or []
    if len(sources) > 1:
        drawn.append(_plot_sources)
    elif sources:
        notes.append(f"one source: {Path(str(sources[0]['source'])).name}")
    else:
        notes.append("sources: one, or not recorded")
    return drawn, notes


def _windows(stats) -> tuple[dict | None, str]:
    """The windows histogram (``{count: rows}``) and what it counts."""
    w = stats.get("windows_per_conversation")
    return (w["histogram"], "windows per conversation") if w else (stats.get("segments_per_block"),
                                                                  "windows per block")


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
    hist, label = _windows(stats)
    title = "windows"
    ks = np.array([int(k) for k in hist])
    cs = np.array([hist[k] for k in hist])
    shown = ks <= 16
    ax.bar(ks[shown], cs[shown], color="#aa3377")
    ax.set_yscale("log")
    if not shown.all():
        title += f" ({int(cs[~shown].sum()):,} above 16 not shown; max {int(ks.max())})"
    ax.set_xlabel(label)
    ax.set_title(title, fontsize=10)


def _plot_sources(ax, stats) -> None:
    sources = stats["sources"]
    names = [Path(str(s["source"])).name[:24] for s in sources[:12]]
    y = np.arange(len(names))
    ax.barh(y - 0.2, [s["token_share"] for s in sources[:12]], height=0.4, label="tokens", color="#4477aa")
    ax.barh(y + 0.2, [s["loss_share"] for s in sources[:12]], height=0.4, label="supervised", color="#228833")
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("share")
    ax.legend(fontsize=8)
    ax.set_title("sources", fontsize=10)
