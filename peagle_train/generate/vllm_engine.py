"""vLLM as a speculative decoding engine: one engine on the verifier, with or without the drafter, its
settings, passes and counters (docs/design.md §9); :class:`VllmSpeculativeEngine` is the Python API's
``engine="vllm"``, :func:`vllm_generate` the engine of ``peagle-eval --engine vllm``
(:mod:`peagle_train.evaluate.vllm_eval`).

vLLM is imported only here, and only when an engine runs (it pins its own transformers, so it lives
in its own environment: ``PEAGLE_VLLM=1 bash scripts/setup_env.sh`` makes ``.venv-vllm``).

At T > 0 on CPU speculative decoding is refused, before any engine starts, while vLLM's CPU rejection sampler gives
draft tokens uninitialized memory as their temperature (:func:`check_vllm_sampling`, :data:`VLLM_CPU_EXPAND_BUG`:
vLLM 0.32, issue #55005): a child Python probes vLLM's ``expand_batch_to_tokens`` as vLLM's worker runs it.
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

from peagle_train.generate.identity import TOP_K
from peagle_train.generate.render import eos_ids
from peagle_train.generate.speculative import Truncation
from peagle_train.train.kinds import checkpoint_kind
from stores.errors import InputError, PeagleError
from runtime.model_config import load_model_config, text_config
from runtime.model_cache import resolve_model
from runtime.progress import progress
from runtime.vllm_runtime import (CPU_HYBRID_PREFIX_CACHING, CPU_MAMBA2_SPECULATION, VLLM_SETUP, VllmMemory,
                                         VllmOutput, VllmStartError, cpu_bf16_only,
                                         cpu_speculation_not_lossless, cpu_without_prefix_caching, start_llm)
from runtime.vllm_runtime import import_vllm as import_vllm_module

__all__ = ["VLLM_SETUP", "SPEC_METRICS", "VllmRun", "import_vllm", "vllm_generate", "engine_settings",
           "check_full_length", "request_seed", "top_logits_of", "VLLM_EXPAND_PROBE", "VLLM_EXPAND_EXPECTED",
           "VLLM_CPU_EXPAND_BUG", "probe_vllm_expand", "check_vllm_sampling", "check_vllm_verifier", "vllm_on_cpu",
           "verifier_generation_config", "VllmSpeculativeEngine"]


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
            of vLLM's :data:`~peagle_train.generate.identity.TOP_K` largest raw logits
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
    many requests: the Python API's ``engine="vllm"`` (:class:`~peagle_train.generate.inference.PEAGLEInference`).
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
        self.eos = sorted(set(eos_ids(tokenizer, SimpleNamespace(generation_config=verifier_generation_config(
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


def verifier_generation_config(directory: str):
    """The verifier's ``generation_config.json`` (its EOS ids, as peagle's own engine reads them), or None."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(directory)
    except OSError:
        return None


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


