"""Content parts reach the chat template as vLLM passes them (runtime/chat/chat_template.py).

vLLM detects whether a template loops over a message's content ("openai" format: every content is a
list of text parts) or not ("string" format: text parts joined with "\\n"). The tests marked ``vllm``
render the same requests with vLLM's own message parsing and template application and compare ids.
"""

from __future__ import annotations

import pytest

from peagle_data.chat.tokens import tokenize_conversation, tokenize_turns
from runtime.chat.chat_template import (ChatTemplate, ChatTemplateError, chat_template_kwargs_record,
                                  check_chat_template_kwargs, check_kwargs_read, content_format, parse_chat_template_kwargs, prompt_ids, render,
                                  template_messages, template_tools, template_variables)
from stores.errors import StoreMismatchError
from tests.chat_templates import harmony_tokenizer, qwen_tokenizer, template
from peagle_data.readers.normalize import normalize_record
from peagle_data.regenerate.backends import Request, prompt_tokens
from tests.peagle_data.chat.test_tokens import masked_texts
from tests.peagle_data.chat.test_template_families import GEMMA, LLAMA3, LLAMA31_TOOLS, MISTRAL, OPEN_THINK, QWEN3, VICUNA

# A list-content template (Llama-4 / Gemma-3 style): a string is rendered as is, a list of parts each
# trimmed and numbered, so a template given the wrong form renders other text.
PARTS = (
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{{- '(' ~ (message.content | length) ~ ')' }}"
    "{%- for part in message.content %}{%- if part.type == 'text' %}{{- '[' + part.text | trim + ']' }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- for tc in message.tool_calls or [] %}{{- '<tool_call>' + tc.function.name + ' ' }}"
    "{{- tc.function.arguments | tojson + '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# vLLM's other ways of looping over content: through a variable set from messages, a macro's
# parameter, a bare `content` variable, an item access; and look-alikes that do not.
VIA_SET = ("{% set loop_messages = messages[1:] %}{% for m in loop_messages %}"
           "{% for c in m['content'] | list %}{{ c.text }}{% endfor %}{% endfor %}")
VIA_MACRO = ("{% macro show(parts) %}{% for p in parts %}{{ p.text }}{% endfor %}{% endmacro %}"
             "{% for m in messages %}{{ show(m.content) }}{% endfor %}")
VIA_NAME = ("{% for m in messages %}{% set content = m.content %}{% for c in content %}{{ c.text }}{% endfor %}"
            "{% endfor %}")
NOT_CONTENT = "{% for m in messages %}{% for tc in m.tool_calls or [] %}{{ tc.function.name }}{% endfor %}{% endfor %}"
MACRO_OTHER = ("{% macro show(parts) %}{% for p in parts %}{{ p }}{% endfor %}{% endmacro %}"
               "{% for m in messages %}{{ show(m.tool_calls) }}{% endfor %}")

# A request as a client sends it: text parts, a null content with a tool call, a tool result in parts.
REQUEST = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Summarise this:"},
                                 {"type": "text", "text": "The cat sat on the mat."}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "cat"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "cat: a small"},
                                                        {"type": "text", "text": "domesticated feline"}]},
    {"role": "assistant", "content": " A cat sat on a mat. "},
    {"role": "user", "content": " Thanks! "},
    {"role": "assistant", "content": [{"type": "text", "text": "You are"}, {"type": "text", "text": "welcome."}]},
]
NO_TOOLS = [m for m in REQUEST if m["role"] != "tool" and not m.get("tool_calls")]

