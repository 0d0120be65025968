"""vLLM's acceptance of several drafters on the same MT-Bench requests, at one temperature, in one process (the
``vllm`` stage of bench/bench_losses.py; run in the vLLM environment).

vLLM's reference (the verifier alone: greedy at T = 0, at T > 0 request i sampled with the seed
``peagle-eval --engine vllm`` gives it) is run once; every drafter is then served by vLLM on its requests
(``--vllm-loading speculators``: vLLM reads the checkpoint's own config, as ``vllm serve DRAFTER`` does), one
engine after the other, K = the drafter's ``num_depths``, vLLM's default draft scheme (``greedy``), concurrency 1.
Each report is ``peagle-eval --engine vllm``'s (:func:`peagle_train.evaluate.vllm_eval.vllm_report`), plus
``judge_wall_s`` (this drafter's engine start and requests, seconds), ``reference_wall_s`` (the reference,
shared), ``cpu_expand_fix`` and ``judge_env`` (vLLM's CPU thread and KV-cache variables: on a CPU shared with
other jobs ``VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1`` keeps vLLM's OpenMP threads from waiting on
each other).

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). At T > 0 on a CPU build where vLLM's
``expand_batch_to_tokens`` is wrong (vLLM 0.32, issue #55005: draft tokens get uninitialised memory as their
temperature; :func:`~peagle_train.generate.vllm_engine.check_vllm_sampling` refuses it), the CPU shim is replaced
in this process by PR #55006's semantics (:func:`trace_vllm_rejection.expand_fixed`), the expansion is probed
again in this process and must be exact, and every report says so (``cpu_expand_fix: true`` and
``vllm_sampling_check``). On an accelerator, or a CPU build with the fix, nothing is replaced.

    VLLM_CPU_KVCACHE_SPACE=2 PYTHONPATH=. .venv-vllm/bin/python bench/vllm_judge.py --temperature 1 \\
        --prompts ../shared/data/mt_bench_question.jsonl --num-prompts 10 --max-new-tokens 128 \\
        --drafters RUN_A/final RUN_B/checkpoint-200 --reports RUN_A/vllm-T1.json RUN_B/vllm-T1.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported: its engine in this process

sys.path.insert(0, str(Path(__file__).parent))
import trace_vllm_rejection  # noqa: E402  (imports vLLM in this process)
from vllm.utils import cpu_triton_utils  # noqa: E402

from peagle_train.evaluate.config import EvalConfig  # noqa: E402
from peagle_train.evaluate.vllm_eval import (  # noqa: E402
    check_speculators_verifier, speculative_drafter, vllm_reference, vllm_speculative)
from peagle_train.generate.speculative import served_truncation  # noqa: E402
from peagle_train.generate.vllm_engine import (  # noqa: E402
    VLLM_CPU_EXPAND_BUG, VLLM_EXPAND_EXPECTED, VLLM_EXPAND_PROBE, check_vllm_sampling, vllm_on_cpu)
from stores.errors import InputError  # noqa: E402

CPU_FIX = ("vLLM's CPU expand_kernel shim (vllm/utils/cpu_triton_utils.py, _expand_kernel_impl) replaced in the "
           "judge's process by vLLM PR #55006's semantics (bench/trace_vllm_rejection.py expand_fixed; issue "
           "#55005); expand_batch_to_tokens then probed in that process: exact")
"""The sampling check recorded in a report judged with the in-process CPU fix."""


JUDGE_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "VLLM_CPU_KVCACHE_SPACE")
"""Environment variables that set vLLM's CPU threads and KV cache, recorded in every report (``judge_env``)."""


def probe_in_process() -> dict:
    """:data:`~peagle_train.generate.vllm_engine.VLLM_EXPAND_PROBE` run in this process (after the fix)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(VLLM_EXPAND_PROBE, {})  # noqa: S102  peagle's own probe text
    return json.loads(buf.getvalue().strip().splitlines()[-1])


def sampling_check(temperature: float) -> tuple[str, bool]:
    """``(the check in words, whether the CPU fix was applied)``: peagle's own check, and where it refuses a CPU
    build at T > 0, the fix applied in this process and probed here.

    Raises:
        SystemExit: the fixed expansion is still not exact (the report would be wrong).
    """
    on_cpu = vllm_on_cpu()
    try:
        return check_vllm_sampling(temperature, on_cpu), False
    except InputError:
        if not on_cpu:
            raise
    cpu_triton_utils._expand_kernel_impl = trace_vllm_rejection.expand_fixed  # read when overrides are registered
    got = probe_in_process()
    if got != VLLM_EXPAND_EXPECTED:
        raise SystemExit(f"vllm_judge: with PR #55006's fix in this process expand_batch_to_tokens gave {got}, "
                         f"expected {VLLM_EXPAND_EXPECTED}: {VLLM_CPU_EXPAND_BUG}")
    return CPU_FIX, True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafters", nargs="+", required=True)
    ap.add_argument("--reports", nargs="+", required=True, help="one JSON path per drafter")
    ap.add_argument("--temperature", type=float, required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--verifier", default="smollm2-135m")
    a = ap.parse_args()
    if len(a.drafters) != len(a.reports):
        ap.error(f"{len(a.drafters)} --drafters but {len(a.reports)} --reports")
    for d in a.drafters:  # before any engine starts
        check_speculators_verifier(d, a.verifier)
    check, fixed = sampling_check(a.temperature)
    config = EvalConfig(max_new_tokens=a.max_new_tokens, num_prompts=a.num_prompts, temperature=a.temperature,
                        seed=0, draft_sample_method="greedy", engine="vllm", concurrency=1,
                        vllm_loading="speculators")
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    t0 = time.perf_counter()
    ref = vllm_reference(a.verifier, a.prompts, config, log,
                         served=served_truncation(a.verifier, config.top_k, config.top_p))
    reference_s = time.perf_counter() - t0
    for drafter, path in zip(a.drafters, a.reports):
        t0 = time.perf_counter()
        kind, K = speculative_drafter(drafter, config)
        report = vllm_speculative(ref, drafter, config, log, kind=kind, num_draft_tokens=K, sampling_check=check)
        report.update(judge_wall_s=time.perf_counter() - t0, reference_wall_s=reference_s, cpu_expand_fix=fixed,
                      judge_env={k: os.environ.get(k) for k in JUDGE_ENV})
        Path(path).write_text(json.dumps(report, indent=1))
        print(f"vllm_judge: {drafter} T={a.temperature:g}: AL {report['acceptance_length']:.3f} "
              f"({report['num_drafts']} drafts) in {report['judge_wall_s']:.0f} s", file=sys.stderr)
    print("vllm_judge: done", file=sys.stderr)


if __name__ == "__main__":
    main()
