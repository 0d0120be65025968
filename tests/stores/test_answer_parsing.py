"""Answers parsed as served (stores/answer_parsing.py): think blocks as vLLM's parsers split them,
Harmony channels, and the refusals of what cannot be parsed exactly."""

from __future__ import annotations

import re

import pytest

from stores.answer_parsing import (AnswerFormatError, ParsedAnswer, answer_message, harmony_messages, parse_answer,
                                   parse_think)
from tests.chat_templates import harmony_tokenizer, think_tokenizer

# (text, parser, chat_template_kwargs) -> (reasoning, content): the values vLLM 0.32's parsers return
# (read off DeepSeekR1ReasoningParser / Qwen3ParserReasoningAdapter / DeepSeekV3ReasoningParser, and
# checked against them in tests/stores/test_answer_parsing_vllm.py)
THINK_CASES = [
    ("<think>\nplan\n</think>\n\nAnswer", "deepseek_r1", None, ("\nplan\n", "\n\nAnswer")),
    ("plan\n</think>\n\nAnswer", "deepseek_r1", None, ("plan\n", "\n\nAnswer")),
    ("no tags", "deepseek_r1", None, ("no tags", None)),
    ("<think>cut short", "deepseek_r1", None, ("cut short", None)),
    ("<think></think>", "deepseek_r1", None, ("", None)),
    ("x</think>y</think>z", "deepseek_r1", None, ("x", "y</think>z")),
    ("pre<think>a</think>b", "deepseek_r1", None, ("a", "b")),
    ("<think>\nplan\n</think>\n\nAnswer", "qwen3", None, ("\nplan\n", "\n\nAnswer")),
    ("no tags", "qwen3", None, ("no tags", None)),
    ("<think></think>", "qwen3", None, (None, None)),
    ("x</think>y</think>z", "qwen3", None, ("x", "yz")),
    ("pre<think>a</think>b", "qwen3", {"enable_thinking": True}, ("prea", "b")),
    ("<think>\n\n</think>\n\nHi", "qwen3", {"enable_thinking": False}, (None, "<think>\n\n</think>\n\nHi")),
    ("<think>a</think>b", "deepseek_v3", None, (None, "<think>a</think>b")),
    ("<think>a</think>b", "deepseek_v3", {"thinking": True}, ("a", "b")),
    ("<think>a</think>b", "deepseek_v3", {"enable_thinking": True}, ("a", "b")),
]


@pytest.mark.parametrize("text,parser,kwargs,expected", THINK_CASES)
def test_think_blocks_split_as_vllms_parsers_split_them(text, parser, kwargs, expected):
    assert parse_think(text, parser, kwargs) == expected


@pytest.fixture(scope="module")
def think_tok(smollm2_tokenizer):
    return think_tokenizer(smollm2_tokenizer)


@pytest.fixture(scope="module")
def harmony_tok(smollm2_tokenizer):
    return harmony_tokenizer(smollm2_tokenizer)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_parse_answer_decodes_the_ids_without_eos_and_splits_the_think_block(think_tok):
    eos = think_tok.eos_token_id  # <|im_end|>
    out = ids(think_tok, "<think>\nTwo and  two.\n</think>\n\nx != 4") + [eos, 5, 6]
    assert parse_answer(think_tok, out, "qwen3", [eos]) == ParsedAnswer("\n\nx != 4", "\nTwo and  two.\n")
    assert parse_answer(think_tok, out, None, [eos]) == ParsedAnswer("<think>\nTwo and  two.\n</think>\n\nx != 4")
    assert parse_answer(think_tok, out, "qwen3", [eos], {"enable_thinking": False}).reasoning is None


def test_think_parsers_need_the_tags_as_tokens(smollm2_tokenizer):
    with pytest.raises(AnswerFormatError, match="needs <think> as one token"):
        parse_answer(smollm2_tokenizer, ids(smollm2_tokenizer, "<think>a</think>b"), "deepseek_r1")


HARMONY_ANSWER = ("<|channel|>analysis<|message|>User greets. Reply.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>Hello  there!<|return|>")


def test_harmony_channels_become_reasoning_and_content(harmony_tok):
    out = ids(harmony_tok, HARMONY_ANSWER)
    ret = harmony_tok.convert_tokens_to_ids("<|return|>")
    msgs = harmony_messages(harmony_tok, out)
    assert [(m.role, m.channel, m.text, m.complete) for m in msgs] == [
        ("assistant", "analysis", "User greets. Reply.", True), ("assistant", "final", "Hello  there!", True)]
    assert parse_answer(harmony_tok, out, "openai_gptoss", [ret]) == ParsedAnswer("Hello  there!",
                                                                                  "User greets. Reply.")
    # the flat decode a client never sees: what peagle-eval fed back before (issue 32)
    assert harmony_tok.decode(out, skip_special_tokens=True) == "analysisUser greets. Reply.assistantfinalHello  there!"


