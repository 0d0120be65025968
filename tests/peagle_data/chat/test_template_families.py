"""Loss masks on five template families and tool calls, on copies of the real SmolLM2 tokenizer.

Each family is a Jinja template written here (no ``{% generation %}`` tags), with its control
tokens added as special tokens to a copy of the tokenizer, as the real models ship them. For every
assistant turn, the decoded supervised tokens are exactly the rendered content (reasoning and
tool-call text included) and the end-of-turn token; ids always equal ``apply_chat_template``.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from peagle_data.chat.render import render_rows
from peagle_data.chat.tokens import tokenize_conversation, tokenize_turns
from runtime.chat.chat_template import ChatTemplateError, prompt_ids
from tests.chat_templates import newline_runs_whole
from tests.peagle_data.chat.test_tokens import masked_texts, runs

# --------------------------------------------------------------------------------------------
# Templates

LLAMA3 = (
    "{{ '<|begin_of_text|>' }}"
    "{% for m in messages %}{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content | trim"
    " + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

GEMMA = (
    "{{ '<bos>' }}"
    "{% if messages[0].role == 'system' %}{% set first_user_prefix = messages[0].content + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}"
    "{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if m.role == 'assistant' else m.role %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ m.content | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

# Mistral v0.3 style: the system prompt goes into the LAST user turn, so earlier renders change.
MISTRAL = (
    "{{ '<s>' }}"
    "{% if messages[0].role == 'system' %}{% set system_message = messages[0].content %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in loop_messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in loop_messages %}"
    "{% if m.role == 'user' %}"
    "{% if loop.index0 == ns.last_user and system_message is defined %}"
    "{{ '[INST] ' + system_message + '\n\n' + m.content + '[/INST]' }}"
    "{% else %}{{ '[INST] ' + m.content + '[/INST]' }}{% endif %}"
    "{% elif m.role == 'assistant' %}{{ ' ' + m.content + '</s>' }}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported') }}{% endif %}"
    "{% endfor %}"
)

# Qwen3 style: tools in the system turn, <think> blocks kept only for turns after the last user
# query (earlier reasoning is dropped from the history), the last turn always gets a think block
# (an empty one when there is no reasoning), tool calls as <tool_call> JSON, tool results in a
# user turn.
QWEN3 = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query_index=messages|length - 1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query_index = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content or '' %}{%- set reasoning = m.reasoning_content or '' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning) %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content }}"
    "{%- if m.tool_calls %}{%- for tc in m.tool_calls %}"
    "{%- if (loop.first and content) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + tc.function.name + '\", \"arguments\": ' }}"
    "{{- tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A reasoning model whose generation prompt opens the think block: the rendered turn holds the
# reasoning and </think> but the verifier never generates the opening <think>.
OPEN_THINK = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}<think>\n{{ m.reasoning_content or '' }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


def _with_tokens(tok, special=(), added=()):
    out = copy.deepcopy(tok)
    if special:
        out.add_special_tokens({"additional_special_tokens": list(special)})
    if added:
        out.add_tokens(list(added))
    return out


@pytest.fixture(scope="module")
def llama3_tok(smollm2_tokenizer):  # Llama 3's own split keeps the header's "\n\n" whole before the reply
    return _with_tokens(newline_runs_whole(smollm2_tokenizer),
                        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])


@pytest.fixture(scope="module")
def gemma_tok(smollm2_tokenizer):
    return _with_tokens(smollm2_tokenizer, ["<bos>", "<start_of_turn>", "<end_of_turn>"])


@pytest.fixture(scope="module")
def mistral_tok(smollm2_tokenizer):
    return _with_tokens(smollm2_tokenizer, ["<s>", "</s>", "[INST]", "[/INST]"])


@pytest.fixture(scope="module")
def qwen3_tok(smollm2_tokenizer):
    return _with_tokens(newline_runs_whole(smollm2_tokenizer),
                        added=["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                               "</tool_response>"])


# --------------------------------------------------------------------------------------------
# Helpers


def check(tok, messages, template, expected_spans, expected_prefix=None, tools=None):
    """Tokenize, compare ids with apply_chat_template, and the supervised spans with the expected."""
    out = tokenize_conversation(tok, messages, tools=tools, chat_template=template)
    kw = {"tools": tools} if tools is not None else {}
    reference = tok.apply_chat_template(messages, tokenize=True, return_dict=False, chat_template=template, **kw)
    assert out.input_ids.tolist() == list(reference)
    assert masked_texts(tok, out) == expected_spans
    if expected_prefix is not None:
        assert tok.decode(out.input_ids[: out.system_len]) == expected_prefix
    assert not out.loss_mask[: out.system_len].any()
    return out


TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6."},
]


# --------------------------------------------------------------------------------------------
# Families


def test_chatml_smollm2_default_system(smollm2_tokenizer):
    check(smollm2_tokenizer, TWO_TURNS[1:], None, ["2+2 is 4.<|im_end|>", "It is 6.<|im_end|>"],
          "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n")


def test_llama3_headers(llama3_tok):
    out = check(llama3_tok, TWO_TURNS, LLAMA3, ["2+2 is 4.<|eot_id|>", "It is 6.<|eot_id|>"],
                "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>")
    # Headers and user turns stay at 0.
    assert "<|start_header_id|>assistant" in llama3_tok.decode(out.input_ids[out.loss_mask == 0])


def test_llama3_reply_ending_in_blank_lines_is_trimmed_as_rendered(llama3_tok):
    messages = [{"role": "user", "content": "List?"}, {"role": "assistant", "content": "- a\n- b\n\n"}]
    check(llama3_tok, messages, LLAMA3, ["- a\n- b<|eot_id|>"], "<|begin_of_text|>")


def test_gemma_system_inside_first_user_turn(gemma_tok):
    out = check(gemma_tok, TWO_TURNS, GEMMA, ["2+2 is 4.<end_of_turn>", "It is 6.<end_of_turn>"],
                "<bos><start_of_turn>user\nBe brief.\n\n")
    # The user's own text is not part of the prefix, and the trailing "\n" glue is not supervised.
    assert gemma_tok.decode(out.input_ids[out.system_len:]).startswith("What is 2+2?")
    check(gemma_tok, TWO_TURNS[1:], GEMMA, ["2+2 is 4.<end_of_turn>", "It is 6.<end_of_turn>"], "<bos>")


def test_gemma_roles_must_alternate_is_a_template_error(gemma_tok):
    with pytest.raises(ChatTemplateError, match="template error"):
        tokenize_conversation(gemma_tok, [{"role": "assistant", "content": "x"}], chat_template=GEMMA)


def test_mistral_inst_without_system(mistral_tok):
    check(mistral_tok, TWO_TURNS[1:], MISTRAL, [" 2+2 is 4.</s>", " It is 6.</s>"], "<s>")


def test_mistral_system_in_last_user_turn_gives_one_row_per_turn(mistral_tok):
    # The system prompt moves to the last user turn, so the first turn's context is rendered
    # differently in the full conversation: whole-conversation masks would be a guess.
    with pytest.raises(ChatTemplateError) as info:
        tokenize_conversation(mistral_tok, TWO_TURNS, chat_template=MISTRAL)
    assert str(info.value) == (
        "template rewrites history: the render up to assistant turn 2 is not a prefix of the whole conversation's "
        "render; it moves the system message into the last user turn (Mistral style): rendered in the user turn "
        "before assistant turn 2 while that turn is last, and in a later user turn in the whole conversation; "
        "per-turn rows (--on-history-rewrite split, the default) give each assistant turn a row with the context "
        "the verifier is served")
    rows = tokenize_turns(mistral_tok, TWO_TURNS, chat_template=MISTRAL)
    assert [turn for turn, _ in rows] == [2, 4]
    for (turn, out), expected in zip(rows, [" 2+2 is 4.</s>", " It is 6.</s>"]):
        reference = mistral_tok.apply_chat_template(TWO_TURNS[: turn + 1], tokenize=True, return_dict=False,
                                                    chat_template=MISTRAL)
        assert out.input_ids.tolist() == list(reference)
        assert masked_texts(mistral_tok, out) == [expected]  # only the row's last turn
    assert "[INST] Be brief.\n\nWhat is 2+2?[/INST]" in mistral_tok.decode(rows[0][1].input_ids)
    assert "[INST] Be brief.\n\nAnd 3+3?[/INST]" in mistral_tok.decode(rows[1][1].input_ids)


# Mistral v0.3's own template: the system prompt is rendered only while a user turn is the LAST
# message (`loop.last`), so a conversation that ends with a reply never shows it.
MISTRAL_V3 = (
    "{{- '<s>' }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] | trim + '</s>' }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported') }}{%- endif %}"
    "{%- endfor %}"
)

LAST_USER_SYSTEM = ("template renders the system message only in the last user turn: the system message (message 0) "
                    "is rendered in the prompt of assistant turn 2, where a user turn is the last message, but not "
                    "once that turn's reply follows (a Mistral-v3 style `loop.last` test), so no row holds the "
                    "context the verifier is served. Pass --chat-template FILE with a training template that renders "
                    "the system message in the last user turn whatever follows it (the index of the last user "
                    "message instead of `loop.last`); each assistant turn then gets its own row "
                    "(--on-history-rewrite split, the default) whose context is the prompt the verifier is served")


def test_mistral_v3_system_only_while_a_user_turn_is_last_is_refused_naming_the_cause(mistral_tok):
    for messages in (TWO_TURNS, TWO_TURNS[:3]):
        for tokenize in (tokenize_conversation, tokenize_turns):
            with pytest.raises(ChatTemplateError) as info:
                tokenize(mistral_tok, messages, chat_template=MISTRAL_V3)
            assert str(info.value) == LAST_USER_SYSTEM
    check(mistral_tok, TWO_TURNS[1:], MISTRAL_V3, [" 2+2 is 4.</s>", " It is 6.</s>"], "<s>")  # no system: exact
    # The advised training template (the system message in the last user turn, MISTRAL above): each row's
    # context is exactly the prompt Mistral-v3's own template renders for the served request.
    rows = tokenize_turns(mistral_tok, TWO_TURNS, chat_template=MISTRAL)
    for turn, out in rows:
        served = mistral_tok.apply_chat_template(TWO_TURNS[:turn], tokenize=True, return_dict=False,
                                                 chat_template=MISTRAL_V3)
        first = int(out.loss_mask.argmax())
        assert out.input_ids[:first].tolist() == list(served)
        assert "Be brief." in mistral_tok.decode(served)


def test_mistral_v3_rows_in_tokenize_are_rejected_with_the_cause(tmp_path, mistral_tok):
    from peagle_data.prepare.config import TokenizeConfig, TokenizeRun
    from peagle_data.prepare.tokenizing import run_tokenize

    template = tmp_path / "mistral_v3.jinja"
    template.write_text(MISTRAL_V3)
    src = tmp_path / "m.jsonl"
    src.write_text(json.dumps({"messages": TWO_TURNS}) + "\n" + json.dumps({"messages": TWO_TURNS[1:]}) + "\n")
    out = tmp_path / "t"
    counts = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=out,
                                      settings=TokenizeConfig(chat_template=str(template))),
                          tokenizer=mistral_tok)["counts"]
    assert (counts["used"], counts["rejected"]) == (1, 1)
    assert counts["rejected_by_reason"] == {"template renders the system message only in the last user turn": 1}
    (reject,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert reject["reason"] == LAST_USER_SYSTEM and reject["source"] == f"{src}:1"


QWEN_REASONING = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4.", "reasoning_content": "Two and two."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "6.", "reasoning_content": "Three and three."},
]


def test_qwen3_drops_earlier_reasoning_so_rows_are_per_turn(qwen3_tok):
    full = qwen3_tok.apply_chat_template(QWEN_REASONING, tokenize=False, chat_template=QWEN3)
    assert "Two and two." not in full  # the template rewrites the first turn once a query follows
    with pytest.raises(ChatTemplateError, match="^template rewrites history: .*; it drops the reasoning of "
                                                "assistant turn 1 once later turns follow \\(Qwen3 style\\); per-turn"):
        tokenize_conversation(qwen3_tok, QWEN_REASONING, chat_template=QWEN3)
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in QWEN_REASONING]
    with pytest.raises(ChatTemplateError) as info:  # no reasoning: the last turn's injected empty think block
        tokenize_conversation(qwen3_tok, plain, chat_template=QWEN3)
    assert str(info.value).endswith(
        " (assistant turn 1 renders as '<think>\\n\\n</think>\\n\\n4.<|im_end|>\\n' when it is the last message, as "
        "'4.<|im_end|>\\n<|im_start|>user\\nAnd 3+3?<|' once later messages follow)")
    rows = tokenize_turns(qwen3_tok, QWEN_REASONING, chat_template=QWEN3)
    assert [t for t, _ in rows] == [1, 3]
    assert masked_texts(qwen3_tok, rows[0][1]) == ["<think>\nTwo and two.\n</think>\n\n4.<|im_end|>"]
    assert masked_texts(qwen3_tok, rows[1][1]) == ["<think>\nThree and three.\n</think>\n\n6.<|im_end|>"]
    # The second row's context is the history as the verifier saw it: first reasoning dropped.
    second = qwen3_tok.decode(rows[1][1].input_ids)
    assert "Two and two." not in second and "<|im_start|>assistant\n4.<|im_end|>" in second
    for turn, out in rows:
        reference = qwen3_tok.apply_chat_template(QWEN_REASONING[: turn + 1], tokenize=True,
                                                  return_dict=False, chat_template=QWEN3)
        assert out.input_ids.tolist() == list(reference)


def test_qwen3_single_turn_with_reasoning_is_one_row(qwen3_tok):
    messages = QWEN_REASONING[:2]
    check(qwen3_tok, messages, QWEN3, ["<think>\nTwo and two.\n</think>\n\n4.<|im_end|>"], "")
    assert render_rows(qwen3_tok, messages, chat_template=QWEN3)[0].turn is None


TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "number"}, "b": {"type": "number"}}}}}]

TOOL_CONVERSATION = [
    {"role": "system", "content": "Use tools."},
    {"role": "user", "content": "Add 1 and 2."},
    {"role": "assistant", "content": "", "reasoning_content": "I should call add.",
     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
    {"role": "tool", "content": '{"result": 3}'},
    {"role": "assistant", "content": "The sum is 3."},
]


def test_qwen3_tool_call_tool_result_and_injected_empty_think(qwen3_tok):
    # Turn 2: content null (normalised to "") with tool_calls and real reasoning: all supervised.
    # Turn 4: no reasoning; the template injects an empty think block: loss 0 (not generated).
    out = check(qwen3_tok, TOOL_CONVERSATION, QWEN3, [
        '<think>\nI should call add.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}'
        "\n</tool_call><|im_end|>",
        "The sum is 3.<|im_end|>",
    ], tools=TOOLS)
    text = qwen3_tok.decode(out.input_ids)
    assert "<think>\n\n</think>\n\nThe sum is 3." in text  # injected, then left unsupervised
    unmasked = qwen3_tok.decode(out.input_ids[out.loss_mask == 0])
    assert '{"result": 3}' in unmasked and "<tool_response>" in unmasked and '"name": "add"' in unmasked
    prefix = qwen3_tok.decode(out.input_ids[: out.system_len])
    assert prefix.startswith("<|im_start|>system\nUse tools.\n\n# Tools") and prefix.endswith("</tools><|im_end|>\n")


def test_reasoning_without_its_opening_think_tag(smollm2_tokenizer):
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."}]
    # The generation prompt ends with "<think>\n": the opening tag is context, not generated.
    check(smollm2_tokenizer, messages, OPEN_THINK, ["Greet back.\n</think>\n\nHello!<|im_end|>"], "")


def test_assistant_reply_is_the_very_first_rendered_content(gemma_tok):
    template = "{% for m in messages %}{{ m.content }}<end_of_turn>{% endfor %}"
    out = check(gemma_tok, [{"role": "assistant", "content": "Hello!"}], template, ["Hello!<end_of_turn>"])
    assert out.loss_mask[0] == 1 and out.system_len == 0


@pytest.mark.parametrize("reply", ["Done.\n\n", "Done. ", "Done.\n", "a\n\n\n"])
def test_reply_ending_in_whitespace_chatml(smollm2_tokenizer, reply):
    messages = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": reply}]
    check(smollm2_tokenizer, messages, None, [reply + "<|im_end|>"])


@pytest.mark.shared_data
def test_sharegpt_tool_call_rows_on_chatml_from_glaive(smollm2_tokenizer):
    # SmolLM2's ChatML has no tool support: the tools list and every tool call are dropped by it, so such
    # rows are rejected saying so; kept on request, a tool-call turn supervises nothing.
    from peagle_data.readers.conversations import read_conversations
    from peagle_data.readers.rows import Conversation
    from tests.conftest import shared_file

    items = [c for c in read_conversations([shared_file("glaive_toolcall_en_demo.json")], limit=40)
             if isinstance(c, Conversation)]
    n_calls = n_tools = 0
    for conv in items:
        calls = [m for m in conv.messages if m.get("tool_calls")]
        if conv.tools or calls:
            n_tools += bool(conv.tools)
            part = "tools" if conv.tools else "tool_calls"
            with pytest.raises(ChatTemplateError, match=f"^template drops {part}: "):
                tokenize_conversation(smollm2_tokenizer, conv.messages, tools=conv.tools)
        out = tokenize_conversation(smollm2_tokenizer, conv.messages, tools=conv.tools, on_dropped="keep")
        texts = [m["content"] for m in conv.messages if m["role"] == "assistant" and not m.get("tool_calls")]
        assert masked_texts(smollm2_tokenizer, out) == [c + "<|im_end|>" for c in texts]
        n_calls += len(calls)
    assert n_calls == 29 and n_tools == 24


# Llama-3.1 style tool use: tools in the first user turn, a call rendered as {"name", "parameters"}
# JSON, tool results in an "ipython" turn (as Meta's template: a string result is iterable, so tojson).
LLAMA31_TOOLS = (
    "{{- '<|begin_of_text|>' }}"
    "{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{%- if tools is not none %}{{- 'Environment: ipython\n' }}{%- endif %}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- if tools is not none %}{%- set first_user_message = messages[0].content | trim %}"
    "{%- set messages = messages[1:] %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, respond with a JSON for a '"
    " 'function call.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary of argument '"
    " 'name and its value}.\n\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) + '\n\n' }}{%- endfor %}"
    "{{- first_user_message + '<|eot_id|>' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- elif 'tool_calls' in message %}{%- set tool_call = message.tool_calls[0].function %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"' + tool_call.name + '\", \"parameters\": ' }}"
    "{{- tool_call.arguments | tojson + '}<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}"
    "{%- if message.content is mapping or message.content is iterable %}{{- message.content | tojson }}"
    "{%- else %}{{- message.content }}{%- endif %}{{- '<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"
)

GLAIVE_ROW = {  # Glaive / LLaMA-Factory ShareGPT: tools as a JSON string of bare schemas
    "tools": json.dumps([{"name": "search_recipes", "description": "Search for recipes",
                          "parameters": {"type": "object", "properties": {"ingredients": {"type": "array"}}}}]),
    "conversations": [
        {"from": "human", "value": "I have chicken and rice."},
        {"from": "function_call", "value": '{"name": "search_recipes", "arguments": {"ingredients": ["chicken", '
                                           '"rice"]}}'},
        {"from": "observation", "value": '{"recipes": ["Chicken fried rice"]}'},
        {"from": "gpt", "value": "Try chicken fried rice."},
    ],
}


def as_openai(row: dict) -> dict:
    """A ShareGPT tool row written in OpenAI form by hand, as a client sends it: wrapped tools, calls
    with JSON-string arguments and null content, tool results as tool messages."""
    roles = {"human": "user", "gpt": "assistant", "system": "system", "observation": "tool"}
    messages = []
    for turn in row["conversations"]:
        if turn["from"] == "function_call":
            call = json.loads(turn["value"])
            messages.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{len(messages)}", "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}}]})
        else:
            messages.append({"role": roles[turn["from"]], "content": turn["value"]})
    tools = [{"type": "function", "function": t} for t in json.loads(row["tools"] or "[]")]
    return {"messages": messages, **({"tools": tools} if tools else {})}


def _tool_rows_both_forms(tmp_path, sharegpt_rows):
    from peagle_data.readers.conversations import read_conversations
    from peagle_data.readers.rows import Conversation

    share, openai = tmp_path / "share.jsonl", tmp_path / "openai.jsonl"
    share.write_text("".join(json.dumps(r) + "\n" for r in sharegpt_rows))
    openai.write_text("".join(json.dumps(as_openai(r)) + "\n" for r in sharegpt_rows))
    a = [c for c in read_conversations([share]) if isinstance(c, Conversation)]
    b = [c for c in read_conversations([openai]) if isinstance(c, Conversation)]
    assert len(a) == len(b) == len(sharegpt_rows)
    return a, b


def _rows(tok, conv, template):
    """``[(turn, ids, mask)]`` of a conversation as tokenize makes them (per-turn rows when the template
    rewrites history, as Qwen3's does: a last turn gets an empty think block), each row's ids checked
    against transformers' own apply_chat_template of the OpenAI-form messages."""
    out = []
    for turn, t in tokenize_turns(tok, conv.messages, tools=conv.tools, chat_template=template):
        messages = conv.messages if turn is None else conv.messages[: turn + 1]
        reference = [{**m, "content": "" if m["content"] is None else m["content"]} for m in messages]
        kw = {"tools": conv.tools} if conv.tools else {}
        assert t.input_ids.tolist() == list(tok.apply_chat_template(reference, tokenize=True, return_dict=False,
                                                                    chat_template=template, **kw))
        out.append((turn, t.input_ids.tolist(), t.loss_mask.tolist(), t))
    return out


@pytest.mark.parametrize("family", ["qwen3", "llama31"])
def test_sharegpt_function_calls_render_like_the_openai_form(tmp_path, family, qwen3_tok, llama3_tok):
    tok, template = {"qwen3": (qwen3_tok, QWEN3), "llama31": (llama3_tok, LLAMA31_TOOLS)}[family]
    (share,), (openai,) = _tool_rows_both_forms(tmp_path, [GLAIVE_ROW])
    x, y = _rows(tok, share, template), _rows(tok, openai, template)
    assert [r[:3] for r in x] == [r[:3] for r in y]
    # the call is supervised as the verifier's own template writes it, not as Hermes text
    supervised = [text for *_, t in x for text in masked_texts(tok, t)]
    assert supervised == {
        "qwen3": ['<tool_call>\n{"name": "search_recipes", "arguments": {"ingredients": '
                  '["chicken", "rice"]}}\n</tool_call><|im_end|>', "Try chicken fried rice.<|im_end|>"],
        "llama31": ['{"name": "search_recipes", "parameters": {"ingredients": ["chicken", "rice"]}}<|eot_id|>',
                    "Try chicken fried rice.<|eot_id|>"]}[family]
    if family == "qwen3":  # the call is its row's last turn, so the template injects an empty think block: loss 0
        assert "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>" in tok.decode(x[0][3].input_ids)
    rendered = tok.decode(x[-1][3].input_ids)
    assert {"qwen3": '<tool_response>\n{"recipes": ["Chicken fried rice"]}\n</tool_response>',
            "llama31": '<|start_header_id|>ipython<|end_header_id|>\n\n"{\\"recipes\\": [\\"Chicken fried rice\\"]}"'
            }[family] in rendered
    assert '"name": "search_recipes"' in rendered.split("I have chicken")[0 if family == "qwen3" else 1]  # tools


@pytest.mark.shared_data
@pytest.mark.parametrize("family", ["qwen3", "llama31"])
def test_glaive_sharegpt_and_openai_forms_give_identical_ids_and_masks(tmp_path, family, qwen3_tok, llama3_tok):
    from tests.conftest import shared_file

    tok, template = {"qwen3": (qwen3_tok, QWEN3), "llama31": (llama3_tok, LLAMA31_TOOLS)}[family]
    rows = json.loads(shared_file("glaive_toolcall_en_demo.json").read_text())[:40]
    share, openai = _tool_rows_both_forms(tmp_path, rows)
    n_calls = supervised_calls = 0
    opener = {"qwen3": "<tool_call>", "llama31": '{"name": '}[family]
    for a, b in zip(share, openai):
        x, y = _rows(tok, a, template), _rows(tok, b, template)
        assert [r[:3] for r in x] == [r[:3] for r in y]
        n_calls += sum(bool(m.get("tool_calls")) for m in a.messages)
        # per-turn rows supervise their last turn only, a whole row every turn: each call once
        supervised_calls += sum(text.startswith(opener) for *_, t in x for text in masked_texts(tok, t))
    assert n_calls == 29 and supervised_calls == 29


# --------------------------------------------------------------------------------------------
# A token across a supervised span's boundary: no exact mask, the row is a reject


VICUNA = ("{% for m in messages %}{% if m.role == 'user' %}USER: {{ m.content }} {% else %}ASSISTANT: {{ m.content }}"
          "</s>{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT: {% endif %}")
VICUNA_TURNS = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
                {"role": "user", "content": "Again"}, {"role": "assistant", "content": "Sure thing"}]


