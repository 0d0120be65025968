"""``peagle-data regenerate``: options -> a back end and a config -> one library call."""

from __future__ import annotations

import sys

import click

from cli.common import handle_errors

__all__ = ["regenerate"]


def _backend(verifier, servers, served_model, max_new_tokens, temperature, concurrency, batch_size, device,
             retries, timeout):
    """The local back end for --verifier, the server back end for --server (exactly one of them)."""
    from peagle_data.verifier_backends import LocalBackend, ServerBackend

    if verifier:
        return LocalBackend(verifier, max_new_tokens, temperature, batch_size=batch_size, device=device)
    return ServerBackend(list(servers), served_model, max_new_tokens, temperature, concurrency=concurrency,
                         retries=retries, timeout=timeout)


@click.command()
@click.argument("inputs", metavar="INPUT...", nargs=-1, required=True)
@click.option("--output", metavar="OUT.jsonl", required=True, type=click.Path(dir_okay=False),
              help="Regenerated conversations (OpenAI messages); OUT.manifest.json and OUT.rejects.jsonl beside it.")
@click.option("--verifier", metavar="MODEL", help="Generate in this process: smollm2-135m, a directory or a hub id.")
@click.option("--server", "servers", metavar="URL", multiple=True,
              help="An OpenAI-compatible server (vLLM, SGLang, transformers serve), http://host:port[/v1]; "
                   "repeat for several, used in parallel.")
@click.option("--served-model", metavar="NAME", help="Model name sent to the servers [default: their only model].")
@click.option("--max-new-tokens", metavar="N", type=click.IntRange(min=1), default=512, show_default=True,
              help="Most tokens per answer (an answer cut there is kept and counted).")
@click.option("--temperature", metavar="T", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="0 is greedy (reproducible, resumable to the same file).")
@click.option("--turns", type=click.Choice(["all", "last"]), default="all", show_default=True,
              help="Regenerate every assistant turn (given the regenerated history) or only the last one.")
@click.option("--concurrency", metavar="N", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests in flight per --server.")
@click.option("--batch-size", metavar="N", type=click.IntRange(min=1), default=16, show_default=True,
              help="Prompts per generate call of --verifier (sorted by length, left-padded).")
@click.option("--device", metavar="DEV", help="--verifier device (cpu, cuda, cuda:1) [default: cuda if available].")
@click.option("--limit", metavar="N", type=click.IntRange(min=1), help="Read at most N input rows.")
@click.option("--format", "fmt", type=click.Choice(["auto", "openai", "sharegpt"]), default="auto", show_default=True,
              help="Conversation format of the input rows (auto detects per row).")
@click.option("--retries", metavar="N", type=click.IntRange(min=0), default=5, show_default=True,
              help="Retries of a failed server request (exponential backoff) before the row is rejected.")
@click.option("--timeout", metavar="S", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Seconds a server request may take.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of sampling (--temperature > 0).")
@click.option("--resume", is_flag=True, help="Continue an unfinished run of the same settings.")
@click.option("--force", is_flag=True, help="Overwrite an existing output.")
@handle_errors
def regenerate(inputs, output, verifier, servers, served_model, max_new_tokens, temperature, turns, concurrency,
               batch_size, device, limit, fmt, retries, timeout, seed, resume, force):
    """Rewrite the assistant turns of conversations with the verifier's own answers.

    INPUT: .jsonl, .json or .parquet conversation files (globs allowed) or 'sharegpt'. System, user
    and tool messages and tools are kept; tool-calling assistant turns are kept as they are. Rows
    that cannot be regenerated go to OUT.rejects.jsonl with the reason. Exits 1 when no row is written.
    """
    from peagle_data.regenerate import RegenerateConfig, run_regenerate

    try:
        cfg = RegenerateConfig(max_new_tokens=max_new_tokens, temperature=temperature, turns=turns, limit=limit,
                               format=fmt, seed=seed)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if bool(verifier) == bool(servers):
        raise click.UsageError("give exactly one of --verifier MODEL (local) and --server URL (OpenAI-compatible)")
    if verifier and served_model:
        raise click.UsageError("--served-model goes with --server, not --verifier")
    summary = run_regenerate(list(inputs), output,
                             lambda: _backend(verifier, servers, served_model, max_new_tokens, temperature,
                                              concurrency, batch_size, device, retries, timeout),
                             cfg, force=force, resume=resume)
    c = summary["counts"]
    click.echo(f"read {c['read']}  written {c['written']}  rejected {c['rejected']}"
               + (f"  (resumed after {summary['resumed_rows']} rows)" if summary["resumed_rows"] else ""))
    if c["rejected"]:
        click.echo(f"  rejected by reason: {c['rejected_by_reason']}; see the rejects file beside {output}")
    click.echo(f"turns regenerated {c['turns_regenerated']} (cut at --max-new-tokens {c['turns_truncated']})  "
               f"prompt tokens {c['prompt_tokens']}  completion tokens {c['completion_tokens']}")
    click.echo(f"output: {output}")
    if c["written"] == 0:
        click.echo("WARNING: no conversation was regenerated; see the rejects file", err=True)
        sys.exit(1)
