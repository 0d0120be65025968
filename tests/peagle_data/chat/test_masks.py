"""Loss masks and system prefixes on the real SmolLM2 tokenizer (ChatML, default system injected)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from peagle_data.chat.render import (SERVED_PROMPT_CHANGED, needs_turn_rows, render_rows, tokenize_conversation,
                                    tokenize_rendered, tokenize_turns)
from runtime.chat.chat_template import ChatTemplateError

DEFAULT_SYSTEM = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                  "Hugging Face<|im_end|>\n")


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of every run of 1s."""
    padded = np.concatenate([[0], mask.astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def masked_texts(tok, out) -> list[str]:
    return [tok.decode(out.input_ids[a:b]) for a, b in runs(out.loss_mask)]


def reference_ids(tok, messages, **kw) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kw))


MULTI_TURN = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "2+2 is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "It is 6."},
]


def test_multi_turn_spans_are_content_plus_im_end(smollm2_tokenizer):
    tok = smollm2_tokenizer
    out = tokenize_conversation(tok, MULTI_TURN)
    assert out.input_ids.dtype == np.int32 and out.loss_mask.dtype == np.uint8
    assert out.input_ids.tolist() == reference_ids(tok, MULTI_TURN)
    assert masked_texts(tok, out) == ["2+2 is 4.<|im_end|>", "It is 6.<|im_end|>"]
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for a, b in runs(out.loss_mask):
        assert out.input_ids[b - 1] == im_end
        assert tok.decode(out.input_ids[b:b + 1]) == "\n" and out.loss_mask[b] == 0  # template glue
        assert tok.decode(out.input_ids[:a]).endswith("<|im_start|>assistant\n")  # header: mask 0
    # Nothing else is supervised: no system, user or header token.
    unmasked = tok.decode(out.input_ids[out.loss_mask == 0])
    assert "What is 2+2?" in unmasked and "2+2 is 4." not in unmasked


def test_system_len_default_system_injected(smollm2_tokenizer):
    tok = smollm2_tokenizer
    out = tokenize_conversation(tok, MULTI_TURN)
    assert tok.decode(out.input_ids[:out.system_len]) == DEFAULT_SYSTEM
    assert out.system_len == 21
    assert not out.loss_mask[:out.system_len].any()


def test_system_len_with_system_message(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [{"role": "system", "content": "You are terse."}] + MULTI_TURN
    out = tokenize_conversation(tok, messages)
    assert out.input_ids.tolist() == reference_ids(tok, messages)
    assert tok.decode(out.input_ids[:out.system_len]) == "<|im_start|>system\nYou are terse.<|im_end|>\n"
    assert masked_texts(tok, out) == ["2+2 is 4.<|im_end|>", "It is 6.<|im_end|>"]


def test_reply_ending_in_whitespace_keeps_it(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [{"role": "user", "content": "List?"}, {"role": "assistant", "content": "- a\n- b\n\n"}]
    out = tokenize_conversation(tok, messages)
    assert out.input_ids.tolist() == reference_ids(tok, messages)
    assert masked_texts(tok, out) == ["- a\n- b\n\n<|im_end|>"]


def test_assistant_as_first_rendered_content(smollm2_tokenizer):
    # A bare template: the reply is the very first thing rendered (token 0 is supervised).
    template = "{% for m in messages %}{{ m.content }}<|endoftext|>{% endfor %}"
    messages = [{"role": "assistant", "content": "Hello!"}]
    out = tokenize_conversation(smollm2_tokenizer, messages, chat_template=template)
    assert out.loss_mask[0] == 1 and out.system_len == 0
    assert masked_texts(smollm2_tokenizer, out) == ["Hello!<|endoftext|>"]


def test_assistant_right_after_system(smollm2_tokenizer):
    tok = smollm2_tokenizer
    messages = [{"role": "system", "content": "Greet."}, {"role": "assistant", "content": "Hello!"}]
    out = tokenize_conversation(tok, messages)
    assert masked_texts(tok, out) == ["Hello!<|im_end|>"]
    assert tok.decode(out.input_ids[:out.system_len]) == "<|im_start|>system\nGreet.<|im_end|>\n"


def test_assistant_first_under_smollm2_is_rejected_not_guessed(smollm2_tokenizer):
    # SmolLM2 injects its default system prompt only when messages exist, so the generation
    # prompt of an empty history is not a prefix of the render: the row is rejected (readers drop
    # leading assistant turns before this point anyway).
    with pytest.raises(ChatTemplateError, match="template rewrites history"):
        tokenize_conversation(smollm2_tokenizer, [{"role": "assistant", "content": "Hello!"}])


def test_empty_assistant_content_supervises_nothing(smollm2_tokenizer):
    # An empty assistant turn yields no supervised token, not even its end-of-turn token (issue 3).
    tok = smollm2_tokenizer
    out = tokenize_conversation(tok, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}])
    assert masked_texts(tok, out) == [] and out.loss_mask.sum() == 0
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
                {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "Yes."}]
    out = tokenize_conversation(tok, messages)
    assert masked_texts(tok, out) == ["Yes.<|im_end|>"]
    assert out.input_ids.tolist() == reference_ids(tok, messages)


