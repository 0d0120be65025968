"""Speculative sampling at T > 0 as vLLM serves it: vLLM's acceptance, replayed with peagle's formulas.

A drafter is trained briefly for SmolLM2-135M (16 ShareGPT conversations, 80 steps, K = 3, draft vocab 2,048)
and ``peagle-eval``'s vLLM engine runs the example prompts at T = 1 (seeded requests) without the drafter and
with it, once per ``draft_sample_method`` (vLLM's field: ``greedy``, its default, and ``probabilistic``).

vLLM's outputs are random, but each step's acceptance probability is not: replaying every vLLM step with peagle's
verifier and drafter on the tokens vLLM emitted (float32 both), draft i of a step that reached it is kept with
probability ``a_i = p_i(d_i)`` under ``greedy`` (``d_i`` the drafter's argmax, which must equal every draft
vLLM accepted) and ``a_i = Σ_x min(p_i(x), q_i(x))`` under ``probabilistic`` (``q_i`` the drafter's softmax at
T), where ``p_i`` is the verifier's softmax at T after the step's input and the drafts before i (all accepted,
so known from vLLM's output). The accepted indicators minus ``a_i`` are martingale differences, so
``z = Σ (accepted - a) / sqrt(Σ a (1 - a))`` is about standard normal when vLLM accepts as peagle computes;
|z| < 4 is asserted (a scheme that kept greedy drafts with min(1, p/q) of the drafter's soft q, or with
probability 1 at the argmax, is far outside). Steps that could end the output (a draft past ``max_new_tokens``,
an EOS) are left out: vLLM counts acceptances there that its output then cuts.

Then peagle's own engine at T = 1 on the same request token ids (several seeds) against vLLM's counters: the
acceptance rates agree within 4 combined binomial standard errors (an approximate tolerance: acceptances
within a step are not independent).

Both fail on vLLM 0.32 CPU (2026-12-02, this drafter, 6 requests x 48 tokens): vLLM accepts far fewer drafts
than the rule predicts: ``greedy`` 0 accepted at 352 replayed positions where peagle's p(d) sum to 3.1 (z -1.9;
too few uncertain positions for the test's power guard), 0 of 1,128 drafts in vLLM's counters against peagle's
engine 73 of 2,961 (0.025); ``probabilistic`` 10 against Σ min(p, q) = 51.1 (z -6.4), 10 of 1,098 drafts
(0.009) against peagle's engine 118 of 2,859 (0.041). vLLM's CPU rejection
kernel (``cpu_triton_utils._rejection_random_sample_kernel_impl``) accepts and resamples correctly on
hand-made inputs, so the difference is upstream of it (the drafts or the probabilities vLLM feeds it at
T > 0); not resolved. Marked xfail (not strict) with that reason, so the discrepancy stays visible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              # about 27 minutes (a drafter trained, vLLM run twice, every step replayed): beyond CI's time budget
              # while its two comparisons are an open investigation (xfail below); run it by hand
              pytest.mark.skipif(os.environ.get("PEAGLE_LONG_VLLM") != "1",
                                 reason="vLLM T > 0 investigation (~27 min): set PEAGLE_LONG_VLLM=1 to run it")]

VLLM_CPU_T_GT_0 = pytest.mark.xfail(
    strict=False, reason="vLLM 0.32 CPU accepts far fewer drafts at T > 0 than Leviathan's rule on peagle's replay "
                         "(module docstring): unresolved, issue 33")

REPO = Path(__file__).resolve().parents[3]
K = 3
T = 1.0
MAX_NEW_TOKENS = 48
METHODS = ("greedy", "probabilistic")

SCRIPT = '''
import json, sys
import peagle_train.evaluate.vllm_engine as ve
from peagle_train.evaluate.config import EvalConfig

runs = []
_generate = ve.vllm_generate


def keep(*args, **kwargs):  # the VllmRun behind each report: its token ids and per-step counts
    run = _generate(*args, **kwargs)
    runs.append(run)
    return run


if __name__ == "__main__":  # vLLM spawns its engine process: the script must be importable without running
    job = json.load(open(sys.argv[1]))
    ve.vllm_generate = keep
    settings = dict(max_new_tokens=job["max_new_tokens"], engine="vllm", concurrency=1, temperature=job["T"],
                    seed=5, num_draft_tokens=job["K"])
    ref = ve.vllm_reference("smollm2-135m", job["prompts"], EvalConfig(**settings))
    out = {"requests": ref.requests, "eos": sorted(ref.eos), "cases": {}}
    for method in job["methods"]:
        report = ve.vllm_speculative(ref, job["drafter"], EvalConfig(**settings, draft_sample_method=method))
        run = runs[-1]
        out["cases"][method] = {"report": report, "tokens": run.tokens, "per_request": run.per_request}
    json.dump(out, open(sys.argv[2], "w"), default=str)
'''


def _run(cmd, args):
    result = CliRunner().invoke(cmd, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    """Train the drafter, run the vLLM script; returns ``(drafter final/, vLLM's results)``."""
    from cli.data import main as data_main
    from cli.train import main as train_main

    work = tmp_path_factory.mktemp("sampled")
    _run(data_main, ["pack", "sharegpt", "--tokenizer", "smollm2-135m", "--output", work / "packed", "--limit", 16,
                     "--max-seq-len", 256, "--max-windows", 1])
    _run(data_main, ["extract", work / "packed", "--verifier", "smollm2-135m", "--output", work / "s.zarr",
                     "--layers", "2,15,27"])
    _run(train_main, ["--store", work / "s.zarr", "--output", work / "d", "--max-steps", 80, "--num-depths", K,
                      "--val-fraction", 0, "--draft-vocab-size", 2048])
    drafter = work / "d" / "final"
    job = {"prompts": str(REPO / "examples" / "prompts.jsonl"), "max_new_tokens": MAX_NEW_TOKENS, "T": T, "K": K,
           "drafter": str(drafter), "methods": list(METHODS)}
    (work / "job.json").write_text(json.dumps(job))
    (work / "sample.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(work / "sample.py"), str(work / "job.json"), str(work / "out.json")],
                          env=env, cwd=work, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return drafter, json.loads((work / "out.json").read_text())


@pytest.fixture(scope="module")
def models(sampled):
    from peagle_train.model.checkpoint import load_drafter
    from stores.model_cache import load_verifier

    return load_verifier("smollm2-135m", dtype=torch.float32, device="cpu"), load_drafter(sampled[0]).eval()


@torch.no_grad()
def replay(verifier, drafter, prompt: list[int], tokens: list[int], steps: dict, method: str, eos: set[int]):
    """vLLM's steps of one request replayed: per reached draft position ``(accepted, a)`` with ``a`` peagle's
    acceptance probability (module docstring), and the number of vLLM-accepted drafts that equal peagle's
    greedy drafts (greedy only) out of those checked."""
    from peagle_train.evaluate.speculative import DrafterSession, aux_features
    from peagle_train.evaluate.verifier import aux_hidden_states, crop_cache, rollback_cache, verifier_pass

    layers, ids = drafter.config.aux_layer_ids, drafter.draft_ids
    events, same, checked = [], 0, 0
    with aux_hidden_states(verifier) as last:
        cache, session = rollback_cache(verifier), DrafterSession(drafter)
        _, hs = verifier_pass(verifier, torch.tensor(prompt), cache, want_hidden=True, last_only=True)
        read = len(prompt)
        new_tokens = torch.tensor(prompt[1:] + tokens[:1])
        new_aux = aux_features(hs, last, layers)
        pos = 1  # tokens emitted so far
        for acc, drafted in zip(steps["accepted"], steps["drafted"]):
            assert drafted == K
            if pos + K + 1 > len(tokens) or any(t in eos for t in tokens[pos:pos + K + 1]):
                break  # this step could end the output: vLLM's counts there are cut (module docstring)
            draft_logits = session.draft(new_tokens, new_aux, K).float()  # [K, D]
            emitted = tokens[pos:pos + acc + 1]
            logits, hs = verifier_pass(verifier, torch.tensor(tokens[pos - 1:pos + acc]), cache, want_hidden=True)
            for i in range(min(acc + 1, K)):  # positions reached: 0..acc (acc < K), or all K
                p = torch.softmax(logits[i] / T, -1)  # [V]
                if method == "greedy":
                    d = int(ids[draft_logits[i].argmax()])
                    a = float(p[d])
                    if i < acc:
                        checked += 1
                        same += int(tokens[pos + i] == d)
                else:
                    q = torch.softmax(draft_logits[i] / T, -1)  # [D]
                    a = float(torch.minimum(p[ids], q).sum())
                events.append((int(i < acc), a))
            read += acc + 1
            crop_cache(cache, read)
            new_tokens, new_aux = torch.tensor(emitted), aux_features(hs, last, layers)[:acc + 1]
            pos += acc + 1
    return events, same, checked


@pytest.mark.parametrize("method", METHODS)
def test_engine_vllm_runs_t_gt_0_and_names_the_scheme(sampled, method):
    """``--engine vllm`` at T = 1: vLLM got the scheme (its report says which) and samples are not compared."""
    report = sampled[1]["cases"][method]["report"]
    assert report["temperature"] == T and report["draft_sample_method"] == method and report["seed"] == 5
    assert f"draft_sample_method={method}" in report["acceptance_scheme"]
    assert report["identical_to_greedy"] is None and report["mismatches"] == []
    assert report["drafted"] > 0 and report["num_drafts"] > 0


@VLLM_CPU_T_GT_0
@pytest.mark.parametrize("method", METHODS)
def test_vllm_accepts_with_peagles_probabilities(sampled, models, method):
    _, out = sampled
    case = out["cases"][method]
    verifier, drafter = models
    events, same, checked = [], 0, 0
    for prompt, tokens, steps in zip(out["requests"], case["tokens"], case["per_request"]):
        e, s, c = replay(verifier, drafter, prompt, tokens, steps, method, set(out["eos"]))
        events += e
        same, checked = same + s, checked + c
    acc = torch.tensor([e[0] for e in events], dtype=torch.float64)
    a = torch.tensor([e[1] for e in events], dtype=torch.float64)
    var = float((a * (1 - a)).sum())
    z = float((acc - a).sum()) / var ** 0.5
    print(f"{method}: {len(events)} positions, accepted {int(acc.sum())}, expected {float(a.sum()):.1f}, "
          f"var {var:.1f}, z {z:.2f}; greedy drafts equal {same}/{checked}")
    assert var > 5, "too few uncertain acceptances for the test to mean anything"
    assert abs(z) < 4, z
    if method == "greedy":
        assert same == checked > 0  # every draft vLLM accepted is peagle's greedy draft
        # kept with min(1, p/q) of the drafter's soft q instead would accept far more often than p(d)
        assert float(acc.sum()) < float(a.sum()) + 4 * var ** 0.5


@VLLM_CPU_T_GT_0
@pytest.mark.parametrize("method", METHODS)
def test_peagles_engine_accepts_as_vllm_at_temperature_one(sampled, models, method):
    from peagle_train.evaluate.speculative import speculative_generate

    _, out = sampled
    verifier, drafter = models
    c = out["cases"][method]["report"]
    acc = dra = 0
    for seed in range(3):
        for i, prompt in enumerate(out["requests"]):
            g = torch.Generator().manual_seed(1000 * seed + i)
            r = speculative_generate(verifier, drafter, prompt, MAX_NEW_TOKENS, K, set(out["eos"]), T, g,
                                     draft_sample_method=method)
            acc, dra = acc + r.accepted, dra + r.drafted
    ours, theirs = acc / dra, c["accepted"] / c["drafted"]
    se = (ours * (1 - ours) / dra + theirs * (1 - theirs) / c["drafted"]) ** 0.5
    print(f"{method}: peagle {acc}/{dra} = {ours:.3f}, vLLM {c['accepted']}/{c['drafted']} = {theirs:.3f}, se {se:.3f}")
    assert abs(ours - theirs) < 4 * se
