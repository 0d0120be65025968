"""Our checkpoint against what speculators 0.9.0 declares (its wheel is too heavy to install here).

The field names, types and defaults below are copied from speculators 0.9.0:
- ``speculators/models/peagle/config.py`` (``PEagleSpeculatorConfig``, registered as "peagle"),
- ``speculators/models/eagle3/config.py`` (``Eagle3SpeculatorConfig``, its base),
- ``speculators/config.py`` (``SpeculatorModelConfig``: ``extra="allow"``; ``SpeculatorsConfig``,
  ``VerifierConfig``), ``speculators/proposals/greedy.py`` (``GreedyTokenProposalConfig``),
- ``speculators/models/eagle3/core.py`` and ``speculators/models/peagle/core.py`` (module names:
  ``embed_tokens``, ``fc``, ``layers`` with ``hidden_norm`` on the first, ``norm``, ``lm_head``,
  buffers ``d2t``/``t2d``, parameter ``mask_hidden [1, 1, num_aux * hidden]``).
"""

import json

import pytest
import torch
from safetensors import safe_open

from peagle_train.model.checkpoint import save_drafter
from peagle_train.model.config import DrafterConfig
from peagle_train.model.drafter import PEagleDrafter

# speculators 0.9.0 PEagleSpeculatorConfig fields (own + Eagle3SpeculatorConfig + SpeculatorModelConfig): type
SPECULATORS_FIELDS = {
    "speculators_model_type": str,  # Literal["peagle"]
    "architectures": list,  # default ["PEagleSpeculator"]
    "mask_token_id": (int, type(None)),
    "embed_requires_grad": bool,  # P-EAGLE default True
    "transformer_layer_config": dict,  # PretrainedConfig, serialised with model_type
    "draft_vocab_size": int,
    "norm_before_residual": bool,
    "target_hidden_size": (int, type(None)),
    "eagle_aux_hidden_state_layer_ids": (list, type(None)),
    "norm_before_fc": bool,
    "fc_norm": bool,
    "norm_output": bool,
    "speculators_version": str,
    "speculators_config": dict,
}
REQUIRED = {"speculators_model_type", "architectures", "transformer_layer_config", "draft_vocab_size",
            "eagle_aux_hidden_state_layer_ids", "mask_token_id", "speculators_config"}
SPECULATORS_CONFIG_FIELDS = {"algorithm": str, "proposal_methods": list, "default_proposal_method": str,
                             "verifier": dict}
GREEDY_FIELDS = {"proposal_type": "greedy", "speculative_tokens": int}  # speculative_tokens >= 1
VERIFIER_FIELDS = {"name_or_path": (str, type(None)), "architectures": list}


def _saved(tmp_path, num_layers=2):
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=100, draft_vocab_size=40, aux_layer_ids=[1, 3, 5],
                        num_hidden_layers=num_layers, mask_token_id=7, num_depths=5, verifier_name_or_path="v")
    model = PEagleDrafter(cfg)
    model.init_from_verifier(torch.randn(100, 32), torch.randn(100, 32), torch.arange(40))
    save_drafter(model, tmp_path / "ck")
    return json.loads((tmp_path / "ck" / "config.json").read_text()), tmp_path / "ck" / "model.safetensors"


def test_config_json_fields_have_the_speculators_types(tmp_path):
    cfg, _ = _saved(tmp_path)
    assert REQUIRED <= cfg.keys()
    for key, typ in SPECULATORS_FIELDS.items():
        if key in cfg:
            assert isinstance(cfg[key], typ), (key, cfg[key])
    assert cfg["speculators_model_type"] == "peagle" and cfg["architectures"] == ["PEagleSpeculator"]
    assert cfg["embed_requires_grad"] is True  # P-EAGLE trains the embedding
    assert not (cfg.get("norm_before_fc") and cfg.get("fc_norm"))  # speculators rejects both
    assert cfg["transformer_layer_config"]["model_type"] == "llama"  # picks LlamaConfig via AutoConfig
    sc = cfg["speculators_config"]
    for key, typ in SPECULATORS_CONFIG_FIELDS.items():
        assert isinstance(sc[key], typ), key
    assert sc["algorithm"] == "peagle"
    (method,) = sc["proposal_methods"]
    assert method["proposal_type"] == GREEDY_FIELDS["proposal_type"] and method["speculative_tokens"] >= 1
    assert sc["default_proposal_method"] == method["proposal_type"]
    for key, typ in VERIFIER_FIELDS.items():
        assert isinstance(sc["verifier"][key], typ), key


