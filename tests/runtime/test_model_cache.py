"""The embedded model's conversion writes weights readable as the umask allows (not 0600)."""

import os
import stat

import pytest


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_converted_weights_follow_the_umask(tmp_path, monkeypatch, umask, mode):
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    import runtime.model_cache as mc

    monkeypatch.setenv("PEAGLE_HOME", str(tmp_path / "home"))
    target = tmp_path / "home" / "models" / "smollm2-135m"
    target.mkdir(parents=True)
    (target / mc._TOKENIZER_DONE).touch()  # the tokenizer half is done: only the weights are written
    monkeypatch.setattr(mc, "gguf_path", lambda name: tmp_path / "fake.gguf")

    def tiny(*args, **kwargs):  # stands in for the dequantized GGUF
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", tiny)
    old = os.umask(umask)
    try:
        assert mc.resolve_model("smollm2-135m") == target
    finally:
        os.umask(old)
    weights = list(target.glob("*.safetensors"))
    assert [w.name for w in weights] == ["model.safetensors"]
    assert stat.S_IMODE(weights[0].stat().st_mode) == mode  # save_pretrained alone gives 0600
    assert stat.S_IMODE((target / "config.json").stat().st_mode) == mode


def test_hub_id_of_the_embedded_alias():
    from runtime.model_cache import hub_id

    assert hub_id("smollm2-135m") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_id("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B" and hub_id("/models/x") == "/models/x"


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text", "gemma3_mm", "nemotron_h"])
def test_load_submodule_reads_only_the_final_norm(tmp_path, family):
    """The final norm of a verifier from its checkpoint alone equals the fully loaded model's, for a
    causal LM, Gemma's (1 + w) RMSNorm, a multimodal wrapper and Nemotron-H (checkpoint names differ from the
    module's: ``model.language_model.norm`` / ``model.norm``, ``backbone.norm_f`` / ``model.norm_f``)."""
    import sys
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from peagle_data.extract.hf_forward import final_norm, language_model
    from runtime.model_cache import load_submodule, verifier_skeleton

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from families import save_family

    model_dir = save_family(family, tmp_path / family)
    with torch.no_grad():  # a norm weight that is not its initial value
        auto = AutoModelForImageTextToText if family == "gemma3_mm" else AutoModelForCausalLM
        full = auto.from_pretrained(model_dir, dtype=torch.float32)
        final_norm(language_model(full)).weight.normal_()
        full.save_pretrained(model_dir)
    skeleton = verifier_skeleton(model_dir)
    assert next(skeleton.parameters()).device.type == "meta"
    name = next(n for n, m in skeleton.named_modules() if m is final_norm(language_model(skeleton)))
    norm = load_submodule(model_dir, skeleton, name, torch.float32)
    ref = final_norm(language_model(auto.from_pretrained(model_dir, dtype=torch.float32)))
    assert type(norm) is type(ref)
    x = torch.randn(5, ref.weight.shape[0])
    assert torch.equal(norm.weight, ref.weight) and torch.equal(norm(x), ref(x))


@pytest.mark.parametrize("tied", [False, True])
def test_load_output_head_reads_the_head_alone_in_the_models_dtype(tmp_path, tied):
    """The output head ``[V, H]`` from the checkpoint alone, in the dtype the config declares: the loaded model's
    ``lm_head`` weight (the input embeddings where the config ties them)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from runtime.model_cache import load_output_head

    cfg = LlamaConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "m")
    head = load_output_head(tmp_path / "m")
    assert head.dtype == torch.bfloat16 and head.shape == (96, 16)
    assert torch.equal(head, model.lm_head.weight.detach())
    assert tied == torch.equal(head, model.model.embed_tokens.weight.detach())
