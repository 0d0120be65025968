"""Content a chat template drops is never trained on silently (issue 16), JSON-string tool
arguments render like mappings and a generation prompt that injects text is named (issue 11).

Five template families (those of test_template_families: SmolLM2's ChatML, Llama 3, Gemma, Mistral,
Qwen3), each given a conversation holding content it does not render.
"""

from __future__ import annotations

import json

import pytest

from peagle_data.chat.dropped import dropped_content
from peagle_data.chat.render import render_rows
from peagle_data.chat.tokens import tokenize_conversation, tokenize_turns
from runtime.chat.chat_template import ChatTemplateError
from peagle_data.readers.conversations import read_conversations
from tests.peagle_data.chat.test_tokens import masked_texts, reference_ids, runs
from tests.peagle_data.chat.test_template_families import (  # noqa: F401 - fixtures
    GEMMA, LLAMA3, MISTRAL, QWEN3, _with_tokens, gemma_tok, llama3_tok, mistral_tok, qwen3_tok)

CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
TOOL_CALL_TURNS = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temp": 3}'},
    {"role": "assistant", "content": "It is 3 degrees."},
]
REASONING_TURNS = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4.", "reasoning_content": "Two and two make four."},
]


# --------------------------------------------------------------------------------------------
# SmolLM2 (ChatML without tool or reasoning support)


def test_chatml_tool_call_turn_is_rejected_not_trained_as_a_bare_im_end(smollm2_tokenizer):
    tok = smollm2_tokenizer
    with pytest.raises(ChatTemplateError) as info:
        tokenize_conversation(tok, TOOL_CALL_TURNS)
    assert str(info.value).startswith("template drops tool_calls: the tool_calls of message 1 (assistant) does "
                                      "not appear in the render (the template has no tool-call support)")
    # Kept on request: the call's turn renders as a bare <|im_end|>, which is not supervised.
    out = tokenize_conversation(tok, TOOL_CALL_TURNS, on_dropped="keep")
    assert out.input_ids.tolist() == reference_ids(tok, TOOL_CALL_TURNS)
    assert masked_texts(tok, out) == ["It is 3 degrees.<|im_end|>"]
    bare = tok.decode(out.input_ids).index("<|im_start|>assistant\n<|im_end|>")
    assert bare > 0
    (a, b), = runs(out.loss_mask)
    assert tok.decode(out.input_ids[a:b]) == "It is 3 degrees.<|im_end|>" and b == len(out.input_ids) - 1
    (row,) = render_rows(tok, TOOL_CALL_TURNS, on_dropped="keep")
    assert row.dropped == ("tool_calls of message 1",)


def test_chatml_drops_reasoning_and_tools(smollm2_tokenizer):
    tok = smollm2_tokenizer
    with pytest.raises(ChatTemplateError, match=r"^template drops reasoning_content: the reasoning_content of "
                                                r"message 1 \(assistant\) does not appear"):
        tokenize_conversation(tok, REASONING_TURNS)
    out = tokenize_conversation(tok, REASONING_TURNS, on_dropped="keep")  # the answer is rendered: kept
    assert masked_texts(tok, out) == ["4.<|im_end|>"]
    plain = TOOL_CALL_TURNS[:1] + [{"role": "assistant", "content": "Sunny."}]
    with pytest.raises(ChatTemplateError, match=r"^template drops tools: the tools passed with the conversation "
                                                r"do not appear in the render \(the template ignores the tools"):
        tokenize_conversation(tok, plain, tools=TOOLS)
    assert dropped_content(tok, plain, tok.apply_chat_template(plain, tokenize=False), {1: (0, 0)}, TOOLS) == [
        (None, "tools", False), (1, "content", True)]  # an empty span holds nothing of message 1


# --------------------------------------------------------------------------------------------
# Llama 3, Gemma, Mistral: no tool calls or reasoning; a Gemma variant without system support


def test_llama3_drops_tool_calls_but_renders_the_tool_result(llama3_tok):
    with pytest.raises(ChatTemplateError, match="^template drops tool_calls: the tool_calls of message 1 "):
        tokenize_conversation(llama3_tok, TOOL_CALL_TURNS, chat_template=LLAMA3)
    out = tokenize_conversation(llama3_tok, TOOL_CALL_TURNS, chat_template=LLAMA3, on_dropped="keep")
    assert masked_texts(llama3_tok, out) == ["It is 3 degrees.<|eot_id|>"]
    assert '{"temp": 3}' in llama3_tok.decode(out.input_ids)  # the tool turn is context, rendered
    no_tools = LLAMA3.replace("{% for m in messages %}", "{% for m in messages if m.role != 'tool' %}")
    plain_calls = [TOOL_CALL_TURNS[0], {"role": "assistant", "content": "Calling get_weather(city=Oslo)."}] + \
        TOOL_CALL_TURNS[2:]
    with pytest.raises(ChatTemplateError, match=r"^template drops content: the content of message 2 \(tool\) does "
                                                r"not appear in the render \(the template does not render it\)"):
        tokenize_conversation(llama3_tok, plain_calls, chat_template=no_tools)
    out = tokenize_conversation(llama3_tok, plain_calls, chat_template=no_tools, on_dropped="keep")
    assert masked_texts(llama3_tok, out) == ["Calling get_weather(city=Oslo).<|eot_id|>", "It is 3 degrees.<|eot_id|>"]


