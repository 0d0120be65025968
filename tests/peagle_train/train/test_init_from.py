"""``--init-from``: a warm start from a peagle, speculators (P-EAGLE / EAGLE-3) or native vLLM-layout drafter,
checked against the store, the verifier and the options before any weights load (peagle_train/model/warm_start.py,
peagle_train/train/setup.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from peagle_train.data.loader import to_block
from peagle_train.model.checkpoint import drafter_config_json, load_drafter, save_drafter
from peagle_train.model.drafter import PEagleDrafter
from peagle_train.model.warm_start import read_init_source
from peagle_train.train.run import build_trainer, run_train
from peagle_train.train.step import block_loss, cod_generator, sample_elements
from stores.errors import InputError
from stores.features.feature_store import FeatureStore

from .test_train import _cfg, _rows, _store

D = 200
"""The source drafter's draft vocab (reduced: it has d2t/t2d)."""


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory, make_tiny_llama):
    return make_tiny_llama(tmp_path_factory.mktemp("verifier"), hidden=64, vocab=256)


@pytest.fixture(scope="module")
def source(tmp_path_factory, verifier_dir):
    """(store, the output of a 3-step run with draft vocab D, K = 4, 1 layer)."""
    root = tmp_path_factory.mktemp("src")
    store = _store(root / "s.zarr", verifier_dir, n_blocks=3)
    out = root / "x"
    run_train(_cfg(store, out, max_steps=3, draft_vocab_size=D))
    return store, out


@pytest.fixture
def no_weights(monkeypatch):
    """Loading the verifier's weights raises: the refusals must come before it."""
    import transformers

    def fail(cls, *a, **k):
        raise AssertionError(f"{cls.__name__}.from_pretrained was called before the --init-from checks")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(fail))


def _reference_loss(drafter: PEagleDrafter, store_path: str, verifier_dir, cfg, block_id: int) -> float:
    """The loss of ``drafter`` on the first step's block (cursor 0, its COD generator), by the sdpa backend."""
    store = FeatureStore.open(store_path)
    block = to_block(block_id, store.read_block(block_id))
    elements = sample_elements(block, cfg, cod_generator(cfg.run.seed, 0))
    verifier = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32)
    head = verifier.get_output_embeddings().weight.detach()[drafter.draft_ids]  # [D, H]
    with torch.no_grad():
        out = block_loss(drafter, drafter.lm_head.weight, head, block, elements, cfg.model.num_depths,
                         cfg.optim.loss_chunk_size, "sdpa")
    return float(out.loss_sum) / float(out.weight_sum)


def test_first_step_loss_is_the_drafters_loss_on_that_block_and_the_run_records_it(tmp_path, source, verifier_dir):
    """The warm start's step-1 loss (before its optimizer step) is X's loss on the step's block. Tolerance
    rel 1e-5: float32 on both sides, but the run's attention backend (``split`` on the CPU) and the reference's
    (``sdpa``) sum in another order: measured 1.2e-7 relative (0.1043232196 vs 0.1043232067), the tolerance
    ~100x that, far below the 1e-3 that tells a fresh drafter's loss apart."""
    store, x = source
    cfg = _cfg(store, tmp_path / "w", max_steps=3, init_from=str(x))  # the training output: its final/
    summary = run_train(cfg)
    rows = _rows(tmp_path / "w")
    ref = _reference_loss(load_drafter(x / "final"), store, verifier_dir, cfg, rows[0]["blocks"][0])
    assert rows[0]["loss"] == pytest.approx(ref, rel=1e-5)
    fresh = _rows(x)[0]["loss"]
    assert abs(rows[0]["loss"] - fresh) > 1e-3  # not a fresh drafter's
    assert rows[-1]["loss"] != rows[0]["loss"]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["lr"] == pytest.approx(3e-3)  # a new schedule, step 0
    sha = hashlib.sha256((x / "final" / "model.safetensors").read_bytes()).hexdigest()
    saved = json.loads((tmp_path / "w" / "train_config.json").read_text())
    assert saved["model"]["init_from"] == str((x / "final").resolve())
    assert saved["model"]["init_from_sha256"] == sha
    record = json.loads((tmp_path / "w" / "final" / "config.json").read_text())["peagle_training"]["init_from"]
    assert record["path"] == str((x / "final").resolve()) and record["format"] == "peagle"
    assert record["weights_sha256"] == sha and summary["init_from"] == record
    assert summary["draft_vocab_size"] == D  # the drafter's, without --draft-vocab-size
    assert torch.equal(load_drafter(tmp_path / "w" / "final").draft_ids, load_drafter(x / "final").draft_ids)


