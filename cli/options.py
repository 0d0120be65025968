"""Click options generated from the config dataclasses, and ``--config FILE`` / ``--print-config``.

A config field ``max_seq_len: int = 2048`` with the attribute docstring ``"Most tokens in a window."``
becomes ``--max-seq-len N  Most tokens in a window.  [default: 2048]``: the flag from the field
name, the metavar in one style (:func:`metavar_of`: ``N``, ``X``, ``TEXT``, ``FILE``, ``MODEL``...), the
click type from the annotation (``bool`` a flag, ``T | None`` an optional ``T``,
``list[int]`` a comma-separated list, ``list[str]`` a repeatable option), the default from the
field, the help from the docstring (litgpt's convention; docs/design.md §2: ``cli/`` is thin).
What the annotation cannot say (the choices of a ``str``, a secondary negative flag, a metavar)
comes from a small per-command table of overrides, whose choice lists are the library's own
constants, so an option and its config field cannot drift apart.

Config files (YAML or TOML) hold the same keys as the command's options (``max_seq_len`` or
``max-seq-len``, arguments by their name, e.g. ``inputs``); options given on the command line win
over the file, the file over the defaults. ``--print-config`` prints the resolved values as YAML,
which ``--config`` reads back to the same values.

A config of groups (a field whose type is a dataclass: ``TrainConfig.optim`` an ``OptimConfig``)
gives each group's fields as options like any other (``--lr`` for ``optim.lr``; a field name is
unique over the groups). ``--print-config`` prints such a command's values by group
(``optim: {lr: ...}``); a config file may hold them by group or flat (``lr: ...``, the form of the
files written before the grouping), or both.

Actions are not settings. A field marked ``metadata={"action": True}`` (``--force``, ``--resume``,
``--repair``, extract's ``--max-blocks``) says what one invocation does with an existing output, or how
much of the run it does, not what the run computes. It is an option (an :class:`ActionOption`), but
``--print-config`` and the config a run records in its output (:func:`run_config`) leave it out, and a
config file does not set it: the key is dropped, with a warning on stderr when it is set (records
written before this rule hold ``force`` and ``resume``). So ``peagle-train --config
OUTPUT/train_config.json --resume`` continues a run started with ``--force``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import re
import textwrap
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, Callable

import click
from click.core import ParameterSource

from cli.common import version_option
from runtime.chat.chat_template import loads_unique

__all__ = ["FROM_CONFIG_FILE", "ActionOption", "is_action", "example_key", "ConfigFileOption", "field_docs", "plain_text", "config_options",
           "config_file_options", "resolved_config", "run_config", "IntList", "load_config_file", "config_fields",
           "ValueOrMixture", "MIXTURE"]


def is_action(f: dataclasses.Field) -> bool:
    """True for a config field that is an action of one invocation (``--force``, ``--resume``,
    ``--repair``, extract's ``--max-blocks``: ``metadata={"action": True}``), not a setting of the run."""
    return bool(f.metadata.get("action"))


class ActionOption(click.Option):
    """The option of an action field (:func:`is_action`): never printed by ``--print-config``, never
    recorded in a run's output, never set by a ``--config`` file."""


def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass and its bases: ``{field name: text}``.

    An attribute docstring is the string literal statement right after an annotated assignment
    (PEP 257, read by Sphinx); fields without one are left out.
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__[:-1]):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


_ROLE = re.compile(r":(?:[a-z]+:)?[a-z]+:`(~?)([^`<]+?)(?:\s*<([^`>]+)>)?`")
"""A Sphinx role: ``:data:`x.Y` ``, ``:py:func:`~x.f` `` (shown ``f``), ``:ref:`text <label>` ``."""
_LITERAL = re.compile(r"``(.+?)``|`([^`]+)`")
_NONE = re.compile(r"\bNone\b(\s*[:=])?")


def plain_text(doc: str) -> str:
    """Docstring text as ``--help`` text: Sphinx roles, ````literals```` and `interpreted text` as
    plain text (line breaks kept). Applied to every option's help and every command's docstring."""
    def role(m: re.Match) -> str:
        target = m.group(2).strip()
        return target.rsplit(".", 1)[-1] if m.group(1) else target

    return _LITERAL.sub(lambda m: m.group(1) or m.group(2), _ROLE.sub(role, doc))


