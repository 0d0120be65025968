"""``peagle-eval --engine vllm``: the prompts through vLLM, with and without the drafter (docs/design.md §9).

vLLM is imported only here, and only when this engine runs (it pins its own transformers, so it lives
in its own environment: ``PEAGLE_VLLM=1 bash scripts/setup_env.sh`` makes ``.venv-vllm``).

One engine without the drafter gives the reference: each prompt turn's greedy token ids with their 20
largest raw logits (for the near-tie rule of :mod:`peagle_train.evaluate.identity`: bf16 on an accelerator), or
at ``--temperature T > 0`` a seeded sample (later turns take the reference answers as history, as
peagle's own engine does). The engine with the drafter runs at the same temperature, with vLLM's
``draft_sample_method`` set to ``--draft-sample-method`` (vLLM's default ``greedy`` unless asked). One engine with the drafter
(vLLM's P-EAGLE: ``method eagle3`` with ``parallel_drafting``; a DFlash drafter: ``method dflash``, its
kind's :meth:`~peagle_train.train.kinds.DrafterKind.speculative_config`) then runs the same token-id prompts:
- one request at a time, counted: vLLM's spec-decode counters (``llm.get_metrics()``: drafts, draft
  tokens, accepted tokens, accepted per position; their change over this pass) and its per-request
  per-step counts (``per_request_spec_decode_metrics="detailed"``), and the token identity with the
  reference; timed, this is the concurrency-1 throughput;
- then all requests at once with up to ``concurrency`` running together (the list of prompt turns
  repeated to at least that many requests), timed: the concurrency-C throughput.
The reference engine is timed the same two ways. Every timed pass follows an untimed warm-up request.

vLLM counts as peagle reports (docs/design.md §9): AL ``= 1 + accepted / num_drafts``, per-position
acceptance ``accepted_per_pos[i] / num_drafts``. vLLM drafts K tokens at every step, also the last
steps of a turn where fewer tokens are left (peagle drafts ``min(K, left - 1)`` there), and counts
the accepted drafts the output then cuts at ``max_new_tokens`` or an EOS; so on the same tokens its
counts can exceed peagle's at each turn's last step.

At T > 0 on CPU the run is refused, before any engine starts, while vLLM's CPU rejection sampler gives draft tokens
uninitialized memory as their temperature (:func:`check_vllm_sampling`, :data:`VLLM_CPU_EXPAND_BUG`: vLLM 0.32,
issue #55005): a child Python probes vLLM's ``expand_batch_to_tokens`` as vLLM's worker runs it.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from peagle_train.evaluate.config import VLLM_LOADINGS, EvalConfig
from peagle_train.evaluate.identity import TOP_K, compare_to_greedy, greedy_check_summary
from peagle_train.evaluate.prompts import (Prompt, eos_ids, history_message, prompt_modes, read_prompts, render_turn,
                                          turn_text)
from peagle_train.evaluate.report import per_mode_report
from peagle_train.evaluate.speculative import (Truncation, acceptance_scheme, check_draft_sample_method,
                                               checked_num_draft_tokens, served_truncation)
from peagle_train.model.checkpoint import find_drafter
from peagle_train.train.kinds import checkpoint_kind, load_drafter_of_kind
from stores.errors import InputError, ModelNotFoundError, PeagleError
from runtime.model_config import load_model_config, text_config
from runtime.model_cache import load_tokenizer, resolve_model
from runtime.progress import progress
from runtime.model_identity import model_fingerprint
from runtime.vllm_runtime import (CPU_HYBRID_PREFIX_CACHING, CPU_MAMBA2_SPECULATION, VLLM_SETUP, VllmMemory,
                                         VllmOutput, VllmStartError, cpu_bf16_only,
                                         cpu_speculation_not_lossless, cpu_without_prefix_caching, start_llm)
from runtime.vllm_runtime import import_vllm as import_vllm_module

__all__ = ["VLLM_SETUP", "SPEC_METRICS", "VllmRun", "VllmReference", "import_vllm", "vllm_generate",
           "engine_settings", "check_full_length", "request_seed", "top_logits_of", "vllm_report",
           "next_turn_prompts", "per_position_counts", "check_speculators_verifier", "VLLM_EXPAND_PROBE",
           "VLLM_EXPAND_EXPECTED", "VLLM_CPU_EXPAND_BUG", "probe_vllm_expand", "check_vllm_sampling",
           "check_vllm_verifier", "vllm_on_cpu", "vllm_reference", "vllm_speculative", "run_vllm_eval",
           "VllmSpeculativeEngine"]


SPEC_METRICS = {
    "num_drafts": "vllm:spec_decode_num_drafts",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}
"""vLLM's spec-decode counters (``llm.get_metrics()``) by the names this module reports."""


def import_vllm():
    """The ``vllm`` module, its logs on stderr (:func:`runtime.vllm_runtime.import_vllm`).

    Raises:
        MissingDependencyError: vLLM is not installed here; names the set-up command.
    """
    return import_vllm_module("--engine vllm")