def test_gemma_drops_reasoning_and_a_partial_tool_call_turn_keeps_its_text(gemma_tok):
    with pytest.raises(ChatTemplateError, match="^template drops reasoning_content: the reasoning_content of "
                                                "message 1 "):
        tokenize_conversation(gemma_tok, REASONING_TURNS, chat_template=GEMMA)
    turns = [{"role": "user", "content": "Weather in Oslo?"},
             {"role": "assistant", "content": "Let me check.", "tool_calls": [CALL]}]
    with pytest.raises(ChatTemplateError, match="^template drops tool_calls: "):
        tokenize_conversation(gemma_tok, turns, chat_template=GEMMA)
    out = tokenize_conversation(gemma_tok, turns, chat_template=GEMMA, on_dropped="keep")
    assert masked_texts(gemma_tok, out) == ["Let me check.<end_of_turn>"]  # what is rendered is trained


GEMMA_NO_SYSTEM = GEMMA.replace("{% if messages[0].role == 'system' %}{% set first_user_prefix = "
                                "messages[0].content + '\n\n' %}", "{% if messages[0].role == 'system' %}"
                                "{% set first_user_prefix = '' %}")


def test_a_system_message_the_template_drops(gemma_tok):
    turns = [{"role": "system", "content": "Answer in French."}] + REASONING_TURNS[:1] + [
        {"role": "assistant", "content": "Quatre."}]
    with pytest.raises(ChatTemplateError, match=r"^template drops content: the content of message 0 \(system\)"):
        tokenize_conversation(gemma_tok, turns, chat_template=GEMMA_NO_SYSTEM)
    out = tokenize_conversation(gemma_tok, turns, chat_template=GEMMA, on_dropped="keep")  # rendered: nothing dropped
    assert masked_texts(gemma_tok, out) == ["Quatre.<end_of_turn>"]


