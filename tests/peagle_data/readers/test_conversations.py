"""Conversation readers: formats, normalisation, rejects with file:N reasons (N from 1), strict errors."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from peagle_data.readers.conversations import read_conversations
from peagle_data.readers.rows import Conversation, Reject
from stores.errors import InputError

OPENAI_ROW = {"id": "o1", "messages": [{"role": "user", "content": "Hi"},
                                       {"role": "assistant", "content": "Hello"}]}
SHAREGPT_ROW = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}


def write_jsonl(path: Path, rows) -> Path:
    with path.open("wb") as f:
        for row in rows:
            f.write(row if isinstance(row, bytes) else (json.dumps(row) + "\n").encode())
    return path


def read_all(*inputs, **kw):
    return list(read_conversations([str(i) for i in inputs], **kw))


def test_jsonl_auto_detects_both_formats(tmp_path):
    path = write_jsonl(tmp_path / "mix.jsonl", [OPENAI_ROW, SHAREGPT_ROW])
    a, b = read_all(path)
    assert isinstance(a, Conversation) and isinstance(b, Conversation)
    assert a.conversation_id == "o1" and a.source == f"{path}:1"  # line 1
    assert b.conversation_id == "mix:2" and b.source == f"{path}:2"
    expected = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert a.messages == expected and b.messages == expected


def test_json_array_and_parquet(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([SHAREGPT_ROW, OPENAI_ROW]))
    pq.write_table(pa.Table.from_pylist([OPENAI_ROW]), tmp_path / "b.parquet")
    items = read_all(tmp_path / "a.json", tmp_path / "b.parquet")
    assert [type(i) for i in items] == [Conversation] * 3
    assert [i.source for i in items] == [f"{tmp_path / 'a.json'}:1", f"{tmp_path / 'a.json'}:2",
                                         f"{tmp_path / 'b.parquet'}:1"]
    assert [i.conversation_id for i in items] == ["a:1", "o1", "o1~2"]  # the repeated id is renamed
    assert [i.duplicate_id_renamed for i in items] == [0, 0, 1]
    assert items[2].messages[1] == {"role": "assistant", "content": "Hello"}


def test_glob_and_limit(tmp_path):
    for name in ("x1.jsonl", "x2.jsonl"):
        write_jsonl(tmp_path / name, [SHAREGPT_ROW, SHAREGPT_ROW])
    items = read_all(tmp_path / "x*.jsonl")
    assert [i.conversation_id for i in items] == ["x1:1", "x1:2", "x2:1", "x2:2"]
    assert len(read_all(tmp_path / "x*.jsonl", limit=3)) == 3


def test_sharegpt_roles_system_and_tools(tmp_path):
    row = {
        "system": "Be nice.",
        "tools": json.dumps([{"name": "f", "parameters": {}}]),
        "conversations": [
            {"from": "human", "value": "Call f."},
            {"from": "function_call", "value": '{"name": "f"}'},
            {"from": "observation", "value": "42"},
            {"from": "gpt", "value": "It is 42."},
        ],
    }
    (c,) = read_all(write_jsonl(tmp_path / "t.jsonl", [row]))
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert c.messages[0]["content"] == "Be nice."
    # the function_call turn is a real tool call (no arguments: {}), the observation a tool message,
    # and the bare schema is wrapped as an OpenAI client sends it
    assert c.messages[2] == {"role": "assistant", "content": None,
                             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}
    assert c.messages[3] == {"role": "tool", "content": "42"}
    assert c.tools == [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert c.counts == {"sharegpt_function_calls": 1, "sharegpt_observations": 1, "tool_schemas_wrapped": 1}


def test_sharegpt_function_call_values(tmp_path):
    def row(value):
        return {"conversations": [{"from": "human", "value": "go"}, {"from": "function_call", "value": value},
                                  {"from": "observation", "value": "ok"}, {"from": "gpt", "value": "done"}]}

    parallel = json.dumps([{"name": "f", "arguments": '{"x": 1}'}, {"name": "g", "arguments": {"y": [2]}}])
    good, bad_json, no_name, empty = read_all(write_jsonl(tmp_path / "fc.jsonl", [
        row(parallel), row("<tool_call>f()</tool_call>"), row('{"arguments": {}}'), row("[]")]))
    assert good.messages[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
        {"type": "function", "function": {"name": "g", "arguments": {"y": [2]}}}]
    assert good.counts == {"sharegpt_function_calls": 2, "sharegpt_observations": 1, "tool_arguments_decoded": 1}
    assert (bad_json.reason, bad_json.field) == (
        'invalid tool call: conversations[1].value of a function_call turn is not JSON (expected {"name": ..., '
        '"arguments": {...}} or a list of them)', "conversations[1].value")
    assert (no_name.reason, no_name.field) == (
        "invalid tool call: conversations[1].value of a function_call turn has no function name",
        "conversations[1].value")
    assert empty.reason == "invalid tool call: conversations[1].value of a function_call turn is an empty list"


def test_tool_calls_and_content_parts_read_alike_from_jsonl_json_and_parquet(tmp_path):
    rows = [
        {"id": "s", "tools": json.dumps([{"name": "f", "description": "d", "parameters": {"type": "object"}}]),
         "conversations": [{"from": "human", "value": "go"},
                           {"from": "function_call", "value": '{"name": "f", "arguments": "{\\"x\\": 1}"}'},
                           {"from": "observation", "value": "7"}, {"from": "gpt", "value": "It is 7."}]},
        {"id": "o", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "7"},
                                                              {"type": "text", "text": "8"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "It is"}, {"type": "text", "text": "7."}]}]},
    ]
    (tmp_path / "r.json").write_text(json.dumps(rows))
    keys = ("id", "tools", "conversations", "messages")  # from_pylist takes the columns of the first row
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), tmp_path / "r.parquet")
    read = {ext: read_all(path) for ext, path in (
        ("jsonl", write_jsonl(tmp_path / "r.jsonl", rows)), ("json", tmp_path / "r.json"),
        ("parquet", tmp_path / "r.parquet"))}
    for items in read.values():
        assert [(c.messages, c.tools) for c in items] == [(c.messages, c.tools) for c in read["jsonl"]]
    s, o = read["parquet"]
    assert s.messages[1] == {"role": "assistant", "content": None,
                             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    assert s.tools == [{"type": "function", "function": {"name": "f", "description": "d",
                                                         "parameters": {"type": "object"}}}]
    assert o.messages[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert o.messages[2] == {"role": "tool", "content": "7\n8", "tool_call_id": "c"}
    assert {k: v for k, v in s.counts.items() if k != "null_keys_dropped_rows"} == {
        "sharegpt_function_calls": 1, "sharegpt_observations": 1, "tool_schemas_wrapped": 1,
        "tool_arguments_decoded": 1}


def test_tools_vllm_refuses_reject_the_row(tmp_path):
    def row(tools):
        return {"tools": tools, "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": "ok"}]}

    bad = [[{"type": "code_interpreter"}], [{"type": "function", "function": {"description": "no name"}}],
           [{"function": {"name": "f", "description": 3}}], [{"function": {"name": "f", "parameters": "not json"}}]]
    got = read_all(write_jsonl(tmp_path / "tools.jsonl", [row(t) for t in bad]))
    assert [(r.reason, r.field) for r in got] == [
        ('invalid tools: tools[0] is not a function tool (expected {"type": "function", "function": {"name", '
         '"description", "parameters"}} or a bare {"name", "parameters"} schema)', "tools[0]"),
        ("invalid tools: tools[0].function has no name", "tools[0].function.name"),
        ("invalid tools: tools[0].function.description is a int, expected text", "tools[0].function.description"),
        ("invalid tools: tools[0].function.parameters is not a JSON object", "tools[0].function.parameters")]


def test_openai_content_parts_and_tool_calls(tmp_path):
    row = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function",
                                                               "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": [{"type": "reasoning", "text": "think"}, {"type": "text", "value": "ok"}]},
    ]}
    (c,) = read_all(write_jsonl(tmp_path / "p.jsonl", [row]))
    # two text parts stay parts (the template gets them as vLLM passes them: runtime/chat/chat_template.py), one is its string
    assert c.messages[0]["content"] == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert c.messages[1]["content"] is None and c.messages[1]["tool_calls"][0]["function"]["name"] == "f"
    assert c.messages[3] == {"role": "assistant", "content": "ok", "reasoning_content": "think"}


def test_text_part_types_tool_parts_and_merged_part_lists(tmp_path):
    row = {"messages": [
        {"role": "user", "content": [{"type": "input_text", "text": "Summarise this:"}, "The cat sat on the mat."]},
        {"role": "user", "content": [{"type": "text", "text": "Briefly."}, {"type": "text", "text": "Please."}]},
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]},
        {"role": "tool", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Cat."}, {"type": "refusal",
                                                                                  "refusal": "No more."}]},
    ]}
    (c,) = read_all(write_jsonl(tmp_path / "parts.jsonl", [row]))
    # consecutive user turns: the first's last part and the second's first part joined with "\n\n"
    assert c.messages[0] == {"role": "user", "content": [
        {"type": "text", "text": "Summarise this:"}, {"type": "text", "text": "The cat sat on the mat.\n\nBriefly."},
        {"type": "text", "text": "Please."}]}
    assert c.merged_user_turns == 1
    assert c.messages[2] == {"role": "tool", "content": "r1\nr2"}  # vLLM joins tool parts in both formats
    assert c.messages[3]["content"] == [{"type": "text", "text": "Cat."}, {"type": "text", "text": "No more."}]


def test_leading_assistant_dropped_and_user_turns_merged(tmp_path):
    row = {"conversations": [{"from": "gpt", "value": "Welcome"}, {"from": "human", "value": "a"},
                             {"from": "human", "value": "b"}, {"from": "gpt", "value": "c"}]}
    (c,) = read_all(write_jsonl(tmp_path / "d.jsonl", [row]))
    assert c.messages == [{"role": "user", "content": "a\n\nb"}, {"role": "assistant", "content": "c"}]
    assert c.dropped_leading_assistant == 1 and c.merged_user_turns == 1


def test_bad_rows_are_rejects_with_reasons(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [
        OPENAI_ROW,                                                                # line 1 ok
        b"{not json\n",                                                            # 2
        b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}\n',              # 3
        {"conversations": []},                                                     # 4
        {"conversations": [{"from": "bot", "value": "x"}]},                        # 5
        {"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},   # 6
        {"messages": [{"role": "user", "content": "only a question"}]},            # 7
        {"text": "no conversation here"},                                          # 8
        {"conversations": [{"from": "gpt", "value": "only a reply"}]},             # 9
    ])
    items = read_all(path)
    assert isinstance(items[0], Conversation)
    rejects = {int(r.source.rsplit(":", 1)[1]) - 1: r for r in items if isinstance(r, Reject)}  # by index
    assert sorted(rejects) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert all(r.source.startswith(f"{path}:") for r in rejects.values())
    assert rejects[1].reason.startswith("invalid JSON")
    assert rejects[2].reason.startswith("invalid UTF-8")
    assert rejects[3].reason == "empty conversation"
    assert rejects[4].reason.startswith("unknown role") and rejects[4].field == "conversations[0].from"
    assert rejects[5].reason == "turn with no content: messages[0].content is missing"
    assert rejects[5].field == "messages[0].content"
    assert rejects[6].reason == "no assistant turn"
    assert rejects[7].reason.startswith("unknown format")
    assert rejects[8].reason == "only a leading assistant turn (dropped)"


def test_strict_names_file_row_and_field(tmp_path):
    path = write_jsonl(tmp_path / "s.jsonl", [OPENAI_ROW, {"conversations": [{"from": "bot", "value": "x"}]}])
    with pytest.raises(InputError) as info:
        read_all(path, strict=True)
    err = info.value
    assert (err.file, err.row, err.field) == (str(path), 2, "conversations[0].from")  # line 2
    assert str(path) in str(err) and "row 2" in str(err) and "unknown role" in str(err)


def test_forced_format_mismatch_is_a_reject(tmp_path):
    (r,) = read_all(write_jsonl(tmp_path / "f.jsonl", [SHAREGPT_ROW]), fmt="openai")
    assert isinstance(r, Reject) and r.reason.startswith("missing field")


def test_truncated_json_array_keeps_complete_records(tmp_path):
    text = json.dumps([SHAREGPT_ROW, SHAREGPT_ROW, SHAREGPT_ROW])
    (tmp_path / "cut.json").write_text(text[: len(text) - 30])
    items = read_all(tmp_path / "cut.json")
    assert [type(i) for i in items] == [Conversation, Conversation, Reject]
    assert items[2].reason.startswith("truncated JSON") and items[2].source.endswith(":3")


def test_missing_input_is_an_input_error(tmp_path):
    with pytest.raises(InputError, match=r"input '.*nope.jsonl' does not exist \(expected a .jsonl"):
        read_all(tmp_path / "nope.jsonl")
    (tmp_path / "fifo.jsonl").symlink_to("/dev/null")
    with pytest.raises(InputError, match="is not a regular file"):
        read_all(tmp_path / "fifo.jsonl")
    with pytest.raises(InputError, match="matches no file"):
        read_all(tmp_path / "nope*.jsonl")


@pytest.mark.shared_data
def test_glaive_tool_calling_set():
    from tests.conftest import shared_file

    items = read_all(shared_file("glaive_toolcall_en_demo.json"))
    assert len(items) == 300 and all(isinstance(i, Conversation) for i in items)
    roles = {m["role"] for c in items for m in c.messages}
    assert roles == {"user", "assistant", "tool"}
    assert sum(bool(c.tools) for c in items) == 191  # the others have tools "[]"
    assert sum(any(m.get("tool_calls") for m in c.messages) for c in items) == 153
    calls = [m for c in items for m in c.messages if m.get("tool_calls")]
    assert len(calls) == 211 and sum(m["role"] == "tool" for c in items for m in c.messages) == 211
    assert all(m["content"] is None and len(m["tool_calls"]) == 1 for m in calls)
    assert calls[0]["tool_calls"] == [{"type": "function", "function": {
        "name": "search_recipes", "arguments": {"ingredients": ["chicken", "bell peppers", "rice"]}}}]
    assert items[0].tools[0]["type"] == "function" and items[0].tools[0]["function"]["name"] == "search_recipes"
    assert sum(c.counts.get("sharegpt_function_calls", 0) for c in items) == 211
    assert sum(c.counts.get("sharegpt_observations", 0) for c in items) == 211


def test_tool_call_content_parts_become_tool_calls(tmp_path):
    row = {"tools": [{"type": "function", "function": {"name": "f"}}], "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [
            {"type": "reasoning", "value": "call f"},
            {"type": "tool_call", "name": "f", "arguments": {"x": 1}},
            {"type": "tool_call", "text": '{"name": "g", "arguments": {}}'}]},
        {"role": "tool", "content": [{"type": "text", "text": "1"}]},
        {"role": "assistant", "content": "done"},
    ]}
    (c,) = read_all(write_jsonl(tmp_path / "tc.jsonl", [row]))
    assert c.tools == row["tools"]
    assert c.messages[1] == {"role": "assistant", "content": [], "reasoning_content": "call f", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
        {"type": "function", "function": {"name": "g", "arguments": {}}}]}
    assert c.messages[2] == {"role": "tool", "content": "1"}
    bad = {"messages": [{"role": "user", "content": "go"},
                        {"role": "assistant", "content": [{"type": "tool_call", "text": "not json"}]}]}
    (r,) = read_all(write_jsonl(tmp_path / "bad.jsonl", [bad]))
    assert isinstance(r, Reject) and r.reason.startswith("invalid tool call")


def test_not_parquet_or_not_json_is_an_input_error_naming_the_file(tmp_path):
    fake = tmp_path / "fake.parquet"
    fake.write_text("just some text, not Parquet\n")
    with pytest.raises(InputError, match="not a readable Parquet file") as info:
        read_all(fake)
    assert info.value.file == str(fake) and str(fake) in str(info.value)
    text = tmp_path / "fake.json"
    text.write_text("hello, this is not JSON\n")
    with pytest.raises(InputError, match="not a readable JSON file") as info:
        read_all(text)
    assert info.value.file == str(text)


def test_unfinished_output_directory_as_input(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "part-00000.parquet").write_bytes(b"")
    with pytest.raises(InputError, match=r"an unfinished peagle output \(no manifest.json\)"):
        read_all(tmp_path / "half")


def test_null_content_and_empty_or_leading_assistant_turns(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]},
        {"conversations": [{"from": "human", "value": None}, {"from": "gpt", "value": "x"}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]},
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""},
                      {"role": "user", "content": "again"}, {"role": "assistant", "content": "ok"}]},
        {"conversations": [{"from": "gpt", "value": "Welcome"}, {"from": "human", "value": "hi"}]},
    ]
    a, b, c, d, e = read_all(write_jsonl(tmp_path / "n.jsonl", rows))
    assert a.reason == "turn with no content: messages[0].content is null"
    assert b.reason == "turn with no content: conversations[0].value is null"
    assert isinstance(c, Reject) and c.reason.startswith("no supervised tokens")
    assert isinstance(d, Conversation) and d.empty_assistant_turns == 1
    assert e.reason == "only a leading assistant turn (dropped)"


def test_ids_are_unique_across_files_and_repeats(tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
        write_jsonl(tmp_path / folder / "good.jsonl", [SHAREGPT_ROW, {**SHAREGPT_ROW, "id": "same"}])
    items = read_all(tmp_path / "a" / "good.jsonl", tmp_path / "b" / "good.jsonl", tmp_path / "a" / "good.jsonl")
    ids = [i.conversation_id for i in items]
    assert ids == ["a/good:1", "same", "b/good:1", "same~2", "a/good:1~2", "same~3"]
    assert len(set(ids)) == len(ids)
    assert sum(i.duplicate_id_renamed for i in items) == 3


# --------------------------------------------------------------------------------------------
# Invalid JSON: the reject names the line and column in the file (issue 16)


def test_invalid_json_names_line_and_column_of_the_file(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [OPENAI_ROW, b'{"messages": [{"role": "user",, "content": "x"}]}\n'])
    (_, bad) = read_all(tmp_path / "a.jsonl")
    assert bad.reason == "invalid JSON: Expecting property name enclosed in double quotes at line 2 column 31"
    pretty = ('[\n  {"messages": [\n    {"role": "user", "content": "Hi"},\n    {"role": "assistant", '
              '"content": "Yo"}\n  ]},\n  {"messages": [\n    {"role": "user",, "content": "x"}\n  ]}\n]\n')
    (tmp_path / "b.json").write_text(pretty)
    good, bad = read_all(tmp_path / "b.json")
    assert isinstance(good, Conversation)
    assert bad.source.endswith("b.json:2")  # the array element
    assert bad.reason == ("invalid JSON: Expecting property name enclosed in double quotes at line 7 column 21; "
                          "the rest of the file is not read")
    assert pretty.splitlines()[6][20] == ","  # line 7, column 21 (both from 1)
    (tmp_path / "c.json").write_text('{\n "messages": [\n  {"role": "user",, "content": "x"}\n ]\n}\n')
    (bad,) = read_all(tmp_path / "c.json")
    assert bad.reason == "invalid JSON: Expecting property name enclosed in double quotes at line 3 column 19"


def test_invalid_json_position_after_the_buffer_moved_on(tmp_path, monkeypatch):
    import peagle_data.readers.formats as readers

    monkeypatch.setattr(readers, "_CHUNK_CHARS", 64)  # force the streaming buffer to drop text
    rows = [json.dumps(SHAREGPT_ROW)] * 5 + ['{"conversations": [}']
    (tmp_path / "d.json").write_text("[\n" + ",\n".join(rows) + "\n]\n")
    items = read_all(tmp_path / "d.json")
    assert [type(i) for i in items] == [Conversation] * 5 + [Reject]
    assert items[5].reason == "invalid JSON: Expecting value at line 7 column 20; the rest of the file is not read"


# --------------------------------------------------------------------------------------------
# Parquet null keys from schema unification; JSON-string tool arguments (issue 11)


def _tool_row(param: str, value: str) -> dict:
    tool = {"type": "function", "function": {"name": f"get_{param}", "parameters": {
        "type": "object", "properties": {param: {"type": "string"}}, "required": [param]}}}
    return {"tools": [tool], "messages": [
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": f"get_{param}", "arguments": {param: value}}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Done."}]}


def test_parquet_schema_unification_nulls_are_dropped(tmp_path):
    rows = [_tool_row("city", "Lyon"), _tool_row("ticker", "ACME")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    raw = pq.read_table(tmp_path / "t.parquet").to_pylist()[0]  # what Arrow gives back
    assert raw["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Lyon", "ticker": None}
    assert raw["tools"][0]["function"]["parameters"]["properties"]["ticker"] is None
    a, b = read_all(tmp_path / "t.parquet")
    assert a.tools == rows[0]["tools"] and b.tools == rows[1]["tools"]
    assert a.messages[1]["tool_calls"] == rows[0]["messages"][1]["tool_calls"]
    assert b.messages[1]["tool_calls"][0]["function"]["arguments"] == {"ticker": "ACME"}
    assert a.messages[0] == {"role": "user", "content": "Look it up."}
    assert a.counts == {"null_keys_dropped_rows": 1} and b.counts == {"null_keys_dropped_rows": 1}
    # The same rows as JSONL keep what they say, an explicit null included.
    explicit = _tool_row("city", "Lyon")
    explicit["messages"][1]["tool_calls"][0]["function"]["arguments"]["unit"] = None
    (c,) = read_all(write_jsonl(tmp_path / "t.jsonl", [explicit]))
    assert c.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Lyon", "unit": None}
    assert c.counts == {}


def test_parquet_nulls_in_content_parts_and_turn_keys(tmp_path):
    rows = [  # parts with "text" in one row and "value" in another; ShareGPT turns with from/role
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]},
                      {"role": "assistant", "content": [{"type": "reasoning", "value": "r"},
                                                        {"type": "text", "value": "b"}],
                       "reasoning_content": None}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "c"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "d"}],
                       "reasoning_content": "think"}]},
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    a, b = read_all(tmp_path / "p.parquet")
    assert a.messages == [{"role": "user", "content": "a"},
                          {"role": "assistant", "content": "b", "reasoning_content": "r"}]
    assert b.messages == [{"role": "user", "content": "c"},
                          {"role": "assistant", "content": "d", "reasoning_content": "think"}]
    sharegpt = [{"conversations": [{"from": "human", "value": "x"}, {"from": "gpt", "value": "y"}]},
                {"conversations": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}]
    pq.write_table(pa.Table.from_pylist(sharegpt), tmp_path / "s.parquet")
    expected = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert [c.messages for c in read_all(tmp_path / "s.parquet")] == [expected, expected]


def test_json_string_tool_arguments_are_decoded(tmp_path):
    as_mapping = _tool_row("city", "Oslo")
    as_string = json.loads(json.dumps(as_mapping))
    as_string["messages"][1]["tool_calls"][0]["function"]["arguments"] = '{"city":"Oslo"}'
    as_string["tools"] = [json.dumps(as_mapping["tools"][0])]  # a tools entry as JSON text
    broken = json.loads(json.dumps(as_mapping))
    broken["messages"][1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Oslo"'
    legacy = {"messages": [{"role": "user", "content": "go"},
                           {"role": "assistant", "content": None,
                            "function_call": {"name": "get_city", "arguments": '{"city": "Oslo"}'}}]}
    a, b, c, d = read_all(write_jsonl(tmp_path / "s.jsonl", [as_mapping, as_string, broken, legacy]))
    assert b.messages == a.messages and b.tools == a.tools
    assert a.counts == {} and b.counts == {"tool_arguments_decoded": 1, "tool_schemas_decoded": 1}
    assert (c.reason, c.field) == (
        "invalid tool call: messages[1].tool_calls[0].function.arguments is text that is not a JSON object (vLLM "
        "renders such arguments as {}); fix or drop the call", "messages[1].tool_calls[0].function.arguments")
    assert d.messages[1] == {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_city", "arguments": {"city": "Oslo"}}}]}


def test_tool_calls_as_vllm_takes_them(tmp_path):
    def row(calls):
        return {"messages": [{"role": "user", "content": "go"},
                             {"role": "assistant", "content": None, "tool_calls": calls}]}

    flat, no_args, listed, other = read_all(write_jsonl(tmp_path / "c.jsonl", [
        row([{"id": "c1", "name": "f", "arguments": '{"x": 1}'}]), row([{"function": {"name": "f"}}]),
        row([{"function": {"name": "f", "arguments": [1]}}]), row([{"type": "custom", "custom": {"name": "f"}}])]))
    assert flat.messages[1]["tool_calls"] == [{"id": "c1", "type": "function",
                                               "function": {"name": "f", "arguments": {"x": 1}}}]
    assert flat.counts == {"tool_calls_wrapped": 1, "tool_arguments_decoded": 1}
    assert no_args.messages[1]["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": {}}}]
    assert listed.reason == ("invalid tool call: messages[1].tool_calls[0].function.arguments is a list, not a JSON "
                             "object (vLLM renders such arguments as {})")
    assert other.reason == ('invalid tool call: messages[1].tool_calls[0] is not a function call with a name '
                            '(expected {"type": "function", "function": {"name", "arguments"}})')


def test_unsupported_content_parts_reject_or_are_counted(tmp_path):
    row = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}},
                                                      {"type": "text", "text": "What is this?"}]},
                        {"role": "assistant", "content": "A cat."}]}
    path = write_jsonl(tmp_path / "img.jsonl", [row])
    (r,) = read_all(path)
    assert isinstance(r, Reject) and r.reason.startswith("unsupported content part: messages[0].content[0] has "
                                                         "type 'image_url'")
    (c,) = read_all(path, keep_dropped=True)
    assert c.messages[0] == {"role": "user", "content": "What is this?"}
    assert c.counts == {"dropped_content_parts": 1}


def test_whitespace_only_assistant_turns_are_empty(tmp_path):
    path = tmp_path / "ws.jsonl"
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "  \n"}]},
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\t",
                                                              "reasoning_content": " "},
                          {"role": "user", "content": "Hm?"}, {"role": "assistant", "content": "Yes."}]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = read_conversations([path])
    assert isinstance(a, Reject) and a.reason == "no supervised tokens: every assistant turn is empty"
    assert isinstance(b, Conversation) and b.empty_assistant_turns == 1


@pytest.mark.parametrize("chunk", [5, 1 << 20])
def test_text_after_a_json_arrays_end_is_a_reject_not_ignored(tmp_path, monkeypatch, chunk):
    # Two arrays concatenated into one file (cat a.json b.json): the second one's rows were dropped silently.
    import peagle_data.readers.formats as readers

    monkeypatch.setattr(readers, "_CHUNK_CHARS", chunk)
    conv = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    path = tmp_path / "two.json"
    path.write_text(json.dumps([conv]) + "\n" + json.dumps([conv, conv]) + "\n")
    items = list(read_conversations([path], keep_dropped=False))
    assert [type(i).__name__ for i in items] == ["Conversation", "Reject"]
    assert items[1].source == f"{path}:2"
    assert items[1].reason == ("invalid JSON: extra data after the array's closing ']' at line 2 column 1 (two "
                               "arrays in one file?); the rest of the file is not read")
    (tmp_path / "ok.json").write_text(json.dumps([conv]) + " \r\n\n")  # whitespace after it is fine
    assert [type(i).__name__ for i in read_conversations([tmp_path / "ok.json"])] == ["Conversation"]


def test_finish_reason_of_a_complete_turn_is_dropped_and_length_kept():
    from peagle_data.readers.normalize import normalize_record

    def last(reason):
        row = {"messages": [{"role": "user", "content": "q"},
                            {"role": "assistant", "content": "a", "finish_reason": reason}]}
        return normalize_record(row)[0][-1]

    for complete in ("stop", "tool_calls", "function_call", None):
        assert last(complete) == {"role": "assistant", "content": "a"}
    assert last("length") == {"role": "assistant", "content": "a", "finish_reason": "length"}
    sharegpt = {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "finish_reason": "length"}]}
    assert normalize_record(sharegpt)[0][-1] == {"role": "assistant", "content": "a", "finish_reason": "length"}


def test_tool_call_arguments_under_another_key_or_no_object_reject_the_row(tmp_path):
    """A call whose arguments sit under another key (``parameters``, Llama-3.1 style) or are a falsy
    non-object (``[]``, ``0``) is refused in every form, never rendered as ``{}``."""
    def sharegpt(value):
        return {"conversations": [{"from": "human", "value": "go"}, {"from": "function_call", "value": value},
                                  {"from": "observation", "value": "1"}, {"from": "gpt", "value": "done"}]}

    def openai(assistant):
        return {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", **assistant}]}

    rows = [sharegpt('{"name": "f", "parameters": {"x": 1}}'),
            sharegpt('{"name": "f", "arguments": []}'),
            sharegpt('{"name": "f", "arguments": 0}'),
            openai({"content": [{"type": "tool_call", "name": "f", "parameters": {"x": 1}}]}),
            openai({"content": [{"type": "tool_call", "name": "f", "arguments": []}]}),
            openai({"content": None, "tool_calls": [{"name": "f", "parameters": {"x": 1}}]}),
            openai({"content": None, "tool_calls": [{"type": "function", "function": {"name": "f",
                                                                                      "parameters": {"x": 1}}}]}),
            openai({"content": None, "function_call": {"name": "f", "parameters": {"x": 1}}}),
            sharegpt('{"name": "f"}')]
    items = read_all(write_jsonl(tmp_path / "calls.jsonl", rows))
    reasons = [getattr(item, "reason", None) for item in items]
    assert reasons[:-1] == [
        "invalid tool call: conversations[1].value has the key 'parameters' (a call's arguments go under "
        "'arguments'; rename it)",
        "invalid tool call: conversations[1].value.function.arguments is a list, not a JSON object "
        "(vLLM renders such arguments as {})",
        "invalid tool call: conversations[1].value.function.arguments is a int, not a JSON object "
        "(vLLM renders such arguments as {})",
        "invalid tool call: messages[1].content[0] has the key 'parameters' (a call's arguments go under "
        "'arguments'; rename it)",
        "invalid tool call: messages[1].content.function.arguments is a list, not a JSON object "
        "(vLLM renders such arguments as {})",
        "invalid tool call: messages[1].tool_calls[0] has the key 'parameters' (a call's arguments go under "
        "'arguments'; rename it)",
        "invalid tool call: messages[1].tool_calls[0].function has the key 'parameters' (a call's arguments go "
        "under 'arguments'; rename it)",
        "invalid tool call: messages[1].function_call has the key 'parameters' (a call's arguments go under "
        "'arguments'; rename it)",
    ]
    assert items[-1].messages[1]["tool_calls"] == [{"type": "function", "function": {"name": "f", "arguments": {}}}]


def test_reasoning_field_is_read_as_vllm_reads_it(tmp_path):
    """``reasoning`` (vLLM's request field; ``reasoning_content`` is its deprecated name) is the turn's
    reasoning; both given and different rejects the row."""
    def row(**fields):
        return {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", **fields}]}

    items = read_all(write_jsonl(tmp_path / "r.jsonl", [
        row(reasoning="why"), row(reasoning="why", reasoning_content="why"),
        row(reasoning="why", reasoning_content="other")]))
    assert items[0].messages[1] == {"role": "assistant", "content": "a", "reasoning_content": "why"}
    assert items[1].messages[1] == {"role": "assistant", "content": "a", "reasoning_content": "why"}
    assert items[2].reason == ("conflicting reasoning: messages[1] has both 'reasoning' and 'reasoning_content' "
                               "and they differ; keep one")


def test_a_reasoning_only_turn_with_null_content_is_kept(tmp_path):
    """``content: null`` beside reasoning (an answer cut inside its think block, R1-style rows): vLLM
    renders the reasoning and an empty content, so the turn is kept; null content with nothing else
    still rejects."""
    rows = [{"messages": [{"role": "user", "content": "q"},
                          {"role": "assistant", "content": None, "reasoning": "hmm"}]},
            {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]}]
    kept, rejected = read_all(write_jsonl(tmp_path / "r.jsonl", rows))
    assert kept.messages[1] == {"role": "assistant", "content": None, "reasoning_content": "hmm"}
    assert rejected.reason == "turn with no content: messages[1].content is null"


def test_a_name_or_tool_call_id_that_is_no_text_rejects_the_row(tmp_path):
    """vLLM's request model refuses a message ``name``, ``tool_call_id`` or tool-call ``id`` that is no
    string, so no served prompt renders it (peagle passed ``5`` to the template)."""
    rows = [{"messages": [{"role": "user", "content": "q", "name": 5}, {"role": "assistant", "content": "a"}]},
            {"messages": [{"role": "user", "content": "q"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                          {"role": "tool", "content": "r", "tool_call_id": 1}, {"role": "assistant", "content": "a"}]},
            {"messages": [{"role": "user", "content": "q", "name": "ann"}, {"role": "assistant", "content": "a"}]},
            {"messages": [{"role": "user", "content": "q"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": 7, "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}]
    a, b, c, d = read_all(write_jsonl(tmp_path / "n.jsonl", rows))
    assert d.reason == "invalid tool call: messages[1].tool_calls[0].id is a int, expected text"
    assert a.reason == "invalid name: messages[0].name is a int, expected text"
    assert b.reason == "invalid tool_call_id: messages[2].tool_call_id is a int, expected text"
    assert c.messages[0] == {"role": "user", "content": "q", "name": "ann"}


def test_a_thinking_part_holds_its_text_under_thinking(tmp_path):
    """``{"type": "thinking", "thinking": ...}`` (the form vLLM's and Anthropic's messages use) is the
    turn's reasoning; it was refused as content that is no text."""
    row = {"messages": [{"role": "user", "content": "q"},
                        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t"},
                                                          {"type": "text", "text": "a"}]}]}
    (c,) = read_all(write_jsonl(tmp_path / "t.jsonl", [row]))
    assert c.messages[1] == {"role": "assistant", "content": "a", "reasoning_content": "t"}


