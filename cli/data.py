"""``peagle-data``: regenerate, tokenize, pack, extract, inspect, verify, stats, show, merge."""

from __future__ import annotations

import click

from cli.data_extract import extract, inspect_cmd, verify
from cli.data_prepare import pack, tokenize
from cli.data_show import show
from cli.data_merge import merge
from cli.data_regenerate import regenerate
from cli.data_stats import stats


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Prepare P-EAGLE training data: conversations -> tokens -> packed blocks -> feature store."""


main.add_command(tokenize)
main.add_command(pack)
main.add_command(extract)
main.add_command(inspect_cmd, name="inspect")
main.add_command(verify)
main.add_command(stats)
main.add_command(show)
main.add_command(merge)
main.add_command(regenerate)

if __name__ == "__main__":
    main()
