"""Drafters trained by the pipeline, served by a real vLLM engine on the real SmolLM2 verifier.

One small pipeline (16 ShareGPT conversations, first window of 256 tokens) is packed once; stores of
3 (``2,15,27``, EAGLE-3's default), 2 (``15,30``) and 4 (``2,15,27,30``) aux layers are extracted
from it (30 = L: the last decoder layer's output before the final norm, as vLLM feeds it), and a
drafter is trained on each (K = 3, a few dozen steps). vLLM runs in a subprocess script with a
``__main__`` guard (it spawns its engine process): once without a drafter, then once per case,
loading the drafter either way users do:

| case | aux layers | draft vocab | loading |
|---|---|---|---|
| ``3aux-reduced`` | 2, 15, 27 | 2,048 | ``speculative_config`` (and ``speculators`` through ``peagle-eval --engine vllm``) |
| ``2aux-reduced`` | 15, 30 | 2,048 | ``speculative_config`` |
| ``4aux-full`` | 2, 15, 27, 30 | 49,152 | ``speculators`` (``LLM(model=final/)``, verifier from ``speculators_config``) |
| ``qwen3-2-layer`` | 2, 15, 27 | 2,048 | ``speculative_config`` (``--drafter-layer qwen3 --num-layers 2``: vLLM's ``Eagle3Qwen3ForCausalLM``) |

Each case varies what the others hold (aux layers 2/3/4, the reduced and the full vocabulary, both loadings, the
Llama and the Qwen3 layer, one and two layers): four drafters and engines where six held the same claims.

A DFlash drafter (``--method dflash --block-size K+1`` on the 3-aux store, draft vocab 2,048) is served too, in the
same script with vLLM's ``method: dflash`` (one engine start more): its greedy output equals vLLM's without a drafter,
every step drafting K.

Each P-EAGLE case asserts (a) vLLM's greedy output with the drafter equals its output without it, token for
token, and (b) vLLM's counters equal peagle's speculative decoding of the same request token ids, step
by step: vLLM drafts K at every step and counts acceptances the output then cuts (at
``max_new_tokens`` or an EOS), peagle drafts ``min(K, left - 1)`` and counts only what is emitted, so
peagle's accepted count of each step is ``min(vLLM's, peagle's drafted)``; and vLLM's global counters
(``llm.get_metrics()``) are the sums of its per-step counts.

(c) vLLM's own outputs, walked by the replay judge (``peagle_train/evaluate/replay.py``) with peagle's float32
features of them, give vLLM's per-step counts (the same ``min`` rule): at T = 0 for every case, and at T = 1 for
the ``3aux-reduced`` drafter, which one more engine serves at T = 1 (``greedy`` draft scheme, seeded requests,
vLLM in the child's process with the CPU fix of vLLM #55005 that ``bench/vllm_judge.py`` applies).

vLLM's drafter loader skips tensors it has no parameter for and leaves parameters no tensor fills at
their init, without an error, and these briefly trained drafters accept few drafts, so equal counts alone
would not show that vLLM computes every part of them. For the ``qwen3-2-layer`` drafter the
script therefore also reads, in vLLM's worker (``collective_rpc``) of the engine that served the case, before
that engine stops (no engine of its own: a start took 130-165 s at load 11-14), the drafter vLLM built: its
class (``Eagle3Qwen3ForCausalLM`` with ``Qwen3Attention``; ``Eagle3LlamaForCausalLM`` with 2 layers), and
every tensor of the checkpoint equal to the weight vLLM computes with (a linear layer whose weight vLLM's CPU
backend repacked is applied to the identity), q_norm/k_norm and the second layer included,
none of vLLM's parameters left at its init but layer 1's ``hidden_norm``, which vLLM builds in every layer
and its forward reads in layer 0 only (``llama_eagle3.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from peagle_train.evaluate.run import VLLM_COSTS_SKIPPED

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]
K = 3
MAX_NEW_TOKENS = 32
NUM_PROMPTS = 3
STEPS = 40
CASES = {  # name: (store, draft vocab or None for the full vocab, loading, more peagle-train options)
    "3aux-reduced": ("s3", 2048, "speculative_config", []),
    "2aux-reduced": ("s2", 2048, "speculative_config", []),
    "4aux-full": ("s4", None, "speculators", []),
    "qwen3-2-layer": ("s3", 2048, "speculative_config", ["--drafter-layer", "qwen3", "--num-layers", 2]),
}
STORES = {"s3": "2,15,27", "s2": "15,30", "s4": "2,15,27,30"}
DFLASH = ("s3", 2048, ["--method", "dflash", "--block-size", K + 1])
"""The DFlash drafter (``--method dflash``, blocks of K + 1: K drafts a step) served with vLLM's ``method: dflash``
in the same script as the P-EAGLE cases (one engine start more)."""
LOADED = {  # case: the drafter vLLM builds for it (class, decoder layers, attention), and its parameters no
    # checkpoint tensor fills (vLLM gives every layer a hidden_norm; its forward reads layer 0's only)
    "qwen3-2-layer": ("Eagle3Qwen3ForCausalLM", ["Qwen3Eagle3DecoderLayer"] * 2, "Qwen3Attention",
                      ["model.layers.1.hidden_norm.weight"]),
}

SCRIPT = '''
import json, sys, time
import peagle_train.generate.vllm_engine as ve
from peagle_train.evaluate.config import EvalConfig
from peagle_train.evaluate.vllm_eval import speculative_drafter, vllm_reference, vllm_speculative
from peagle_train.generate.speculative import served_truncation

INSPECT = {}  # "path": the drafter to read in the running engine's worker before it stops; "loaded": what it read
_shutdown = ve._shutdown


def inspect_then_shutdown(llm):
    """vllm_generate's engine stop, reading the drafter vLLM built first when INSPECT asks (one engine less)."""
    if INSPECT.get("path"):
        INSPECT["loaded"] = llm.collective_rpc(loaded_drafter, args=(INSPECT.pop("path"),))[0]
    _shutdown(llm)