def test_tool_call_and_tool_result(smollm2_tokenizer):
    tok = smollm2_tokenizer
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    messages = [
        {"role": "user", "content": "Add one."},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": '{"result": 2}'},
        {"role": "assistant", "content": "The result is 2."},
    ]
    out = tokenize_conversation(tok, messages)
    assert out.input_ids.tolist() == reference_ids(tok, messages)
    assert masked_texts(tok, out) == [call + "<|im_end|>", "The result is 2.<|im_end|>"]
    assert '{"result": 2}' in tok.decode(out.input_ids[out.loss_mask == 0])


def test_other_template_without_newline_glue(smollm2_tokenizer):
    tok = smollm2_tokenizer
    template = ("{% for m in messages %}{% if m.role == 'user' %}User: {{ m.content }}\n\n"
                "{% else %}Assistant: {{ m.content }}<|endoftext|>{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}Assistant:{% endif %}")
    out = tokenize_conversation(tok, MULTI_TURN, chat_template=template)
    assert out.input_ids.tolist() == reference_ids(tok, MULTI_TURN, chat_template=template)
    # The generation prompt ends at "Assistant:", so the space before the content is generated too.
    assert masked_texts(tok, out) == [" 2+2 is 4.<|endoftext|>", " It is 6.<|endoftext|>"]
    assert out.system_len == 0


def test_template_that_rewrites_history_is_rejected(smollm2_tokenizer):
    # Earlier assistant turns are rendered as "[...]" once a later turn exists.
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n"
                "{% if m.role == 'assistant' and not loop.last %}[...]{% else %}{{ m.content }}{% endif %}"
                "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ChatTemplateError, match="template rewrites history"):
        tokenize_conversation(smollm2_tokenizer, MULTI_TURN, chat_template=template)


def test_template_error_is_a_reject_reason(smollm2_tokenizer):
    template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatTemplateError, match="template error"):
        tokenize_conversation(smollm2_tokenizer, MULTI_TURN, chat_template=template)


def test_a_special_token_inside_a_reply_without_end_of_turn_is_rejected_not_cut(smollm2_tokenizer):
    # A template that ends assistant turns with no special token: the reply's own <file_sep> was taken as
    # its end-of-turn token, and " b and more" silently got loss 0.
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    messages = [{"role": "user", "content": "Paths?"}, {"role": "assistant", "content": "a <file_sep> b and more"}]
    with pytest.raises(ChatTemplateError, match="no end-of-turn token ends an assistant turn: its last special "
                                                "token '<file_sep>' is followed by ' b and more"):
        tokenize_conversation(smollm2_tokenizer, messages, chat_template=template, on_special_text="keep")
    # by default the reply's special-token text itself is the reject (issue 33, kind 7), under any template
    for t in (template, None):
        with pytest.raises(ChatTemplateError, match="special-token text in a reply: the content of assistant message "
                                                    "1 writes '<file_sep>', which the tokenizer reads as the special "
                                                    "token id 5"):
            tokenize_conversation(smollm2_tokenizer, messages, chat_template=t)
    # kept under ChatML: <|im_end|> ends the turn, the reply's <file_sep> is supervised with it, as it tokenizes
    out = tokenize_conversation(smollm2_tokenizer, messages, on_special_text="keep")
    assert masked_texts(smollm2_tokenizer, out) == ["a <file_sep> b and more<|im_end|>"]


