"""Units of ``peagle-eval --engine vllm`` (peagle_train/evaluate/vllm_eval.py) that need no engine."""

from __future__ import annotations

import pytest

from peagle_train.evaluate.prompts import Prompt, render_turn
from peagle_train.evaluate.vllm_eval import next_turn_prompts, per_position_counts

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
    answers: list[list[dict]] = [[], []]
    first = next_turn_prompts(tok, prompts, eos, order, answers, None)
    assert first == [render_turn(tok, prompts[0], 0, []), render_turn(tok, prompts[1], 0, [])]
    assert order == [(0, 0), (1, 0)]
    second = next_turn_prompts(tok, prompts, eos, order, answers, [ids + sorted(eos), [5, 6]])
    assert answers[0] == [{"role": "assistant", "content": SPACED}]
    assert second == [render_turn(tok, prompts[0], 1, [SPACED])]
    assert order == [(0, 0), (1, 0), (0, 1)]
    assert SPACED in tok.decode(second[0], clean_up_tokenization_spaces=False)
    assert next_turn_prompts(tok, prompts, eos, order, answers, [ids]) == []


def test_per_position_counts_only_when_every_step_drafted_k():
    """vLLM exports no drafts-per-position counter: reached = num_drafts only if each step drafted K."""
    c = {"num_drafts": 5, "num_draft_tokens": 15, "num_accepted_tokens": 7, "accepted_per_pos": [4, 2, 1]}
    assert per_position_counts(c, 3) == ([4, 2, 1], [5, 5, 5])
    assert per_position_counts({**c, "accepted_per_pos": [4]}, 3) == ([4, 0, 0], [5, 5, 5])
    assert per_position_counts({**c, "num_draft_tokens": 14}, 3) is None  # one step drafted 2


def test_report_text_says_why_per_position_figures_are_missing():
    from peagle_train.evaluate.report import format_report

    note = "vLLM drafted 14 tokens in 5 steps, not K=3 at each"
    report = {"acceptance_length": 2.4, "acceptance_rate": 0.5, "accepted": 7, "drafted": 14, "num_prompts": 1,
              "num_turns": 1, "num_draft_tokens": 3, "tokens_per_second": 1.0, "baseline_tokens_per_second": 1.0,
              "speedup": 1.0, "identical_to_greedy": True, "per_position_acceptance": None,
              "per_position_note": note}
    text = format_report(report)
    assert f"  per position       {note}" in text.splitlines()


def test_speculators_loading_refuses_a_verifier_other_than_the_drafters(tmp_path, make_tiny_llama):
    """``--vllm-loading speculators``: vLLM loads the drafter's named verifier; --verifier must be it."""
    import json
    import shutil

    import pytest

    from peagle_train.evaluate.vllm_eval import check_speculators_verifier
    from stores.errors import InputError

    a = make_tiny_llama(tmp_path / "a")
    same = tmp_path / "a_copy"
    shutil.copytree(a, same)
    b = make_tiny_llama(tmp_path / "b", hidden=32)
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"speculators_config": {"verifier": {"name_or_path": str(a)}}}))
    check_speculators_verifier(drafter, str(a))
    check_speculators_verifier(drafter, str(same))  # another directory holding the same model
    with pytest.raises(InputError) as e:
        check_speculators_verifier(drafter, str(b))
    assert e.value.field == "--verifier" and e.value.file == str(drafter / "config.json")
    assert (f"--vllm-loading speculators: vLLM would load the verifier {str(a)!r} that the drafter's "
            f"speculators_config names, but the reference runs on --verifier {str(b)!r}, a different model; pass "
            f"--vllm-loading speculative_config (the verifier given to vLLM as the model, the drafter as "
            f"speculative_config) or --verifier {str(a)!r}") in str(e.value)
    (drafter / "config.json").write_text(json.dumps({"speculators_config": {"verifier": {"name_or_path": "nope"}}}))
    with pytest.raises(InputError, match="vLLM would load the verifier 'nope' the drafter names, which does not "
                                         "resolve here"):
        check_speculators_verifier(drafter, str(a))