def _help(doc: str, flags: list[str]) -> str:
    """A field docstring as one line of ``--help``: plain text (:func:`plain_text`), Python's None
    (which cannot be typed) as "unset" ("None: x" -> "unset: x"), a bare self-reference such as
    ``(--seed)`` dropped."""
    text = plain_text(" ".join(doc.split()))
    text = _NONE.sub(lambda m: "unset:" if m.group(1) else "unset", text)
    for flag in flags:
        text = text.replace(f" ({flag})", "")
        text = re.sub(rf"\({re.escape(flag)}(?:/--[a-z-]+)?[;,] ", "(", text)
    return text


class IntList(click.ParamType):
    """``2,18,33`` (or a list of integers, from a config file) -> ``[2, 18, 33]``."""

    name = "N,N,..."

    def convert(self, value, param, ctx):
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return list(value)
        parts = [v.strip() for v in str(value).split(",")]
        try:
            if not parts or any(p == "" for p in parts):
                raise ValueError
            return [int(v) for v in parts]
        except ValueError:
            self.fail(f"expected comma-separated integers such as 2,18,33, got {value!r}", param, ctx)


class JsonObject(click.ParamType):
    """``'{"enable_thinking": false}'`` (or a mapping, from a config file) -> a dict; a JSON object only."""

    name = "JSON"

    def convert(self, value, param, ctx):
        if isinstance(value, dict):
            return dict(value)
        try:
            parsed = loads_unique(str(value))
        except json.JSONDecodeError as e:
            self.fail(f"expected a JSON object such as '{{\"enable_thinking\": false}}', got {value!r} "
                      f"({e.msg} at character {e.pos})", param, ctx)
        except ValueError as e:  # a key given twice
            self.fail(f"{value!r}: {e}", param, ctx)
        if not isinstance(parsed, dict):
            self.fail(f"expected a JSON object such as '{{\"enable_thinking\": false}}', got {value!r}", param, ctx)
        return parsed


def _unwrap_optional(tp) -> tuple[Any, bool]:
    """``T | None`` -> ``(T, True)``; anything else -> ``(tp, False)``."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return tp, False


METAVARS = {int: "N", float: "X", str: "TEXT"}
"""The one metavar style of every command: an integer ``N``, a number ``X``, text ``TEXT``; a path ``PATH``,
``DIR`` or ``FILE`` (:func:`metavar_of`); the kinds of :data:`FIELD_METAVARS`; overrides name other kinds in
the same style (``URL``, ``NAME``, ``ID``)."""

FIELD_METAVARS = {"verifier": "MODEL", "tokenizer": "MODEL", "device": "DEVICE", "init_from_sha256": "HEX",
                  "report_to": "NAME", "max_store_bytes": "SIZE"}
"""Fields whose text is of a kind: a model (an alias, a directory or a hub id), a torch device, a digest, a name,
a size in bytes (``20GB``, ``512MiB``)."""


def metavar_of(name: str, kwargs: dict[str, Any]) -> str | None:
    """The metavar of a generated option without one in its overrides (:data:`METAVARS`); None for a flag
    or a choice (click shows ``[a|b]``)."""
    tp = kwargs.get("type")
    if kwargs.get("is_flag") or isinstance(tp, click.Choice):
        return None
    if isinstance(tp, click.Path):
        return "DIR" if not tp.file_okay else "FILE" if not tp.dir_okay else "PATH"
    if name in FIELD_METAVARS:
        return FIELD_METAVARS[name]
    if tp is int or isinstance(tp, click.types.IntParamType):
        return METAVARS[int]
    if tp is float or isinstance(tp, click.types.FloatParamType):
        return METAVARS[float]
    if tp is str or isinstance(tp, click.types.StringParamType):
        return METAVARS[str]
    return None  # a type with its own name (IntList: N,N,...)


def _click_kwargs(tp, default) -> dict[str, Any]:
    """click keyword arguments for a field's type annotation and default."""
    tp, _ = _unwrap_optional(tp)
    if tp is bool:
        return {"is_flag": True} if default is False else {}
    if tp in (int, float, str):
        return {"type": tp}
    if typing.get_origin(tp) is list and typing.get_args(tp) == (int,):
        return {"type": IntList()}
    if typing.get_origin(tp) is dict and typing.get_args(tp)[:1] == (str,):
        return {"type": JsonObject()}
    if typing.get_args(tp) and str in typing.get_args(tp):  # str | list[str]: a repeatable option
        return {"multiple": True, "type": str}
    raise TypeError(f"no click option for a field of type {tp!r}; give its type in the overrides")


