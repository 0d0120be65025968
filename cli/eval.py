"""``peagle-eval``: offline and online evaluation of a P-EAGLE drafter (DESIGN.md §9)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from cli.common import echo_json, handle_errors
from stores.errors import OutputExistsError


def _progress(desc: str):
    """A ``total -> tqdm bar`` factory writing to stderr."""
    from tqdm import tqdm

    return lambda total: tqdm(total=total, desc=desc, unit="it", file=sys.stderr, dynamic_ncols=True)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--drafter", required=True, type=click.Path(),
              help="Drafter checkpoint directory, or a peagle-train output (its final/, else its newest checkpoint-N/).")
@click.option("--verifier", default=None, help="Verifier MODEL (default: the verifier named in the drafter config).")
@click.option("--prompts", default=None, type=click.Path(),
              help="Prompts JSONL (MT-Bench `turns` or OpenAI `messages` lines): run online evaluation.")
@click.option("--store", default=None, type=click.Path(), help="Feature store: run offline evaluation.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True, help="Tokens generated per prompt turn.")
@click.option("--num-prompts", type=int, default=None, help="Use the first N prompts (default: all).")
@click.option("--num-draft-tokens", type=int, default=None, help="K drafts per verifier step (default: the drafter's).")
@click.option("--temperature", type=float, default=0.0, show_default=True,
              help="0: greedy, checked token for token against plain greedy decoding; T > 0: speculative "
                   "sampling (rejection sampling keeps the verifier's distribution).")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed (with --temperature > 0).")
@click.option("--max-blocks", type=int, default=None, help="Offline: score at most N validation blocks.")
@click.option("--output", default=None, type=click.Path(), help="Also write the JSON report here (and a PNG beside it).")
@click.option("--force", is_flag=True, help="Overwrite an existing --output (and its PNG).")
@handle_errors
def main(drafter: str, verifier: str | None, prompts: str | None, store: str | None, max_new_tokens: int,
         num_prompts: int | None, num_draft_tokens: int | None, temperature: float, seed: int,
         max_blocks: int | None, output: str | None, force: bool) -> None:
    """Evaluate a drafter: offline on STORE, online (speculative decoding) on PROMPTS; prints one JSON object.

    Exits non-zero when speculative decoding does not reproduce the verifier's greedy output.
    """
    from peagle_train.evaluate import (
        EvalConfig,
        check_before_weights,
        format_report,
        run_offline_eval,
        run_online_eval,
        write_acceptance_plot,
    )

    if prompts is None and store is None:
        raise click.UsageError("give --prompts (online), --store (offline), or both")
    from peagle_train.checkpoint import find_drafter

    found, note = find_drafter(drafter)  # a training output directory means its final/ checkpoint
    if note:
        click.echo(note, err=True)
    drafter = str(found)
    if output is not None and not force:
        for existing in (Path(output), Path(output).with_suffix(".png")):
            if existing.exists():
                raise OutputExistsError(str(existing))
    try:
        EvalConfig(max_new_tokens=max_new_tokens, num_prompts=num_prompts, num_draft_tokens=num_draft_tokens,
                   max_blocks=max_blocks, temperature=temperature, seed=seed)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    check_before_weights(drafter, verifier, prompts, store, num_prompts)  # every check that needs no weights
    report: dict = {}
    if store is not None:
        offline = run_offline_eval(drafter, store, max_blocks=max_blocks, verifier_name=verifier,
                                   num_depths=num_draft_tokens, progress_factory=_progress("offline blocks"))
    if prompts is not None:
        report = run_online_eval(drafter, verifier, prompts, max_new_tokens=max_new_tokens, num_prompts=num_prompts,
                                 num_draft_tokens=num_draft_tokens, progress_factory=_progress("prompt turns"),
                                 temperature=temperature, seed=seed)
    if store is not None:
        report = {**report, "offline": offline} if prompts is not None else offline
    if output is not None:
        path = Path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        write_acceptance_plot(report if prompts is not None else {"offline": report}, path.with_suffix(".png"))
    click.echo(format_report(report), err=True)
    echo_json(report)
    if prompts is not None and report["identical_to_greedy"] is False:
        click.echo(f"Error: speculative decoding differs from greedy decoding on prompts "
                   f"{', '.join(report['mismatches'])}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
