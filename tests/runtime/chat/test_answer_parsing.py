"""Answers parsed as served (runtime/chat/answer_parsing.py): think blocks as vLLM's parsers split them,
Harmony channels, and the refusals of what cannot be parsed exactly."""

from __future__ import annotations

import re

import pytest

from runtime.chat.answer_parsing import (AnswerFormatError, ParsedAnswer, answer_message, harmony_messages, parse_answer,
                                   parse_think)
from tests.chat_templates import harmony_tokenizer, think_tokenizer

# (text, parser, chat_template_kwargs) -> (reasoning, content): the values vLLM 0.32's parsers return
# (read off DeepSeekR1ReasoningParser / Qwen3ParserReasoningAdapter / DeepSeekV3ReasoningParser, and
# checked against them below, in the vLLM environment)
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
    from runtime.chat.chat_template import ChatTemplate, prompt_ids, template_variables

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


# --------------------------------------------------------------------------------------------
# Against vLLM's Harmony parser (``--reasoning-parser openai_gptoss``) on gpt-oss's genuine vocabulary:
# answers rendered to ids by openai_harmony, parsed by vLLM's HarmonyParser (vllm/parser/harmony.py) and by peagle

HARMONY_EFFORTS = ["low", "medium", "high"]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(tokenizer, harmony encoding) of gpt-oss, with ``$TIKTOKEN_ENCODINGS_BASE``/``$TIKTOKEN_CACHE_DIR`` set
    for the module; skipped (failed under ``PEAGLE_REQUIRE_VLLM=1``) without the vocabulary."""
    import os

    from tests.chat_templates import gpt_oss as oss

    raw = oss.vocab_bytes()
    if raw is None:
        if os.environ.get("PEAGLE_REQUIRE_VLLM") == "1":
            pytest.fail(oss.missing_reason())
        pytest.skip(oss.missing_reason())
    directory = oss.vocab_dir(tmp_path_factory.mktemp("o200k"), raw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(directory))
        mp.setenv("TIKTOKEN_CACHE_DIR", str(directory))
        yield oss.gpt_oss_tokenizer(directory), oss.harmony_encoding()


def _harmony_answers(enc):
    """name -> generated ids (after the prompt's ``<|start|>assistant``), rendered by openai_harmony, and two
    answers in the header order gpt-oss itself emits (``assistant to=functions.X<|channel|>commentary json``),
    which vLLM rewrites earlier tool calls into (``_use_legacy_tool_call_headers``)."""
    from openai_harmony import Conversation, Message, RenderConversationConfig, Role

    def after_prompt(*msgs):
        user = Message.from_role_and_content(Role.USER, "What is 2+2?")
        prompt = enc.render_conversation_for_completion(Conversation.from_messages([user]), Role.ASSISTANT)
        full = enc.render_conversation_for_training(Conversation.from_messages([user, *msgs]),
                                                    config=RenderConversationConfig(auto_drop_analysis=False))
        assert full[:len(prompt)] == prompt
        return full[len(prompt):]

    def a(text, channel):
        return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)

    def call(args, name="get_weather", content_type="json"):
        return a(args, "commentary").with_recipient(f"functions.{name}").with_content_type(content_type)

    think, final = a("User asks  2+2.\nSimple: 4.", "analysis"), a("It is  **4**.\n\nx != y", "final")

    def text(s):
        return enc.encode(s, allowed_special="all")

    answers = {
        "analysis+final": after_prompt(think, final),
        "final only": after_prompt(final),
        "two analyses": after_prompt(think, a("Check: 2+2=4 ✓ 日本語", "analysis"), final),
        "preamble+final": after_prompt(a("Let me check.", "commentary"), final),
        "tool call": after_prompt(think, call('{"city": "Paris",   "unit": "c"}')),
        "tool call, args not JSON": after_prompt(call("city=Paris")),
        "tool call, code content type": after_prompt(call("print(1)", "run", "code")),
        "empty final": after_prompt(think, a("", "final")),
        "legacy tool header": text("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant "
                                   "to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Oslo\"}"
                                   "<|call|>"),
        "recipient before channel": text(" to=functions.lookup<|channel|>commentary <|constrain|>json<|message|>"
                                         "{\"q\":1}<|call|>"),
    }
    answers["cut in the final text"] = answers["analysis+final"][:-4]
    answers["cut in the analysis"] = after_prompt(think)[:-3]
    return answers


def _vllm_harmony_parse(tok, ids_, tools=True):
    """(reasoning, content, tool_calls) of vLLM's HarmonyParser as ``vllm serve --reasoning-parser openai_gptoss
    [--tool-call-parser openai --enable-auto-tool-choice]`` composes it for a gpt-oss model, on a finished answer."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager

    cls = ParserManager.get_parser(reasoning_parser_name="openai_gptoss", tool_parser_name="openai" if tools else None,
                                   enable_auto_tools=tools, is_harmony=True, tokenizer=tok)
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "What is 2+2?"}], model="m")
    text = tok.decode(ids_, skip_special_tokens=True)
    reasoning, content, calls = cls(tok, None).parse(text, request, model_output_token_ids=list(ids_))
    return reasoning, content, [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                for c in calls or []] or None


