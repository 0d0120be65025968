"""Exact deduplication across sources and the --max-tokens / --min-loss-tokens filters."""

from __future__ import annotations

import json

from click.testing import CliRunner

from cli.data import main
from peagle_data.prepare.dedup import Deduplicator, conversation_key, filter_reason
from peagle_data.prepare.config import PackConfig, PackRun, TokenizeConfig, TokenizeRun
from peagle_data.prepare.pack import run_pack
from peagle_data.prepare.tokenizing import run_tokenize
from peagle_data.readers.rows import Conversation
from stores.tables.token_tables import TokenTable


def _conv(user, answer, cid="x"):
    return {"id": cid, "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rejects(table):
    return [json.loads(line) for line in (table / "rejects.jsonl").read_text().splitlines()]


def test_key_is_of_normalised_messages_not_ids():
    a = Conversation("a", "f:1", [{"role": "user", "content": "hi"}])
    b = Conversation("b", "g:9", [{"role": "user", "content": "hi"}])
    c = Conversation("c", "g:9", [{"role": "user", "content": "hi "}])
    assert conversation_key(a) == conversation_key(b) != conversation_key(c)
    d = Deduplicator()
    assert d.first_of(b"k", "f:1") is None and d.first_of(b"k", "g:2") == "f:1" and len(d) == 1


def test_duplicates_across_sources_and_formats_are_dropped_and_listed(tmp_path, smollm2_tokenizer):
    a = _write(tmp_path / "a.jsonl", [_conv("hello", "hi there", "a1"), _conv("what is 2+2", "4", "a2")])
    sharegpt_copy = {"id": "b2", "conversations": [{"from": "human", "value": "what is 2+2"},
                                                   {"from": "gpt", "value": "4"}]}
    b = _write(tmp_path / "b.jsonl", [_conv("hello", "hi there", "b1"), sharegpt_copy, _conv("new", "row", "b3"),
                                      _conv("hello", "hi there", "b4")])
    c = run_tokenize(TokenizeRun(inputs=[a, b], tokenizer="smollm2-135m", output=tmp_path / "tok",
                                 settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)["counts"]
    assert (c["read"], c["used"], c["rejected"], c["duplicates"]) == (6, 3, 3, 3)
    assert c["rejected_by_reason"] == {"duplicate": 3}
    rejects = _rejects(tmp_path / "tok")
    assert [(r["source"], r["duplicate_of"], r["conversation_id"]) for r in rejects] == [
        (f"{b}:1", f"{a}:1", "b1"), (f"{b}:2", f"{a}:2", "b2"), (f"{b}:4", f"{a}:1", "b4")]
    assert rejects[0]["reason"] == f"duplicate: same messages as {a}:1"
    ids = [r["conversation_id"] for r in TokenTable.open(tmp_path / "tok").iter_rows(["conversation_id"])]
    assert ids == ["a1", "a2", "b3"]
    # --no-dedup keeps them all
    c = run_tokenize(TokenizeRun(inputs=[a, b], tokenizer="smollm2-135m", output=tmp_path / "all",
                                 settings=TokenizeConfig(dedup=False)), tokenizer=smollm2_tokenizer)["counts"]
    assert (c["used"], c["rejected"], c.get("duplicates", 0)) == (6, 0, 0)
    # pack of two tokenize outputs holding the same conversations: duplicates by tokens
    p = run_pack(PackRun(inputs=[tmp_path / "tok", tmp_path / "all"], tokenizer="smollm2-135m", output=tmp_path / "p",
                         settings=PackConfig(max_seq_len=64)), tokenizer=smollm2_tokenizer)["counts"]
    assert (p["read"], p["used"], p["duplicates"]) == (9, 3, 6)
    firsts = {r["duplicate_of"] for r in _rejects(tmp_path / "p")}
    assert firsts == {f"{a}:1", f"{a}:2", f"{b}:3"}


def test_length_filters_reject_with_counts(tmp_path, smollm2_tokenizer):
    long_answer = " ".join(["word"] * 200)
    src = _write(tmp_path / "f.jsonl", [_conv("q1", "ok"), _conv("q2", long_answer), _conv("q3", "fine thanks")])
    full = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "full",
                                    settings=TokenizeConfig()), tokenizer=smollm2_tokenizer)
    rows = list(TokenTable.open(tmp_path / "full").iter_rows(["n_tokens", "n_loss_tokens"]))
    n = [r["n_tokens"] for r in rows]
    m = [r["n_loss_tokens"] for r in rows]
    assert full["counts"]["used"] == 3 and n[1] > 200 > max(n[0], n[2]) and m[0] < m[2]
    cfg = TokenizeConfig(max_tokens=n[1] - 1, min_loss_tokens=m[0] + 1)
    c = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "f", settings=cfg),
                                 tokenizer=smollm2_tokenizer)["counts"]
    assert (c["used"], c["rejected"]) == (1, 2)
    assert c["rejected_by_reason"] == {"too long": 1, "too few supervised tokens": 1}
    reasons = {r["source"]: r["reason"] for r in _rejects(tmp_path / "f")}
    assert reasons == {f"{src}:2": f"too long: {n[1]} tokens > --max-tokens {n[1] - 1}",
                       f"{src}:1": f"too few supervised tokens: {m[0]} < --min-loss-tokens {m[0] + 1}"}
    # the same filters on a tokenize output given to pack, from the command line
    r = CliRunner().invoke(main, ["pack", str(tmp_path / "full"), "--tokenizer", "smollm2-135m", "--output",
                                  str(tmp_path / "p"), "--max-seq-len", "512", "--max-tokens", str(n[1] - 1),
                                  "--min-loss-tokens", str(m[0] + 1)])
    assert r.exit_code == 0, r.output
    counts = TokenTable.open(tmp_path / "p").manifest["counts"]
    assert counts["used"] == 1 and counts["rejected_by_reason"] == {"too long": 1, "too few supervised tokens": 1}
    assert TokenTable.open(tmp_path / "p").manifest["parameters"]["tokenize"]["max_tokens"] == n[1] - 1


