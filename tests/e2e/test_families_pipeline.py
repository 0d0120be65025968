"""A new user's own tiny verifier of each kind through the CLI: pack -> extract -> train -> eval.

Families with sliding windows shorter than the prompts (gpt-oss: eager attention with sinks, YaRN;
Gemma-3 multimodal wrapper: per-layer-type RoPE, extraction from its language model) and Llama-3.1
with llama3 RoPE scaling; the real SmolLM2 tokenizer. Stored features equal each segment run alone,
evaluation is identical to greedy decoding, and the drafter checkpoint carries the verifier's RoPE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from cli.data import main as data_main
from cli.eval import main as eval_main
from cli.train import main as train_main
from peagle_train.generate.vllm_engine import VllmSpeculativeEngine
from peagle_train.train.setup import verifier_rope
from stores.errors import InputError
from stores.features.feature_store import FeatureStore
from runtime.model_cache import load_verifier
from stores.tables.token_tables import TokenTable

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e.test_pipeline import CONVERSATIONS, PROMPTS, _run  # noqa: E402
from families import (HYBRID, VLLM_CPU_DENSE, VLLM_CPU_SHAPE, family_config, hidden_states_as_stored,  # noqa: E402
                      save_family)


def _pack_and_extract(tmp_path: Path, model: str, layers: str) -> Path:
    """The tests' conversations packed (``tmp_path/packed``, 128 tokens a block) and extracted with ``model``'s
    ``layers`` on CPU (``tmp_path/f.zarr``); returns the prompts file written beside them."""
    data, prompts = tmp_path / "convs.jsonl", tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    _run(data_main, ["pack", data, "--tokenizer", model, "--output", tmp_path / "packed", "--max-seq-len", 128])
    _run(data_main, ["extract", tmp_path / "packed", "--verifier", model, "--output", tmp_path / "f.zarr",
                     "--layers", layers, "--device", "cpu"])
    return prompts


DFLASH_FAMILIES = {"gpt_oss", "gemma2", "qwen3_next", "nemotron_h"}
"""The families whose store also trains a DFlash drafter through the CLI (:func:`_dflash_through_the_cli`): two
attention families (sliding windows, soft-capped logits) and two hybrids (linear attention; Mamba-2 aux layers)."""


def _dflash_through_the_cli(tmp_path: Path, model: str, prompts: Path) -> None:
    """``peagle-train --method dflash`` on the family's store (blocks of 4), then ``peagle-eval``: the replayed
    acceptance of the store and online decoding identical to greedy (a hybrid's state put back after rejections)."""
    _run(train_main, ["--store", tmp_path / "f.zarr", "--output", tmp_path / "dflash", "--max-steps", 4,
                      "--method", "dflash", "--block-size", 4, "--draft-vocab-size", 64])
    final = tmp_path / "dflash" / "final"
    assert json.loads((final / "config.json").read_text())["speculators_model_type"] == "dflash"
    report = json.loads(_run(eval_main, ["--drafter", final, "--store", tmp_path / "f.zarr", "--no-measure-costs",
                                         "--all-anchor"]))
    assert report["positions_scored"] > 0 and report["simulated_acceptance_length"] >= 1.0, report
    report = json.loads(_run(eval_main, ["--drafter", final, "--verifier", model, "--prompts", prompts,
                                         "--max-new-tokens", 12, "--no-measure-costs"]))
    assert report["identical_to_greedy"] is True and report["num_draft_tokens"] == 3, report


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "gemma3_mm", "llama31", "gemma2"])
def test_family_through_the_cli(tmp_path, smollm2_tokenizer_dir, family):
    model = str(save_family(family, tmp_path / "verifier", smollm2_tokenizer_dir, vocab_size=49152))
    prompts = _pack_and_extract(tmp_path, model, "0,1,2")
    store = FeatureStore.open(tmp_path / "f.zarr")
    text = family_config(family, 49152).get_text_config()
    assert store.attrs["verifier"]["num_hidden_layers"] == text.num_hidden_layers
    from runtime.model_cache import load_verifier

    verifier = load_verifier(model, device="cpu")
    b = store.read_block(0)
    for k in range(len(b.cu_seqlens) - 1):  # every segment of the first block, alone through the verifier
        lo, hi = int(b.cu_seqlens[k]), int(b.cu_seqlens[k + 1])
        alone, _ = hidden_states_as_stored(verifier, input_ids=b.input_ids[lo:hi][None])  # [L]: before the norm
        for j, layer in enumerate([0, 1, 2]):
            ref = alone[layer][0]
            rel = (b.aux_hidden[lo:hi, j].float() - ref).norm(dim=-1) / ref.norm(dim=-1)
            assert float(rel.max()) < 8e-3, (family, k, layer)

    _run(train_main, ["--store", tmp_path / "f.zarr", "--output", tmp_path / "drafter", "--max-steps", 4,
                      "--num-depths", 3, "--draft-vocab-size", 64])
    final = tmp_path / "drafter" / "final"
    layer_config = json.loads((final / "config.json").read_text())["transformer_layer_config"]
    assert layer_config["rope_parameters"] == verifier_rope(text)
    assert layer_config["rope_theta"] == verifier_rope(text)["rope_theta"]
    # the KL targets are the verifier's real distribution: Gemma-2's logits are soft-capped
    recorded = json.loads((final / "config.json").read_text())["peagle_training"]["verifier_logit_transform"]
    assert recorded == {"scale": 1.0, "softcap": getattr(text, "final_logit_softcapping", None)}

    report = json.loads(_run(eval_main, ["--drafter", final, "--verifier", model, "--prompts", prompts,
                                         "--max-new-tokens", 12, "--output", tmp_path / "eval.json"]))
    assert report["identical_to_greedy"] is True
    if family in DFLASH_FAMILIES:
        _dflash_through_the_cli(tmp_path, model, prompts)


