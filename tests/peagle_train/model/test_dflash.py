"""The DFlash drafter and its checkpoint against speculators 0.9's ``DFlashDraftModel`` (installed without its
training dependencies: ``datasets`` and ``hs_connectors``, imported by its data modules only, are stubbed), and
vLLM's rules for serving it as trained."""

import importlib.util
import json
import re
import shutil
import sys
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

from peagle_train.data.anchors import AnchorBlocks, block_inputs
from peagle_train.model.dflash import DFlashConfig, DFlashDrafter
from peagle_train.model.dflash_checkpoint import dflash_problems, load_dflash, save_dflash
from stores.errors import InputError, StoreFormatError

H, V, L, B = 32, 100, 3, 4


def _config(verifier: str, draft_vocab: int = V) -> DFlashConfig:
    return DFlashConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        vocab_size=V, draft_vocab_size=draft_vocab, aux_layer_ids=[1, 2, 3], num_hidden_layers=2,
                        mask_token_id=7, block_size=B, rope_theta=10000.0, verifier_name_or_path=verifier)


@pytest.fixture
def trained(tmp_path):
    """A DFlash drafter with non-trivial weights, saved, and the verifier files speculators reloads heads from."""
    torch.manual_seed(0)
    embed, head = torch.randn(V, H), torch.randn(V, H)
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": torch.ones(H)},
              str(verifier / "model.safetensors"))
    model = DFlashDrafter(_config(str(verifier)))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.init_from_verifier(embed, head)
    save_dflash(model, tmp_path / "ck")
    return model, tmp_path / "ck"


def _speculators_model(directory):
    # training-data dependencies of speculators, unused by its models: stubbed while it imports, then removed (a
    # stub left in sys.modules would break a later real import, or bench/speculators_ref.py's own placeholders)
    added = [name for name in ("datasets", "hs_connectors") if name not in sys.modules]
    sys.modules.update({name: mock.MagicMock(name=name) for name in added})
    try:
        from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    finally:
        for name in added:
            sys.modules.pop(name, None)

    config = DFlashSpeculatorConfig.from_pretrained(str(directory))
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs torch.compile
    return DFlashDraftModel.from_pretrained(str(directory), config=config).eval()


@pytest.mark.skipif(importlib.util.find_spec("speculators") is None,
                    reason="speculators is not installed (the bench extra: PEAGLE_BENCH=1 bash scripts/setup_env.sh)")
def test_speculators_loads_the_checkpoint_and_computes_what_peagle_computes(trained):
    model, directory = trained
    theirs = _speculators_model(directory)
    assert theirs.config.block_size == B and theirs.config.sample_from_anchor is False
    assert theirs.config.sliding_window_non_causal is True and theirs.config.aux_hidden_state_layer_ids == [1, 2, 3]
    ours, their_state = model.state_dict(), theirs.state_dict()
    assert set(their_state) - set(ours) == {"verifier_lm_head.weight", "verifier_norm.weight"} and set(ours) <= set(their_state)
    assert all(torch.equal(ours[k], their_state[k]) for k in ours)
    # a packed row of two documents; speculators takes every supervised row before the last B as an anchor
    T = 24
    g = torch.Generator().manual_seed(1)
    ids, aux = torch.randint(0, V, (T,), generator=g), torch.randn(T, L * H, generator=g)
    mask = torch.zeros(T, dtype=torch.long)
    mask[3:10] = 1
    mask[14:22] = 1
    pos, doc = torch.cat([torch.arange(12), torch.arange(12)]), torch.arange(T) // 12
    with torch.no_grad():
        hidden = theirs._backbone_forward(aux[None], ids[None], mask[None], torch.randn(1, T, H), doc[None], pos[None],
                                          max_anchors=64)[0][0]
    valid = mask.bool().clone()
    valid[-B:] = False
    anchors = torch.nonzero(valid).squeeze(1)
    inp = block_inputs(AnchorBlocks(anchors, B), ids, pos, torch.tensor([0, 12, T]), mask, 7)
    with torch.no_grad():
        out = model(aux, pos, inp.input_ids, inp.position_ids, inp.mask)
    torch.testing.assert_close(out, hidden[: anchors.numel() * B], atol=1e-5, rtol=1e-5)


