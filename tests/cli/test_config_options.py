"""Config fields and click options agree, both ways, for every command; every ``--option`` the code
tells a user about (docstrings, error messages) is an option of some peagle command."""

import dataclasses
import inspect
import re
from pathlib import Path

import click
import pytest

from cli.data import main as data_main
from cli.data_merge import MergeConfig
from cli.eval import main as eval_main
from cli.train import main as train_main
from peagle_data.extract.config import ExtractConfig
from peagle_data.prepare.config import PackConfig, PackRun, TokenizeConfig, TokenizeRun
from peagle_data.regenerate.run import RegenerateConfig, RegenerateRun
from peagle_data.inspect.show import ShowConfig
from peagle_data.inspect.stats import StatsConfig
from peagle_data.inspect.verify import InspectConfig, VerifyConfig
from peagle_data.regenerate.backends import BackendConfig
from peagle_train.evaluate.config import EvalConfig
from peagle_train.evaluate.run import EvalRun
from peagle_train.train.config import DataConfig, ModelConfig, OptimConfig, RunConfig, StreamConfig, TrainConfig

REPO = Path(__file__).resolve().parents[2]

# command -> (config classes, click parameter -> field where the names differ,
#             parameters that are no config field, fields that are no option (and why))
COMMANDS = {
    "train": (train_main, [TrainConfig, DataConfig, ModelConfig, OptimConfig, RunConfig, StreamConfig], {}, set(),
              {"data", "model", "optim", "run", "stream"}),  # the groups
    "eval": (eval_main, [EvalRun, EvalConfig], {}, set(),
             {"settings",  # the nested EvalConfig
              "chunk_anchors", "warmup", "cost_rounds"}),  # memory bound, timing: library knobs, never named as options
    "extract": (data_main.get_command(None, "extract"), [ExtractConfig], {}, set(),
                {"writer_queue"}),  # host-memory bound of the writer thread, never named as an option
    "tokenize": (data_main.get_command(None, "tokenize"), [TokenizeRun, TokenizeConfig], {}, set(),
                 {"settings"}),  # the nested TokenizeConfig
    "pack": (data_main.get_command(None, "pack"), [PackRun, PackConfig, TokenizeConfig], {}, set(),
             {"settings", "tokenize"}),  # the nested PackConfig and TokenizeConfig
    "regenerate": (data_main.get_command(None, "regenerate"), [RegenerateRun, RegenerateConfig, BackendConfig], {},
                   set(), {"settings", "backend",  # the nested RegenerateConfig and BackendConfig
                           "chunk_rows"}),  # rows per write: a library knob
    "inspect": (data_main.get_command(None, "inspect"), [InspectConfig], {}, set(), set()),
    "verify": (data_main.get_command(None, "verify"), [VerifyConfig], {}, set(), set()),
    "stats": (data_main.get_command(None, "stats"), [StatsConfig], {}, set(), set()),
    "show": (data_main.get_command(None, "show"), [ShowConfig], {}, set(), set()),
    "merge": (data_main.get_command(None, "merge"), [MergeConfig], {}, set(), set()),
}


def test_every_command_is_covered():
    assert sorted(COMMANDS) == sorted([*data_main.list_commands(None), "train", "eval"])


CONFIG_FILE_OPTIONS = {"config", "print_config", "version"}
"""``--config FILE``, ``--print-config`` and ``--version`` (cli/options.py): on every command with a config, no field."""


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


#: flags of other tools that messages quote (pip, click, accelerate launch, vllm serve) and a placeholder in a docstring
FOREIGN = {"--no-deps", "--force-reinstall", "--help", "--num_processes", "--multi_gpu", "--cpu", "--option",
           "--data-parallel-size", "--kv-transfer-config", "--no-enable-prefix-caching", "--skip-tokenizer-init",
           "--speculative-config", "--dtype", "--kv-cache-dtype", "--hf-overrides", "--model-class-overrides",
           "--disable-sliding-window", "--max-model-len", "--model"}


def test_every_option_the_code_names_exists():
    pattern = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*[a-z0-9]")
    options = _all_options() | FOREIGN
    unknown = {}
    for package in ("peagle_data", "peagle_train", "stores", "cli"):
        for path in sorted((REPO / package).rglob("*.py")):
            for name in set(pattern.findall(path.read_text())) - options:
                unknown.setdefault(name, []).append(path.name)
    assert unknown == {}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_generated_option_has_its_field_docstring_as_help(name):
    from cli.options import _help, field_docs

    command, configs, renamed, _, _ = COMMANDS[name]
    by_field = {renamed.get(p.name, p.name): p for p in command.params if isinstance(p, click.Option)}
    checked = set()
    for cls in configs:
        for field, doc in field_docs(cls).items():
            if field in by_field:
                p = by_field[field]
                assert p.help == _help(doc, p.opts + p.secondary_opts + ["/".join(p.opts + p.secondary_opts)]), field
                checked.add(field)
    assert checked == set(by_field) - CONFIG_FILE_OPTIONS  # every option is a documented field
    assert len(checked) >= (0 if name == "inspect" else 2)  # inspect: PATH alone


