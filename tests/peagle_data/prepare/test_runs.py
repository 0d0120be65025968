"""run_tokenize / run_pack end to end: bad rows, per-turn rows, workers, packing round trips, stale
partials of killed runs, ignored tokenize options."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from peagle_data.prepare.config import PackConfig, PackRun, TokenizeConfig, TokenizeRun
from peagle_data.prepare.pack import run_pack
from peagle_data.prepare.tokenizing import run_tokenize
from stores.errors import InputError
from stores.staging import _host_tag
from stores.tables.token_tables import TokenTable
from tests.peagle_data.chat.test_template_families import QWEN3, qwen3_tok  # noqa: F401 - a fixture
from tests.stores.test_staging import dead_pid, make_staging

REPO = Path(__file__).resolve().parents[3]

OK = {"id": "ok", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}

BAD_ROWS = [  # comments: the 1-based line number in bad.jsonl
    OK,                                                                                     # 1 used
    {"conversations": []},                                                                  # 2 empty
    {"conversations": [{"from": "gpt", "value": "Welcome"}, {"from": "human", "value": "a"},
                       {"from": "gpt", "value": "b"}]},                                     # 3 used, 1 dropped
    {"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]},   # 4 unknown role
    {"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"},
                       {"from": "gpt", "value": "c"}]},                                     # 5 used, merged
    {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},                # 6 no content
    b"{not json\n",                                                                         # 7 invalid JSON
    b'{"messages": [{"role": "user", "content": "\xff"}]}\n',                               # 8 invalid UTF-8
    {"id": "e", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
                             {"role": "user", "content": "r"}, {"role": "assistant", "content": "s"}]},  # 9 used
    {"messages": [{"role": "user", "content": "nobody answers"}]},                         # 10 no assistant
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},  # 11 only empty
    {"conversations": [{"from": "gpt", "value": "Welcome"}, {"from": "human", "value": "a"}]},  # 12 leading
    {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]},  # 13 null
]


def distinct_ok_rows(n):
    """``n`` usable rows of different content (equal rows would be rejected as duplicates)."""
    return [dict(OK, messages=[{"role": "user", "content": f"Hi {i}"}, OK["messages"][1]]) for i in range(n)]


def write_rows(path, rows):
    with path.open("wb") as f:
        for row in rows:
            f.write(row if isinstance(row, bytes) else (json.dumps(row) + "\n").encode())
    return path


def rejects_of(directory):
    return [json.loads(line) for line in (directory / "rejects.jsonl").read_text().splitlines()]


def test_bad_rows_nothing_lost(tmp_path, smollm2_tokenizer):
    src = write_rows(tmp_path / "bad.jsonl", BAD_ROWS)
    summary = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "tok",
                                       settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)
    c = summary["counts"]
    assert (c["read"], c["used"], c["rejected"]) == (13, 4, 9)
    assert c["dropped_leading_assistant_turns"] == 1 and c["merged_user_turns"] == 1
    assert c["empty_assistant_turns"] == 1
    rejects = rejects_of(tmp_path / "tok")
    # sources are file:LINE, counted from 1 like peagle-eval and editors
    assert [r["source"] for r in rejects] == [f"{src}:{i}" for i in (2, 4, 6, 7, 8, 10, 11, 12, 13)]
    assert [r["reason"] for r in rejects][5:] == [
        "no assistant turn", "no supervised tokens: every assistant turn is empty",
        "only a leading assistant turn (dropped)", "turn with no content: messages[0].content is null"]
    assert [r["reason"].split(":")[0] for r in rejects][:5] == [
        "empty conversation", "unknown role", "turn with no content", "invalid JSON", "invalid UTF-8"]
    assert rejects[2]["reason"] == "turn with no content: messages[0].content is missing"
    rows = {r["conversation_id"]: r for r in TokenTable.open(tmp_path / "tok").iter_rows()}
    # the empty assistant turn supervises nothing, not even its <|im_end|>; the later one does
    assert smollm2_tokenizer.decode(rows["e"]["input_ids"][rows["e"]["loss_mask"] == 1]) == "s<|im_end|>"
    assert all(r["n_loss_tokens"] >= 1 for r in rows.values())  # no row without a supervised token

    packed = run_pack(PackRun(inputs=[tmp_path / "tok"], tokenizer="smollm2-135m", output=tmp_path / "pack",
                              settings=PackConfig(max_seq_len=64)), tokenizer=smollm2_tokenizer)["counts"]
    assert packed["used"] + packed["rejected"] == packed["read"] == 4
    assert packed["loss_tokens"] == c["loss_tokens"]
    table = TokenTable.open(tmp_path / "pack")
    for row in table.iter_rows():  # every segment has a supervised token: no 0/0 loss downstream
        cu = row["cu_seqlens"]
        assert all(row["loss_mask"][a:b].sum() > 0 for a, b in zip(cu[:-1], cu[1:]))


def test_strict_stops_at_the_first_bad_row(tmp_path, smollm2_tokenizer):
    src = write_rows(tmp_path / "bad.jsonl", BAD_ROWS)
    with pytest.raises(InputError) as info:
        run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "tok",
                                 settings=TokenizeConfig(strict=True)), tokenizer=smollm2_tokenizer)
    assert (info.value.file, info.value.row) == (str(src), 2)  # line 2 of the file
    assert not (tmp_path / "tok").exists()  # no half-written output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]  # nor a staging directory


def test_failed_run_keeps_the_old_output_and_a_rerun_works(tmp_path, smollm2_tokenizer):
    src = write_rows(tmp_path / "bad.jsonl", BAD_ROWS)
    out = tmp_path / "tok"
    run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=out, settings=TokenizeConfig()),
                             tokenizer=smollm2_tokenizer)
    before = (out / "manifest.json").read_text()
    with pytest.raises(InputError):  # a forced run that fails leaves the finished output as it was
        run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=out,
                                 settings=TokenizeConfig(strict=True), force=True), tokenizer=smollm2_tokenizer)
    assert (out / "manifest.json").read_text() == before
    with pytest.raises(InputError):
        run_pack(PackRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "p",
                         settings=PackConfig(tokenize=TokenizeConfig(strict=True))), tokenizer=smollm2_tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "tok"]
    run_pack(PackRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "p", settings=PackConfig()),
                     tokenizer=smollm2_tokenizer)  # no --force
    assert TokenTable.open(tmp_path / "p").manifest["counts"]["used"] == 4


def test_bad_chat_template_fails_once_up_front(tmp_path, smollm2_tokenizer):
    src = write_rows(tmp_path / "ok.jsonl", [OK] * 30)
    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(InputError, match="not a valid Jinja template") as info:
        run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "tok",
                                 settings=TokenizeConfig(chat_template=str(template))), tokenizer=smollm2_tokenizer)
    assert str(template) in str(info.value) and not (tmp_path / "tok").exists()
    with pytest.raises(InputError, match="not a valid Jinja template"):
        run_pack(PackRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "p",
                         settings=PackConfig(
            tokenize=TokenizeConfig(chat_template=str(template)))),
                         tokenizer=smollm2_tokenizer)
    with pytest.raises(ValueError, match=r"^--chat-template '.*nope.jinja' does not exist$"):
        TokenizeConfig(chat_template=str(tmp_path / "nope.jinja"))
    with pytest.raises(ValueError, match=r"^--chat-template '.*' is not a regular file$"):
        TokenizeConfig(chat_template=str(tmp_path))


def test_pack_limit_applies_to_a_tokenize_output(tmp_path, smollm2_tokenizer):
    src = write_rows(tmp_path / "c.jsonl", _long_conversations(6))
    run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "tok",
                             settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)
    c = run_pack(PackRun(inputs=[tmp_path / "tok"], tokenizer="smollm2-135m", output=tmp_path / "p",
                         settings=PackConfig(
        max_seq_len=4096, tokenize=TokenizeConfig(limit=2))),
                         tokenizer=smollm2_tokenizer)["counts"]
    assert (c["read"], c["used"], c["windows"]) == (2, 2, 2)
    segments = [s for r in TokenTable.open(tmp_path / "p").iter_rows() for s in r["segment_ids"]]
    assert sorted(segments) == ["c0#0", "c1#0"]


def test_duplicate_ids_are_renamed_and_counted(tmp_path, smollm2_tokenizer):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    row = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
    a = write_rows(tmp_path / "a" / "good.jsonl", [row, OK])
    b = write_rows(tmp_path / "b" / "good.jsonl", [row, OK])
    c = run_tokenize(TokenizeRun(inputs=[a, b, a], tokenizer="smollm2-135m", output=tmp_path / "tok",
                                 settings=TokenizeConfig(dedup=False)), tokenizer=smollm2_tokenizer)["counts"]
    ids = [r["conversation_id"] for r in TokenTable.open(tmp_path / "tok").iter_rows(["conversation_id"])]
    assert ids == ["a/good:1", "ok", "b/good:1", "ok~2", "a/good:1~2", "ok~3"]
    assert c["duplicate_ids_renamed"] == 3
    # the same tokenize output twice: pack keeps segment ids unique too
    p = run_pack(PackRun(inputs=[tmp_path / "tok", tmp_path / "tok"], tokenizer="smollm2-135m", output=tmp_path / "p",
                         settings=PackConfig(max_seq_len=256, tokenize=TokenizeConfig(dedup=False))),
                         tokenizer=smollm2_tokenizer)["counts"]
    segments = [s for r in TokenTable.open(tmp_path / "p").iter_rows() for s in r["segment_ids"]]
    assert len(segments) == len(set(segments)) == 12 and p["duplicate_ids_renamed"] == 6


def test_nothing_used_still_writes_manifest_without_dividing_by_zero(tmp_path, smollm2_tokenizer):
    empty_turn = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}
    src = write_rows(tmp_path / "e.jsonl", [empty_turn, empty_turn])
    c = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "tok",
                                 settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)["counts"]
    assert (c["read"], c["used"], c["loss_tokens"]) == (2, 0, 0)
    p = run_pack(PackRun(inputs=[tmp_path / "tok"], tokenizer="smollm2-135m", output=tmp_path / "p",
                         settings=PackConfig(max_seq_len=64)), tokenizer=smollm2_tokenizer)["counts"]
    assert (p["read"], p["n_blocks"], p["packing_efficiency"]) == (0, 0, 0.0)
    p = run_pack(PackRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "p2",
                         settings=PackConfig(max_seq_len=64)), tokenizer=smollm2_tokenizer)["counts"]
    assert (p["read"], p["rejected"], p["n_blocks"], p["packing_efficiency"]) == (2, 2, 0, 0.0)
    assert TokenTable.open(tmp_path / "p2").num_rows == 0


def tokenize_history_rewrite(tmp_path, tokenizer):
    """Tokenize a two-turn reasoning conversation ``q`` and the row ``OK`` under the Qwen3 template
    (which rewrites history: ``q`` becomes rows ``q@1``, ``q@3``) into ``tmp_path/split``.

    Returns: (template path, input path, the run's counts)."""
    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3)
    conv = {"id": "q", "messages": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4.", "reasoning_content": "Add."},
        {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6.", "reasoning_content": "Add."}]}
    src = write_rows(tmp_path / "q.jsonl", [conv, OK])
    counts = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "split",
                                      settings=TokenizeConfig(chat_template=str(template))),
                          tokenizer=tokenizer)["counts"]
    return template, src, counts