def test_a_generation_prompt_ending_in_a_space_is_built_as_served(smollm2_tokenizer):
    # "ASSISTANT: " + "Hello" tokenizes as ":" " Hello": the reply's first token starts in the prompt. Masked by
    # "starts inside the span", every reply silently lost its first word (" there</s>"); it was a reject. vLLM
    # serves the prompt tokenized alone (ending in " ") and the verifier generates after it: the row is that,
    # the prompt's ids then the reply's ("Hello" " there"), one row per turn (the history merges " Hello").
    tok = smollm2_tokenizer
    with pytest.raises(ChatTemplateError) as info:
        tokenize_conversation(tok, VICUNA_TURNS, chat_template=VICUNA)
    assert str(info.value).startswith(
        "reply starts inside a token: ' Hello' holds ' ' rendered before an assistant reply (the generation "
        "prompt's end or the previous message's) and 'Hello' of the reply, so the reply's first token has no exact "
        "mask (a generation prompt that ends in a space does this); pass --chat-template FILE with a generation "
        "prompt that ends where a token ends; tokenized in pieces")
    assert str(info.value).endswith("no one sequence holds every turn as served: per-turn rows "
                                    "(--on-history-rewrite split, the default) give each turn its served prompt "
                                    "and reply")
    rows = tokenize_turns(tok, VICUNA_TURNS, chat_template=VICUNA)
    assert [t for t, _ in rows] == [1, 3] and all(r.served_pieces and r.served_turn_row for _, r in rows)
    assert [masked_texts(tok, r) for _, r in rows] == [["Hello there</s>"], ["Sure thing</s>"]]
    for turn, row in rows:
        first = int(np.flatnonzero(row.loss_mask)[0])
        assert row.input_ids[:first].tolist() == prompt_ids(tok, VICUNA_TURNS[:turn], None, VICUNA)
        assert tok.decode(row.input_ids[first:first + 1]) == ("Hello" if turn == 1 else "Sure")
    one = tokenize_conversation(tok, VICUNA_TURNS[:2], chat_template=VICUNA)  # one turn: one row, in pieces
    assert one.served_pieces == 1 and masked_texts(tok, one) == ["Hello there</s>"]
    fixed = VICUNA.replace("{% if add_generation_prompt %}ASSISTANT: {% endif %}",
                           "{% if add_generation_prompt %}ASSISTANT:{% endif %}")  # DeepSeek-LLM's way
    out = tokenize_conversation(tok, VICUNA_TURNS, chat_template=fixed)
    assert masked_texts(tok, out) == [" Hello there</s>", " Sure thing</s>"] and out.served_pieces == 0


