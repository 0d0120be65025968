"""vLLM's rejection sampler at T > 0, traced from inside: what it was given and what it decided, step by step.

vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so its functions can be wrapped: every call of
``RejectionSampler.forward`` (vllm/v1/sample/rejection_sampler.py) logs the draft ids, the verifier's
``p = softmax(logits / T)`` computed here from the raw logits vLLM got (at each draft, its argmax), the draft
probabilities q vLLM kept (``probabilistic``), and the tokens it emitted; every call of
``sample_recovered_tokens`` logs the target probabilities vLLM itself used (after ``apply_sampling_constraints``)
at the token it recovered. Printed (JSON, one line): draft positions reached, drafts accepted (a step's emitted
tokens but one, as vLLM counts; its counters beside), the acceptance the rejection rule expects from this p
(``Σ a`` with ``a = p(d)`` for ``greedy``, ``Σ min(p, q)`` for ``probabilistic``), ``z = (accepted - expected) /
sqrt(Σ a (1 - a))``, and how many recovered tokens vLLM drew from a target row that is NaN.

``--fix-cpu-expand`` replaces vLLM 0.32's CPU ``expand_kernel`` shim (vllm/utils/cpu_triton_utils.py), which
leaves draft tokens' temperatures uninitialized (vLLM issue #55005), by PR #55006's semantics, to see the rest of
vLLM's path alone.

    python bench/trace_vllm_rejection.py --drafter DRAFTER --draft-sample-method greedy --temperature 1 \\
        --num-prompts 6 --max-new-tokens 48 [--fix-cpu-expand] [--trace trace.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM is imported: its engine in this process
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

import torch  # noqa: E402
import vllm  # noqa: E402
from transformers import GenerationConfig  # noqa: E402
from vllm.utils import cpu_triton_utils  # noqa: E402
from vllm.v1.sample import rejection_sampler  # noqa: E402

from peagle_train.generate.render import eos_ids
from peagle_train.evaluate.prompts import read_prompts, render_turn  # noqa: E402
from runtime.model_cache import load_tokenizer, resolve_model  # noqa: E402

STEPS: list[dict] = []
RECOVERED: list[dict] = []
_forward = rejection_sampler.RejectionSampler.forward
_sample_recovered = rejection_sampler.sample_recovered_tokens


def traced_forward(self, metadata, draft_probs, logits, sampling_metadata):
    """``RejectionSampler.forward`` on copies of its inputs (it scales logits in place), then the step's log."""
    out = _forward(self, metadata, None if draft_probs is None else draft_probs.clone(), logits.clone(),
                   sampling_metadata)
    T = float(sampling_metadata.temperature[0]) if sampling_metadata.temperature is not None else 0.0
    p = torch.softmax(logits[metadata.target_logits_indices].float() / (T or 1.0), -1)  # [drafts, V]
    d = metadata.draft_token_ids.long()  # [drafts]
    step = {"draft": d.tolist(), "p_draft": p.gather(1, d[:, None])[:, 0].tolist(), "p_argmax": p.argmax(-1).tolist(),
            "out": out.sampled_token_ids[0].tolist(), "temperature": T}
    if draft_probs is not None:
        q = draft_probs.float()  # [drafts, V]
        step["q_draft"] = q.gather(1, d[:, None])[:, 0].tolist()
        step["overlap"] = torch.minimum(p, q).sum(-1).tolist()
    STEPS.append(step)
    return out


def traced_sample_recovered(max_spec_len, num_draft_tokens, cu, draft_ids, draft_probs, target_probs, *args, **kw):
    """``sample_recovered_tokens``, logging vLLM's own target probabilities at the tokens it recovered."""
    got = _sample_recovered(max_spec_len, num_draft_tokens, cu, draft_ids, draft_probs, target_probs, *args, **kw)
    RECOVERED.append({"draft": draft_ids.tolist(), "recovered": got.tolist(),
                      "p_recovered": target_probs.gather(1, got.long()[:, None])[:, 0].tolist()})
    return got


def expand_fixed(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM PR #55006's CPU expand_kernel: each request's value once per token, written at the output's dtype."""
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[:expanded.shape[0]].copy_(expanded)


def summary(method: str, counters: dict) -> dict:
    """Reached / accepted draft positions of the traced steps and the acceptance the rule expects from p."""
    reached = accepted = 0
    expected = variance = 0.0
    for s in STEPS:
        if not s["draft"]:
            continue
        kept = sum(1 for t in s["out"] if t >= 0) - 1  # vLLM's count: emitted tokens but the recovered / bonus one
        accepted += kept
        for i in range(min(kept + 1, len(s["draft"]))):  # positions reached
            reached += 1
            a = s["p_draft"][i] if method == "greedy" else s["overlap"][i]  # the rule's acceptance probability
            expected, variance = expected + a, variance + a * (1 - a)
    rows = [x for r in RECOVERED for x in r["p_recovered"]]
    return {"draft_sample_method": method, "steps": sum(1 for s in STEPS if s["draft"]), "reached": reached,
            "accepted": accepted, "expected": round(expected, 2),
            "z": round((accepted - expected) / variance ** 0.5, 2) if variance else None, "vllm_counters": counters,
            "recovered_rows": len(rows), "recovered_from_nan_rows": sum(1 for x in rows if x != x)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--prompts", default="examples/prompts.jsonl")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--draft-sample-method", choices=("greedy", "probabilistic"), default="greedy")
    ap.add_argument("--fix-cpu-expand", action="store_true")
    ap.add_argument("--trace", help="write every traced step here (JSON)")
    a = ap.parse_args()
    rejection_sampler.RejectionSampler.forward = traced_forward
    rejection_sampler.sample_recovered_tokens = traced_sample_recovered
    if a.fix_cpu_expand:
        cpu_triton_utils._expand_kernel_impl = expand_fixed  # read when the engine registers its overrides
    directory = str(resolve_model(a.verifier))
    tokenizer = load_tokenizer(a.verifier)
    spec = {"model": a.drafter, "method": "eagle3", "parallel_drafting": True,
            "num_speculative_tokens": a.num_draft_tokens, "draft_sample_method": a.draft_sample_method}
    llm = vllm.LLM(model=directory, speculative_config=spec, dtype="float32", enforce_eager=True, seed=0,
                   max_model_len=2048, max_num_seqs=1, generation_config="vllm", kv_cache_memory_bytes=2 << 30,
                   disable_log_stats=False)
    stop = eos_ids(tokenizer, SimpleNamespace(generation_config=GenerationConfig.from_pretrained(directory)))
    for i, prompt in enumerate(read_prompts(a.prompts, a.num_prompts)):
        params = vllm.SamplingParams(temperature=a.temperature, max_tokens=a.max_new_tokens, stop_token_ids=stop,
                                     seed=1000 + i)
        llm.generate([{"prompt_token_ids": render_turn(tokenizer, prompt, 0, [])}], params, use_tqdm=False)
    counters = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics()
                if m.name.startswith("vllm:spec_decode")}
    if a.trace:
        with open(a.trace, "w") as f:
            json.dump({"steps": STEPS, "recovered": RECOVERED}, f)
    print(json.dumps(summary(a.draft_sample_method, counters)))
    print("done", file=sys.stderr)


if __name__ == "__main__":
    main()