@dataclass
class VllmRun:
    """What one vLLM engine produced.

    Attributes:
        tokens: per request of the counted pass, the generated token ids.
        counters: the change of :data:`SPEC_METRICS` over the counted pass (None without a drafter).
        per_request: per request, vLLM's per-step ``accepted`` and ``drafted`` lists (None without a drafter).
        tokens_per_second: concurrency (1, C) -> generated tokens / wall seconds of that pass.
        start_s: seconds to start the engine; num_speculative_tokens: K (None without a drafter).
        engine_settings: the engine's ``dtype`` and ``enforce_eager`` (:func:`engine_settings`), and the
            memory arguments it got (``kv_cache_memory_bytes`` / ``gpu_memory_utilization``, when given).
        top_logits: with ``top_logits=True`` at T = 0, per request, per generated token ``{token id: logit}``
            of vLLM's :data:`~peagle_train.evaluate.identity.TOP_K` largest raw logits
            (``logprobs_mode="raw_logits"``), else None.
    """

    tokens: list[list[int]]
    counters: dict[str, Any] | None = None
    per_request: list[dict[str, list[int]]] | None = None
    tokens_per_second: dict[int, float] = field(default_factory=dict)
    start_s: float = 0.0
    num_speculative_tokens: int | None = None
    engine_settings: dict[str, Any] = field(default_factory=dict)
    top_logits: list[list[dict[int, float]]] | None = None


def top_logits_of(output) -> list[dict[int, float]]:
    """Per generated token of one request output: ``{token id: logit}`` from its logprobs entries (raw logits
    with ``logprobs_mode="raw_logits"``; the sampled token's entry is among them)."""
    return [{int(tok): float(lp.logprob) for tok, lp in entry.items()} for entry in output.outputs[0].logprobs or []]


def request_seed(seed: int, index: int) -> int:
    """The seed of request ``index`` (counted pass order) at T > 0: a function of ``(seed, index)`` only, as
    peagle's own engine seeds prompt turn ``index``."""
    return seed * 1_000_003 + index


