"""Reading an ``--init-from`` drafter (peagle_train/model/warm_start.py): the layouts, as vLLM reads them."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle_train.model.checkpoint import save_drafter
from peagle_train.model.config import DrafterConfig
from peagle_train.model.dflash import DFlashDrafter
from peagle_train.model.drafter import PEagleDrafter
from peagle_train.model.warm_start import NATIVE_ARCHITECTURES, load_init_weights, read_init_source
from peagle_train.model.dflash_checkpoint import save_dflash
from stores.errors import InputError, StoreFormatError
from tests.peagle_train.model.test_dflash import _config as dflash_config
from tests.peagle_train.model.test_dflash import _speculators_model as speculators_dflash_model

H, V, D = 32, 100, 40


def _peagle(path) -> PEagleDrafter:
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        vocab_size=V, draft_vocab_size=D, aux_layer_ids=[1, 3], num_hidden_layers=2, mask_token_id=7,
                        num_depths=3, verifier_name_or_path="Org/Verifier")
    torch.manual_seed(0)
    m = PEagleDrafter(cfg)
    m.init_from_verifier(torch.randn(V, H), torch.randn(V, H), torch.arange(D))  # draft id i -> token 2i
    save_drafter(m, path)
    return m


def _native(src, dst, token_key="ptd_token_id"):
    """``src`` in the native vLLM layout (as the public gpt-oss P-EAGLE drafters): a top-level Llama config,
    the mask token as ``token_key``, the aux layers in ``eagle_config``, layer 0 as ``midlayer.*``, no embed_tokens."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    native = dict(cfg["transformer_layer_config"])
    native.update(architectures=["Eagle3LlamaForCausalLM"], draft_vocab_size=cfg["draft_vocab_size"],
                  **{token_key: cfg["mask_token_id"]},
                  eagle_config={"eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"]})
    (dst / "config.json").write_text(json.dumps(native))
    tensors = {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v
               for k, v in load_file(str(src / "model.safetensors")).items() if k != "embed_tokens.weight"}
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_native_layout_reads_as_the_peagle_one_and_loads_the_same_weights(tmp_path):
    m = _peagle(tmp_path / "p")
    native = read_init_source(_native(tmp_path / "p", tmp_path / "n"))
    ours = read_init_source(tmp_path / "p")
    assert (native.format, ours.format) == ("vllm", "peagle")
    assert native.mask_token_id == ours.mask_token_id == 7
    assert native.num_depths is None and ours.num_depths == 3  # vLLM's native config has no K
    assert native.config.aux_layer_ids == [1, 3] and native.config.num_hidden_layers == 2
    assert native.names["layers.0.hidden_norm.weight"] == "midlayer.hidden_norm.weight"
    assert torch.equal(native.d2t, torch.arange(D)) and torch.equal(native.t2d, m.t2d)
    assert native.weights_sha256 != ours.weights_sha256
    fresh = PEagleDrafter(ours.config)
    fresh.init_from_verifier(torch.zeros(V, H), torch.zeros(V, H), native.d2t)
    assert load_init_weights(native, fresh) == ["embed_tokens.weight"]  # kept: the verifier's (zeros here)
    got, want = fresh.state_dict(), m.state_dict()
    for k in want:
        if k != "embed_tokens.weight":
            assert torch.equal(got[k], want[k]), k
    assert not got["embed_tokens.weight"].any()