def _fake_ref_and_spec(dtype: str, temperature: float = 0.0):
    from types import SimpleNamespace

    from peagle_train.evaluate.vllm_eval import VllmReference
    from peagle_train.generate.vllm_engine import VllmRun

    tok = SimpleNamespace(decode=lambda ids, **kw: " ".join(map(str, ids)))
    plain = VllmRun(tokens=[[5, 6, 7], [5, 6, 7]], tokens_per_second={1: 10.0},
                    top_logits=[[{5: 20.0, 9: 18.0}, {6: 20.0, 8: 19.5}, {7: 20.0, 3: 17.0}]] * 2)
    counters = {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 2, "accepted_per_pos": [2]}
    spec = VllmRun(tokens=[[5, 6, 7], [5, 8, 4]], counters=counters, tokens_per_second={1: 12.0},
                   per_request=[{"accepted": [1], "drafted": [3]}] * 2, num_speculative_tokens=3,
                   engine_settings={"dtype": dtype, "enforce_eager": False})
    ref = VllmReference(name="v", directory="v", tokenizer=tok, eos={2}, prompts_file="p",
                        prompts=[Prompt("a", ["x"]), Prompt("b", ["y"])], order=[(0, 0), (1, 0)],
                        requests=[[1], [1]], plain=plain)
    return ref, spec


def test_vllm_report_in_bf16_counts_a_near_tie_and_float32_stays_exact():
    """vLLM on an accelerator runs bf16: prompt b's second token is 0.5 below the reference's top logit
    (<= 8 ulps of bf16 at 20 = 1.0): a near-tie divergence, not a mismatch; the same outputs in float32 fail."""
    from peagle_train.evaluate.config import EvalConfig
    from peagle_train.evaluate.vllm_eval import vllm_report

    ref, spec = _fake_ref_and_spec("bfloat16")
    report = vllm_report("d", ref, spec, EvalConfig(engine="vllm"), "0.32.0")
    assert report["mismatches"] == [] and report["near_tie_divergences"] == 1 and report["near_tie_prompts"] == ["b"]
    assert report["identical_to_greedy"] is False
    assert report["per_prompt"][1]["divergence"] == {"position": 1, "reference_token": 6, "token": 8, "margin": 0.5,
                                                     "tolerance": 1.0, "near_tie": True}
    assert report["acceptance_scheme"] == "greedy verification (T=0)"
    ref, spec = _fake_ref_and_spec("float32")
    report = vllm_report("d", ref, spec, EvalConfig(engine="vllm"), "0.32.0")
    assert report["mismatches"] == ["b"] and report["near_tie_divergences"] == 0


def test_vllm_report_at_temperature_names_the_scheme_and_compares_nothing():
    from peagle_train.evaluate.config import EvalConfig
    from peagle_train.evaluate.vllm_eval import vllm_report

    ref, spec = _fake_ref_and_spec("float32", 1.0)
    cfg = EvalConfig(engine="vllm", temperature=1.0, seed=4, draft_sample_method="probabilistic")
    report = vllm_report("d", ref, spec, cfg, "0.32.0")
    assert report["identical_to_greedy"] is None and report["mismatches"] == [] and report["seed"] == 4
    assert report["draft_sample_method"] == "probabilistic"
    assert report["acceptance_scheme"].startswith("rejection sampling at T=1, draft_sample_method=probabilistic")


