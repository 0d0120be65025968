"""runtime.progress: one convention for every loop: a tqdm bar on a terminal; in a log at most one plain
line per interval and always a final ``done:`` line (issue 34 item 6)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

import runtime.progress
from runtime.progress import progress

ROOT = Path(__file__).resolve().parents[2]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def clock(monkeypatch):
    """A fake clock for both tqdm and the log lines: no sleeping, no dependence on the machine's load."""
    now = [1000.0]
    monkeypatch.setattr("tqdm.std.time", lambda: now[0])
    monkeypatch.setattr(runtime.progress.time, "monotonic", lambda: now[0])
    return now


def _run(stream, clock, n=12, step_s=0.25, postfix=False, **kwargs):
    """Run a bar over ``n`` steps of ``step_s`` seconds each, the trainer's way when ``postfix``
    (a postfix set before each update)."""
    bar = progress(total=n, desc="pack", unit="block", file=stream, **kwargs)
    for i in range(n):
        clock[0] += step_s
        if postfix:
            bar.set_postfix_str(f"loss {1 / (i + 1):.3f}")
        bar.update(1)
    bar.close()
    return stream.getvalue()


def test_a_log_gets_one_plain_line_per_interval_and_a_final_line(monkeypatch, clock):
    monkeypatch.setattr(runtime.progress, "LOG_INTERVAL_S", 1.0)
    text = _run(io.StringIO(), clock)
    assert "\r" not in text
    lines = text.splitlines()
    assert [re.match(r"pack: (\d+)/12 block", line).group(1) for line in lines[:-1]] == ["4", "8", "12"], lines
    assert lines[0] == "pack: 4/12 block (33%), 1.0s elapsed, 4 block/s, ~2.0s left"
    assert lines[-1] == "pack: done: 12/12 block in 3.0s (4 block/s)"


def test_a_postfix_every_step_does_not_print_a_line_every_step(monkeypatch, clock):
    # the trainer sets its loss every step: tqdm's set_postfix refreshed the line each time (301 lines for
    # 300 steps), and its close then printed nothing (a log ending at 299/300)
    monkeypatch.setattr(runtime.progress, "LOG_INTERVAL_S", 30.0)
    lines = _run(io.StringIO(), clock, n=300, step_s=0.5, postfix=True).splitlines()
    assert len(lines) == 5 + 1, lines  # 150 s: one line per 30 s, and the final one
    assert lines[-1] == "pack: done: 300/300 block in 2m30s (2 block/s), loss 0.003"


def test_a_loop_shorter_than_the_interval_prints_only_its_final_line(clock):
    assert _run(io.StringIO(), clock, n=3) == "pack: done: 3/3 block in 0.8s (4 block/s)\n"


def test_an_iterated_loop_and_a_resumed_one(clock):
    stream = io.StringIO()
    for _ in progress(range(3), desc="extract", unit="block", file=stream):
        clock[0] += 1
    assert stream.getvalue() == "extract: done: 3/3 block in 3.0s (1 block/s)\n"
    stream = io.StringIO()
    with progress(total=10, initial=8, desc="regenerate", unit="row", file=stream) as bar:
        clock[0] += 2
        bar.update(2)
    assert stream.getvalue() == "regenerate: done: 10/10 row in 2.0s (1 row/s)\n"  # the rate of this run's rows


def test_a_loop_that_ends_before_its_total_says_so(clock):  # tokenize's total is --limit, a bound
    stream = io.StringIO()
    with progress(total=1000, desc="tokenize", unit="conv", file=stream) as bar:
        clock[0] += 5
        bar.update(50)
    assert stream.getvalue() == "tokenize: done: 50 conv (1000 expected) in 5.0s (10 conv/s)\n"


def test_an_interrupted_loop_says_stopped(clock):
    stream = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        with progress(total=20, desc="peagle-train", unit="step", file=stream) as bar:
            bar.update(19)
            raise KeyboardInterrupt
    assert stream.getvalue().startswith("peagle-train: stopped: 19/20 step in ")


def test_a_terminal_gets_the_usual_in_place_bar(clock):
    text = _run(_Terminal(), clock, n=3)
    assert text.startswith("\rpack:   0%|") and "3/3" in text and text.endswith("\n")


def test_disabled_prints_nothing_anywhere(monkeypatch, clock):
    monkeypatch.setattr(runtime.progress, "LOG_INTERVAL_S", 0.0)
    assert _run(io.StringIO(), clock, n=3, disable=True) == ""
    assert _run(_Terminal(), clock, n=3, disable=True) == ""


def test_no_module_uses_tqdm_but_the_helper():
    users = sorted(str(p.relative_to(ROOT)) for pkg in ("peagle_data", "peagle_train", "runtime", "stores", "cli")
                   for p in (ROOT / pkg).rglob("*.py") if re.search(r"^\s*(from|import) tqdm", p.read_text(), re.M))
    assert users == ["runtime/progress.py"]


def test_slow_steps_in_a_log_get_a_line_every_few_percent_not_one_a_step(clock):
    """Issue 44 item 10: 40 training steps written to a file printed 45 lines (steps slower than the interval:
    a line each). A loop of known total prints at most MAX_LOG_LINES lines (one per 4% mark) and its final line."""
    assert runtime.progress.MAX_LOG_LINES == 25
    lines = _run(io.StringIO(), clock, n=40, step_s=45.0, postfix=True).splitlines()
    counts = [int(re.match(r"pack: (\d+)/40 block", line).group(1)) for line in lines[:-1]]
    assert counts == list(range(2, 41, 2)), counts  # 40 steps: every second step is past the next 4% mark
    assert lines[-1] == "pack: done: 40/40 block in 30m00s (0.0222 block/s), loss 0.025"
    for n in (10, 1000, 12345):  # any total: at most 25 lines and the final one
        lines = _run(io.StringIO(), clock, n=n, step_s=3600.0 / n + 31.0).splitlines()
        assert min(n, 20) <= len(lines) - 1 <= 25 and lines[-1].startswith(f"pack: done: {n}/{n} block"), (n, len(lines))
    resumed = io.StringIO()  # a resumed loop: the marks of what is left to do
    with progress(total=100, initial=90, desc="peagle-train", unit="step", file=resumed) as bar:
        for _ in range(10):
            clock[0] += 60
            bar.update(1)
    assert len(resumed.getvalue().splitlines()) == 10 + 1


def test_a_log_of_unknown_total_gets_ever_fewer_lines(monkeypatch, clock):
    """No total (regenerate without --limit): the interval doubles after each 25 lines, so the lines grow as the
    log of the run's time (30 s interval: 25 lines in 12.5 min, 25 more in 25 min, ...)."""
    stream = io.StringIO()
    bar = progress(desc="regenerate", unit="row", file=stream)
    for _ in range(24 * 3600):
        clock[0] += 1.0
        bar.update(1)
    bar.close()
    # 25 lines 30 s apart, 25 at 60 s, ... 25 at 960 s (47,250 s in all), then 20 at 1,920 s in the day's rest
    assert sum(25 * 30 * 2 ** k for k in range(6)) == 47250 and (86400 - 47250) // 1920 == 20
    assert len(stream.getvalue().splitlines()) == 6 * 25 + 20 + 1