def test_special_token_text_counts_in_supervised_replies_only(smollm2_tokenizer):
    """Issue 33, kind 7: which text counts. A special token's text (all_special_tokens, added tokens marked
    special) in a supervised reply's content, reasoning or tool calls; not in context turns (they render
    as vLLM renders them), not in an unsupervised turn, not in a turn trained on its generated ids."""
    from peagle_data.chat.render import special_token_text

    tok = smollm2_tokenizer
    call = {"type": "function", "function": {"name": "say", "arguments": {"text": "<|im_start|>"}}}
    messages = [{"role": "system", "content": "End turns with <|im_end|>."},
                {"role": "user", "content": "Say <|endoftext|>"},
                {"role": "assistant", "content": "ok", "reasoning_content": "write <|endoftext|>"},
                {"role": "user", "content": "again"},
                {"role": "assistant", "content": "<file_sep>", "weight": 0},
                {"role": "user", "content": "call"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "user", "content": "plain"},
                {"role": "assistant", "content": "<|im_end|>", "token_ids": [27, 91, 344, 62, 408, 91, 29, 2]},
                {"role": "assistant", "content": "fine <not_special> <|im_start"}]
    assert special_token_text(tok, messages, [2, 6, 8, 9]) == [
        (2, "reasoning_content", "<|endoftext|>"), (6, "tool_calls", "<|im_start|>")]
    assert special_token_text(tok, messages, [0, 1]) == [(0, "content", "<|im_end|>"), (1, "content", "<|endoftext|>")]
    context_only = [messages[1], {"role": "assistant", "content": "Done."}]
    out = tokenize_conversation(tok, context_only)
    assert out.input_ids.tolist() == reference_ids(tok, context_only)
    assert out.input_ids.tolist().count(0) == 1  # the user's <|endoftext|> is its control id, as in vLLM


def test_a_cut_reply_is_supervised_up_to_its_own_text(smollm2_tokenizer):
    # ChatML: the reply cut at a token limit is supervised without the <|im_end|> the template adds
    cut = [MULTI_TURN[0], {**MULTI_TURN[1], "finish_reason": "length"}]
    assert masked_texts(smollm2_tokenizer, tokenize_conversation(smollm2_tokenizer, cut)) == ["2+2 is 4."]
    # a template that closes turns with plain text: its "\n" is not supervised either
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant:{% endif %}")
    out = tokenize_conversation(smollm2_tokenizer, cut, chat_template=template)
    assert masked_texts(smollm2_tokenizer, out) == [" 2+2 is 4."]
    # a render without the reply's text (the dropped-content check rejects such rows first): no guess
    from peagle_data.chat.render import _cut_end

    with pytest.raises(ChatTemplateError, match="a reply cut at a token limit .* whose text's end is not found"):
        _cut_end(cut[1], "assistant: 2+2 IS 4.\n", 11, 21)
    assert _cut_end({"content": "", "reasoning_content": "Two and "}, "<think>\nTwo and\n</think>", 0, 25) == 15


