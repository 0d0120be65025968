"""peagle-data merge + verify: shard tables and shard stores joined into the unsharded run."""

from __future__ import annotations

import hashlib
import json
from collections import Counter

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from cli.data import main
from peagle_data.extract.config import ExtractConfig
from peagle_data.extract.run import run_extract
from peagle_data.prepare.config import PackConfig, PackRun, TokenizeConfig, TokenizeRun
from peagle_data.prepare.pack import run_pack
from peagle_data.prepare.tokenizing import run_tokenize
from stores.errors import InputError, StoreFormatError, StoreMismatchError
from stores.features.feature_repair import verify_store
from stores.features.feature_store import FeatureStore
from stores.merge import merge_stores, merge_tables, verify_table
from stores.tables.token_tables import CONVERSATIONS, TokenTable, conversations_record

from tests.long_conversations import long_conversations
from tests.peagle_data.extract.test_run import pack_conversations, write_packed
from tests.peagle_data.prepare.test_mixtures import _three_sources
from tests.peagle_data.prepare.test_shards import _inputs, _tok_rows, _windows


def _shards(tmp_path, tok, inputs, kind, n=3):
    outs = []
    for i in range(n):
        out = tmp_path / f"{kind}{i}"
        t = TokenizeConfig(num_shards=n, shard_index=i)
        if kind == "tok":
            run_tokenize(TokenizeRun(inputs=inputs, tokenizer="smollm2-135m", output=out, settings=t), tokenizer=tok)
        else:
            run_pack(PackRun(inputs=inputs, tokenizer="smollm2-135m", output=out,
                             settings=PackConfig(max_seq_len=128, tokenize=t)), tokenizer=tok)
        outs.append(out)
    return outs


def test_merged_tokenize_and_pack_shards_equal_the_unsharded_run(tmp_path, smollm2_tokenizer):
    inputs = _inputs(tmp_path)
    full_tok = run_tokenize(TokenizeRun(inputs=inputs, tokenizer="smollm2-135m", output=tmp_path / "full_tok",
                                        settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)
    shards = _shards(tmp_path, smollm2_tokenizer, inputs, "tok")
    manifest = merge_tables(shards[::-1], tmp_path / "merged_tok")  # any order
    assert _tok_rows(tmp_path / "merged_tok") == _tok_rows(tmp_path / "full_tok")
    for key in ("read", "used", "rejected", "duplicates", "tokens", "loss_tokens"):
        assert manifest["counts"][key] == full_tok["counts"][key], key
    assert [p["shard_index"] for p in manifest["merged_from"]] == [0, 1, 2]
    assert np.array_equal(TokenTable.open(tmp_path / "merged_tok").token_freq(),
                          TokenTable.open(tmp_path / "full_tok").token_freq())
    rejects = lambda p: sorted((p / "rejects.jsonl").read_text().splitlines())  # noqa: E731
    assert rejects(tmp_path / "merged_tok") == rejects(tmp_path / "full_tok")
    assert verify_table(tmp_path / "merged_tok") == {"ok": True, "kind": "tokenized",
                                                     "rows": full_tok["counts"]["used"], "problems": []}

    full = run_pack(PackRun(inputs=inputs, tokenizer="smollm2-135m", output=tmp_path / "full_p",
                            settings=PackConfig(max_seq_len=128)), tokenizer=smollm2_tokenizer)
    r = CliRunner().invoke(main, ["merge", *map(str, _shards(tmp_path, smollm2_tokenizer, inputs, "p")),
                                  "--output", str(tmp_path / "merged_p")])
    assert r.exit_code == 0, r.output
    merged = TokenTable.open(tmp_path / "merged_p")
    assert _windows(tmp_path / "merged_p") == _windows(tmp_path / "full_p")
    assert merged.read_all(["block_id"]).column(0).to_pylist() == list(range(merged.num_rows))
    assert merged.manifest["counts"]["loss_tokens"] == full["counts"]["loss_tokens"]
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "merged_p")])
    assert r.exit_code == 0 and json.loads(r.output)["ok"], r.output


