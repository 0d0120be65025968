"""Spans -> token loss mask: a last special token followed by more of the reply is a reject, not a cut."""

from __future__ import annotations

import pytest

from peagle_data.chat.tokens import tokenize_conversation
from runtime.chat.chat_template import ChatTemplateError
from tests.peagle_data.chat.test_tokens import masked_texts


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
