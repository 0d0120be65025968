"""Drafter checkpoints: exact round trip; config.json keys and tensor names/shapes per docs/design.md §8."""

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from peagle_train.model.checkpoint import (
    read_weights,
    find_drafter, latest_checkpoint, load_drafter, load_training_state, save_checkpoint, save_drafter,
)
from peagle_train.model.config import DrafterConfig
from peagle_train.model.drafter import PEagleDrafter
from stores.errors import NonFiniteError, StoreFormatError

H, L, V, D = 32, 3, 100, 40


def _model(num_layers=2):
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=V, draft_vocab_size=D, aux_layer_ids=[1, 3, 5],
                        num_hidden_layers=num_layers, rope_theta=5000.0, mask_token_id=7, num_depths=5,
                        verifier_name_or_path="tiny-verifier")
    torch.manual_seed(0)
    m = PEagleDrafter(cfg)
    d2t = torch.tensor([2 * i for i in range(D)]) - torch.arange(D)  # draft id i -> verifier id 2i
    m.init_from_verifier(torch.randn(V, H), torch.randn(V, H), d2t)
    return m


def test_round_trip_is_exact(tmp_path):
    m = _model()
    save_drafter(m, tmp_path / "ck")
    back = load_drafter(tmp_path / "ck")
    assert back.config == m.config
    sd, sd2 = m.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys()
    for k in sd:
        assert sd[k].dtype == sd2[k].dtype and torch.equal(sd[k], sd2[k]), k
    assert torch.equal(back.draft_ids, torch.arange(D) * 2)


def test_config_json_and_tensor_names(tmp_path):
    m = _model()
    save_drafter(m, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["architectures"] == ["PEagleSpeculator"]
    assert cfg["speculators_model_type"] == "peagle"
    assert cfg["draft_vocab_size"] == D
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
    assert cfg["mask_token_id"] == 7
    tl = cfg["transformer_layer_config"]
    assert tl["model_type"] == "llama" and tl["hidden_size"] == H and tl["num_hidden_layers"] == 2
    assert tl["vocab_size"] == V and tl["head_dim"] == 8 and tl["rope_parameters"]["rope_theta"] == 5000.0
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "peagle" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"] == [{"proposal_type": "greedy", "speculative_tokens": 5}]
    assert sc["verifier"] == {"name_or_path": "tiny-verifier", "architectures": ["LlamaForCausalLM"]}
    with safe_open(str(tmp_path / "ck" / "model.safetensors"), "pt") as f:
        shapes = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    expect = {
        "embed_tokens.weight": ((V, H), "F32"), "fc.weight": ((H, L * H), "F32"),
        "mask_hidden": ((1, 1, L * H), "F32"),
        "layers.0.self_attn.q_proj.weight": ((4 * 8, 2 * H), "F32"),
        "layers.0.self_attn.k_proj.weight": ((2 * 8, 2 * H), "F32"),
        "layers.0.self_attn.v_proj.weight": ((2 * 8, 2 * H), "F32"),
        "layers.0.self_attn.o_proj.weight": ((H, 4 * 8), "F32"),
        "layers.0.hidden_norm.weight": ((H,), "F32"), "layers.0.input_layernorm.weight": ((H,), "F32"),
        "layers.0.post_attention_layernorm.weight": ((H,), "F32"),
        "layers.0.mlp.gate_proj.weight": ((64, H), "F32"), "layers.0.mlp.down_proj.weight": ((H, 64), "F32"),
        "layers.1.self_attn.q_proj.weight": ((4 * 8, H), "F32"),
        "norm.weight": ((H,), "F32"), "lm_head.weight": ((D, H), "F32"),
        "d2t": ((D,), "I64"), "t2d": ((V,), "BOOL"),
    }
    for k, v in expect.items():
        assert shapes[k] == v, k
    assert "layers.1.hidden_norm.weight" not in shapes


def test_training_state_and_latest_checkpoint(tmp_path):
    m = _model(1)
    for step in (2, 10, 4):
        save_checkpoint(m, tmp_path / f"checkpoint-{step}", {"step": step, "data": {"position": step}})
    (tmp_path / "checkpoint-99").mkdir()  # incomplete: no training_state.pt
    assert latest_checkpoint(tmp_path).name == "checkpoint-10"
    assert load_training_state(tmp_path / "checkpoint-10")["data"]["position"] == 10
    with pytest.raises(StoreFormatError):
        load_training_state(tmp_path / "checkpoint-99")
    with pytest.raises(StoreFormatError):
        load_drafter(tmp_path / "checkpoint-99")
    assert find_drafter(tmp_path) == (tmp_path / "checkpoint-10", f"{tmp_path} is a training output without "
                                      f"final/ (an unfinished run): using its newest checkpoint {tmp_path / 'checkpoint-10'}")


def test_a_run_with_no_checkpoint_yet_says_so(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train_config.json").write_text("{}")
    with pytest.raises(StoreFormatError, match="is a peagle-train output with no checkpoint yet: the run writes "
                                               "checkpoint-N/ every --save-every steps"):
        find_drafter(tmp_path / "run")
    with pytest.raises(StoreFormatError, match="is not a drafter checkpoint .* nor a peagle-train output"):
        find_drafter(tmp_path)  # not a run at all


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640), (0o002, 0o664)])
def test_weights_and_state_follow_the_umask(tmp_path, umask, mode):
    import os
    import stat

    old = os.umask(umask)
    try:
        save_drafter(_model(1), tmp_path / "final")
        save_checkpoint(_model(1), tmp_path / "checkpoint-1", {"step": 1})
    finally:
        os.umask(old)
    for f in ("final/model.safetensors", "final/config.json", "checkpoint-1/model.safetensors",
              "checkpoint-1/config.json", "checkpoint-1/training_state.pt"):
        assert stat.S_IMODE((tmp_path / f).stat().st_mode) == mode, f  # safetensors alone makes 0600