ve._shutdown = inspect_then_shutdown


def loaded_drafter(worker, path):
    """In vLLM's worker: the drafter it built and loaded, against the checkpoint's tensors (by peagle name:
    equal or not), and vLLM's parameters no checkpoint tensor filled."""
    import torch
    from safetensors.torch import load_file

    model = worker.model_runner.drafter.model
    theirs = {**dict(model.named_parameters()), "mask_hidden": model.mask_hidden}

    def effective(key):  # the CPU backend repacks linear weights (leaving them empty): layer(I) = W^T
        w = theirs[key].detach()
        if w.numel() or not key.endswith(".weight"):
            return w
        layer = model.get_submodule(key[:-len(".weight")])
        with torch.no_grad():
            out = layer(torch.eye(layer.input_size, dtype=torch.float32))
        return (out[0] if isinstance(out, tuple) else out).T

    ours = load_file(f"{path}/model.safetensors")
    fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    equal, used = {}, set()
    for name, t in ours.items():
        if name == "t2d":  # vLLM reads d2t only
            continue
        part = next((p for p in fused if f".{p}." in name), None)
        key = {"lm_head.weight": "lm_head.weight", "d2t": "draft_id_to_target_id", "mask_hidden": "mask_hidden"}.get(
            name, "model." + name)
        if part is None:
            got = effective(key)
        else:
            into, i = fused[part]
            key = key.replace(part, into)
            sizes = ([ours[name.replace(part, p)].shape[0] for p in ("q_proj", "k_proj", "v_proj")]
                     if into == "qkv_proj" else [t.shape[0]] * 2)
            got = effective(key).split(sizes, dim=0)[i]
        used.add(key)
        equal[name] = bool(got.numel() == t.numel() and torch.equal(got.reshape(t.shape), t.to(got.dtype)))
    layers = model.model.layers
    return {"class": type(model).__name__, "layers": [type(x).__name__ for x in layers],
            "attention": type(layers[0].self_attn).__name__, "equal": equal, "not_loaded": sorted(set(theirs) - used)}


