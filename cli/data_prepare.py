"""``peagle-data tokenize`` and ``peagle-data pack``: options -> one config -> one library call."""

from __future__ import annotations

import dataclasses
import sys

import click
from click.core import ParameterSource

from cli.common import OutputPath, Writes, config_error, handle_errors
from cli.options import FROM_CONFIG_FILE, config_file_options, config_options, run_config
from peagle_data.prepare.config import (
    DROPPED_CONTENT,
    HISTORY_REWRITE,
    SPECIAL_TOKEN_TEXT,
    PackConfig,
    PackRun,
    TokenizeConfig,
    TokenizeRun,
)
from peagle_data.prepare.pack import run_pack
from peagle_data.prepare.tokenizing import run_tokenize
from peagle_data.prepare.windows import OVERLAP_LOSS
from peagle_data.readers.rows import FORMATS
from stores.tables.token_tables import read_first_reject

__all__ = ["tokenize", "pack"]

_TOKENIZE_OVERRIDES = {
    "format": {"type": click.Choice(FORMATS)},
    "chat_template": {"type": click.Path(dir_okay=False), "metavar": "FILE"},
    "on_history_rewrite": {"type": click.Choice(HISTORY_REWRITE)},
    "on_dropped_content": {"type": click.Choice(DROPPED_CONTENT)},
    "on_special_token_text": {"type": click.Choice(SPECIAL_TOKEN_TEXT)},
    "dedup": {"decls": ["--dedup/--no-dedup"]},
}
"""What TokenizeConfig's annotations cannot say: the choices (the library's own tuples), a path, a flag pair."""


_RUN_OVERRIDES = {
    "inputs": {"metavar": "INPUT...", "nargs": -1, "required": True},
    "tokenizer": {"metavar": "MODEL"},
    "output": {"metavar": "DIR", "type": OutputPath(directory=True)},
}
"""The run fields of TokenizeRun and PackRun: INPUT... an argument, MODEL, a directory."""


def _run_fields(options: dict) -> dict:
    """The fields of the run wrapper (inputs, tokenizer, output, force) from a command's options."""
    return {"inputs": list(options.pop("inputs")), **{k: options.pop(k) for k in ("tokenizer", "output", "force")}}


def _tokenize_config(options: dict) -> TokenizeConfig:
    """The TokenizeConfig of a command's options (its fields; the others are left alone)."""
    with config_error():
        return TokenizeConfig(**{f.name: options[f.name] for f in dataclasses.fields(TokenizeConfig)})


def _pack_config(options: dict) -> PackConfig:
    """The PackConfig of pack's options, its ``tokenize`` the TokenizeConfig of the same options."""
    with config_error():
        return PackConfig(tokenize=_tokenize_config(options),
                          **{f.name: options[f.name] for f in dataclasses.fields(PackConfig) if f.name != "tokenize"})


def _explicit_tokenize_fields(ctx: click.Context) -> set[str]:
    """TokenizeConfig fields the user set: on the command line (or in the environment), or in a
    ``--config`` file to another value than the default."""
    defaults, from_file = TokenizeConfig(), ctx.meta.get(FROM_CONFIG_FILE, set())
    explicit = set()
    for f in dataclasses.fields(TokenizeConfig):
        source = ctx.get_parameter_source(f.name)
        if source not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP) or (
                f.name in from_file and ctx.params[f.name] != getattr(defaults, f.name)):
            explicit.add(f.name)
    return explicit


