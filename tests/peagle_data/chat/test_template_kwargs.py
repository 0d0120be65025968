"""Loss masks of reasoning templates in each mode their variables select (``--chat-template-kwargs``).

Templates: tests/chat_templates (Qwen3-style hybrid thinking, Qwen3.5-style open think, Harmony). For
every row the context before a supervised turn is exactly the prompt the verifier is served in that
mode (:func:`runtime.chat.chat_template.prompt_ids` with the same variables), the supervised tokens are what
it generates after that prompt, and the ids equal ``apply_chat_template`` with the same variables.
"""

from __future__ import annotations

import copy

import pytest

from peagle_data.chat.tokens import tokenize_conversation, tokenize_turns
from runtime.chat.chat_template import ChatTemplate, ChatTemplateError, prompt_ids, render
from tests.chat_templates import harmony_tokenizer, qwen_tokenizer, template
from tests.peagle_data.chat.test_tokens import masked_texts, reference_ids, runs

PLAIN = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
REASONED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."}]
TWO_TURNS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."},
             {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye!", "reasoning_content": "Part."}]
OFF = {"enable_thinking": False}


@pytest.fixture(scope="module")
def qwen_tok(smollm2_tokenizer):
    return qwen_tokenizer(smollm2_tokenizer)


@pytest.fixture(scope="module")
def harmony_tok(smollm2_tokenizer):
    return harmony_tokenizer(smollm2_tokenizer)


def _context_is_the_served_prompt(tok, messages, turn, out, spec: ChatTemplate) -> None:
    """The row's tokens before its first supervised token are the prompt of ``messages[:turn]`` in this
    mode, as text and as the served ids exactly (the Qwen test tokenizer keeps a newline run one token, as
    Qwen's own pre-tokenizer does, so the prompt's ``"\\n\\n"`` is one token alone and before the reply)."""
    first = runs(out.loss_mask)[0][0]
    served = prompt_ids(tok, messages[:turn], None, spec)
    assert tok.decode(out.input_ids[:first]) == render(tok, messages[:turn], None, spec, add_generation_prompt=True)
    assert out.input_ids[:first].tolist() == list(served)


# --------------------------------------------------------------------------------------------
# Qwen3-style hybrid thinking: enable_thinking false closes an empty think block in the prompt


def test_qwen3_generation_prompt_in_each_mode(qwen_tok):
    spec = template("qwen3_hybrid")
    on = render(qwen_tok, PLAIN[:1], None, ChatTemplate(spec, {}), add_generation_prompt=True)
    off = render(qwen_tok, PLAIN[:1], None, ChatTemplate(spec, OFF), add_generation_prompt=True)
    assert on == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"
    assert render(qwen_tok, PLAIN[:1], None, ChatTemplate(spec, {"enable_thinking": True}),
                  add_generation_prompt=True) == on


def test_qwen3_thinking_off_supervises_the_answer_after_the_served_empty_think_block(qwen_tok):
    spec = ChatTemplate(template("qwen3_hybrid"), OFF)
    out = tokenize_conversation(qwen_tok, PLAIN, chat_template=spec)
    assert masked_texts(qwen_tok, out) == ["Hello!<|im_end|>"]
    assert out.input_ids.tolist() == reference_ids(qwen_tok, PLAIN, chat_template=spec.text, enable_thinking=False)
    _context_is_the_served_prompt(qwen_tok, PLAIN, 1, out, spec)
    assert qwen_tok.decode(out.input_ids).endswith("<think>\n\n</think>\n\nHello!<|im_end|>\n")


def test_qwen3_thinking_on_supervises_the_reasoning(qwen_tok):
    spec = ChatTemplate(template("qwen3_hybrid"), {})
    out = tokenize_conversation(qwen_tok, REASONED, chat_template=spec)
    assert masked_texts(qwen_tok, out) == ["<think>\nGreet.\n</think>\n\nHello!<|im_end|>"]
    _context_is_the_served_prompt(qwen_tok, REASONED, 1, out, spec)
    # a turn without reasoning: the empty think block the template injects is context, not supervised
    plain = tokenize_conversation(qwen_tok, PLAIN, chat_template=spec)
    assert masked_texts(qwen_tok, plain) == ["Hello!<|im_end|>"]


def test_qwen3_reasoning_in_thinking_off_mode_is_refused_naming_the_mode(qwen_tok):
    spec = ChatTemplate(template("qwen3_hybrid"), OFF)
    with pytest.raises(ChatTemplateError) as info:
        tokenize_turns(qwen_tok, REASONED, chat_template=spec)
    assert str(info.value) == (
        "generation prompt mismatch: the generation prompt closes an empty think block "
        "('<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n', chat template kwargs {\"enable_thinking\": false}), "
        "so the verifier answers without reasoning in this mode, but assistant turn 1 has reasoning; no exact mask "
        "exists. Tokenize in the mode the answers were generated in (--chat-template-kwargs), or regenerate them in "
        "this mode")


def test_qwen3_multi_turn_rows_in_each_mode(qwen_tok):
    """Earlier reasoning is dropped from the history: one row per turn, each with its served prompt."""
    spec = ChatTemplate(template("qwen3_hybrid"), {})
    rows = tokenize_turns(qwen_tok, TWO_TURNS, chat_template=spec)
    assert [t for t, _ in rows] == [2, 4]
    assert [masked_texts(qwen_tok, r) for _, r in rows] == [["<think>\nGreet.\n</think>\n\nHello!<|im_end|>"],
                                                            ["<think>\nPart.\n</think>\n\nBye!<|im_end|>"]]
    for turn, row in rows:
        _context_is_the_served_prompt(qwen_tok, TWO_TURNS, turn, row, spec)
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in TWO_TURNS]
    off = ChatTemplate(template("qwen3_hybrid"), OFF)
    rows = tokenize_turns(qwen_tok, plain, chat_template=off)
    assert [masked_texts(qwen_tok, r) for _, r in rows] == [["Hello!<|im_end|>"], ["Bye!<|im_end|>"]]
    for turn, row in rows:
        _context_is_the_served_prompt(qwen_tok, plain, turn, row, off)


