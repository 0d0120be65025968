"""``.ci/run``: the whole run's time line, and past the budget (45 min by default) an OVER BUDGET line and a failure,
even when the tests passed; within it, the tests' exit status. Run on a copy with a stub ``scripts/test.sh``."""

import os
import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _ci(tmp_path: Path, stub: str, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / ".ci").mkdir()
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "scripts" / "test.sh").write_text(stub)
    return subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)


def test_defaults_are_45_minutes():
    text = (REPO / ".ci" / "run").read_text()
    assert "budget=${PEAGLE_CI_BUDGET_S:-2700}" in text and "limit=${PEAGLE_CI_FAIL_S:-2700}" in text


def test_over_budget_fails_though_the_tests_passed(tmp_path):
    r = _ci(tmp_path, "sleep 2; exit 0\n", PEAGLE_CI_BUDGET_S="1", PEAGLE_CI_FAIL_S="1")
    assert r.returncode == 1
    wall = int(re.search(r"whole run (\d+) s", r.stderr).group(1))  # 2, or 3 on a busy machine
    assert wall in (2, 3) and "budget 1 s, tests exit 0" in r.stderr
    assert ".ci/run: OVER BUDGET" in r.stderr and f".ci/run: FAILED: the run took 0 min {wall:02d} s" in r.stderr


def test_within_budget_the_tests_exit_status_stands(tmp_path):
    r = _ci(tmp_path, "exit 3\n")
    assert r.returncode == 3 and "tests exit 3" in r.stderr and "OVER BUDGET" not in r.stderr
    (tmp_path / "b").mkdir()
    r = _ci(tmp_path / "b", "exit 0\n")
    assert r.returncode == 0 and "FAILED" not in r.stderr