def _speculators(src, dst):
    """``src`` as speculators writes a P-EAGLE checkpoint: no ``peagle`` block (the config from the Llama layer)."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    for key in ("peagle", "peagle_training", "embed_requires_grad", "num_depths"):
        cfg.pop(key, None)
    (dst / "config.json").write_text(json.dumps(cfg))
    shutil.copy(src / "model.safetensors", dst / "model.safetensors")
    return dst


def _native(src, dst):
    """``src`` in the native vLLM layout: a top-level Llama config, ``ptd_token_id``, the aux layers in
    ``eagle_config``, layer 0 as ``midlayer.*``, no ``embed_tokens`` (vLLM then shares the verifier's)."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    native = dict(cfg["transformer_layer_config"])
    native.update(architectures=["Eagle3LlamaForCausalLM"], draft_vocab_size=cfg["draft_vocab_size"],
                  ptd_token_id=cfg["mask_token_id"], norm_before_residual=False,
                  eagle_config={"eagle_aux_hidden_state_layer_ids": cfg["eagle_aux_hidden_state_layer_ids"],
                                "use_aux_hidden_state": True})
    (dst / "config.json").write_text(json.dumps(native))
    tensors = {k.replace("layers.0.", "midlayer.", 1) if k.startswith("layers.0.") else k: v
               for k, v in load_file(str(src / "model.safetensors")).items() if k != "embed_tokens.weight"}
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _eagle3(src, dst):
    """``src`` as a speculators EAGLE-3 checkpoint: no mask token, no ``mask_hidden``."""
    dst.mkdir()
    cfg = json.loads((_speculators(src, dst.parent / (dst.name + "-spec")) / "config.json").read_text())
    cfg.update(speculators_model_type="eagle3", architectures=["Eagle3Speculator"], norm_before_residual=False)
    cfg.pop("mask_token_id")
    cfg["speculators_config"]["algorithm"] = "eagle3"
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in load_file(str(src / "model.safetensors")).items() if k != "mask_hidden"},
              str(dst / "model.safetensors"))
    return dst


@pytest.mark.parametrize("layout,fmt,kept", [(_speculators, "peagle", ()), (_native, "vllm", ("embed_tokens.weight",)),
                                             (_eagle3, "eagle3", ("mask_hidden",))])
def test_each_layout_loads_the_drafters_weights_then_trains_with_a_fresh_optimizer(tmp_path, source, verifier_dir,
                                                                                   layout, fmt, kept):
    store, x = source
    src = layout(x / "final", tmp_path / "ck")
    trainer = build_trainer(_cfg(store, tmp_path / "w", max_steps=3, init_from=str(src)))
    got, want = trainer.unwrapped.state_dict(), load_drafter(x / "final").state_dict()
    assert set(got) == set(want)
    for k in want:
        if k not in kept:
            assert torch.equal(got[k], want[k]), k
    if "embed_tokens.weight" in kept:  # the verifier's, as vLLM serves a drafter without embed_tokens
        verifier = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32)
        assert torch.equal(got["embed_tokens.weight"], verifier.get_input_embeddings().weight.detach())
        assert not torch.equal(got["embed_tokens.weight"], want["embed_tokens.weight"])
    if "mask_hidden" in kept:  # EAGLE-3 has none: this run's seeded init
        assert not torch.equal(got["mask_hidden"], want["mask_hidden"])
    assert trainer.step == 0 and trainer.optimizer.state_dict()["state"] == {}  # fresh optimizer
    assert trainer.scheduler.last_epoch == 0
    assert trainer.run.info["init_from"]["format"] == fmt
    summary = trainer.train()
    trainer.close()
    rows = _rows(tmp_path / "w")
    assert summary["steps"] == 3 and rows[-1]["loss"] != rows[0]["loss"]