def test_tensors_that_are_not_the_configs_are_refused_by_name(tmp_path):
    _peagle(tmp_path / "p")
    src = _native(tmp_path / "p", tmp_path / "n")
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["mask_hidden"]
    tensors["layers.2.mlp.up_proj.weight"] = torch.zeros(64, H)
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(InputError, match=r"its tensors are not those of its config \(2 layers\): unknown "
                                         r"\['layers.2.mlp.up_proj.weight'\], missing \['mask_hidden'\]"):
        read_init_source(src)
    (src / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    with pytest.raises(StoreFormatError, match="not a drafter --init-from reads"):
        read_init_source(src)


def test_a_source_whose_weights_are_truncated_or_not_finite_is_refused_naming_it(tmp_path):
    m = _peagle(tmp_path / "p")
    w = tmp_path / "p" / "model.safetensors"
    tensors = load_file(str(w))
    tensors["layers.0.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(tensors, str(w))
    source = read_init_source(tmp_path / "p")  # the header is sound; the values are read with the weights
    with pytest.raises(InputError, match=r"--init-from .*up_proj.weight holds NaN or Inf"):
        load_init_weights(source, PEagleDrafter(m.config))
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(InputError, match=r"--init-from .*model.safetensors cannot be read as safetensors"):
        read_init_source(tmp_path / "p")


@pytest.mark.vllm
@pytest.mark.parametrize("token_key", ["ptd_token_id", "pard_token", "mask_token_id"])
def test_vllm_reads_the_native_layout_as_peagle_does(tmp_path, token_key):
    """vLLM's config loading of the native layout: the architecture it maps to its Llama EAGLE-3 drafter,
    the parallel-drafting token and the aux layers are the ones :func:`read_init_source` reads."""
    from vllm import ModelRegistry
    from vllm.transformers_utils.config import get_config
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    _peagle(tmp_path / "p")
    src = _native(tmp_path / "p", tmp_path / "n", token_key)
    hf = get_config(str(src), trust_remote_code=False)
    init = read_init_source(src)
    for arch, layer in NATIVE_ARCHITECTURES.items():  # each mapped to vLLM's EAGLE-3 / P-EAGLE drafter of its layer
        entry = ModelRegistry.models[arch]
        assert (entry.module_name, entry.class_name) == (f"vllm.model_executor.models.{layer}_eagle3",
                                                         f"Eagle3{layer.capitalize()}ForCausalLM"), arch
    assert set(NATIVE_ARCHITECTURES.values()) == {"llama", "qwen3"}
    assert hf.architectures == ["Eagle3LlamaForCausalLM"]
    assert get_parallel_drafting_token_id(hf) == init.mask_token_id == 7
    assert hf.eagle_config["eagle_aux_hidden_state_layer_ids"] == init.config.aux_layer_ids
    assert getattr(hf, "norm_before_residual", False) is False and hf.num_hidden_layers == 2


@pytest.mark.vllm
def test_vllm_reads_an_eagle3_checkpoint_without_norm_before_residual_as_true(tmp_path):
    """Why an EAGLE-3 checkpoint without ``norm_before_residual`` is refused: vLLM's default there is true."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    _peagle(tmp_path / "p")
    cfg = json.loads((tmp_path / "p" / "config.json").read_text())
    for key in ("peagle", "norm_before_residual", "mask_token_id"):
        cfg.pop(key)
    cfg["speculators_model_type"] = "eagle3"
    (tmp_path / "p" / "config.json").write_text(json.dumps(cfg))
    assert SpeculatorsConfig.from_pretrained(str(tmp_path / "p")).norm_before_residual is True
    with pytest.raises(InputError, match=r"norm_before_residual is true \(vLLM reads it so when absent\)"):
        read_init_source(tmp_path / "p")


def _without(path, *names):
    """Drop ``names`` from the checkpoint's ``model.safetensors``."""
    tensors = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in names}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("fmt", ["peagle", "native"])
def test_a_drafter_without_lm_head_or_embed_tokens_takes_the_verifiers_whole_lm_head_as_vllm_does(tmp_path, fmt):
    """vLLM serves an EAGLE drafter that ships no lm_head / embed_tokens with the verifier's modules
    (llm_base_proposer._maybe_share_lm_head): with D == V the run keeps the verifier's whole lm_head and
    embedding, and records which tensors it took."""
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 3], mask_token_id=7)
    torch.manual_seed(0)
    m = PEagleDrafter(cfg)
    save_drafter(m, tmp_path / "p")
    src = _native(tmp_path / "p", tmp_path / "n") if fmt == "native" else tmp_path / "p"
    init = read_init_source(_without(src, "lm_head.weight", "embed_tokens.weight"))
    assert init.from_verifier == ("embed_tokens.weight", "lm_head.weight") and init.fresh == ()
    assert init.record()["from_verifier"] == ["embed_tokens.weight", "lm_head.weight"]
    fresh = PEagleDrafter(init.config)
    embed, head = torch.randn(V, H), torch.randn(V, H)
    fresh.init_from_verifier(embed, head, init.d2t)
    assert load_init_weights(init, fresh) == ["embed_tokens.weight", "lm_head.weight"]
    assert torch.equal(fresh.lm_head.weight, head) and torch.equal(fresh.embed_tokens.weight, embed)
    assert torch.equal(fresh.fc.weight, m.fc.weight)


def test_a_reduced_vocab_drafter_without_lm_head_is_refused_unless_vllms_rows_are_its_tokens(tmp_path):
    """With D < V vLLM keeps the first D of the verifier's V logits and places draft id i's at token
    ``i + d2t[i]``: row i scores token 2i here (d2t = arange), refused; with d2t all zero (draft ids the
    first D tokens) row i is token i's, and the run takes the verifier's rows [0, D)."""
    _peagle(tmp_path / "p")  # d2t[i] = i
    src = _without(_native(tmp_path / "p", tmp_path / "n"), "lm_head.weight")
    with pytest.raises(InputError, match=r"it has no lm_head.weight and a reduced draft vocab \(draft_vocab_size 40 "
                                         r"< vocab_size 100\): vLLM then shares the verifier's lm_head and keeps its "
                                         r"first 40 logits, so draft id 1 is scored by verifier token 1's row but "
                                         r"proposes token 2 \(d2t\); give the checkpoint its lm_head \[40, 32\]"):
        read_init_source(src)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["d2t"], tensors["t2d"] = torch.zeros(D, dtype=torch.int64), torch.arange(V) < D
    save_file(tensors, str(src / "model.safetensors"))
    init = read_init_source(src)
    assert init.from_verifier == ("embed_tokens.weight", "lm_head.weight")  # _native drops embed_tokens too
    fresh = PEagleDrafter(init.config)
    head = torch.randn(V, H)
    fresh.init_from_verifier(torch.randn(V, H), head, init.d2t)
    load_init_weights(init, fresh)
    assert torch.equal(fresh.lm_head.weight, head[:D])  # the rows vLLM's logits [:D] come from


