"""``peagle-data``: regenerate, tokenize, pack, extract, inspect, verify, stats, show, merge.

A subcommand's module is imported when the subcommand runs, so ``peagle-data tokenize`` does not
import torch (extract, inspect, verify and stats do: they read feature stores, whose module imports
torch at its top).
"""

from __future__ import annotations

import importlib

import click

from cli.common import version_option

COMMANDS = {
    "extract": "cli.data_extract:extract",
    "inspect": "cli.data_extract:inspect_cmd",
    "merge": "cli.data_merge:merge",
    "pack": "cli.data_prepare:pack",
    "regenerate": "cli.data_regenerate:regenerate",
    "show": "cli.data_show:show",
    "stats": "cli.data_stats:stats",
    "tokenize": "cli.data_prepare:tokenize",
    "verify": "cli.data_extract:verify",
}
"""Subcommand name -> ``module:attribute`` of its click command."""


class _LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use (click's lazy-loading pattern)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context | None, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attribute = COMMANDS[name].split(":")
        return getattr(importlib.import_module(module), attribute)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"]}, params=[version_option()])
def main() -> None:
    """Prepare P-EAGLE training data: conversations -> tokens -> packed blocks -> feature store."""


if __name__ == "__main__":
    main()
