"""``peagle-data tokenize`` / ``pack`` through click's CliRunner on a tiny JSONL file."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from cli.data_prepare import pack, tokenize
from stores.tables.token_tables import TokenTable


@pytest.fixture()
def tok_name(monkeypatch, smollm2_tokenizer):
    """``--tokenizer`` value; loading it returns the session's SmolLM2 tokenizer (no reload)."""
    import runtime.model_cache

    monkeypatch.setattr(runtime.model_cache, "load_tokenizer", lambda name: smollm2_tokenizer)
    return "smollm2-135m"


@pytest.fixture()
def convs(tmp_path):
    rows = [
        {"id": "c0", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
        {"conversations": [{"from": "human", "value": "Count."},
                           {"from": "gpt", "value": " ".join(str(i) for i in range(60))}]},
        {"messages": [{"role": "user", "content": "nobody answers"}]},
        {"id": "c3", "system": "Be brief.", "conversations": [
            {"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
            {"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}]},
    ]
    path = tmp_path / "convs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{broken\n")
    return path


def invoke(cmd, args):
    result = CliRunner().invoke(cmd, [str(a) for a in args])
    return result


def test_help_lists_the_options():
    tok_help = invoke(tokenize, ["--help"]).output
    for opt in ("--tokenizer", "--output", "--chat-template", "--limit", "--format", "--strict", "--force",
                "--num-workers", "--on-history-rewrite"):
        assert opt in tok_help
    pack_help = invoke(pack, ["--help"]).output
    for opt in ("--max-seq-len", "--block-size", "--overlap", "--overlap-loss", "--chat-template", "--limit",
                "--max-windows", "--num-workers", "--on-history-rewrite"):
        assert opt in pack_help


def test_tokenize_writes_table_and_refuses_overwrite(tmp_path, convs, tok_name):
    out = tmp_path / "tok"
    result = invoke(tokenize, [convs, "--tokenizer", tok_name, "--output", out])
    assert result.exit_code == 0, result.output
    assert "read 5  used 3  rejected 2" in result.output and str(out) in result.output
    for name in ("manifest.json", "rejects.jsonl", "token_freq.npy", "part-00000.parquet"):
        assert (out / name).is_file()
    table = TokenTable.open(out)
    counts = table.manifest["counts"]
    assert counts["used"] + counts["rejected"] == counts["read"] == 5
    assert table.manifest["kind"] == "tokenized" and table.num_rows == 3
    rows = list(table.iter_rows())
    assert [r["conversation_id"] for r in rows] == ["c0", "convs:2", "c3"]  # convs.jsonl line 2
    assert sum(r["n_loss_tokens"] for r in rows) == counts["loss_tokens"] == table.token_freq().sum()
    rejects = [json.loads(line) for line in table.rejects_path.read_text().splitlines()]
    assert [r["source"] for r in rejects] == [f"{convs}:3", f"{convs}:5"]  # 1-based lines
    assert rejects[0]["reason"] == "no assistant turn" and rejects[1]["reason"].startswith("invalid JSON")

    again = invoke(tokenize, [convs, "--tokenizer", tok_name, "--output", out])
    assert again.exit_code == 2 and "already exists" in again.output
    forced = invoke(tokenize, [convs, "--tokenizer", tok_name, "--output", out, "--force"])
    assert forced.exit_code == 0, forced.output


def test_strict_exits_2_naming_file_and_row(tmp_path, convs, tok_name):
    result = invoke(tokenize, [convs, "--tokenizer", tok_name, "--output", tmp_path / "s", "--strict"])
    assert result.exit_code == 2
    assert f"file {convs}, row 3" in result.output and "no assistant turn" in result.output
    # a failed run leaves nothing behind: the rerun needs no --force, and works
    assert not (tmp_path / "s").exists()
    assert invoke(tokenize, [convs, "--tokenizer", tok_name, "--output", tmp_path / "s"]).exit_code == 0


def test_pack_raw_and_from_tokenized_agree(tmp_path, convs, tok_name):
    args = ["--tokenizer", tok_name, "--max-seq-len", 64, "--block-size", 96]
    raw = invoke(pack, [convs, *args, "--output", tmp_path / "p1"])
    assert raw.exit_code == 0, raw.output
    assert "packing efficiency" in raw.output
    assert f"packing efficiency {TokenTable.open(tmp_path / 'p1').manifest['counts']['packing_efficiency']:.4f}" \
        in raw.output
    assert invoke(tokenize, [convs, "--tokenizer", tok_name, "--output", tmp_path / "tok"]).exit_code == 0
    from_tok = invoke(pack, [tmp_path / "tok", *args, "--output", tmp_path / "p2"])
    assert from_tok.exit_code == 0, from_tok.output

    t1, t2 = TokenTable.open(tmp_path / "p1"), TokenTable.open(tmp_path / "p2")
    c = t1.manifest["counts"]
    assert c["used"] + c["rejected"] == c["read"] == 5
    assert c["windows"] > 3  # the long conversation was cut
    assert c["packing_efficiency"] == pytest.approx(c["tokens"] / (c["n_blocks"] * 96))
    assert t1.read_all().to_pylist() == t2.read_all().to_pylist()  # deterministic, same blocks
    segments = []
    for row in t1.iter_rows():
        cu = row["cu_seqlens"]
        assert cu[0] == 0 and cu[-1] == row["n_tokens"] <= 96
        for a, b in zip(cu[:-1], cu[1:]):
            assert b - a <= 64 and row["position_ids"][a:b].tolist() == list(range(b - a))
        segments += row["segment_ids"]
    assert len(segments) == len(set(segments)) == c["windows"]
    assert np.array_equal(t1.token_freq(), t2.token_freq()) and t1.token_freq().sum() == c["loss_tokens"]


@pytest.mark.slow
def test_sharegpt_2000_packing_efficiency(tmp_path, tok_name):
    """docs/design.md §5 goal: efficiency >= 0.99 on 2,000 ShareGPT conversations at --max-seq-len 2048
    (about 100 s on 2 CPU cores; slow: runs in CI and with PEAGLE_SLOW_TESTS=1)."""
    result = invoke(pack, ["sharegpt", "--tokenizer", tok_name, "--limit", 2000, "--max-seq-len", 2048,
                           "--output", tmp_path / "p"])
    assert result.exit_code == 0, result.output
    counts = TokenTable.open(tmp_path / "p").manifest["counts"]
    assert counts["packing_efficiency"] >= 0.99 and "packing efficiency" in result.output


def test_not_parquet_is_an_input_error_exit_2(tmp_path, tok_name):
    fake = tmp_path / "fake.parquet"
    fake.write_text("this is a text file\n")
    result = invoke(tokenize, [fake, "--tokenizer", tok_name, "--output", tmp_path / "o"])
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    assert f"file {fake}: not a readable Parquet file" in result.output
    assert not (tmp_path / "o").exists()
    bad_json = tmp_path / "fake.json"
    bad_json.write_text("this is a text file\n")
    result = invoke(pack, [bad_json, "--tokenizer", tok_name, "--output", tmp_path / "o"])
    assert result.exit_code == 2 and f"file {bad_json}: not a readable JSON file" in result.output


def test_unfinished_output_as_pack_input(tmp_path, tok_name):
    half = tmp_path / "half"
    half.mkdir()
    (half / "part-00000.parquet").write_bytes(b"")
    (half / "rejects.jsonl").write_text("")
    result = invoke(pack, [half, "--tokenizer", tok_name, "--output", tmp_path / "p"])
    assert result.exit_code == 2 and "an unfinished peagle output (no manifest.json)" in result.output


def test_pack_limit_on_a_tokenize_output(tmp_path, convs, tok_name):
    assert invoke(tokenize, [convs, "--tokenizer", tok_name, "--output", tmp_path / "tok"]).exit_code == 0
    result = invoke(pack, [tmp_path / "tok", "--tokenizer", tok_name, "--limit", 1, "--output", tmp_path / "p"])
    assert result.exit_code == 0, result.output
    assert "read 1  used 1" in result.output
    assert TokenTable.open(tmp_path / "p").manifest["counts"]["read"] == 1


def _assert_useless(result, out):
    assert result.exit_code == 1, result.output
    assert "WARNING: the output holds no training data" in result.stderr
    assert (out / "manifest.json").is_file() and (out / "rejects.jsonl").is_file()


def test_nothing_used_warns_and_exits_1(tmp_path, convs, tok_name):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "e"
    result = invoke(tokenize, [empty, "--tokenizer", tok_name, "--output", out])
    _assert_useless(result, out)
    assert "0 of 0 input rows used" in result.stderr

    openai = tmp_path / "openai.jsonl"
    openai.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "Yo"}]}) + "\n")
    result = invoke(pack, [openai, "--tokenizer", tok_name, "--format", "sharegpt", "--output", tmp_path / "f"])
    _assert_useless(result, tmp_path / "f")
    assert "0 of 1 input rows used" in result.stderr and "missing field" in result.stderr

    unknown = tmp_path / "unknown.jsonl"
    unknown.write_text('{"foo": 1}\n{"foo": 2}\n')
    result = invoke(pack, [unknown, "--tokenizer", tok_name, "--output", tmp_path / "u"])
    _assert_useless(result, tmp_path / "u")
    assert (f"(rejected: {{'unknown format': 2}}); the first reject: {unknown}:1: unknown format: the row has "
            "neither 'messages' nor 'conversations'. See") in result.stderr

    result = invoke(pack, [convs, "--tokenizer", tok_name, "--max-seq-len", 5, "--output", tmp_path / "short"])
    _assert_useless(result, tmp_path / "short")
    counts = TokenTable.open(tmp_path / "short").manifest["counts"]
    assert counts["used"] == 0 and counts["rejected"] == counts["read"] == 5 and counts["n_blocks"] == 0