@pytest.mark.vllm
def test_vllm_scores_draft_id_i_of_a_drafter_without_lm_head_with_the_verifiers_row_i():
    """Why a reduced-vocab drafter without lm_head is refused, in vLLM's own code: an EAGLE-3 drafter that
    loaded no lm_head (``has_own_lm_head`` False, vLLM's default) gets the verifier's lm_head module
    (``_maybe_share_lm_head``), its LogitsProcessor keeps the first D of the V logits, and
    ``compute_logits`` places draft id i's at token ``i + d2t[i]``."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.models.interfaces import SupportsEagleBase
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    Hs, Vs, Ds = 8, 12, 5
    assert Eagle3LlamaForCausalLM.has_own_lm_head is SupportsEagleBase.has_own_lm_head is False
    target, draft = torch.nn.Module(), torch.nn.Module()
    target.lm_head, target.model = torch.nn.Linear(Hs, Vs, bias=False), torch.nn.Module()
    draft.has_own_lm_head, draft.lm_head = False, torch.nn.Linear(Hs, Ds, bias=False)
    proposer = SimpleNamespace(model=draft, use_local_argmax_reduction=False,
                               vllm_config=SimpleNamespace(speculative_config=None))
    SpecDecodeBaseProposer._maybe_share_lm_head(proposer, target)
    assert draft.lm_head is target.lm_head  # the whole [V, H] head
    head = target.lm_head
    head.quant_method, head.tp_size = SimpleNamespace(apply=lambda layer, x, bias=None: x @ layer.weight.T), 1
    with set_current_vllm_config(VllmConfig()):
        processor = LogitsProcessor(Ds)  # Eagle3LlamaForCausalLM's: LogitsProcessor(draft_vocab_size)
    d2t = torch.tensor([0, 1, 1, 2, 7])
    drafter = SimpleNamespace(logits_processor=processor, lm_head=head, draft_id_to_target_id=d2t,
                              config=SimpleNamespace(draft_vocab_size=Ds, vocab_size=Vs))
    hidden = torch.randn(3, Hs)
    want = torch.full((3, Vs), float("-inf"))
    want[:, torch.arange(Ds) + d2t] = hidden @ head.weight[:Ds].T  # row i at token i + d2t[i]
    assert torch.equal(Eagle3LlamaForCausalLM.compute_logits(drafter, hidden), want)


@pytest.mark.skipif(importlib.util.find_spec("speculators") is None,
                    reason="speculators is not installed (the bench extra: PEAGLE_BENCH=1 bash scripts/setup_env.sh)")
def test_a_dflash_checkpoint_speculators_saved_is_read_and_loads_every_weight(tmp_path):
    """speculators' ``DFlashDraftModel.save_pretrained`` (its default ``sliding_window_non_causal`` false, no
    ``peagle`` block, no embed_tokens, and with the full vocab no lm_head: both the verifier's) is a DFlash
    warm-start source; its weights load into peagle's drafter exactly."""
    torch.manual_seed(0)
    embed, head = torch.randn(V, H), torch.randn(V, H)
    verifier = tmp_path / "verifier"  # the files speculators reloads the verifier's heads from
    verifier.mkdir()
    save_file({"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": torch.ones(H)},
              str(verifier / "model.safetensors"))
    model = DFlashDrafter(dflash_config(str(verifier)))  # 2 layers, B 4, mask token 7, the full vocab
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    model.init_from_verifier(embed, head)
    save_dflash(model, tmp_path / "ck")
    theirs = speculators_dflash_model(tmp_path / "ck")
    theirs.config.sliding_window_non_causal = False
    theirs.save_pretrained(str(tmp_path / "spec"))
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    config.pop("peagle", None)
    (tmp_path / "spec" / "config.json").write_text(json.dumps(config))
    init = read_init_source(tmp_path / "spec", "dflash")
    assert (init.format, init.block_size, init.num_depths, init.mask_token_id) == ("dflash", 4, 3, 7)
    assert init.from_verifier == ("embed_tokens.weight", "lm_head.weight") and init.fresh == ()
    ours = DFlashDrafter(init.config)
    ours.init_from_verifier(embed, head)  # what the run does first
    load_init_weights(init, ours)
    assert all(torch.equal(v, ours.state_dict()[k]) for k, v in model.state_dict().items())
    with pytest.raises(InputError, match=r"it is a dflash drafter .* pass --method dflash"):
        read_init_source(tmp_path / "spec")  # --method peagle's