@pytest.mark.vllm
def test_gpt_oss_tokenizer_is_openai_harmonys(gpt_oss):
    tok, enc = gpt_oss
    for text in ["Hello  there!\n\nx != 4", "日本語 🙂 123456789", "<|start|>assistant<|channel|>final<|message|>Hi<|return|>"]:
        assert tok(text, add_special_tokens=False)["input_ids"] == enc.encode(text, allowed_special="all"), text
    assert [tok.convert_tokens_to_ids(t) for t in ("<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
                                                   "<|message|>", "<|call|>")] == [200002, 200003, 200005, 200006,
                                                                                   200007, 200008, 200012]


@pytest.mark.vllm
def test_harmony_reading_equals_vllms_openai_gptoss_parser(gpt_oss):
    """Issue 32: peagle's (content, reasoning, tool_calls) of answers openai_harmony renders equal what vLLM's
    parser gives a client, with the stop id kept or cut (``eos_ids``), for every reasoning effort's prompt."""
    tok, enc = gpt_oss
    stops = [200002, 200012, 199999]  # gpt-oss's generation_config eos_token_id: <|return|>, <|call|>, <|endoftext|>
    answers = _harmony_answers(enc)
    for name, out in answers.items():
        for kept in (out, [t for t in out if t not in stops]):
            reasoning, content, calls = _vllm_harmony_parse(tok, kept)
            assert parse_answer(tok, kept, "openai_gptoss", stops) == ParsedAnswer(content or "", reasoning, calls), name
            # without --tool-call-parser, vLLM drops a call (peagle keeps it: regenerate writes tool_calls,
            # peagle-eval refuses an answer that calls a tool): reasoning and content are the same
            reasoning_nt, content_nt, _ = _vllm_harmony_parse(tok, kept, tools=False)
            assert (reasoning_nt, content_nt) == (reasoning, content), name
    # the values themselves (not only equal to vLLM's)
    parsed = {name: parse_answer(tok, out, "openai_gptoss", stops) for name, out in answers.items()}
    assert parsed["analysis+final"] == ParsedAnswer("It is  **4**.\n\nx != y", "User asks  2+2.\nSimple: 4.")
    assert parsed["two analyses"].reasoning == "User asks  2+2.\nSimple: 4.\nCheck: 2+2=4 ✓ 日本語"
    assert parsed["preamble+final"] == ParsedAnswer("Let me check.\nIt is  **4**.\n\nx != y")
    assert parsed["tool call"].tool_calls == [{"type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]
    assert parsed["tool call, args not JSON"].tool_calls[0]["function"]["arguments"] == "city=Paris"
    assert parsed["legacy tool header"] == ParsedAnswer("", "Need weather.", [{"type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo"}'}}])
    assert parsed["empty final"] == ParsedAnswer("", "User asks  2+2.\nSimple: 4.")
    assert parsed["cut in the final text"].content == tok.decode(answers["analysis+final"][:-4][
        answers["analysis+final"].index(200008, 10) + 1:])
    # the prompts of each reasoning effort end with the same <|start|>assistant the answers follow
    from openai_harmony import Conversation, Message, ReasoningEffort, Role, SystemContent

    for effort in HARMONY_EFFORTS:
        system = Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_reasoning_effort(
            ReasoningEffort(effort.capitalize())))
        user = Message.from_role_and_content(Role.USER, "What is 2+2?")
        prompt = enc.render_conversation_for_completion(Conversation.from_messages([system, user]), Role.ASSISTANT)
        assert f"Reasoning: {effort}" in tok.decode(prompt) and prompt[-2:] == [200006, tok.encode("assistant")[0]]


@pytest.mark.vllm
def test_harmony_answers_vllm_falls_back_on_are_refused(gpt_oss):
    """Where vLLM answers with a fallback (a header cut at the token limit: its raw decode, markers and all, as content; a built-in
    tool's message: dropped), peagle refuses with the reason: neither is what the verifier said."""
    tok, enc = gpt_oss
    cut_header = enc.encode("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>fin",
                            allowed_special="all")
    assert _vllm_harmony_parse(tok, cut_header) == ("Think.", "<|start|>assistant<|channel|>fin", None)
    with pytest.raises(AnswerFormatError, match="cut inside a header"):
        parse_answer(tok, cut_header, "openai_gptoss")
    browser = enc.encode("<|channel|>analysis<|message|>Search.<|end|><|start|>assistant<|channel|>commentary "
                         "to=browser.search<|message|>{\"q\": \"x\"}<|call|>", allowed_special="all")
    assert _vllm_harmony_parse(tok, browser) == ("Search.", None, None)
    with pytest.raises(AnswerFormatError, match="neither reasoning, content nor a function call"):
        parse_answer(tok, browser, "openai_gptoss")


@pytest.mark.vllm
@pytest.mark.parametrize("effort", HARMONY_EFFORTS)
def test_harmony_turn_2_is_what_a_client_of_vllm_serve_sends(gpt_oss, effort):
    """Issue 32: peagle-eval's turn-2 history (``history_message``) is the message a client of
    ``vllm serve --reasoning-parser openai_gptoss`` sends back, so vLLM's gpt-oss renderer (openai_harmony:
    preamble with the request's ``reasoning_effort``, earlier analysis dropped) makes the same prompt of both."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.parser.harmony_utils import (build_harmony_preamble,
                                                              parse_chat_inputs_to_harmony_messages,
                                                              render_for_completion)

    from peagle_train.evaluate.prompts import history_message

    tok, enc = gpt_oss
    out = _harmony_answers(enc)["analysis+final"]
    reasoning, content, _ = _vllm_harmony_parse(tok, out)
    client = {"role": "assistant", "content": content, "reasoning": reasoning}
    ours = history_message(tok, out, [200002, 200012, 199999], "openai_gptoss")

    def served(assistant):
        request = ChatCompletionRequest(model="m", reasoning_effort=effort, messages=[
            {"role": "user", "content": "What is 2+2?"}, assistant, {"role": "user", "content": "And 3+3?"}])
        msgs = build_harmony_preamble(reasoning_effort=request.reasoning_effort)
        msgs += parse_chat_inputs_to_harmony_messages(request.messages)
        return request.messages[1], render_for_completion(msgs)

    (client_msg, client_ids), (our_msg, our_ids) = served(client), served(ours)
    assert our_msg == client_msg and our_ids == client_ids
    text = tok.decode(our_ids)
    assert f"Reasoning: {effort}" in text and "It is  **4**.\n\nx != y<|end|><|start|>user" in text
    assert "User asks" not in text  # turn 1's analysis is dropped once it has a final answer
    # the flat decode peagle-eval fed back before would be another prompt
    flat = served({"role": "assistant", "content": tok.decode(out, skip_special_tokens=True)})[1]
    assert flat != our_ids
