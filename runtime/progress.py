"""Progress of every long loop (tokenize, pack, regenerate, extract, train, eval): one place, one convention.

On a terminal a bar is tqdm's usual in-place bar. Written anywhere else (a log file, a pipe, a
notebook's captured stderr) :func:`progress` prints plain ASCII lines instead (:class:`LogLines`), bounded:
a line needs both :data:`LOG_INTERVAL_S` seconds since the last one and, when the total is known, another
``1/`` :data:`MAX_LOG_LINES` of it done (a line every 4% at most), so a loop prints at most :data:`MAX_LOG_LINES` lines
however slow its items. With no total
the interval doubles after each :data:`MAX_LOG_LINES` lines. Whatever the loop updates in between (a step, a
postfix) prints nothing by itself. One final line always ends the loop,
``DESC: done: N/TOTAL UNIT in ELAPSED (RATE UNIT/s), POSTFIX`` (``stopped:`` instead of ``done:`` when
an exception, Ctrl-C included, ends it), also for a loop shorter than the interval.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Iterable, Iterator, TextIO

__all__ = ["LOG_INTERVAL_S", "MAX_LOG_LINES", "LogLines", "progress"]

LOG_INTERVAL_S = 30.0
"""Seconds between two progress lines (at least) when the bar's stream is not a terminal."""
MAX_LOG_LINES = 25
"""The most progress lines of one loop of known total on a stream that is not a terminal, besides its final line
(a line every ``100 / MAX_LOG_LINES`` = 4% of the total at most)."""


def _duration(seconds: float) -> str:
    """``1h02m03s`` / ``2m03s`` / ``4.2s``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class LogLines:
    """The progress of a loop as plain lines on a stream that is not a terminal (the module's convention).

    It has the part of ``tqdm``'s interface the loops use: iterate it, ``update(n)``,
    ``set_postfix(**kwargs)`` / ``set_postfix_str(s)`` (kept for the next line, never a line by
    itself), ``close()``, and use as a context manager.

    Args:
        iterable: the loop's items (optional; else call :meth:`update`).
        file: the stream.
        desc: the name starting each line (``extract``, ``peagle-train``).
        total: the number of items, or None when unknown.
        initial: items already done (a resumed run).
        unit: the items' unit (``block``, ``step``, ``tok``).
        disable: True: no output at all.
        interval: seconds between two lines at least (default :data:`LOG_INTERVAL_S`; doubled after every
            :data:`MAX_LOG_LINES` lines of a loop with no total).
        max_lines: the most lines before the final one for a known total (default :data:`MAX_LOG_LINES`).
    """

    def __init__(self, iterable: Iterable | None = None, *, file: TextIO, desc: str = "", total: int | None = None,
                 initial: int = 0, unit: str = "it", disable: bool = False, interval: float | None = None,
                 max_lines: int | None = None, **_ignored: Any):
        if total is None and iterable is not None and hasattr(iterable, "__len__"):
            total = len(iterable)
        self.iterable, self.file, self.desc, self.total, self.unit = iterable, file, desc, total, unit
        self.n = self.initial = int(initial)
        self.disable = bool(disable)
        self.interval = LOG_INTERVAL_S if interval is None else float(interval)
        self.max_lines = MAX_LOG_LINES if max_lines is None else max(1, int(max_lines))
        self.lines = 0
        self.last_n = self.n
        self.postfix = ""
        self.start = self.last = time.monotonic()
        self.closed = False

    # ---------------------------------------------------------------------------- tqdm's interface
    def __iter__(self) -> Iterator:
        try:
            for item in self.iterable:
                yield item
                self.update(1)
        finally:
            self.close()

    def __enter__(self) -> "LogLines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        """Count ``n`` more items; print a line when :meth:`_due` (the interval has passed, and the next
        ``1/max_lines`` of a known total is done)."""
        self.n += int(n)
        now = time.monotonic()
        if not self.disable and self._due(now):
            self.last, self.last_n, self.lines = now, self.n, self.lines + 1
            self._write(self._line(now))

    def _due(self, now: float) -> bool:
        """Whether a progress line is due: :attr:`interval` seconds since the last line (doubled after every
        :attr:`max_lines` lines of a loop with no total), and with a total,
        ``ceil((total - initial) / max_lines)`` more items done since the last line."""
        if self.total is None:
            return now - self.last >= self.interval * 2 ** (self.lines // self.max_lines)
        step = max(1, -(-(self.total - self.initial) // self.max_lines))
        return now - self.last >= self.interval and self.n - self.last_n >= step

    def set_postfix(self, ordered_dict: dict | None = None, refresh: bool = True, **kwargs: Any) -> None:
        """Show ``key=value`` pairs at the end of the next line (no line by itself)."""
        items = {**(ordered_dict or {}), **kwargs}
        self.postfix = ", ".join(f"{k}={v}" for k, v in items.items())

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Show ``s`` at the end of the next line (no line by itself)."""
        self.postfix = str(s)

    def close(self) -> None:
        """Print the final line (once): ``done:``, or ``stopped:`` while an exception propagates."""
        if self.closed:
            return
        self.closed = True
        if not self.disable:
            state = "stopped" if sys.exc_info()[0] is not None else "done"
            self._write(self._line(time.monotonic(), state))

    # ---------------------------------------------------------------------------- the lines
    def _line(self, now: float, state: str | None = None) -> str:
        elapsed = now - self.start
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else None
        shown_rate = f"{rate:.3g} {self.unit}/s" if rate is not None else f"- {self.unit}/s"
        head = f"{self.desc}: " if self.desc else ""
        if state is not None:
            counted = f"{count} {self.unit}"
            if self.total is not None and self.n != self.total and state == "done":  # a bound such as --limit
                counted = f"{self.n} {self.unit} ({self.total} expected)"
            text = f"{head}{state}: {counted} in {_duration(elapsed)} ({shown_rate})"
        else:
            pct = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
            left = ""
            if self.total is not None and rate:
                left = f", ~{_duration(max(self.total - self.n, 0) / rate)} left"
            text = f"{head}{count} {self.unit}{pct}, {_duration(elapsed)} elapsed, {shown_rate}{left}"
        return f"{text}, {self.postfix}" if self.postfix else text

    def _write(self, line: str) -> None:
        try:
            self.file.write(line + "\n")
            self.file.flush()
        except ValueError:  # a closed stream (interpreter shutdown)
            pass


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress(iterable: Iterable | None = None, *, file: TextIO | None = None, disable: bool | None = False,
             **kwargs: Any):
    """The progress of a loop on ``file`` (default stderr): a tqdm bar on a terminal, :class:`LogLines` elsewhere.

    Args:
        iterable, kwargs: as ``tqdm(iterable, **kwargs)`` (``desc``, ``total``, ``unit``, ``initial``).
        file: the stream; whether it is a terminal picks the mode.
        disable: True: no output at all (e.g. not the main process). None is False here: unlike
            tqdm's None, a non-terminal stream gets its lines rather than nothing.

    Returns:
        A ``tqdm.tqdm`` or a :class:`LogLines` (iterate it, or ``update``/``set_postfix``/``close``; usable
        as a context manager).
    """
    file = sys.stderr if file is None else file
    if _is_terminal(file):
        from tqdm.auto import tqdm

        return tqdm(iterable, file=file, disable=bool(disable), **kwargs)
    kwargs.pop("dynamic_ncols", None)
    return LogLines(iterable, file=file, disable=bool(disable), **kwargs)
