"""The CLI surface, pinned: every command's --help works and lists exactly these options.

A change to the surface is a visible diff here (STYLE.md #8)."""

import re

import click
import pytest
from click.testing import CliRunner

from cli.data import main as data_main
from cli.eval import main as eval_main
from cli.train import main as train_main

CONFIG_FILE = {"--config", "--print-config", "--version"}
"""cli/options.py: on every command."""
SHARDS = {"--num-shards", "--shard-index"}
TOKENIZE = {"--tokenizer", "--output", "--chat-template", "--chat-template-kwargs", "--limit", "--format", "--strict", "--num-workers",
            "--on-history-rewrite", "--dedup", "--no-dedup", "--max-tokens", "--min-loss-tokens",
            "--on-dropped-content", "--on-special-token-text", *SHARDS, "--force", *CONFIG_FILE}
EXACT = {
    ("data", "tokenize"): TOKENIZE,
    ("data", "pack"): TOKENIZE | {"--max-seq-len", "--block-size", "--overlap", "--overlap-loss", "--max-windows"},
    ("data", "extract"): {"--verifier", "--output", "--layers", "--storage-dtype", "--compressor",
                          "--attn-implementation", "--resume", "--force", "--device", "--max-blocks", *SHARDS,
                          "--engine", "--tensor-parallel-size", "--pipeline-parallel-size", "--server",
                          "--shared-storage", "--concurrency", "--vllm-kv-cache-gib", "--vllm-gpu-memory-utilization",
                          "--context", "--max-context", "--context-packing", "--stream", "--stream-timeout-s", *CONFIG_FILE},
    ("data", "regenerate"): {"--top-k", "--top-p", "--output", "--verifier", "--server", "--served-model", "--max-new-tokens",
                             "--temperature", "--turns", "--concurrency", "--batch-size", "--device", "--limit",
                             "--format", "--retries", "--timeout", "--seed", "--tokenizer", "--server-kind",
                             "--on-dropped-content",
                             "--on-truncated", "--max-prompt-tokens", "--chat-template-kwargs", "--reasoning-effort",
                             "--enable-thinking", "--template-mixture", "--reasoning-parser", "--resume", "--force",
                             *CONFIG_FILE},
    ("data", "inspect"): CONFIG_FILE,
    ("data", "verify"): {"--packed", "--repair"} | CONFIG_FILE,
    ("data", "stats"): {"--json", "--png", "--max-seq-len", "--overlap", "--force"} | CONFIG_FILE,
    ("data", "show"): {"--row", "--block", "--id", "--tokenizer", "--color", "--html", "--force"} | CONFIG_FILE,
    ("data", "merge"): {"--output", "--force"} | CONFIG_FILE,
    ("train", None): {"--store", "--output", "--method", "--block-size", "--verifier", "--max-steps", "--num-depths",
                      "--max-anchors",
                      "--down-sample-ratio", "--down-sample-ratio-min", "--draft-vocab-size", "--num-layers", "--lr",
                      "--warmup-steps", "--weight-decay", "--grad-clip", "--grad-accum", "--save-every",
                      "--save-total-limit", "--val-fraction", "--val-max-blocks", "--val-every", "--log-every", "--mask-token-id",
                      "--loss-chunk-size", "--loss", "--depth-weights", "--gradient-checkpointing", "--lazy-embedding", "--dense-embedding",
                      "--train-embedding", "--freeze-embedding", "--seed", "--attention-backend", "--drafter-layer",
                      "--init-from", "--init-from-sha256", "--init-layers", "--report-to", "--resume", "--allow-incomplete", "--epoch-order",
                      "--force", "--max-store-bytes", "--epoch-policy", "--extract-from", "--layers", "--engine",
                      "--context", "--device", "--storage-dtype", "--stream-timeout-s"} | CONFIG_FILE,
    ("eval", None): {"--drafter", "--verifier", "--prompts", "--store", "--all-anchor", "--top-k", "--top-p", "--output", "--force", "--max-new-tokens",
                     "--num-prompts", "--num-draft-tokens", "--max-blocks", "--temperature", "--seed", "--engine",
                     "--concurrency", "--vllm-loading", "--vllm-kv-cache-gib", "--vllm-gpu-memory-utilization",
                     "--tree-topk", "--tree-nodes", "--measure-costs", "--no-measure-costs",
                     "--draft-sample-method", "--chat-template-kwargs", "--allow-template-mode-mismatch",
                     "--allow-partial", "--reasoning-parser", "--reasoning-effort", "--enable-thinking", "--template-mixture"} | CONFIG_FILE,
}
GROUPS = {"data": data_main, "train": train_main, "eval": eval_main}
ACTIONS = {
    ("data", "tokenize"): {"force"}, ("data", "pack"): {"force"}, ("data", "extract"): {"resume", "force", "max_blocks", "stream",
                                                                                          "stream_timeout_s"},
    ("data", "regenerate"): {"resume", "force"}, ("data", "inspect"): set(), ("data", "verify"): {"repair"},
    ("data", "stats"): {"force"}, ("data", "show"): {"force"}, ("data", "merge"): {"force"},
    ("train", None): {"resume", "force"}, ("eval", None): {"force"},
}
"""Each command's actions (cli/options.py ActionOption, besides --print-config): what one invocation does
with an existing output (and extract's budget of blocks for one invocation), never printed by
--print-config nor recorded in the output."""