def test_later_turns_take_the_harmony_final_channel(smollm2_tokenizer):
    """--engine vllm builds turn 2 from the parser's content, as peagle's engine does (issue 32)."""
    from tests.chat_templates import harmony_tokenizer

    tok = harmony_tokenizer(smollm2_tokenizer)
    ret = tok.convert_tokens_to_ids("<|return|>")
    answer = tok("<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant<|channel|>final<|message|>Done."
                 "<|return|>", add_special_tokens=False)["input_ids"]
    prompts, order, answers = [Prompt("a", ["first", "second"])], [], [[]]
    next_turn_prompts(tok, prompts, {ret}, order, answers, None, reasoning_parser="openai_gptoss")
    second = next_turn_prompts(tok, prompts, {ret}, order, answers, [answer], reasoning_parser="openai_gptoss")
    assert answers == [[{"role": "assistant", "content": "Done.", "reasoning_content": "Plan."}]]
    assert tok.decode(second[0]).endswith("<|start|>assistant<|channel|>final<|message|>Done.<|end|>"
                                          "<|start|>user<|message|>second<|end|><|start|>assistant")


def test_the_reasoning_parser_reads_the_runs_template_variables(smollm2_tokenizer):
    """peagle-eval's --chat-template-kwargs (each prompt's mode) reach the parser (qwen3 with enable_thinking false: all content, as
    vLLM's parser reads the request's variables) and render the prompts (the empty think block)."""
    from tests.chat_templates import think_tokenizer

    tok = think_tokenizer(smollm2_tokenizer)
    eos = {tok.convert_tokens_to_ids("<|im_end|>")}
    answer = tok("Plan.</think>\n\nHi!", add_special_tokens=False)["input_ids"]
    off = {"enable_thinking": False}
    histories = {}
    for name, kwargs in (("on", None), ("off", off)):
        prompts, order, answers = [Prompt("a", ["first", "second"])], [], [[]]
        first = next_turn_prompts(tok, prompts, eos, order, answers, None, [kwargs], "qwen3")
        second = next_turn_prompts(tok, prompts, eos, order, answers, [answer], [kwargs], "qwen3")
        histories[name] = answers[0][0]
        assert tok.decode(first[0]).endswith("assistant\n" + ("<think>\n\n</think>\n\n" if kwargs else ""))
        assert second[0] == render_turn(tok, prompts[0], 1, answers[0], kwargs)
    assert histories["on"] == {"role": "assistant", "content": "\n\nHi!", "reasoning_content": "Plan."}
    assert histories["off"] == {"role": "assistant", "content": "Plan.</think>\n\nHi!"}


def test_vllm_report_gives_each_turns_mode_and_the_acceptance_per_mode():
    """A mode mixture under --engine vllm: each turn records its prompt's template variables and the steps that
    drafted; per_mode sums vLLM's per-request counts by mode."""
    import dataclasses

    from peagle_train.evaluate.config import EvalConfig
    from peagle_train.evaluate.vllm_eval import vllm_report

    ref, spec = _fake_ref_and_spec("float32")
    ref = dataclasses.replace(ref, modes=[{"reasoning_effort": "low"}, {"reasoning_effort": "high"}])
    spec = dataclasses.replace(spec, per_request=[{"accepted": [1, 0, 2], "drafted": [3, 3, 0]},
                                                  {"accepted": [3], "drafted": [3]}])
    cfg = EvalConfig(engine="vllm", reasoning_effort={"low": 1, "high": 1})
    report = vllm_report("d", ref, spec, cfg, "0.32.0")
    assert [(t["chat_template_kwargs"], t["num_drafts"], t["accepted"]) for t in report["per_prompt"]] == [
        ({"reasoning_effort": "low"}, 2, 3), ({"reasoning_effort": "high"}, 1, 3)]
    low, high = report["per_mode"]['{"reasoning_effort": "low"}'], report["per_mode"]['{"reasoning_effort": "high"}']
    assert (low["acceptance_length"], low["acceptance_rate"], low["prompts"]) == (2.5, 0.5, 1)
    assert (high["acceptance_length"], high["acceptance_rate"], high["turns"]) == (4.0, 1.0, 1)
    assert "per_mode" not in vllm_report("d", ref, spec, EvalConfig(engine="vllm"), "0.32.0")


