"""``peagle-eval``'s decoding of generated answers: never cleaned up (an answer is rendered into the next
turn's prompt and re-tokenized; the report's texts are what the verifier said), and parsed as served
(issue 32: a Harmony answer's final channel is the next turn's history, not the flat decode)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from peagle_train.evaluate import online
from peagle_train.evaluate.config import EvalConfig
from peagle_train.evaluate.prompts import Prompt, answer_text, history_message
from peagle_train.generate.speculative import GenerationResult
from stores.errors import InputError
from tests.chat_templates import harmony_tokenizer, think_tokenizer

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
    assert history_message(tok, ids + eos, eos) == {"role": "assistant", "content": SPACED}


class ScriptedEngine:
    """peagle's engine replaced by fixed answers: each turn generates the next of ``answers`` (both decodings)."""

    def __init__(self, tokenizer, answers: list[list[int]], eos: set[int]):
        self.K, self.eos, self.tree, self.answers, self.prompts = 1, eos, None, list(answers), []

    def generate_ids(self, ids, max_new_tokens, T, **_):
        self.prompts.append(list(ids))
        tokens = self.answers.pop(0)
        return GenerationResult(tokens=list(tokens)), GenerationResult(tokens=list(tokens))


def run_scripted(monkeypatch, tok, answers, eos, parser):
    engine = ScriptedEngine(tok, answers, eos)
    monkeypatch.setattr(online, "PEAGLEInference", SimpleNamespace(from_models=lambda *a, **k: engine))
    config = EvalConfig(max_new_tokens=64, warmup=False, measure_costs=False, reasoning_parser=parser)
    prompt = Prompt("q1", ["Say hi.", "Again, shorter."])
    report = online.evaluate_prompts(torch.nn.Linear(1, 1), None, tok, [prompt], config, recurrent_layers=[])
    return engine.prompts, report


HARMONY_ANSWER = ("<|channel|>analysis<|message|>User greets. Reply.<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>Hello  there!<|return|>")


def test_peagle_engine_turn_2_takes_the_final_channel_not_the_flat_decode(smollm2_tokenizer, monkeypatch):
    tok = harmony_tokenizer(smollm2_tokenizer)
    ret = tok.convert_tokens_to_ids("<|return|>")
    answer = tok(HARMONY_ANSWER, add_special_tokens=False)["input_ids"]
    prompts, report = run_scripted(monkeypatch, tok, [answer, answer], {ret}, "openai_gptoss")
    turn2 = tok.decode(prompts[1])
    assert turn2.endswith("<|start|>user<|message|>Say hi.<|end|>"
                          "<|start|>assistant<|channel|>final<|message|>Hello  there!<|end|>"
                          "<|start|>user<|message|>Again, shorter.<|end|><|start|>assistant")
    assert "analysisUser greets" not in turn2 and "User greets" not in turn2  # earlier analysis: not rendered
    assert report["num_turns"] == 2
    with pytest.raises(InputError, match="prompt 'q1' turn 0: .*pass --reasoning-parser openai_gptoss"):
        run_scripted(monkeypatch, tok, [answer, answer], {ret}, None)


def test_peagle_engine_turn_2_takes_the_think_parsers_content(smollm2_tokenizer, monkeypatch):
    tok = think_tokenizer(smollm2_tokenizer)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    answer = tok("<think>\nGreet back.\n</think>\n\nHi!", add_special_tokens=False)["input_ids"] + [eos]
    prompts, _ = run_scripted(monkeypatch, tok, [answer, answer], {eos}, "qwen3")
    # the parser's content ("\n\nHi!", whitespace kept); Qwen3's template renders an earlier turn's content as
    # it is and drops its reasoning
    assert tok.decode(prompts[1]).endswith("<|im_start|>assistant\n\n\nHi!<|im_end|>\n"
                                           "<|im_start|>user\nAgain, shorter.<|im_end|>\n<|im_start|>assistant\n")
    assert "Greet back" not in tok.decode(prompts[1])