@pytest.mark.slow
@pytest.mark.parametrize("family", HYBRID)
def test_hybrid_family_through_the_cli(tmp_path, smollm2_tokenizer_dir, family):
    """A hybrid verifier: pack -> extract (full context: each conversation its own row, its state from zero)
    -> train -> offline eval -> online eval (peagle's own speculative decoding, identical to greedy: the recurrent
    state is put back after a rejected draft); the checkpoint names aux layers that are linear-attention / Mamba-2 layers and
    the verifier's text model shape."""
    model = str(save_family(family, tmp_path / "verifier", smollm2_tokenizer_dir, vocab_size=49152))
    layers = [1, 2, 4]  # 1 and (Qwen3.5, Qwen3-Next, Granite, OLMo) 3 are recurrent layers' outputs
    prompts = _pack_and_extract(tmp_path, model, ",".join(map(str, layers)))
    store = FeatureStore.open(tmp_path / "f.zarr")
    assert store.layout == "windows"  # full context: the contexts ran, the windows are views of them
    verifier = load_verifier(model, device="cpu")
    packed = TokenTable.open(tmp_path / "packed")
    conversations = {r["conversation_id"]: r["input_ids"] for r in packed.conversations().iter_rows()}
    for i, row in enumerate(packed.iter_rows()):  # every window against its whole conversation run alone
        b, cu = store.read_block(i), row["cu_seqlens"]
        for k, sid in enumerate(row["segment_ids"]):
            ids = torch.from_numpy(conversations[sid.rpartition("#")[0]].astype(np.int64))
            alone, _ = hidden_states_as_stored(verifier, input_ids=ids[None])
            p, s, n = row["segment_prefix_lens"][k], row["segment_starts"][k], cu[k + 1] - cu[k]
            where = np.r_[0:p, s:s + n - p]  # the window's tokens in its conversation
            for j, layer in enumerate(layers):
                got = b.aux_hidden[cu[k]:cu[k + 1], j].float()
                cos = torch.nn.functional.cosine_similarity(got, alone[layer][0][where], dim=-1)
                assert float(cos.min()) >= 0.999, (family, i, k, layer)

    _run(train_main, ["--store", tmp_path / "f.zarr", "--output", tmp_path / "drafter", "--max-steps", 4,
                      "--num-depths", 3, "--draft-vocab-size", 64])
    final = tmp_path / "drafter" / "final"
    config = json.loads((final / "config.json").read_text())
    text = family_config(family, 49152).get_text_config()
    assert config["eagle_aux_hidden_state_layer_ids"] == layers
    assert config["target_hidden_size"] == text.hidden_size
    # the verifier's own architecture (Qwen3.5: its multimodal wrapper), not its text config's (none: llama)
    assert config["speculators_config"]["verifier"]["architectures"] \
        == json.loads((Path(model) / "config.json").read_text())["architectures"]
    report = json.loads(_run(eval_main, ["--drafter", final, "--store", tmp_path / "f.zarr", "--no-measure-costs",
                                         "--all-anchor", "--output", tmp_path / "eval.json"]))
    assert report["positions_scored"] > 0 and report["simulated_acceptance_length"] >= 1.0, report
    report = json.loads(_run(eval_main, ["--drafter", final, "--verifier", model, "--prompts", prompts,
                                         "--max-new-tokens", 12]))
    assert report["identical_to_greedy"] is True and report["cost_model"]["skipped"], report
    if family in DFLASH_FAMILIES:
        _dflash_through_the_cli(tmp_path, model, prompts)