def test_speculators_verifier_is_a_name_vllm_resolves_offline(tmp_path, monkeypatch):
    from runtime.model_cache import peagle_home

    m = _model(1)
    m.config.verifier_name_or_path = "smollm2-135m"
    save_drafter(m, tmp_path / "ck")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    # what vLLM resolves without a hub (vllm serve final/): the alias's converted directory ...
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(peagle_home() / "models" / "smollm2-135m")
    # ... while peagle keeps the local alias, which it loads without the hub
    assert cfg["peagle"]["drafter_config"]["verifier_name_or_path"] == "smollm2-135m"
    assert load_drafter(tmp_path / "ck").config.verifier_name_or_path == "smollm2-135m"
    (tmp_path / "models" / "v").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for given, written in (("models/v", str(tmp_path / "models" / "v")),  # a directory: its absolute path
                           ("Org/Model-1B", "Org/Model-1B")):  # a hub id: as given
        m.config.verifier_name_or_path = given
        save_drafter(m, tmp_path / "ck2")
        cfg = json.loads((tmp_path / "ck2" / "config.json").read_text())
        assert cfg["speculators_config"]["verifier"]["name_or_path"] == written


def _full_vocab_model():
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 3, 5],
                        num_hidden_layers=1, mask_token_id=7, num_depths=5, verifier_name_or_path="v")
    torch.manual_seed(0)
    m = PEagleDrafter(cfg)
    m.init_from_verifier(torch.randn(V, H), torch.randn(V, H), None)
    return m


def test_full_vocab_round_trip_and_a_checkpoint_that_still_has_identity_maps(tmp_path):
    from safetensors.torch import load_file, save_file

    m = _full_vocab_model()
    save_drafter(m, tmp_path / "ck")
    saved = load_file(str(tmp_path / "ck" / "model.safetensors"))
    assert "d2t" not in saved and "t2d" not in saved
    back = load_drafter(tmp_path / "ck")
    assert torch.equal(back.draft_ids, torch.arange(V)) and bool(back.t2d.all())
    assert torch.equal(back.lm_head.weight, m.lm_head.weight)
    # written before d2t/t2d were left out: identity maps are dropped on load ...
    save_file({**saved, "d2t": torch.zeros(V, dtype=torch.long), "t2d": torch.ones(V, dtype=torch.bool)},
              str(tmp_path / "ck" / "model.safetensors"))
    assert torch.equal(load_drafter(tmp_path / "ck").embed_tokens.weight, m.embed_tokens.weight)
    # ... anything else is refused
    save_file({**saved, "d2t": torch.ones(V, dtype=torch.long), "t2d": torch.ones(V, dtype=torch.bool)},
              str(tmp_path / "ck" / "model.safetensors"))
    with pytest.raises(StoreFormatError, match="not the identity maps"):
        load_drafter(tmp_path / "ck")


