"""bench/bench_vllm_extract.py's pure helpers: the requests of a packed row, the ABBA order of the runs, and the
breakdown of an extraction's timings against the prefill of the same requests."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from tests.bench.bench_modules import load_bench


bench = load_bench("bench_vllm_extract")


def test_segment_prompts_are_the_rows_segments_without_empty_ones():
    row = {"input_ids": np.array([5, 6, 7, 8, 9, 10], dtype=np.int32), "cu_seqlens": np.array([0, 2, 2, 5, 6])}
    assert bench.segment_prompts(row) == [[5, 6], [7, 8, 9], [10]]


def test_abba_alternates_which_run_goes_first():
    assert bench.abba(1) == ["prefill", "extract"]
    assert bench.abba(3) == ["prefill", "extract", "extract", "prefill", "prefill", "extract"]


TIMINGS = {"engine_open_s": 60.0, "store_open_s": 0.5, "engine_s": 9.0, "writer_wait_s": 0.5, "blocks_s": 10.0,
           "store_write_s": 2.0, "requests_s": 8.0, "files_s": 0.6, "check_s": 0.1, "assemble_s": 0.3}


def test_breakdown_splits_the_extra_time_per_token():
    parts = bench.breakdown(tokens=1000, prefill_s=6.0, timings=TIMINGS)
    assert parts == {"prefill": 6000.0, "extract": 10000.0, "extra": 4000.0, "capture": 2000.0, "files": 600.0,
                     "check": 100.0, "assemble": 300.0, "writer_wait": 500.0, "other": 500.0, "store_write": 2000.0,
                     "start_extract": 60500.0}
    named = ("capture", "files", "check", "assemble", "writer_wait", "other")
    assert sum(parts[k] for k in named) == pytest.approx(parts["extra"])  # the parts add up to the extra time
    assert bench.client_us(parts) == pytest.approx(2000.0)  # files + check + assemble + writer_wait + other


def test_ceiling_is_the_serial_rate():
    assert bench.ceiling(2000.0, 500.0) == pytest.approx(400.0)
    assert bench.ceiling(0.0, 250.0) == pytest.approx(4000.0)


def test_cpu_meter_counts_a_child_that_ended():
    """A child that burns CPU and exits still counts (its last sample): the extraction's engine process ends
    inside ``run_extract``, before the bench reads the meter."""
    meter = bench.CpuMeter(every_s=0.02)
    before = meter.total()
    child = subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\n"
                            "while time.process_time() - t < 0.5: pass\ntime.sleep(0.1)"], timeout=60)
    assert child.returncode == 0
    assert meter.total() - before >= 0.4  # the child's 0.5 s, less at most one sampling interval