def test_history_rewrite_split_and_reject(tmp_path, smollm2_tokenizer):
    template, src, split = tokenize_history_rewrite(tmp_path, smollm2_tokenizer)
    assert (split["read"], split["used"], split["history_rewrite_conversations"], split["history_rewrite_rows"]) \
        == (2, 2, 1, 2)
    table = TokenTable.open(tmp_path / "split")
    assert [r["conversation_id"] for r in table.iter_rows(["conversation_id"])] == ["q@1", "q@3", "ok"]
    packed = run_pack(PackRun(inputs=[tmp_path / "split"], tokenizer="smollm2-135m", output=tmp_path / "p",
                              settings=PackConfig(
        max_seq_len=256, tokenize=TokenizeConfig(chat_template=str(template)))),
                              tokenizer=smollm2_tokenizer)
    assert (packed["counts"]["read"], packed["counts"]["used"], packed["counts"]["windows"]) == (2, 2, 3)

    reject = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "rej",
                                      settings=TokenizeConfig(
        chat_template=str(template), on_history_rewrite="reject")),
                                      tokenizer=smollm2_tokenizer)["counts"]
    assert (reject["used"], reject["rejected"]) == (1, 1)
    assert rejects_of(tmp_path / "rej")[0]["reason"].startswith("template rewrites history")


