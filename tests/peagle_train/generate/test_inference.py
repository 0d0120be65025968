"""The Python inference API: the README's example ("From Python") runs as written, and a result's
counts mean what they say."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from peagle_train.generate.inference import PEAGLEInference, acceptance_summary
from peagle_train.generate.speculative import greedy_generate
from peagle_train.model.checkpoint import save_drafter
from peagle_train.model.config import DrafterConfig
from peagle_train.model.drafter import PEagleDrafter
from stores.errors import InputError
from tests.families import save_family
from tests.peagle_train.generate.test_tree import RankOracle

README = Path(__file__).resolve().parents[3] / "README.md"
"""Where the inference example lives."""


def smollm2_drafter(directory: Path) -> Path:
    """A random 1-layer drafter for the embedded SmolLM2-135M (bf16 on disk, a 1024-token draft vocab)."""
    cfg = DrafterConfig(hidden_size=576, intermediate_size=256, num_attention_heads=9, num_key_value_heads=3,
                        head_dim=64, vocab_size=49152, draft_vocab_size=1024, aux_layer_ids=[1, 15, 29],
                        num_depths=4, rope_theta=100000.0, verifier_name_or_path="smollm2-135m")
    torch.manual_seed(0)
    drafter = PEagleDrafter(cfg).eval()
    drafter.init_from_verifier(torch.randn(49152, 576) * 0.02, torch.randn(49152, 576) * 0.02,
                               d2t=torch.zeros(1024, dtype=torch.long))
    save_drafter(drafter.to(torch.bfloat16), directory)
    return directory


@pytest.fixture(scope="module")
def smollm2_checkpoints(tmp_path_factory) -> Path:
    """A working directory holding ``checkpoints/best_model``, the documented example's drafter."""
    root = tmp_path_factory.mktemp("readme")
    smollm2_drafter(root / "checkpoints" / "best_model")
    return root


def documented_example() -> str:
    """The first python block of the README's "From Python" section."""
    section = README.read_text().split("\n## From Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_documented_example_runs_as_written(smollm2_checkpoints, monkeypatch, capsys, one_thread):
    code = documented_example()
    assert 'target_model="smollm2-135m"' in code and "result.speedup" in code
    monkeypatch.chdir(smollm2_checkpoints)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)  # noqa: S102 (the README's own example)
    out = capsys.readouterr().out
    assert re.fullmatch(r"Speedup: \d+\.\d\dx\nAcceptance rate: \d+\.\d%\n", out), out
    result = scope["result"]
    assert result.identical_to_plain is True and result.finish_reason in ("stop", "length")
    assert len(result.token_ids) <= 20 and result.text
    assert result.speedup == pytest.approx(result.tokens_per_second / result.baseline_tokens_per_second)
    assert result.acceptance_rate == result.accepted / result.drafted
    engine = scope["engine"]  # messages render with the chat template, as every stage renders them
    messages = [{"role": "user", "content": "Name a colour."}]
    assert engine.encode(messages) == engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert engine.encode("Explain quantum computing:") == engine.tokenizer("Explain quantum computing:")["input_ids"]


def test_counts_mean_what_the_docs_say(tiny_verifier, smollm2_tokenizer):
    """An oracle right at depths 0 and 1 only: AL, acceptance rate and per-position acceptance are the counts
    of the steps; speedup is the ratio of the two tokens/s measured in the call; a tree keeps more."""
    prompt = [1, 504, 3458, 282, 260, 1115, 30]
    greedy = greedy_generate(tiny_verifier, prompt, 12)
    oracle = RankOracle(tiny_verifier.config, prompt + greedy.tokens, num_depths=3, second={2})
    chain = PEAGLEInference.from_models(tiny_verifier, oracle, smollm2_tokenizer, speculation_depth=3)
    r = chain.generate(prompt, max_new_tokens=12, measure_speedup=True)
    assert r.token_ids == greedy.tokens and r.identical_to_plain is True
    spec = r.speculative
    steps = [(n, k) for n, k in zip(spec.accepted_per_step, spec.drafted_per_step) if k > 0]
    assert r.num_drafts == len(steps) and r.accepted == sum(n for n, _ in steps)
    assert r.acceptance_length == pytest.approx(sum(n + 1 for n, _ in steps) / len(steps))  # tokens per step
    assert r.acceptance_rate == pytest.approx(r.accepted / r.drafted)
    assert r.per_position_acceptance[:2] == [1.0, 1.0] and r.per_position_acceptance[2] == 0.0
    assert r.tokens_per_second == pytest.approx(len(r.token_ids) / r.wall_time_s)
    assert r.speedup == pytest.approx(r.tokens_per_second / r.baseline_tokens_per_second)
    tree = PEAGLEInference.from_models(tiny_verifier, oracle, smollm2_tokenizer, tree={"topk": [1, 1, 2]})
    t = tree.generate(prompt, max_new_tokens=12)
    assert t.token_ids == greedy.tokens and t.acceptance_length > r.acceptance_length
    assert t.tree_nodes == sum(t.speculative.nodes_per_step) and t.speedup is None
    assert acceptance_summary([spec], 3)["acceptance_length"] == r.acceptance_length