def _variant(x, dst, **changes):
    """A drafter of ``x``'s config with ``changes`` (random weights, consistent tensors), saved as peagle writes it."""
    base = load_drafter(x / "final")
    cfg = dataclasses.replace(base.config, **changes)
    model = PEagleDrafter(cfg)
    if cfg.draft_vocab_size < cfg.vocab_size:
        ids = torch.arange(cfg.draft_vocab_size)
        model.d2t.zero_()
        model.t2d.zero_()
        model.t2d[ids] = True
    save_drafter(model, dst)
    return dst


def test_a_drafter_without_lm_head_trains_with_the_verifiers_as_vllm_serves_it_and_records_it(tmp_path, source,
                                                                                            verifier_dir):
    """vLLM serves a drafter that ships no lm_head with the verifier's (``_maybe_share_lm_head``): with
    D == V the run's lm_head is the verifier's whole ``[V, H]`` head, recorded as ``from_verifier``; with a
    reduced vocab whose d2t is not all zero (vLLM would score token ``i + d2t[i]`` with row i) it is refused
    before the weights load."""
    store, x = source
    src = _variant(x, tmp_path / "ck", draft_vocab_size=256)  # D == V
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, str(src / "model.safetensors"))
    trainer = build_trainer(_cfg(store, tmp_path / "w", max_steps=1, init_from=str(src)))
    verifier = AutoModelForCausalLM.from_pretrained(verifier_dir, dtype=torch.float32)
    assert torch.equal(trainer.unwrapped.lm_head.weight, verifier.get_output_embeddings().weight.detach())
    assert torch.equal(trainer.unwrapped.fc.weight, tensors["fc.weight"])
    assert trainer.run.info["init_from"]["from_verifier"] == ["lm_head.weight"]
    trainer.train()
    trainer.close()
    record = json.loads((tmp_path / "w" / "final" / "config.json").read_text())["peagle_training"]["init_from"]
    assert record["from_verifier"] == ["lm_head.weight"] and record["fresh"] == []
    reduced = tmp_path / "reduced"
    shutil.copytree(x / "final", reduced)
    tensors = load_file(str(reduced / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != "lm_head.weight"}, str(reduced / "model.safetensors"))
    with pytest.raises(InputError, match=rf"it has no lm_head.weight and a reduced draft vocab \(draft_vocab_size {D} "
                                         r"< vocab_size 256\): vLLM then shares the verifier's lm_head"):
        build_trainer(_cfg(store, tmp_path / "w2", max_steps=1, init_from=str(reduced)))


