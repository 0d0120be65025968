"""``--init-layers verifier``: the drafter's decoder layers start as copies of the verifier's last ones
(peagle_train/model/warm_start.py: check_verifier_layers, copy_verifier_layers; peagle_train/train/setup.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

from peagle_train.model.config import DrafterConfig
from peagle_train.model.drafter import PEagleDrafter
from peagle_train.model.warm_start import COPYABLE_LAYERS, check_verifier_layers, copy_verifier_layers
from peagle_train.train.run import build_trainer
from stores.errors import InputError

from tests.families import FAMILIES, build_family, family_config

from .test_train import H, _cfg, _store


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory, make_tiny_llama):
    return make_tiny_llama(tmp_path_factory.mktemp("verifier"), hidden=H, vocab=256)


def _drafter_config(**kw) -> DrafterConfig:
    base = dict(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=256, draft_vocab_size=256, aux_layer_ids=[1, 2], num_hidden_layers=2)
    base.update(kw)
    return DrafterConfig(**base)


@pytest.mark.parametrize("num_layers", [1, 2])
def test_each_drafter_layer_starts_as_the_verifiers_layer_and_the_embedding_half_stays_fresh(tmp_path, verifier_dir,
                                                                                            num_layers):
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    fresh = build_trainer(_cfg(store, tmp_path / "r", max_steps=1, num_layers=num_layers)).unwrapped
    model = build_trainer(_cfg(store, tmp_path / "v", max_steps=1, num_layers=num_layers,
                               init_layers="verifier")).unwrapped
    verifier = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32).model.layers
    L = len(verifier)
    assert L == 3
    for i in range(num_layers):
        src = verifier[L - num_layers + i].state_dict()
        own = model.layers[i].state_dict()
        for name, want in src.items():
            if i == 0 and name == "input_layernorm.weight":
                assert torch.equal(own["hidden_norm.weight"], want)
                # the embedding's norm keeps its fresh initialisation
                assert torch.equal(own["input_layernorm.weight"], fresh.layers[0].input_layernorm.weight)
            elif i == 0 and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):
                assert torch.equal(own[name][:, H:], want)  # the columns that read the hidden half
                assert torch.equal(own[name][:, :H], fresh.layers[0].state_dict()[name][:, :H])  # the embedding's
            else:
                assert torch.equal(own[name], want), name
        assert not torch.equal(model.layers[i].mlp.up_proj.weight, fresh.layers[i].mlp.up_proj.weight)
    # what is not a decoder layer is the same as a fresh drafter's (same seed)
    for name in ("fc.weight", "mask_hidden", "norm.weight", "embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(model.state_dict()[name], fresh.state_dict()[name]), name


def test_init_layers_verifier_with_init_from_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="--init-layers verifier must be left out with --init-from"):
        _cfg(str(tmp_path / "s.zarr"), tmp_path / "o", init_layers="verifier", init_from=str(tmp_path))
    with pytest.raises(ValueError, match="--init-layers must be one of random, verifier"):
        _cfg(str(tmp_path / "s.zarr"), tmp_path / "o", init_layers="last")


@pytest.mark.parametrize("changes,reason", [
    ({"num_hidden_layers": 1}, "it has 1 decoder layers and the drafter 2"),
    ({"intermediate_size": 96}, "intermediate_size 96 (the drafter's 128)"),
    ({"head_dim": 8}, "head_dim 8 (the drafter's 16)"),
    ({"attention_bias": True}, "attention_bias true (the drafter's layers have no biases)"),
    ({"mlp_bias": True}, "mlp_bias true"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' (the drafter's 'silu')"),
    ({"model_type": "gemma"}, "its decoder layers (model_type 'gemma') are not a drafter layer exactly"),
    ({"model_type": "qwen3"}, "its qwen3 layers are the drafter layer 'qwen3', the drafter's is 'llama'"),
])
def test_a_verifier_whose_layers_the_drafter_cannot_copy_is_refused_from_its_config(changes, reason):
    vc = dict(model_type="llama", num_hidden_layers=3, hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, attention_bias=False, mlp_bias=False, hidden_act="silu")
    assert check_verifier_layers(SimpleNamespace(**vc), _drafter_config(), "v") == [1, 2]
    vc.update(changes)
    with pytest.raises(InputError, match=reason.replace("(", r"\(").replace(")", r"\)")) as err:
        check_verifier_layers(SimpleNamespace(**vc), _drafter_config(), "v")
    assert err.value.field == "--init-layers"


def _qwen3_layer_state() -> dict[str, torch.Tensor]:
    cfg = Qwen3Config(hidden_size=H, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      num_hidden_layers=1, vocab_size=256)
    state = Qwen3DecoderLayer(cfg, 0).state_dict()
    with torch.no_grad():
        for v in state.values():
            v.normal_()  # norms not all ones, so a copy is told from a fresh init
    return state


def test_a_qwen3_layers_q_norm_has_no_place_in_a_llama_drafter_layer():
    """Another family's layer is not copied approximately: Qwen3's per-head q_norm / k_norm are refused by name."""
    model = PEagleDrafter(_drafter_config(num_hidden_layers=1))
    with pytest.raises(InputError, match=r"self_attn\.[qk]_norm\.weight \(16,\) has no place in drafter layer 0"):
        copy_verifier_layers(model, [_qwen3_layer_state()])


def test_a_qwen3_drafter_layer_takes_every_tensor_of_a_qwen3_layer():
    state = _qwen3_layer_state()
    model = PEagleDrafter(_drafter_config(num_hidden_layers=1, layer_type="qwen3"))
    assert copy_verifier_layers(model, [state]) == ["layers.0.input_layernorm.weight"]  # the embedding's norm only
    own = model.layers[0].state_dict()
    assert torch.equal(own["self_attn.q_norm.weight"], state["self_attn.q_norm.weight"])
    assert torch.equal(own["self_attn.k_norm.weight"], state["self_attn.k_norm.weight"])
    assert torch.equal(own["self_attn.k_proj.weight"][:, H:], state["self_attn.k_proj.weight"])
    assert torch.equal(own["hidden_norm.weight"], state["input_layernorm.weight"])


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_matrix_is_copied_exactly_or_refused_from_its_config(family):
    """Llama, Mistral and Qwen3 layers are copied tensor for tensor into the drafter layer that computes them;
    every other family (Gemma's 1 + w norms, MoE experts, Qwen2's biases, gpt-oss sinks, multimodal wrappers'
    language models of those) is refused from its config, before any weights."""
    vc = family_config(family).get_text_config()
    layer_type = COPYABLE_LAYERS.get(vc.model_type, "llama")
    head_dim = getattr(vc, "head_dim", None) or vc.hidden_size // vc.num_attention_heads
    drafter = _drafter_config(hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
                              num_attention_heads=vc.num_attention_heads, num_key_value_heads=vc.num_key_value_heads,
                              head_dim=head_dim, vocab_size=vc.vocab_size, draft_vocab_size=vc.vocab_size,
                              num_hidden_layers=1, layer_type=layer_type, hidden_act=getattr(vc, "hidden_act", "silu"))
    if vc.model_type not in COPYABLE_LAYERS:
        with pytest.raises(InputError, match=f"model_type '{vc.model_type}'"):
            check_verifier_layers(vc, drafter, family)
        return
    assert check_verifier_layers(vc, drafter, family) == [vc.num_hidden_layers - 1]
    layer = build_family(family).get_decoder().layers[-1].state_dict()
    model = PEagleDrafter(drafter)
    assert copy_verifier_layers(model, [layer]) == ["layers.0.input_layernorm.weight"]
    assert torch.equal(model.layers[0].mlp.down_proj.weight, layer["mlp.down_proj.weight"])