def _long_conversations(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    rows = []
    for i in range(n):
        turns = []
        for _ in range(int(rng.integers(1, 4))):
            turns.append({"role": "user", "content": " ".join(rng.choice(words, int(rng.integers(3, 30))))})
            turns.append({"role": "assistant", "content": " ".join(rng.choice(words, int(rng.integers(5, 200))))})
        rows.append({"id": f"c{i}", "messages": turns})
    return rows


def test_workers_give_identical_output(tmp_path, smollm2_tokenizer):
    src = write_rows(tmp_path / "c.jsonl", _long_conversations(150) + [b"{bad\n"])
    for workers in (1, 2):
        run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / f"t{workers}",
                                 settings=TokenizeConfig(num_workers=workers)), tokenizer=smollm2_tokenizer)
    t1, t2 = TokenTable.open(tmp_path / "t1"), TokenTable.open(tmp_path / "t2")
    assert t1.read_all().equals(t2.read_all())
    assert t1.manifest["counts"] == t2.manifest["counts"]
    assert (tmp_path / "t1" / "rejects.jsonl").read_text() == (tmp_path / "t2" / "rejects.jsonl").read_text()


def test_pack_round_trip_every_supervised_token_once(tmp_path, smollm2_tokenizer):
    src = write_rows(tmp_path / "c.jsonl", _long_conversations(60))
    run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "tok",
                             settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)
    tok = TokenTable.open(tmp_path / "tok")
    run_pack(PackRun(inputs=[tmp_path / "tok"], tokenizer="smollm2-135m", output=tmp_path / "p",
                     settings=PackConfig(max_seq_len=128)), tokenizer=smollm2_tokenizer)
    packed = TokenTable.open(tmp_path / "p")
    c = packed.manifest["counts"]
    assert c["conversations_split"] > 10 and c["windows_trimmed"] > 0
    # skip: every supervised token trained once, so the loss-token multiset is the tokenized one.
    assert c["loss_tokens"] == tok.manifest["counts"]["loss_tokens"]
    assert np.array_equal(packed.token_freq(), tok.token_freq())
    assert c["packing_efficiency"] == pytest.approx(c["tokens"] / (c["n_blocks"] * 128), abs=1e-6)
    table = packed.read_all()
    for name in ("input_ids", "loss_mask", "position_ids"):
        assert pa.types.is_large_list(table.schema.field(name).type)
    for row in packed.iter_rows():
        cu = row["cu_seqlens"]
        assert cu[0] == 0 and cu[-1] == row["n_tokens"] == len(row["input_ids"]) == len(row["loss_mask"]) <= 128
        for a, b in zip(cu[:-1], cu[1:]):
            assert row["position_ids"][a:b].tolist() == list(range(b - a))
            assert row["loss_mask"][a:b].any()