def _counters(llm) -> dict[str, Any]:
    """The summed values of :data:`SPEC_METRICS` (over label sets) now."""
    out: dict[str, Any] = {k: 0 for k in SPEC_METRICS}
    out["accepted_per_pos"] = []
    names = {v: k for k, v in SPEC_METRICS.items()}
    for m in llm.get_metrics():
        key = names.get(m.name)
        if key == "accepted_per_pos":
            vals = list(m.values)
            prev = out[key] + [0] * (len(vals) - len(out[key]))
            out[key] = [a + b for a, b in zip(prev, vals)]
        elif key is not None:
            out[key] += int(m.value)
    return out


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out = {k: after[k] - before[k] for k in SPEC_METRICS if k != "accepted_per_pos"}
    prev = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    out["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], prev)]
    return out


def _generate(llm, prompts: Sequence[list[int]], params) -> tuple[list, float]:
    """``llm.generate`` of token-id prompts; (outputs, wall seconds)."""
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    return outs, time.perf_counter() - start


def _step_counts(output) -> dict[str, list[int]] | None:
    m = getattr(output.outputs[0], "spec_decode_metrics", None)
    if m is None:
        return None
    return {"accepted": list(m.per_step_accepted), "drafted": list(m.per_step_drafted)}


def engine_settings(on_cpu: bool, model: str | None = None) -> dict[str, Any]:
    """vLLM engine arguments as peagle measures: on CPU float32 and eager (exact, no graphs there); on
    an accelerator the verifier's serving dtype (bfloat16) with CUDA graphs, so AL, token identity and
    throughput are those of the served engine. On CPU a verifier that vLLM's CPU build computes in bf16 only
    (:func:`runtime.vllm_runtime.cpu_bf16_only`: Qwen3-Next, Qwen3.5, whose gated DeltaNet kernel asserts bf16)
    runs eager in bf16, and a hybrid verifier (:func:`runtime.vllm_runtime.cpu_without_prefix_caching`) without
    prefix caching (:data:`runtime.vllm_runtime.CPU_HYBRID_PREFIX_CACHING`); ``model`` is the verifier's
    directory, or a drafter's (its verifier is read).

    Returns:
        ``{"dtype": "float32" | "bfloat16", "enforce_eager": bool}``, with ``"enable_prefix_caching": False``
        for a hybrid verifier on CPU.
    """
    if not on_cpu:
        return {"dtype": "bfloat16", "enforce_eager": False}
    text = _verifier_text_config(model) if model is not None else None
    settings = {"dtype": "bfloat16" if text is not None and cpu_bf16_only(text) else "float32", "enforce_eager": True}
    if text is not None and cpu_without_prefix_caching(text):
        settings["enable_prefix_caching"] = False
    return settings


def _verifier_text_config(model: str):
    """The text config of ``model``'s verifier (a drafter directory: the verifier its ``speculators_config``
    names); None when no config can be read there."""
    path = Path(model) / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    verifier = (raw.get("speculators_config") or {}).get("verifier", {}).get("name_or_path")
    try:
        return text_config(load_model_config(verifier or model))
    except (PeagleError, OSError, ValueError):
        return None


VLLM_EXPAND_PROBE = """
import json, os
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
import torch
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()  # as vLLM's worker does before any kernel runs
from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens
cu = torch.tensor([2, 5], dtype=torch.int32)  # 2 requests: 2 and 3 draft tokens
temperature = expand_batch_to_tokens(torch.tensor([0.75, 1.25]), cu, 5, replace_from=0, replace_to=1)
top_k = expand_batch_to_tokens(torch.tensor([5, 9], dtype=torch.int32), cu, 5)
print(json.dumps({"temperature": temperature.tolist(), "top_k": top_k.tolist()}))
"""
"""What :func:`probe_vllm_expand` runs in a child Python: vLLM's ``expand_batch_to_tokens`` (which gives every
draft token its request's temperature / top-k / top-p in the rejection sampler) with the platform's kernel
overrides registered, as vLLM's worker registers them."""

VLLM_EXPAND_EXPECTED = {"temperature": [0.75, 0.75, 1.25, 1.25, 1.25], "top_k": [5, 5, 9, 9, 9]}
"""The probe's exact answer: each request's value repeated once per draft token."""

VLLM_CPU_EXPAND_BUG = (
    "vLLM's CPU rejection sampler gives the draft tokens of a T > 0 request uninitialized memory as their "
    "temperature: its CPU shim of expand_kernel (vllm/utils/cpu_triton_utils.py, _expand_kernel_impl) lets the "
    "C++ kernel fill an int64 copy of the output (_ensure_int64) and never writes the float32 buffer that "
    "expand_batch_to_tokens (vllm/v1/sample/rejection_sampler.py) returns, so apply_sampling_constraints divides "
    "the verifier's logits by garbage and the target probabilities p are NaN, one-hot or flat: vLLM's acceptance "
    "counts and its sampled outputs at T > 0 are not the verifier's distribution (vLLM issue #55005, fix in PR "
    "#55006)")
"""Why vLLM's CPU speculative decoding at T > 0 is refused while :func:`probe_vllm_expand` is not exact."""


def vllm_on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here (imports vLLM: :func:`import_vllm`)."""
    import_vllm()
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


@functools.lru_cache(maxsize=1)
def probe_vllm_expand(timeout_s: float = 600.0) -> dict[str, list]:
    """Run :data:`VLLM_EXPAND_PROBE` in a child Python (this interpreter, vLLM's platform overrides kept out of
    this process); once per process.

    Returns:
        ``{"temperature": [5] floats, "top_k": [5] ints}``, to compare with :data:`VLLM_EXPAND_EXPECTED`.

    Raises:
        VllmStartError: the probe did not run (its last output lines).
    """
    env = {**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
    proc = subprocess.run([sys.executable, "-c", VLLM_EXPAND_PROBE], capture_output=True, text=True,
                          timeout=timeout_s, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise VllmStartError("could not check vLLM's rejection sampler at T > 0 (vLLM's expand_batch_to_tokens "
                             f"in a child Python, exit code {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(lines[-1])


def check_vllm_sampling(temperature: float, on_cpu: bool) -> str:
    """Whether vLLM's speculative decoding at ``temperature`` verifies drafts against the verifier's distribution
    on this platform. At T = 0 vLLM compares drafts with the verifier's argmax (no temperature is expanded);
    on an accelerator vLLM's Triton ``expand_kernel`` runs; on CPU its C++ shim does, which vLLM 0.32 gets
    wrong (:data:`VLLM_CPU_EXPAND_BUG`), so there :func:`probe_vllm_expand` decides.

    Returns:
        the check done, in words, for the report (``vllm_sampling_check``).

    Raises:
        InputError: T > 0 on a vLLM whose CPU probe is not exact (field ``--temperature``): the reason, and
            which numbers to trust instead. VllmStartError: the probe did not run.
    """
    if temperature == 0:
        return "not needed at T=0: greedy verification compares drafts with the verifier's argmax"
    if not on_cpu:
        return "not probed: on an accelerator vLLM's Triton expand_kernel gives draft tokens their temperature"
    got = probe_vllm_expand()
    if got != VLLM_EXPAND_EXPECTED:
        raise InputError(
            f"--engine vllm at --temperature {temperature:g} on CPU: {VLLM_CPU_EXPAND_BUG}. Probe: "
            f"expand_batch_to_tokens gave {got}, expected {VLLM_EXPAND_EXPECTED}. Trust peagle's own engine at "
            "T > 0 (--engine peagle: rejection sampling on the verifier's exact softmax, with the same "
            "--draft-sample-method), or measure vLLM at --temperature 0, or on an accelerator, or with a vLLM that "
            "has the fix", field="--temperature")
    return "vLLM's expand_batch_to_tokens probed on CPU: exact (vLLM issue #55005 fixed in this vLLM)"


def check_full_length(prompt_len: int, tokens: Sequence[int], max_new_tokens: int, eos: Iterable[int],
                      max_model_len: int) -> None:
    """A request that ended before ``max_new_tokens`` without an EOS was cut by ``max_model_len``
    (vLLM ends it as length-capped, without error): refused, as its counts would not match.

    Raises:
        InputError: names the lengths and the fix (fewer --max-new-tokens or shorter prompts).
    """
    if len(tokens) < max_new_tokens and not (tokens and tokens[-1] in set(eos)):
        raise InputError(f"a prompt of {prompt_len} tokens got {len(tokens)} of --max-new-tokens {max_new_tokens} "
                         f"before vLLM's max_model_len {max_model_len}; lower --max-new-tokens or shorten the "
                         "prompts", field="--max-new-tokens")


def vllm_generate(model: str, prompts: Sequence[list[int]], max_new_tokens: int, stop_token_ids: Sequence[int] = (),
                  speculative_config: dict[str, Any] | None = None, concurrency: int = 8,
                  turns: Callable[[list[list[int]]], list[list[int]]] | None = None,
                  max_model_len: int = 4096, timed: bool = True, log: Callable[[str], None] | None = None,
                  memory: VllmMemory = VllmMemory(), temperature: float = 0.0, seed: int = 0,
                  top_logits: bool = False, truncation: Truncation = Truncation()) -> VllmRun:
    """Start one vLLM engine on ``model`` (:func:`engine_settings`, seed 0, ``memory``), run ``prompts``,
    stop it. The engine starts as :func:`runtime.vllm_runtime.start_llm` starts it: its output on
    stderr while it runs (stdout stays peagle's), its root cause raised when it does not start.

    Args:
        model: the verifier directory or hub id, or (``speculators`` loading) the drafter directory.
        prompts: token-id prompts, one per request.
        max_new_tokens: ``max_tokens`` of each request (at ``temperature`` with ``truncation``'s top-k / top-p,
            given in each request; vLLM's other defaults from the model's ``generation_config.json`` are not applied,
            ``generation_config="vllm"``).
        stop_token_ids: EOS ids that end a request besides the tokenizer's (peagle's engine's set).
        speculative_config: vLLM's ``speculative_config`` (None: none, or whatever ``model``'s config sets).
        concurrency: C of the second timed pass (and the engine's ``max_num_seqs``).
        turns: when given, called with the outputs of the counted pass to build the next prompts (later
            prompt turns that take earlier answers as history), until it returns an empty list.
        timed: also run the concurrency-C pass (the counted pass is always timed as concurrency 1).
        memory: the engine's KV cache size / GPU memory share (:class:`runtime.vllm_runtime.VllmMemory`).
        temperature: 0 greedy; T > 0 samples, request i of the counted pass seeded :func:`request_seed`.
        top_logits: at T = 0, record the largest raw logits of every generated token (``VllmRun.top_logits``).

    Returns:
        a :class:`VllmRun`.

    Raises:
        VllmStartError: vLLM did not start (its root cause). InputError: ``memory`` options this platform has not.
    """
    vllm = import_vllm()
    log = log or (lambda m: None)
    start = time.perf_counter()
    kwargs = ({"speculative_config": speculative_config, "per_request_spec_decode_metrics": "detailed"}
              if speculative_config else {})
    tops = top_logits and temperature == 0
    if tops:
        kwargs["logprobs_mode"] = "raw_logits"
    from vllm.platforms import current_platform

    settings = engine_settings(current_platform.is_cpu(), model)
    if settings.get("enable_prefix_caching") is False:
        log(CPU_HYBRID_PREFIX_CACHING)
    with VllmOutput() as output:
        llm, mem = start_llm(memory, output, model=model, **settings, seed=0, max_model_len=max_model_len,
                             max_num_seqs=max(concurrency, 1), disable_log_stats=False, generation_config="vllm",
                             **kwargs)
        try:
            return _run_engine(vllm, llm, prompts, max_new_tokens, stop_token_ids, concurrency, turns,
                               max_model_len, timed, log, model, VllmRun(tokens=[], start_s=time.perf_counter() - start,
                                                                        engine_settings={**settings, **mem}),
                               temperature=temperature, seed=seed, tops=tops, truncation=truncation)
        finally:
            _shutdown(llm)


def _run_engine(vllm, llm, prompts, max_new_tokens, stop_token_ids, concurrency, turns, max_model_len, timed, log,
                model, run: VllmRun, *, temperature: float, seed: int, tops: bool,
                truncation: Truncation = Truncation()) -> VllmRun:
    """The passes of :func:`vllm_generate` on the started engine ``llm``, filling ``run`` (``tops``: record the
    top raw logits of every generated token; ``truncation``: each request's top-k / top-p)."""
    spec = llm.llm_engine.vllm_config.speculative_config
    run.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else None
    log(f"vLLM engine on {model} started in {run.start_s:.0f} s"
        + (f" (drafter {spec.model}, K={spec.num_speculative_tokens})" if spec is not None else ""))

    def params(index: int | None):  # request index of the counted pass (its seed at T > 0), None: unseeded
        return vllm.SamplingParams(temperature=temperature, max_tokens=max_new_tokens, top_k=truncation.top_k,
                                   top_p=truncation.top_p,
                                   stop_token_ids=list(stop_token_ids), logprobs=TOP_K if tops else None,
                                   seed=request_seed(seed, index) if temperature > 0 and index is not None else None)

    if tops:
        run.top_logits = []
    # later turns are built from the answers: the total is unknown until the last turn (runtime.progress)
    bar = progress(desc=f"vLLM {'speculative' if spec is not None else 'plain'} requests", unit="request")
    try:
        _generate(llm, [prompts[0]], vllm.SamplingParams(temperature=temperature, max_tokens=4))  # warm-up, untimed
        before = _counters(llm) if spec is not None else None
        all_prompts, elapsed, generated = [], 0.0, 0
        per_request: list[dict[str, list[int]]] = []
        batch = list(prompts)
        while batch:
            outs = []
            for p in batch:  # one request at a time: concurrency 1
                o, s = _generate(llm, [p], params(len(run.tokens) + len(outs)))
                check_full_length(len(p), o[0].outputs[0].token_ids, max_new_tokens, stop_token_ids, max_model_len)
                outs += o
                elapsed += s
                bar.update(1)
            all_prompts += batch
            run.tokens += [list(o.outputs[0].token_ids) for o in outs]
            if tops:
                run.top_logits += [top_logits_of(o) for o in outs]
            per_request += [_step_counts(o) or {} for o in outs]
            generated += sum(len(o.outputs[0].token_ids) for o in outs)
            batch = turns([list(o.outputs[0].token_ids) for o in outs]) if turns else []
        bar.close()  # the concurrency-C pass is one vLLM call, not counted here
        run.tokens_per_second[1] = generated / elapsed if elapsed else 0.0
        if spec is not None:
            run.counters = _delta(_counters(llm), before)
            run.per_request = per_request
        if timed and concurrency > 1:
            n = -(-max(len(all_prompts), concurrency) // concurrency) * concurrency
            many = [all_prompts[i % len(all_prompts)] for i in range(n)]
            outs, s = _generate(llm, many, params(None))
            run.tokens_per_second[concurrency] = sum(len(o.outputs[0].token_ids) for o in outs) / s
    finally:
        bar.close()
    return run


class VllmSpeculativeEngine:
    """One vLLM engine serving the verifier with the drafter (``speculative_config`` loading, greedy), kept for
    many requests: the Python API's ``engine="vllm"`` (:class:`~peagle_train.evaluate.inference.PEAGLEInference`).
    Settings as :func:`vllm_generate`'s (:func:`engine_settings`, seed 0, ``generation_config="vllm"``,
    per-request spec-decode metrics); vLLM is imported here.

    Raises:
        MissingDependencyError: no vLLM (names the set-up command). InputError: a vLLM that no longer serves
        P-EAGLE (from 0.34: :meth:`~peagle_train.train.kinds.DrafterKind.check_installed_vllm`), a verifier whose
        drafts this vLLM does not verify exactly on this platform (:func:`check_vllm_verifier`), before the
        engine starts.
    """

    def __init__(self, verifier_name: str, drafter_dir: str | Path, K: int, tokenizer, max_model_len: int = 4096,
                 max_num_seqs: int = 8, memory: VllmMemory | None = None):
        checkpoint_kind(drafter_dir).check_installed_vllm("engine")  # P-EAGLE from vLLM 0.34: refused
        vllm = import_vllm()
        from vllm.platforms import current_platform

        check_vllm_verifier(verifier_name, current_platform.is_cpu())
        self.vllm, self.K, self.max_model_len = vllm, int(K), max_model_len
        self.directory = str(resolve_model(verifier_name))
        self.eos = sorted(set(eos_ids(tokenizer, SimpleNamespace(generation_config=_generation_config(
            self.directory)))))
        self.settings = engine_settings(current_platform.is_cpu(), self.directory)
        # started as every vLLM engine of peagle is (runtime.vllm_runtime): memory, its log off stdout, its root cause
        self.output = VllmOutput()
        self.llm, mem = start_llm(memory or VllmMemory(), self.output, model=self.directory, **self.settings, seed=0,
                                  max_model_len=max_model_len, max_num_seqs=max_num_seqs, disable_log_stats=False,
                                  generation_config="vllm",
                                  speculative_config=checkpoint_kind(drafter_dir).speculative_config(
                                      str(drafter_dir), self.K),
                                  per_request_spec_decode_metrics="detailed")
        self.settings = {**self.settings, **mem}

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], dict[str, list[int]], float,
                                                                            dict[str, Any]]:
        """One greedy request alone (concurrency 1).

        Returns:
            ``(tokens, {"accepted": [...], "drafted": [...]} per step, wall seconds, the change of vLLM's
            spec-decode counters)``.
        """
        params = self.vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=self.eos)
        before = _counters(self.llm)
        outs, seconds = _generate(self.llm, [prompt_ids], params)
        tokens = list(outs[0].outputs[0].token_ids)
        check_full_length(len(prompt_ids), tokens, max_new_tokens, self.eos, self.max_model_len)
        return tokens, _step_counts(outs[0]) or {"accepted": [], "drafted": []}, seconds, \
            _delta(_counters(self.llm), before)

    def close(self) -> None:
        """Stop the engine's processes."""
        if getattr(self, "llm", None) is not None:
            _shutdown(self.llm)
            self.llm = None
        if getattr(self, "output", None) is not None:
            self.output.stop(wait_s=2.0)
            self.output = None


def _shutdown(llm) -> None:
    """Stop the engine's processes, so the next engine gets the memory and cores."""
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    del llm
    gc.collect()


def _generation_config(directory: str):
    """The verifier's ``generation_config.json`` (its EOS ids, as peagle's own engine reads them), or None."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(directory)
    except OSError:
        return None


def next_turn_prompts(tokenizer, prompts: Sequence[Prompt], eos: Iterable[int], order: list[tuple[int, int]],
                      answers: list[list[dict[str, Any]]], outputs: list[list[int]] | None,
                      modes: Sequence[dict[str, Any]] | None = None,
                      reasoning_parser: str | None = None) -> list[list[int]]:
    """The next turn's token-id prompts, given the greedy answers of the previous turn's requests.

    Args:
        prompts: the prompts read; eos: ids that end a turn (dropped from the history).
        order: ``(prompt index, turn)`` of each request so far; the new requests are appended.
        answers: per prompt, the answers so far; ``outputs``' are appended as the assistant messages a
            client of ``vllm serve --reasoning-parser reasoning_parser`` sends back, as peagle's own engine
            makes them (:func:`~peagle_train.evaluate.prompts.history_message`: never cleaned up, so
            ``x != y`` stays ``x != y`` in the next prompt).
        outputs: per request of the previous turn (the last ``len(outputs)`` of ``order``), the
            generated token ids; None: the first turn.
        modes: per prompt, the template's variables (vLLM's ``chat_template_kwargs``,
            :func:`~peagle_train.evaluate.prompts.prompt_modes`; None: none): each prompt's turns are rendered
            with its own and the reasoning parser reads them (``enable_thinking``, ``thinking``).
        reasoning_parser: vLLM's ``--reasoning-parser`` name the answers are parsed with (None: none).

    Returns:
        per prompt that has one more user turn, its rendered prompt token ids (empty: no turn left).
    """
    turn = 0
    if outputs is not None:
        for (i, t), tokens in zip(order[-len(outputs):], outputs):
            if t + 1 < len(prompts[i].user_turns):
                answers[i].append(history_message(tokenizer, tokens, eos, reasoning_parser, modes[i] if modes else None,
                                                  where=f"prompt {prompts[i].prompt_id!r} turn {t}"))
        turn = order[-1][1] + 1
    batch = []
    for i, p in enumerate(prompts):
        if turn < len(p.user_turns):
            order.append((i, turn))
            batch.append(render_turn(tokenizer, p, turn, answers[i], modes[i] if modes else None))
    return batch


@dataclass
class VllmReference:
    """The prompts as vLLM requests and vLLM's own greedy output for them (no drafter).

    Attributes:
        name: the verifier MODEL; directory: what vLLM loads; tokenizer; eos: ids that end a turn.
        prompts: the prompts read; order: ``(prompt index, turn)`` of each request; requests: their
            token ids (later turns with the reference answers as history); plain: the engine's run; modes: per
            prompt, its template variables (:func:`~peagle_train.evaluate.prompts.prompt_modes`).
    """

    name: str
    directory: str
    tokenizer: Any
    eos: set[int]
    prompts_file: str
    prompts: list
    order: list[tuple[int, int]]
    requests: list[list[int]]
    plain: VllmRun
    modes: list[dict[str, Any]] = field(default_factory=list)


def vllm_reference(verifier_name: str, prompts_file: str | Path, config: EvalConfig,
                   log: Callable[[str], None] = print) -> VllmReference:
    """Run every prompt turn through vLLM without a drafter (turn by turn, each later turn with the
    answers before it as history, as peagle's own engine does), timed at concurrency 1 and
    ``config.concurrency``; at ``config.temperature`` (T > 0: sampled, seeded per request from
    ``config.seed``); at T = 0 with each token's largest logits (the near-tie rule of
    :mod:`peagle_train.evaluate.identity`).

    Raises:
        MissingDependencyError: no vLLM. ModelNotFoundError: unknown verifier. InputError: bad prompts.
    """
    directory = str(resolve_model(verifier_name))
    tokenizer = load_tokenizer(verifier_name)
    eos = set(eos_ids(tokenizer, SimpleNamespace(generation_config=_generation_config(directory))))
    prompts = read_prompts(prompts_file, config.num_prompts)
    order: list[tuple[int, int]] = []
    answers: list[list[dict[str, Any]]] = [[] for _ in prompts]
    modes = prompt_modes(prompts, config.chat_template_kwargs, config.mode_variables(), config.seed)

    def next_turns(outputs: list[list[int]] | None) -> list[list[int]]:
        return next_turn_prompts(tokenizer, prompts, eos, order, answers, outputs, modes,
                                 config.reasoning_parser)

    plain = vllm_generate(directory, next_turns(None), config.online_max_new_tokens(), sorted(eos),
                          concurrency=config.concurrency, turns=next_turns, log=log, memory=config.vllm_memory,
                          temperature=config.temperature, seed=config.seed, top_logits=True,
                          truncation=served_truncation(verifier_name, config.top_k, config.top_p)[0])
    requests = [render_turn(tokenizer, prompts[i], t, answers[i][:t], modes[i]) for i, t in order]
    return VllmReference(name=str(verifier_name), directory=directory, tokenizer=tokenizer, eos=eos,
                         prompts_file=str(prompts_file), prompts=prompts, order=order, requests=requests, plain=plain,
                         modes=modes)


def vllm_speculative(ref: VllmReference, drafter_dir: str | Path, config: EvalConfig,
                     log: Callable[[str], None] = print, sampling_check: str | None = None) -> dict[str, Any]:
    """The requests of ``ref`` through vLLM with the drafter (loaded the ``config.vllm_loading`` way, K
    = ``config.num_draft_tokens`` or the drafter's ``num_depths``, at ``config.temperature`` with vLLM's
    ``draft_sample_method`` = ``config.draft_sample_method``): the report of :func:`run_vllm_eval`.

    Args:
        sampling_check: the caller's own check that vLLM samples exactly at ``config.temperature``, in words, for
            the report (a benchmark that fixes vLLM in its own process); None: :func:`check_vllm_sampling`.

    Raises:
        InputError: K above the drafter's ``num_depths``; an unknown draft sample method; T > 0 where vLLM's
        rejection sampler does not get the verifier's distribution (:func:`check_vllm_sampling`).
    """
    vllm = import_vllm()
    if sampling_check is None:
        sampling_check = check_vllm_sampling(config.temperature, vllm_on_cpu())
    kind = checkpoint_kind(drafter_dir)
    drafter = kind.load(drafter_dir)
    K = checked_num_draft_tokens(config.num_draft_tokens, drafter)
    del drafter
    method = check_draft_sample_method(config.draft_sample_method)
    truncation, sampling = served_truncation(ref.name, config.top_k, config.top_p)
    common = dict(stop_token_ids=sorted(ref.eos), concurrency=config.concurrency, log=log, memory=config.vllm_memory,
                  temperature=config.temperature, seed=config.seed, truncation=truncation)
    if config.vllm_loading == "speculative_config":
        spec = vllm_generate(ref.directory, ref.requests, config.online_max_new_tokens(), **common,
                             speculative_config={**kind.speculative_config(str(drafter_dir), K),
                                                 "draft_sample_method": method})
    else:  # vLLM reads speculators_config of the drafter and loads the verifier it names
        spec = vllm_generate(str(drafter_dir), ref.requests, config.online_max_new_tokens(), **common,
                             speculative_config={"num_speculative_tokens": K, "draft_sample_method": method})
    return {**vllm_report(drafter_dir, ref, spec, config, vllm.__version__), "sampling": sampling,
            "vllm_sampling_check": sampling_check}


def check_speculators_verifier(drafter_dir: str | Path, verifier_name: str) -> None:
    """With ``--vllm-loading speculators`` vLLM loads the verifier the drafter's ``config.json`` names
    (``speculators_config.verifier.name_or_path``), while the plain reference runs on ``verifier_name``:
    both must be the same model (:func:`~runtime.model_identity.model_fingerprint` of the resolved
    directories). Reads configs and hashes files only; no engine starts.

    Raises:
        InputError: the names resolve to different models, or the drafter's name does not resolve
            (names both and the fix: ``--vllm-loading speculative_config``).
    """
    config_file = Path(drafter_dir) / "config.json"
    named = ((json.loads(config_file.read_text()).get("speculators_config") or {}).get("verifier") or {}).get(
        "name_or_path")
    fix = ("pass --vllm-loading speculative_config (the verifier given to vLLM as the model, the drafter as "
           "speculative_config) or --verifier " + repr(named))
    if not named:
        raise InputError(f"--vllm-loading speculators: the drafter's speculators_config names no verifier; {fix}",
                         file=str(config_file), field="--vllm-loading")
    try:
        theirs = model_fingerprint(resolve_model(named))
    except ModelNotFoundError as e:
        raise InputError(f"--vllm-loading speculators: vLLM would load the verifier {named!r} the drafter names, "
                         f"which does not resolve here ({e}); {fix}", file=str(config_file),
                         field="--vllm-loading") from e
    if theirs != model_fingerprint(resolve_model(verifier_name)):
        raise InputError(f"--vllm-loading speculators: vLLM would load the verifier {named!r} that the drafter's "
                         f"speculators_config names, but the reference runs on --verifier {verifier_name!r}, a "
                         f"different model; {fix}", file=str(config_file), field="--verifier")


def check_vllm_verifier(verifier_name: str, on_cpu: bool) -> None:
    """Refuse a verifier whose speculative decoding this vLLM does not verify exactly on this platform: on CPU a
    Mamba-2 hybrid (:data:`runtime.vllm_runtime.CPU_MAMBA2_SPECULATION`), before any engine starts.

    Raises:
        InputError: field ``--engine``: the reason, and what to measure with instead.
    """
    text = _verifier_text_config(verifier_name) if on_cpu else None
    kind = cpu_speculation_not_lossless(text) if text is not None else None
    if kind is not None:
        raise InputError(f"--engine vllm on CPU with a {kind} hybrid verifier ({text.model_type}): "
                         f"{CPU_MAMBA2_SPECULATION}. Measure with peagle's own engine (--engine peagle: exact, the "
                         "recurrent state put back after each rejected draft), or with vLLM on a GPU",
                         field="--engine")


def run_vllm_eval(drafter_dir: str | Path, verifier_name: str | None, prompts_file: str | Path,
                  config: EvalConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The online report of ``peagle-eval`` (same keys; docs/design.md §9), measured by vLLM.

    Args:
        drafter_dir: a drafter checkpoint (or a peagle-train output).
        verifier_name: MODEL; None: the drafter's verifier.
        config: ``max_new_tokens``, ``num_prompts``, ``num_draft_tokens`` (K; default the drafter's
            ``num_depths``), ``temperature`` and ``seed`` (T > 0: every request seeded, :func:`request_seed`),
            ``draft_sample_method`` (vLLM's speculative config field), ``concurrency`` (C of the second
            throughput measurement), ``vllm_loading`` (:data:`~peagle_train.evaluate.config.VLLM_LOADINGS`).

    Returns:
        ``acceptance_length``, ``acceptance_rate``, ``per_position_acceptance`` / ``_accepted`` /
        ``_reached``, ``num_drafts``, ``drafted``, ``accepted``, ``identical_to_greedy``,
        ``mismatches``, ``near_tie_divergences`` / ``near_tie_prompts`` / ``greedy_check`` (T = 0: token
        identity decided as the engine's dtype allows, :mod:`peagle_train.evaluate.identity`; None / empty at
        T > 0), ``draft_sample_method``, ``acceptance_scheme``,
        ``tokens_per_second`` / ``baseline_tokens_per_second`` / ``speedup`` (concurrency 1),
        ``throughput`` (per concurrency: ``plain``, ``speculative`` tokens/s and ``speedup``),
        ``vllm_counters`` (vLLM's own names), ``per_prompt`` (per turn: ``text``, ``reference_text``,
        vLLM's per-step ``accepted`` / ``drafted``), ``engine: "vllm"``, ``vllm_version``, ``loading``,
        ``vllm_sampling_check`` (:func:`check_vllm_sampling`).

    Raises:
        MissingDependencyError: no vLLM (names the set-up command). InputError: a vLLM that no longer serves
        P-EAGLE (from 0.34: :meth:`~peagle_train.train.kinds.DrafterKind.check_installed_vllm`), an unknown loading or draft
        sample method, K above the drafter's ``num_depths``, T > 0 where vLLM's rejection sampler does not get
        the verifier's distribution (:func:`check_vllm_sampling`), a verifier whose drafts vLLM does not verify
        exactly on this platform (:func:`check_vllm_verifier`), each before any engine starts.
    """
    found, note = find_drafter(drafter_dir)
    checkpoint_kind(found).check_installed_vllm()  # P-EAGLE from vLLM 0.34: refused
    check_draft_sample_method(config.draft_sample_method)
    if config.vllm_loading not in VLLM_LOADINGS:
        raise InputError(f"{config.vllm_loading!r}: expected one of {VLLM_LOADINGS}", field="--vllm-loading")
    check_vllm_sampling(config.temperature, vllm_on_cpu())
    if note:
        log(note)
    name = verifier_name or load_drafter_of_kind(found).config.verifier_name_or_path
    if not name:
        raise InputError("the drafter's config names no verifier; pass one", field="--verifier")
    check_vllm_verifier(name, vllm_on_cpu())
    if config.vllm_loading == "speculators":
        check_speculators_verifier(found, name)
    return vllm_speculative(vllm_reference(name, prompts_file, config, log), found, config, log)