# ChatML that trims message content, and a template that closes turns with plain text.
TRIMMING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN_GLUE = ("{% for m in messages %}{{ m.role }}:{{ m.content }}\n{% endfor %}"
              "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.mark.parametrize("template, text, supervised", [
    (None, "x = [0];\n", 6),  # ChatML renders the trailing "\n": every generated id
    (None, "echo $num * ", 5),
    (TRIMMING, "x = [0];\n", 6),  # the template trims it: the generated ids spliced in
    (TRIMMING, "echo $num * ", 5),
    (PLAIN_GLUE, " a\n", 1),  # the reply's "\n" merges with the template's: " a" only
    (None, "<<", 1),  # its end was found at the "<<" overlapping "<|im_end|>" ("a supervised token ends past")
])
def test_a_cut_reply_ending_in_whitespace_trains_on_its_generated_ids(smollm2_tokenizer, template, text, supervised):
    """Issue 33, kind 8: a reply cut at the token limit after a whitespace token was "generated ids do not
    round-trip" (the cut span ended before the reply's trailing whitespace). The turn supervises exactly
    its generated ids (spliced after the prompt where the template trims the whitespace), or, where the
    template merges the last whitespace with its own text, those before it, each at its own position."""
    tok = smollm2_tokenizer
    generated = tok(text, add_special_tokens=False)["input_ids"]
    row = [{"role": "user", "content": "q"},
           {"role": "assistant", "content": text, "finish_reason": "length", "token_ids": generated}]
    out = tokenize_conversation(tok, row, chat_template=template)
    assert out.input_ids[out.loss_mask == 1].tolist() == generated[:supervised]
    reference = reference_ids(tok, row, **({"chat_template": template} if template else {}))
    if template is TRIMMING:  # the prompt, the generated ids, then <|im_end|>\n (not supervised)
        assert out.on_generated_ids == 1 and out.input_ids.tolist() == reference[:-(len(generated) + 1)] + \
            generated + reference[-2:]
    else:
        assert out.on_generated_ids == 0 and out.input_ids.tolist() == reference
    # an earlier cut turn: the tokens it shares with the generated ids, the next turn's context as rendered
    two = row + [{"role": "user", "content": "go on"}, {"role": "assistant", "content": "ok"}]
    out = tokenize_conversation(tok, two, chat_template=template)
    first = runs(out.loss_mask)[0]
    earlier = len(generated) - (template is TRIMMING)  # trimmed: all but its last whitespace
    assert out.input_ids[first[0]:first[1]].tolist() == generated[:earlier]


def test_a_finished_reply_whose_whitespace_the_template_trims(smollm2_tokenizer):
    """A finished reply (end-of-turn generated) whose trailing whitespace the template trims: the rendered
    turn puts <|im_end|> where the verifier generated "\n". The last turn trains on its generated ids
    (spliced after the prompt, as the verifier computed them); an earlier one, whose trimmed text was the
    next turn's context, is a reject naming the template; a template that changes the text otherwise is
    named as the cause, not a clean-up decode, an edit or another tokenizer."""
    tok = smollm2_tokenizer
    generated = tok("x = [0];\n", add_special_tokens=False)["input_ids"] + [2]
    row = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x = [0];\n", "token_ids": generated}]
    out = tokenize_conversation(tok, row, chat_template=TRIMMING)
    assert out.input_ids[out.loss_mask == 1].tolist() == generated and out.on_generated_ids == 1
    prompt = tok.apply_chat_template(row[:1], chat_template=TRIMMING, add_generation_prompt=True, return_dict=False)
    assert out.input_ids.tolist() == prompt + generated + [198]
    with pytest.raises(ChatTemplateError) as e:
        tokenize_conversation(tok, row + [{"role": "user", "content": "more"}, {"role": "assistant", "content": "ok"}],
                              chat_template=TRIMMING)
    assert str(e.value) == (
        "generated ids do not round-trip: assistant message 1 re-tokenizes inside the chat template to 6 ids, the "
        "verifier generated 7 (token_ids); first difference at token 5: '<|im_end|>' for the generated 'Ċ' (the "
        "template trims the reply's whitespace); the verifier saw the trimmed text as the context of the turns after "
        "it, so no tokenization trains both exactly")
    signed = TRIMMING.replace("{{ m.content | trim }}", "{{ m.content }}--")  # it appends text to the reply
    with pytest.raises(ChatTemplateError) as e:
        tokenize_conversation(tok, row, chat_template=signed)
    assert str(e.value).startswith(
        "generated ids do not round-trip: assistant message 1 re-tokenizes inside the chat template to ")
    assert str(e.value).endswith(
        "they decode to the message's text, but the chat template renders it otherwise: '--<|im_end|>' in the render "
        "where the generated text has '<|im_end|>' (after 'x = [0];\\n'), so the turn as rendered is not what the "
        "verifier generated; pass --chat-template FILE with a template that renders assistant content as it is")


