"""Processes for the tests: killing a long command part-way (the kill-and-resume tests of extraction), and
`peagle-train` launched on two CPU ranks."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import sys
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


def launch_two_ranks(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    """``accelerate launch --multi_gpu --num_processes 2 -m cli.train ARGS`` on a free port (accelerate's default
    29500 is shared with any other launch). ``--cpu`` would make accelerate start a single process;
    ``--multi_gpu`` starts two through torchrun, and run_train's ``Accelerator(cpu=True)`` puts them on gloo when
    there is no CUDA. Times out after 300 s."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
           "1", "--main_process_port", str(port), "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "cli.train",
           *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