def test_merge_refuses_incomplete_or_foreign_shards_and_verify_finds_overlaps(tmp_path, smollm2_tokenizer):
    inputs = _inputs(tmp_path)
    shards = _shards(tmp_path, smollm2_tokenizer, inputs, "tok")
    with pytest.raises(InputError, match=r"missing shard index \[1\]"):
        merge_tables([shards[0], shards[2]], tmp_path / "m")
    with pytest.raises(InputError, match=r"shard index \[0\] given twice"):
        merge_tables([shards[0], shards[0], shards[2]], tmp_path / "m")
    run_tokenize(TokenizeRun(inputs=inputs, tokenizer="smollm2-135m", output=tmp_path / "other",
                             settings=TokenizeConfig(num_shards=3, shard_index=1, max_tokens=500)),
                             tokenizer=smollm2_tokenizer)
    with pytest.raises(StoreMismatchError, match="other parameters"):
        merge_tables([shards[0], tmp_path / "other", shards[2]], tmp_path / "m")
    run_tokenize(TokenizeRun(inputs=inputs, tokenizer="smollm2-135m", output=tmp_path / "whole",
                             settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)
    with pytest.raises(InputError, match="is not a shard"):
        merge_tables([tmp_path / "whole"], tmp_path / "m")
    assert not (tmp_path / "m").exists()
    # a merged table whose part files were tampered with: one part linked twice
    merge_tables(shards, tmp_path / "m")
    parts = sorted((tmp_path / "m").glob("part-*.parquet"))
    parts[1].unlink()
    parts[1].hardlink_to(parts[0])
    report = verify_table(tmp_path / "m")
    assert not report["ok"] and any("repeated row sources" in p for p in report["problems"])
    assert any(p.startswith("shard 1:") for p in report["problems"])
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "m")])
    assert r.exit_code == 1 and "failed verification" in r.output


def test_merged_pack_shards_record_their_conversations_and_refuse_a_changed_one(tmp_path, smollm2_tokenizer):
    from tests.stores.tables.test_token_tables import _rewrite

    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in long_conversations(6)))
    shards = []
    for i in range(2):
        run_pack(PackRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / f"s{i}",
                         settings=PackConfig(max_seq_len=64, tokenize=TokenizeConfig(num_shards=2, shard_index=i))),
                 tokenizer=smollm2_tokenizer)
        shards.append(tmp_path / f"s{i}")
    merged = merge_tables(shards, tmp_path / "m")
    assert merged[CONVERSATIONS] == conversations_record(tmp_path / "m") and merged[CONVERSATIONS]["rows"] == 6
    assert verify_table(tmp_path / "m")["ok"]
    _rewrite(tmp_path / "m", lambda rows: rows[::-1])  # the same conversations in another order: other bytes
    report = verify_table(tmp_path / "m")
    assert not report["ok"] and any("edited or copied from another pack run" in p for p in report["problems"])
    _rewrite(shards[1], lambda rows: rows[:-1])
    with pytest.raises(StoreMismatchError, match=f"{shards[1] / CONVERSATIONS}: its part files are not those"):
        merge_tables(shards, tmp_path / "m2")
    # a shard whose manifest records no digest (an older peagle): nothing was checked, nothing is recorded
    manifest = json.loads((shards[1] / "manifest.json").read_text())
    del manifest[CONVERSATIONS]
    (shards[1] / "manifest.json").write_text(json.dumps(manifest))
    assert CONVERSATIONS not in merge_tables(shards, tmp_path / "m3")


