"""The engine interface's helper :func:`peagle_data.extract.engine.timed`: the items unchanged, the producer's time
counted, the consumer's not (on a clock the test moves)."""

from __future__ import annotations

import time

from peagle_data.extract.engine import timed


def test_timed_counts_the_producers_time_not_the_consumers(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def producer():
        for x, cost in ((1, 2.0), (2, 3.0)):
            clock[0] += cost  # the producer's time: counted
            yield x
        clock[0] += 0.5  # the last next(), which ends the iteration: counted too

    totals = {"engine_s": 1.0}
    got = []
    for x in timed(producer(), totals, "engine_s"):
        got.append(x)
        clock[0] += 10.0  # the consumer's time: not counted
    assert got == [1, 2]
    assert totals == {"engine_s": 1.0 + 2.0 + 3.0 + 0.5}  # added to what was there