def test_stream_and_batch_give_generates_tokens(tiny_verifier, smollm2_tokenizer):
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    engine = PEAGLEInference.from_models(tiny_verifier, tiny_drafter(tiny_verifier), smollm2_tokenizer)
    prompts = ["Hello there", [{"role": "user", "content": "Name a colour."}]]
    whole = [engine.generate(p, max_new_tokens=9) for p in prompts]
    assert [b.token_ids for b in engine.generate_batch(prompts, max_new_tokens=9)] == [w.token_ids for w in whole]
    chunks = list(engine.stream(prompts[1], max_new_tokens=9))
    assert chunks[-1].result is not None and chunks[-1].result.token_ids == whole[1].token_ids
    assert sum((c.token_ids for c in chunks), []) == whole[1].token_ids
    assert "".join(c.text for c in chunks) == whole[1].text
    assert len(chunks) - 1 == 1 + whole[1].speculative.verifier_steps  # the prefill's token, then one per step


def test_unseeded_sampling_draws_afresh_and_a_seed_repeats(tiny_verifier, smollm2_tokenizer, one_thread):
    """At T = 1 four unseeded calls give four samples (a fresh draw each call, as transformers and vLLM); the same
    seed gives the same sample, in generate, stream and generate_batch alike."""
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    engine = PEAGLEInference.from_models(tiny_verifier, tiny_drafter(tiny_verifier), smollm2_tokenizer)
    unseeded = [tuple(engine.generate("Hello there", max_new_tokens=6, temperature=1.0).token_ids)
                for _ in range(4)]
    assert len(set(unseeded)) == 4, unseeded  # a random tiny verifier: about uniform over 49152 tokens
    streamed = [tuple(sum((c.token_ids for c in engine.stream("Hello there", max_new_tokens=6, temperature=1.0)),
                          [])) for _ in range(2)]
    assert len(set(streamed + unseeded)) == 6
    batch = [tuple(r.token_ids) for r in engine.generate_batch(["Hello there"] * 2, max_new_tokens=6,
                                                               temperature=1.0)]
    assert len(set(batch + unseeded)) == 6
    seeded = engine.generate("Hello there", max_new_tokens=6, temperature=1.0, seed=7).token_ids
    assert engine.generate("Hello there", max_new_tokens=6, temperature=1.0, seed=7).token_ids == seeded
    assert sum((c.token_ids for c in engine.stream("Hello there", max_new_tokens=6, temperature=1.0, seed=7)),
               []) == seeded
    assert engine.generate_batch(["Hi", "Hello there"], max_new_tokens=6, temperature=1.0,
                                 seed=6)[1].token_ids == seeded  # prompt i: seed + i


def test_closing_a_stream_stops_its_decoding(tiny_verifier, smollm2_tokenizer, one_thread):
    """``close()``, leaving a ``for`` loop and garbage collection each stop the decoding at once: no thread is
    left running a 5000-token generation; a closed stream still decodes exactly what it yielded."""
    import gc
    import threading
    import time

    from tests.peagle_train.generate.test_speculative import tiny_drafter

    engine = PEAGLEInference.from_models(tiny_verifier, tiny_drafter(tiny_verifier), smollm2_tokenizer)
    whole = engine.generate("Hello there", max_new_tokens=12).token_ids
    threads = threading.active_count()
    start = time.monotonic()
    gen = engine.stream("Hello there", max_new_tokens=5000)
    first = next(gen).token_ids + next(gen).token_ids
    assert first == whole[:len(first)]
    gen.close()
    assert threading.active_count() == threads
    for i, _ in enumerate(engine.stream("Hello there", max_new_tokens=5000)):
        if i == 2:
            break
    assert threading.active_count() == threads
    abandoned = engine.stream("Hello there", max_new_tokens=5000)
    next(abandoned)
    del abandoned
    gc.collect()
    assert threading.active_count() == threads
    assert time.monotonic() - start < 60  # 3 x 5000 tokens would take minutes


