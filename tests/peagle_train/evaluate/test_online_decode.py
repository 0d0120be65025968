"""``peagle-eval``'s decoding of generated answers: never cleaned up (an answer is rendered into the next
turn's prompt and re-tokenized; the report's texts are what the verifier said)."""

from __future__ import annotations

from peagle_train.evaluate.online import answer_text

SPACED = "if x != y: print('social' .)"


def test_answers_are_decoded_without_cleaning_up_spaces(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir, clean_up_tokenization_spaces=True,
                                        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    ids = tok(SPACED, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "if x!= y: print('social'.)"  # what a default decode writes
    eos = [tok.convert_tokens_to_ids("<|im_end|>")]
    assert answer_text(tok, ids + eos, eos) == SPACED
    assert tok(answer_text(tok, ids + eos, eos), add_special_tokens=False)["input_ids"] == ids