def _save_with_maps(tmp_path, d2t, t2d, foreign=False):
    """A reduced-vocab checkpoint (draft id i -> verifier id 2i) whose d2t/t2d are replaced; ``foreign``
    drops the ``peagle`` block, as a checkpoint written by speculators or another trainer has none."""
    from safetensors.torch import load_file, save_file

    ck = save_drafter(_model(), tmp_path / "ck")
    tensors = load_file(str(ck / "model.safetensors"))
    save_file({**tensors, "d2t": d2t, "t2d": t2d}, str(ck / "model.safetensors"))
    if foreign:
        cfg = json.loads((ck / "config.json").read_text())
        del cfg["peagle"]
        (ck / "config.json").write_text(json.dumps(cfg))
    return ck


def _maps():
    ids = 2 * torch.arange(D)  # the drafter's verifier ids
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(D), t2d, ids


FIX = ("d2t must hold offsets, verifier_id = draft_id + d2t[draft_id], of strictly increasing verifier ids, "
       "and t2d mark exactly those ids (a d2t rewritten as absolute ids is a known bug of other writers); "
       "rebuild the maps or re-export the checkpoint")


@pytest.mark.parametrize("foreign", [False, True])
def test_d2t_rewritten_as_absolute_ids_is_refused_naming_the_file_and_draft_id(tmp_path, foreign):
    """verl-SpeCo's bug: d2t holds the verifier ids themselves, so draft id i reads verifier id i + 2i."""
    _, t2d, ids = _maps()
    ck = _save_with_maps(tmp_path, ids.clone(), t2d, foreign)
    # ids 3i: t2d marks the even ids up to 78, so odd i <= 33 (17) and i = 28, 30, 32 land on unmarked
    # ids, and i >= 34 (6) past V = 100
    want = (f"{ck / 'model.safetensors'}: draft id 1 maps to verifier id 3 (d2t[1] = 2), which t2d does not mark "
            f"(20 of 40 draft ids map to ids t2d does not mark, 6 outside the vocab); {FIX}")
    with pytest.raises(StoreFormatError) as e:
        load_drafter(ck)
    assert str(e.value) == want


def test_every_other_d2t_t2d_disagreement_is_refused(tmp_path):
    d2t, t2d, _ = _maps()
    w = tmp_path / "ck" / "model.safetensors"
    cases = []
    past = d2t.clone()
    past[39] += 30  # verifier id 108 >= V
    cases.append((past, t2d, f"draft id 39 maps to verifier id 108 (d2t[39] = 69), outside [0, 100) "
                             f"(0 of 40 draft ids map to ids t2d does not mark, 1 outside the vocab)"))
    repeat = d2t.clone()
    repeat[5] = 3  # verifier id 8, draft id 4's too
    cases.append((repeat, t2d, "draft id 5 maps to verifier id 8 (d2t[5] = 3), not above draft id 4's 8 "
                               "(0 of 40 draft ids map to ids t2d does not mark, 0 outside the vocab)"))
    negative = d2t.clone()
    negative[0] = -1
    cases.append((negative, t2d, "draft id 0 maps to verifier id -1 (d2t[0] = -1), outside [0, 100) "
                                 "(0 of 40 draft ids map to ids t2d does not mark, 1 outside the vocab)"))
    missing = t2d.clone()
    missing[6] = False
    cases.append((d2t, missing, "draft id 3 maps to verifier id 6 (d2t[3] = 3), which t2d does not mark "
                                "(1 of 40 draft ids map to ids t2d does not mark, 0 outside the vocab)"))
    extra = t2d.clone()
    extra[1] = True
    cases.append((d2t, extra, "t2d marks 41 verifier ids but d2t maps 40 draft ids: verifier id 1 is marked but "
                              "no draft id maps to it"))
    for bad_d2t, bad_t2d, reason in cases:
        _save_with_maps(tmp_path, bad_d2t, bad_t2d)
        with pytest.raises(StoreFormatError) as e:
            load_drafter(tmp_path / "ck")
        assert str(e.value) == f"{w}: {reason}; {FIX}"
    _save_with_maps(tmp_path, d2t, t2d.to(torch.uint8))  # a 0/1 t2d of agreeing maps loads
    assert torch.equal(load_drafter(tmp_path / "ck").draft_ids, 2 * torch.arange(D))