def test_a_supervised_token_that_runs_into_the_next_turn_is_refused(smollm2_tokenizer):
    glued = "{% for m in messages %}{{ m.content }}{% endfor %}"  # no end-of-turn token, no separator
    turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hel"},
             {"role": "user", "content": "lo"}, {"role": "assistant", "content": "."}]
    with pytest.raises(ChatTemplateError) as info:
        tokenize_conversation(smollm2_tokenizer, turns, chat_template=glued)
    assert str(info.value) == ("a supervised token ends past its assistant turn: 'Hello' holds 'lo' of what follows "
                               "the turn, so the turn has no exact mask; pass --chat-template FILE with a template "
                               "that ends assistant turns with an end-of-turn token")
    turns[2]["content"] = "bye"  # "Good" "bye" are two tokens: exact
    turns[1]["content"] = "Good"
    assert masked_texts(smollm2_tokenizer, tokenize_conversation(smollm2_tokenizer, turns, chat_template=glued)) == [
        "Good", "."]


def test_a_reply_starting_inside_a_token_is_served_per_turn_in_tokenize(tmp_path, smollm2_tokenizer):
    import json

    from peagle_data.prepare.config import TokenizeConfig, TokenizeRun
    from peagle_data.prepare.tokenizing import run_tokenize

    template = tmp_path / "vicuna.jinja"
    template.write_text(VICUNA)
    src = tmp_path / "v.jsonl"
    src.write_text(json.dumps({"id": "v", "messages": VICUNA_TURNS}) + "\n")
    counts = run_tokenize(TokenizeRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "t",
                                      settings=TokenizeConfig(chat_template=str(template))),
                                      tokenizer=smollm2_tokenizer)["counts"]
    assert (counts["used"], counts["rejected"], counts["served_prompt_rows"]) == (1, 0, 2)
    assert (counts["served_turn_conversations"], counts["served_turn_rows"]) == (1, 2)