def test_generated_ids_outside_the_tokenizer_reject_the_row(smollm2_tokenizer):
    """An id past the tokenizer decodes to "" (the text still matches), so it would be spliced into the
    training ids unseen, and pass extract on a verifier whose embedding is padded past the tokenizer."""
    tok = smollm2_tokenizer
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there"}]
    generated = [19556, 665, 2]  # 'Hello', 'Ġthere', '<|im_end|>'
    ok = tokenize_conversation(tok, [messages[0], {**messages[1], "token_ids": generated}])
    assert ok.problem is None and ok.input_ids[ok.loss_mask == 1].tolist() == generated
    with pytest.raises(ChatTemplateError) as e:
        tokenize_conversation(tok, [messages[0], {**messages[1], "token_ids": [19556, 665, 49157, 2]}])
    assert str(e.value) == ("generated ids outside the tokenizer: assistant message 1 token_ids[2] is 49157, but "
                            "the tokenizer has 49152 tokens (ids 0..49151): the ids come from another tokenizer or "
                            "were edited; tokenize with the tokenizer of the verifier that generated them")


# --------------------------------------------------------------------------------------------
# The served prompt's tokens (served_prompt_mismatch): the tail form agrees with P_i tokenized whole

PLAIN_TEXT = ("{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n\n{% endfor %}"
              "{% if add_generation_prompt %}Assistant:{% endif %}")  # no added token at all: P_i tokenized whole
NEWLINE_PROMPT = ("{% for m in messages %}<|im_start|>{{ m.role }}\n\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n\n{% endif %}")  # ends "\n\n" before the reply


@pytest.mark.parametrize("template, messages, in_pieces", [
    (None, MULTI_TURN, False),
    (PLAIN_TEXT, MULTI_TURN, False),
    (PLAIN_TEXT, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Hello"}], False),
    (NEWLINE_PROMPT, MULTI_TURN, "turns"),
    (NEWLINE_PROMPT, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "\n\nHello"}], True),
    (NEWLINE_PROMPT, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<|im_end|>"}], False),
])
def test_served_prompt_check_agrees_with_the_whole_prompt_tokenized(smollm2_tokenizer, template, messages, in_pieces):
    """For every supervised turn: the row is tokenized as served (in pieces) exactly when, tokenized whole, its
    tokens before the turn differ from ``P_i`` tokenized whole (the check tokenizes only ``P_i``'s tail after its
    last added token); either way its tokens before each turn are then ``P_i`` tokenized alone. Where no one
    sequence is (``"turns"``: the second prompt tokenized alone splits the first reply's leading newlines
    otherwise than the first prompt alone), each turn gets its own row (:func:`tokenize_turns`)."""
    tok = smollm2_tokenizer
    rows = render_rows(tok, messages, None, template, on_special_text="keep")
    outs = tokenize_rendered(tok, rows)
    if in_pieces == "turns":
        assert needs_turn_rows(outs[0].problem) and outs[0].problem.startswith(SERVED_PROMPT_CHANGED)
        turns = tokenize_turns(tok, messages, None, template, on_special_text="keep")
        assert [t for t, _ in turns] == [1, 3] and [r.served_turn_row for _, r in turns] == [1, 1]
        rows = [render_rows(tok, messages[:t + 1], None, template, on_special_text="keep")[0] for t, _ in turns]
        rows = [replace(r, spans=r.spans[-1:]) for r in rows]  # the per-turn row supervises its last turn
        outs, in_pieces = [r for _, r in turns], True
    for row, out in zip(rows, outs):
        enc = tok(row.text, add_special_tokens=False, return_offsets_mapping=True)
        differs = False
        for a, _ in row.spans:
            lo = sum(1 for s, _ in enc["offset_mapping"] if s < a)
            differs |= tok(row.text[:a], add_special_tokens=False)["input_ids"] != enc["input_ids"][:lo]
        assert differs == in_pieces and out.problem is None and out.served_pieces == int(in_pieces)
        assert len(runs(out.loss_mask)) == len(row.spans)
        for (a, _), (first, _) in zip(row.spans, runs(out.loss_mask)):
            assert out.input_ids[:first].tolist() == tok(row.text[:a], add_special_tokens=False)["input_ids"]
        assert tok.decode(out.input_ids) == row.text