def test_broken_chat_template_exits_2_naming_the_file(tmp_path, convs, tok_name):
    template = tmp_path / "broken.jinja"
    template.write_text("{% if messages %}{{ messages[0].content }")
    result = invoke(tokenize, [convs, "--tokenizer", tok_name, "--chat-template", template,
                               "--output", tmp_path / "o"])
    assert result.exit_code == 2
    assert f"--chat-template {template} is not a valid Jinja template" in result.output
    assert "template error" not in result.output and not (tmp_path / "o").exists()


def test_pack_of_a_tokenize_output_warns_about_ignored_tokenize_options(tmp_path, convs, tok_name):
    assert invoke(tokenize, [convs, "--tokenizer", tok_name, "--output", tmp_path / "tok"]).exit_code == 0
    args = [tmp_path / "tok", "--tokenizer", tok_name, "--max-seq-len", 64]
    result = invoke(pack, [*args, "--output", tmp_path / "p1", "--format", "sharegpt", "--num-workers", 3,
                           "--on-history-rewrite", "split", "--limit", 2])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    # --on-history-rewrite split is its default and --limit applies: neither is named
    assert warnings == ["WARNING: ignoring --format sharegpt, --num-workers 3: the INPUT is a tokenize output, "
                        "already tokenized (these options only apply to raw conversations)"]
    assert "WARNING" not in result.stdout and "read 2  used 2" in result.stdout
    for extra in ([], ["--format", "auto", "--num-workers", 1]):  # nothing set, or set to the defaults
        result = invoke(pack, [*args, "--output", tmp_path / f"p{len(extra)}x", *extra])
        assert result.exit_code == 0 and "WARNING" not in result.stderr, result.output
    # a value the user did not give (here a context default_map) is not named either
    result = CliRunner().invoke(pack, [str(a) for a in [*args, "--output", tmp_path / "pdm"]],
                                default_map={"num_workers": 3})
    assert result.exit_code == 0 and "WARNING" not in result.stderr, result.output
    raw = invoke(pack, [convs, "--tokenizer", tok_name, "--max-seq-len", 64, "--output", tmp_path / "raw",
                        "--on-history-rewrite", "reject"])  # raw conversations: the option applies
    assert raw.exit_code == 0 and "WARNING" not in raw.stderr, raw.output