# --------------------------------------------------------------------------------------------
# Qwen3.5-style: the generation prompt opens <think>\n by default


def test_qwen35_open_think_supervises_what_follows_the_opened_block(qwen_tok):
    """The served prompt ends ``<think>\\n``: the verifier generates the reasoning, ``</think>`` and the
    answer; the opening tag is context."""
    spec = ChatTemplate(template("qwen35_open_think"), {})
    assert render(qwen_tok, PLAIN[:1], None, spec, add_generation_prompt=True).endswith("<|im_start|>assistant\n<think>\n")
    out = tokenize_conversation(qwen_tok, REASONED, chat_template=spec)
    assert masked_texts(qwen_tok, out) == ["Greet.\n</think>\n\nHello!<|im_end|>"]
    assert out.input_ids.tolist() == reference_ids(qwen_tok, REASONED, chat_template=spec.text)
    _context_is_the_served_prompt(qwen_tok, REASONED, 1, out, spec)
    rows = tokenize_turns(qwen_tok, TWO_TURNS, chat_template=spec)
    assert [masked_texts(qwen_tok, r) for _, r in rows] == [["Greet.\n</think>\n\nHello!<|im_end|>"],
                                                            ["Part.\n</think>\n\nBye!<|im_end|>"]]
    for turn, row in rows:
        _context_is_the_served_prompt(qwen_tok, TWO_TURNS, turn, row, spec)


def test_qwen35_thinking_off_supervises_the_answer(qwen_tok):
    spec = ChatTemplate(template("qwen35_open_think"), OFF)
    out = tokenize_conversation(qwen_tok, PLAIN, chat_template=spec)
    assert masked_texts(qwen_tok, out) == ["Hello!<|im_end|>"]
    assert out.input_ids.tolist() == reference_ids(qwen_tok, PLAIN, chat_template=spec.text, enable_thinking=False)
    _context_is_the_served_prompt(qwen_tok, PLAIN, 1, out, spec)


def test_a_turn_without_a_think_block_under_an_open_think_prompt_names_the_mode(qwen_tok):
    """A variant that renders a reasoning-less turn without a think block: in thinking mode the verifier
    reasons first, so no exact row exists; the reason says how to state the served mode, and in that
    mode (thinking off) the row is exact."""
    variant = template("qwen35_open_think").replace(
        "{%- if loop.index0 > ns.last_query_index %}", "{%- if loop.index0 > ns.last_query_index and reasoning_content %}")
    with pytest.raises(ChatTemplateError) as info:
        tokenize_turns(qwen_tok, PLAIN, chat_template=ChatTemplate(variant, {}))
    assert str(info.value).startswith("generation prompt mismatch: the template's generation prompt adds "
                                      "'<|im_start|>assistant\\n<think>\\n' after the history")
    assert str(info.value).endswith(
        ". The generation prompt opens a think block (chat template kwargs none (the template's defaults)), so the "
        "verifier reasons first: if it is served with thinking off, say so with --chat-template-kwargs (e.g. "
        "'{\"enable_thinking\": false}')")
    # thinking off: that template renders an empty think block for the prompt, but none in the turn
    with pytest.raises(ChatTemplateError, match="^generation prompt mismatch"):
        tokenize_turns(qwen_tok, PLAIN, chat_template=ChatTemplate(variant, OFF))


