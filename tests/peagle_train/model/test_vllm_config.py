"""peagle's checkpoints against vLLM's own P-EAGLE config conversion, and vLLM's rules (docs/design.md §8).

The ``vllm`` tests import vLLM's code (``SpeculatorsConfig``, the speculators algorithm updaters) in
``.venv-vllm``; the others check :func:`peagle_train.model.checkpoint.vllm_problems` rule by rule.
"""

from __future__ import annotations

import json

import pytest
import torch

from peagle_train.model.checkpoint import save_drafter, vllm_problems
from peagle_train.model.config import DrafterConfig
from peagle_train.model.drafter import PEagleDrafter

H, V = 32, 100


def _drafter(layers, draft_vocab: int, num_depths: int = 3) -> PEagleDrafter:
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        vocab_size=V, draft_vocab_size=draft_vocab, aux_layer_ids=list(layers), num_hidden_layers=1,
                        mask_token_id=7, num_depths=num_depths, verifier_name_or_path="Org/Verifier")
    torch.manual_seed(0)
    m = PEagleDrafter(cfg)
    d2t = (torch.arange(draft_vocab) * 2 - torch.arange(draft_vocab)) if draft_vocab < V else None
    m.init_from_verifier(torch.randn(V, H), torch.randn(V, H), d2t)
    return m


CASES = [([2, 15, 27], 40), ([2, 15, 27], V), ([15, 30], 40), ([2, 15, 27, 30], V)]
IDS = ["3aux-reduced", "3aux-full", "2aux-reduced", "4aux-full"]


@pytest.mark.vllm
@pytest.mark.parametrize("layers, draft_vocab", CASES, ids=IDS)
def test_vllm_converts_the_checkpoint_as_trained(tmp_path, layers, draft_vocab):
    """vLLM's SpeculatorsConfig reads what peagle trained: the P-EAGLE llama drafter, the mask token
    as ``pard_token``, fc as wide as the aux layers, the aux layers, no norm peagle did not train."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    save_drafter(_drafter(layers, draft_vocab), tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert SpeculatorsConfig.extract_vllm_speculative_config(raw) == {
        "method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": 3}
    hf = SpeculatorsConfig.from_pretrained(str(tmp_path / "d"))
    assert hf.architectures == ["PeagleLlamaForCausalLM"] and hf.model_type == "speculators"
    assert hf.pard_token == 7 and hf.draft_vocab_size == draft_vocab and hf.vocab_size == V
    assert hf.num_aux_hidden_states == len(layers)  # vLLM's fc width, target_hidden_size x this
    assert hf.target_hidden_size == H and hf.hidden_size == H
    assert list(hf.eagle_aux_hidden_state_layer_ids) == layers
    assert hf.norm_before_residual is False and hf.norm_before_fc is False
    assert not getattr(hf, "fc_norm", False) and not getattr(hf, "norm_output", False)
    assert hf.hidden_act == "silu" and hf.num_hidden_layers == 1 and hf.head_dim == 8
    assert vllm_problems(raw) == []


@pytest.mark.vllm
def test_vllm_maps_only_llama_and_qwen3_drafters():
    """The model types :data:`peagle_train.model.checkpoint.VLLM_MODEL_TYPES` names are vLLM's own."""
    from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES

    from peagle_train.model.checkpoint import VLLM_MODEL_TYPES

    for model_type in VLLM_MODEL_TYPES:
        layer = {"model_type": model_type}
        SUPPORTED_SPECULATORS_TYPES["peagle"]({"mask_token_id": 1}, layer)
        assert layer["architectures"][0].startswith("Peagle")
    with pytest.raises(ValueError, match="Unsupported model_type gemma2"):
        SUPPORTED_SPECULATORS_TYPES["peagle"]({"mask_token_id": 1}, {"model_type": "gemma2"})


