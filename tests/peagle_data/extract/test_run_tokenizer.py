"""extract compares the packed table's tokenizer with the verifier's, and its token ids with the verifier's
embedding rows, before any weights load (docs/design.md §2); pack does the same with tokenize outputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from peagle_data.extract.config import ExtractConfig
from peagle_data.extract.run import run_extract
from stores.errors import StoreMismatchError
from stores.features.feature_store import FeatureStore
from stores.tables.token_tables import TokenTable
from runtime.verifier_match import tokenizer_fingerprint

from .test_run import pack_conversations, write_packed

EXTRA = "<|peagle_extra|>"  # the added token: id 49152 after SmolLM2's 49152 ids
FIX = "tokenize and pack the conversations with the verifier's tokenizer (`peagle-data pack ... --tokenizer {v}`), " \
      "or pass the verifier whose tokenizer made them"


@pytest.fixture(scope="module")
def plus_tokenizer_dir(tmp_path_factory, smollm2_tokenizer_dir) -> Path:
    """The SmolLM2 tokenizer with one added token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)
    assert tok.add_tokens([EXTRA]) == 1
    out = tmp_path_factory.mktemp("plus_tokenizer")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def packed_plus(tmp_path_factory, plus_tokenizer_dir) -> Path:
    """A packed table made with the added-token tokenizer; both answers hold the added token."""
    from cli.data import main

    d = tmp_path_factory.mktemp("packed_plus")
    rows = [{"messages": [{"role": "user", "content": f"question {i}"},
                          {"role": "assistant", "content": f"answer {EXTRA} number {i}"}]} for i in range(2)]
    (d / "conv.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = CliRunner().invoke(main, ["pack", str(d / "conv.jsonl"), "--tokenizer", str(plus_tokenizer_dir),
                                    "--output", str(d / "packed"), "--block-size", "256",
                                    "--max-seq-len", "256"])
    assert res.exit_code == 0, res.output
    return d / "packed"


