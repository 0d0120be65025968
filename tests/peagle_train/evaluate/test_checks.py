"""peagle-eval's template mode (``template_mode``): the chat template variables its prompts are rendered
with, the drafter's by default; another mode, or a STORE made in another, refused unless allowed."""

from __future__ import annotations

import json
import re

import pytest

from peagle_train.evaluate.checks import template_mode
from peagle_train.generate.checks import trained_template_kwargs
from peagle_train.evaluate.config import EvalConfig
from peagle_train.evaluate.report import format_report
from stores.errors import StoreMismatchError
from stores.features.feature_store import FeatureStore

OFF = {"enable_thinking": False}


def _drafter(path, tokenizer_record):
    path.mkdir()
    config = {"architectures": ["LlamaForCausalLMEagle3"]}
    if tokenizer_record is not None:
        config["peagle_training"] = {"tokenizer": tokenizer_record}
    (path / "config.json").write_text(json.dumps(config))
    return path


def _store(path, tokenizer_record):
    FeatureStore.create(path, n_blocks=1, block_size=8, max_segments=2, layers=[1, 2, 3], hidden_size=4,
                        vocab_size=16, verifier={"name_or_path": "v"}, tokenizer=tokenizer_record)
    return path


def test_the_drafters_mode_is_the_default(tmp_path):
    d = _drafter(tmp_path / "d", {"name": "v", "chat_template_kwargs": OFF})
    assert trained_template_kwargs(d) == OFF
    assert template_mode(d, None) == {"chat_template_kwargs": OFF, "trained_chat_template_kwargs": OFF,
                                      "mismatches": [], "mismatch_allowed": False}
    assert template_mode(d, {"enable_thinking": False})["mismatches"] == []
    old = _drafter(tmp_path / "old", {"name": "v"})  # recorded before peagle recorded the variables: none
    assert template_mode(old, None)["chat_template_kwargs"] == {}
    other_tool = _drafter(tmp_path / "o", None)  # nothing to check
    assert trained_template_kwargs(other_tool) is None
    assert template_mode(other_tool, OFF) == {"chat_template_kwargs": OFF, "trained_chat_template_kwargs": None,
                                              "mismatches": [], "mismatch_allowed": False}


def test_another_mode_is_refused_unless_allowed_and_then_reported(tmp_path):
    d = _drafter(tmp_path / "d", {"name": "v", "chat_template_kwargs": OFF})
    with pytest.raises(StoreMismatchError) as info:
        template_mode(d, {})
    assert str(info.value).startswith(
        f"the drafter {d} was trained on data rendered with chat template kwargs {{\"enable_thinking\": false}}, but "
        "--chat-template-kwargs gives none (the template's defaults): a drafter's acceptance holds for the mode it "
        "was trained in")
    assert str(info.value).endswith("or pass --allow-template-mode-mismatch to measure it in another mode (the "
                                    "report's template_mode says so)")
    mode = template_mode(d, {}, allow_mismatch=True)
    assert mode["chat_template_kwargs"] == {} and mode["mismatch_allowed"] is True
    assert len(mode["mismatches"]) == 1
    text = format_report({"template_mode": mode})
    assert text.splitlines() == [
        "template mode: chat template kwargs none (the template's defaults)",
        f"  WARNING: another mode than the drafter's (--allow-template-mode-mismatch): {mode['mismatches'][0]}"]


def test_a_store_of_another_mode_is_refused(tmp_path):
    d = _drafter(tmp_path / "d", {"name": "v", "chat_template_kwargs": OFF})
    same = _store(tmp_path / "same.zarr", {"name": "v", "chat_template_kwargs": OFF})
    assert template_mode(d, None, store=same)["store_chat_template_kwargs"] == OFF
    other = _store(tmp_path / "other.zarr", {"name": "v", "chat_template_kwargs": {}})
    with pytest.raises(StoreMismatchError, match=f"the store {other} holds data rendered with chat template kwargs "
                                                 "none \\(the template's defaults\\), but the drafter was trained with "
                                                 "{\"enable_thinking\": false}"):
        template_mode(d, None, store=other)
    assert template_mode(d, None, allow_mismatch=True, store=other)["mismatch_allowed"] is True


