"""The served checks: a row's tokens before each supervised turn are its generation prompt tokenized alone."""

from __future__ import annotations

from dataclasses import replace

import pytest

from peagle_data.chat.render import render_rows
from peagle_data.chat.served import SERVED_PROMPT_CHANGED, needs_turn_rows
from peagle_data.chat.tokens import tokenize_rendered, tokenize_turns
from tests.peagle_data.chat.test_tokens import MULTI_TURN, runs


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