@pytest.mark.parametrize("command", ["tokenize", "pack"])
def test_a_rerun_removes_stale_partials_of_dead_runs_only(tmp_path, smollm2_tokenizer, capsys, command):
    src = write_rows(tmp_path / "ok.jsonl", distinct_ok_rows(3))
    host = _host_tag()
    stale = make_staging(tmp_path, "out", "partial", f"{host}-{dead_pid()}")
    live = make_staging(tmp_path, "out", "partial", f"{host}-{os.getpid()}")
    if command == "tokenize":
        run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "out",
                                 settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)
    else:
        run_pack(PackRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "out",
                         settings=PackConfig(max_seq_len=64)), tokenizer=smollm2_tokenizer)
    assert not stale.exists() and live.is_dir()
    assert TokenTable.open(tmp_path / "out").manifest["counts"]["used"] == 3
    lines = [line for line in capsys.readouterr().err.splitlines() if "stale partial" in line]
    assert lines == [f"removed 1 stale partial output of killed runs (their process is gone): {stale}"]


# `peagle-data ARGS`, except that the process SIGKILLs itself inside its staging directory (when it
# would load the tokenizer), leaving that directory behind as a killed run does
KILLED_DATA_CLI = """
import os, signal, sys
import peagle_data.prepare.tokenizing as p  # run_tokenize loads its tokenizer there
def die(*args):
    os.kill(os.getpid(), signal.SIGKILL)
p.resolve_tokenizer = die
from cli.data import main
sys.argv[0] = "peagle-data"
main()
"""