def _verifier(path: Path, vocab: int, tokenizer_dir: Path, weights: bool = False) -> Path:
    """A tiny Llama of ``vocab`` embedding rows with the tokenizer of ``tokenizer_dir``; config only
    unless ``weights``, so that loading weights fails (the checks must come first)."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if weights:
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(path)
    else:
        cfg.save_pretrained(path)
    for f in Path(tokenizer_dir).iterdir():
        if f.is_file() and not f.name.startswith(".") and f.suffix != ".safetensors" \
                and f.name not in ("config.json", "generation_config.json"):
            shutil.copy(f, path / f.name)
    return path


def _fp(directory) -> str:
    from transformers import AutoTokenizer

    return tokenizer_fingerprint(AutoTokenizer.from_pretrained(directory))


def test_the_manifest_records_the_tokenizer_fingerprint(packed_plus, plus_tokenizer_dir, smollm2_tokenizer_dir):
    rec = TokenTable.open(packed_plus).manifest["tokenizer"]
    assert rec["name"] == str(plus_tokenizer_dir) and rec["vocab_size"] == 49153
    assert rec["fingerprint"] == _fp(plus_tokenizer_dir) != _fp(smollm2_tokenizer_dir)
    ids = np.concatenate([r["input_ids"] for r in TokenTable.open(packed_plus).iter_rows(["input_ids"])])
    assert int((ids == 49152).sum()) == 2  # the added token, once per answer


@pytest.mark.parametrize("vocab", [49152, 49152 + 64], ids=["verifier-without-the-token", "bigger-embedding"])
def test_a_verifier_without_the_added_token_is_refused_before_the_weights(tmp_path, packed_plus, plus_tokenizer_dir,
                                                                          smollm2_tokenizer_dir, vocab):
    """Without the check: an IndexError from torch.embedding after the weights load (49152 rows), or
    (a bigger embedding) exit 0 and a complete store whose id 49152 the verifier reads as another token."""
    v = _verifier(tmp_path / "v", vocab, smollm2_tokenizer_dir)  # no weights: loading them would fail
    out = tmp_path / "f.zarr"
    want = (f"the packed table {packed_plus} was tokenized with {str(plus_tokenizer_dir)!r} (tokenizer fingerprint "
            f"{_fp(plus_tokenizer_dir)}, 49153 tokens), but verifier {str(v)!r} has tokenizer fingerprint "
            f"{_fp(smollm2_tokenizer_dir)} and 49152 tokens: its token ids would mean other tokens; "
            + FIX.format(v=v))
    with pytest.raises(StoreMismatchError) as e:
        run_extract(ExtractConfig(packed=str(packed_plus), verifier=str(v), output=str(out), device="cpu"),
                    progress=False, log=lambda m: None)
    assert str(e.value) == want
    assert not out.exists()  # nothing half-written
    from cli.data import main

    res = CliRunner().invoke(main, ["extract", str(packed_plus), "--verifier", str(v), "--output", str(out),
                                    "--device", "cpu"])
    assert res.exit_code == 2 and f"Error: {want}" in " ".join(res.output.split()), res.output
    assert not out.exists()


def test_the_verifier_with_the_same_tokenizer_extracts_and_counts_the_added_token(tmp_path, packed_plus,
                                                                                  plus_tokenizer_dir):
    v = _verifier(tmp_path / "v", 49152 + 64, plus_tokenizer_dir, weights=True)
    summary = run_extract(ExtractConfig(packed=str(packed_plus), verifier=str(v), output=str(tmp_path / "f.zarr"),
                                        device="cpu", layers=[1, 2, 3]), progress=False, log=lambda m: None)
    assert summary["complete"]
    store = FeatureStore.open(tmp_path / "f.zarr")
    assert store.attrs["tokenizer"]["fingerprint"] == _fp(plus_tokenizer_dir)
    freq = store.token_freq()
    assert freq.shape == (49152 + 64,) and int(freq[49152]) == 2  # both supervised copies counted
    want = np.zeros(49152 + 64, np.int64)
    for r in TokenTable.open(packed_plus).iter_rows(["input_ids", "loss_mask"]):
        np.add.at(want, np.asarray(r["input_ids"])[np.asarray(r["loss_mask"]) == 1], 1)
    assert np.array_equal(freq, want)


def test_token_ids_past_the_embedding_are_refused_naming_block_position_and_id(tmp_path, smollm2_tokenizer_dir):
    """A table whose manifest records no tokenizer fingerprint (an older or hand-made table): the ids
    themselves are checked against the verifier's embedding rows, before the weights load."""
    packed = write_packed(tmp_path / "packed", n_blocks=3, block_size=48)  # ids 3..49151
    v = _verifier(tmp_path / "v", 49152, smollm2_tokenizer_dir)
    small = _verifier(tmp_path / "small", 4096, smollm2_tokenizer_dir)
    (small / "tokenizer.json").unlink()  # a verifier directory without a tokenizer: the ids are still checked
    (small / "tokenizer_config.json").unlink()
    rows = list(TokenTable.open(packed).iter_rows(["input_ids"]))
    for shard, num_shards in ((0, 1), (1, 2)):
        mine = rows[shard::num_shards]
        k, t = next((k, int(np.flatnonzero(np.asarray(r["input_ids"]) >= 4096)[0]))
                    for k, r in enumerate(mine) if (np.asarray(r["input_ids"]) >= 4096).any())
        block, bad = shard + k * num_shards, int(mine[k]["input_ids"][t])
        want = (f"the packed table {packed}: block {block} holds token id {bad} at position {t}, but verifier "
                f"{str(small)!r} has 4096 embedding rows (ids 0..4095): the table was made with another tokenizer; "
                f"pack it with the verifier's tokenizer (`peagle-data pack ... --tokenizer {small}`), or pass the "
                "verifier whose tokenizer made it")
        with pytest.raises(StoreMismatchError) as e:
            run_extract(ExtractConfig(packed=str(packed), verifier=str(small), output=str(tmp_path / "f.zarr"),
                                      device="cpu", num_shards=num_shards, shard_index=shard, context="window"),
                        progress=False, log=lambda m: None)
        assert str(e.value) == want
    # a manifest naming a tokenizer with its vocab size but no fingerprint: the sizes are compared
    manifest = json.loads((packed / "manifest.json").read_text())
    manifest["tokenizer"] = {"name": "old", "vocab_size": 49153}
    (packed / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreMismatchError, match=f"tokenized with 'old' \\(tokenizer fingerprint None, 49153 "
                                                 f"tokens\\), but verifier {str(v)!r} has tokenizer fingerprint "
                                                 f"{_fp(smollm2_tokenizer_dir)} and 49152 tokens"):
        run_extract(ExtractConfig(packed=str(packed), verifier=str(v), output=str(tmp_path / "f.zarr"), device="cpu",
                                  context="window"), progress=False, log=lambda m: None)