def test_mistral_per_turn_rows_check_each_row(mistral_tok):
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet."},
             {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye."}]
    with pytest.raises(ChatTemplateError, match="^template drops reasoning_content: the reasoning_content of "
                                                "message 2 "):
        tokenize_turns(mistral_tok, turns, chat_template=MISTRAL)
    rows = tokenize_turns(mistral_tok, turns, chat_template=MISTRAL, on_dropped="keep")
    assert [(t, masked_texts(mistral_tok, o)) for t, o in rows] == [(2, [" Hello.</s>"]), (4, [" Bye.</s>"])]


def test_tool_results_rendered_with_tojson_are_found(llama3_tok):
    # Llama 3.1 renders a tool message's content with tojson (a string is iterable in Jinja).
    template = LLAMA3.replace("m.content | trim", "(m.content | tojson if m.role == 'tool' else m.content | trim)")
    turns = [TOOL_CALL_TURNS[0], {"role": "assistant", "content": "Calling."},
             {"role": "tool", "content": 'Line 1\n{"temp": 3}'}, TOOL_CALL_TURNS[3]]
    out = tokenize_conversation(llama3_tok, turns, chat_template=template)
    assert '"Line 1\\n{\\"temp\\": 3}"' in llama3_tok.decode(out.input_ids)
    assert masked_texts(llama3_tok, out) == ["Calling.<|eot_id|>", "It is 3 degrees.<|eot_id|>"]


# --------------------------------------------------------------------------------------------
# Qwen3 renders everything: nothing is flagged, history-dropped reasoning of context turns included


def test_qwen3_renders_tools_calls_results_and_reasoning(qwen3_tok):
    turns = [{"role": "user", "content": "Weather in Oslo?"},
             {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [CALL]},
             {"role": "tool", "content": '{"temp": 3}'},
             {"role": "assistant", "content": "It is 3 degrees.", "reasoning_content": "Report it."},
             {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "You are welcome."}]
    rows = render_rows(qwen3_tok, turns, tools=TOOLS, chat_template=QWEN3)
    assert [r.turn for r in rows] == [1, 3, 5] and all(r.dropped == () for r in rows)
    last = tokenize_turns(qwen3_tok, turns, tools=TOOLS, chat_template=QWEN3)[-1][1]
    assert "Report it." not in qwen3_tok.decode(last.input_ids)  # the template's history, not a drop
    assert masked_texts(qwen3_tok, last) == ["You are welcome.<|im_end|>"]


# --------------------------------------------------------------------------------------------
# JSON-string tool arguments give the ids and masks of the mapping form (issue 11)

TOJSON_CALLS = (  # a Hermes-style ChatML template that always applies tojson to the arguments
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", ["qwen3", "tojson"])
def test_json_string_arguments_tokenize_like_a_mapping(tmp_path, qwen3_tok, template):
    template = QWEN3 if template == "qwen3" else TOJSON_CALLS
    as_mapping = {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                               {"role": "assistant", "content": None, "tool_calls": [CALL]}]}
    as_string = json.loads(json.dumps(as_mapping))
    as_string["messages"][1]["tool_calls"][0]["function"]["arguments"] = '{"city":"Oslo"}'
    path = tmp_path / "calls.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (as_mapping, as_string)))
    a, b = [tokenize_conversation(qwen3_tok, c.messages, c.tools, template) for c in read_conversations([path])]
    assert a.input_ids.tolist() == b.input_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
    (span,) = masked_texts(qwen3_tok, b)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>' in span


# --------------------------------------------------------------------------------------------
# A generation prompt that injects text (R1-Distill style) is named as the cause (issue 11)

R1 = ("{{ '<｜begin▁of▁sentence｜>' }}{% for m in messages %}"
      "{% if m.role == 'user' %}{{ '<｜User｜>' + m.content }}"
      "{% elif m.role == 'assistant' %}{% set content = m.content %}"
      "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
      "{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{% endif %}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")
# The training form: each assistant turn is the generation prompt, the reasoning and the answer.
R1_TRAINING = R1.replace("{% set content = m.content %}{% if '</think>' in content %}{% set content = "
                         "content.split('</think>')[-1] %}{% endif %}{{ '<｜Assistant｜>' + content",
                         "{{ '<｜Assistant｜><think>\\n' + (m.reasoning_content or '') + '\\n</think>\\n\\n' "
                         "+ m.content")


@pytest.fixture(scope="module")
def r1_tok(smollm2_tokenizer):
    return _with_tokens(smollm2_tokenizer, ["<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                                            "<｜end▁of▁sentence｜>"])


def test_r1_generation_prompt_mismatch_names_the_cause_and_the_fix(r1_tok):
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    expected = ("generation prompt mismatch: the template's generation prompt adds '<｜Assistant｜><think>\\n' "
                "after the history, but assistant turn 1 renders as '<｜Assistant｜>Hello!<｜end▁of▁sentence｜>'...; "
                "no exact mask exists. Pass --chat-template FILE with a training template that keeps the reasoning")
    for call in (tokenize_conversation, tokenize_turns):
        with pytest.raises(ChatTemplateError) as info:
            call(r1_tok, plain, chat_template=R1)
        assert str(info.value).startswith(expected)
    inline = [plain[0], {"role": "assistant", "content": "<think>\nGreet.\n</think>\n\nHello!"}]
    with pytest.raises(ChatTemplateError, match=r"and it drops the reasoning of assistant turn 1 \(rendered turns "
                                                r"keep only the text after </think>, as R1-Distill templates do\)"):
        tokenize_turns(r1_tok, inline, chat_template=R1)
    # The advised fix works: the opening <think> is context, the reasoning and answer are trained.
    turns = [plain[0], {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."}]
    out = tokenize_conversation(r1_tok, turns, chat_template=R1_TRAINING)
    assert masked_texts(r1_tok, out) == ["Greet.\n</think>\n\nHello!<｜end▁of▁sentence｜>"]
    assert out.input_ids.tolist() == reference_ids(r1_tok, turns, chat_template=R1_TRAINING)


def test_an_empty_history_is_still_a_history_rewrite(smollm2_tokenizer):
    with pytest.raises(ChatTemplateError, match="^template rewrites history"):
        tokenize_conversation(smollm2_tokenizer, [{"role": "assistant", "content": "Hello!"}])


# --------------------------------------------------------------------------------------------
# Parquet rows tokenize like the same rows in JSONL: no invented null argument or tool parameter


def test_parquet_tool_rows_tokenize_like_jsonl(tmp_path, qwen3_tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def row(param, value):
        return {"tools": [{"type": "function", "function": {"name": f"get_{param}", "parameters": {
                    "type": "object", "properties": {param: {"type": "string"}}}}}],
                "messages": [{"role": "user", "content": "Look it up."},
                             {"role": "assistant", "content": None, "tool_calls": [
                                 {"type": "function", "function": {"name": f"get_{param}",
                                                                   "arguments": {param: value}}}]}]}

    rows = [row("city", "Lyon"), row("ticker", "ACME")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenized = [[tokenize_conversation(qwen3_tok, c.messages, c.tools, QWEN3) for c in read_conversations([p])]
                 for p in (tmp_path / "t.parquet", tmp_path / "t.jsonl")]
    for from_parquet, from_jsonl in zip(*tokenized):
        assert from_parquet.input_ids.tolist() == from_jsonl.input_ids.tolist()
        assert from_parquet.loss_mask.tolist() == from_jsonl.loss_mask.tolist()
    lyon = tokenized[0][0]
    assert masked_texts(qwen3_tok, lyon) == [
        '<tool_call>\n{"name": "get_city", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>']
    system = qwen3_tok.decode(lyon.input_ids[: lyon.system_len])
    assert '"properties": {"city": {"type": "string"}}' in system and "ticker" not in system


# --------------------------------------------------------------------------------------------
# Text that appears twice: the copy a template keeps does not vouch for the copy it drops


SKIP_TOOL = LLAMA3.replace("{% for m in messages %}", "{% for m in messages if m.role != 'tool' %}")
ECHO_TURNS = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "Checking."},
              {"role": "tool", "content": "Sunny"}, {"role": "assistant", "content": "Sunny"}]


def test_a_dropped_tool_result_that_the_answer_repeats_is_found(llama3_tok):
    with pytest.raises(ChatTemplateError, match=r"^template drops content: the content of message 2 \(tool\) does "
                                                r"not appear in the render"):
        tokenize_conversation(llama3_tok, ECHO_TURNS, chat_template=SKIP_TOOL)
    text = llama3_tok.apply_chat_template(ECHO_TURNS, tokenize=False, chat_template=SKIP_TOOL)
    assert text.count("Sunny") == 1  # the answer's copy only
    # A template that renders the tool turn: both copies are there, nothing is dropped.
    out = tokenize_conversation(llama3_tok, ECHO_TURNS, chat_template=LLAMA3)
    assert masked_texts(llama3_tok, out) == ["Checking.<|eot_id|>", "Sunny<|eot_id|>"]


def test_a_dropped_repeated_user_message_is_found(llama3_tok):
    first_user_only = LLAMA3.replace("{% for m in messages %}", "{% for m in messages %}{% if m.role != 'user' "
                                                                "or loop.first %}").replace("{% endfor %}",
                                                                                            "{% endif %}{% endfor %}")
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
             {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello again"}]
    with pytest.raises(ChatTemplateError, match=r"^template drops content: the content of message 2 \(user\)"):
        tokenize_conversation(llama3_tok, turns, chat_template=first_user_only)
    out = tokenize_conversation(llama3_tok, turns, chat_template=LLAMA3)
    assert masked_texts(llama3_tok, out) == ["Hello<|eot_id|>", "Hello again<|eot_id|>"]
    assert llama3_tok.decode(out.input_ids).count("<|end_header_id|>\n\nHi<|eot_id|>") == 2


def test_a_dropped_tool_call_that_the_turns_text_mentions_is_found(smollm2_tokenizer):
    tok = smollm2_tokenizer
    turns = [{"role": "user", "content": "Weather in Oslo?"},
             {"role": "assistant", "content": "I will call get_weather with city Oslo.", "tool_calls": [CALL]}]
    with pytest.raises(ChatTemplateError, match=r"^template drops tool_calls: the tool_calls of message 1 "):
        tokenize_conversation(tok, turns)
    out = tokenize_conversation(tok, turns, on_dropped="keep")
    assert masked_texts(tok, out) == ["I will call get_weather with city Oslo.<|im_end|>"]
    # Rendered by a template with tool calls, the same turn claims its text and its call apart.
    rows = render_rows(tok, turns, chat_template=TOJSON_CALLS)
    assert rows[0].dropped == () and rows[0].text.count("get_weather") == 2


@pytest.mark.parametrize("family", ["chatml", "llama3"])
def test_a_whitespace_only_reply_supervises_nothing(smollm2_tokenizer, llama3_tok, family):
    tok, template, eot = ((smollm2_tokenizer, None, "<|im_end|>") if family == "chatml"
                          else (llama3_tok, LLAMA3, "<|eot_id|>"))
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " \n "},
             {"role": "user", "content": "Still there?"}, {"role": "assistant", "content": "Yes."}]
    out = tokenize_conversation(tok, turns, chat_template=template)
    assert out.input_ids.tolist() == reference_ids(tok, turns, chat_template=template)
    assert masked_texts(tok, out) == [f"Yes.{eot}"]  # not a bare end-of-turn token, nor blanks