STREAM_EXIT_SCRIPT = '''
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
from peagle_train.generate.inference import PEAGLEInference
from tests.peagle_train.generate.test_speculative import tiny_drafter

verifier = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
engine = PEAGLEInference.from_models(verifier, tiny_drafter(verifier), AutoTokenizer.from_pretrained(sys.argv[1]))
stream = engine.stream("Hello there", max_new_tokens=5000)
for i, chunk in enumerate(stream):
    if i == 2:
        break
print("stopped reading", flush=True)
'''


@pytest.mark.slow
def test_a_program_that_stops_reading_a_stream_exits_cleanly(tiny_verifier_dir, tmp_path):
    """A program that leaves its stream loop early and exits (the iterator still referenced) exits 0, three times
    of three: no "terminate called without an active exception" abort (exit 134)."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(repo), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", STREAM_EXIT_SCRIPT, str(tiny_verifier_dir)], env=env,
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]  # together: one process's start-up time for the three
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert (proc.returncode, out) == (0, "stopped reading\n"), err[-3000:]
        assert "terminate called" not in err


def test_refusals_say_why(tiny_verifier, smollm2_tokenizer):
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    drafter = tiny_drafter(tiny_verifier)
    tree = PEAGLEInference.from_models(tiny_verifier, drafter, smollm2_tokenizer, tree={"nodes": 8})
    with pytest.raises(InputError, match="greedy only"):
        tree.generate("Hi", max_new_tokens=4, temperature=0.8)
    with pytest.raises(InputError, match="exceeds the drafter's trained num_depths 4"):
        PEAGLEInference.from_models(tiny_verifier, drafter, smollm2_tokenizer, speculation_depth=5)
    with pytest.raises(InputError, match="tool calls"):
        tree.encode([{"role": "tool", "content": "x"}])


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory, copy_smollm2_tokenizer) -> tuple[Path, Path]:
    """A Qwen3.5 hybrid verifier (the multimodal wrapper; gated DeltaNet and attention layers, the SmolLM2 vocab
    and tokenizer) and a random drafter checkpoint for it: ``(verifier_dir, drafter_dir)``."""
    root = tmp_path_factory.mktemp("hybrid")
    verifier_dir = save_family("qwen3_5", root / "verifier", vocab_size=49152)
    copy_smollm2_tokenizer(verifier_dir)
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=49152, draft_vocab_size=1024, aux_layer_ids=[1, 2, 4],
                        num_depths=3, verifier_name_or_path=str(verifier_dir))
    torch.manual_seed(0)
    drafter = PEagleDrafter(cfg).eval()
    drafter.init_from_verifier(torch.randn(49152, 64) * 0.02, torch.randn(49152, 64) * 0.02,
                               d2t=torch.zeros(1024, dtype=torch.long))
    save_drafter(drafter, root / "drafter")
    return verifier_dir, root / "drafter"


def test_a_hybrid_verifier_generates_its_greedy_output_and_refuses_a_tree(hybrid_checkpoint, monkeypatch):
    """PEAGLEInference on a hybrid verifier: greedy output equals plain decoding and a full forward's argmax loop,
    streaming gives the same tokens, seeded sampling repeats; a tree is refused before the weights load."""
    import peagle_train.generate.inference as inference

    verifier_dir, drafter_dir = hybrid_checkpoint
    engine = PEAGLEInference(drafter_dir, target_model=str(verifier_dir), warmup=False)
    messages = [{"role": "user", "content": "Name a colour."}]
    r = engine.generate(messages, max_new_tokens=10, measure_speedup=True)
    ids = engine.encode(messages)
    want = []
    with torch.no_grad():
        while len(want) < 10 and (not want or want[-1] not in engine.eos):
            want.append(int(engine.verifier(input_ids=torch.tensor([ids + want])).logits[0, -1].argmax()))
    assert r.token_ids == want and r.identical_to_plain is True and r.drafted > 0
    assert sum((c.token_ids for c in engine.stream(messages, max_new_tokens=10)), []) == want
    sampled = [engine.generate(messages, max_new_tokens=8, temperature=0.8, seed=3).token_ids for _ in range(2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) >= 1

    def no_weights(*args, **kwargs):
        raise AssertionError("the verifier's weights were loaded")

    monkeypatch.setattr(inference, "load_for_decoding", no_weights)
    with pytest.raises(InputError, match="recurrent state.*Use the chain"):
        PEAGLEInference(drafter_dir, target_model=str(verifier_dir), tree={"topk": [2, 1]}, warmup=False)


def test_peagle_eval_online_with_a_hybrid_verifier(hybrid_checkpoint, tmp_path, monkeypatch):
    """``peagle-eval``'s online run on a hybrid: identical to greedy, the cost model skipped with the reason (it
    does not time the recompute pass); a tree refused before the weights load."""
    import peagle_train.evaluate.online as online

    verifier_dir, drafter_dir = hybrid_checkpoint
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name a colour."}) + "\n")
    report = online.run_online_eval(drafter_dir, str(verifier_dir), prompts, max_new_tokens=6)
    assert report["identical_to_greedy"] is True and report["num_prompts"] == 1
    assert "hybrid verifier" in report["cost_model"]["skipped"]
    monkeypatch.setattr(online, "load_for_decoding", None)  # a tree must be refused before this is reached
    with pytest.raises(InputError, match="recurrent state"):
        online.run_online_eval(drafter_dir, str(verifier_dir), prompts, max_new_tokens=6, tree_topk=[2, 1])


def test_eval_cli_tree_equals_greedy(tiny_verifier, tiny_verifier_dir, tmp_path):
    """``peagle-eval --tree-topk`` reaches the tree through the API; T > 0 with a tree is refused."""
    from click.testing import CliRunner

    from cli.eval import main
    from tests.peagle_train.evaluate.test_evaluate import saved_drafter_and_store, write_lines

    saved_drafter_and_store(tiny_verifier, tiny_verifier_dir, tmp_path)
    prompts = write_lines(tmp_path / "p.jsonl", [{"question_id": 7, "turns": ["Hi", "Again"]}])
    result = CliRunner().invoke(main, ["--drafter", str(tmp_path / "drafter"), "--prompts", prompts,
                                       "--max-new-tokens", "6", "--tree-topk", "2,2,1,1"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["identical_to_greedy"] is True and report["tree"] == {"topk": [2, 2, 1, 1], "max_nodes": 14}
    assert report["tree_nodes_verified"] > 0 and "skipped" in report["cost_model"]
    assert "tree {'topk': [2, 2, 1, 1], 'max_nodes': 14}" in result.stderr
    refused = CliRunner().invoke(main, ["--drafter", str(tmp_path / "drafter"), "--prompts", prompts,
                                        "--tree-nodes", "8", "--temperature", "0.7"])
    assert refused.exit_code == 2 and "greedy only" in refused.output


VLLM_SCRIPT = '''
import json, sys
from peagle_train.generate.inference import PEAGLEInference

if __name__ == "__main__":  # vLLM spawns its engine process: importable without running
    drafter, out = sys.argv[1], sys.argv[2]
    prompts = ["Explain quantum computing:", [{"role": "user", "content": "Name a colour."}]]
    engine = PEAGLEInference(drafter_checkpoint=drafter, target_model="smollm2-135m", speculation_depth=3,
                             engine="vllm")
    got = []
    for r in engine.generate_batch(prompts, max_tokens=12):
        got.append({k: getattr(r, k) for k in ("token_ids", "engine", "acceptance_length", "acceptance_rate",
                                               "accepted", "drafted", "num_drafts", "vllm_counters", "speedup")}
                   | {"steps": [r.speculative.accepted_per_step, r.speculative.drafted_per_step]})
    try:
        engine.generate(prompts[0], max_tokens=4, measure_speedup=True)
    except ValueError as e:
        refused = str(e)
    engine.close()
    json.dump({"results": got, "refused": refused, "ids": [engine.encode(p) for p in prompts]}, open(out, "w"))
'''


@pytest.mark.vllm
def test_engine_vllm_generates_through_vllm(smollm2_checkpoints, tmp_path):
    """``engine="vllm"``: vLLM's greedy tokens (those of peagle's engine) and its acceptance counters; the
    speedup is refused with the reason (one engine holds the drafter)."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[3]
    (tmp_path / "api.py").write_text(VLLM_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(repo), "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(tmp_path / "api.py"), str(smollm2_checkpoints / "checkpoints" /
                                                                        "best_model"), str(tmp_path / "out.json")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert "cannot measure the speedup" in out["refused"]
    peagle = PEAGLEInference(drafter_checkpoint=smollm2_checkpoints / "checkpoints" / "best_model",
                             target_model="smollm2-135m", speculation_depth=3, warmup=False)
    for r, ids in zip(out["results"], out["ids"]):
        assert r["engine"] == "vllm" and r["speedup"] is None and 0 < len(r["token_ids"]) <= 12
        assert r["token_ids"] == peagle.generate(ids, max_new_tokens=12).token_ids
        accepted, drafted = r["steps"]
        c = r["vllm_counters"]
        assert c["num_drafts"] == len(drafted) and c["num_accepted_tokens"] == sum(accepted) == r["accepted"]
        assert c["num_draft_tokens"] == sum(drafted) == r["drafted"] == 3 * len(drafted)
        assert r["acceptance_length"] == pytest.approx(1 + r["accepted"] / r["num_drafts"])