REFUSALS = [
    ({"hidden_size": 32, "head_dim": 8}, {}, "--init-from",
     "the drafter's hidden_size is 32 but the store {store}'s is 64; train a fresh drafter"),
    ({"vocab_size": 300}, {}, "--init-from",
     "the drafter's vocab_size (the verifier vocab) is 300 but the store {store}'s is 256"),
    ({"aux_layer_ids": [0, 1, 2]}, {}, "--init-from",
     "the drafter's eagle_aux_hidden_state_layer_ids (3 layers) is [0, 1, 2] but the store's layers (2) is [1, 2]; "
     "extract a store with --layers 0,1,2"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}, {}, "--init-from",
     "the drafter's RoPE (type, theta, scaling) is {{'rope_type': 'default', 'rope_theta': 500000.0}} but the "
     "verifier"),
    ({"num_key_value_heads": 4}, {}, "--init-from", "the drafter's num_key_value_heads is 4 but the verifier"),
    ({"intermediate_size": 96}, {}, "--init-from", "the drafter's intermediate_size is 96 but the verifier"),
    ({"num_hidden_layers": 2}, {}, "--num-layers",
     "the drafter's num_hidden_layers is 2 but --num-layers is 1; pass --num-layers 2"),
    ({"num_depths": 6}, {}, "--num-depths",
     "the drafter's num_depths (speculative_tokens) is 6 but --num-depths is 4; pass --num-depths 6"),
    ({}, {"mask_token_id": 5}, "--mask-token-id",
     "the drafter's mask token is 3 but --mask-token-id is 5; drop --mask-token-id (the run takes the drafter's) "
     "or pass --mask-token-id 3"),
    ({"layer_type": "qwen3"}, {"drafter_layer": "llama"}, "--drafter-layer",
     "the drafter's layer type is 'qwen3' but --drafter-layer is 'llama'; pass --drafter-layer qwen3 or drop "
     "--drafter-layer (the run takes the drafter's)"),
    ({}, {"drafter_layer": "qwen3"}, "--drafter-layer",
     "the drafter's layer type is 'llama' but --drafter-layer is 'qwen3'; pass --drafter-layer llama"),
    ({}, {"draft_vocab_size": 100}, "--draft-vocab-size",
     f"the drafter's draft_vocab_size is {D} but --draft-vocab-size is 100; drop --draft-vocab-size"),
    ({"draft_vocab_size": D}, {"draft_vocab_size": D}, "--draft-vocab-size",
     "the drafter's draft vocab (d2t) at draft id 3: verifier token is 3 but the 200 most frequent tokens of the "
     "store {store} there is 4; drop --draft-vocab-size"),
]


@pytest.mark.parametrize("changes,options,field,message", REFUSALS)
def test_a_drafter_that_does_not_fit_is_refused_before_the_weights(tmp_path, source, no_weights, changes, options,
                                                                   field, message):
    store, x = source
    src = _variant(x, tmp_path / "ck", **changes) if changes else x / "final"
    with pytest.raises(InputError) as e:
        build_trainer(_cfg(store, tmp_path / "w", max_steps=3, init_from=str(src), **options))
    assert f"--init-from {src.resolve()}: " + message.format(store=store) in str(e.value)
    assert e.value.field == field


def test_a_forward_peagle_does_not_compute_is_refused(tmp_path, source, no_weights):
    store, x = source
    src = _eagle3(x / "final", tmp_path / "ck")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["norm_before_residual"]  # vLLM's default for EAGLE-3: true
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=r"norm_before_residual is true \(vLLM reads it so when absent\): vLLM adds "
                                         "the normed fc output as the residual"):
        build_trainer(_cfg(store, tmp_path / "w", init_from=str(src)))
    cfg["norm_before_residual"], cfg["transformer_layer_config"]["model_type"] = False, "gemma2"
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="model_type is 'gemma2'; peagle's drafter layer is one of "
                                         r"\['llama', 'qwen3'\]; train a fresh drafter instead"):
        build_trainer(_cfg(store, tmp_path / "w", init_from=str(src)))
    cfg["transformer_layer_config"]["model_type"] = "qwen3"  # a qwen3 layer needs its q_norm/k_norm tensors
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=r"its tensors are not those of its config \(1 layers\): unknown \[\], "
                                         r"missing \['layers.0.self_attn.k_norm.weight', "
                                         r"'layers.0.self_attn.q_norm.weight'\]"):
        build_trainer(_cfg(store, tmp_path / "w", init_from=str(src)))