def test_eval_and_resume_refuse_a_checkpoint_whose_maps_disagree(tmp_path):
    """peagle-eval's checks (before any verifier loads) and a training resume both read checkpoints
    with load_drafter, so both refuse."""
    from peagle_train.evaluate.checks import check_before_weights

    _, t2d, ids = _maps()
    ck = _save_with_maps(tmp_path, ids.clone(), t2d)
    with pytest.raises(StoreFormatError, match="draft id 1 maps to verifier id 3"):
        check_before_weights(ck)


def test_maps_that_disagree_are_never_written(tmp_path):
    m = _model()
    with torch.no_grad():
        m.t2d[1] = True  # marked, but no draft id maps to verifier id 1
    with pytest.raises(StoreFormatError, match="verifier id 1 is marked but no draft id maps to it"):
        save_drafter(m, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("key,where", [("mask_token_id", None), ("speculative_tokens", "proposal_methods")])
def test_a_foreign_checkpoint_without_mask_token_or_k_is_refused_not_defaulted(tmp_path, key, where):
    """vLLM requires both; loading used to take mask token 0 and K = 8 in their place."""
    ck = save_drafter(_model(), tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["peagle"]
    if where is None:
        del cfg[key]
        name = key
    else:
        del cfg["speculators_config"]["proposal_methods"][0][key]
        name = "speculators_config.proposal_methods[0].speculative_tokens"
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StoreFormatError, match=rf"config.json: {name.replace('[', '[[]').replace('.', '[.]')} is "
                                               r"None, expected an integer \(vLLM requires it\)"):
        load_drafter(ck)


def _qwen3_model(num_layers=2):
    import dataclasses

    base = _model(num_layers)
    m = PEagleDrafter(dataclasses.replace(base.config, layer_type="qwen3"))
    m.load_state_dict(base.state_dict(), strict=False)  # all but q_norm/k_norm
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                p.copy_(torch.linspace(0.5, 1.5, p.numel()))
    return m


def test_qwen3_round_trip_is_exact_and_written_as_vllms_qwen3_layer(tmp_path):
    m = _qwen3_model()
    save_drafter(m, tmp_path / "ck")
    back = load_drafter(tmp_path / "ck")
    assert back.config == m.config and back.config.layer_type == "qwen3"
    sd, sd2 = m.state_dict(), back.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    tl = cfg["transformer_layer_config"]
    assert (tl["model_type"], tl["architectures"], tl["attention_bias"], tl["use_sliding_window"]) == (
        "qwen3", ["Qwen3ForCausalLM"], False, False)
    assert tl["layer_types"] == ["full_attention"] * 2 and tl["head_dim"] == 8 and tl["rms_norm_eps"] == 1e-5
    assert cfg["peagle"]["drafter_config"]["layer_type"] == "qwen3"
    with safe_open(str(tmp_path / "ck" / "model.safetensors"), "pt") as f:
        norms = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if "q_norm" in k or "k_norm" in k}
    assert norms == {f"layers.{i}.self_attn.{n}_norm.weight": (8,) for i in (0, 1) for n in "qk"}