def newer_vllm(monkeypatch):
    """vLLM 0.34.0 installed (as its distribution says), and every way peagle starts or imports vLLM failing the
    test if reached."""
    import runtime.vllm_runtime as vr
    from peagle_train.evaluate import run, vllm_eval
    from peagle_train.generate import vllm_engine

    def reached(*args, **kwargs):
        raise AssertionError("vLLM was imported or an engine started")

    monkeypatch.setattr(vr, "installed_vllm_version", lambda: "0.34.0")
    for module, name in ((vllm_engine, "start_llm"), (vllm_engine, "import_vllm"), (run, "import_vllm"),
                         (vllm_eval, "vllm_reference"), (vllm_eval, "vllm_speculative")):
        monkeypatch.setattr(module, name, reached)


NEWER_VLLM = ("vLLM 0.34.0 (installed here) no longer serves P-EAGLE drafters", "vLLM 0.33 is the last release",
              "peagle-train --method dflash")


def test_peagle_eval_engine_vllm_refuses_a_vllm_that_dropped_p_eagle(tmp_path, tiny_verifier, tiny_verifier_dir,
                                                                     monkeypatch):
    import json

    from click.testing import CliRunner

    from cli.eval import main as eval_main
    from peagle_train.evaluate.config import EvalConfig
    from peagle_train.evaluate.vllm_eval import run_vllm_eval
    from peagle_train.model.checkpoint import save_drafter
    from stores.errors import InputError
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    newer_vllm(monkeypatch)
    drafter = tiny_drafter(tiny_verifier)
    drafter.config.verifier_name_or_path = str(tiny_verifier_dir)
    save_drafter(drafter, tmp_path / "drafter")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Hi"]}) + "\n")
    result = CliRunner().invoke(eval_main, ["--drafter", str(tmp_path / "drafter"), "--prompts", str(prompts),
                                            "--engine", "vllm", "--no-measure-costs"])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "field '--engine'" in text and all(part in text for part in NEWER_VLLM), text
    with pytest.raises(InputError) as e:  # the library function checks it too
        run_vllm_eval(tmp_path / "drafter", None, prompts, EvalConfig(engine="vllm"))
    assert all(part in str(e.value) for part in NEWER_VLLM), e.value


def test_a_dflash_drafter_is_not_refused_by_the_vllm_that_dropped_p_eagle(tmp_path, tiny_verifier, tiny_verifier_dir,
                                                                          monkeypatch):
    """vLLM 0.34 serves DFlash: the version check is the drafter kind's, so a DFlash checkpoint goes on to start vLLM
    (here: reaches the patched import, which fails the test's stand-in) where a P-EAGLE one is refused."""
    import json

    from peagle_train.generate import inference
    from peagle_train.evaluate.config import EvalConfig
    from peagle_train.evaluate.vllm_eval import run_vllm_eval
    from peagle_train.model.dflash_checkpoint import save_dflash
    from peagle_train.train.kinds import DRAFTER_KINDS
    from stores.errors import InputError
    from tests.peagle_train.generate.test_speculative import tiny_dflash

    newer_vllm(monkeypatch)
    with pytest.raises(InputError, match="no longer serves P-EAGLE"):
        DRAFTER_KINDS["peagle"].check_installed_vllm()
    DRAFTER_KINDS["dflash"].check_installed_vllm()  # served by every vLLM from 0.32: no refusal
    drafter = tiny_dflash(tiny_verifier)
    drafter.config.verifier_name_or_path = str(tiny_verifier_dir)
    save_dflash(drafter, tmp_path / "dflash")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"turns": ["Hi"]}) + "\n")
    with pytest.raises(AssertionError, match="vLLM was imported or an engine started"):
        run_vllm_eval(tmp_path / "dflash", None, prompts, EvalConfig(engine="vllm"))
    monkeypatch.setattr(inference, "load_any_drafter", lambda *a: pytest.fail("reached the loading: not refused"))
    with pytest.raises(pytest.fail.Exception, match="not refused"):
        inference.PEAGLEInference(tmp_path / "dflash", "smollm2-135m", engine="vllm")