def test_sharegpt_turns_keep_token_ids_like_openai_turns(tmp_path):
    """A ShareGPT assistant turn's ``token_ids`` are kept (and checked) as an OpenAI turn's are; they
    were dropped, so tokenize re-tokenized the text without comparing it with the generated ids."""
    rows = [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "token_ids": [64, 2]}]},
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "token_ids": [-1]}]}]
    good, bad = read_all(write_jsonl(tmp_path / "s.jsonl", rows))
    assert good.messages[1] == {"role": "assistant", "content": "a", "token_ids": [64, 2]}
    assert bad.reason == "invalid token_ids: conversations[1].token_ids must be a list of token ids (ints >= 0)"


def test_a_truncated_jsonl_line_is_said_to_be_cut_short(tmp_path):
    """Issue 44 item 11: a line cut short was rejected as "invalid JSON: Invalid control character at at line 3"
    (Python's message ends in "at"; the newline ended the line inside a string). A line whose record is still open
    where it ends is "truncated JSON" (its own reject key), and no message says "at at"."""
    whole = json.dumps(OPENAI_ROW)
    write_jsonl(tmp_path / "cut.jsonl", [OPENAI_ROW, OPENAI_ROW, whole[:40].encode() + b"\n",
                                         whole[:14].encode() + b"\n", b'{"messages": [{"role": "user",, "x": 1}]}\n',
                                         b'{"a": "tab\there"}\n'])
    items = read_all(tmp_path / "cut.jsonl")
    assert [type(i) for i in items] == [Conversation, Conversation, Reject, Reject, Reject, Reject]
    assert items[2].reason == "truncated JSON: line 3 is cut short: its record is still open where the line ends (column 41)"
    assert items[3].reason == "truncated JSON: line 4 is cut short: its record is still open where the line ends (column 15)"
    assert items[4].reason == "invalid JSON: Expecting property name enclosed in double quotes at line 5 column 31"
    assert items[5].reason == "invalid JSON: Invalid control character at line 6 column 11"  # a raw tab: not "at at"
    (tmp_path / "end.jsonl").write_bytes(whole.encode() + b"\n" + whole[:40].encode())  # cut at the file's end
    assert read_all(tmp_path / "end.jsonl")[1].reason == (
        "truncated JSON: line 2 is cut short: its record is still open where the line ends (column 41; "
        "Unterminated string starting at column 36)")  # the string "user