def test_full_context_names_the_packed_block_of_a_token_id_past_the_embedding(tmp_path, smollm2_tokenizer,
                                                                            smollm2_tokenizer_dir):
    """With the default --context full the verifier runs context blocks, but a bad id is named by the
    packed block (and position) that holds it, as with --context window."""
    packed = pack_conversations(tmp_path, smollm2_tokenizer)
    manifest = json.loads((packed / "manifest.json").read_text())
    manifest.pop("tokenizer")  # no fingerprint to compare: the ids themselves are checked
    (packed / "manifest.json").write_text(json.dumps(manifest))
    small = _verifier(tmp_path / "small", 4096, smollm2_tokenizer_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (small / name).unlink()
    rows = list(TokenTable.open(packed).iter_rows(["input_ids"]))
    block, t = next((b, int(np.flatnonzero(np.asarray(r["input_ids"]) >= 4096)[0]))
                    for b, r in enumerate(rows) if (np.asarray(r["input_ids"]) >= 4096).any())
    with pytest.raises(StoreMismatchError) as e:
        run_extract(ExtractConfig(packed=str(packed), verifier=str(small), output=str(tmp_path / "f.zarr"),
                                  device="cpu"), progress=False, log=lambda m: None)
    assert str(e.value).startswith(f"the packed table {packed}: block {block} holds token id "
                                   f"{int(rows[block]['input_ids'][t])} at position {t}, but verifier")
    assert not (tmp_path / "f.zarr").exists()


def test_a_recorded_fingerprint_and_a_verifier_without_tokenizer_is_refused(tmp_path, packed_plus,
                                                                             plus_tokenizer_dir):
    v = _verifier(tmp_path / "v", 49153, plus_tokenizer_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (v / name).unlink()
    with pytest.raises(StoreMismatchError) as e:
        run_extract(ExtractConfig(packed=str(packed_plus), verifier=str(v), output=str(tmp_path / "f.zarr"),
                                  device="cpu"), progress=False, log=lambda m: None)
    assert str(e.value) == (
        f"the packed table {packed_plus} was tokenized with {str(plus_tokenizer_dir)!r} (tokenizer fingerprint "
        f"{_fp(plus_tokenizer_dir)}, 49153 tokens), but verifier {str(v)!r} ({v}) has no tokenizer files "
        "(tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json) to compare it with; copy the "
        "verifier's tokenizer into its directory")


def test_pack_refuses_a_tokenize_output_of_another_tokenizer(tmp_path, plus_tokenizer_dir, smollm2_tokenizer_dir):
    """Same chat template, one added token: the tokenize output's ids are not the --tokenizer's."""
    from cli.data import main

    (tmp_path / "conv.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "q"},
                                                                  {"role": "assistant", "content": "a"}]}) + "\n")
    res = CliRunner().invoke(main, ["tokenize", str(tmp_path / "conv.jsonl"), "--tokenizer", str(plus_tokenizer_dir),
                                    "--output", str(tmp_path / "tok")])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(main, ["pack", str(tmp_path / "tok"), "--tokenizer", str(smollm2_tokenizer_dir),
                                    "--output", str(tmp_path / "p")])
    assert res.exit_code == 2, res.output
    assert (f"Error: the tokenize output {tmp_path / 'tok'} was tokenized with {str(plus_tokenizer_dir)!r} "
            f"(tokenizer fingerprint {_fp(plus_tokenizer_dir)}, 49153 tokens), but --tokenizer "
            f"{smollm2_tokenizer_dir} has tokenizer fingerprint {_fp(smollm2_tokenizer_dir)} and 49152 tokens: its "
            "token ids would mean other tokens; pass the tokenizer it was tokenized with, or re-run tokenize") \
        in " ".join(res.output.split()), res.output
    assert not (tmp_path / "p").exists()
