"""Units of vLLM as the decoding engine (peagle_train/generate/vllm_engine.py) that need no engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from peagle_train.generate.speculative import Truncation
from tests.peagle_train.evaluate.test_vllm_eval import NEWER_VLLM, newer_vllm


def test_engine_settings_are_exact_on_cpu_and_as_served_on_an_accelerator():
    from peagle_train.generate.vllm_engine import engine_settings

    assert engine_settings(True) == {"dtype": "float32", "enforce_eager": True}
    assert engine_settings(False) == {"dtype": "bfloat16", "enforce_eager": False}


def test_engine_settings_on_cpu_are_bf16_for_a_gated_deltanet_verifier_and_its_drafter(tmp_path):
    """vLLM's CPU gated DeltaNet kernel computes bf16 only: Qwen3-Next (and a drafter naming it) runs bf16 on CPU,
    without prefix caching (CPU_HYBRID_PREFIX_CACHING), an attention-only verifier float32."""
    import json
    import sys

    from peagle_train.generate.vllm_engine import engine_settings

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from families import family_config

    for name in ("qwen3_next", "qwen3"):
        family_config(name).save_pretrained(tmp_path / name)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps(
        {"speculators_config": {"verifier": {"name_or_path": str(tmp_path / "qwen3_next")}}}))
    # a hybrid verifier without prefix caching on CPU: vLLM's 'align' state copies are a Triton kernel
    bf16 = {"dtype": "bfloat16", "enforce_eager": True, "enable_prefix_caching": False}
    assert engine_settings(True, str(tmp_path / "qwen3_next")) == bf16 == engine_settings(True, str(drafter))
    assert engine_settings(True, str(tmp_path / "qwen3")) == {"dtype": "float32", "enforce_eager": True}
    assert engine_settings(False, str(tmp_path / "qwen3_next")) == {"dtype": "bfloat16", "enforce_eager": False}


def test_a_request_cut_by_max_model_len_is_refused():
    import pytest

    from peagle_train.generate.vllm_engine import check_full_length
    from stores.errors import InputError

    check_full_length(10, [1, 2, 3], 3, [9], 4096)  # full length
    check_full_length(10, [1, 9], 3, [9], 4096)  # ended by an EOS
    with pytest.raises(InputError, match=r"a prompt of 4000 tokens got 96 of --max-new-tokens 128 before vLLM's "
                                         r"max_model_len 4096; lower --max-new-tokens or shorten the prompts"):
        check_full_length(4000, [1] * 96, 128, [9], 4096)


def test_vllm_generate_reports_progress_per_request_with_a_final_line(monkeypatch, capsys):
    """issue 34 item 6: the vLLM passes said nothing until the turn ended; a fake vLLM (no engine) shows the
    concurrency-1 requests counted, later turns included, and the final line."""
    import sys
    from types import ModuleType, SimpleNamespace

    import peagle_train.generate.vllm_engine as engine

    class LLM:
        def __init__(self, **kwargs):
            self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=None))

        def generate(self, prompts, params, use_tqdm):
            sent.extend(params if isinstance(params, list) else [params])
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7] * params.max_tokens)]) for _ in prompts]

    sent = []
    vllm = ModuleType("vllm")
    vllm.LLM = LLM
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)
    platforms, inputs = ModuleType("vllm.platforms"), ModuleType("vllm.inputs")
    platforms.current_platform = SimpleNamespace(is_cpu=lambda: True)
    inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(engine, "import_vllm", lambda: vllm)
    turns = iter([[[1, 2]], []])  # one later turn of one request, then none
    run = engine.vllm_generate("m", [[1], [2], [3]], 3, concurrency=2, turns=lambda outs: next(turns),
                               temperature=1.0, truncation=Truncation(20, 0.95))
    assert run.tokens == [[7, 7, 7]] * 4 and set(run.tokens_per_second) == {1, 2}
    counted = [p for p in sent if p.max_tokens == 3]  # every request but the warm-up states the top-k / top-p
    assert counted and all((p.top_k, p.top_p, p.temperature) == (20, 0.95, 1.0) for p in counted)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("vLLM")]
    assert len(lines) == 1 and lines[0].startswith("vLLM plain requests: done: 4 request in "), lines


def test_top_logits_of_read_vllms_raw_logits():
    from types import SimpleNamespace

    from peagle_train.generate.vllm_engine import request_seed, top_logits_of

    lp = SimpleNamespace
    out = SimpleNamespace(outputs=[SimpleNamespace(logprobs=[
        {7: lp(logprob=12.5, rank=1), 3: lp(logprob=12.25, rank=2)},
        {4: lp(logprob=3.0, rank=2), 9: lp(logprob=3.5, rank=1)}])])
    assert top_logits_of(out) == [{7: 12.5, 3: 12.25}, {4: 3.0, 9: 3.5}]
    assert request_seed(2, 5) == 2 * 1_000_003 + 5


def test_the_python_apis_vllm_engine_refuses_a_vllm_that_dropped_p_eagle(tmp_path, tiny_verifier, monkeypatch):
    from peagle_train.generate import inference
    from peagle_train.generate.vllm_engine import VllmSpeculativeEngine
    from peagle_train.model.checkpoint import save_drafter
    from stores.errors import InputError
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    newer_vllm(monkeypatch)
    save_drafter(tiny_drafter(tiny_verifier), tmp_path / "drafter")
    monkeypatch.setattr(inference, "load_any_drafter", lambda *a: pytest.fail("the drafter loaded"))
    with pytest.raises(InputError) as e:
        inference.PEAGLEInference(tmp_path / "drafter", "smollm2-135m", engine="vllm")
    assert str(e.value).startswith("field 'engine': ") and all(part in str(e.value) for part in NEWER_VLLM)
    with pytest.raises(InputError, match="no longer serves P-EAGLE"):
        VllmSpeculativeEngine("smollm2-135m", tmp_path / "drafter", 3, None)