def _edit(path, edit):
    cfg = json.loads((path / "config.json").read_text())
    edit(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def test_a_checkpoint_without_layer_type_is_llama_and_a_mismatch_is_refused(tmp_path):
    save_drafter(_model(), tmp_path / "old")
    _edit(tmp_path / "old", lambda c: c["peagle"]["drafter_config"].pop("layer_type"))  # written before the field
    assert load_drafter(tmp_path / "old").config.layer_type == "llama"
    _edit(tmp_path / "old", lambda c: c["transformer_layer_config"].update(model_type="qwen3"))
    with pytest.raises(StoreFormatError, match="transformer_layer_config.model_type is 'qwen3' \\(what vLLM serves\\) "
                                               "but the peagle block's layer_type is 'llama'"):
        load_drafter(tmp_path / "old")


def test_a_foreign_qwen3_checkpoint_loads_as_qwen3_and_what_peagle_does_not_compute_is_refused(tmp_path):
    """speculators' layout (no peagle block): the layer type from model_type; biases, sliding windows and other
    layer types are refused naming the key; a qwen3 layer without rope_theta has vLLM's default 1e6."""
    save_drafter(_qwen3_model(), tmp_path / "ck")
    _edit(tmp_path / "ck", lambda c: c.pop("peagle"))
    back = load_drafter(tmp_path / "ck")
    assert back.config.layer_type == "qwen3" and torch.equal(
        back.state_dict()["layers.1.self_attn.k_norm.weight"], torch.linspace(0.5, 1.5, 8))

    def no_theta(c):
        for key in ("rope_theta", "rope_parameters", "rope_scaling"):
            c["transformer_layer_config"].pop(key)
    _edit(tmp_path / "ck", no_theta)
    assert load_drafter(tmp_path / "ck").config.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}
    for edit, message in [
        (lambda c: c["transformer_layer_config"].update(attention_bias=True),
         "transformer_layer_config.attention_bias is true; peagle's drafter layers have no biases"),
        (lambda c: c["transformer_layer_config"].update(layer_types=["sliding_attention", "full_attention"],
                                                        sliding_window=64),
         "layer_types is \\['sliding_attention', 'full_attention'\\]: vLLM would attend within a sliding window of 64"),
        (lambda c: c["transformer_layer_config"].update(model_type="gemma2"),
         "model_type is 'gemma2'; peagle's drafter layer is one of \\['llama', 'qwen3'\\]"),
    ]:
        save_drafter(_qwen3_model(), tmp_path / "bad")
        _edit(tmp_path / "bad", lambda c: c.pop("peagle"))
        _edit(tmp_path / "bad", edit)
        with pytest.raises(StoreFormatError, match=f"{tmp_path / 'bad' / 'config.json'}: .*{message}"):
            load_drafter(tmp_path / "bad")


def test_weights_that_are_truncated_or_not_finite_are_refused_naming_the_file_or_tensor(tmp_path):
    """A checkpoint's weights changed after peagle wrote them: a raw safetensors traceback once named neither the
    file nor what to do, and a NaN weight was evaluated (AL 1.0) as if it were a drafter."""
    path = tmp_path / "model.safetensors"
    save_file({"a.weight": torch.ones(4, 4), "d2t": torch.zeros(3, dtype=torch.long)}, str(path))
    assert set(read_weights(path)) == {"a.weight", "d2t"}
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])
    with pytest.raises(StoreFormatError, match=r"model\.safetensors cannot be read as safetensors"):
        read_weights(path)
    save_file({"a.weight": torch.tensor([1.0, float("nan")]), "b.weight": torch.ones(2)}, str(path))
    with pytest.raises(NonFiniteError, match=r"a\.weight hold NaN or Inf"):
        read_weights(path)


@pytest.mark.parametrize("edit, field", [
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[3, 10, 20]),
     "eagle_aux_hidden_state_layer_ids is [3, 10, 20]"),
    (lambda c: c.update(mask_token_id=5), "mask_token_id is 5"),
    (lambda c: c["transformer_layer_config"].update(rms_norm_eps=0.1), "rms_norm_eps is 0.1"),
    (lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=7), "speculative_tokens is 7"),
])
def test_a_peagle_checkpoint_whose_served_fields_differ_from_the_trained_drafter_is_refused(tmp_path, edit, field):
    """vLLM builds the drafter from the top-level fields, peagle from its ``peagle`` block: an edited mask token,
    aux layer list or eps was once evaluated (AL 1.0) as the drafter vLLM would serve."""
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=100, draft_vocab_size=100, aux_layer_ids=[1, 2, 3], num_hidden_layers=1,
                        mask_token_id=3, num_depths=3)
    save_drafter(PEagleDrafter(cfg), tmp_path / "d")
    assert load_drafter(tmp_path / "d").config.mask_token_id == 3  # as saved: loads
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    edit(config)
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(StoreFormatError, match=re.escape(field)):
        load_drafter(tmp_path / "d")