def test_sigkilled_tokenize_leaves_a_partial_the_next_run_removes(tmp_path, smollm2_tokenizer, capsys):
    src = write_rows(tmp_path / "ok.jsonl", distinct_ok_rows(3))
    out = tmp_path / "tok"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", KILLED_DATA_CLI, "tokenize", str(src), "--tokenizer", "smollm2-135m",
                          "--output", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".tok.partial-")]
    assert len(left) == 1 and not out.exists()
    live = make_staging(tmp_path, "tok", "partial", f"{_host_tag()}-{os.getpid()}")
    run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=out, settings=TokenizeConfig()),
                             tokenizer=smollm2_tokenizer)
    assert not left[0].exists() and live.is_dir()
    assert str(left[0]) in capsys.readouterr().err
    assert TokenTable.open(out).manifest["counts"]["used"] == 3


def test_pack_of_a_tokenize_output_warns_about_ignored_tokenize_options(tmp_path, smollm2_tokenizer, capsys):
    src = write_rows(tmp_path / "ok.jsonl", distinct_ok_rows(3))
    run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "tok",
                             settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)
    tok_cfg = TokenizeConfig(format="sharegpt", num_workers=2, on_history_rewrite="reject", limit=2)
    capsys.readouterr()
    run_pack(PackRun(inputs=[tmp_path / "tok"], tokenizer="smollm2-135m", output=tmp_path / "p",
                     settings=PackConfig(max_seq_len=64, tokenize=tok_cfg)), tokenizer=smollm2_tokenizer)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "WARNING" in line]
    assert warnings == ["WARNING: ignoring --format sharegpt, --num-workers 2, --on-history-rewrite reject: the "
                        "INPUT is a tokenize output, already tokenized (these options only apply to raw "
                        "conversations)"]
    # only the options the caller set explicitly are named; raw conversations use them all: no warning
    run_pack(PackRun(inputs=[tmp_path / "tok"], tokenizer="smollm2-135m", output=tmp_path / "p2",
                     settings=PackConfig(max_seq_len=64, tokenize=tok_cfg)), tokenizer=smollm2_tokenizer,
                     explicit={"num_workers", "limit"})
    assert [line for line in capsys.readouterr().err.splitlines() if "WARNING" in line] == [
        "WARNING: ignoring --num-workers 2: the INPUT is a tokenize output, already tokenized (these options "
        "only apply to raw conversations)"]
    run_pack(PackRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "p3",
                     settings=PackConfig(max_seq_len=64, tokenize=TokenizeConfig(
        format="openai"))),
                     tokenizer=smollm2_tokenizer)
    assert "WARNING" not in capsys.readouterr().err