def test_a_native_vllm_drafter_loads_as_its_peagle_checkpoint(tiny_verifier, tmp_path):
    """The native vLLM layout (no embed_tokens, no recorded K) loads with the verifier's embedding and the given
    depth, tensor for tensor the peagle checkpoint it came from; one without mask_hidden is refused."""
    from safetensors.torch import load_file, save_file

    from peagle_train.generate.inference import load_any_drafter
    from tests.peagle_train.generate.test_speculative import tiny_drafter
    from tests.peagle_train.model.test_warm_start import _native

    drafter = tiny_drafter(tiny_verifier, num_depths=3)
    drafter.config.mask_token_id = 7
    drafter.init_from_verifier(tiny_verifier.model.embed_tokens.weight.detach(), tiny_verifier.lm_head.weight.detach())
    save_drafter(drafter, tmp_path / "p")
    native = _native(tmp_path / "p", tmp_path / "n")
    with pytest.raises(InputError, match="records no trained number of depths"):
        load_any_drafter(native, None)
    _, loaded, finish = load_any_drafter(native, 3)
    finish(tiny_verifier)
    assert loaded.config.num_depths == 3 and loaded.config.mask_token_id == 7
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    weights = load_file(str(native / "model.safetensors"))
    del weights["mask_hidden"]
    save_file(weights, str(native / "model.safetensors"))
    with pytest.raises(InputError, match=r"missing \['mask_hidden'\]"):  # no trained input for depths >= 1
        load_any_drafter(native, 3)