ANSWER_WORDS = " the cat sat on a mat and ran to big red dog with one two three four"
"""The words the served hybrid verifier answers with (:func:`families.build_family`'s ``answer_tokens``)."""
SERVED_PROMPTS = [{"question_id": i, "turns": [f"Count from {i} to 9."]} for i in range(1, 9)]
"""The prompts served; the drafter is trained on the verifier's answers to the first six only."""


def peagle_counts(vllm_accepted: list[int], drafted: list[int]) -> list[int]:
    """Each step's accepted drafts as peagle counts them, from vLLM's on the same tokens: vLLM drafts K at every
    step, also where fewer tokens are left (peagle drafts ``min(K, left - 1)``, ``drafted``), and counts the
    acceptances the output then cuts (peagle_train/generate/vllm_engine.py's docstring)."""
    return [min(a, k) for a, k in zip(vllm_accepted, drafted)]


@pytest.mark.vllm
@pytest.mark.slow  # two vLLM engine starts (the reference, then the drafter's) and peagle's own online eval
@pytest.mark.parametrize("family", ["qwen3_next", pytest.param("qwen3_5", marks=pytest.mark.skipif(
    os.environ.get("PEAGLE_LONG_VLLM") != "1", reason="the second served hybrid (about 6 min in CI): set "
    "PEAGLE_LONG_VLLM=1 to run it; Qwen3-Next, served the same way, runs in CI"))])