def per_position_counts(counters: dict[str, Any], K: int) -> tuple[list[int], list[int]] | None:
    """Per draft position i < K: (accepted, reached) from vLLM's counters (:data:`SPEC_METRICS` keys).

    vLLM exports accepted drafts per position but not drafts per position
    (``SpecDecodingStats.num_draft_tokens_per_pos`` is not a metric): ``reached[i] = num_drafts`` holds
    only when every draft step drafted K tokens, i.e. ``num_draft_tokens == K * num_drafts``.

    Returns:
        ``(accepted_per_pos [K], reached [K])`` as ints; None when some step drafted fewer than K
        (per-position rates are then not known and are not reported).
    """
    drafts = counters["num_drafts"]
    if counters["num_draft_tokens"] != K * drafts:
        return None
    return (counters["accepted_per_pos"] + [0] * K)[:K], [drafts] * K


def vllm_report(found, ref: VllmReference, spec: VllmRun, config: EvalConfig, version: str) -> dict[str, Any]:
    """The report of :func:`run_vllm_eval` from the reference run ``ref`` and the run with the drafter ``spec``
    (T = 0: each turn compared with :func:`~peagle_train.evaluate.identity.compare_to_greedy` in the
    engine's dtype, from the reference's top logits)."""
    prompts, plain, tokenizer, eos = ref.prompts, ref.plain, ref.tokenizer, ref.eos
    c = spec.counters
    K = spec.num_speculative_tokens
    drafts = c["num_drafts"]
    counts = per_position_counts(c, K)
    per_pos, reached = counts if counts is not None else (None, None)
    T = config.temperature
    dtype = spec.engine_settings.get("dtype", "float32")
    checks: list[tuple[str, dict[str, Any]]] = []
    per_prompt = []
    tops = plain.top_logits or [None] * len(plain.tokens)
    rows = sorted(zip(ref.order, ref.requests, plain.tokens, spec.tokens, spec.per_request, tops), key=lambda r: r[0])
    for (i, t), ids, base, got, steps, top in rows:  # prompt by prompt, turn by turn, as peagle's own report
        check = compare_to_greedy(got, base, top, dtype) if T == 0 else None  # samples differ at T > 0
        if check is not None:
            checks.append((prompts[i].prompt_id, check))
        per_prompt.append({
            "prompt_id": prompts[i].prompt_id, "turn": t, "prompt_tokens": len(ids), "new_tokens": len(base),
            "spec_new_tokens": len(got), "verifier_steps": len(steps.get("accepted", [])),
            "accepted": sum(steps.get("accepted", [])), "drafted": sum(steps.get("drafted", [])),
            "num_drafts": sum(1 for k in steps.get("drafted", []) if k > 0),
            "chat_template_kwargs": dict(ref.modes[i]) if ref.modes else dict(config.chat_template_kwargs or {}),
            "identical_to_greedy": None if check is None else check["identical"],
            "divergence": None if check is None else check["divergence"], "user": prompts[i].user_turns[t],
            "text": turn_text(tokenizer, got, eos), "reference_text": turn_text(tokenizer, base, eos),
            "finish_reason": "stop" if got and got[-1] in eos else "length",
            "vllm_steps": steps,
        })
    identity = greedy_check_summary(dtype, checks) if T == 0 else {
        "identical_to_greedy": None, "near_tie_divergences": None, "near_tie_prompts": [], "mismatches": [],
        "greedy_check": None}

    def ratio(a, b):
        return a / b if b else None

    throughput = {str(n): {"plain": plain.tokens_per_second.get(n), "speculative": spec.tokens_per_second.get(n),
                           "speedup": ratio(spec.tokens_per_second.get(n), plain.tokens_per_second.get(n))}
                  for n in sorted(set(plain.tokens_per_second) | set(spec.tokens_per_second))}
    return {
        "drafter": str(found), "verifier": ref.name, "prompts": ref.prompts_file, "engine": "vllm",
        "vllm_version": version, "loading": config.vllm_loading,
        "vllm_dtype": spec.engine_settings.get("dtype"),
        "vllm_enforce_eager": spec.engine_settings.get("enforce_eager"),
        "vllm_memory": {k: spec.engine_settings[k] for k in ("kv_cache_memory_bytes", "gpu_memory_utilization")
                        if k in spec.engine_settings},
        "acceptance_length": 1.0 + (c["num_accepted_tokens"] / drafts if drafts else 0.0),
        "acceptance_rate": ratio(c["num_accepted_tokens"], c["num_draft_tokens"]),
        "per_position_acceptance": [ratio(a, r) for a, r in zip(per_pos, reached)] if counts else None,
        "per_position_accepted": per_pos,
        "per_position_reached": reached,
        "per_position_note": None if counts else (
            f"vLLM drafted {c['num_draft_tokens']} tokens in {drafts} steps, not K={K} at each, and does not "
            "export drafts per position: per-position figures are not reported"),
        "num_draft_tokens": K,
        "drafted": c["num_draft_tokens"],
        "accepted": c["num_accepted_tokens"],
        "num_drafts": drafts,
        "generated_tokens": sum(len(t) for t in spec.tokens),
        "tokens_per_second": spec.tokens_per_second.get(1),
        "baseline_tokens_per_second": plain.tokens_per_second.get(1),
        "speedup": throughput.get("1", {}).get("speedup"),
        "throughput": throughput,
        "concurrency": [int(n) for n in throughput],
        "engine_start_s": {"plain": plain.start_s, "speculative": spec.start_s},
        "vllm_counters": {SPEC_METRICS[k]: v for k, v in c.items()},
        **identity,
        "temperature": T,
        "seed": config.seed if T > 0 else None,
        "draft_sample_method": config.draft_sample_method if T > 0 else None,
        "acceptance_scheme": acceptance_scheme(T, config.draft_sample_method),
        "num_prompts": len(prompts),
        "num_turns": len(per_prompt),
        "max_new_tokens": config.online_max_new_tokens(),
        **({"per_mode": per_mode_report(per_prompt)} if config.mode_variables() else {}),
        "per_prompt": per_prompt,
    }