def _command(group, sub) -> click.Command:
    return GROUPS[group].get_command(None, sub) if sub else GROUPS[group]


@pytest.mark.parametrize("group,sub", sorted(EXACT, key=str))
def test_the_options_are_exactly(group, sub):
    command = _command(group, sub)
    options = {o for p in command.params if isinstance(p, click.Option) for o in p.opts + p.secondary_opts}
    assert sorted(options) == sorted(EXACT[(group, sub)])


@pytest.mark.parametrize("group,sub", sorted(EXACT, key=str))
def test_the_actions_are_exactly(group, sub):
    from cli.options import ActionOption

    command = _command(group, sub)
    assert {p.name for p in command.params if isinstance(p, ActionOption)} == ACTIONS[(group, sub)]


@pytest.mark.parametrize("group,sub", sorted(EXACT, key=str))
def test_help_lists_the_options(group, sub):
    args = ([sub] if sub else []) + ["--help"]
    result = CliRunner().invoke(GROUPS[group], args)
    assert result.exit_code == 0, result.output
    options = set(re.findall(r"(--[a-z][a-z0-9-]+)", result.output))
    missing = EXACT[(group, sub)] - options
    assert not missing, f"{group} {sub}: --help lacks {sorted(missing)}"


def _required_args(tmp_path) -> dict:
    """The fewest arguments each command runs with (paths that must exist are made)."""
    (tmp_path / "d").mkdir()
    d = str(tmp_path / "d")
    return {("data", "tokenize"): [d, "--tokenizer", "m", "--output", "o"],
            ("data", "pack"): [d, "--tokenizer", "m", "--output", "o"],
            ("data", "extract"): [d, "--verifier", "m", "--output", "o"],
            ("data", "regenerate"): ["in.jsonl", "--output", "o.jsonl", "--verifier", "m"],
            ("data", "inspect"): [d], ("data", "verify"): [d, "--packed", d, "--repair"],
            ("data", "stats"): [d, "--json", "--max-seq-len", "64"],
            ("data", "show"): [d, "--id", "c1", "--color", "never"], ("data", "merge"): [d, d, "--output", "o"],
            ("train", None): ["--store", d, "--output", "o"], ("eval", None): ["--drafter", d, "--store", d]}


def _by_key(printed: dict, group: str) -> dict:
    """--print-config's values by key: peagle-train prints them by TrainConfig group (data, model, optim, run, stream)."""
    return {k: v for values in printed.values() for k, v in values.items()} if group == "train" else printed


@pytest.mark.parametrize("group,sub", sorted(EXACT, key=str))
def test_print_config_is_a_config_file_of_the_same_run(group, sub, tmp_path):
    """--print-config of the command line, read back with --config, prints the same values; one key
    per parameter (its first long option, or the argument name)."""
    import yaml

    command, cli = _command(group, sub), ([sub] if sub else [])
    first = CliRunner().invoke(GROUPS[group], [*cli, *_required_args(tmp_path)[(group, sub)], "--print-config"])
    assert first.exit_code == 0, first.output
    printed = _by_key(yaml.safe_load(first.stdout), group)
    settings = [p for p in command.params if p.name not in ("config", "print_config", "version", *ACTIONS[(group, sub)])]
    assert len(printed) == len(settings) and not set(printed) & ACTIONS[(group, sub)]
    (tmp_path / "c.yaml").write_text(first.stdout)
    again = CliRunner().invoke(GROUPS[group], [*cli, "--config", str(tmp_path / "c.yaml"), "--print-config"])
    assert again.exit_code == 0, again.output
    assert again.stdout == first.stdout