def test_filter_reason_bounds():
    assert filter_reason(10, 3, 10, 3) is None
    assert filter_reason(11, 3, 10, None).startswith("too long: 11 tokens")
    assert filter_reason(5, 2, None, 3).startswith("too few supervised tokens: 2 < ")


def test_max_tokens_of_a_split_conversation_is_its_length_not_the_sum_of_its_rows(tmp_path, smollm2_tokenizer):
    # A history-rewriting template (Qwen3) gives one row per assistant turn, each holding the whole
    # history before it: the conversation is as long as its last row, not as the rows together.
    from tests.peagle_data.chat.test_template_families import QWEN3

    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3)
    turns = [{"role": "user", "content": "What is 2+2?"},
             {"role": "assistant", "content": "4.", "reasoning_content": "Two and two."},
             {"role": "user", "content": "And 3+3?"},
             {"role": "assistant", "content": "6.", "reasoning_content": "Three and three."}]
    src = _write(tmp_path / "q.jsonl", [{"id": "q", "messages": turns}])
    run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "full",
                             settings=TokenizeConfig(chat_template=str(template))), tokenizer=smollm2_tokenizer)
    rows = list(TokenTable.open(tmp_path / "full").iter_rows(["conversation_id", "n_tokens", "n_loss_tokens"]))
    assert [r["conversation_id"] for r in rows] == ["q@1", "q@3"]
    longest, loss = rows[1]["n_tokens"], rows[0]["n_loss_tokens"] + rows[1]["n_loss_tokens"]
    whole = smollm2_tokenizer.apply_chat_template(turns, chat_template=QWEN3, tokenize=True, return_dict=False)
    assert longest == len(whole) < rows[0]["n_tokens"] + rows[1]["n_tokens"]
    kept = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "kept",
                                    settings=TokenizeConfig(
        chat_template=str(template), max_tokens=longest, min_loss_tokens=loss)),
                                    tokenizer=smollm2_tokenizer)
    assert kept["counts"]["used"] == 1 and TokenTable.open(tmp_path / "kept").num_rows == 2
    cut = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "cut",
                                   settings=TokenizeConfig(
        chat_template=str(template), max_tokens=longest - 1)),
                                   tokenizer=smollm2_tokenizer)
    assert cut["counts"]["used"] == 0
    assert _rejects(tmp_path / "cut")[0]["reason"] == f"too long: {longest} tokens > --max-tokens {longest - 1}"
    for n, used in ((longest, 1), (longest - 1, 0)):  # pack of the tokenize output: the same rule
        out = tmp_path / f"p{n}"
        r = run_pack(PackRun(inputs=[tmp_path / "full"], tokenizer="smollm2-135m", output=out,
                             settings=PackConfig(
            max_seq_len=512, tokenize=TokenizeConfig(chat_template=str(template), max_tokens=n))),
                             tokenizer=smollm2_tokenizer)
        assert r["counts"]["used"] == used, n
