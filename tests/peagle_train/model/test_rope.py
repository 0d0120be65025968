"""The drafter's RoPE is the verifier's: type, scaling and theta, in training, evaluation and checkpoints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from peagle_train.generate.speculative import DrafterSession
from peagle_train.model.checkpoint import load_drafter, rope_from_layer_config, save_drafter
from peagle_train.model.config import DrafterConfig
from peagle_train.model.drafter import PEagleDrafter
from peagle_train.model.rope import rope_cos_sin
from stores.errors import StoreFormatError

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from families import FAMILIES, family_config  # noqa: E402

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": False}


def _cfg(rope=None, **kw) -> DrafterConfig:
    return DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=50, draft_vocab_size=50, aux_layer_ids=[1, 2],
                         max_position_embeddings=131072, rope_parameters=rope, **kw)


@pytest.mark.parametrize("rope", [None, LLAMA3, YARN, {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}],
                         ids=["default", "llama3", "yarn", "linear"])
def test_rope_tables_equal_transformers_llama(rope):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = _cfg(rope)
    lc = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=131072,
                     rope_parameters=dict(cfg.rope_parameters))
    pos = torch.tensor([0, 1, 7, 300, 5000])
    cos, sin = rope_cos_sin(pos, cfg, torch.float32)
    want_cos, want_sin = LlamaRotaryEmbedding(lc)(torch.zeros(1, 5, 16), pos[None])
    torch.testing.assert_close(cos, want_cos[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sin, want_sin[0], atol=1e-5, rtol=1e-5)


def test_scaling_changes_the_drafter_output_in_training_and_in_the_session():
    torch.manual_seed(0)
    plain = PEagleDrafter(_cfg(None, rope_theta=500000.0)).eval()
    plain.reset_parameters(std=0.3)
    scaled = PEagleDrafter(_cfg(LLAMA3)).eval()
    scaled.load_state_dict(plain.state_dict())
    E = 6
    ids, g, depth0 = torch.arange(E), torch.randn(E, 64), torch.zeros(E, dtype=torch.bool)
    causal = torch.ones(E, E, dtype=torch.bool).tril()
    spread = torch.arange(E) * 20000  # llama3 scaling only changes the slow frequencies
    with torch.no_grad():
        assert not torch.allclose(plain(ids, g, depth0, spread, causal), scaled(ids, g, depth0, spread, causal),
                                  atol=1e-3)
    yarn = PEagleDrafter(_cfg(YARN)).eval()  # YaRN also scales cos/sin: visible at any position
    yarn.load_state_dict(plain.state_dict())
    pos = torch.arange(1, E + 1)
    with torch.no_grad():
        full = yarn.logits(yarn(ids, g, depth0, pos, causal))  # the training forward
    got = DrafterSession(yarn).draft(ids, g, 1)  # the evaluation path (cached keys, its own RoPE call)
    torch.testing.assert_close(got, full[-1:], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(DrafterSession(plain).draft(ids, g, 1), got, atol=1e-3)


@pytest.mark.parametrize("family", FAMILIES)
def test_drafter_rope_follows_each_family(family):
    """What training builds from the verifier: its RoPE (a per-layer-type RoPE collapses to the sliding
    layers', as speculators 0.9 does); the checkpoint carries it in both layouts and loads back."""
    from peagle_train.train.setup import verifier_rope

    text = family_config(family).get_text_config()
    rope = verifier_rope(text)
    src = text.rope_parameters
    src = src.get("sliding_attention", src) if "rope_type" not in src else src
    assert rope["rope_type"] == src["rope_type"] and rope["rope_theta"] == src["rope_theta"]
    dropped = ("partial_rotary_factor", "type")  # as speculators 0.9 drops them (``type``: legacy alias)
    assert {k: v for k, v in rope.items() if k not in dropped} == {k: v for k, v in src.items() if k not in dropped}
    assert "type" not in rope and "partial_rotary_factor" not in rope
    DrafterConfig(**{**_cfg().to_dict(), "rope_parameters": rope})  # supported


def test_checkpoint_carries_rope_in_both_layouts_and_round_trips(tmp_path):
    from transformers import LlamaConfig

    m = PEagleDrafter(_cfg(LLAMA3))
    save_drafter(m, tmp_path / "ck")
    tl = json.loads((tmp_path / "ck" / "config.json").read_text())["transformer_layer_config"]
    assert tl["rope_parameters"] == LLAMA3 and tl["rope_theta"] == 500000.0
    assert tl["rope_scaling"] == {k: v for k, v in LLAMA3.items() if k != "rope_theta"}
    assert LlamaConfig(**tl).rope_parameters == LLAMA3  # what speculators 0.9 builds from the dict
    assert load_drafter(tmp_path / "ck").config.rope_parameters == LLAMA3


def test_v4_only_layer_config_keeps_its_scaling(tmp_path):
    """A checkpoint from another tool with only rope_theta/rope_scaling (legacy ``type`` key) loads scaled."""
    save_drafter(PEagleDrafter(_cfg(LLAMA3)), tmp_path / "ck")
    path = tmp_path / "ck" / "config.json"
    cfg = json.loads(path.read_text())
    del cfg["peagle"], cfg["transformer_layer_config"]["rope_parameters"]
    scaling = cfg["transformer_layer_config"]["rope_scaling"]
    scaling["type"] = scaling.pop("rope_type")
    path.write_text(json.dumps(cfg))
    assert load_drafter(tmp_path / "ck").config.rope_parameters == LLAMA3
    assert rope_from_layer_config({"rope_theta": 1e6, "rope_scaling": None}) == {"rope_type": "default",
                                                                                 "rope_theta": 1e6}


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_unsupported_rope_is_refused_at_load(tmp_path, rope_type):
    save_drafter(PEagleDrafter(_cfg()), tmp_path / "ck")
    path = tmp_path / "ck" / "config.json"
    cfg = json.loads(path.read_text())
    del cfg["peagle"]
    cfg["transformer_layer_config"]["rope_parameters"] = {"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0}
    path.write_text(json.dumps(cfg))
    with pytest.raises(StoreFormatError, match=rope_type):
        load_drafter(tmp_path / "ck")
    with pytest.raises(ValueError, match=rope_type):
        _cfg({"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0})


def test_edited_rope_disagreeing_with_the_peagle_block_is_refused(tmp_path):
    save_drafter(PEagleDrafter(_cfg(LLAMA3)), tmp_path / "ck")
    path = tmp_path / "ck" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["transformer_layer_config"]["rope_parameters"]["factor"] = 16.0
    path.write_text(json.dumps(cfg))
    with pytest.raises(StoreFormatError, match="peagle block"):
        load_drafter(tmp_path / "ck")


def test_train_refuses_a_longrope_verifier_before_its_weights(tmp_path, make_tiny_llama, monkeypatch):
    import transformers
    from click.testing import CliRunner

    from cli.train import main

    from tests.peagle_train.train.test_train import _store

    verifier = make_tiny_llama(tmp_path / "v", hidden=64, vocab=256)
    cfg = json.loads((verifier / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                              "long_factor": [2.0] * 8, "original_max_position_embeddings": 1024}
    cfg["max_position_embeddings"] = 4096
    (verifier / "config.json").write_text(json.dumps(cfg))
    store = _store(tmp_path / "s.zarr", verifier, n_blocks=1)

    def fail(cls, *a, **k):
        raise AssertionError("weights loaded before the RoPE check")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(fail))
    res = CliRunner().invoke(main, ["--store", store, "--output", str(tmp_path / "out"), "--max-steps", "1"])
    assert res.exit_code == 2 and "'longrope'" in res.output and "llama3" in res.output, res.output