def test_a_dflash_checkpoint_decodes_its_verifiers_greedy_output_and_refuses_a_tree(tiny_verifier, tiny_verifier_dir,
                                                                                     tmp_path):
    """``PEAGLEInference`` on a DFlash checkpoint (read by its kind): a chain of B - 1 drafts a step whose output
    is the verifier's greedy output; a tree is refused with the reason."""
    from peagle_train.generate.tree import DFLASH_TREE_REFUSED
    from peagle_train.model.dflash_checkpoint import save_dflash
    from tests.peagle_train.generate.test_speculative import tiny_dflash

    drafter = tiny_dflash(tiny_verifier, block_size=3)
    drafter.config.verifier_name_or_path = str(tiny_verifier_dir)
    save_dflash(drafter, tmp_path / "dflash")
    prompt = [1, 504, 3458, 282, 260, 1115, 30]
    api = PEAGLEInference(str(tmp_path / "dflash"), warmup=False)
    r = api.generate(prompt, max_new_tokens=12)
    assert r.token_ids == greedy_generate(tiny_verifier, prompt, 12).tokens and api.K == 2
    assert r.speculative.drafted_per_step[0] == 2
    with pytest.raises(InputError) as e:
        PEAGLEInference(str(tmp_path / "dflash"), tree={"topk": [1, 1]}, warmup=False)
    assert DFLASH_TREE_REFUSED in str(e.value)