def test_the_options_are_checked():
    assert EvalConfig(chat_template_kwargs={"reasoning_effort": "high"}).chat_template_kwargs == {
        "reasoning_effort": "high"}
    assert EvalConfig().chat_template_kwargs is None
    with pytest.raises(ValueError, match="may not set 'tokenize'"):
        EvalConfig(chat_template_kwargs={"tokenize": False})


def test_a_mode_mixture_is_recorded_and_checked_against_the_drafters_fixed_variables(tmp_path):
    """--reasoning-effort / --enable-thinking / --template-mixture draw each prompt's mode: the mixture and seed are
    recorded; a drawn value the drafter's data fixed otherwise is a mismatch (refused unless allowed), the drawn
    variable then leaving the fixed ones; drawn variables the checkpoint does not fix are not checked."""
    from runtime.chat.setting_mixtures import parse_mixture, template_value

    efforts = {"reasoning_effort": parse_mixture({"low": 1, "high": 3}, "", template_value)}
    free = _drafter(tmp_path / "free", {"name": "v", "chat_template_kwargs": {"persona": "terse"}})
    mode = template_mode(free, None, variables=efforts, seed=7)
    assert mode == {"chat_template_kwargs": {"persona": "terse"}, "trained_chat_template_kwargs": {"persona": "terse"},
                    "mixture": {"reasoning_effort": {"low": 0.25, "high": 0.75}}, "seed": 7, "mismatches": [],
                    "mismatch_allowed": False}
    assert format_report({"template_mode": mode}).splitlines()[1] == (
        '  drawn per prompt from --seed 7: {"reasoning_effort": {"low": 0.25, "high": 0.75}}')
    high = _drafter(tmp_path / "high", {"name": "v", "chat_template_kwargs": {"reasoning_effort": "high"}})
    with pytest.raises(StoreMismatchError, match=re.escape(
            f"the drafter {high} was trained on data rendered with reasoning_effort \"high\" (chat template kwargs "
            "{\"reasoning_effort\": \"high\"}), but the mixture draws reasoning_effort from [\"low\", \"high\"]")):
        template_mode(high, None, variables=efforts)
    allowed = template_mode(high, None, allow_mismatch=True, variables=efforts)
    assert allowed["chat_template_kwargs"] == {} and allowed["mismatch_allowed"] is True
    only_high = {"reasoning_effort": parse_mixture({"high": 1}, "", template_value)}
    assert template_mode(high, None, variables=only_high)["mismatches"] == []


def test_the_mixture_options_are_checked():
    cfg = EvalConfig(reasoning_effort='{"low": 1, "high": 1}', enable_thinking="true",
                     template_mixture='{"thinking": {"true": 3, "false": 1}}')
    assert (cfg.reasoning_effort, cfg.enable_thinking) == ({"low": 0.5, "high": 0.5}, True)
    assert cfg.template_mixture == {"thinking": {"true": 0.75, "false": 0.25}}
    assert set(cfg.mode_variables()) == {"reasoning_effort", "enable_thinking", "thinking"}
    assert EvalConfig().mode_variables() == {}
    with pytest.raises(ValueError, match="reasoning_effort given both by --chat-template-kwargs"):
        EvalConfig(chat_template_kwargs={"reasoning_effort": "high"}, reasoning_effort='{"low": 1}')
    with pytest.raises(ValueError, match="--enable-thinking: mixture key 'maybe': expected true or false"):
        EvalConfig(enable_thinking='{"maybe": 1}')
    with pytest.raises(ValueError, match="--template-mixture sets enable_thinking, given by its own option too"):
        EvalConfig(enable_thinking="true", template_mixture={"enable_thinking": "false"})
    from peagle_train.evaluate.run import EvalRun

    with pytest.raises(ValueError, match="draw each online prompt's mode: give --prompts"):
        EvalRun(drafter="d", store="s.zarr", settings=EvalConfig(reasoning_effort="high"))
