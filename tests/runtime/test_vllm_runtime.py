"""The one way peagle starts vLLM (runtime/vllm_runtime.py): its memory arguments, its output kept off
stdout, and the root cause read from its engine processes' log. No vLLM needed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.vllm_runtime import DEFAULT_CPU_KV_CACHE_GIB, VllmMemory, root_cause, serve_prefix

REPO = Path(__file__).resolve().parents[3]
GiB = 2**30

# vLLM 0.32's CPU build, started on a 24 GB machine without a KV cache size (stdout and stderr, trimmed):
# its worker's ValueError is the cause; the engine core's and the parent's exceptions only point at it
FAILED_START = """\
(MainProcess pid=12339) INFO 12-02 06:48:20 [model.py:2152] Using max model len 256
(EngineCore pid=12913) WARNING 12-02 06:48:36 [cpu.py:224] Triton is not installed. triton-cpu is expected on x86 CPUs.
(VllmWorker-0 pid=13391) ERROR 12-02 06:49:15 [multiproc_executor.py:953] WorkerProc failed to start.
(VllmWorker-0 pid=13391) ERROR 12-02 06:49:15 [multiproc_executor.py:953] Traceback (most recent call last):
(VllmWorker-0 pid=13391) ERROR 12-02 06:49:15 [multiproc_executor.py:953]     raise ValueError(
(VllmWorker-0 pid=13391) ERROR 12-02 06:49:15 [multiproc_executor.py:953] ValueError: Available memory on node 0 \
(19.58/21.84 GiB) on startup is less than desired CPU memory utilization (0.92, 20.1 GiB).
(EngineCore pid=12913) INFO 12-02 06:49:15 [multiproc_executor.py:479] [shutdown] Executor: waiting for worker exit
(EngineCore pid=12913) ERROR 12-02 06:49:21 [core.py:1510] EngineCore failed to start.
(EngineCore pid=12913) ERROR 12-02 06:49:21 [core.py:1510] Exception: WorkerProc initialization failed due to an \
exception in a background process. See stack trace for root cause.
Traceback (most recent call last):
Exception: WorkerProc initialization failed due to an exception in a background process. See stack trace for root cause.
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
"""


def test_root_cause_is_the_workers_exception_not_vllms_pointers_to_it():
    assert root_cause(FAILED_START.splitlines()) == (
        "ValueError: Available memory on node 0 (19.58/21.84 GiB) on startup is less than desired CPU memory "
        "utilization (0.92, 20.1 GiB).")
    assert root_cause(FAILED_START.splitlines()[-3:]) is None  # only pointers: the caller names vLLM's own error
    assert root_cause(["(EngineCore pid=1) INFO 12-02 06:48:20 [x.py:1] ImportError: optional, logged at INFO",
                       "torch.OutOfMemoryError: CUDA out of memory."]) == "torch.OutOfMemoryError: CUDA out of memory."


def test_memory_on_cpu_is_a_fixed_kv_cache_and_on_gpu_vllms_utilization():
    assert DEFAULT_CPU_KV_CACHE_GIB == 2.0
    assert VllmMemory().engine_args(on_cpu=True, env={}) == {"kv_cache_memory_bytes": 2 * GiB}
    assert VllmMemory().engine_args(on_cpu=True, env={"VLLM_CPU_KVCACHE_SPACE": "4"}) == {"kv_cache_memory_bytes": 4 * GiB}
    assert VllmMemory(kv_cache_gib=0.5).engine_args(True, env={"VLLM_CPU_KVCACHE_SPACE": "4"}) == {
        "kv_cache_memory_bytes": GiB // 2}  # the option over the environment
    assert VllmMemory().engine_args(on_cpu=False, env={}) == {}  # vLLM's gpu_memory_utilization 0.92
    assert VllmMemory(gpu_memory_utilization=0.5).engine_args(False) == {"gpu_memory_utilization": 0.5}
    assert VllmMemory(kv_cache_gib=8).engine_args(False) == {"kv_cache_memory_bytes": 8 * GiB}
    with pytest.raises(ValueError, match="--vllm-gpu-memory-utilization is for a GPU; on CPU peagle gives vLLM a "
                                         "fixed KV cache: set its size with --vllm-kv-cache-gib"):
        VllmMemory(gpu_memory_utilization=0.5).engine_args(on_cpu=True, env={})
    with pytest.raises(ValueError, match="give one of them"):
        VllmMemory(kv_cache_gib=1, gpu_memory_utilization=0.5)
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        VllmMemory(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="whole GiB"):
        VllmMemory().engine_args(on_cpu=True, env={"VLLM_CPU_KVCACHE_SPACE": "1.5"})


SCRIPT = textwrap.dedent("""
    import json, subprocess, sys
    from runtime.vllm_runtime import VllmOutput

    print("before", flush=True)  # ours, before the engine: stays on stdout
    out = VllmOutput().start()
    # an engine process inherits fds 1 and 2, and the parent's own prints go there too while it starts
    engine = subprocess.Popen(["sh", "-c", "echo engine-stdout; echo engine-stderr >&2; read x; echo engine-late"],
                              stdin=subprocess.PIPE)
    print("vllm-log-line", flush=True)
    out.settle(quiet_s=0.5)
    out.started()  # the engine is up: this process writes to the real stderr again, its stdout there too
    print("parent-after-start", flush=True)
    print("parent-log", file=sys.stderr, flush=True)
    engine.communicate(b"go")  # the engine still writes into the pipe
    out.stop(wait_s=5)
    print(json.dumps({"lines": list(out.lines)}))
""")


def test_vllm_output_keeps_every_engine_line_off_stdout_and_readable():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    first, rest = proc.stdout.split("\n", 1)
    assert first == "before"
    assert sorted(json.loads(rest)["lines"]) == ["engine-late", "engine-stderr", "engine-stdout", "vllm-log-line"]
    assert sorted(proc.stderr.splitlines()) == ["engine-late", "engine-stderr", "engine-stdout", "parent-after-start",
                                                "parent-log", "vllm-log-line"]


def test_the_serve_command_without_an_accelerator_is_the_module_form_the_cpu_build_runs():
    assert serve_prefix("drafter/final", accelerator=False) == [
        "python", "-m", "vllm.entrypoints.openai.api_server", "--model", "drafter/final"]
    assert serve_prefix("drafter/final", accelerator=True) == ["vllm", "serve", "drafter/final"]


@pytest.mark.parametrize("version, serves", [
    ("0.32.0", True), ("0.33.2", True), ("0.33.0rc1+cpu", True),
    ("0.34.0", False), ("0.34.1rc1", False), ("0.35.0+cpu", False), ("1.0.0", False),
])
def test_vllm_serves_p_eagle_up_to_0_33(version, serves):
    from runtime.vllm_runtime import peagle_vllm_refusal

    why = peagle_vllm_refusal(version)
    assert (why is None) == serves, why
    if not serves:
        assert why.startswith(f"vLLM {version} (installed here) no longer serves P-EAGLE drafters: from 0.34 ")
        assert "vLLM 0.33 is the last release that serves P-EAGLE drafters" in why
        assert "`peagle-train --method dflash`" in why


def test_an_unreadable_vllm_version_is_refused_with_the_reason():
    from runtime.vllm_runtime import peagle_vllm_refusal

    why = peagle_vllm_refusal("dev")
    assert why.startswith("the installed vLLM's version 'dev' does not read as MAJOR.MINOR, so whether it serves "
                          "P-EAGLE drafters is not known; vLLM 0.33 is the last release"), why


def test_the_installed_version_is_read_from_either_distribution_without_importing_vllm(monkeypatch):
    import importlib.metadata

    import runtime.vllm_runtime as vr
    from stores.errors import InputError

    installed = {"vllm-cpu": "0.34.0+cpu"}

    def version(dist):
        if dist not in installed:
            raise importlib.metadata.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(importlib.metadata, "version", version)
    modules = set(sys.modules)
    assert vr.installed_vllm_version() == "0.34.0+cpu"
    with pytest.raises(InputError, match=r"field '--engine': vLLM 0.34.0\+cpu \(installed here\) no longer serves"):
        vr.check_vllm_serves_peagle()
    assert not {m for m in set(sys.modules) - modules if m.split(".")[0] == "vllm"}
    installed.update({"vllm": "0.33.1", "vllm-cpu": "0.35.0"})  # the CUDA build's distribution is read first
    assert vr.installed_vllm_version() == "0.33.1"
    vr.check_vllm_serves_peagle()
    installed.clear()
    assert vr.installed_vllm_version() is None
    vr.check_vllm_serves_peagle()  # no vLLM: import_vllm names the set-up command
