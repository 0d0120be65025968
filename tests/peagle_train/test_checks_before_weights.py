"""Options that need only a config, a store or the file system are checked before any weights load.

Every test makes loading model weights fail (``PreTrainedModel.from_pretrained`` raises), then checks
that each command reports the option's own error: the error comes first, without the weights.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from .test_train import LAYERS, _store


class WeightsLoaded(AssertionError):
    pass


@pytest.fixture
def no_weights(monkeypatch):
    """Loading any transformers model's weights raises :class:`WeightsLoaded`."""
    import transformers

    def fail(cls, *a, **k):
        raise WeightsLoaded(f"{cls.__name__}.from_pretrained was called before the option checks")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(fail))


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory, make_tiny_llama):
    return make_tiny_llama(tmp_path_factory.mktemp("verifier"), hidden=64, vocab=256)


def _train(args):
    from cli.train import main

    return CliRunner().invoke(main, args)


def test_train_checks_come_before_the_weights(tmp_path, verifier_dir, make_tiny_llama, no_weights):
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "something").write_text("x")
    base = ["--store", store, "--output", str(out), "--max-steps", "1", "--num-depths", "2"]
    res = _train(base)
    assert res.exit_code == 2 and "already exists" in res.output and "--resume" in res.output, res.output
    res = _train([*base, "--force", "--draft-vocab-size", "1000"])
    assert res.exit_code == 2 and "--draft-vocab-size 1000 exceeds" in res.output and "256" in res.output, res.output
    other = make_tiny_llama(tmp_path / "other", hidden=32)
    res = _train([*base, "--force", "--verifier", str(other)])
    assert res.exit_code == 2 and "hidden_size 32" in res.output, res.output
    assert (out / "something").exists()  # --force deletes nothing before the checks pass


def test_train_resume_with_changed_settings_is_refused_before_the_weights(tmp_path, verifier_dir, monkeypatch):
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    base = ["--store", store, "--output", str(tmp_path / "out"), "--max-steps", "1", "--num-depths", "2",
            "--save-every", "1"]
    assert _train(base).exit_code == 0
    import transformers

    def fail(cls, *a, **k):
        raise WeightsLoaded("weights loaded before the --resume settings check")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(fail))
    res = _train([*base[:-4], "--num-depths", "3", "--save-every", "1", "--resume"])
    assert res.exit_code == 2 and "and these differ from it: --num-depths: saved 2, given 3. Resume it with: " \
        f"peagle-train --config {tmp_path / 'out' / 'train_config.json'} --resume" in res.output, res.output


def test_train_loads_the_weights_once_the_checks_pass(tmp_path, verifier_dir, no_weights):
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    res = _train(["--store", store, "--output", str(tmp_path / "out"), "--max-steps", "1", "--num-depths", "2"])
    assert isinstance(res.exception, WeightsLoaded)  # the fixture works: a valid run reaches the weights


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, verifier_dir):
    """A random drafter checkpoint for ``verifier_dir`` (hidden 64, vocab 256, layers 1, 2)."""
    from peagle_train.checkpoint import save_drafter
    from peagle_train.model import DrafterConfig, PEagleDrafter

    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=256, draft_vocab_size=256, aux_layer_ids=LAYERS, num_depths=2,
                        verifier_name_or_path=str(verifier_dir))
    torch.manual_seed(0)
    return save_drafter(PEagleDrafter(cfg), tmp_path_factory.mktemp("drafter") / "d")


def _eval(args):
    from cli.eval import main

    return CliRunner().invoke(main, args)


def test_eval_checks_come_before_the_weights(tmp_path, verifier_dir, drafter_dir, make_tiny_llama, no_weights):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["hi"]}) + "\n")
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    other = make_tiny_llama(tmp_path / "other", hidden=32)
    res = _eval(["--drafter", str(drafter_dir), "--prompts", str(prompts), "--verifier", str(other)])
    assert res.exit_code == 2 and "hidden size 64 != verifier's 32" in res.output, res.output
    # offline runs first: a bad prompts file is still reported before the offline run loads weights
    res = _eval(["--drafter", str(drafter_dir), "--store", store, "--prompts", str(tmp_path / "none.jsonl")])
    assert res.exit_code == 2 and "none.jsonl" in res.output, res.output
    res = _eval(["--drafter", str(drafter_dir), "--store", store, "--prompts", str(prompts),
                 "--verifier", str(other)])
    assert res.exit_code == 2 and "does not match the verifier" in res.output, res.output
    res = _eval(["--drafter", str(drafter_dir), "--prompts", str(prompts)])
    assert isinstance(res.exception, WeightsLoaded)  # valid options reach the weights