def _echo_summary(summary: dict) -> None:
    """Print the run's counts, each explained, and where the rejected rows are listed."""
    c, out = summary["counts"], summary["output"]
    click.echo(f"read {c['read']}  used {c['used']}  rejected {c['rejected']}"
               + (f"  (duplicates {c['duplicates']})" if c.get("duplicates") else ""))
    if c.get("rejected"):
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(c.get("rejected_by_reason", {}).items(),
                                                           key=lambda kv: (-kv[1], kv[0])))
        click.echo(f"  rejected by reason: {reasons}; each rejected row is a line of {out}/rejects.jsonl "
                   "(its FILE:N source and the reason)")
    if c.get("conversations_with_dropped_content"):
        parts = ", ".join(f"{k[len('dropped_'):]} {v}" for k, v in sorted(c.items())
                          if k.startswith("dropped_") and k != "dropped_leading_assistant_turns" and v)
        click.echo(f"  kept without content the chat template drops (--on-dropped-content keep): "
                   f"{c['conversations_with_dropped_content']} conversations ({parts})")
    if c.get("conversations_with_special_token_text"):
        click.echo(f"  kept with special-token text in a supervised reply, read as control ids "
                   f"(--on-special-token-text keep): {c['conversations_with_special_token_text']} conversations")
    for name, sc in (c.get("sources") or {}).items():  # a mixture: one line per source
        # sampled out and copies exist where weights were drawn (not in pack of a tokenize output)
        drawn = "".join(f"  {label} {sc[key]}" for key, label in (("sampled_out", "sampled out"), ("copies", "copies"))
                        if key in sc)
        click.echo(f"  source {name}: read {sc['read']}  used {sc['used']}  rejected {sc['rejected']}  duplicates "
                   f"{sc['duplicates']}{drawn}"
                   + (f"  in other shards {sc['other_shards']}" if sc.get("other_shards") else ""))
    if c.get("other_shards"):
        click.echo(f"  {c['other_shards']} input items belong to other shards (--num-shards)")
    click.echo(f"tokens {c['tokens']}  loss tokens {c['loss_tokens']}")
    if "n_blocks" in c:
        click.echo(f"windows {c['windows']}  (dropped {c['windows_dropped']}: windows with no supervised token left, "
                   f"e.g. the overlap of a long conversation with --overlap-loss skip; capped "
                   f"{c.get('windows_capped', 0)}: windows after the first --max-windows of a conversation)")
        click.echo(f"blocks {c['n_blocks']} x {c['block_size']} tokens  packing efficiency "
                   f"{c['packing_efficiency']:.4f}")
    click.echo(f"output: {out}")


def _exit_if_useless(summary: dict) -> None:
    """A run that produced no usable data still wrote its manifest and rejects; say so loudly on
    stderr and exit 1, so scripts do not go on with an empty table."""
    c = summary["counts"]
    if c["used"] > 0 and c.get("loss_tokens", 1) > 0 and c.get("n_blocks", 1) > 0:
        return
    what = (f"0 of {c['read']} input rows used" if c["used"] == 0
            else "no supervised token" if c.get("loss_tokens", 1) == 0 else "0 packed blocks")
    reasons = f" (rejected: {c['rejected_by_reason']})" if c.get("rejected_by_reason") else ""
    first = read_first_reject(summary["output"]) if c["rejected"] else None
    if first is not None:
        reasons += f"; the first reject: {first.get('source')}: {first.get('reason')}"
    click.echo(f"WARNING: the output holds no training data: {what}{reasons}. See "
               f"{summary['output']}/rejects.jsonl; check the input files, --format, --max-seq-len "
               "and --chat-template.", err=True)
    sys.exit(1)


@click.command()
@config_options(TokenizeRun, skip=("settings",), arguments=("inputs",), overrides=_RUN_OVERRIDES)
@config_options(TokenizeConfig, overrides=_TOKENIZE_OVERRIDES)
@config_file_options
@handle_errors(writes=Writes({"inputs": "INPUTS", "tokenizer": "--tokenizer"}))
def tokenize(**options):
    """Tokenize conversations with the chat template; write input_ids and assistant loss masks.

    INPUT: .jsonl, .json or .parquet files (globs allowed), 'sharegpt', or one mixture file
    (.yaml/.toml: 'seed' and a list 'sources', each with 'path', optional 'name', 'weight' (expected copies
    of each row), 'limit' (first rows) and 'chat_template'; paths relative to the file). Rejected rows go to
    rejects.jsonl as FILE:N (N counts lines/rows from 1). Exits 1 with a warning when no row is used.
    """
    run = TokenizeRun(**_run_fields(options), settings=_tokenize_config(options))
    summary = run_tokenize(run, config=run_config())
    _echo_summary(summary)
    _exit_if_useless(summary)


@click.command()
@config_options(PackRun, skip=("settings",), arguments=("inputs",), overrides=_RUN_OVERRIDES)
@config_options(TokenizeConfig, overrides=_TOKENIZE_OVERRIDES)
@config_options(PackConfig, skip=("tokenize",), overrides={"overlap_loss": {"type": click.Choice(OVERLAP_LOSS)}})
@config_file_options
@handle_errors(writes=Writes({"inputs": "INPUTS", "tokenizer": "--tokenizer"}))
def pack(**options):
    """Cut conversations into windows and pack them into blocks with cu_seqlens.

    INPUT: conversation files / 'sharegpt' / one mixture file (tokenized on the fly), or a tokenize output (then
    --format, --num-workers, --on-history-rewrite and --on-dropped-content do not apply; a warning
    names them if given).
    Exits 1 with a warning when no row is used or no block is written.
    """
    run = PackRun(**_run_fields(options), settings=_pack_config(options))
    summary = run_pack(run, explicit=_explicit_tokenize_fields(click.get_current_context()), config=run_config())
    _echo_summary(summary)
    _exit_if_useless(summary)
