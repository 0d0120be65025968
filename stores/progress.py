"""Progress bars of every long loop (tokenize, pack, regenerate, extract, train, eval): one place.

On a terminal a bar is tqdm's usual in-place bar. Written anywhere else (a log file, a pipe, a
notebook's captured stderr) tqdm would redraw the bar with carriage returns on one line, which a log
keeps as one line of tens of kilobytes; there :func:`progress` prints plain ASCII lines instead: the
first after :data:`LOG_INTERVAL_S` seconds, then at most one per :data:`LOG_INTERVAL_S`, and a final
one when the loop ends (a loop shorter than that prints nothing).
"""

from __future__ import annotations

import io
import sys
from typing import Any, Iterable, TextIO

__all__ = ["LOG_INTERVAL_S", "progress"]

LOG_INTERVAL_S = 30.0
"""Seconds between two progress lines when the bar's stream is not a terminal."""


class _Lines(io.TextIOBase):
    """A stream wrapper that writes each tqdm refresh (``"\\r" + status + padding``) as its own line."""

    def __init__(self, stream: TextIO):
        self.stream, self.last = stream, ""

    def write(self, s: str) -> int:
        text = s.replace("\r", "").strip()
        # tqdm's bare "\r"/"\n" (clearing, closing) and "" probes write nothing, nor does the
        # closing redraw of a count already written (only its [elapsed, rate] part differs)
        key = text.split("[", 1)[0]
        if text and key != self.last:
            self.stream.write(text + "\n")
            self.stream.flush()
            self.last = key
        return len(s)

    def flush(self) -> None:
        self.stream.flush()


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress(iterable: Iterable | None = None, *, file: TextIO | None = None, disable: bool | None = False,
             **kwargs: Any):
    """A tqdm bar on ``file`` (default stderr): in place on a terminal, sparse lines elsewhere.

    Args:
        iterable, kwargs: as ``tqdm(iterable, **kwargs)`` (``desc``, ``total``, ``unit``, ``initial``).
        file: the stream; whether it is a terminal picks the mode.
        disable: True: no output at all (e.g. not the main process). None is False here: unlike
            tqdm's None, a non-terminal stream gets its sparse lines rather than nothing.

    Returns:
        A ``tqdm.tqdm`` (iterate it, or ``update``/``set_postfix``/``close``; usable as a context manager).
    """
    file = sys.stderr if file is None else file
    if _is_terminal(file):
        from tqdm.auto import tqdm

        return tqdm(iterable, file=file, disable=bool(disable), **kwargs)
    from tqdm import tqdm

    kwargs.pop("dynamic_ncols", None)
    return tqdm(iterable, file=_Lines(file), disable=bool(disable), mininterval=LOG_INTERVAL_S,
                delay=LOG_INTERVAL_S, ascii=True, **kwargs)