def test_extract_checks_come_before_the_weights(tmp_path, tiny_verifier_dir, monkeypatch):
    """--layers past the config's layer count, and --resume with other layers, storage dtype or table."""
    import transformers

    from cli.data_extract import extract
    from tests.peagle_data.test_extract_run import write_packed

    packed = write_packed(tmp_path / "packed", n_blocks=2, block_size=32)
    out = tmp_path / "f.zarr"
    base = [str(packed), "--verifier", str(tiny_verifier_dir), "--output", str(out), "--device", "cpu"]
    assert CliRunner().invoke(extract, [*base, "--layers", "1,2", "--max-blocks", "1"]).exit_code == 0

    def fail(cls, *a, **k):
        raise WeightsLoaded(f"{cls.__name__}.from_pretrained was called before the option checks")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(fail))
    res = CliRunner().invoke(extract, [*base.copy()[:4], str(tmp_path / "new.zarr"), "--layers", "1,5"])
    assert res.exit_code == 2 and "layers [5] out of range: the verifier has 4 layers" in res.output, res.output
    res = CliRunner().invoke(extract, [*base, "--layers", "1,3", "--resume"])
    assert res.exit_code == 2 and "layers [1, 2], asked for [1, 3]" in res.output, res.output
    res = CliRunner().invoke(extract, [*base, "--layers", "1,2", "--resume", "--storage-dtype", "fp8"])
    assert res.exit_code == 2 and "holds bf16, asked for fp8" in res.output, res.output
    res = CliRunner().invoke(extract, [*base, "--layers", "1,2", "--resume", "--num-shards", "2"])
    assert res.exit_code == 2 and "the store is shard 0 of 1, asked for shard 0 of 2" in res.output, res.output
    other = write_packed(tmp_path / "other", n_blocks=2, block_size=32, seed=1)
    res = CliRunner().invoke(extract, [str(other), *base[1:], "--layers", "1,2", "--resume"])
    assert res.exit_code == 2 and "another packed table" in res.output, res.output
    res = CliRunner().invoke(extract, [*base, "--layers", "1,2", "--resume"])
    assert isinstance(res.exception, WeightsLoaded)  # valid options reach the weights


def _relabel(store, **attrs):
    """Rewrite a store's ``peagle`` attributes (a store made by an older peagle, or other layers)."""
    from stores.feature_store import FeatureStore

    FeatureStore.open(store, mode="r+").update_attrs(**attrs)
    return store


def test_train_refuses_a_store_whose_layer_l_is_the_normed_state(tmp_path, verifier_dir, no_weights):
    """A store extracted before layer L meant vLLM's pre-norm value, with L among its layers, is refused
    with the re-extract command; one without L trains (its layers are the same values either way)."""
    base = ["--output", str(tmp_path / "out"), "--max-steps", "1", "--num-depths", "2"]
    old = _relabel(_store(tmp_path / "old.zarr", verifier_dir), layer_convention="hf_hidden_states",
                   layers=[1, 3])  # L = 3 (the store's verifier num_hidden_layers)
    res = _train(["--store", old, *base])
    assert res.exit_code != 0 and not isinstance(res.exception, WeightsLoaded), res.output
    assert (f"{old}: aux layer 3 of this store is the verifier's final normed state" in res.output
            and f"peagle-data extract PACKED --verifier {verifier_dir} --layers 1,3 --output NEW_STORE"
            in res.output), res.output
    fine = _relabel(_store(tmp_path / "fine.zarr", verifier_dir), layer_convention="hf_hidden_states")
    assert isinstance(_train(["--store", fine, *base]).exception, WeightsLoaded)  # layers 1, 2: no L


def test_train_refuses_aux_layers_vllm_would_reorder(tmp_path, verifier_dir, no_weights):
    """vLLM captures sorted(set(ids)): a store of layers 2, 1 would feed fc its inputs swapped."""
    store = _relabel(_store(tmp_path / "s.zarr", verifier_dir), layers=[2, 1])
    res = _train(["--store", store, "--output", str(tmp_path / "out"), "--max-steps", "1", "--num-depths", "2"])
    assert res.exit_code == 2 and not isinstance(res.exception, WeightsLoaded), res.output
    assert "vLLM cannot serve this drafter as it is trained: eagle_aux_hidden_state_layer_ids [2, 1] is not " \
        "strictly increasing: vLLM feeds the layers [1, 2], in that order; extract with --layers 1,2" \
        in res.output.replace("\n", " "), res.output


def test_eval_refuses_a_foreign_checkpoint_vllm_would_serve_otherwise(tmp_path, drafter_dir, no_weights):
    """A checkpoint without num_aux_hidden_states (vLLM sizes fc for 3 aux layers) and with a reduced
    vocab but no d2t is refused by peagle-eval before any weights load, naming both."""
    import shutil

    from safetensors.torch import load_file, save_file

    foreign = tmp_path / "foreign"
    shutil.copytree(drafter_dir, foreign)
    cfg = json.loads((foreign / "config.json").read_text())
    del cfg["transformer_layer_config"]["num_aux_hidden_states"]
    cfg["draft_vocab_size"] = 128
    (foreign / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(foreign / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:128].contiguous()
    save_file(tensors, str(foreign / "model.safetensors"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["hi"]}) + "\n")
    res = _eval(["--drafter", str(foreign), "--prompts", str(prompts)])
    text = res.output.replace("\n", " ")
    assert res.exit_code == 2 and not isinstance(res.exception, WeightsLoaded), res.output
    assert (f"{foreign}: vLLM cannot serve this drafter as it is trained: vLLM sizes fc for 3 aux layers but the "
            f"checkpoint has 2 ({LAYERS}); write \"num_aux_hidden_states\": 2 inside transformer_layer_config; "
            "d2t is missing but the draft vocab is reduced (128 < 256): vLLM would map draft id i to token i"
            in text), res.output


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_eval_engine_vllm_without_vllm_names_the_set_up(tmp_path, drafter_dir, no_weights):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["hi"]}) + "\n")
    res = _eval(["--drafter", str(drafter_dir), "--prompts", str(prompts), "--engine", "vllm"])
    assert res.exit_code != 0 and not isinstance(res.exception, WeightsLoaded), res.output
    assert "--engine vllm needs vLLM, which this environment lacks" in res.output
    assert "PEAGLE_VLLM=1 bash scripts/setup_env.sh" in res.output.replace("\n", " "), res.output
    res = _eval(["--drafter", str(drafter_dir), "--prompts", str(prompts), "--engine", "vllm", "--temperature", "0.5"])
    assert res.exit_code == 2 and "--engine vllm measures greedy decoding only" in res.output, res.output
