"""``peagle-data tokenize`` and ``peagle-data pack``: options -> one config -> one library call."""

from __future__ import annotations

import sys

import click
from click.core import ParameterSource

from cli.common import handle_errors

__all__ = ["tokenize", "pack"]

_FORMAT = click.Choice(["auto", "openai", "sharegpt"])


def _common_options(fn):
    """Options shared by tokenize and pack (applied in reverse so --help lists them in order)."""
    options = [
        click.argument("inputs", metavar="INPUT...", nargs=-1, required=True),
        click.option("--tokenizer", "tokenizer_name", metavar="MODEL", required=True,
                     help="smollm2-135m, a local model directory or a Hugging Face id."),
        click.option("--output", metavar="DIR", required=True, type=click.Path(file_okay=False),
                     help="Output table directory (must not exist unless --force)."),
        click.option("--chat-template", metavar="FILE", type=click.Path(dir_okay=False),
                     help="Jinja chat template file replacing the tokenizer's own."),
        click.option("--limit", metavar="N", type=click.IntRange(min=1),
                     help="Read at most N input rows (usable or not); for pack of a tokenize output, "
                          "its first N conversations."),
        click.option("--format", "fmt", type=_FORMAT, default="auto", show_default=True,
                     help="Conversation format of the input rows (auto detects per row)."),
        click.option("--strict", is_flag=True, help="Stop at the first bad row instead of rejecting it."),
        click.option("--num-workers", metavar="N", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Processes that render and tokenize (same output for any N)."),
        click.option("--on-history-rewrite", type=click.Choice(["split", "reject"]), default="split",
                     show_default=True,
                     help="A template that rewrites earlier turns: one row per assistant turn, or reject."),
        click.option("--dedup/--no-dedup", default=True, show_default=True,
                     help="Reject exact duplicates (same normalised messages) after the first, across all inputs; "
                          "listed in rejects.jsonl with the row they duplicate."),
        click.option("--max-tokens", metavar="N", type=click.IntRange(min=1), default=None,
                     help="Reject conversations of more than N tokens (counted as 'too long')."),
        click.option("--min-loss-tokens", metavar="N", type=click.IntRange(min=1), default=None,
                     help="Reject conversations with fewer than N supervised tokens."),
        click.option("--on-dropped-content", type=click.Choice(["reject", "keep"]), default="reject",
                     show_default=True,
                     help="Message content the chat template does not render (tool calls, reasoning, tools, "
                          "images): reject the conversation, or keep it without that content (counted)."),
        click.option("--num-shards", metavar="N", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Split the run into N shards by conversation content; see --shard-index."),
        click.option("--shard-index", metavar="I", type=click.IntRange(min=0), default=0, show_default=True,
                     help="The shard this run writes, 0..N-1; the union of all N outputs is the unsharded run "
                          "(`peagle-data merge` joins them)."),
        click.option("--force", is_flag=True, help="Overwrite an existing output."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _tokenize_config(chat_template, limit, fmt, strict, num_workers, on_history_rewrite, **filters):
    """``filters``: on_dropped_content, dedup, max_tokens, min_loss_tokens (TokenizeConfig fields of
    the same names)."""
    from peagle_data.prepare import TokenizeConfig

    try:
        return TokenizeConfig(format=fmt, limit=limit, strict=strict, chat_template=chat_template,
                              num_workers=num_workers, on_history_rewrite=on_history_rewrite, **filters)
    except ValueError as e:
        raise click.UsageError(str(e)) from None


_TOKENIZE_FIELDS = {"chat_template": "chat_template", "limit": "limit", "fmt": "format", "strict": "strict",
                    "num_workers": "num_workers", "on_history_rewrite": "on_history_rewrite",
                    "on_dropped_content": "on_dropped_content"}
"""click parameter name -> TokenizeConfig field."""


def _explicit_tokenize_fields(ctx: click.Context) -> set[str]:
    """TokenizeConfig fields whose option the user set (command line or environment), not defaults."""
    return {field for param, field in _TOKENIZE_FIELDS.items()
            if ctx.get_parameter_source(param) not in (None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)}


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
    click.echo(f"WARNING: the output holds no training data: {what}{reasons}. See "
               f"{summary['output']}/rejects.jsonl; check the input files, --format, --max-seq-len "
               "and --chat-template.", err=True)
    sys.exit(1)


@click.command()
@_common_options
@handle_errors
def tokenize(inputs, tokenizer_name, output, chat_template, limit, fmt, strict, num_workers, on_history_rewrite,
             on_dropped_content, dedup, max_tokens, min_loss_tokens, num_shards, shard_index, force):
    """Tokenize conversations with the chat template; write input_ids and assistant loss masks.

    INPUT: .jsonl, .json or .parquet files (globs allowed), 'sharegpt', or one mixture file
    (.yaml/.toml: sources with weights or row limits, see the README). Rejected rows go to
    rejects.jsonl as FILE:N (N counts lines/rows from 1). Exits 1 with a warning when no row is used.
    """
    from peagle_data.prepare import run_tokenize

    cfg = _tokenize_config(chat_template, limit, fmt, strict, num_workers, on_history_rewrite,
                           on_dropped_content=on_dropped_content, dedup=dedup,
                           max_tokens=max_tokens, min_loss_tokens=min_loss_tokens, num_shards=num_shards,
                           shard_index=shard_index)
    summary = run_tokenize(list(inputs), tokenizer_name, output, cfg, force=force)
    _echo_summary(summary)
    _exit_if_useless(summary)


@click.command()
@_common_options
@click.option("--max-seq-len", metavar="N", type=int, default=2048, show_default=True,
              help="Most tokens in a window; longer conversations become overlapping windows.")
@click.option("--block-size", metavar="N", type=int, default=None,
              help="Most tokens in a packed block (>= --max-seq-len)  [default: --max-seq-len]")
@click.option("--overlap", metavar="F", type=float, default=0.5, show_default=True,
              help="Fraction of a window's body shared with the next window, in [0, 1).")
@click.option("--overlap-loss", type=click.Choice(["skip", "keep"]), default="skip", show_default=True,
              help="skip: supervise every token once; keep: supervise the overlap twice.")
@click.option("--max-windows", type=click.IntRange(min=1), default=None, metavar="N",
              help="Keep at most the first N windows of each conversation (default: all); the rest are counted.")
@handle_errors
def pack(inputs, tokenizer_name, output, chat_template, limit, fmt, strict, num_workers, on_history_rewrite,
         on_dropped_content, dedup, max_tokens, min_loss_tokens, num_shards, shard_index, force, max_seq_len,
         block_size, overlap, overlap_loss, max_windows):
    """Cut conversations into windows and pack them into blocks with cu_seqlens.

    INPUT: conversation files / 'sharegpt' / one mixture file (tokenized on the fly), or a tokenize output (then
    --format, --num-workers, --on-history-rewrite and --on-dropped-content do not apply; a warning
    names them if given).
    Exits 1 with a warning when no row is used or no block is written.
    """
    from peagle_data.prepare import PackConfig, run_pack

    tok_cfg = _tokenize_config(chat_template, limit, fmt, strict, num_workers, on_history_rewrite,
                               on_dropped_content=on_dropped_content, dedup=dedup,
                               max_tokens=max_tokens, min_loss_tokens=min_loss_tokens, num_shards=num_shards,
                               shard_index=shard_index)
    try:
        cfg = PackConfig(max_seq_len=max_seq_len, block_size=block_size, overlap=overlap,
                         overlap_loss=overlap_loss, max_windows=max_windows, tokenize=tok_cfg)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    summary = run_pack(list(inputs), tokenizer_name, output, cfg, force=force,
                       explicit=_explicit_tokenize_fields(click.get_current_context()))
    _echo_summary(summary)
    _exit_if_useless(summary)