def test_dropped_content_rejects_or_is_kept_and_counted(tmp_path, smollm2_tokenizer):
    call = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    rows = [OK,
            {"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None,
                                                                   "tool_calls": [call]},
                          {"role": "tool", "content": "3 C"}, {"role": "assistant", "content": "3 degrees."}]},
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}},
                                                       {"type": "text", "text": "What is it?"}]},
                          {"role": "assistant", "content": "A cat."}]}]
    src = write_rows(tmp_path / "drops.jsonl", rows)
    summary = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "rej",
                                       settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)
    assert (summary["counts"]["used"], summary["counts"]["rejected"]) == (1, 2)
    reasons = [r["reason"] for r in rejects_of(tmp_path / "rej")]
    assert reasons[0].startswith("template drops tool_calls: the tool_calls of message 1 (assistant)")
    assert reasons[1].startswith("unsupported content part: messages[0].content[0] has type 'image_url'")
    assert summary["counts"]["rejected_by_reason"] == {"template drops tool_calls": 1, "unsupported content part": 1}
    assert summary["counts"]["tool_arguments_decoded"] == 0  # counted for used rows only
    kept = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "keep",
                                    settings=TokenizeConfig(on_dropped_content="keep")), tokenizer=smollm2_tokenizer)["counts"]
    assert (kept["used"], kept["rejected"]) == (3, 0)
    assert kept["conversations_with_dropped_content"] == 2 and kept["dropped_tool_calls"] == 1
    assert kept["dropped_content_parts"] == 1 and kept["tool_arguments_decoded"] == 1
    table = {r["conversation_id"]: r for r in TokenTable.open(tmp_path / "keep").iter_rows()}
    call_row = table["drops:2"]
    ids, mask = call_row["input_ids"], call_row["loss_mask"]
    assert [smollm2_tokenizer.decode(ids[mask == 1])] == ["3 degrees.<|im_end|>"]  # no bare <|im_end|>


def test_special_token_text_in_a_reply_is_rejected_or_kept_and_counted(tmp_path, smollm2_tokenizer):
    """Issue 33, kind 7: a reply that writes out <|im_end|> (explaining ChatML) or <file_sep> was tokenized
    with that text as one control id and supervised mid-reply ("read 3 used 3 rejected 0")."""
    tok = smollm2_tokenizer
    rows = [OK,
            {"messages": [{"role": "user", "content": "How does ChatML end a turn?"},
                          {"role": "assistant", "content": "Each turn ends with <|im_end|> and a newline."}]},
            {"messages": [{"role": "user", "content": "Join the files"},
                          {"role": "assistant", "content": "a.py<file_sep>b.py"}]},
            # a user turn holding the text: rendered as vLLM renders it (a control id there too), not a reject
            {"messages": [{"role": "user", "content": "What does <|im_end|> mean?"},
                          {"role": "assistant", "content": "It ends a turn."}]}]
    src = write_rows(tmp_path / "special.jsonl", rows)
    summary = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "rej",
                                       settings=TokenizeConfig()), tokenizer=tok)
    assert (summary["counts"]["read"], summary["counts"]["used"], summary["counts"]["rejected"]) == (4, 2, 2)
    assert "conversations_with_special_token_text" not in summary["counts"]
    rejects = rejects_of(tmp_path / "rej")
    assert [(r["source"].rsplit("/", 1)[-1], r["reason"]) for r in rejects] == [
        ("special.jsonl:2", "special-token text in a reply: the content of assistant message 1 writes '<|im_end|>', "
         "which the tokenizer reads as the special token id 2, not as text, so the row would supervise a control "
         "token inside the reply (the verifier never generates it there); pass --on-special-token-text keep to keep "
         "such rows as the tokenizer reads them (counted as conversations_with_special_token_text), or remove the "
         "text"),
        ("special.jsonl:3", "special-token text in a reply: the content of assistant message 1 writes '<file_sep>', "
         "which the tokenizer reads as the special token id 5, not as text, so the row would supervise a control "
         "token inside the reply (the verifier never generates it there); pass --on-special-token-text keep to keep "
         "such rows as the tokenizer reads them (counted as conversations_with_special_token_text), or remove the "
         "text")]
    assert summary["counts"]["rejected_by_reason"] == {"special-token text in a reply": 2}
    table = {r["conversation_id"]: r for r in TokenTable.open(tmp_path / "rej").iter_rows()}
    user_row = table["special:4"]
    assert user_row["input_ids"].tolist() == tok.apply_chat_template(rows[3]["messages"], tokenize=True,
                                                                      return_dict=False)
    assert list(user_row["input_ids"]).count(2) == 4  # the user's <|im_end|> text is the control id, as in vLLM
    kept = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "keep",
                                    settings=TokenizeConfig(on_special_token_text="keep")), tokenizer=tok)["counts"]
    assert (kept["used"], kept["rejected"], kept["conversations_with_special_token_text"]) == (4, 0, 2)
    table = {r["conversation_id"]: r for r in TokenTable.open(tmp_path / "keep").iter_rows()}
    ids, mask = table["special:2"]["input_ids"], table["special:2"]["loss_mask"]
    assert tok.decode(ids[mask == 1]) == "Each turn ends with <|im_end|> and a newline.<|im_end|>"
    assert list(ids[mask == 1]).count(2) == 2