def test_hybrid_drafter_served_by_vllm_is_greedy(tmp_path, smollm2_tokenizer_dir, family):
    """A drafter trained on a hybrid verifier's store, served by vLLM (P-EAGLE, speculators loading; on CPU without
    prefix caching, runtime.vllm_runtime.CPU_HYBRID_PREFIX_CACHING; Qwen3.5, a vision-language wrapper, in
    vLLM's text-only mode, runtime.vllm_runtime.TEXT_ONLY): output identical to vLLM's own greedy decoding
    (bf16 on CPU: a turn may differ only at a near tie, identity.py's rule), and vLLM's accepted drafts those of
    peagle-eval's own engine step by step on every turn where both produced the same tokens, with drafts accepted
    and rejected: the verifier answers in 17 words (``answer_tokens``), the drafter learns its regenerated answers
    to six prompts and has never seen two, so steps keep 0 to 3 drafts, and after each partial acceptance the
    gated DeltaNet state must be put back to the kept tokens: a state that kept a rejected draft changes the next
    tokens. vLLM computes these families in bf16 on CPU, peagle's engine in float32, so a turn may take another
    token at a bf16 tie (then its counts differ from there on: not compared). Qwen3-Next routes every token to all
    4 experts (as VLLM_CPU_HYBRID_SHAPE): with a top-2 router bf16 routing flips add differences beyond ties."""
    shape = {**VLLM_CPU_SHAPE, "linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_experts_per_tok": 4}
    words = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir).encode(ANSWER_WORDS, add_special_tokens=False)
    model = str(save_family(family, tmp_path / "verifier", smollm2_tokenizer_dir, vocab_size=49152, overrides=shape,
                            answer_tokens=words))
    prompts, seen = tmp_path / "prompts.jsonl", tmp_path / "seen.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in SERVED_PROMPTS))
    seen.write_text("".join(json.dumps(p) + "\n" for p in SERVED_PROMPTS[:6]))
    _run(data_main, ["regenerate", seen, "--verifier", model, "--output", tmp_path / "own.jsonl",
                     "--max-new-tokens", 16, "--device", "cpu"])  # the verifier's own answers
    _run(data_main, ["pack", tmp_path / "own.jsonl", "--tokenizer", model, "--output", tmp_path / "packed",
                     "--max-seq-len", 128])
    _run(data_main, ["extract", tmp_path / "packed", "--verifier", model, "--output", tmp_path / "f.zarr",
                     "--layers", "1,2,4"])
    _run(train_main, ["--store", tmp_path / "f.zarr", "--output", tmp_path / "drafter", "--max-steps", 200,
                      "--lr", "3e-3", "--num-depths", 3])
    final = tmp_path / "drafter" / "final"
    own = json.loads(_run(eval_main, ["--drafter", final, "--verifier", model, "--prompts", prompts,
                                      "--max-new-tokens", 16, "--no-measure-costs"]))
    assert own["identical_to_greedy"] is True, own
    report = json.loads(_run(eval_main, ["--drafter", final, "--verifier", model, "--prompts", prompts,
                                         "--max-new-tokens", 16, "--engine", "vllm", "--vllm-loading", "speculators",
                                         "--no-measure-costs"]))
    assert report["engine"] == "vllm" and report["mismatches"] == [], report
    turns = report["per_prompt"]
    assert all(p["identical_to_greedy"] or p["divergence"]["near_tie"] for p in turns), turns
    assert report["num_drafts"] > 0 and report["drafted"] == 3 * report["num_drafts"], report
    same = [(a, b) for a, b in zip(own["per_prompt"], turns) if a["text"] == b["text"]]  # the same tokens
    assert len(same) >= 6, [(a["text"], b["text"]) for a, b in zip(own["per_prompt"], turns)]
    for a, b in same:  # step by step
        assert a["steps"]["accepted"] == peagle_counts(b["vllm_steps"]["accepted"], a["steps"]["drafted"]), (a, b)
    accepted, drafted = (sum(a[k] for a, _ in same) for k in ("accepted", "drafted"))
    assert 0 < accepted < drafted, (accepted, drafted)  # drafts kept and drafts rejected
    kept = [n for a, _ in same for n in a["steps"]["accepted"]]
    assert {0, 3} <= set(kept) and set(kept) & {1, 2}, kept  # steps keeping none, some and all of their drafts
    print(f"{family}: on {len(same)} of {len(turns)} turns with the same tokens vLLM and peagle-eval accepted "
          f"{accepted} of {drafted} drafted tokens step by step; whole AL vLLM {report['acceptance_length']:.3f}, "
          f"peagle {own['acceptance_length']:.3f}; prompts compared {[a['prompt_id'] for a, _ in same]}, "
          f"steps keeping 0-3 drafts {[kept.count(n) for n in range(4)]}")


NGRAM_PROBE = """
import json, sys
from vllm import LLM, SamplingParams, TokensPrompt


def main():
    model, prompts = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=model, dtype="float32", enforce_eager=True, enable_prefix_caching=False, max_model_len=256,
              seed=0, kv_cache_memory_bytes=1 << 30, speculative_config={
                  "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
    print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))


if __name__ == "__main__":
    main()
"""
"""vLLM's greedy decoding of the prompts (JSON token ids) with its n-gram proposer (3 drafts a step)."""


def _mamba2_verifier(directory: Path, tokenizer_dir: Path) -> str:
    """A tiny dense Nemotron-H (Mamba-2, attention, MLP blocks) that vLLM's CPU build runs, in float32."""
    return str(save_family("nemotron_h", directory, tokenizer_dir, vocab_size=49152,
                           overrides={**VLLM_CPU_SHAPE, **VLLM_CPU_DENSE["nemotron_h"]}))


