"""``peagle-data regenerate``: options -> a back end config and a run config -> one library call.

The options are the fields of :class:`~peagle_data.regenerate.run.RegenerateRun` (INPUT, --output,
--resume, --force), of its ``settings`` (:class:`~peagle_data.regenerate.run.RegenerateConfig`) and of
its ``backend`` (:class:`~peagle_data.regenerate.backends.BackendConfig`) (cli/options.py).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import click

from cli.common import OutputPath, Writes, again_command, config_error, handle_errors, resume_command
from cli.options import MIXTURE, config_file_options, config_options, run_config
from peagle_data.readers.rows import FORMATS
from peagle_data.regenerate.backends import SERVER_KINDS, BackendConfig
from peagle_data.regenerate.run import ON_DROPPED, ON_TRUNCATED, TURNS, RegenerateConfig, RegenerateRun, run_regenerate
from runtime.chat.answer_parsing import REASONING_PARSERS
from stores.tables.conversation_files import read_regenerate_manifest, regenerate_paths

__all__ = ["regenerate", "kept_rows"]

_BACKEND_OVERRIDES = {
    "verifier": {"metavar": "MODEL"},
    "servers": {"decls": ["--server"], "metavar": "URL", "show_default": False},
    "served_model": {"metavar": "NAME"},
    "concurrency": {"metavar": "N"},
    "batch_size": {"metavar": "N"},
    "retries": {"metavar": "N"},
    "tokenizer": {"metavar": "MODEL"},
    "server_kind": {"type": click.Choice(SERVER_KINDS)},
}
_IO_OVERRIDES = {
    "inputs": {"metavar": "INPUT...", "nargs": -1, "required": True},
    "output": {"type": OutputPath(suffixes=(".jsonl",))},
}
_MIXTURE = MIXTURE
_RUN_OVERRIDES = {
    "temperature": {**_MIXTURE, "metavar": "X|JSON"},
    "reasoning_effort": {**_MIXTURE, "metavar": "X|JSON"},
    "enable_thinking": {**_MIXTURE, "metavar": "X|JSON"},
    "template_mixture": {**_MIXTURE, "metavar": "JSON"},
    "reasoning_parser": {"type": click.Choice(REASONING_PARSERS), "metavar": "NAME"},
    "max_new_tokens": {"metavar": "N"},
    "turns": {"type": click.Choice(TURNS)},
    "limit": {"metavar": "N"},
    "max_prompt_tokens": {"metavar": "N"},
    "format": {"type": click.Choice(FORMATS)},
    "on_dropped_content": {"type": click.Choice(ON_DROPPED)},
    "on_truncated": {"type": click.Choice(ON_TRUNCATED)},
}


def _echo_summary(summary: dict, output: str, max_new_tokens: int) -> None:
    """Print the run's counts; exit 1 with a warning when no conversation was written."""
    c = summary["counts"]
    click.echo(f"read {c['read']}  written {c['written']}  rejected {c['rejected']}"
               + (f"  (resumed after {summary['resumed_rows']} rows)" if summary["resumed_rows"] else ""))
    if c["rejected"]:
        click.echo(f"  rejected by reason: {c['rejected_by_reason']}; see the rejects file beside {output}")
    mid = c.get("turns_cut_mid_character", 0)
    click.echo(f"turns regenerated {c['turns_regenerated']} ({c['turns_truncated']} cut at --max-new-tokens "
               f"{max_new_tokens}" + (f", {mid} of them inside a character, dropped" if mid else "") + ")  "
               f"prompt tokens {c['prompt_tokens']}  completion tokens {c['completion_tokens']}")
    for name, drawn in (c.get("row_settings") or {}).items():
        click.echo(f"  {name} per row: " + ", ".join(f"{value} {rows}" for value, rows in drawn.items()))
    if c.get("conversations_with_dropped_content"):
        click.echo(f"  regenerated with content the chat template drops (--on-dropped-content keep): "
                   f"{c['conversations_with_dropped_content']} conversations")
    if summary.get("not_sent"):
        click.echo(f"WARNING: the server could not be told these sampling settings, its own defaults applied: "
                   f"{', '.join(summary['not_sent'])} (--server-kind; recorded in the manifest)", err=True)
    click.echo(f"output: {output}")
    if c["written"] == 0:
        click.echo("WARNING: no conversation was regenerated; see the rejects file", err=True)
        sys.exit(1)


def _split(options: dict, cls: type) -> dict:
    """The options that are fields of the dataclass ``cls``."""
    return {f.name: options[f.name] for f in dataclasses.fields(cls) if f.name in options}


def kept_rows(program: str, args: list[str], params: dict[str, Any]) -> tuple[str, str]:
    """After Ctrl-C (cli.common.handle_errors): the rows the last checkpoint of the manifest counts, and ``--resume``."""
    output = params.get("output")
    manifest = read_regenerate_manifest(output) if output else None
    if manifest is None:
        return f"nothing: {output} was not started yet", again_command(program, args)
    rows = (manifest.get("checkpoint") or {}).get("rows", 0)
    return f"{rows} regenerated rows in {regenerate_paths(output)['partial']}", resume_command(program, args)


@click.command()
@config_options(RegenerateRun, skip=("settings", "backend", "resume", "force"), arguments=("inputs",),
                overrides=_IO_OVERRIDES)
@config_options(BackendConfig, overrides=_BACKEND_OVERRIDES)
@config_options(RegenerateConfig, skip=("chunk_rows",), overrides=_RUN_OVERRIDES)
@config_options(RegenerateRun, skip=("inputs", "output", "settings", "backend"))
@config_file_options
@handle_errors(kept=kept_rows, writes=Writes({"inputs": "INPUTS"}, directory=False))
def regenerate(inputs, output, resume, force, **options):
    """Rewrite the assistant turns of conversations with the verifier's own answers.

    INPUT: .jsonl, .json or .parquet conversation files (globs allowed) or 'sharegpt', or question
    files (MT-Bench 'turns', 'prompt' or 'question' rows, as peagle-eval --prompts reads them). System,
    user and tool messages and tools are kept; tool-calling assistant turns are kept as they are. Rows
    that cannot be regenerated go to OUT.rejects.jsonl with the reason. Exits 1 when no row is written.
    """
    with config_error():
        run = RegenerateRun(inputs=list(inputs), output=output, resume=resume, force=force,
                            settings=RegenerateConfig(**_split(options, RegenerateConfig)),
                            backend=BackendConfig(**_split(options, BackendConfig)))
    _echo_summary(run_regenerate(run, config=run_config()), output, run.settings.max_new_tokens)