def test_checkpoint_round_trip_is_bit_exact_and_says_how_vllm_serves_it(trained):
    model, directory = trained
    back = load_dflash(directory)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in model.state_dict().items())
    config = json.loads((directory / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashSpeculator"]
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == B - 1
    assert config["sliding_window_non_causal"] is True and "is_causal" not in config["transformer_layer_config"]
    assert config["transformer_layer_config"]["model_type"] == "qwen3"
    assert set(config["transformer_layer_config"]["layer_types"]) == {"full_attention"}
    assert dflash_problems(config) == []


@pytest.mark.parametrize("edit, problem", [
    (lambda c: c.update(sliding_window_non_causal=False), "causal attention inside the block"),
    (lambda c: c["transformer_layer_config"].update(is_causal=True), "is_causal"),
    (lambda c: c["transformer_layer_config"].update(layer_types=["sliding_attention", "full_attention"]), "sliding"),
    (lambda c: c.update(block_size=8), "another block"),
    (lambda c: c.update(sample_from_anchor=True), "sample_from_anchor"),
    (lambda c: c.update(aux_hidden_state_layer_ids=[3, 1, 2]), "strictly increasing"),
    (lambda c: c.pop("mask_token_id"), "mask_token_id"),
])
def test_dflash_problems_names_what_vllm_would_serve_otherwise(trained, edit, problem):
    config = json.loads((trained[1] / "config.json").read_text())
    edit(config)
    assert any(problem in p for p in dflash_problems(config)), dflash_problems(config)


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.update(aux_hidden_state_layer_ids=[3, 10, 20]), "aux_hidden_state_layer_ids is [3, 10, 20]"),
    (lambda c: c.update(mask_token_id=5), "mask_token_id is 5"),
    (lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=5), "speculative_tokens is 5"),
    (lambda c: c["transformer_layer_config"].update(rope_theta=123.0), "rope_theta is 123.0"),
    (lambda c: c["transformer_layer_config"].update(rms_norm_eps=0.1), "rms_norm_eps is 0.1"),
    (lambda c: c["transformer_layer_config"].update(max_position_embeddings=128), "max_position_embeddings"),
])
def test_a_checkpoint_whose_served_fields_differ_from_the_trained_drafter_is_refused(trained, tmp_path, edit, field):
    """vLLM builds the drafter from the top-level fields, peagle from its ``peagle`` block: an edit of the former
    once had peagle-eval score a drafter other than the one vLLM serves, silently."""
    shutil.copytree(trained[1], tmp_path / "edited")
    config = json.loads((tmp_path / "edited" / "config.json").read_text())
    edit(config)
    (tmp_path / "edited" / "config.json").write_text(json.dumps(config))
    with pytest.raises(StoreFormatError, match=re.escape(field)):
        load_dflash(tmp_path / "edited")
    assert isinstance(load_dflash(trained[1]), DFlashDrafter)  # the checkpoint as saved loads


def test_a_reduced_vocab_checkpoint_holds_its_maps_and_refuses_mask_hidden(tmp_path):
    model = DFlashDrafter(_config("v", draft_vocab=40))
    model.init_from_verifier(torch.randn(V, H), torch.randn(V, H), torch.arange(40))  # draft id i -> token 2i
    save_dflash(model, tmp_path / "ck")
    back = load_dflash(tmp_path / "ck")
    assert back.draft_ids.tolist() == list(range(0, 80, 2)) and int(back.t2d.sum()) == 40
    config = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert any("d2t is missing" in p for p in dflash_problems(config, {"fc.weight": (H, L * H)}))
    assert any("mask_hidden" in p for p in dflash_problems(config, {"d2t": (40,), "mask_hidden": (1, 1, L * H)}))