@pytest.mark.vllm
@pytest.mark.slow  # one vLLM engine start
def test_vllm_cpu_speculation_on_mamba2_is_not_greedy(tmp_path, smollm2_tokenizer_dir):
    """The reason peagle-eval --engine vllm refuses a Mamba-2 hybrid on CPU
    (runtime.vllm_runtime.CPU_MAMBA2_SPECULATION), measured without any peagle code in the engine: vLLM's own
    n-gram speculative decoding on a float32 Nemotron-H differs from greedy decoding (transformers' float32 argmax
    loop, which vLLM's plain greedy decoding of this model equals) beyond a near tie. When a vLLM fixes it, this
    fails: lift the refusal (CPU_SPECULATION_NOT_LOSSLESS) and serve Nemotron-H drafters in the test above."""
    model = _mamba2_verifier(tmp_path / "verifier", smollm2_tokenizer_dir)
    prompts = [list(range(1, 11)) * 3 + [100 + i] for i in range(4)]
    probe = tmp_path / "probe.py"
    probe.write_text(NGRAM_PROBE)
    res = subprocess.run([sys.executable, str(probe), model, json.dumps(prompts)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "VLLM_LOGGING_STREAM": "ext://sys.stderr"})
    assert res.returncode == 0, res.stderr[-3000:]
    spec = json.loads(res.stdout.strip().splitlines()[-1])
    verifier = load_verifier(model, device="cpu")
    firsts = []
    for prompt, got in zip(prompts, spec):
        x = torch.tensor(prompt)
        for t in got:  # the greedy token at each position of vLLM's output, as long as it agrees
            with torch.no_grad():
                logits = verifier(input_ids=x[None]).logits[0, -1]
            best = int(logits.argmax())
            if best != t:
                assert float(logits[best] - logits[t]) > 1e-3, "a near tie, not a wrong state"
                firsts.append(len(x) - len(prompt))
                break
            x = torch.cat([x, torch.tensor([t])])
    assert firsts, "vLLM's CPU build now decodes a Mamba-2 hybrid with speculation as without: lift " \
        "CPU_SPECULATION_NOT_LOSSLESS"
    print(f"vLLM CPU, Nemotron-H float32: n-gram speculative decoding differs from greedy on {len(firsts)} of "
          f"{len(prompts)} prompts, the earliest at token {min(firsts)}")


@pytest.mark.vllm
def test_peagle_eval_refuses_a_mamba2_verifier_on_vllm_cpu_before_any_engine(tmp_path, smollm2_tokenizer_dir):
    """peagle-eval --engine vllm on CPU with a Nemotron-H verifier: exit 2 naming the reason and what to use
    instead, before vLLM starts (peagle's own engine decodes Nemotron-H identically to greedy:
    tests/peagle_train/generate/test_families_speculative.py)."""
    model = _mamba2_verifier(tmp_path / "verifier", smollm2_tokenizer_dir)
    prompts = _pack_and_extract(tmp_path, model, "1,2,4")
    _run(train_main, ["--store", tmp_path / "f.zarr", "--output", tmp_path / "drafter", "--max-steps", 2,
                      "--num-depths", 3])
    drafter = tmp_path / "drafter" / "final"
    res = subprocess.run([sys.executable, "-m", "cli.eval", "--drafter", str(drafter), "--verifier", model,
                          "--prompts", str(prompts), "--max-new-tokens", "8", "--engine", "vllm", "--no-measure-costs"],
                         capture_output=True, text=True, timeout=600, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2 and res.stdout == "", res.stderr[-3000:]
    err = " ".join(res.stderr.split())
    assert "--engine vllm on CPU with a Mamba-2 hybrid verifier (nemotron_h): vLLM 0.32's CPU build does not " \
        "verify drafts exactly" in err and "Measure with peagle's own engine (--engine peagle" in err, err
    assert "EngineCore" not in res.stderr and "Resolved architecture" not in res.stderr, err
    with pytest.raises(InputError, match="vLLM 0.32's CPU build does not verify drafts exactly"):  # the Python API's
        VllmSpeculativeEngine(model, drafter, 3, AutoTokenizer.from_pretrained(model))  # engine="vllm" too