def test_tensor_names_are_the_speculators_module_names(tmp_path):
    _, weights = _saved(tmp_path)
    with safe_open(str(weights), "pt") as f:
        names = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in names}
    top = {n.split(".")[0] for n in names}
    assert top == {"embed_tokens", "fc", "mask_hidden", "layers", "norm", "lm_head", "d2t", "t2d"}
    assert shapes["mask_hidden"] == (1, 1, 3 * 32)  # num_aux * hidden_size
    assert "layers.0.hidden_norm.weight" in names and "layers.1.hidden_norm.weight" not in names
    # never saved by speculators either (_keys_to_ignore_on_save) nor needed: verifier_norm / verifier_lm_head
    assert not any(n.startswith(("verifier_norm", "verifier_lm_head")) for n in names)
    llama = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
             "input_layernorm.weight", "post_attention_layernorm.weight"}
    for i in (0, 1):
        assert {f"layers.{i}.{s}" for s in llama} <= names


# speculators 0.9.0 PEagleDraftModel(PEagleSpeculatorConfig(**our config.json)).state_dict() for the
# drafter of _reference_case (hidden 32, 4 heads of 8, 2 kv heads, MLP 64, 3 aux layers, V 100, layer 0
# of 1), less its _keys_to_ignore_on_save (verifier_lm_head.weight, verifier_norm.weight); printed
# by scripts/check_speculators_compat.py's PEagleDraftModel in a venv with speculators 0.9.0
REFERENCE_LAYER0 = {
    "mask_hidden": ((1, 1, 96), "F32"), "embed_tokens.weight": ((100, 32), "F32"), "fc.weight": ((32, 96), "F32"),
    "layers.0.self_attn.q_proj.weight": ((32, 64), "F32"), "layers.0.self_attn.k_proj.weight": ((16, 64), "F32"),
    "layers.0.self_attn.v_proj.weight": ((16, 64), "F32"), "layers.0.self_attn.o_proj.weight": ((32, 32), "F32"),
    "layers.0.mlp.gate_proj.weight": ((64, 32), "F32"), "layers.0.mlp.up_proj.weight": ((64, 32), "F32"),
    "layers.0.mlp.down_proj.weight": ((32, 64), "F32"), "layers.0.input_layernorm.weight": ((32,), "F32"),
    "layers.0.post_attention_layernorm.weight": ((32,), "F32"), "layers.0.hidden_norm.weight": ((32,), "F32"),
    "norm.weight": ((32,), "F32"),
}
REFERENCE_KEYS = {
    40: {**REFERENCE_LAYER0, "lm_head.weight": ((40, 32), "F32"), "d2t": ((40,), "I64"), "t2d": ((100,), "BOOL")},
    100: {**REFERENCE_LAYER0, "lm_head.weight": ((100, 32), "F32")},  # full vocab: no d2t / t2d buffers
}


@pytest.mark.parametrize("draft_vocab_size", [40, 100])
def test_state_dict_keys_equal_the_reference_for_reduced_and_full_vocab(tmp_path, draft_vocab_size):
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=100, draft_vocab_size=draft_vocab_size, aux_layer_ids=[1, 3, 5],
                        num_hidden_layers=1, mask_token_id=7, num_depths=5, verifier_name_or_path="v")
    model = PEagleDrafter(cfg)
    model.init_from_verifier(torch.randn(100, 32), torch.randn(100, 32),
                             torch.arange(40) if draft_vocab_size == 40 else None)
    save_drafter(model, tmp_path / "ck")
    with safe_open(str(tmp_path / "ck" / "model.safetensors"), "pt") as f:
        saved = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    assert saved == REFERENCE_KEYS[draft_vocab_size]  # a strict load: nothing missing, nothing unexpected