if __name__ == "__main__":  # vLLM spawns its engine process: the script must be importable without running
    job = json.load(open(sys.argv[1]))
    settings = dict(max_new_tokens=job["max_new_tokens"], num_prompts=job["num_prompts"], engine="vllm",
                    concurrency=1)
    t0 = time.perf_counter()
    ref = vllm_reference("smollm2-135m", job["prompts"], EvalConfig(**settings),
                         served=served_truncation("smollm2-135m"))
    out = {"requests": ref.requests, "keys": [[ref.prompts[i].prompt_id, t] for i, t in ref.order],
           "directory": ref.directory,
           "plain": ref.plain.tokens, "plain_start_s": ref.plain.start_s,
           "reference_s": time.perf_counter() - t0, "cases": {}}
    for name, (drafter, loading) in job["cases"].items():
        t = time.perf_counter()
        if name in job["inspect"]:  # what vLLM built and loaded, read in the engine that served the case
            INSPECT["path"] = drafter
        config = EvalConfig(**settings, vllm_loading=loading)
        kind, K = speculative_drafter(drafter, config)
        report = vllm_speculative(ref, drafter, config, kind=kind, num_draft_tokens=K,
                                  sampling_check=ve.check_vllm_sampling(config.temperature, ve.vllm_on_cpu()))
        out["cases"][name] = {**report, "case_s": time.perf_counter() - t}
        if name in job["inspect"]:
            out["cases"][name]["loaded"] = INSPECT.pop("loaded")
    t = time.perf_counter()
    run = ve.vllm_generate(ref.directory, ref.requests, job["max_new_tokens"], stop_token_ids=sorted(ref.eos),
                           speculative_config={"model": job["dflash"], "method": "dflash",
                                               "num_speculative_tokens": job["K"]}, concurrency=1, timed=False)
    out["dflash"] = {"tokens": run.tokens, "per_request": run.per_request, "case_s": time.perf_counter() - t}
    json.dump(out, open(sys.argv[2], "w"), default=str)
'''


def _run(cmd, args):
    result = CliRunner().invoke(cmd, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Pack, extract, train every case's drafter, then run the vLLM script once; returns
    ``(work dir, {case: drafter final/}, vLLM's results)``."""
    from cli.data import main as data_main
    from cli.train import main as train_main

    work = tmp_path_factory.mktemp("served")
    _run(data_main, ["pack", "sharegpt", "--tokenizer", "smollm2-135m", "--output", work / "packed", "--limit", 16,
                     "--max-seq-len", 256, "--max-windows", 1])
    for store, layers in STORES.items():
        _run(data_main, ["extract", work / "packed", "--verifier", "smollm2-135m", "--output", work / f"{store}.zarr",
                         "--layers", layers])
    drafters = {}
    for name, (store, vocab, _, more) in CASES.items():
        _run(train_main, ["--store", work / f"{store}.zarr", "--output", work / name, "--max-steps", STEPS,
                          "--num-depths", K, "--val-fraction", 0, *(["--draft-vocab-size", vocab] if vocab else []),
                          *more])
        drafters[name] = work / name / "final"
    _run(train_main, ["--store", work / f"{DFLASH[0]}.zarr", "--output", work / "dflash", "--max-steps", STEPS,
                      "--val-fraction", 0, "--draft-vocab-size", DFLASH[1], *DFLASH[2]])
    drafters["dflash"] = work / "dflash" / "final"
    job = {"prompts": str(REPO / "examples" / "prompts.jsonl"), "max_new_tokens": MAX_NEW_TOKENS,
           "num_prompts": NUM_PROMPTS, "cases": {n: [str(drafters[n]), CASES[n][2]] for n in CASES},
           "inspect": list(LOADED), "dflash": str(drafters["dflash"]), "K": K}
    (work / "job.json").write_text(json.dumps(job))
    (work / "serve.py").write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",  # no hub
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # collective_rpc of the script's own function
    proc = subprocess.run([sys.executable, str(work / "serve.py"), str(work / "job.json"), str(work / "out.json")],
                          env=env, cwd=work, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return work, drafters, json.loads((work / "out.json").read_text())


SCRIPT_T1 = '''
import json, sys
import vllm_judge  # vLLM in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the CPU fix reaches its sampler
from peagle_train.generate.vllm_engine import vllm_generate