def test_a_nan_weight_is_never_saved(tmp_path):
    model = DFlashDrafter(_config("v"))
    with torch.no_grad():
        model.fc.weight[0, 0] = float("nan")
    with pytest.raises(Exception, match="NaN"):
        save_dflash(model, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


def test_block_size_sets_the_drafts_and_the_layer():
    cfg = _config("v")
    assert (cfg.num_depths, cfg.layer_type) == (B - 1, "qwen3")
    with pytest.raises(ValueError, match="block_size"):
        DFlashConfig(**{**cfg.to_dict(), "block_size": 1})


@pytest.mark.vllm
def test_vllm_reads_the_checkpoint_as_trained(trained):
    """vLLM 0.32's own conversion: method dflash, B - 1 drafts, every layer non-causal and full attention."""
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    raw = json.loads((trained[1] / "config.json").read_text())
    assert SpeculatorsConfig.extract_vllm_speculative_config(raw)["method"] == "dflash"
    assert SpeculatorsConfig.extract_vllm_speculative_config(raw)["num_speculative_tokens"] == B - 1
    hf = SpeculatorsConfig.from_pretrained(str(trained[1]))
    assert hf.architectures == ["DFlashDraftModel"] and hf.dflash_config["causal"] is False
    assert hf.dflash_config["mask_token_id"] == 7 and hf.eagle_aux_hidden_state_layer_ids == [1, 2, 3]
    assert dflash_has_any_non_causal(hf) and getattr(hf, "is_causal", None) is None


def test_input_error_is_raised_for_an_unservable_save(tmp_path):
    model = DFlashDrafter(_config("v"))
    with pytest.raises(InputError, match="sample_from_anchor"):
        save_dflash(model, tmp_path / "ck", extra_config={"sample_from_anchor": True})


def test_block_predictions_are_the_block_of_each_anchor_run_alone(trained):
    """``block_predictions`` (every anchor of a segment in chunked passes) equals the drafter run anchor by anchor
    on the rows before the anchor alone (positions of the store's rows: a segment at row 5 of a block starts at 0);
    ``pred[t-1, d]`` is slot d + 1 of the block anchored at t, -1 past the segment."""
    model, _ = trained
    model.eval()
    torch.manual_seed(1)
    n, start, K = 11, 5, B - 1
    ids = torch.randint(0, V, (start + n + 3,))
    pos = torch.cat([torch.arange(start), torch.arange(n), torch.arange(3)])
    blk = type("Blk", (), {"input_ids": ids, "position_ids": pos,
                           "aux_hidden": torch.randn(ids.numel(), L, H)})()
    pred = model.block_predictions(blk, start, n, K, chunk_anchors=3)
    assert pred.shape == (n - 2, K)
    aux = blk.aux_hidden.reshape(ids.numel(), -1)[start:start + n]
    for t in range(1, n - 1):
        block = torch.tensor([int(ids[start + t])] + [model.config.mask_token_id] * (B - 1))
        with torch.no_grad():
            hidden = model(aux[:t], torch.arange(t), block, torch.arange(t, t + B), torch.ones(B, t + B, dtype=torch.bool))
        want = model.logits(hidden[1:]).argmax(-1)  # [B-1]
        for d in range(K):
            assert int(pred[t - 1, d]) == (int(want[d]) if t + d + 1 <= n - 1 else -1), (t, d)
    assert len(set(pred[pred >= 0].tolist())) >= 3  # real, varied drafts
    short = model.block_predictions(blk, start, n, 2)  # K < B - 1: blocks of K + 1 (vLLM's at K drafts a step)
    for t in range(1, n - 1):
        want = model.draft(aux[:t], int(ids[start + t]), 2, num_drafts=2).argmax(-1)
        assert [int(v) for v in short[t - 1]] == [int(w) if t + d + 1 <= n - 1 else -1 for d, w in enumerate(want)]
    assert not torch.allclose(model.draft(aux[:4], int(ids[start + 4]), 2, num_drafts=2),
                              model.draft(aux[:4], int(ids[start + 4]), 2))  # a shorter block: other logits