@pytest.mark.parametrize("group,sub", sorted(EXACT, key=str))
def test_an_unknown_config_key_lists_the_print_config_keys(group, sub, tmp_path):
    """The keys an unknown-key error lists are exactly those --print-config writes (the option names,
    e.g. regenerate's ``server`` for ``--server``, not the parameter name ``servers``)."""
    import yaml

    cli = [sub] if sub else []
    keys = _by_key(yaml.safe_load(CliRunner().invoke(
        GROUPS[group], [*cli, *_required_args(tmp_path)[(group, sub)], "--print-config"]).stdout), group)
    (tmp_path / "bad.yaml").write_text("bogus: 1\n")
    result = CliRunner().invoke(GROUPS[group], [*cli, "--config", str(tmp_path / "bad.yaml")])
    assert result.exit_code == 2
    listed = re.search(r"unknown key 'bogus'; the keys are the options of `[^`]+`: (.*)", result.output)
    assert listed, result.output
    assert listed.group(1).strip().split(", ") == sorted(keys)
    if (group, sub) == ("data", "regenerate"):
        assert "server" in keys and "servers" not in keys
    if (group, sub) in (("data", "tokenize"), ("data", "pack")):
        assert "tokenizer" in keys and "tokenizer_name" not in keys


def test_data_group_lists_every_stage():
    out = CliRunner().invoke(data_main, ["--help"]).output
    for command in ("regenerate", "tokenize", "pack", "extract", "inspect", "verify", "show", "stats", "merge"):
        assert command in out
    assert sorted(data_main.list_commands(None)) == sorted(c[1] for c in EXACT if c[0] == "data")