def test_extract_shards_merge_into_the_unsharded_store(tmp_path, tiny_verifier_dir):
    packed = write_packed(tmp_path / "packed", n_blocks=5, block_size=48)
    cfg = dict(packed=str(packed), verifier=str(tiny_verifier_dir), layers=[1, 3], device="cpu", context="window")
    run_extract(ExtractConfig(**cfg, output=str(tmp_path / "full.zarr")), progress=False)
    parts = []
    for i in range(2):
        out = tmp_path / f"s{i}.zarr"
        s = run_extract(ExtractConfig(**cfg, output=str(out), num_shards=2, shard_index=i), progress=False)
        assert s["complete"] and s["training_blocks"] == (3, 2)[i]
        parts.append(out)
        r = CliRunner().invoke(main, ["verify", str(out), "--packed", str(packed)])  # a shard checks its blocks
        assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["merge", str(parts[1]), str(parts[0]), "--output", str(tmp_path / "m.zarr")])
    assert r.exit_code == 0, r.output
    full, merged = FeatureStore.open(tmp_path / "full.zarr"), FeatureStore.open(tmp_path / "m.zarr")
    assert merged.n_blocks == 5 and merged.n_tokens == full.n_tokens
    for name in ("input_ids", "loss_mask", "position_ids", "cu_seqlens", "aux_hidden", "final_hidden", "n_tokens",
                 "token_freq", "done", "segment_keys"):
        assert np.array_equal(merged.group[name][:], full.group[name][:]), name
    assert merged.segment_keys()[:, 0].tolist() == [0, 10, 20, 30, 40]  # interleaved back into packed order
    assert verify_store(tmp_path / "m.zarr")["ok"]
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "m.zarr"), "--packed", str(packed)])
    assert r.exit_code == 0, r.output
    assert merged.attrs["engine"] == full.attrs["engine"] == {"name": "hf"}
    FeatureStore.open(parts[1], mode="r+").update_attrs(engine={"name": "vllm"})  # as an --engine vllm shard
    with pytest.raises(StoreMismatchError, match="a store's blocks come from one engine"):
        merge_stores(parts, tmp_path / "z.zarr")
    FeatureStore.open(parts[1], mode="r+").update_attrs(engine={"name": "hf"})
    verifier = FeatureStore.open(parts[1]).attrs["verifier"]
    FeatureStore.open(parts[1], mode="r+").update_attrs(verifier={**verifier, "dtype": "bfloat16"})  # a GPU server's
    with pytest.raises(StoreMismatchError) as e:
        merge_stores(parts, tmp_path / "z.zarr")
    assert str(e.value) == (f"{parts[1]}: features computed in bfloat16, {parts[0]}'s in float32 (servers or devices "
                            "of other dtypes); a merged store's blocks come from one compute dtype: extract the "
                            "shards again with one")
    FeatureStore.open(parts[1], mode="r+").update_attrs(verifier=verifier)
    chunk = FeatureStore.open(parts[0]).chunk_path("final_hidden", 1)
    good = chunk.read_bytes()
    chunk.write_bytes(good[:50] + bytes([good[50] ^ 0xFF]) + good[51:])  # same size: only the crc32c tells
    with pytest.raises(StoreFormatError, match=r"s0\.zarr: block 1 cannot be trusted: .*final_hidden.*(checksum|crc32c)"):
        merge_stores(parts, tmp_path / "d.zarr")  # issue 33: a damaged shard block is not copied into the union
    chunk.write_bytes(good)
    with pytest.raises(InputError, match=r"missing shard index \[1\]"):
        merge_stores([parts[0]], tmp_path / "x.zarr")
    FeatureStore.open(parts[1], mode="r+").clear_done(0)
    with pytest.raises(InputError, match="1 blocks not done"):
        merge_stores(parts, tmp_path / "y.zarr")


def _files(store):
    """Every file of a store but its zarr.json metadata, byte for byte."""
    return {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*"))
            if p.is_file() and p.name != "zarr.json"}


def test_full_context_shards_merge_into_the_unsharded_store(tmp_path, smollm2_tokenizer, tiny_verifier_dir):
    packed = pack_conversations(tmp_path, smollm2_tokenizer)
    cfg = dict(packed=str(packed), verifier=str(tiny_verifier_dir), layers=[1, 3], device="cpu", context="full",
               max_context=128)
    quiet = dict(progress=False, log=lambda m: None)
    run_extract(ExtractConfig(**cfg, output=str(tmp_path / "full.zarr")), **quiet)
    full = FeatureStore.open(tmp_path / "full.zarr")
    # 8 conversations in 9 contexts (the one of 145 tokens is cut in two) in 7 context blocks of 128 slots
    assert (full.n_blocks, full.contexts.n_blocks, full.contexts.block_size) == (20, 7, 128)
    assert full.attrs["context"]["conversations_split"] == 1
    parts = [tmp_path / f"s{i}.zarr" for i in range(2)]
    for i, out in enumerate(parts):
        s = run_extract(ExtractConfig(**cfg, output=str(out), num_shards=2, shard_index=i), **quiet)
        assert s["complete"] and (s["context_blocks"], s["training_blocks"]) == ((4, 3)[i], 20)
        shard = FeatureStore.open(out)
        # the whole root in every shard, context blocks i, i+2, ... below
        assert np.array_equal(shard.views(), full.views())
        assert np.array_equal(shard.contexts.group["input_ids"][:], full.contexts.group["input_ids"][i::2])
        assert np.array_equal(shard.contexts.group["aux_hidden"][:], full.contexts.group["aux_hidden"][i::2])
    r = CliRunner().invoke(main, ["merge", str(parts[1]), str(parts[0]), "--output", str(tmp_path / "m.zarr")])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["contexts"]["n_blocks"] == 7
    merged = FeatureStore.open(tmp_path / "m.zarr")
    assert _files(tmp_path / "m.zarr") == _files(tmp_path / "full.zarr")  # every chunk, byte for byte
    for a, b in ((merged, full), (merged.contexts, full.contexts)):
        for name, arr in b.group.arrays():
            assert np.array_equal(a.group[name][:], arr[:]), name
        assert a.attrs["merged_from"] == [{"path": str(parts[0]), "shard_index": 0},
                                          {"path": str(parts[1]), "shard_index": 1}]
        assert {k: v for k, v in a.attrs.items() if k != "merged_from"} == b.attrs
    for i in range(full.n_blocks):
        x, y = merged.read_block(i), full.read_block(i)
        for name in ("input_ids", "loss_mask", "position_ids", "cu_seqlens", "aux_hidden", "final_hidden"):
            assert torch.equal(getattr(x, name), getattr(y, name)), (i, name)
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "m.zarr"), "--packed", str(packed)])
    assert r.exit_code == 0 and json.loads(r.output)["blocks_done"] == 20, r.output


