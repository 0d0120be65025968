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
])
def test_a_bad_demo_variable_stops_before_any_stage_naming_it(tmp_path, var, value, message):
    env = {**os.environ, "DEMO_DIR": str(tmp_path / "demo"), var: value}
    result = subprocess.run(["bash", str(DEMO)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == f"demo.sh: {message}\n" and result.stdout == ""  # no stage (nor setup) ran
    assert not (tmp_path / "demo").exists()