def test_a_light_command_does_not_import_torch():
    """The data group imports a subcommand's module when it runs (cli/data.py): tokenize's --help
    loads no torch."""
    import subprocess
    import sys

    code = ("import sys; from cli.data import main; main(['tokenize', '--help'], standalone_mode=False); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("False")


def test_command_functions_are_thin():
    """cli/ is thin (docs/design.md §2): every click command function, docstring included, is at most
    15 lines; the work is one library call."""
    import ast
    from pathlib import Path

    sizes = {}
    for path in sorted((Path(__file__).resolve().parents[2] / "cli").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and any(
                    isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "command" for d in node.decorator_list):
                sizes[f"{path.name}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert len(sizes) == 11  # nine peagle-data subcommands, peagle-train, peagle-eval
    assert {k: v for k, v in sizes.items() if v > 15} == {}


def test_plain_text_turns_sphinx_markup_and_none_into_typable_help():
    from cli.options import _help, plain_text

    assert plain_text("a name of :data:`peagle_train.model.attention.ATTENTION_BACKENDS`") == \
        "a name of peagle_train.model.attention.ATTENTION_BACKENDS"
    assert plain_text("see :py:func:`~peagle_data.stats_plot.plot_stats` and :ref:`the design <design>`") == \
        "see plot_stats and the design"
    assert plain_text("``zstd`` or `pack --overlap`\nnext line") == "zstd or pack --overlap\nnext line"
    assert _help("Steps; None: one pass.", ["--max-steps"]) == "Steps; unset: one pass."
    assert _help("Prompts; None = all.", ["--num-prompts"]) == "Prompts; unset: all."
    assert _help("Cap (None keeps all).", ["--cap"]) == "Cap (unset keeps all)."


@pytest.mark.parametrize("command,says,never", [
    (("data", "extract"),
     ["--layers N,N,... The verifier layers whose hidden states the drafter reads (auxiliary layers)",
      "writes a full-context store", "writes a window store", "With --context full (the default) the blocks extracted "
      "and deleted are the whole conversations"],
     ["format-1", "format-2", "stream plan", "consumed cursor", "Aux layer", "evicting", "Needs --context"]),
    (("train", None),
     ["COD sampling (conditional drop-token, from PARD", "--context [window|full] --extract-from: full (each "
      "conversation run whole, as the verifier serves it",
      'each written as a row with "split": "val" in metrics.jsonl'],
     ["format-1", "each a split"]),
    (("data", "pack"), ["the copies of a row that a mixture source's weight above 1 draws"],
     ["a weight's copies"]),
    (("data", "stats"), ["Reads the table in a stream"], ["polars"]),
])
def test_help_words_a_new_user_can_read(command, says, never):
    """Issue 34: the --help texts a new user could not decode, in plain words."""
    group, sub = command
    text = " ".join(CliRunner().invoke(GROUPS[group], [*([sub] if sub else []), "--help"],
                                       terminal_width=200).output.split())
    assert [s for s in says if s not in text] == [] and [s for s in never if s in text] == []


@pytest.mark.parametrize("group,sub", sorted(EXACT, key=str) + [("data", None)])
def test_help_has_no_sphinx_markup_and_no_python_none(group, sub):
    """Every command's --help (options and the command's own text) is plain: no roles, no
    backticks, no None (which cannot be typed)."""
    result = CliRunner().invoke(GROUPS[group], [*([sub] if sub else []), "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for markup in (":data:", ":func:", ":class:", ":meth:", ":attr:", ":mod:", "`"):
        assert markup not in result.output, f"{group} {sub}: {markup!r} in --help"
    assert not re.search(r"\bNone\b", result.output), result.output
    if (group, sub) == ("train", None):
        assert "--attention-backend [auto|sdpa|flex|split] Drafter attention backend: sdpa (a dense" in " ".join(
            result.output.split())  # the field's docstring, roles stripped


@pytest.mark.parametrize("group,sub", sorted(EXACT, key=str) + [("data", None)])
def test_every_command_has_version(group, sub):
    from importlib.metadata import version

    prog = {"data": "peagle-data", "train": "peagle-train", "eval": "peagle-eval"}[group]
    result = CliRunner().invoke(GROUPS[group], [*([sub] if sub else []), "--version"], prog_name=prog)
    assert result.exit_code == 0, result.output
    assert result.output == f"{prog}{' ' + sub if sub else ''}, version {version('peagle')}\n"


METAVARS = {"N", "X", "TEXT", "PATH", "DIR", "FILE", "MODEL", "DEVICE", "URL", "NAME", "ID", "HEX", "SIZE", "N,N,...", "X|JSON",
            "JSON"}
"""cli/options.py METAVARS / FIELD_METAVARS: one style (issue 34: INTEGER beside N, TEXT beside MODEL)."""


@pytest.mark.parametrize("group,sub", sorted(EXACT, key=str))
def test_one_metavar_style_and_required_options_first(group, sub):
    command = _command(group, sub)
    ctx = click.Context(command)
    options = [p for p in command.get_params(ctx) if isinstance(p, click.Option)]
    shown = {p.opts[0]: p.make_metavar(ctx) for p in options if not p.is_flag and not isinstance(p.type, click.Choice)}
    assert {o: m for o, m in shown.items() if m not in METAVARS} == {}
    required = [p.required for p in options]
    assert required == sorted(required, reverse=True), [p.opts[0] for p in options]  # required ones first


@pytest.mark.parametrize("group,sub", sorted(EXACT, key=str) + [("data", None)])
def test_help_points_to_no_file_of_the_repository(group, sub):
    """A wheel user has no README, docs/ or scripts/: the help says it itself."""
    result = CliRunner().invoke(GROUPS[group], [*([sub] if sub else []), "--help"], terminal_width=200)
    text = " ".join(result.output.split())
    for pointer in ("README", "docs/", "scripts/", "setup_env", ".md"):
        assert pointer not in text, f"{group} {sub}: {pointer!r} in --help"


@pytest.mark.parametrize("group,sub", sorted(EXACT, key=str))
def test_help_names_no_python_module(group, sub):
    """Users do not know the package layout: the help says what a thing is, not where its code lives."""
    result = CliRunner().invoke(GROUPS[group], [*([sub] if sub else []), "--help"], terminal_width=200)
    modules = re.findall(r"\b(?:peagle_data|peagle_train|stores|cli)\.[a-z_]+", result.output)
    assert modules == [], f"{group} {sub}: {modules}"


@pytest.mark.parametrize("group,sub", sorted(EXACT, key=str))
def test_config_help_names_a_key_of_its_own_command(group, sub):
    """``--config``'s example key is one ``--config`` accepts on this command (stats has --max-seq-len, inspect
    only its path argument, train no --max-seq-len)."""
    from cli.options import _print_keys  # the keys --config reads, as the CLI computes them

    result = CliRunner().invoke(GROUPS[group], [*([sub] if sub else []), "--help"], terminal_width=400)
    text = " ".join(result.output.split())
    key = re.search(r"keys as the options, e\.g\. (\w+)\)", text).group(1)
    assert key in _print_keys(_command(group, sub)).values(), (group, sub, key)
    expected = {("data", "stats"): "max_seq_len", ("data", "inspect"): "path", ("train", None): "down_sample_ratio",
                ("eval", None): "max_new_tokens"}
    if (group, sub) in expected:
        assert key == expected[(group, sub)]