def test_eval_cli_decodes_a_dflash_drafter_as_the_verifier_does(tiny_verifier, tiny_verifier_dir, tmp_path):
    """``peagle-eval --prompts`` with a DFlash checkpoint: peagle's chain engine, B - 1 drafts a step, output
    identical to greedy; ``--tree-topk`` is refused with the reason."""
    from click.testing import CliRunner

    from cli.eval import main
    from peagle_train.model.dflash_checkpoint import save_dflash
    from tests.peagle_train.evaluate.test_evaluate import write_lines
    from tests.peagle_train.generate.test_speculative import tiny_dflash

    drafter = tiny_dflash(tiny_verifier, block_size=4)
    drafter.config.verifier_name_or_path = str(tiny_verifier_dir)
    save_dflash(drafter, tmp_path / "dflash")
    prompts = write_lines(tmp_path / "p.jsonl", [{"question_id": 7, "turns": ["Hi", "Again"]}])
    result = CliRunner().invoke(main, ["--drafter", str(tmp_path / "dflash"), "--prompts", prompts,
                                       "--max-new-tokens", "6", "--no-measure-costs"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["identical_to_greedy"] is True and report["num_draft_tokens"] == 3, report
    refused = CliRunner().invoke(main, ["--drafter", str(tmp_path / "dflash"), "--prompts", prompts,
                                        "--tree-topk", "2,1,1"])
    assert refused.exit_code == 2 and "drafts one chain per step" in refused.output


def smollm2_dflash(directory: Path) -> Path:
    """A random 1-layer DFlash drafter (blocks of 4) for the embedded SmolLM2-135M (a 1024-token draft vocab)."""
    from peagle_train.model.dflash import DFlashConfig, DFlashDrafter
    from peagle_train.model.dflash_checkpoint import save_dflash

    cfg = DFlashConfig(hidden_size=576, intermediate_size=256, num_attention_heads=9, num_key_value_heads=3,
                       head_dim=64, vocab_size=49152, draft_vocab_size=1024, aux_layer_ids=[1, 15, 29],
                       num_hidden_layers=1, mask_token_id=0, block_size=4, rope_theta=100000.0,
                       verifier_name_or_path="smollm2-135m")
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).eval()
    drafter.init_from_verifier(torch.randn(49152, 576) * 0.02, torch.randn(49152, 576) * 0.02,
                               d2t=torch.zeros(1024, dtype=torch.long))
    save_dflash(drafter, directory)
    return directory


@pytest.mark.vllm
def test_peagle_eval_engine_vllm_counts_a_dflash_drafter_as_peagles_engine(tmp_path):
    """``peagle-eval --engine vllm`` with a DFlash checkpoint (``method dflash``, K = B - 1) against
    ``peagle-eval`` with peagle's engine on the same prompts: both greedy-identical, vLLM drafts K at every step,
    and every turn's per-step accepted counts agree (vLLM's last step at least peagle's). ``PEAGLEInference(engine=
    "vllm")`` builds its engine from the same :meth:`~peagle_train.train.kinds.DrafterKind.speculative_config`."""
    import os
    import subprocess
    import sys

    smollm2_dflash(tmp_path / "dflash")
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(repo), "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1"}
    reports = {}
    for engine in ("vllm", "peagle"):
        proc = subprocess.run([sys.executable, "-m", "cli.eval", "--drafter", str(tmp_path / "dflash"), "--prompts",
                               str(repo / "examples" / "prompts.jsonl"), "--num-prompts", "2", "--max-new-tokens",
                               "12", "--engine", engine, "--no-measure-costs", "--output",
                               str(tmp_path / f"{engine}.json")],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
        assert proc.returncode == 0, proc.stderr[-6000:]
        reports[engine] = json.loads((tmp_path / f"{engine}.json").read_text())
    theirs, ours = reports["vllm"], reports["peagle"]
    assert theirs["engine"] == "vllm" and theirs["identical_to_greedy"] and ours["identical_to_greedy"]
    assert theirs["drafted"] == 3 * theirs["num_drafts"] and len(theirs["per_prompt"]) == len(ours["per_prompt"])
    for v, p in zip(theirs["per_prompt"], ours["per_prompt"]):
        a, b = v["vllm_steps"]["accepted"], p["steps"]["accepted"]
        assert set(v["vllm_steps"]["drafted"]) == {3} and len(a) == len(b)
        assert a[:-1] == b[:-1] and a[-1] >= b[-1], (a, b)
