"""Rendering and assistant spans: templates with no exact span are rejected, a cut reply's span ends with its text."""

from __future__ import annotations

import pytest

from peagle_data.chat.render import _cut_end
from peagle_data.chat.tokens import tokenize_conversation
from runtime.chat.chat_template import ChatTemplateError
from tests.peagle_data.chat.test_tokens import MULTI_TURN, masked_texts


def test_assistant_first_under_smollm2_is_rejected_not_guessed(smollm2_tokenizer):
    # SmolLM2 injects its default system prompt only when messages exist, so the generation
    # prompt of an empty history is not a prefix of the render: the row is rejected (readers drop
    # leading assistant turns before this point anyway).
    with pytest.raises(ChatTemplateError, match="template rewrites history"):
        tokenize_conversation(smollm2_tokenizer, [{"role": "assistant", "content": "Hello!"}])


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
    with pytest.raises(ChatTemplateError, match="a reply cut at a token limit .* whose text's end is not found"):
        _cut_end(cut[1], "assistant: 2+2 IS 4.\n", 11, 21)
    assert _cut_end({"content": "", "reasoning_content": "Two and "}, "<think>\nTwo and\n</think>", 0, 25) == 15
