"""Conversations -> ids, loss masks and system prefixes on the real SmolLM2 tokenizer (ChatML, default system
injected)."""

from __future__ import annotations

import numpy as np

from peagle_data.chat.tokens import tokenize_conversation

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