@pytest.mark.parametrize("layers, draft_vocab", CASES, ids=IDS)
def test_written_checkpoints_follow_vllms_rules(tmp_path, layers, draft_vocab):
    from safetensors import safe_open

    save_drafter(_drafter(layers, draft_vocab), tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["transformer_layer_config"]["num_aux_hidden_states"] == len(layers)
    with safe_open(str(tmp_path / "d" / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert ("d2t" in shapes) == (draft_vocab < V) and shapes["mask_hidden"] == (1, 1, len(layers) * H)
    assert vllm_problems(raw, shapes) == []


def _config(tmp_path, layers=(2, 15, 27), draft_vocab=40):
    save_drafter(_drafter(layers, draft_vocab), tmp_path / "d")
    return json.loads((tmp_path / "d" / "config.json").read_text())


@pytest.mark.parametrize("edit, problem", [
    (lambda c: c["transformer_layer_config"].pop("num_aux_hidden_states"), None),  # 3 layers: vLLM's default 3
    (lambda c: c.pop("mask_token_id"), "mask_token_id is missing: vLLM needs it (pard_token)"),
    (lambda c: c["transformer_layer_config"].update(model_type="gemma2"),
     "transformer_layer_config.model_type 'gemma2': vLLM maps only ['llama', 'qwen3']"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[15, 2, 27]),
     "eagle_aux_hidden_state_layer_ids [15, 2, 27] is not strictly increasing: vLLM feeds the layers [2, 15, 27], "
     "in that order; extract with --layers 2,15,27"),
    (lambda c: c.update(norm_before_residual=True), "norm_before_residual is true"),
    (lambda c: c.update(fc_norm=True), "fc_norm is set: peagle's drafter has no such norm"),
    (lambda c: c["transformer_layer_config"].update(norm_output=True), "norm_output is set"),
    (lambda c: c.update(norm_before_fc=True), "norm_before_fc is set"),
    (lambda c: c["transformer_layer_config"].update(hidden_act="gelu_pytorch_tanh"),
     "hidden_act 'gelu_pytorch_tanh': vLLM's drafter MLP supports only silu"),
    (lambda c: c["transformer_layer_config"].update(num_aux_hidden_states=4),
     "vLLM sizes fc for 4 aux layers but the checkpoint has 3 ([2, 15, 27]); write \"num_aux_hidden_states\": 3 "
     "inside transformer_layer_config"),
    (lambda c: c.update(target_hidden_size=64), "target_hidden_size 64 != hidden_size 32"),
])
def test_each_rule_names_its_problem(tmp_path, edit, problem):
    cfg = _config(tmp_path)
    edit(cfg)
    problems = vllm_problems(cfg)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_missing_d2t_of_a_reduced_vocab_and_the_fc_width_are_checked_on_the_tensors(tmp_path):
    cfg = _config(tmp_path, layers=(15, 30))
    shapes = {"mask_hidden": (1, 1, 2 * H), "fc.weight": (H, 2 * H), "lm_head.weight": (40, H)}
    assert vllm_problems(cfg, shapes) == [
        "d2t is missing but the draft vocab is reduced (40 < 100): vLLM would map draft id i to token i"]
    shapes.update(d2t=(40,), **{"fc.weight": (H, 3 * H), "mask_hidden": (1, 1, 3 * H)})
    assert vllm_problems(cfg, shapes) == [
        "mask_hidden (1, 1, 96) must hold 2 x 32 values (vLLM requires it under parallel drafting)",
        "fc.weight (32, 96) is not [32, 64]"]


def _qwen3_with_stale_inner_ids(tmp_path):
    """A qwen3 drafter config whose transformer_layer_config holds other aux ids than the top level."""
    c = _config(tmp_path)
    c["transformer_layer_config"].update(model_type="qwen3", eagle_aux_hidden_state_layer_ids=[2, 15])
    c["transformer_layer_config"].pop("num_aux_hidden_states")
    return c


def test_qwen3_fc_width_comes_from_the_top_level_ids(tmp_path):
    assert vllm_problems(_qwen3_with_stale_inner_ids(tmp_path)) == []


@pytest.mark.vllm
def test_vllms_peagle_conversion_takes_the_top_level_ids(tmp_path):
    """vLLM's update_peagle replaces the inner ids by the top-level ones (what vllm_problems assumes)."""
    from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES

    c = _qwen3_with_stale_inner_ids(tmp_path)
    layer = dict(c["transformer_layer_config"])
    SUPPORTED_SPECULATORS_TYPES["peagle"](c, layer)
    assert layer["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]


def _qwen3_drafter(num_layers: int = 2) -> PEagleDrafter:
    import dataclasses

    base = _drafter([2, 15, 27], 40)
    m = PEagleDrafter(dataclasses.replace(base.config, layer_type="qwen3", num_hidden_layers=num_layers))
    m.load_state_dict(base.state_dict(), strict=False)
    return m


@pytest.mark.vllm
def test_vllm_converts_a_qwen3_layer_drafter_to_its_qwen3_peagle_model(tmp_path):
    """vLLM maps the qwen3 layer to PeagleQwen3ForCausalLM (qwen3_eagle3.Eagle3Qwen3ForCausalLM) with every layer
    full attention, no q/k/v bias, the head dim and eps of q_norm/k_norm peagle trained, and peagle's tensor names
    are the parameter names of vLLM's Qwen3Attention."""
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    save_drafter(_qwen3_drafter(), tmp_path / "d")
    hf = SpeculatorsConfig.from_pretrained(str(tmp_path / "d"))
    assert hf.architectures == ["PeagleQwen3ForCausalLM"] and hf.num_hidden_layers == 2
    entry = ModelRegistry.models["PeagleQwen3ForCausalLM"]
    assert (entry.module_name, entry.class_name) == ("vllm.model_executor.models.qwen3_eagle3",
                                                     "Eagle3Qwen3ForCausalLM")
    assert hf.layer_types == ["full_attention"] * 2 and hf.attention_bias is False and hf.head_dim == 8
    assert hf.rms_norm_eps == 1e-5 and hf.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}
    assert hf.num_aux_hidden_states == 3 and hf.pard_token == 7 and hf.norm_before_residual is False
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert vllm_problems(raw) == []


def test_a_qwen3_sliding_window_layer_is_a_problem(tmp_path):
    save_drafter(_qwen3_drafter(), tmp_path / "d")
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    raw["transformer_layer_config"]["layer_types"] = ["sliding_attention", "full_attention"]
    assert vllm_problems(raw) == [
        "transformer_layer_config.layer_types ['sliding_attention', 'full_attention']: vLLM's qwen3 drafter would "
        "attend within a sliding window there; the drafter is trained with full attention"]