def test_a_cut_turn_in_a_per_turn_row_ends_before_its_end_of_turn(qwen3_tok):
    turns = [dict(m) for m in QWEN_REASONING]
    turns[3]["finish_reason"] = "length"
    rows = tokenize_turns(qwen3_tok, turns, chat_template=QWEN3)
    assert [t for t, _ in rows] == [1, 3]
    assert masked_texts(qwen3_tok, rows[1][1]) == ["<think>\nThree and three.\n</think>\n\n6."]


def test_a_reply_cut_inside_its_reasoning_supervises_no_closing_think(qwen3_tok):
    # regenerate cut inside the think block: reasoning only; the template adds "\n</think>\n\n" itself
    turns = [{"role": "user", "content": "3+3?"},
             {"role": "assistant", "content": "", "reasoning_content": "Two and", "finish_reason": "length"}]
    rows = tokenize_turns(qwen3_tok, turns, chat_template=QWEN3)
    assert [masked_texts(qwen3_tok, out) for _, out in rows] == [["<think>\nTwo and"]]


def test_a_weight_zero_turn_gets_no_per_turn_row(qwen3_tok):
    turns = [dict(m) for m in QWEN_REASONING]
    turns[1]["weight"] = 0  # the OpenAI fine-tuning format's "do not train on this turn"
    rows = tokenize_turns(qwen3_tok, turns, chat_template=QWEN3)
    assert [t for t, _ in rows] == [3]
    assert masked_texts(qwen3_tok, rows[0][1]) == ["<think>\nThree and three.\n</think>\n\n6.<|im_end|>"]
