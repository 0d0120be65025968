"""Turns trained on the verifier's generated ids (``token_ids``)."""

from __future__ import annotations

import pytest

from peagle_data.chat.tokens import tokenize_conversation
from runtime.chat.chat_template import ChatTemplateError
from tests.peagle_data.chat.test_tokens import reference_ids, runs


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
