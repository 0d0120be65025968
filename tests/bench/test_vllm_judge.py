"""bench/vllm_judge.py (the vLLM suite, seconds): at T > 0 on a vLLM CPU build whose ``expand_batch_to_tokens`` is
wrong (vLLM issue #55005) the judge replaces the shim by PR #55006's in its own process, probes it there and
records it; at T = 0, or on a vLLM that is right, it changes nothing. Run in a child Python: the judge sets
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and registers vLLM's kernel overrides, which must not reach this test process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.vllm


def test_at_t1_a_broken_cpu_build_is_fixed_in_process_and_said_so_and_at_t0_nothing_is_replaced():
    code = ("import json, vllm_judge\n"
            "from peagle_train.generate.vllm_engine import VLLM_EXPAND_EXPECTED, probe_vllm_expand, vllm_on_cpu\n"
            "shipped = (not vllm_on_cpu()) or probe_vllm_expand() == VLLM_EXPAND_EXPECTED\n"
            "print(json.dumps([vllm_judge.sampling_check(0.0), vllm_judge.sampling_check(1.0), vllm_judge.CPU_FIX, "
            "shipped]))")  # T = 0 first: it must replace nothing
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'bench'}"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1800)  # seconds on an idle machine; vLLM imports twice (the probe's child)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (check0, fixed0), (check1, fixed1), cpu_fix, shipped_exact = json.loads(proc.stdout.strip().splitlines()[-1])
    assert fixed0 is False and check0.startswith("not needed at T=0")
    if shipped_exact:  # an accelerator, or a vLLM with the fix: nothing replaced
        assert fixed1 is False and check1 != cpu_fix
    else:  # vLLM 0.32's CPU build: fixed here, and the probe in the judge's process was exact (else SystemExit)
        assert fixed1 is True and check1 == cpu_fix
        assert "PR #55006" in check1 and "#55005" in check1