def test_the_summary_explains_its_counts_and_points_to_rejects(tmp_path, convs, tok_name):
    out = tmp_path / "p"
    result = invoke(pack, [convs, "--tokenizer", tok_name, "--output", out, "--max-seq-len", 40, "--overlap", 0.5,
                           "--max-windows", 2])
    assert result.exit_code == 0, result.output
    c = TokenTable.open(out).manifest["counts"]
    assert c["windows_capped"] >= 1  # the 60-number conversation has more than 2 windows
    lines = result.stdout.splitlines()
    assert lines[0] == "read 5  used 3  rejected 2"
    assert lines[1] == (f"  rejected by reason: invalid JSON 1, no assistant turn 1; each rejected row is a line of "
                        f"{out}/rejects.jsonl (its FILE:N source and the reason)")
    assert lines[3] == (f"windows {c['windows']}  (dropped {c['windows_dropped']}: windows with no supervised token "
                        "left, e.g. the overlap of a long conversation with --overlap-loss skip; capped "
                        f"{c['windows_capped']}: windows after the first --max-windows of a conversation)")
    assert lines[4].startswith(f"blocks {c['n_blocks']} x 40 tokens  packing efficiency ")


def test_dropped_content_kept_is_summarised(tmp_path, tok_name):
    row = {"messages": [{"role": "user", "content": "Weather?"},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
                        {"role": "tool", "content": "3 C"}, {"role": "assistant", "content": "3 degrees."}]}
    path = tmp_path / "calls.jsonl"
    path.write_text(json.dumps(row) + "\n")
    rejected = invoke(tokenize, [path, "--tokenizer", tok_name, "--output", tmp_path / "r"])
    assert rejected.exit_code == 1 and "template drops tool_calls 1" in rejected.stdout
    kept = invoke(tokenize, [path, "--tokenizer", tok_name, "--output", tmp_path / "k", "--on-dropped-content", "keep"])
    assert kept.exit_code == 0, kept.output
    assert ("  kept without content the chat template drops (--on-dropped-content keep): 1 conversations "
            "(tool_calls 1)") in kept.stdout