def _qwen3_native(src, dst):
    """``src`` (a qwen3-layer drafter) in the native vLLM layout of vLLM's Qwen3 EAGLE-3 drafter."""
    _native(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["Eagle3Qwen3ForCausalLM"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("layout", [None, _speculators, _qwen3_native])
def test_a_qwen3_drafter_warm_starts_a_qwen3_run(tmp_path, source, layout):
    """Without --drafter-layer the run takes the source's qwen3 layer, records it, and starts from its
    q_norm/k_norm weights; a native config whose model_type contradicts its architecture is refused."""
    store, x = source
    src = _variant(x, tmp_path / "q3", layer_type="qwen3", draft_vocab_size=D)
    drafter = load_drafter(src)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    save_drafter(drafter, src)
    if layout is not None:
        src = layout(src, tmp_path / "ck")
    trainer = build_trainer(_cfg(store, tmp_path / "w", max_steps=2, init_from=str(src)))
    assert trainer.unwrapped.config.layer_type == "qwen3"
    got = trainer.unwrapped.state_dict()
    for k in ("layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"):
        assert torch.equal(got[k], drafter.state_dict()[k]), k
    assert json.loads((tmp_path / "w" / "train_config.json").read_text())["model"]["drafter_layer"] == "qwen3"
    trainer.train()
    trainer.close()
    final = json.loads((tmp_path / "w" / "final" / "config.json").read_text())
    assert final["transformer_layer_config"]["model_type"] == "qwen3"
    if layout is _qwen3_native:
        cfg = json.loads((src / "config.json").read_text())
        cfg["model_type"] = "llama"
        (src / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(InputError, match=r"architectures \['Eagle3Qwen3ForCausalLM'\] \(vLLM builds a qwen3 "
                                             r"drafter layer\) and model_type 'llama' disagree"):
            build_trainer(_cfg(store, tmp_path / "w2", init_from=str(src)))


def test_resume_of_a_warm_start_continues_it_and_init_from_with_resume_is_refused(tmp_path, source):
    from cli.train import main

    store, x = source
    out, copy = tmp_path / "w", tmp_path / "copy"
    shutil.copytree(x / "final", copy)
    run_train(_cfg(store, out, max_steps=4, save_every=2, init_from=str(copy)))
    record = json.loads((out / "checkpoint-2" / "config.json").read_text())["peagle_training"]["init_from"]
    uninterrupted = [r["loss"] for r in _rows(out)]
    shutil.rmtree(out / "checkpoint-4")
    shutil.rmtree(out / "final")
    shutil.rmtree(copy)  # a resume needs the run's checkpoint, not the drafter it started from
    res = CliRunner().invoke(main, ["--config", str(out / "train_config.json"), "--resume"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{\n"):])
    assert summary["resumed_from"].endswith("checkpoint-2") and summary["steps"] == 4
    assert summary["init_from"] == record and record["path"] == str(copy.resolve())  # the record kept
    assert summary["draft_vocab_size"] == D  # the run's own, not the full vocab
    assert [r["loss"] for r in _rows(out)] == pytest.approx(uninterrupted, rel=1e-6)  # continued exactly
    assert json.loads((out / "train_config.json").read_text())["model"]["init_from"] == str(copy.resolve())
    assert json.loads((out / "final" / "config.json").read_text())["peagle_training"]["init_from"] == record
    other = tmp_path / "other"
    run_train(_cfg(store, other, max_steps=2))
    with pytest.raises(InputError, match=r"--init-from cannot be combined with --resume: --resume continues the run "
                                         rf"saved in {other} from its checkpoint \(started from None\), --init-from"):
        run_train(_cfg(store, other, max_steps=2, resume=True, init_from=str(x / "final")))
    res = CliRunner().invoke(main, ["--config", str(out / "train_config.json"), "--resume", "--init-from",
                                    str(other / "final")])
    assert res.exit_code != 0 and "--init-from cannot be combined with --resume" in res.output, res.output
    with pytest.raises(InputError, match="--init-from-sha256 is 00ff: not the drafter the run was started from"):
        run_train(_cfg(store, tmp_path / "w2", init_from=str(x / "final"), init_from_sha256="00ff"))


def test_a_p_eagle_drafter_is_refused_by_a_dflash_run_naming_both_kinds(source):
    _, x = source
    with pytest.raises(InputError, match=r"it is a peagle drafter \(peagle layout, speculators_model_type 'peagle'\) "
                                         r"and this run trains a dflash drafter \(--method dflash, which starts from "
                                         r"dflash drafters\); pass --method peagle") as e:
        read_init_source(x, "dflash")
    assert e.value.field == "--init-from"
    assert read_init_source(x).format == "peagle"  # --method peagle's, the default