# --------------------------------------------------------------------------------------------
# Harmony-style (gpt-oss): reasoning_effort in the system message, channels in the answer


def test_harmony_reasoning_effort_is_in_the_system_prefix(harmony_tok):
    spec = template("harmony")
    rows = {}
    for effort in ("low", "high"):
        kw = ChatTemplate(spec, {"reasoning_effort": effort})
        out = tokenize_conversation(harmony_tok, REASONED, chat_template=kw)
        text = harmony_tok.decode(out.input_ids[:out.system_len])
        assert f"Reasoning: {effort}\n" in text
        _context_is_the_served_prompt(harmony_tok, REASONED, 1, out, kw)
        rows[effort] = out
    assert rows["low"].input_ids.tolist() != rows["high"].input_ids.tolist()
    assert masked_texts(harmony_tok, rows["high"]) == [
        "<|channel|>analysis<|message|>Greet.<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|return|>"]
    default = tokenize_conversation(harmony_tok, REASONED, chat_template=ChatTemplate(spec, {}))
    assert "Reasoning: medium\n" in harmony_tok.decode(default.input_ids[:default.system_len])


def test_harmony_multi_turn_rows_drop_earlier_analysis(harmony_tok):
    spec = ChatTemplate(template("harmony"), {"reasoning_effort": "high"})
    rows = tokenize_turns(harmony_tok, TWO_TURNS, chat_template=spec)
    assert [t for t, _ in rows] == [2, 4]
    last = rows[1][1]
    assert masked_texts(harmony_tok, last) == [
        "<|channel|>analysis<|message|>Part.<|end|><|start|>assistant<|channel|>final<|message|>Bye!<|return|>"]
    assert "Greet." not in harmony_tok.decode(last.input_ids)  # earlier analysis is not history
    for turn, row in rows:
        _context_is_the_served_prompt(harmony_tok, TWO_TURNS, turn, row, spec)


def test_qwen35_regenerated_turns_train_on_the_generated_ids_in_each_mode(qwen_tok):
    """A turn regenerated in the mode (``token_ids``: what the verifier generated after the served prompt)
    is trained on exactly those ids: in thinking mode the reasoning, ``</think>`` and the answer after the
    prompt's ``<think>\\n``; thinking off, the answer after the prompt's empty think block."""
    text = template("qwen35_open_think")
    for kwargs, generated, message in (
            ({}, "Greet.\n</think>\n\nHello!<|im_end|>", {"content": "Hello!", "reasoning_content": "Greet."}),
            (OFF, "Hello!<|im_end|>", {"content": "Hello!"})):
        ids = qwen_tok(generated, add_special_tokens=False)["input_ids"]
        messages = [PLAIN[0], {"role": "assistant", **message, "token_ids": ids}]
        [(turn, row)] = tokenize_turns(qwen_tok, messages, chat_template=ChatTemplate(text, kwargs))
        assert turn is None and row.on_generated_ids == 0
        first = runs(row.loss_mask)[0][0]
        assert row.input_ids[first:first + len(ids)].tolist() == ids and int(row.loss_mask.sum()) == len(ids)


# --------------------------------------------------------------------------------------------
# The served prompt's tokens: a tokenizer that splits the prompt's last newline run before the reply


GPT2_SPLIT_REASON = (
    "the prompt's last tokens change when the reply follows: served ['\\n\\n'] vs trained ['\\n', '\\n'] before "
    "{which} (from token {at}): vLLM tokenizes the generation prompt alone and the verifier generates after those "
    "ids, but tokenized with the reply ('Hello!<|im_end|>'...) the prompt's last characters form other tokens, so "
    "the row's context is not the served one; pass --chat-template FILE with a generation prompt that ends where a "
    "token ends whatever follows it (a special token, or text the tokenizer never merges across), or use the "
    "tokenizer the verifier is served with")