def test_parquet_null_keys_are_counted_in_the_manifest(tmp_path, smollm2_tokenizer):
    rows = [{"id": f"r{k}", "messages": [{"role": "user", "content": [{"type": "text", "text": f"Hi {k}"}]},
                                         {"role": "assistant", "content": [{"type": "text", "text": "Yo"}]}]}
            for k in range(3)]
    rows[1]["messages"][1]["content"][0] = {"type": "text", "value": "Yo"}  # the other rows gain value: null
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "n.parquet")
    counts = run_tokenize(TokenizeRun(inputs=[tmp_path / "n.parquet"], tokenizer="smollm2-135m",
                                      output=tmp_path / "tok", settings=TokenizeConfig()),
                                      tokenizer=smollm2_tokenizer)["counts"]
    assert counts["used"] == 3 and counts["null_keys_dropped_rows"] == 3
    manifest = json.loads((tmp_path / "tok" / "manifest.json").read_text())
    assert manifest["counts"]["null_keys_dropped_rows"] == 3


def test_sharegpt_function_calls_are_counted_and_tokenize_like_the_openai_form(tmp_path, qwen3_tok):
    from tests.peagle_data.chat.test_template_families import GLAIVE_ROW, as_openai

    tok = qwen3_tok
    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3)
    share, openai = tmp_path / "share.jsonl", tmp_path / "openai.jsonl"
    share.write_text(json.dumps({"id": "g", **GLAIVE_ROW}) + "\n")
    openai.write_text(json.dumps({"id": "g", **as_openai(GLAIVE_ROW)}) + "\n")
    counts = {}
    for name, src in (("share", share), ("openai", openai)):
        counts[name] = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / name,
                                                settings=TokenizeConfig(chat_template=str(template))),
                                    tokenizer=tok)["counts"]
    manifest = json.loads((tmp_path / "share" / "manifest.json").read_text())["counts"]
    assert (manifest["used"], manifest["sharegpt_function_calls"], manifest["sharegpt_observations"],
            manifest["tool_schemas_wrapped"]) == (1, 1, 1, 1)
    assert counts["openai"]["used"] == 1 and counts["openai"]["tool_arguments_decoded"] == 1
    assert not {"sharegpt_function_calls", "sharegpt_observations", "tool_schemas_wrapped"} & set(counts["openai"])
    a, b = (list(TokenTable.open(tmp_path / name).iter_rows()) for name in ("share", "openai"))
    for key in ("input_ids", "loss_mask"):
        assert [r[key].tolist() for r in a] == [r[key].tolist() for r in b]
    assert [r["conversation_id"] for r in a] == ["g@1", "g@3"]  # the call turn is last in its row