# Tools as a client may send them: no type, keys in another order, no description. vLLM dumps its request
# model: {"type", "function": {"name", "description": null, "parameters"}}.
ODD_TOOLS = [{"function": {"parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                           "name": "lookup"}},
             {"type": "function", "function": {"name": "now", "strict": True, "description": "The time."},
              "x-extra": 1}]

# A developer message after the system message: vLLM passes it to a template that names the role, and
# makes it part of one first system message for any other template.
DEV_REQUEST = [{"role": "system", "content": "Be brief."}, {"role": "developer", "content": "Answer in French."},
               {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Salut."},
               {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Au revoir."}]
DEVELOPER = ("{% for m in messages %}{% if m.role == 'developer' %}<|im_start|>developer\n[{{ m.content }}]"
             "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


TEMPLATES = {"llama3": LLAMA3, "gemma": GEMMA, "mistral": MISTRAL, "qwen3": QWEN3, "open_think": OPEN_THINK,
             "vicuna": VICUNA, "llama31_tools": LLAMA31_TOOLS, "parts": PARTS, "via_set": VIA_SET,
             "via_macro": VIA_MACRO, "via_name": VIA_NAME, "developer": DEVELOPER, "not_content": NOT_CONTENT,
             "macro_other": MACRO_OTHER,
             "broken": "{% for m in messages %}"}
EXPECTED_FORMAT = {"parts": "openai", "via_set": "openai", "via_macro": "openai", "via_name": "openai"}


def _normalized(messages):
    return normalize_record({"messages": messages})[0]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_content_format_of_templates(name):
    assert content_format(TEMPLATES[name]) == EXPECTED_FORMAT.get(name, "string")


def test_template_messages_in_both_formats():
    msgs = _normalized(REQUEST)
    assert [m["content"] for m in template_messages(msgs, LLAMA3)] == [
        "Be brief.", "Summarise this:\nThe cat sat on the mat.", "", "cat: a small\ndomesticated feline",
        " A cat sat on a mat. ", " Thanks! ", "You are\nwelcome."]
    text = [{"type": "text", "text": t} for t in ("Summarise this:", "The cat sat on the mat.")]
    assert [m["content"] for m in template_messages(msgs, PARTS)] == [
        [{"type": "text", "text": "Be brief."}], text, [], "cat: a small\ndomesticated feline",
        [{"type": "text", "text": " A cat sat on a mat. "}], [{"type": "text", "text": " Thanks! "}],
        [{"type": "text", "text": "You are"}, {"type": "text", "text": "welcome."}]]


def test_developer_messages_as_vllm_passes_them():
    msgs = _normalized(DEV_REQUEST)
    assert [m["role"] for m in msgs] == ["system", "developer", "user", "assistant", "user", "assistant"]
    assert template_messages(msgs, DEVELOPER) == msgs  # the template names the role: as it is
    assert template_messages(msgs, LLAMA3)[:2] == [{"role": "system", "content": "Be brief.\n\nAnswer in French."},
                                                   {"role": "user", "content": "Hi"}]
    alone = [{"role": "developer", "content": "Terse."}] + msgs[2:]
    assert template_messages(alone, LLAMA3)[0] == {"role": "system", "content": "Terse."}
    # a list-content template: vLLM merges the messages it already parsed into parts, into a string
    assert template_messages(msgs, PARTS)[:2] == [{"role": "system", "content": "Be brief.\n\nAnswer in French."},
                                                  {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert template_messages(alone, PARTS)[0] == {"role": "system", "content": [{"type": "text", "text": "Terse."}]}


def test_tools_as_vllm_dumps_them(smollm2_tokenizer):
    assert template_tools(normalize_record({"messages": NO_TOOLS, "tools": ODD_TOOLS})[1]) == [
        {"type": "function", "function": {"name": "lookup", "description": None, "parameters": {
            "type": "object", "properties": {"q": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": None,
                                          "strict": True}}]
    tools = normalize_record({"messages": NO_TOOLS, "tools": ODD_TOOLS})[1]
    text = render(smollm2_tokenizer, _normalized(NO_TOOLS)[:2], tools, QWEN3)
    assert ('<tools>\n{"type": "function", "function": {"name": "lookup", "description": null, "parameters": '
            '{"type": "object", "properties": {"q": {"type": "string"}}}}}\n') in text


def test_parts_are_joined_with_a_newline_for_a_string_template(smollm2_tokenizer):
    # the case: ["Summarise this:", "The cat sat on the mat."] is not "Summarise this:The cat..."
    text = render(smollm2_tokenizer, _normalized(NO_TOOLS)[:2], None, None)
    assert "<|im_start|>user\nSummarise this:\nThe cat sat on the mat.<|im_end|>" in text


def test_a_list_template_gets_every_content_as_parts(smollm2_tokenizer):
    out = tokenize_conversation(smollm2_tokenizer, _normalized(REQUEST), chat_template=PARTS)
    text = smollm2_tokenizer.decode(out.input_ids)
    assert text.startswith("<|im_start|>system\n(1)[Be brief.]<|im_end|>\n<|im_start|>user\n"
                           "(2)[Summarise this:][The cat sat on the mat.]<|im_end|>\n")
    assert "<|im_start|>tool\ncat: a small\ndomesticated feline<|im_end|>" in text  # tool content: a string
    assert masked_texts(smollm2_tokenizer, out) == [
        '(0)<tool_call>lookup {"q": "cat"}</tool_call><|im_end|>', "(1)[A cat sat on a mat.]<|im_end|>",
        "(2)[You are][welcome.]<|im_end|>"]


# --------------------------------------------------------------------------------------------
# Against vLLM's own rendering (vllm/renderers: parse_chat_messages, safe_apply_chat_template)


@pytest.fixture(scope="module")
def vllm_model_config(smollm2_tokenizer_dir):
    from vllm.config import ModelConfig

    return ModelConfig(model=str(smollm2_tokenizer_dir), tokenizer=str(smollm2_tokenizer_dir), dtype="float32")


def _vllm_ids(model_config, tokenizer, messages, template, add_generation_prompt, tools=None):
    """Token ids vLLM's chat endpoint renders for ``messages`` (and ``tools``): its content-format
    detection, message parsing, tool dump and template application, as its online renderer and
    ``HfRenderer.render_messages`` run them."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionToolsParam
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template

    tool_dicts = None if tools is None else [ChatCompletionToolsParam(**t).model_dump() for t in tools]
    fmt = resolve_chat_template_content_format(template, tool_dicts, "auto", tokenizer, model_config=model_config)
    conversation, _, _ = parse_chat_messages(messages, model_config, fmt)
    return fmt, list(safe_apply_chat_template(model_config, tokenizer, conversation, tools=tool_dicts,
                                              chat_template=template, tokenize=True,
                                              add_generation_prompt=add_generation_prompt))


@pytest.mark.vllm
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_content_format_equals_vllms(vllm_model_config, smollm2_tokenizer, name):
    from vllm.renderers.hf import resolve_chat_template_content_format

    assert content_format(TEMPLATES[name]) == resolve_chat_template_content_format(
        TEMPLATES[name], None, "auto", smollm2_tokenizer, model_config=vllm_model_config)


@pytest.mark.vllm
@pytest.mark.parametrize("name, request_messages, tools", [
    ("smollm2", NO_TOOLS, None), ("parts", REQUEST, None), ("smollm2", DEV_REQUEST, None),
    ("developer", DEV_REQUEST, None), ("qwen3", REQUEST, ODD_TOOLS), ("parts", DEV_REQUEST, None)])
def test_ids_equal_vllms_rendering_of_the_same_request(vllm_model_config, smollm2_tokenizer, name,
                                                       request_messages, tools):
    tok = smollm2_tokenizer
    template = {"smollm2": None, "parts": PARTS, "developer": DEVELOPER, "qwen3": QWEN3}[name]
    record = normalize_record({"messages": request_messages, **({"tools": tools} if tools else {})})
    messages, row_tools = record[0], record[1]
    # the training rows (one, or one per assistant turn where the template rewrites history: Qwen3)
    rows = tokenize_turns(tok, messages, tools=row_tools, chat_template=template)
    assert [turn for turn, _ in rows] == ([None] if name != "qwen3" else [2, 4, 6])
    for turn, out in rows:
        upto = request_messages if turn is None else request_messages[: turn + 1]
        fmt, reference = _vllm_ids(vllm_model_config, tok, upto, template, False, tools)
        assert fmt == {"parts": "openai"}.get(name, "string")
        assert out.input_ids.tolist() == reference
    # every prompt the verifier is served (the history before each assistant turn), as regenerate renders it
    for i in [i for i, m in enumerate(request_messages) if m["role"] == "assistant"]:
        _, served = _vllm_ids(vllm_model_config, tok, request_messages[:i], template, True, tools)
        if template is None:
            assert prompt_tokens(tok, Request(messages=messages[:i], tools=row_tools)) == served
        ids = tok(render(tok, messages[:i], row_tools, template, add_generation_prompt=True), add_special_tokens=False)
        assert ids["input_ids"] == served


@pytest.mark.vllm
def test_a_reasoning_field_renders_as_vllm_renders_it(vllm_model_config, smollm2_tokenizer):
    """An assistant turn's ``reasoning`` (vLLM's request field) reaches the template: the Qwen3 render
    holds its think block, as vLLM's does, and the reasoning is supervised."""
    tok = smollm2_tokenizer
    request = [{"role": "user", "content": "2+2?"},
               {"role": "assistant", "content": "4.", "reasoning": "Two and two make four."}]
    messages, tools, _ = normalize_record({"messages": request})
    out = tokenize_conversation(tok, messages, chat_template=QWEN3)
    _, reference = _vllm_ids(vllm_model_config, tok, request, QWEN3, False)
    assert out.input_ids.tolist() == reference
    assert masked_texts(tok, out) == ["<think>\nTwo and two make four.\n</think>\n\n4.<|im_end|>"]


# A template that reads vLLM's name for the reasoning, ``message.reasoning`` (vLLM passes it and
# ``reasoning_content`` alike).
REASONING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning %}[{{ m.reasoning }}]"
                      "{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_template_messages_pass_the_reasoning_under_both_names():
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r"}]
    assert template_messages(messages, REASONING_TEMPLATE) == [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r",
                                           "reasoning": "r"}]


@pytest.mark.vllm
def test_a_template_reading_message_reasoning_renders_as_vllm_renders_it(vllm_model_config, smollm2_tokenizer):
    tok = smollm2_tokenizer
    request = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4.", "reasoning": "2 and 2."}]
    messages, _, _ = normalize_record({"messages": request})
    out = tokenize_conversation(tok, messages, chat_template=REASONING_TEMPLATE)
    _, reference = _vllm_ids(vllm_model_config, tok, request, REASONING_TEMPLATE, False)
    assert out.input_ids.tolist() == reference
    assert masked_texts(tok, out) == ["[2 and 2.]4.<|im_end|>"]


# --------------------------------------------------------------------------------------------
# Template variables (--chat-template-kwargs): parsed as vLLM takes them, checked, recorded


def test_chat_template_kwargs_parse_as_a_json_object():
    assert parse_chat_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    assert parse_chat_template_kwargs('{"reasoning_effort": "high", "n": [1, 2]}') == {"reasoning_effort": "high",
                                                                                       "n": [1, 2]}
    assert parse_chat_template_kwargs(None) == {} and parse_chat_template_kwargs("  ") == {}
    with pytest.raises(ValueError, match=r"^--chat-template-kwargs is not JSON \(Expecting value at character 0\)"):
        parse_chat_template_kwargs("enable_thinking=false")
    with pytest.raises(ValueError, match="^--chat-template-kwargs must be a JSON object .* got list$"):
        parse_chat_template_kwargs("[1]")
    with pytest.raises(ValueError, match="^--chat-template-kwargs may not set 'add_generation_prompt', 'tokenize': "
                                         "each stage sets them per render"):
        parse_chat_template_kwargs('{"tokenize": true, "add_generation_prompt": false}')
    with pytest.raises(ValueError, match="'bad name' is not a template variable name"):
        parse_chat_template_kwargs('{"bad name": 1}')


def test_rendering_passes_the_variables_over_the_special_tokens(smollm2_tokenizer):
    tpl = "{{ bos_token }}|{{ effort | default('medium') }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    msgs = [{"role": "user", "content": "Hi"}]
    assert render(smollm2_tokenizer, msgs, None, ChatTemplate(tpl, {})) == "<|im_start|>|medium|Hi"
    assert render(smollm2_tokenizer, msgs, None, ChatTemplate(tpl, {"effort": "low"})) == "<|im_start|>|low|Hi"
    assert render(smollm2_tokenizer, msgs, None, ChatTemplate(tpl, {"bos_token": "B"})) == "B|medium|Hi"
    assert render(smollm2_tokenizer, [], None, ChatTemplate(tpl, {"effort": "low"})) == "<|im_start|>|low|"
    assert render(smollm2_tokenizer, msgs, None, tpl) == render(smollm2_tokenizer, msgs, None, ChatTemplate(tpl))


def test_a_stage_of_another_mode_is_refused_naming_both():
    check_chat_template_kwargs({"chat_template_kwargs": {"enable_thinking": False}}, "the tokenize output T",
                               {"enable_thinking": False})
    check_chat_template_kwargs({}, "an old table", {})  # recorded before peagle recorded them: none
    with pytest.raises(StoreMismatchError) as info:
        check_chat_template_kwargs({"chat_template_kwargs": {"enable_thinking": False}}, "the tokenize output T", {})
    assert str(info.value) == (
        "the tokenize output T was rendered with chat template kwargs {\"enable_thinking\": false}, but "
        "--chat-template-kwargs gives none (the template's defaults): the verifier answers another prompt in each "
        "mode; pass --chat-template-kwargs '{\"enable_thinking\": false}', or make the input again in this mode")
    assert chat_template_kwargs_record({"b": 1, "a": 2}) == {"a": 2, "b": 1}
    assert list(chat_template_kwargs_record({"b": 1, "a": 2})) == ["a", "b"]


def test_a_variable_the_template_never_reads_is_refused_naming_those_it_reads():
    text = ("{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
            "{% if add_generation_prompt %}{% if enable_thinking is false %}<think></think>{% endif %}{% endif %}")
    assert template_variables(text) == {"messages", "add_generation_prompt", "enable_thinking"}
    check_kwargs_read(text, {"enable_thinking": False})
    check_kwargs_read(text, {})
    with pytest.raises(ChatTemplateError) as info:
        check_kwargs_read(text, {"enable_thinkng": False, "enable_thinking": True})
    assert str(info.value) == (
        "--chat-template-kwargs: the chat template never reads 'enable_thinkng', so it would change no prompt (vLLM "
        "drops it too) and the rows would be rendered in the template's default mode; the template reads "
        "enable_thinking: check the name, or leave it out")
    assert template_variables("{% if %}") is None  # does not parse: rendering it fails with its own error
    check_kwargs_read("{% if %}", {"x": 1})


def _vllm_request_ids(model_config, tokenizer, messages, template, chat_template_kwargs, add_generation_prompt=True):
    """Token ids vLLM's chat endpoint renders for a request with ``chat_template_kwargs``: the request model
    builds its chat parameters (``build_chat_params``: the kwargs merged with the request's own fields),
    then its message parsing and ``safe_apply_chat_template`` (which keeps the variables the template
    reads, ``resolve_chat_template_kwargs``)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template

    request = ChatCompletionRequest(model="m", messages=messages, chat_template_kwargs=chat_template_kwargs or None,
                                    add_generation_prompt=add_generation_prompt)
    kwargs = request.build_chat_params(template, "auto").get_apply_chat_template_kwargs()
    fmt = resolve_chat_template_content_format(template, None, "auto", tokenizer, model_config=model_config)
    conversation, _, _ = parse_chat_messages(messages, model_config, fmt)
    return list(safe_apply_chat_template(model_config, tokenizer, conversation, tools=None, tokenize=True, **kwargs))


REASONING_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!", "reasoning": "Greet."},
                  {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye!", "reasoning": "Part."}]


@pytest.mark.vllm
@pytest.mark.parametrize("name, chat_template_kwargs", [
    ("qwen3_hybrid", {}), ("qwen3_hybrid", {"enable_thinking": False}), ("qwen3_hybrid", {"enable_thinking": True}),
    ("qwen35_open_think", {}), ("qwen35_open_think", {"enable_thinking": False}),
    ("harmony", {}), ("harmony", {"reasoning_effort": "high"}), ("harmony", {"reasoning_effort": "low"})])
def test_prompt_ids_equal_vllms_with_the_same_template_kwargs(vllm_model_config, smollm2_tokenizer, name,
                                                              chat_template_kwargs):
    """peagle's prompt of every assistant turn (regenerate's, peagle-eval's) is vLLM's for the same
    messages and ``chat_template_kwargs``; the modes give different prompts."""
    tok = (harmony_tokenizer if name == "harmony" else qwen_tokenizer)(smollm2_tokenizer)
    text = template(name)
    messages = normalize_record({"messages": REASONING_CHAT})[0]
    for i in (2, 4):
        served = _vllm_request_ids(vllm_model_config, tok, REASONING_CHAT[:i], text, chat_template_kwargs)
        assert prompt_ids(tok, messages[:i], None, ChatTemplate(text, chat_template_kwargs)) == served
        if name == "qwen3_hybrid" and chat_template_kwargs.get("enable_thinking") is False:
            assert tok.decode(served).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        if name == "qwen35_open_think" and not chat_template_kwargs:
            assert tok.decode(served).endswith("<|im_start|>assistant\n<think>\n")
        if name == "harmony":
            assert f"Reasoning: {chat_template_kwargs.get('reasoning_effort', 'medium')}\n" in tok.decode(served)
    # the training rows (one per assistant turn: each template drops earlier reasoning) are vLLM's renders
    if chat_template_kwargs.get("enable_thinking") is not False:  # reasoning turns have no row in thinking-off mode
        for turn, row in tokenize_turns(tok, messages, chat_template=ChatTemplate(text, chat_template_kwargs)):
            assert row.input_ids.tolist() == _vllm_request_ids(vllm_model_config, tok, REASONING_CHAT[:turn + 1], text,
                                                               chat_template_kwargs, add_generation_prompt=False)