def test_merge_refuses_full_context_shards_of_other_runs_or_unfinished(tmp_path, smollm2_tokenizer,
                                                                      tiny_verifier_dir):
    packed = pack_conversations(tmp_path, smollm2_tokenizer)
    cfg = dict(packed=str(packed), verifier=str(tiny_verifier_dir), layers=[1, 3], device="cpu", num_shards=2)
    quiet = dict(progress=False, log=lambda m: None)
    s0, s1, window, wide = (tmp_path / f"{n}.zarr" for n in ("s0", "s1", "window", "wide"))
    run_extract(ExtractConfig(**cfg, output=str(s0), shard_index=0, context="full", max_context=128), **quiet)
    run_extract(ExtractConfig(**cfg, output=str(s1), shard_index=1, context="full", max_context=128,
                              max_blocks=1), **quiet)
    run_extract(ExtractConfig(**cfg, output=str(window), shard_index=1, context="window"), **quiet)
    run_extract(ExtractConfig(**cfg, output=str(wide), shard_index=1, context="full", max_context=160), **quiet)
    with pytest.raises(InputError) as e:
        merge_stores([s0, s1], tmp_path / "m.zarr")
    assert str(e.value) == (f"{s1}: 2 context blocks not done; finish it with `peagle-data extract --resume` first")
    with pytest.raises(StoreMismatchError) as e:
        merge_stores([s0, window], tmp_path / "m.zarr")
    assert str(e.value) == (f"{window} was extracted with --context window, {s0} with --context full: shards of one "
                            "run share --context; extract the odd ones again")
    with pytest.raises(StoreMismatchError) as e:
        merge_stores([s0, wide], tmp_path / "m.zarr")
    assert str(e.value) == (f"{wide}: extracted with --max-context 160, {s0} with --max-context 128; shards of one "
                            "run share --max-context: extract the odd ones again")
    FeatureStore.open(s0, mode="r+").update_attrs(shard={**FeatureStore.open(s0).attrs["shard"], "context_blocks": 9})
    logs = []
    s = run_extract(ExtractConfig(**cfg, output=str(s1), shard_index=1, context="full", max_context=128,
                                  resume=True), progress=False, log=logs.append)
    assert s["complete"] and s["context_blocks_done_this_run"] == 2
    assert not [m for m in logs if "rewriting" in m or "again" in m], logs  # an undamaged shard: nothing repaired
    with pytest.raises(StoreMismatchError, match="4 context blocks, shard 0 of 2 of a plan of 9 context blocks "
                                                 "holds 5"):
        merge_stores([s1, s0], tmp_path / "m.zarr")
    assert not (tmp_path / "m.zarr").exists()


