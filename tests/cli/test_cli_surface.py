"""The CLI surface, pinned: every command's --help works and lists exactly these options.

A change to the surface is a visible diff here (STYLE.md #8)."""

import re

import pytest
from click.testing import CliRunner

from cli.data import main as data_main
from cli.eval import main as eval_main
from cli.train import main as train_main

REQUIRED = {
    ("data", "tokenize"): {"--tokenizer", "--output", "--chat-template", "--limit", "--format", "--strict", "--force"},
    ("data", "pack"): {"--tokenizer", "--output", "--max-seq-len", "--block-size", "--overlap", "--overlap-loss",
                       "--chat-template", "--limit", "--max-windows", "--force"},
    ("data", "extract"): {"--verifier", "--output", "--layers", "--resume", "--force", "--storage-dtype"},
    ("data", "regenerate"): {"--output", "--verifier", "--server", "--served-model", "--max-new-tokens", "--temperature",
                             "--concurrency", "--turns", "--limit", "--resume", "--force"},
    ("data", "inspect"): set(),
    ("data", "verify"): {"--packed"},
    ("data", "show"): {"--row", "--block", "--id", "--tokenizer", "--color", "--html", "--force"},
    ("train", None): {"--store", "--output", "--verifier", "--max-steps", "--num-depths", "--max-anchors", "--seed",
                      "--down-sample-ratio", "--down-sample-ratio-min", "--draft-vocab-size", "--resume",
                      "--allow-incomplete", "--force"},
    ("eval", None): {"--drafter", "--verifier", "--prompts", "--max-new-tokens", "--store", "--num-prompts",
                     "--output"},
}
GROUPS = {"data": data_main, "train": train_main, "eval": eval_main}


@pytest.mark.parametrize("group,sub", sorted(REQUIRED, key=str))
def test_help_lists_the_options(group, sub):
    args = ([sub] if sub else []) + ["--help"]
    result = CliRunner().invoke(GROUPS[group], args)
    assert result.exit_code == 0, result.output
    options = set(re.findall(r"(--[a-z][a-z0-9-]+)", result.output))
    missing = REQUIRED[(group, sub)] - options
    assert not missing, f"{group} {sub}: --help lacks {sorted(missing)}"


def test_data_group_lists_every_stage():
    out = CliRunner().invoke(data_main, ["--help"]).output
    for command in ("regenerate", "tokenize", "pack", "extract", "inspect", "verify", "show"):
        assert command in out
