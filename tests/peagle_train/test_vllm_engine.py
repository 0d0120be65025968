"""Units of ``peagle-eval --engine vllm`` (peagle_train/evaluate/vllm_engine.py) that need no engine."""

from __future__ import annotations

from peagle_train.evaluate.prompts import Prompt, render_turn
from peagle_train.evaluate.vllm_engine import next_turn_prompts

SPACED = "if x != y: print('social' .)"


def test_later_turns_take_the_answers_without_cleaning_up_spaces(smollm2_tokenizer_dir):
    """Turn 2's history is the turn-1 answer as generated (``x != y``), not a cleaned-up decode
    (``x!= y``), with a tokenizer whose config cleans up (as Llama-3.x tokenizers do)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_dir, clean_up_tokenization_spaces=True,
                                        clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output=True)
    ids = tok(SPACED, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == "if x!= y: print('social'.)"  # the old decoding
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    prompts = [Prompt("a", ["first", "second"]), Prompt("b", ["only"])]
    order: list[tuple[int, int]] = []
    answers: list[list[str]] = [[], []]
    first = next_turn_prompts(tok, prompts, eos, order, answers, None)
    assert first == [render_turn(tok, prompts[0], 0, []), render_turn(tok, prompts[1], 0, [])]
    assert order == [(0, 0), (1, 0)]
    second = next_turn_prompts(tok, prompts, eos, order, answers, [ids + sorted(eos), [5, 6]])
    assert answers[0] == [SPACED]
    assert second == [render_turn(tok, prompts[0], 1, [SPACED])]
    assert order == [(0, 0), (1, 0), (0, 1)]
    assert SPACED in tok.decode(second[0], clean_up_tokenization_spaces=False)
    assert next_turn_prompts(tok, prompts, eos, order, answers, [ids]) == []
