"""Per-row settings of regenerate (runtime/chat/setting_mixtures.py): mixtures parsed and
normalised, draws reproducible from (seed, row id, setting) and in proportion to the weights."""

from __future__ import annotations

import pytest

from runtime.chat.setting_mixtures import Mixture, draw_key, parse_mixture, row_settings, template_value
from peagle_data.regenerate.run import RegenerateConfig
from runtime.chat.chat_template import parse_chat_template_kwargs


def test_a_mixture_is_normalised_and_a_plain_value_is_cast():
    m = parse_mixture('{"0.6": 3, "1.0": 7}', "--temperature", float)
    assert m == Mixture({"0.6": 0.3, "1.0": 0.7}, {"0.6": 0.6, "1.0": 1.0})
    assert parse_mixture({"low": 1, "high": 1}, "--reasoning-effort", str).weights == {"low": 0.5, "high": 0.5}
    assert parse_mixture("0.7", "--temperature", float) == 0.7
    assert template_value("true") is True and template_value("low") == "low" and template_value("2") == 2


@pytest.mark.parametrize("spec,message", [
    ('{"0.6": 0.3, ', "invalid JSON"), ("{}", "an empty mixture"), ('{"0.6": -1}', "finite number >= 0"),
    ('{"0.6": 0, "1.0": 0}', "sum to 0"), ('{"hot": 1}', "mixture key 'hot'"),
    ('{"1": 0.5, "1.0": 0.5}', "keys '1' and '1.0' are the same value"), ('{"0.6": true}', "finite number"),
    # JSON keeps the last of a key given twice: {"0.6": 1} here, the 0.3 dropped without a word
    ('{"0.6": 0.3, "1.0": 0.7, "0.6": 1}', "the key '0.6' is given twice (JSON keeps the last silently)"),
])
def test_bad_mixtures_are_refused_naming_the_option(spec, message):
    with pytest.raises(ValueError, match="--temperature") as e:
        parse_mixture(spec, "--temperature", float)
    assert message in str(e.value)


def test_draws_depend_only_on_seed_row_and_setting_and_follow_the_weights():
    m = parse_mixture({"a": 0.2, "b": 0.8}, "x", str)
    draws = [draw_key(m, 0, f"row{i}", "x") for i in range(2000)]
    assert draws == [draw_key(m, 0, f"row{i}", "x") for i in range(2000)]  # reproducible
    assert 0.17 < draws.count("a") / 2000 < 0.23  # 0.2 +- 3.4 standard deviations
    assert draws != [draw_key(m, 1, f"row{i}", "x") for i in range(2000)]  # the seed matters
    assert draws != [draw_key(m, 0, f"row{i}", "y") for i in range(2000)]  # settings draw independently
    assert {draw_key(parse_mixture({"a": 0, "b": 1}, "x", str), 0, f"r{i}", "x") for i in range(50)} == {"b"}


def test_row_settings_draw_each_setting_and_keep_fixed_ones():
    t = parse_mixture({"0.6": 0.5, "1.0": 0.5}, "t", float)
    s = row_settings(t, {"reasoning_effort": "high", "enable_thinking": parse_mixture({"true": 1, "false": 1}, "e",
                                                                                     template_value)}, 3, "r7")
    assert s.temperature in (0.6, 1.0) and s.drawn["reasoning_effort"] == "high"
    assert s.drawn["enable_thinking"] in (True, False)
    assert s == row_settings(t, {"reasoning_effort": "high", "enable_thinking": parse_mixture(
        {"true": 1, "false": 1}, "e", template_value)}, 3, "r7")


def test_regenerate_config_normalises_and_refuses():
    cfg = RegenerateConfig(temperature='{"0.6": 0.3, "1.0": 0.7}', reasoning_effort='{"low": 1, "high": 3}',
                           enable_thinking="false", template_mixture='{"thinking": {"true": 1, "false": 1}}')
    assert cfg.temperature == {"0.6": 0.3, "1.0": 0.7} and cfg.reasoning_effort == {"low": 0.25, "high": 0.75}
    assert cfg.enable_thinking is False and cfg.template_mixture == {"thinking": {"true": 0.5, "false": 0.5}}
    assert cfg.per_row and not RegenerateConfig(temperature=0.7).per_row
    assert RegenerateConfig(temperature="0.7").temperature == 0.7
    with pytest.raises(ValueError, match="--enable-thinking: expected true or false, got 'maybe'"):
        RegenerateConfig(enable_thinking="maybe")
    with pytest.raises(ValueError, match="--template-mixture sets reasoning_effort, given by its own option too"):
        RegenerateConfig(reasoning_effort="low", template_mixture={"reasoning_effort": "high"})
    with pytest.raises(ValueError, match="--reasoning-parser must be one of"):
        RegenerateConfig(reasoning_parser="qwen")
    with pytest.raises(ValueError, match="^--template-mixture: the key 'thinking' is given twice"):
        RegenerateConfig(template_mixture='{"thinking": {"true": 1}, "thinking": false}')
    with pytest.raises(ValueError, match="^--chat-template-kwargs: the key 'enable_thinking' is given twice"):
        RegenerateConfig(chat_template_kwargs=parse_chat_template_kwargs(
            '{"enable_thinking": true, "enable_thinking": false}'))