def test_harmony_tool_calls_commentary_and_a_cut_answer(harmony_tok):
    call = ids(harmony_tok, "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather"
                            "<|channel|>commentary <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>")
    parsed = parse_answer(harmony_tok, call, "openai_gptoss")
    assert parsed == ParsedAnswer("", "Need weather.", [{"type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}])
    preamble = ids(harmony_tok, "<|channel|>commentary<|message|>Checking.<|end|>"
                                "<|start|>assistant<|channel|>final<|message|>Done.<|return|>")
    assert parse_answer(harmony_tok, preamble, "openai_gptoss") == ParsedAnswer("Checking.\nDone.")
    cut = ids(harmony_tok, "<|channel|>analysis<|message|>Think")
    assert parse_answer(harmony_tok, cut, "openai_gptoss") == ParsedAnswer("", "Think")
    assert harmony_messages(harmony_tok, cut)[0].complete is False


@pytest.mark.parametrize("text,reason", [
    ("<|channel|>analysis<|message|>a<|end|>stray", "text or a token after a message's end"),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>fin", "cut inside a header"),
    ("<|channel|>analysis<|message|>a<|channel|>b", "<|channel|> inside a message's text"),
    ("<|channel|>final<|message|>a<|return|><|start|>assistant", "after <|return|>"),
    ("analysis<|message|>a<|end|>", "without a channel"),
    ("<|channel|>analysis<|message|>a<|end|><|start|>user<|channel|>final<|message|>b<|end|>", "role 'user'"),
    ("<|channel|>commentary to=browser.search<|message|>{}<|call|>", "neither reasoning, content nor a function"),
])
def test_unparseable_harmony_is_refused_with_the_reason(harmony_tok, text, reason):
    with pytest.raises(AnswerFormatError, match="unparsed answer format") as e:
        parse_answer(harmony_tok, ids(harmony_tok, text), "openai_gptoss")
    assert reason in str(e.value)


def test_harmony_without_its_parser_is_refused_not_decoded_flat(harmony_tok, think_tok):
    with pytest.raises(AnswerFormatError, match="--reasoning-parser openai_gptoss"):
        parse_answer(harmony_tok, ids(harmony_tok, HARMONY_ANSWER), None)
    with pytest.raises(AnswerFormatError, match="pass --reasoning-parser openai_gptoss"):
        parse_answer(harmony_tok, ids(harmony_tok, HARMONY_ANSWER), "qwen3")
    with pytest.raises(AnswerFormatError, match=re.escape("this tokenizer has no <|start|>, <|channel|>")):
        parse_answer(think_tok, ids(think_tok, "hi"), "openai_gptoss")
    with pytest.raises(ValueError, match="--reasoning-parser must be one of"):
        parse_answer(think_tok, [1], "granite")


def test_answer_message_is_what_a_client_sends_back():
    assert answer_message(ParsedAnswer("4.", "Two and two.")) == {"role": "assistant", "content": "4.",
                                                                 "reasoning_content": "Two and two."}
    assert answer_message(ParsedAnswer("4.")) == {"role": "assistant", "content": "4."}


# --------------------------------------------------------------------------------------------
# Against vLLM's own parsers (vllm/parser: the composed Parser ``vllm serve --reasoning-parser NAME`` uses)

CORPUS = ["<think>\nTwo and  two.\n</think>\n\nx != 4", "plan\n</think>\n\nAnswer", "no tags at all",
          "<think>cut short", "<think></think>", "x</think>y</think>z", "pre<think>a</think>b", "<think>\n\n</think>\n\nHi",
          " <think>a</think>\n"]
KWARGS = [None, {"enable_thinking": False}, {"enable_thinking": True}, {"thinking": True}]


def _vllm_parse(tok, name, kwargs, prompt_ids, text, ids):
    """(reasoning, content) of vLLM's composed parser, as its chat endpoint calls it for a finished request."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    cls = ParserManager.get_parser(reasoning_parser_name=name, tokenizer=tok)
    parser = cls(tok, None, chat_template_kwargs=kwargs)
    parser.set_prompt_token_ids(prompt_ids)
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], model="m",
                                    chat_template_kwargs=kwargs)
    reasoning, content, _ = parser.parse(text, request, model_output_token_ids=ids)
    return reasoning, content


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["deepseek_r1", "deepseek_v3", "qwen3"])
def test_think_parsing_equals_vllms_parsers(think_tok, name):
    from stores.chat_template import ChatTemplate, prompt_ids, template_variables

    eos = think_tok.convert_tokens_to_ids("<|im_end|>")
    reads = template_variables(think_tok.chat_template)
    for kwargs in KWARGS:
        # the prompt vLLM renders: a variable the template never reads (``thinking``) dropped, as vLLM drops it
        # (peagle refuses to render one); the parsers still read it
        rendered = {k: v for k, v in (kwargs or {}).items() if k in reads}
        prompt = prompt_ids(think_tok, [{"role": "user", "content": "Hi"}], None, ChatTemplate(None, rendered))
        # the template's prompt, and one that opens the think block (Qwen3.5 / DeepSeek-R1 style)
        for prompt_ids_ in (prompt, prompt + ids(think_tok, "<think>\n")):
            for text in CORPUS:
                out = ids(think_tok, text) + [eos]
                served = think_tok.decode(out[:-1], skip_special_tokens=True)  # vLLM's detokenized text
                reasoning, content = _vllm_parse(think_tok, name, kwargs, prompt_ids_, served, out)
                assert parse_answer(think_tok, out, name, [eos], kwargs) == ParsedAnswer(content or "", reasoning), \
                    (name, kwargs, text)