def test_merged_counts_of_a_weighted_mixture_are_the_unsharded_runs(tmp_path, smollm2_tokenizer):
    # Every shard reads every row and draws every weight: read, copies and sampled_out are counted
    # once in the union, not once per shard; other_shards is gone.
    mix = _three_sources(tmp_path)
    full = run_tokenize(TokenizeRun(inputs=[mix], tokenizer="smollm2-135m", output=tmp_path / "full",
                                    settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)
    shards = _shards(tmp_path, smollm2_tokenizer, [mix], "tok")
    merged = merge_tables(shards, tmp_path / "merged")
    assert full["counts"]["sources"]["reasoning"]["copies"] == 20 and full["counts"]["sampled_out"] > 0
    assert merged["counts"] == full["counts"]
    assert TokenTable.open(tmp_path / "merged").manifest["counts"] == full["counts"]
    packed = [tmp_path / f"p{i}" for i in range(2)]
    for i, out in enumerate(packed):
        run_pack(PackRun(inputs=[tmp_path / "full"], tokenizer="smollm2-135m", output=out,
                         settings=PackConfig(max_seq_len=128, tokenize=TokenizeConfig(num_shards=2, shard_index=i))),
                         tokenizer=smollm2_tokenizer)
    whole = run_pack(PackRun(inputs=[tmp_path / "full"], tokenizer="smollm2-135m", output=tmp_path / "p",
                             settings=PackConfig(max_seq_len=128)), tokenizer=smollm2_tokenizer)
    counts = merge_tables(packed, tmp_path / "merged_p")["counts"]
    assert counts["sources"] == whole["counts"]["sources"] and "other_shards" not in counts
    assert {k: counts[k] for k in ("read", "used", "rejected")} == {k: whole["counts"][k] for k in ("read", "used", "rejected")}


def test_merge_refuses_shards_that_read_different_data_and_names_other_parameters(tmp_path, smollm2_tokenizer):
    inputs = _inputs(tmp_path)
    s0 = tmp_path / "s0"
    run_tokenize(TokenizeRun(inputs=inputs, tokenizer="smollm2-135m", output=s0,
                             settings=TokenizeConfig(num_shards=2, shard_index=0)), tokenizer=smollm2_tokenizer)
    with open(inputs[0], "a") as f:  # the file changed between the shard runs (same path)
        f.write(json.dumps({"messages": [{"role": "user", "content": "New?"},
                                         {"role": "assistant", "content": "Yes."}]}) + "\n")
    s1 = tmp_path / "s1"
    run_tokenize(TokenizeRun(inputs=inputs, tokenizer="smollm2-135m", output=s1,
                             settings=TokenizeConfig(num_shards=2, shard_index=1)), tokenizer=smollm2_tokenizer)
    with pytest.raises(StoreMismatchError, match=r"the shards read different input data: read \+ other_shards is "):
        merge_tables([s0, s1], tmp_path / "m")
    assert not (tmp_path / "m").exists()
    # --num-workers does not change a shard's rows: such shards merge; --max-tokens does, and is named.
    run_tokenize(TokenizeRun(inputs=inputs, tokenizer="smollm2-135m", output=tmp_path / "w0",
                             settings=TokenizeConfig(num_shards=2, shard_index=0, num_workers=2)),
                             tokenizer=smollm2_tokenizer)
    merged = merge_tables([tmp_path / "w0", s1], tmp_path / "m")
    assert merged["counts"]["used"] == TokenTable.open(tmp_path / "m").num_rows
    run_tokenize(TokenizeRun(inputs=inputs, tokenizer="smollm2-135m", output=tmp_path / "x0",
                             settings=TokenizeConfig(num_shards=2, shard_index=0, max_tokens=99)),
                             tokenizer=smollm2_tokenizer)
    with pytest.raises(StoreMismatchError, match=r"made with other parameters than .* \(max_tokens: None vs 99\)"):
        merge_tables([tmp_path / "x0", s1], tmp_path / "m2")


def test_merge_refuses_shards_whose_source_template_changed(tmp_path, smollm2_tokenizer):
    # A mixture source's chat template edited between shard runs (same path): other masks, refused.
    from tests.peagle_data.prepare.test_mixtures import conv, write_jsonl

    write_jsonl(tmp_path / "a.jsonl", [conv(i, "a") for i in range(6)])
    template = tmp_path / "t.jinja"
    template.write_text(smollm2_tokenizer.chat_template)
    (tmp_path / "mix.yaml").write_text("sources:\n  - {name: a, path: a.jsonl, chat_template: t.jinja}\n")
    s0 = _shards(tmp_path, smollm2_tokenizer, [tmp_path / "mix.yaml"], "tok", n=2)[0]
    template.write_text(smollm2_tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> "))
    run_tokenize(TokenizeRun(inputs=[tmp_path / "mix.yaml"], tokenizer="smollm2-135m", output=tmp_path / "late1",
                             settings=TokenizeConfig(num_shards=2, shard_index=1)), tokenizer=smollm2_tokenizer)
    with pytest.raises(StoreMismatchError, match="its 'mixture' differs"):
        merge_tables([s0, tmp_path / "late1"], tmp_path / "m")
    assert TokenTable.open(s0).manifest["mixture"]["sources"][0]["chat_template_sha256"] == \
        hashlib.sha256(smollm2_tokenizer.chat_template.encode()).hexdigest()


def test_verify_accepts_the_per_turn_rows_of_a_history_rewrite(tmp_path, smollm2_tokenizer):
    from tests.peagle_data.prepare.test_runs import tokenize_history_rewrite

    tokenize_history_rewrite(tmp_path, smollm2_tokenizer)
    # rows q@1, q@3 (one source) and ok: three rows, none repeated
    assert verify_table(tmp_path / "split") == {"ok": True, "kind": "tokenized", "rows": 3, "problems": []}