def test_special_token_text_in_a_reply_is_a_visible_decision(tmp_path, tok_name):
    """Issue 33, kind 7: "read 3 used 3 rejected 0" for replies that write out <|im_end|>."""
    rows = [{"messages": [{"role": "user", "content": f"Q{k}"},
                          {"role": "assistant", "content": f"A turn ends with <|im_end|> ({k})."}]} for k in range(3)]
    path = tmp_path / "chatml.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rejected = invoke(tokenize, [path, "--tokenizer", tok_name, "--output", tmp_path / "r"])
    assert rejected.exit_code == 1
    assert rejected.stdout.splitlines()[:2] == [
        "read 3  used 0  rejected 3",
        f"  rejected by reason: special-token text in a reply 3; each rejected row is a line of {tmp_path / 'r'}/"
        "rejects.jsonl (its FILE:N source and the reason)"]
    kept = invoke(tokenize, [path, "--tokenizer", tok_name, "--output", tmp_path / "k", "--on-special-token-text",
                             "keep"])
    assert kept.exit_code == 0, kept.output
    assert kept.stdout.splitlines()[:2] == [
        "read 3  used 3  rejected 0",
        "  kept with special-token text in a supervised reply, read as control ids (--on-special-token-text keep): "
        "3 conversations"]


def test_inspect_prints_json(tmp_path, convs, tok_name):
    from cli.data import main

    out = tmp_path / "tok"
    assert invoke(tokenize, [convs, "--tokenizer", tok_name, "--output", out]).exit_code == 0
    result = invoke(main, ["inspect", out])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert (info["kind"], info["rows"], info["path"]) == ("tokenized", 3, str(out))
    assert info["counts"]["read"] == 5 and info["counts"]["rejected_by_reason"] == {"invalid JSON": 1,
                                                                                    "no assistant turn": 1}


def test_a_config_file_is_the_options_and_print_config_repeats_the_run(tmp_path, convs, tok_name):
    """``--config`` supplies the INPUT argument and options; a tokenize option it sets to a non-default
    value counts as given (pack of a tokenize output names it), the defaults a --print-config file
    repeats do not; the command line wins over the file."""
    import yaml

    assert invoke(tokenize, [convs, "--tokenizer", tok_name, "--output", tmp_path / "tok"]).exit_code == 0
    cfg = tmp_path / "pack.yaml"
    cfg.write_text(yaml.safe_dump({"inputs": [str(tmp_path / "tok")], "tokenizer": tok_name, "max-seq-len": 64,
                                   "num_workers": 3, "output": str(tmp_path / "p1")}))
    result = invoke(pack, ["--config", cfg, "--max-seq-len", 32])
    assert result.exit_code == 0, result.output
    assert "WARNING: ignoring --num-workers 3" in result.stderr
    assert TokenTable.open(tmp_path / "p1").manifest["parameters"]["max_seq_len"] == 32  # the command line
    printed = invoke(pack, [tmp_path / "tok", "--tokenizer", tok_name, "--max-seq-len", 64, "--output",
                            tmp_path / "p2", "--print-config"])
    assert printed.exit_code == 0 and not (tmp_path / "p2").exists()  # printed, not run
    assert yaml.safe_load(printed.stdout)["inputs"] == [str(tmp_path / "tok")]
    (tmp_path / "again.yaml").write_text(printed.stdout)
    again = invoke(pack, ["--config", tmp_path / "again.yaml"])
    assert again.exit_code == 0 and "WARNING" not in again.stderr, again.output
    first = TokenTable.open(tmp_path / "p2").manifest["parameters"]
    assert first["max_seq_len"] == 64 and first["tokenize"]["num_workers"] == 1