job = json.load(open(sys.argv[1]))
check, fixed = vllm_judge.sampling_check(1.0)  # vLLM #55005 on CPU: PR #55006's shim, probed exact in this process
run = vllm_generate(job["directory"], job["requests"], job["max_new_tokens"], stop_token_ids=job["eos"],
                    speculative_config={"model": job["drafter"], "method": "eagle3", "parallel_drafting": True,
                                        "num_speculative_tokens": job["K"], "draft_sample_method": "greedy"},
                    concurrency=1, timed=False, temperature=1.0, seed=job["seed"])
json.dump({"tokens": run.tokens, "per_request": run.per_request, "check": check, "fixed": fixed}, open(sys.argv[2], "w"))
'''


@pytest.fixture(scope="module")
def sampled_t1(served, verifier):
    """The ``3aux-reduced`` drafter served by vLLM at T = 1 (``greedy`` draft scheme, requests seeded) on the same
    requests, in a child Python with vLLM in its process and, on vLLM 0.32's CPU build, the fix of vLLM #55005
    (bench/vllm_judge.py): the suite's one engine start for the replay judge at T = 1."""
    work, drafters, out = served
    _, eos = verifier
    job = {"directory": out["directory"], "requests": out["requests"], "max_new_tokens": MAX_NEW_TOKENS,
           "eos": sorted(eos), "drafter": str(drafters["3aux-reduced"]), "K": K, "seed": 0}
    (work / "job_t1.json").write_text(json.dumps(job))
    (work / "sample_t1.py").write_text(SCRIPT_T1)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'bench'}", "VLLM_CPU_KVCACHE_SPACE": "2",
           "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(work / "sample_t1.py"), str(work / "job_t1.json"),
                           str(work / "out_t1.json")], env=env, cwd=work, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return drafters["3aux-reduced"], out["requests"], json.loads((work / "out_t1.json").read_text())


@pytest.fixture(scope="module")
def verifier():
    """The SmolLM2 verifier in float32 on the CPU and its EOS ids, loaded once for every case."""
    from peagle_train.generate.render import eos_ids
    from runtime.model_cache import load_tokenizer, load_verifier

    model = load_verifier("smollm2-135m", dtype=torch.float32, device="cpu")
    return model, eos_ids(load_tokenizer("smollm2-135m"), model)


def _peagle_steps(drafter_dir, requests, verifier):
    """peagle's own speculative decoding of each request (float32, K drafts): GenerationResults."""
    from peagle_train.model.checkpoint import load_drafter
    from peagle_train.generate.speculative import speculative_generate

    model, eos = verifier
    drafter = load_drafter(drafter_dir).eval()
    return [speculative_generate(model, drafter, ids, MAX_NEW_TOKENS, K, eos) for ids in requests]


def _replayed_steps(drafter_dir, requests, outputs, verifier):
    """Each request's vLLM output walked by the replay judge (:func:`~peagle_train.evaluate.replay.walk_turn`):
    the verifier's float32 aux features of ``prompt + output`` (a stored segment's), the drafter's offline chains;
    ``[(accepted per step, drafted per step)]``."""
    from peagle_train.evaluate.offline import segment_predictions
    from peagle_train.evaluate.replay import walk_turn
    from peagle_train.generate.speculative import aux_features
    from peagle_train.generate.verifier import aux_hidden_states
    from peagle_train.model.checkpoint import load_drafter

    model, eos = verifier
    drafter = load_drafter(drafter_dir).eval()
    out = []
    for prompt, tokens in zip(requests, outputs):
        x = torch.tensor(list(prompt) + list(tokens))
        with torch.no_grad(), aux_hidden_states(model) as last:  # layer L before the final norm, as stored
            hs = model(input_ids=x[None], output_hidden_states=True).hidden_states
        block = SimpleNamespace(input_ids=x, position_ids=torch.arange(len(x)),
                                aux_hidden=aux_features(hs, last, drafter.config.aux_layer_ids))
        pred = segment_predictions(drafter, block, 0, len(x), K)
        drafted = torch.where(pred >= 0, drafter.draft_ids[pred.clamp_min(0)], -1).numpy()
        acc, dr, _ = walk_turn(drafted, x.numpy(), len(prompt), len(x), K, MAX_NEW_TOKENS, set(eos))
        out.append((acc, dr))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_serves_the_drafter_exactly(served, verifier, case):
    work, drafters, out = served
    report = out["cases"][case]
    # the drafter loaded as trained: the layers peagle wrote, the loading asked for, K drafts a step
    cfg = json.loads((drafters[case] / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [int(x) for x in STORES[CASES[case][0]].split(",")]
    assert report["loading"] == CASES[case][2] and report["num_draft_tokens"] == K
    layer = cfg["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"]) == {"qwen3-2-layer": ("qwen3", 2)}.get(case, ("llama", 1))
    # (a) token for token vLLM's own greedy output
    assert report["identical_to_greedy"] is True and report["mismatches"] == []
    assert [p["identical_to_greedy"] for p in report["per_prompt"]] == [True] * len(out["requests"])
    # vLLM's global counters are the sums of its per-request, per-step counts
    by_key = {(p["prompt_id"], p["turn"]): p for p in report["per_prompt"]}
    steps = [by_key[(pid, turn)]["vllm_steps"] for pid, turn in out["keys"]]  # in request order
    assert report["num_drafts"] == sum(len(s["accepted"]) for s in steps)
    assert report["drafted"] == sum(sum(s["drafted"]) for s in steps) == K * report["num_drafts"]
    assert report["accepted"] == sum(sum(s["accepted"]) for s in steps)
    assert report["per_position_accepted"] == [sum(a > i for s in steps for a in s["accepted"]) for i in range(K)]
    assert report["accepted"] > 0  # the equalities below hold on kept drafts, not only on rejected ones
    # (b) step by step, the counts of peagle's own speculative decoding of the same requests
    ours = _peagle_steps(drafters[case], out["requests"], verifier)
    for r, (mine, theirs, plain) in enumerate(zip(ours, steps, out["plain"])):
        assert mine.tokens == plain, r  # transformers and vLLM agree on the greedy output
        assert len(mine.accepted_per_step) == len(theirs["accepted"]), r
        assert mine.accepted_per_step == [min(a, k) for a, k in zip(theirs["accepted"], mine.drafted_per_step)], r
    # (c) the replay of vLLM's own outputs (peagle's features of them, the drafter's offline chains) counts the same
    # as vLLM step by step: the judge's exactness at T = 0 (docs/design.md §9, replayed acceptance)
    replayed = _replayed_steps(drafters[case], out["requests"], out["plain"], verifier)
    for r, ((acc, dr), theirs) in enumerate(zip(replayed, steps)):
        assert len(acc) == len(theirs["accepted"]), r  # vLLM's num_drafts: every verifier step
        assert acc == [min(a, k) for a, k in zip(theirs["accepted"], dr)], r
    drafting = sum(1 for m in ours for k in m.drafted_per_step if k > 0)  # peagle's num_drafts
    if case == "3aux-reduced":  # peagle-eval itself (its own plain answers as turn-2 history) counts the same (one
        # case: its counting does not depend on the drafter's layers, which the other cases vary)
        from peagle_train.evaluate.online import run_online_eval

        mine = run_online_eval(drafters[case], "smollm2-135m", REPO / "examples" / "prompts.jsonl",
                               max_new_tokens=MAX_NEW_TOKENS, num_prompts=NUM_PROMPTS, num_draft_tokens=K)
        assert mine["identical_to_greedy"] and mine["num_drafts"] == drafting
        assert mine["accepted"] == sum(m.accepted for m in ours) and mine["drafted"] == sum(m.drafted for m in ours)
        assert [p["text"] for p in mine["per_prompt"]] == [p["text"] for p in report["per_prompt"]]
    if case in LOADED:  # vLLM built the drafter's layers and computes with every tensor peagle trained
        from safetensors.torch import load_file

        loaded, ours_t = report["loaded"], load_file(str(drafters[case] / "model.safetensors"))
        assert (loaded["class"], loaded["layers"], loaded["attention"], loaded["not_loaded"]) == LOADED[case]
        assert loaded["equal"] == {name: True for name in ours_t if name != "t2d"}
        trained = [n for n in ours_t if n.endswith(("q_norm.weight", "k_norm.weight", "layernorm.weight"))]
        # trained away from vLLM's init (ones), so equal means loaded
        assert trained and not any(torch.equal(ours_t[n], torch.ones_like(ours_t[n])) for n in trained)
        assert any(n.startswith("layers.1.") for n in ours_t) and any("q_norm" in n for n in ours_t)
    per_pos = [sum(a > i for m in ours for a in m.accepted_per_step) for i in range(K)]
    print(f"{case}: vLLM AL {report['acceptance_length']:.3f}, accepted per position {report['per_position_accepted']} "
          f"of {report['num_drafts']} drafts; peagle AL {1 + sum(m.accepted for m in ours) / drafting:.3f}, {per_pos} "
          f"of {drafting}; engine start {report['engine_start_s']['speculative']:.0f} s, case {report['case_s']:.0f} s")


@pytest.fixture(scope="module")
def peagle_eval(served):
    """``peagle-eval --engine vllm`` run once, as a user runs it (no ``$VLLM_CPU_KVCACHE_SPACE``), on the
    3aux-reduced drafter with speculators loading (``vllm serve final/``'s path) at concurrency 2:
    ``(completed process, the --output report)``."""
    work, drafters, _ = served
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    report_path = work / "eval.json"
    proc = subprocess.run(
        [sys.executable, "-m", "cli.eval", "--drafter", str(drafters["3aux-reduced"]), "--prompts",
         str(REPO / "examples" / "prompts.jsonl"), "--num-prompts", str(NUM_PROMPTS), "--max-new-tokens",
         str(MAX_NEW_TOKENS), "--engine", "vllm", "--vllm-loading", "speculators", "--concurrency", "2",
         "--output", str(report_path)], env=env, cwd=work, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc, json.loads(report_path.read_text())


def test_peagle_eval_engine_vllm_reports_vllms_figures(served, peagle_eval):
    """``peagle-eval --engine vllm`` (speculators loading, ``vllm serve final/``'s path) on the
    3aux-reduced drafter: the report, plot and counters of the script's native-loading run."""
    work, drafters, out = served
    _, report = peagle_eval
    assert (work / "eval.png").stat().st_size > 0
    native = out["cases"]["3aux-reduced"]
    assert report["engine"] == "vllm" and report["loading"] == "speculators" and report["identical_to_greedy"]
    for key in ("num_drafts", "drafted", "accepted", "per_position_accepted", "acceptance_length"):
        assert report[key] == native[key], key  # both loadings serve the same drafter the same way
    assert [p["vllm_steps"] for p in report["per_prompt"]] == [p["vllm_steps"] for p in native["per_prompt"]]
    assert set(report["throughput"]) == {"1", "2"}
    for c in ("1", "2"):
        t = report["throughput"][c]
        assert t["plain"] > 0 and t["speculative"] > 0 and t["speedup"] == t["speculative"] / t["plain"]
    assert all("<|im_end|>" not in p["text"] for p in report["per_prompt"])
    assert report["cost_model"] == {"skipped": VLLM_COSTS_SKIPPED}  # peagle's costs are not applied to vLLM


def test_replay_of_vllms_t1_samples_counts_as_vllm(sampled_t1, verifier):
    """The replay judge at T = 1: vLLM's own samples (greedy draft scheme, CPU sampler fixed) walked with peagle's
    features of them: a draft is kept exactly when it equals the emitted token, so every step's counts are vLLM's
    (``min(vLLM accepted, drafted)``, as at T = 0) on every request whose drafts agree; a request where they do
    not is counted (numerics: vLLM's features and peagle's, both float32, can flip a near-tied drafter argmax)."""
    drafter, requests, got = sampled_t1
    assert got["fixed"] is False or "PR #55006" in got["check"]  # the sampler was exact at T = 1
    replayed = _replayed_steps(drafter, requests, got["tokens"], verifier)
    agree = 0
    for r, ((acc, dr), theirs) in enumerate(zip(replayed, got["per_request"])):
        # the same steps (the emitted tokens decide them) and the same counts in each
        agree += len(acc) == len(theirs["accepted"]) and acc == [min(a, k) for a, k in zip(theirs["accepted"], dr)]
    print(f"T=1: {agree} of {len(requests)} requests count as vLLM step by step; vLLM accepted "
          f"{sum(sum(t['accepted']) for t in got['per_request'])} drafts")
    assert agree == len(requests)  # none differed on this CPU (float32 both); a difference fails here to be explained


def test_peagle_eval_engine_vllm_starts_without_the_environment_and_prints_only_json(peagle_eval):
    """No ``$VLLM_CPU_KVCACHE_SPACE``: peagle gives vLLM its 2 GiB KV cache (recorded); stdout is the report.
    (It was test_vllm_serve_documented.py's own peagle-eval run on an untrained drafter, two more engine
    starts; the run above is started the same way.)"""
    proc, report = peagle_eval
    printed = json.loads(proc.stdout)  # nothing but the report
    assert printed["engine"] == "vllm" and printed["identical_to_greedy"] is True
    assert printed["acceptance_length"] == report["acceptance_length"]
    assert printed["vllm_memory"] == report["vllm_memory"] == {"kv_cache_memory_bytes": 2 * 2**30}
    assert "INFO" in proc.stderr  # vLLM's log went to stderr


def _dflash_steps(drafter_dir, requests, outputs, verifier):
    """peagle's DFlash drafter walked over each request's vLLM output as vLLM decodes it at T = 0: from the first
    output token (the bonus of the prefill) as anchor, each step drafts K from the verifier's float32 aux features
    of the rows before the anchor, accepts the drafts equal to the output, and anchors at the next bonus; the
    accepted count of each step."""
    from peagle_train.data.anchors import AnchorBlocks, block_inputs
    from peagle_train.generate.speculative import aux_features
    from peagle_train.generate.verifier import aux_hidden_states
    from peagle_train.model.dflash_checkpoint import load_dflash

    model, _ = verifier
    drafter = load_dflash(drafter_dir).eval()
    out = []
    for prompt, tokens in zip(requests, outputs):
        x = torch.tensor(list(prompt) + list(tokens))
        n, T = len(x), len(x) + K + 1  # rows past the output: room for the last block's mask tokens
        with torch.no_grad(), aux_hidden_states(model) as last:
            g = aux_features(model(input_ids=x[None], output_hidden_states=True).hidden_states, last,
                             drafter.config.aux_layer_ids)
        g, ids = torch.cat([g, g.new_zeros(K + 1, g.shape[1])]), torch.cat([x, x.new_zeros(K + 1)])
        p, accepted = len(prompt), []
        while p < n:
            inp = block_inputs(AnchorBlocks(torch.tensor([p]), K + 1), ids, torch.arange(T), torch.tensor([0, T]),
                               torch.ones(T), drafter.config.mask_token_id)
            with torch.no_grad():
                hidden = drafter(g, torch.arange(T), inp.input_ids, inp.position_ids, inp.mask)
            drafts = drafter.draft_ids[drafter.logits(hidden[1:]).argmax(-1)].tolist()
            a = 0
            while a < K and p + 1 + a < n and drafts[a] == int(x[p + 1 + a]):
                a += 1
            accepted.append(a)
            p += a + 1
        out.append(accepted)
    return out


def test_vllm_serves_the_dflash_drafter_exactly(served, verifier):
    """A DFlash drafter trained by ``peagle-train --method dflash`` and served by vLLM 0.32 (``method: dflash``,
    non-causal block attention as trained): vLLM's greedy output equals its output without a drafter, token for
    token; every step drafts K = block_size - 1 tokens; and each step's accepted count is what peagle's drafter
    accepts at that step (:func:`_dflash_steps`; vLLM drafts no step after the last output token, and counts
    acceptances of its last step that the output then cuts, so that step's count is at least peagle's)."""
    work, drafters, out = served
    config = json.loads((drafters["dflash"] / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == K + 1
    assert out["dflash"]["tokens"] == out["plain"]
    ours = _dflash_steps(drafters["dflash"], out["requests"], out["dflash"]["tokens"], verifier)
    for counts, mine in zip(out["dflash"]["per_request"], ours):
        theirs = counts["accepted"]
        assert set(counts["drafted"]) == {K} and len(theirs) == len(counts["drafted"]) >= 1
        assert mine[:len(theirs) - 1] == theirs[:-1] and mine[len(theirs) - 1] <= theirs[-1], (mine, theirs)
    assert sum(sum(c["accepted"]) for c in out["dflash"]["per_request"]) > 0  # the equalities held on kept drafts
