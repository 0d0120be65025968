"""Settings drawn per row from mixtures: the temperature and chat-template variables of ``regenerate``'s rows
and of ``peagle-eval``'s prompts (docs/design.md §1). A mixture is a JSON object ``{value: weight}``, e.g.
``{"0.6": 0.3, "1.0": 0.7}``; its weights are normalised to sum to 1.

Each row draws each mixed setting independently and reproducibly: ``u = sha256(f"{seed}/{row id}/{name}")``
read as a number in ``[0, 1)`` (its first 8 bytes / 2**64) picks the first value whose cumulative weight,
in the order written, exceeds ``u``. The draw depends only on ``--seed``, the row's id and the setting's
name, not on batching, threads or ``--resume`` (a resumed run draws what the first run drew), and two
settings of one row are independent.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from runtime.chat.chat_template import loads_unique
from stores.files import json_error_text

__all__ = ["Mixture", "parse_mixture", "template_value", "draw_key", "RowSettings", "row_settings",
           "temperature_value", "effort_value", "thinking_value", "parse_template_mixture", "normalised",
           "template_variables", "MIXED_VARIABLE_OPTIONS", "mode_options"]

MIXED_VARIABLE_OPTIONS = ("reasoning_effort", "enable_thinking", "template_mixture")
"""The options that draw chat-template variables per row (``--reasoning-effort``, ``--enable-thinking``,
``--template-mixture``), in ``regenerate`` and ``peagle-eval``."""


@dataclass(frozen=True)
class Mixture:
    """A weighted choice: ``weights`` maps each value's key (as written, e.g. ``"0.6"``) to its weight,
    normalised to sum to 1, in the order written; ``values`` maps the key to the value it stands for."""

    weights: dict[str, float]
    values: dict[str, Any]


def _loads(text: Any, option: str) -> Any:
    """A JSON mixture given as text (``'{"a": 1}'``) as a dict; anything else unchanged."""
    if isinstance(text, str) and text.strip().startswith("{"):
        try:
            return loads_unique(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{option}: invalid JSON ({json_error_text(e)} at character {e.pos})") from None
        except ValueError as e:  # a key given twice
            raise ValueError(f"{option}: {e}") from None
    return text


def parse_mixture(value: Any, option: str, cast: Callable[[Any], Any]) -> Any | Mixture:
    """A fixed value (``cast(value)``) or a :class:`Mixture` from an option's value.

    Args:
        value: a plain value, a JSON object as text, or a dict (a config file's); a mixture's keys are
            ``cast`` to the values they stand for, its weights must be finite numbers >= 0, not all 0.
        option: the option's name, for the errors.
        cast: the key (or plain value) to a value; raises ValueError or TypeError for a bad one.

    Raises:
        ValueError: bad JSON, a bad key or weight, two keys of one value, an empty mixture (names ``option``).
    """
    value = _loads(value, option)
    if not isinstance(value, dict):
        try:
            return cast(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{option}: {e}") from None
    if not value:
        raise ValueError(f"{option}: an empty mixture; give a value or {{value: weight, ...}}")
    values, weights = {}, {}
    for key, weight in value.items():
        try:
            values[str(key)] = cast(key)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{option}: mixture key {key!r}: {e}") from None
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ValueError(f"{option}: the weight of {key!r} must be a finite number >= 0, got {weight!r}")
        weights[str(key)] = float(weight)
    seen: dict[str, str] = {}
    for key, v in values.items():
        other = seen.setdefault(json.dumps(v, sort_keys=True), key)
        if other != key:
            raise ValueError(f"{option}: keys {other!r} and {key!r} are the same value {v!r}")
    total = sum(weights.values())
    if total <= 0:
        raise ValueError(f"{option}: the weights sum to 0")
    return Mixture({k: w / total for k, w in weights.items()}, values)


def template_value(key: Any) -> Any:
    """A chat-template variable's value from a mixture key or plain value: JSON where it parses
    (``"true"`` -> True, ``"2"`` -> 2), else the text itself (``"low"``)."""
    if not isinstance(key, str):
        return key
    try:
        return json.loads(key)
    except json.JSONDecodeError:
        return key


def draw_key(mixture: Mixture, seed: int, row_id: str, name: str) -> str:
    """The key ``row_id`` draws from ``mixture`` for the setting ``name`` (module docstring)."""
    digest = hashlib.sha256(f"{seed}/{row_id}/{name}".encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0 ** 64
    acc = 0.0
    keys = [k for k, w in mixture.weights.items() if w > 0]
    for key in keys:
        acc += mixture.weights[key]
        if u < acc:
            return key
    return keys[-1]  # u within rounding of 1


@dataclass(frozen=True)
class RowSettings:
    """One row's settings: its ``temperature``, the chat-template variables drawn for it (``drawn``) and the
    run's fixed ones (``fixed``, ``--chat-template-kwargs``) under them."""

    temperature: float
    drawn: dict[str, Any]
    fixed: dict[str, Any] = field(default_factory=dict)

    def template_kwargs(self) -> dict[str, Any]:
        """Every variable the row's prompts are rendered with: the fixed ones, the drawn ones on top (a
        variable is never both: ``RegenerateConfig`` refuses it)."""
        return {**self.fixed, **self.drawn}

    def record(self) -> dict[str, Any]:
        """The row's record of them (``{"temperature", "chat_template_kwargs"}``: all its variables, so
        ``tokenize`` renders the row in the mode it was answered in)."""
        return {"temperature": self.temperature, "chat_template_kwargs": self.template_kwargs()}


def row_settings(temperature: float | Mixture, variables: dict[str, Any], seed: int, row_id: str,
                 fixed: dict[str, Any] | None = None) -> RowSettings:
    """The settings of row ``row_id``: a fixed temperature or variable as it is, a mixture's draw (:func:`draw_key`).

    Args:
        temperature: a float or a :class:`Mixture` of floats.
        variables: ``{template variable: value or Mixture}`` (None values left out).
        fixed: the run's fixed template variables (``--chat-template-kwargs``), none of ``variables``' names.

    Raises:
        ValueError: a variable both fixed and in ``variables``.
    """
    def pick(name: str, setting: Any) -> Any:
        return setting.values[draw_key(setting, seed, row_id, name)] if isinstance(setting, Mixture) else setting

    drawn = {name: pick(name, v) for name, v in variables.items() if v is not None}
    both = sorted(set(drawn) & set(fixed or {}))
    if both:
        raise ValueError(f"template variables {', '.join(both)} are both fixed and drawn per row: give each one way")
    return RowSettings(float(pick("temperature", temperature)), drawn, dict(fixed or {}))


def temperature_value(value: Any) -> float:
    """A temperature from a mixture key or plain value: a finite number >= 0 (ValueError otherwise)."""
    t = float(value)
    if not (t >= 0 and t != float("inf")):
        raise ValueError(f"a temperature must be a finite number >= 0, got {value!r}")
    return t


def effort_value(value: Any) -> str:
    """A ``reasoning_effort`` (gpt-oss: low, medium, high): a non-empty name (ValueError otherwise)."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"expected a name such as low, medium, high, got {value!r}")
    return value


def thinking_value(value: Any) -> bool:
    """An ``enable_thinking``: true or false, as a bool or JSON text (ValueError otherwise)."""
    value = template_value(value)
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def normalised(value: Any, option: str, cast: Callable[[Any], Any]) -> Any:
    """An option's value as a config keeps it: the plain value cast, or a mixture's normalised weights
    ``{key: weight}`` (:func:`parse_mixture`; ValueError naming ``option``)."""
    parsed = parse_mixture(value, option, cast)
    return parsed.weights if isinstance(parsed, Mixture) else parsed


def parse_template_mixture(value: Any) -> dict[str, Any]:
    """``--template-mixture`` as ``{variable: value or normalised {key: weight}}``.

    Raises:
        ValueError: not a JSON object of variables (names the option).
    """
    if isinstance(value, str):
        try:
            value = loads_unique(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--template-mixture: invalid JSON ({json_error_text(e)} at character {e.pos})") from None
        except ValueError as e:  # a key given twice
            raise ValueError(f"--template-mixture: {e}") from None
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.isidentifier() for k in value):
        raise ValueError("--template-mixture: expected a JSON object {variable: value or {value: weight}}, "
                         f"got {value!r}")
    return {name: normalised(spec, f"--template-mixture {name}", template_value) for name, spec in value.items()}


def template_variables(reasoning_effort: Any = None, enable_thinking: Any = None,
                       template_mixture: dict[str, Any] | None = None,
                       fixed: dict[str, Any] | None = None) -> dict[str, Any]:
    """The chat-template variables drawn per row, ``{name: value or Mixture}`` (for :func:`row_settings`), from
    the options as a config keeps them (:func:`normalised`, :func:`parse_template_mixture`); None: not given.

    Raises:
        ValueError: ``--template-mixture`` sets ``reasoning_effort``/``enable_thinking`` given by their own
            option too, or a drawn variable is also one of ``fixed`` (``--chat-template-kwargs``): each
            variable is given one way.
    """
    def setting(value: Any, cast) -> Any:
        return parse_mixture(value, "", cast) if isinstance(value, dict) else value

    twice = sorted({"reasoning_effort", "enable_thinking"} & set(template_mixture or {}))
    if twice and any(v is not None for v in (reasoning_effort, enable_thinking)):
        given = [k for k, v in (("reasoning_effort", reasoning_effort), ("enable_thinking", enable_thinking))
                 if v is not None and k in twice]
        if given:
            raise ValueError(f"--template-mixture sets {', '.join(given)}, given by its own option too: give it once")
    variables = {"reasoning_effort": setting(reasoning_effort, effort_value),
                 "enable_thinking": setting(enable_thinking, thinking_value)}
    for name, value in (template_mixture or {}).items():
        variables[name] = setting(value, template_value)
    variables = {k: v for k, v in variables.items() if v is not None}
    both = sorted(set(fixed or {}) & set(variables))
    if both:
        raise ValueError(f"{', '.join(both)} given both by --chat-template-kwargs (every row's fixed variables) "
                         "and as a per-row setting (--reasoning-effort, --enable-thinking, --template-mixture): "
                         "give each variable one way")
    return variables


def mode_options(reasoning_effort: Any, enable_thinking: Any, template_mixture: Any) -> tuple[Any, Any, Any]:
    """``--reasoning-effort``, ``--enable-thinking`` and ``--template-mixture`` as given (text, a value or a
    mixture; None: not given) -> each normalised: a value, or a normalised ``{key: weight}`` mixture
    (:func:`normalised`, :func:`parse_template_mixture`), as ``regenerate`` and ``peagle-eval`` take them.

    Raises:
        ValueError: a bad value or mixture, naming the option.
    """
    effort = None if reasoning_effort is None else normalised(reasoning_effort, "--reasoning-effort", effort_value)
    thinking = None if enable_thinking is None else normalised(enable_thinking, "--enable-thinking", thinking_value)
    mixture = None if template_mixture is None else parse_template_mixture(template_mixture)
    return effort, thinking, mixture
