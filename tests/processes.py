"""Killing a long command part-way, for the kill-and-resume tests of extraction."""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def kill_runs(command: Callable[[bool], list[str]], env: dict[str, str], started: Path, output: Path,
              attempts: int = 3, seed: int = 0) -> int:
    """Start ``command(resume)`` ``attempts`` times (``resume`` once ``output`` exists), each time wait
    until ``started`` exists (the run has begun writing), a random 0-1 s more, and SIGKILL it if it
    still runs. Returns how many runs were killed."""
    rng = random.Random(seed)
    kills = 0
    for _ in range(attempts):
        proc = subprocess.Popen(command(output.exists()), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while time.time() < deadline and not started.exists() and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.0))
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
    return kills