def test_assistant_turns_with_weight_zero_are_context_only(tmp_path, smollm2_tokenizer):
    # The OpenAI fine-tuning format marks turns not to train on with "weight": 0 (axolotl's ShareGPT
    # turns too): they stay in the context and supervise nothing; 1 or absent supervises.
    from tests.peagle_data.chat.test_tokens import masked_texts
    from peagle_data.chat.tokens import TokenizedConversation

    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Bad answer.", "weight": 0},
             {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "Good answer.", "weight": 1}]
    sharegpt = {"id": "s", "conversations": [{"from": "human", "value": "Hi"},
                                             {"from": "gpt", "value": "Bad answer.", "weight": 0},
                                             {"from": "human", "value": "Again?"},
                                             {"from": "gpt", "value": "Good answer."}]}
    rows = [{"id": "w", "messages": turns}, sharegpt,
            {"id": "all0", "messages": [turns[0], turns[1]]},
            {"id": "half", "messages": [turns[0], {**turns[3], "weight": 0.5}]}]
    src = write_rows(tmp_path / "w.jsonl", rows)
    counts = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "t",
                                      settings=TokenizeConfig(dedup=False)), tokenizer=smollm2_tokenizer)["counts"]
    assert (counts["used"], counts["rejected"], counts["weight_zero_turns"]) == (2, 2, 2)
    table = list(TokenTable.open(tmp_path / "t").iter_rows())
    for row in table:
        out = TokenizedConversation(row["input_ids"], row["loss_mask"], row["system_len"])
        assert masked_texts(smollm2_tokenizer, out) == ["Good answer.<|im_end|>"]
        assert "Bad answer." in smollm2_tokenizer.decode(row["input_ids"])  # still the context
    assert [r["reason"] for r in rejects_of(tmp_path / "t")] == [
        "no supervised tokens: every assistant turn is empty or has weight 0",
        "invalid weight: messages[1].weight is 0.5 (0 leaves an assistant turn unsupervised, 1 supervises it)"]


def test_a_reply_cut_at_a_token_limit_supervises_no_end_of_turn(tmp_path, smollm2_tokenizer):
    # what `regenerate` writes for an answer cut at --max-new-tokens: the <|im_end|> the template
    # renders after it was never generated by the verifier
    from tests.peagle_data.chat.test_tokens import masked_texts
    from peagle_data.chat.tokens import TokenizedConversation

    turns = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two,", "finish_reason": "length"},
             {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "Done.", "finish_reason": "stop"}]
    rows = [{"id": "c", "messages": turns},
            {"id": "bad", "messages": [turns[0], {**turns[1], "finish_reason": "content_filter"}]},
            {"id": "sg", "conversations": [{"from": "human", "value": "Count."},
                                           {"from": "gpt", "value": "One, two,", "finish_reason": "length"}]}]
    src = write_rows(tmp_path / "c.jsonl", rows)
    counts = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "t",
                                      settings=TokenizeConfig(dedup=False)), tokenizer=smollm2_tokenizer)["counts"]
    assert (counts["used"], counts["rejected"], counts["cut_assistant_turns"]) == (2, 1, 2)
    table = list(TokenTable.open(tmp_path / "t").iter_rows())
    out = [masked_texts(smollm2_tokenizer, TokenizedConversation(r["input_ids"], r["loss_mask"], r["system_len"]))
           for r in table]
    assert out == [["One, two,", "Done.<|im_end|>"], ["One, two,"]]  # the ShareGPT row's turn too
    assert [r["reason"] for r in rejects_of(tmp_path / "t")] == [
        "invalid finish_reason: messages[1].finish_reason is 'content_filter' (\"length\": the reply was cut at a "
        "token limit; \"stop\", \"tool_calls\": it is complete)"]


def test_a_split_turn_the_template_drops_whole_is_counted(tmp_path, smollm2_tokenizer):
    # QWEN3 without its tool-call block: rewrites history (earlier reasoning) and drops tool calls
    start = QWEN3.index("{%- if m.tool_calls %}")
    end = QWEN3.index("{%- endif %}{{- '<|im_end|>\\n' }}", start) + len("{%- endif %}")
    template = tmp_path / "no_calls.jinja"
    template.write_text(QWEN3[:start] + QWEN3[end:])
    conv = {"id": "q", "messages": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4.", "reasoning_content": "Add."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                             "arguments": {"city": "Paris"}}}]}]}
    src = write_rows(tmp_path / "q.jsonl", [conv, OK])
    c = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "o",
                                 settings=TokenizeConfig(chat_template=str(template), on_dropped_content="keep")),
                     tokenizer=smollm2_tokenizer)["counts"]
    # the tool-call turn renders as glue only: no row of its own, but its dropped tool call is counted
    assert (c["used"], c["history_rewrite_rows"]) == (2, 1)
    assert (c["conversations_with_dropped_content"], c.get("dropped_tool_calls")) == (1, 1)
