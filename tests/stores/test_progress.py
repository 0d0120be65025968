"""stores.progress: one tqdm helper for every loop; plain sparse lines when the stream is no terminal."""

from __future__ import annotations

import io
import re
from pathlib import Path

import stores.progress
from stores.progress import progress

ROOT = Path(__file__).resolve().parents[2]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(stream, n=12, step_s=0.25, monkeypatch=None, **kwargs):
    """Run a bar over ``n`` steps of ``step_s`` seconds each on tqdm's clock (a fake one when
    ``monkeypatch`` is given: no sleeping, no dependence on the machine's load)."""
    clock = [1000.0]
    if monkeypatch is not None:
        monkeypatch.setattr("tqdm.std.time", lambda: clock[0])
    for _ in progress(range(n), desc="pack", unit="block", file=stream, **kwargs):
        clock[0] += step_s
    return stream.getvalue()


def test_a_log_gets_one_plain_line_per_interval_and_no_carriage_return(monkeypatch):
    monkeypatch.setattr(stores.progress, "LOG_INTERVAL_S", 1.0)
    text = _run(io.StringIO(), monkeypatch=monkeypatch)
    assert "\r" not in text
    lines = text.splitlines()
    counts = [re.match(r"pack: +\d+%\|[# 0-9]+\| (\d+)/12 \[", line).group(1) for line in lines]
    # the first line after one interval (4 steps of 0.25 s), then one per interval, the last once
    assert counts == ["4", "8", "12"], lines


def test_a_loop_shorter_than_the_interval_prints_nothing_to_a_log():
    assert _run(io.StringIO(), n=3) == ""


def test_a_terminal_gets_the_usual_in_place_bar():
    text = _run(_Terminal(), n=3)
    assert text.startswith("\rpack:   0%|") and "3/3" in text and text.endswith("\n")


def test_disabled_prints_nothing_anywhere(monkeypatch):
    monkeypatch.setattr(stores.progress, "LOG_INTERVAL_S", 0.0)
    assert _run(io.StringIO(), n=3, disable=True) == ""
    assert _run(_Terminal(), n=3, disable=True) == ""


def test_no_module_uses_tqdm_but_the_helper():
    users = sorted(str(p.relative_to(ROOT)) for pkg in ("peagle_data", "peagle_train", "stores", "cli")
                   for p in (ROOT / pkg).rglob("*.py") if re.search(r"^\s*(from|import) tqdm", p.read_text(), re.M))
    assert users == ["stores/progress.py"]
