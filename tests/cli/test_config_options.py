"""Config fields and click options agree, both ways, for every command; every ``--option`` the code
tells a user about (docstrings, error messages) is an option of some peagle command."""

import dataclasses
import inspect
import re
from pathlib import Path

import click
import pytest

from cli.data import main as data_main
from cli.eval import main as eval_main
from cli.train import main as train_main
from peagle_data.extract import ExtractConfig
from peagle_data.prepare import PackConfig, PackRun, TokenizeConfig, TokenizeRun
from peagle_data.regenerate import RegenerateConfig, RegenerateRun
from peagle_data.verifier_backends import BackendConfig
from peagle_train.evaluate.run import EvalRun
from peagle_train.evaluate import EvalConfig
from peagle_train.train import TrainConfig

REPO = Path(__file__).resolve().parents[2]

# command -> (config classes, click parameter -> field where the names differ,
#             parameters that are no config field, fields that are no option (and why))
COMMANDS = {
    "train": (train_main, [TrainConfig], {}, set(), set()),
    "eval": (eval_main, [EvalRun, EvalConfig], {}, set(),
             {"settings",  # the nested EvalConfig
              "chunk_anchors", "warmup"}),  # memory bound and timing warm-up: library knobs, never named as options
    "extract": (data_main.get_command(None, "extract"), [ExtractConfig], {}, set(),
                {"writer_queue"}),  # host-memory bound of the writer thread, never named as an option
    "tokenize": (data_main.get_command(None, "tokenize"), [TokenizeRun, TokenizeConfig], {}, set(),
                 {"settings"}),  # the nested TokenizeConfig
    "pack": (data_main.get_command(None, "pack"), [PackRun, PackConfig, TokenizeConfig], {}, set(),
             {"settings", "tokenize"}),  # the nested PackConfig and TokenizeConfig
    "regenerate": (data_main.get_command(None, "regenerate"), [RegenerateRun, RegenerateConfig, BackendConfig], {},
                   set(), {"settings", "backend",  # the nested RegenerateConfig and BackendConfig
                           "chunk_rows"}),  # rows per write: a library knob
}


CONFIG_FILE_OPTIONS = {"config", "print_config"}
"""``--config FILE`` and ``--print-config`` (cli/options.py): on every command with a config, no field."""


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_config_fields_are_the_options(name):
    command, configs, renamed, not_fields, not_options = COMMANDS[name]
    params = {renamed.get(p.name, p.name) for p in command.params} - not_fields - CONFIG_FILE_OPTIONS
    fields = {f.name for c in configs for f in dataclasses.fields(c)} - not_options
    assert sorted(fields - params) == [], f"{name}: config fields without an option"
    assert sorted(params - fields) == [], f"{name}: options without a config field"
    for cls in configs:  # every option a config's docstrings or messages name is one of this command
        options = {o for p in command.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts}
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]", inspect.getsource(cls)))
        assert sorted(named - options) == [], f"{cls.__name__} names options that {name} does not have"


def _all_options() -> set[str]:
    commands = [*(data_main.get_command(None, n) for n in data_main.list_commands(None)), train_main, eval_main]
    return {o for c in commands for p in c.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts}


#: flags of other tools that messages quote (pip, click, accelerate launch) and a placeholder in a docstring
FOREIGN = {"--no-deps", "--force-reinstall", "--help", "--num_processes", "--multi_gpu", "--cpu", "--option"}


def test_every_option_the_code_names_exists():
    pattern = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")
    options = _all_options() | FOREIGN
    unknown = {}
    for package in ("peagle_data", "peagle_train", "stores", "cli"):
        for path in sorted((REPO / package).glob("*.py")):
            for name in set(pattern.findall(path.read_text())) - options:
                unknown.setdefault(name, []).append(path.name)
    assert unknown == {}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_generated_option_has_its_field_docstring_as_help(name):
    from cli.options import _help, field_docs

    command, configs, renamed, _, _ = COMMANDS[name]
    by_field = {renamed.get(p.name, p.name): p for p in command.params if isinstance(p, click.Option)}
    checked = 0
    for cls in configs:
        for field, doc in field_docs(cls).items():
            if field in by_field:
                p = by_field[field]
                assert p.help == _help(doc, p.opts + p.secondary_opts + ["/".join(p.opts + p.secondary_opts)]), field
                checked += 1
    assert checked >= 5


def test_a_field_without_docstring_is_refused():
    from cli.options import config_options

    @dataclasses.dataclass
    class Undocumented:
        steps: int = 1

    with pytest.raises(TypeError, match="Undocumented.steps has no docstring"):
        config_options(Undocumented)


def test_every_command_takes_a_config_file():
    for command in [*(data_main.get_command(None, n) for n in data_main.list_commands(None)), train_main, eval_main]:
        names = {p.name for p in command.params}
        assert {"config", "print_config"} <= names, command.name
