"""Sharded tokenize/pack: deterministic shards whose union is the unsharded run."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from peagle_data.prepare.config import PackConfig, PackRun, TokenizeConfig, TokenizeRun
from peagle_data.prepare.pack import run_pack
from peagle_data.prepare.tokenizing import run_tokenize
from peagle_data.prepare.shards import check_shard
from stores.tables.token_tables import TokenTable

from tests.peagle_data.prepare.test_mixtures import _three_sources, conv, write_jsonl


def _inputs(tmp_path):
    rows = [conv(i, "s", answer=("long answer " * (i % 23) * 9) or None) for i in range(60)]
    rows += [conv(5, "s"), "{bad", conv(7, "s")]  # two duplicates and a bad row
    a = write_jsonl(tmp_path / "a.jsonl", rows)
    b = write_jsonl(tmp_path / "b.jsonl", [conv(i, "t") for i in range(25)] + [conv(9, "s")])
    return [a, b]


def _tok_rows(path):
    t = TokenTable.open(path).read_all(["source", "conversation_id", "input_ids", "loss_mask", "n_loss_tokens"])
    return Counter((r["source"], r["conversation_id"], tuple(r["input_ids"]), tuple(r["loss_mask"]))
                   for r in t.to_pylist())


def _windows(path):
    """(segment id, tokens, supervised tokens) of every packed window."""
    out = Counter()
    for r in TokenTable.open(path).read_all(["segment_ids", "cu_seqlens", "input_ids", "loss_mask"]).to_pylist():
        cu = r["cu_seqlens"]
        for k, sid in enumerate(r["segment_ids"]):
            out[(sid, sum(r["loss_mask"][cu[k]:cu[k + 1]]))] += 1
    return out


def _rejects(path):
    return sorted(json.loads(x)["source"] for x in (path / "rejects.jsonl").read_text().splitlines())


@pytest.mark.parametrize("mixture", [False, True])
def test_tokenize_shards_union_equals_the_unsharded_run(tmp_path, smollm2_tokenizer, mixture):
    inputs = [_three_sources(tmp_path)] if mixture else _inputs(tmp_path)
    full = run_tokenize(TokenizeRun(inputs=inputs, tokenizer="smollm2-135m", output=tmp_path / "full",
                                    settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)
    union, rejects, counts = Counter(), [], Counter()
    for i in range(3):
        s = run_tokenize(TokenizeRun(inputs=inputs, tokenizer="smollm2-135m", output=tmp_path / f"s{i}",
                                     settings=TokenizeConfig(num_shards=3, shard_index=i)),
                                     tokenizer=smollm2_tokenizer)
        part = _tok_rows(tmp_path / f"s{i}")
        assert part and not set(part) & set(union)  # disjoint, none empty
        union += part
        rejects += _rejects(tmp_path / f"s{i}")
        counts.update({k: s["counts"].get(k, 0) for k in ("used", "rejected", "duplicates", "tokens", "loss_tokens")})
        assert TokenTable.open(tmp_path / f"s{i}").manifest["shard"] == {"num_shards": 3, "shard_index": i}
    assert union == _tok_rows(tmp_path / "full")
    assert sorted(rejects) == _rejects(tmp_path / "full")
    assert all(counts[k] == full["counts"].get(k, 0) for k in counts)
    again = run_tokenize(TokenizeRun(inputs=inputs, tokenizer="smollm2-135m", output=tmp_path / "again",
                                     settings=TokenizeConfig(num_shards=3, shard_index=1)),
                                     tokenizer=smollm2_tokenizer)
    assert TokenTable.open(tmp_path / "again").read_all().equals(TokenTable.open(tmp_path / "s1").read_all())
    assert again["counts"]["used"] + again["counts"]["rejected"] == again["counts"]["read"]


def test_pack_shards_of_raw_inputs_and_of_a_tokenize_output(tmp_path, smollm2_tokenizer):
    inputs = _inputs(tmp_path)
    cfg = dict(max_seq_len=128, overlap=0.5)
    full = run_pack(PackRun(inputs=inputs, tokenizer="smollm2-135m", output=tmp_path / "full",
                            settings=PackConfig(**cfg)), tokenizer=smollm2_tokenizer)
    run_tokenize(TokenizeRun(inputs=inputs, tokenizer="smollm2-135m", output=tmp_path / "tok",
                             settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)
    for kind, src in (("raw", inputs), ("table", [tmp_path / "tok"])):
        union, loss = Counter(), 0
        for i in range(2):
            out = tmp_path / f"{kind}{i}"
            s = run_pack(PackRun(inputs=src, tokenizer="smollm2-135m", output=out,
                                 settings=PackConfig(**cfg, tokenize=TokenizeConfig(num_shards=2, shard_index=i))),
                                 tokenizer=smollm2_tokenizer)
            union += _windows(out)
            loss += s["counts"]["loss_tokens"]
        assert union == _windows(tmp_path / "full"), kind
        assert loss == full["counts"]["loss_tokens"]


def test_bad_shard_options():
    check_shard(1, 0)
    with pytest.raises(ValueError, match="--shard-index must be in \\[0, 2\\]"):
        TokenizeConfig(num_shards=3, shard_index=3)
    with pytest.raises(ValueError, match="--num-shards must be >= 1"):
        TokenizeConfig(num_shards=0)
    from peagle_data.extract.config import ExtractConfig

    for bad, match in (({"num_shards": 3, "shard_index": 3}, "--shard-index must be in \\[0, 2\\]"),
                       ({"num_shards": 0}, "--num-shards must be >= 1")):  # the same check as tokenize's
        with pytest.raises(ValueError, match=match):
            ExtractConfig(packed="p", verifier="v", output="o", **bad)