def config_fields(cls: type, skip: tuple[str, ...] = ()) -> list[tuple[str | None, type, dataclasses.Field]]:
    """``(group, owner, field)`` for every option field of the dataclass ``cls`` in order: a field whose
    type is a dataclass is a group, its fields listed under its name (``owner`` the group's class), unless
    ``skip`` names it (a nested config given its own :func:`config_options`, e.g. a run's ``settings``); the
    others have group None and owner ``cls``.

    Raises:
        TypeError: a field name given twice (two groups, or a group and ``cls``): flags are flat.
    """
    out, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]) and f.name not in skip:
            out.extend((f.name, hints[f.name], g) for g in dataclasses.fields(hints[f.name]))
        else:
            out.append((None, cls, f))
    names = [f.name for _, _, f in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TypeError(f"{cls.__name__}: fields {', '.join(twice)} given twice; each option is one flat name")
    return out


def config_options(cls: type, *, skip: tuple[str, ...] = (), overrides: dict[str, dict] | None = None,
                   arguments: tuple[str, ...] = ()) -> Callable:
    """A decorator adding one click parameter per field of the dataclass ``cls``, in field order.

    Args:
        cls: a config dataclass whose fields have attribute docstrings (the help text); a field whose
            type is a dataclass is a group, whose fields become the options (:func:`config_fields`).
        skip: fields that are no option (library knobs such as a queue bound).
        overrides: ``{field: click keyword arguments}`` merged over the generated ones; the key
            ``"decls"`` replaces the option's declarations (e.g. ``["--lazy-embedding/--dense-embedding"]``).
        arguments: fields that are positional arguments (``metavar`` and ``nargs`` from overrides).

    Raises:
        TypeError: a field without a docstring or of a type with no click mapping and no override; an
            action field (:func:`is_action`) given an option class that is no :class:`ActionOption`.
    """
    overrides = overrides or {}
    params, groups = [], {}
    for group, owner, f in config_fields(cls, skip):
        if f.name in skip:
            continue
        docs, hints = field_docs(owner), typing.get_type_hints(owner)
        if f.name not in docs:
            raise TypeError(f"{owner.__name__}.{f.name} has no docstring to use as its --help")
        if group is not None:
            groups[f.name] = group
        default = f.default if f.default is not dataclasses.MISSING else None
        given = overrides.get(f.name, {})
        try:
            kwargs = {**_click_kwargs(hints[f.name], default), **given}
        except TypeError:
            if "type" not in given:
                raise
            kwargs = dict(given)  # a type with no click mapping (a union of types), given there
        decls = kwargs.pop("decls", None)
        if f.name in arguments:  # a list field is one nargs=-1 argument (overrides), not a repeated option
            kwargs.pop("multiple", None)
            params.append((False, click.argument(f.name, cls=ConfigArgument, **kwargs)))
            continue
        decls = decls or ["--" + f.name.replace("_", "-")]
        if "metavar" not in kwargs and metavar_of(f.name, kwargs) is not None:
            kwargs["metavar"] = metavar_of(f.name, kwargs)
        if is_action(f) and not issubclass(kwargs.setdefault("cls", ActionOption), ActionOption):
            raise TypeError(f"{owner.__name__}.{f.name} is an action: its option class must be an ActionOption")
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if not required:
            kwargs.setdefault("default", default)
        kwargs.setdefault("show_default", default is not None and default is not False)
        kwargs.setdefault("help", _help(docs[f.name], decls + [d for decl in decls for d in decl.split("/")]))
        params.append((required, click.option(*decls, f.name, required=required, **kwargs)))
    # --help lists the required options first (each part in field order); arguments keep their positions
    params = [p for req, p in params if req] + [p for req, p in params if not req]

    def decorate(fn):
        for param in reversed(params):
            fn = param(fn)
        if groups:
            fn.__config_groups__ = {**getattr(fn, "__config_groups__", {}), **groups}
        return fn

    return decorate


class ConfigArgument(click.Argument):
    """A positional argument a config file may supply (click reads ``default_map`` for options only
    when a ``nargs=-1`` argument is absent)."""

    def consume_value(self, ctx, opts):
        value, source = super().consume_value(ctx, opts)
        if value in (None, ()) and ctx.default_map and self.name in ctx.default_map:
            return ctx.default_map[self.name], ParameterSource.DEFAULT_MAP
        return value, source


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The option values of a YAML (``.yaml``/``.yml``), TOML (``.toml``) or JSON (``.json``) config file.

    The file's top-level mapping; or, when that mapping has a ``config`` mapping (no option is named
    ``config``), that section: the options a run recorded in its output (a tokenize or pack
    ``manifest.json``, regenerate's ``OUT.manifest.json``, ``peagle-data inspect STORE`` of a feature store).

    Raises:
        click.BadParameter: not a mapping, unparsable, or another suffix (naming the file).
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".toml":
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise click.BadParameter(f"{path}: {e}", param_hint="--config") from None
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise click.BadParameter(f"{path}: {e}", param_hint="--config") from None
    elif path.suffix == ".json":
        import json

        try:
            data = json.loads(text)
        except ValueError as e:
            raise click.BadParameter(f"{path}: {e}", param_hint="--config") from None
    else:
        raise click.BadParameter(f"{path}: a config file is .yaml, .yml, .toml or .json", param_hint="--config")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise click.BadParameter(f"{path}: expected a mapping of option names to values, got a "
                                 f"{type(data).__name__}", param_hint="--config")
    return data["config"] if isinstance(data.get("config"), dict) else data


FROM_CONFIG_FILE = "peagle.from_config_file"
"""``ctx.meta`` key: the parameter names a ``--config`` file set (their source is ``DEFAULT_MAP``)."""


def _keys(command: click.Command) -> dict[str, click.Parameter]:
    """Config-file key -> parameter: each parameter's name and its long options without ``--``
    (``-`` and ``_`` alike)."""
    keys: dict[str, click.Parameter] = {}
    for p in command.params:
        if p.name in ("config", "print_config", "version") or p.name is None:
            continue
        keys[p.name] = p
        for opt in getattr(p, "opts", []):
            if opt.startswith("--"):
                keys[opt[2:].replace("-", "_")] = p
    return keys


def _groups(command: click.Command) -> dict[str, str]:
    """Parameter name -> its group, for a command whose config has groups (:func:`config_options`)."""
    return getattr(command.callback, "__config_groups__", {})


def _ungrouped(data: dict[str, Any], groups: dict[str, str], path: str) -> list[tuple[str, Any]]:
    """A config file's ``(key, value)`` pairs, a group's mapping (``optim: {lr: ...}``) read as its keys.

    Raises:
        click.BadParameter: a key under a group that is not that group's (naming its group).
    """
    names = set(groups.values())
    pairs = []
    for key, v in data.items():
        if key not in names or not isinstance(v, dict):
            pairs.append((key, v))
            continue
        for sub, w in v.items():
            home = groups.get(str(sub).replace("-", "_"))
            if home is not None and home != key:
                raise click.BadParameter(f"{path}: {key}.{sub}: {sub} is a setting of {home}, not of {key}; "
                                         f"write it under {home}", param_hint="--config")
            pairs.append((sub, w))
    return pairs


def _load_into_context(ctx: click.Context, param, value):
    """``--config`` callback (eager): the file's values become the command's defaults."""
    if value is None:
        return None
    keys, data = _keys(ctx.command), load_config_file(value)
    defaults: dict[str, Any] = {}
    for key, v in _ungrouped(data, _groups(ctx.command), value):
        p = keys.get(str(key).replace("-", "_"))
        if p is None:
            raise click.BadParameter(f"{value}: unknown key {key!r}; the keys are the options of "
                                     f"`{ctx.command_path}`: {', '.join(sorted(_print_keys(ctx.command).values()))}",
                                     param_hint="--config")
        if isinstance(p, ActionOption):  # an action applies to one invocation: give it on the command line
            if v:
                click.echo(f"warning: {value}: ignoring {key}: {v!r}; {p.opts[0]} is an action of one "
                           f"invocation, not a setting of the run: give it on the command line", err=True)
            continue
        if getattr(p, "multiple", False) or getattr(p, "nargs", 1) == -1:
            v = [v] if isinstance(v, str) else v
        defaults[p.name] = v
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    ctx.meta[FROM_CONFIG_FILE] = set(defaults)
    return value


def _print_keys(command: click.Command) -> dict[str, str]:
    """Parameter name -> the key ``--print-config`` writes (the first long option, or the argument name);
    the actions (:class:`ActionOption`, ``--print-config`` itself) are left out."""
    out = {}
    for p in command.params:
        if p.name in ("config", "print_config", "version", "help") or p.name is None or isinstance(p, ActionOption):
            continue
        longs = [o for o in getattr(p, "opts", []) if o.startswith("--")]
        out[p.name] = longs[0][2:].replace("-", "_") if isinstance(p, click.Option) and longs else p.name
    return out


def resolved_config(ctx: click.Context) -> dict[str, Any]:
    """The command's resolved settings, by config-file key (what ``--print-config`` prints): every
    parameter but the actions (:class:`ActionOption`: ``--force``, ``--resume``, ... and ``--print-config``);
    a grouped config's under their group (``{"optim": {"lr": ...}}``, in the groups' order)."""
    keys, groups = _print_keys(ctx.command), _groups(ctx.command)
    out: dict[str, Any] = {g: {} for g in dict.fromkeys(groups.values())}  # the groups in field order
    for name, key in keys.items():
        value = ctx.params.get(name)
        value = list(value) if isinstance(value, tuple) else value
        if name in groups:
            out.setdefault(groups[name], {})[key] = value
        else:
            out[key] = value
    return out


def run_config() -> dict[str, Any]:
    """The current command's resolved settings (as :func:`resolved_config`, without the actions), for the
    library to record in the output (manifest ``config``, store attribute ``config``, the eval report's
    ``config``)."""
    return resolved_config(click.get_current_context())


def example_key(command: click.Command) -> str:
    """The config-file key ``--config``'s help shows for ``command`` (as ``--print-config`` writes it): its
    first option that takes a value, is no action and has a two-word key (it shows that a key is written with
    ``_``), else its first such option, else its first argument (``inspect`` has only ``path``). A command with
    none of them has nothing to put in a file: ``output`` is shown."""
    keys = _print_keys(command)
    options = [keys[p.name] for p in command.params if isinstance(p, click.Option) and not p.is_flag
               and p.name in keys]
    arguments = [keys[p.name] for p in command.params if isinstance(p, click.Argument) and p.name in keys]
    return next((k for k in options if "_" in k), None) or next(iter(options + arguments), "output")


class ConfigFileOption(click.Option):
    """``--config``: its help names a key of the command it belongs to (:func:`example_key`), filled in when
    ``--help`` is shown, since the option is made before the command's other options."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str] | None:
        record = super().get_help_record(ctx)
        if record is None:
            return None
        return record[0], record[1].replace("{key}", example_key(ctx.command))


def config_file_options(fn):
    """Add ``--config FILE``, ``--print-config`` and ``--version`` to a command function (apply below
    ``@click.command``).

    With ``--print-config`` the command prints its resolved values as YAML and exits 0 without running.
    """

    @functools.wraps(fn)
    def wrapper(*args, print_config: bool = False, **kwargs):
        if print_config:
            import yaml

            click.echo(yaml.safe_dump(resolved_config(click.get_current_context()), sort_keys=False), nl=False)
            return None
        return fn(*args, **kwargs)

    wrapper.__doc__ = plain_text(fn.__doc__ or "")  # the command's --help (click reads __doc__)

    # click lists __click_params__ in reverse: put these three last in --help
    wrapper.__click_params__ = [
        version_option(),
        click.Option(["--print-config"], is_flag=True,
                     help="Print the resolved options as YAML (a --config file) and exit without running."),
        ConfigFileOption(["--config"], metavar="FILE", type=click.Path(exists=True, dir_okay=False), is_eager=True,
                     expose_value=False, callback=_load_into_context,
                     help="YAML, TOML or JSON file of option values (keys as the options, e.g. {key}), "
                          "or the config section a run recorded in its output; options on the command line "
                          "override it."),
        *getattr(fn, "__click_params__", []),
    ]
    return wrapper


class ValueOrMixture(click.ParamType):
    """A plain value or a JSON mixture ``{value: weight}`` as text; a config file's number, boolean or mapping
    passes as it is (the library parses and checks it: RegenerateConfig, EvalConfig)."""

    name = "value_or_mixture"

    def convert(self, value, param, ctx):
        return value if isinstance(value, (dict, bool, int, float)) else str(value)


MIXTURE = {"type": ValueOrMixture(), "multiple": False}
"""``config_options`` override of an option taking one value or one JSON mixture (not a repeated option)."""
