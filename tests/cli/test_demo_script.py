"""scripts/demo.sh checks its DEMO_* variables before it sets anything up or runs a stage."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "scripts" / "demo.sh"


@pytest.mark.parametrize("var, value, message", [
    ("DEMO_STEPS", "abc", "DEMO_STEPS=abc: expected a positive integer"),
    ("DEMO_CONVERSATIONS", "0", "DEMO_CONVERSATIONS=0: expected a positive integer"),
    ("DEMO_NUM_DEPTHS", "-3", "DEMO_NUM_DEPTHS=-3: expected a positive integer"),
    ("DEMO_MAX_NEW_TOKENS", "3.5", "DEMO_MAX_NEW_TOKENS=3.5: expected a positive integer"),
    ("DEMO_LR", "fast", "DEMO_LR=fast: expected a positive number such as 1e-3"),
    ("DEMO_LR", "0.0", "DEMO_LR=0.0: expected a positive number such as 1e-3"),
    ("DEMO_MAX_SEQ_LEN", "1", "DEMO_MAX_SEQ_LEN=1: expected at least 2 tokens"),
    ("DEMO_PROMPTS", "no/such.jsonl", "DEMO_PROMPTS=no/such.jsonl: no such file"),
    ("DEMO_MEASURE_COSTS", "no", "DEMO_MEASURE_COSTS=no: expected 0 or 1"),
])
def test_a_bad_demo_variable_stops_before_any_stage_naming_it(tmp_path, var, value, message):
    env = {**os.environ, "DEMO_DIR": str(tmp_path / "demo"), var: value}
    result = subprocess.run(["bash", str(DEMO)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == f"demo.sh: {message}\n" and result.stdout == ""  # no stage (nor setup) ran
    assert not (tmp_path / "demo").exists()


QUALITY = DEMO.parent / "quality.sh"


@pytest.mark.parametrize("var, value, message", [
    ("QUALITY_STEPS", "many", "QUALITY_STEPS=many: expected a positive integer"),
    ("QUALITY_STEPS", "3", "QUALITY_STEPS=3: expected at least 4 (four checkpoints make the learning curve)"),
    ("QUALITY_LR", "-1", "QUALITY_LR=-1: expected a positive number such as 1e-3"),
    ("QUALITY_DRAFT_TOKENS", "9", "QUALITY_DRAFT_TOKENS=9: at most QUALITY_NUM_DEPTHS=4"),
])
def test_a_bad_quality_variable_stops_before_any_stage_naming_it(tmp_path, var, value, message):
    env = {**os.environ, "QUALITY_DIR": str(tmp_path / "q"), var: value}
    result = subprocess.run(["bash", str(QUALITY)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == f"quality.sh: {message}\n" and result.stdout == ""
    assert not (tmp_path / "q").exists()


def test_quality_without_mt_bench_says_where_to_get_it(tmp_path):
    env = {**os.environ, "QUALITY_DIR": str(tmp_path / "q"), "QUALITY_MT_BENCH": str(tmp_path / "none.jsonl")}
    result = subprocess.run(["bash", str(QUALITY)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "no such file; download FastChat's MT-Bench questions" in result.stderr
    assert "raw.githubusercontent.com/lm-sys/FastChat" in result.stderr and not (tmp_path / "q").exists()
