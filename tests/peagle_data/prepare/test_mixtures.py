"""Mixture files: parsing, deterministic weighted sampling, per-source counts and rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from peagle_data.prepare.mixtures import load_mixture, sample_copies
from peagle_data.prepare.config import PackConfig, PackRun, TokenizeConfig, TokenizeRun
from peagle_data.prepare.pack import run_pack
from peagle_data.prepare.tokenizing import run_tokenize
from peagle_data.inspect.stats import collect_stats
from stores.errors import InputError
from stores.tables.token_tables import TokenTable


def conv(i, prefix="q", answer=None):
    return {"id": f"{prefix}{i}", "messages": [{"role": "user", "content": f"{prefix} question {i}"},
                                               {"role": "assistant", "content": answer or f"answer {i} " * (1 + i % 5)}]}


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_yaml_and_toml_give_the_same_mixture(tmp_path):
    (tmp_path / "t.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (tmp_path / "m.yaml").write_text("seed: 7\nsources:\n  - {name: a, path: a.jsonl, weight: 0.5}\n"
                                     "  - {name: b, path: [b.jsonl, sharegpt], limit: 10, chat_template: t.jinja}\n")
    (tmp_path / "m.toml").write_text('seed = 7\n[[sources]]\nname = "a"\npath = "a.jsonl"\nweight = 0.5\n'
                                     '[[sources]]\nname = "b"\npath = ["b.jsonl", "sharegpt"]\nlimit = 10\n'
                                     'chat_template = "t.jinja"\n')
    y, t = load_mixture(tmp_path / "m.yaml"), load_mixture(tmp_path / "m.toml")
    assert y.sources == t.sources and y.seed == t.seed == 7
    assert y.sources[0].inputs == (str(tmp_path / "a.jsonl"),) and y.sources[1].inputs[1] == "sharegpt"
    assert y.sources[1].chat_template == str(tmp_path / "t.jinja") and y.sources[1].limit == 10


@pytest.mark.parametrize("body, message", [
    ("sources: []", "non-empty 'sources' list"),
    ("sources:\n  - {name: a, path: x.jsonl, wieght: 2}", "unknown keys ['wieght']"),
    ("sources:\n  - {name: a, path: x.jsonl}\n  - {name: a, path: y.jsonl}", "repeated: ['a']"),
    ("sources:\n  - {name: a, path: x.jsonl, weight: -1}", "'weight' must be a number >= 0"),
    ("sources:\n  - {name: a, path: x.jsonl, limit: 0}", "'limit' must be an integer >= 1"),
    ("sources:\n  - {name: a}", "'path' must be"),
    ("sources:\n  - {name: a, path: x.jsonl, chat_template: nope.jinja}", "is not a file"),
    ("sources: [", "cannot read it"),
])
def test_bad_mixture_files_name_the_problem(tmp_path, body, message):
    (tmp_path / "m.yaml").write_text(body)
    with pytest.raises(InputError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_mixture(tmp_path / "m.yaml")


def test_weighted_sampling_is_deterministic_and_proportional():
    draws = np.array([sample_copies(0, "src", r, 0.3) for r in range(1, 20001)])
    assert set(np.unique(draws)) == {0, 1} and abs(draws.mean() - 0.3) < 0.015
    again = np.array([sample_copies(0, "src", r, 0.3) for r in range(1, 20001)])
    assert np.array_equal(draws, again)
    other_seed = np.array([sample_copies(1, "src", r, 0.3) for r in range(1, 20001)])
    other_name = np.array([sample_copies(0, "other", r, 0.3) for r in range(1, 20001)])
    assert not np.array_equal(draws, other_seed) and not np.array_equal(draws, other_name)
    up = np.array([sample_copies(0, "src", r, 2.25) for r in range(1, 20001)])
    assert set(np.unique(up)) == {2, 3} and abs(up.mean() - 2.25) < 0.015
    assert {sample_copies(0, "s", r, 2.0) for r in range(1, 100)} == {2}
    assert {sample_copies(0, "s", r, 0.0) for r in range(1, 100)} == {0}


def _three_sources(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [conv(i, "a") for i in range(40)])
    b = write_jsonl(tmp_path / "b.jsonl", [conv(i, "b") for i in range(30)] + [conv(3, "a")] + ["{bad json"])
    c = write_jsonl(tmp_path / "c.jsonl", [conv(i, "c") for i in range(50)])
    (tmp_path / "mix.yaml").write_text(
        "seed: 3\nsources:\n"
        f"  - {{name: chat, path: {a.name}, weight: 0.5}}\n"
        f"  - {{name: tools, path: {b.name}}}\n"
        f"  - {{name: reasoning, path: {c.name}, limit: 20, weight: 2}}\n")
    return tmp_path / "mix.yaml"


def test_three_source_mixture_rows_counts_and_determinism(tmp_path, smollm2_tokenizer):
    mix = _three_sources(tmp_path)
    summary = run_tokenize(TokenizeRun(inputs=[mix], tokenizer="smollm2-135m", output=tmp_path / "t1",
                                       settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)
    run_tokenize(TokenizeRun(inputs=[mix], tokenizer="smollm2-135m", output=tmp_path / "t2",
                             settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)
    t1, t2 = TokenTable.open(tmp_path / "t1"), TokenTable.open(tmp_path / "t2")
    assert t1.read_all().equals(t2.read_all())  # deterministic for the seed
    rows = t1.read_all(["conversation_id", "dataset", "source"]).to_pylist()
    chat_rows = [int(r["conversation_id"][1:]) for r in rows if r["dataset"] == "chat"]
    expect_chat = [i for i in range(40) if sample_copies(3, "chat", i + 1, 0.5) == 1]
    assert chat_rows == expect_chat
    reasoning = [r["conversation_id"] for r in rows if r["dataset"] == "reasoning"]
    assert reasoning == [x for i in range(20) for x in (f"c{i}", f"c{i}*2")]
    src = summary["counts"]["sources"]
    # tools: 30 rows + a bad row + chat's row a3, which the chat weight did not draw: kept from tools
    # (not a duplicate of a row that is not in the output)
    assert sample_copies(3, "chat", 4, 0.5) == 0
    assert src["tools"] == {"read": 32, "used": 31, "rejected": 1, "duplicates": 0, "sampled_out": 0, "copies": 0,
                            "other_shards": 0}
    assert src["reasoning"]["read"] == 20 and src["reasoning"]["copies"] == 20 and src["reasoning"]["used"] == 40
    assert src["chat"]["used"] == len(expect_chat) and src["chat"]["sampled_out"] == 40 - len(expect_chat)
    for c in src.values():
        assert c["read"] - c["sampled_out"] + c["copies"] - c["other_shards"] == c["used"] + c["rejected"]
    m = t1.manifest
    assert m["mixture"]["seed"] == 3 and [s["name"] for s in m["mixture"]["sources"]] == ["chat", "tools", "reasoning"]
    # its id is renamed: ids are unique over every row the run reads, in all sources
    assert [r for r in rows if r["conversation_id"] in ("a3", "a3~2")] == [
        {"conversation_id": "a3~2", "dataset": "tools", "source": f"{tmp_path / 'b.jsonl'}:31"}]
    assert summary["counts"]["duplicate_ids_renamed"] == 1
    assert "duplicate_of" not in (tmp_path / "t1" / "rejects.jsonl").read_text()
    stats = collect_stats(tmp_path / "t1")
    assert {s["source"]: s["rows"] for s in stats["sources"]} == {"chat": len(expect_chat), "tools": 31,
                                                                  "reasoning": 40}


def test_pack_of_a_mixture_records_each_window_source(tmp_path, smollm2_tokenizer):
    mix = _three_sources(tmp_path)
    p = run_pack(PackRun(inputs=[mix], tokenizer="smollm2-135m", output=tmp_path / "p",
                         settings=PackConfig(max_seq_len=64)), tokenizer=smollm2_tokenizer)
    table = TokenTable.open(tmp_path / "p")
    rows = table.read_all(["segment_ids", "segment_datasets", "segment_loss_tokens", "loss_mask", "cu_seqlens"])
    for r in rows.to_pylist():
        assert len(r["segment_datasets"]) == len(r["segment_ids"]) == len(r["segment_loss_tokens"])
        cu = r["cu_seqlens"]
        assert r["segment_loss_tokens"] == [sum(r["loss_mask"][cu[k]:cu[k + 1]]) for k in range(len(cu) - 1)]
    stats = collect_stats(tmp_path / "p")
    by = {s["source"]: s for s in stats["sources"]}
    assert sum(s["loss_tokens"] for s in by.values()) == p["counts"]["loss_tokens"]
    assert by["reasoning"]["rows"] == 40 and p["counts"]["sources"]["reasoning"]["used"] == 40
    # the tokenize output of the same mixture, packed, gives the same blocks
    run_tokenize(TokenizeRun(inputs=[mix], tokenizer="smollm2-135m", output=tmp_path / "t", settings=TokenizeConfig()),
                             tokenizer=smollm2_tokenizer)
    run_pack(PackRun(inputs=[tmp_path / "t"], tokenizer="smollm2-135m", output=tmp_path / "p2",
                     settings=PackConfig(max_seq_len=64)), tokenizer=smollm2_tokenizer)
    cols = ["input_ids", "loss_mask", "segment_ids", "segment_datasets"]
    assert TokenTable.open(tmp_path / "p2").read_all(cols).equals(table.read_all(cols))
    p2 = TokenTable.open(tmp_path / "p2").manifest
    assert p2["mixture"] == table.manifest["mixture"]
    for name, c in p2["counts"]["sources"].items():  # per source: the tokenize output's conversations
        assert c["used"] == p["counts"]["sources"][name]["used"] and c["read"] == c["used"] + c["rejected"]


def test_mixture_must_be_the_only_input_and_takes_no_limit(tmp_path, smollm2_tokenizer):
    mix = _three_sources(tmp_path)
    with pytest.raises(InputError, match="only INPUT"):
        run_tokenize(TokenizeRun(inputs=[mix, tmp_path / "a.jsonl"], tokenizer="smollm2-135m", output=tmp_path / "o",
                                 settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)
    with pytest.raises(InputError, match="give each source a 'limit'"):
        run_tokenize(TokenizeRun(inputs=[mix], tokenizer="smollm2-135m", output=tmp_path / "o",
                                 settings=TokenizeConfig(limit=5)), tokenizer=smollm2_tokenizer)
    assert not (tmp_path / "o").exists()


def test_cli_pack_of_a_mixture_prints_each_source(tmp_path):
    from click.testing import CliRunner

    from cli.data import main

    mix = _three_sources(tmp_path)
    r = CliRunner().invoke(main, ["pack", str(mix), "--tokenizer", "smollm2-135m", "--output", str(tmp_path / "p"),
                                  "--max-seq-len", "64", "--num-shards", "2", "--shard-index", "1"])
    assert r.exit_code == 0, r.output
    counts = TokenTable.open(tmp_path / "p").manifest["counts"]
    tools = counts["sources"]["tools"]
    assert (f"  source tools: read 32  used {tools['used']}  rejected {tools['rejected']}  duplicates "
            f"{tools['duplicates']}  sampled out 0  copies 0  in other shards {tools['other_shards']}") in r.output
    assert 0 < tools["other_shards"] < 32 and f"{counts['other_shards']} input items belong to other shards" in r.output


def test_cli_pack_of_a_mixtures_tokenize_output_prints_each_source(tmp_path):
    # pack of a tokenize output draws no weights: its per-source counts have no sampled_out/copies
    # (the summary indexed them and pack ended in a KeyError traceback after writing its output).
    from click.testing import CliRunner

    from cli.data import main

    mix = _three_sources(tmp_path)
    r = CliRunner().invoke(main, ["tokenize", str(mix), "--tokenizer", "smollm2-135m", "--output", str(tmp_path / "t")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["pack", str(tmp_path / "t"), "--tokenizer", "smollm2-135m", "--output",
                                  str(tmp_path / "p"), "--max-seq-len", "64"])
    assert r.exit_code == 0, r.output
    tools = TokenTable.open(tmp_path / "p").manifest["counts"]["sources"]["tools"]
    assert tools["read"] == 31 and "sampled_out" not in tools
    assert (f"  source tools: read 31  used {tools['used']}  rejected {tools['rejected']}  duplicates "
            f"{tools['duplicates']}\n") in r.output


def test_a_duplicate_is_only_ever_of_a_drawn_copy(tmp_path, smollm2_tokenizer):
    # The same conversations in several sources: a later source's row is a duplicate only of a copy an
    # earlier source's weight drew (copy k of copy k); a row the earlier weight did not draw is kept.
    drawn = [i for i in range(12) if sample_copies(0, "half", i + 1, 0.5) == 1]
    missed = [i for i in range(12) if sample_copies(0, "half", i + 1, 0.5) == 0]
    assert drawn and missed
    a = write_jsonl(tmp_path / "a.jsonl", [conv(i, "a") for i in range(12)])
    b = write_jsonl(tmp_path / "b.jsonl", [conv(drawn[0], "a"), conv(missed[0], "a")])
    c = write_jsonl(tmp_path / "c.jsonl", [conv(drawn[1], "a")])
    (tmp_path / "mix.yaml").write_text("sources:\n  - {name: half, path: a.jsonl, weight: 0.5}\n"
                                       "  - {name: again, path: b.jsonl}\n  - {name: twice, path: c.jsonl, weight: 2}\n")
    summary = run_tokenize(TokenizeRun(inputs=[tmp_path / "mix.yaml"], tokenizer="smollm2-135m", output=tmp_path / "t",
                                       settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)
    rows = TokenTable.open(tmp_path / "t").read_all(["conversation_id", "dataset", "source"]).to_pylist()
    assert [(r["dataset"], r["source"]) for r in rows if r["dataset"] != "half"] == [
        ("again", f"{b}:2"), ("twice", f"{c}:1*2")]  # the missed row once, the drawn one's second copy
    rejects = [json.loads(x) for x in (tmp_path / "t" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["source"], r["duplicate_of"]) for r in rejects] == [
        (f"{b}:1", f"{a}:{drawn[0] + 1}"), (f"{c}:1", f"{a}:{drawn[1] + 1}")]
    src = summary["counts"]["sources"]
    assert (src["again"]["used"], src["again"]["duplicates"]) == (1, 1)
    assert (src["twice"]["used"], src["twice"]["duplicates"], src["twice"]["copies"]) == (1, 1, 1)
    for n in range(3):  # shards: the same verdicts
        run_tokenize(TokenizeRun(inputs=[tmp_path / "mix.yaml"], tokenizer="smollm2-135m", output=tmp_path / f"s{n}",
                                 settings=TokenizeConfig(num_shards=3, shard_index=n)), tokenizer=smollm2_tokenizer)
    union = sorted(r["source"] for n in range(3) for r in TokenTable.open(tmp_path / f"s{n}").read_all(
        ["source"]).to_pylist())
    assert union == sorted(r["source"] for r in rows)


def test_an_id_of_two_sources_names_one_conversation(tmp_path, smollm2_tokenizer):
    """Two sources that use one id for other conversations (two dumps of one corpus): the second is
    renamed ``~2``, so every window id of the packed table, and every row of its conversations sub-table
    (which full-context extraction looks windows up in), names one conversation."""
    write_jsonl(tmp_path / "a.jsonl", [conv(i, "x") for i in range(3)])
    write_jsonl(tmp_path / "b.jsonl", [conv(i, "x", answer=f"other answer {i} " * 3) for i in range(2)])
    (tmp_path / "mix.yaml").write_text("sources:\n  - {name: a, path: a.jsonl}\n  - {name: b, path: b.jsonl}\n")
    p = run_pack(PackRun(inputs=[tmp_path / "mix.yaml"], tokenizer="smollm2-135m", output=tmp_path / "p",
                         settings=PackConfig(max_seq_len=64)), tokenizer=smollm2_tokenizer)
    assert p["counts"]["duplicate_ids_renamed"] == 2
    sub = TokenTable.open(tmp_path / "p").conversations().read_all(["conversation_id", "dataset"]).to_pylist()
    assert sorted((r["conversation_id"], r["dataset"]) for r in sub) == [
        ("x0", "a"), ("x0~2", "b"), ("x1", "a"), ("x1~2", "b"), ("x2", "a")]
    segments = [s for r in TokenTable.open(tmp_path / "p").read_all(["segment_ids"]).to_pylist() for s in r["segment_ids"]]
    assert sorted(segments) == ["x0#0", "x0~2#0", "x1#0", "x1~2#0", "x2#0"]