def test_a_field_without_docstring_is_refused():
    from cli.options import config_options

    @dataclasses.dataclass
    class Undocumented:
        steps: int = 1

    with pytest.raises(TypeError, match="Undocumented.steps has no docstring"):
        config_options(Undocumented)


def test_an_action_field_is_an_action_option_and_not_a_setting():
    from cli.options import ActionOption, config_options

    @dataclasses.dataclass
    class Run:
        steps: int = 1
        """Steps."""
        force: bool = dataclasses.field(default=False, metadata={"action": True})
        """Overwrite."""

    command = click.command()(config_options(Run)(lambda **kw: None))
    assert [type(p) for p in command.params] == [click.Option, ActionOption]
    with pytest.raises(TypeError, match="Run.force is an action: its option class must be an ActionOption"):
        config_options(Run, overrides={"force": {"cls": click.Option}})


def test_every_command_takes_a_config_file():
    for command in [*(data_main.get_command(None, n) for n in data_main.list_commands(None)), train_main, eval_main]:
        names = {p.name for p in command.params}
        assert {"config", "print_config"} <= names, command.name


def test_the_tool_commands_pass_their_config_to_the_library(tmp_path, monkeypatch):
    """inspect, verify, stats, show and merge: options (here from a --config file, one overridden on
    the command line) become the config whose fields reach the library call."""
    from click.testing import CliRunner

    import peagle_data.inspect.show
    import peagle_data.inspect.stats
    import peagle_data.inspect.verify
    import stores.merge

    d = str(tmp_path)
    seen = {}
    monkeypatch.setattr(peagle_data.inspect.verify, "inspect_output", lambda path: seen.setdefault("inspect", path) and {})
    monkeypatch.setattr(peagle_data.inspect.verify, "verify_output",
                        lambda store, packed, repair: seen.setdefault("verify", (store, packed, repair)) and ({}, None))
    monkeypatch.setattr(peagle_data.inspect.stats, "collect_stats",
                        lambda path, max_seq_len, overlap: seen.setdefault("stats", (path, max_seq_len, overlap)) and {})
    monkeypatch.setattr(peagle_data.inspect.show, "show", lambda *a: seen.setdefault("show", a) and "")
    monkeypatch.setattr(stores.merge, "merge_tables",
                        lambda shards, output, force: seen.setdefault("merge", (shards, output, force)) and
                        {"counts": {}, "num_shards": 2})
    (tmp_path / "v.yaml").write_text(f"store: {d}\npacked: {d}\n")
    (tmp_path / "s.yaml").write_text(f"path: {d}\nmax_seq_len: 64\noverlap: 0.25\njson: true\n")
    (tmp_path / "w.yaml").write_text(f"path: {d}\nid: c1\ntokenizer: tok\ncolor: always\nhtml: {d}/p.html\n")
    (tmp_path / "m.yaml").write_text(f"shards: [{d}, {d}]\noutput: {d}-out\n")  # (an output apart from the inputs)
    for args in (["inspect", d], ["verify", "--config", tmp_path / "v.yaml", "--repair"],
                 ["stats", "--config", tmp_path / "s.yaml", "--overlap", "0.5"],
                 ["show", "--config", tmp_path / "w.yaml", "--force"], ["merge", "--config", tmp_path / "m.yaml"]):
        result = CliRunner().invoke(data_main, [str(a) for a in args])
        assert result.exit_code == 0, result.output
    assert seen == {"inspect": d, "verify": (d, d, True), "stats": (d, 64, 0.5),
                    "show": (d, None, None, "c1", "tok", True, f"{d}/p.html", True),
                    "merge": ([d, d], f"{d}-out", False)}


@pytest.mark.parametrize("args,message", [
    (["stats", ".", "--max-seq-len", "1"], "--max-seq-len"), (["show", ".", "--color", "red"], "--color"),
    (["show", ".", "--row", "-1"], "--row")])
def test_the_tool_configs_refuse_bad_values(args, message):
    from click.testing import CliRunner

    result = CliRunner().invoke(data_main, args)
    assert result.exit_code == 2 and message in result.output


def test_the_tool_configs_check_their_values_without_the_command_line():
    with pytest.raises(ValueError, match=r"--overlap must be in \[0, 1\), got 1.0"):
        StatsConfig(path=".", overlap=1.0)
    with pytest.raises(ValueError, match="--max-seq-len must be >= 2 tokens, got 1"):
        StatsConfig(path=".", max_seq_len=1)
    with pytest.raises(ValueError, match="--color must be one of auto, always, never, got 'red'"):
        ShowConfig(path=".", color="red")
    with pytest.raises(ValueError, match="--block must be >= 0, got -2"):
        ShowConfig(path=".", block=-2)