@pytest.fixture(scope="module")
def gpt2_split_tok(smollm2_tokenizer):
    """SmolLM2's own GPT-2 split with Qwen's think tokens: ``"</think>\\n\\n"`` ends in one ``"\\n\\n"`` token
    alone, but ``"\\n"``, ``"\\n"`` before ``"Hello"``."""
    out = copy.deepcopy(smollm2_tokenizer)
    out.add_tokens(["<think>", "</think>"])
    return out


def test_a_prompt_whose_last_tokens_change_before_the_reply_is_built_as_served(gpt2_split_tok):
    """Issue 44 item 5: thinking off (the prompt ends ``</think>\\n\\n``) under a tokenizer that splits a newline
    run before a letter, every plain row was rejected. The row is built as vLLM serves it: the generation prompt
    tokenized alone, then the reply's own ids, the mask on the reply (``served_pieces``); multi-turn, each turn
    has its own row (the template drops the empty think block from the history) with its served prompt."""
    spec = ChatTemplate(template("qwen3_hybrid"), OFF)
    prompt = render(gpt2_split_tok, PLAIN[:1], None, spec, add_generation_prompt=True)
    served = prompt_ids(gpt2_split_tok, PLAIN[:1], None, spec)
    whole = gpt2_split_tok(prompt + "Hello!", add_special_tokens=False)["input_ids"]
    assert whole[:len(served) - 1] == served[:-1]
    assert [gpt2_split_tok.decode([t]) for t in whole[len(served) - 1:len(served) + 1]] == ["\n", "\n"]
    assert gpt2_split_tok.decode(served[-1:]) == "\n\n"  # no token straddles the span: only this check sees it
    reply = gpt2_split_tok("Hello!<|im_end|>\n", add_special_tokens=False)["input_ids"]
    for out in (tokenize_conversation(gpt2_split_tok, PLAIN, chat_template=spec),
                tokenize_turns(gpt2_split_tok, PLAIN, chat_template=spec)[0][1]):
        assert out.served_pieces == 1 and out.problem is None
        assert out.input_ids.tolist() == served + reply
        assert masked_texts(gpt2_split_tok, out) == ["Hello!<|im_end|>"] and runs(out.loss_mask)[0][0] == len(served)
        _context_is_the_served_prompt(gpt2_split_tok, PLAIN, 1, out, spec)
    plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in TWO_TURNS]
    rows = tokenize_turns(gpt2_split_tok, plain, chat_template=spec)
    assert [t for t, _ in rows] == [2, 4] and [r.served_pieces for _, r in rows] == [1, 1]
    assert [masked_texts(gpt2_split_tok, r) for _, r in rows] == [["Hello!<|im_end|>"], ["Bye!<|im_end|>"]]
    for turn, row in rows:
        _context_is_the_served_prompt(gpt2_split_tok, plain, turn, row, spec)
    # thinking on: the prompt ends "assistant\n" before the injected "<think>" (an added token): exact whole
    out = tokenize_conversation(gpt2_split_tok, REASONED, chat_template=ChatTemplate(template("qwen3_hybrid"), {}))
    assert out.served_pieces == 0
    _context_is_the_served_prompt(gpt2_split_tok, REASONED, 1, out, ChatTemplate(template("qwen3_hybrid"), {}))


def test_generated_ids_do_not_hide_a_changed_prompt(gpt2_split_tok, qwen_tok):
    """A turn carrying its generated ids is trained on the served prompt's ids then those ids: exact when the
    row's context is the served prompt (Qwen's split), and when the reply changes the prompt's last tokens
    tokenized whole (the row is then built as served: the prompt alone, then the generated ids)."""
    spec = ChatTemplate(template("qwen3_hybrid"), OFF)
    for tok in (qwen_tok, gpt2_split_tok):
        ids = tok("Hello!<|im_end|>", add_special_tokens=False)["input_ids"]
        messages = [PLAIN[0], {"role": "assistant", "content": "Hello!", "token_ids": ids}]
        [(_, row)] = tokenize_turns(tok, messages, chat_template=spec)
        assert row.served_pieces == int(tok is gpt2_split_tok)
        first = runs(row.loss_mask)[0][0]
        assert row.input_ids.tolist()[:first + len(ids)] == prompt_ids(tok, PLAIN[:1], None, spec) + ids
