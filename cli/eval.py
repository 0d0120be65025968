"""``peagle-eval``: offline and online evaluation of a P-EAGLE drafter (docs/design.md §9).

The options are the fields of :class:`~peagle_train.evaluate.run.EvalRun` and of its ``settings``
(:class:`~peagle_train.evaluate.config.EvalConfig`); the run is :func:`~peagle_train.evaluate.run.run_eval`.
"""

from __future__ import annotations

import sys

import click

from cli.common import OutputPath, Writes, config_error, echo_json, handle_errors
from cli.options import MIXTURE, config_file_options, config_options, run_config
from peagle_train.generate.speculative import DRAFT_SAMPLE_METHODS
from peagle_train.evaluate.config import ENGINES, VLLM_LOADINGS, EvalConfig
from peagle_train.evaluate.report import format_report
from peagle_train.evaluate.run import EvalRun, run_eval
from runtime.chat.answer_parsing import REASONING_PARSERS

_PATH = {"type": click.Path()}


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@config_options(EvalRun, skip=("settings",), overrides={**{k: _PATH for k in ("drafter", "prompts", "store")},
                                               "output": {"type": OutputPath(suffixes=(".json",))}})
@config_options(EvalConfig, skip=("chunk_anchors", "warmup", "cost_rounds"),  # memory bound, timing: library knobs
                overrides={"engine": {"type": click.Choice(ENGINES)},
                           "measure_costs": {"decls": ["--measure-costs/--no-measure-costs"]},
                           "vllm_loading": {"type": click.Choice(VLLM_LOADINGS)},
                           "draft_sample_method": {"type": click.Choice(DRAFT_SAMPLE_METHODS)},
                           "reasoning_parser": {"type": click.Choice(REASONING_PARSERS), "metavar": "NAME"},
                           "reasoning_effort": {**MIXTURE, "metavar": "X|JSON"},
                           "enable_thinking": {**MIXTURE, "metavar": "X|JSON"},
                           "template_mixture": {**MIXTURE, "metavar": "JSON"}})
@config_file_options
@handle_errors(writes=Writes({"drafter": "--drafter", "store": "--store", "prompts": "--prompts", "verifier": "--verifier"},
                             directory=False))
def main(drafter, verifier, prompts, store, output, force, **settings) -> None:
    """Evaluate a drafter: offline on STORE, online (speculative decoding) on PROMPTS; prints one JSON object.

    Exits non-zero when greedy speculative decoding does not reproduce the verifier's greedy output (in
    bfloat16, a first difference at a near tie of the verifier's top-2 logits is accepted and counted).
    """
    with config_error():
        run = EvalRun(drafter=drafter, verifier=verifier, prompts=prompts, store=store, output=output, force=force,
                      settings=EvalConfig(**settings))
    report = run_eval(run, log=lambda m: click.echo(m, err=True), config=run_config())
    click.echo(format_report(report), err=True)
    echo_json(report)
    _exit_if_not_greedy(report if prompts is not None else {})


def _exit_if_not_greedy(online: dict) -> None:
    """Exit 1 naming the prompts where greedy speculative decoding differed from greedy decoding other than at
    a near tie the dtype allows (``mismatches``; peagle_train/generate/identity.py)."""
    if online.get("mismatches"):
        click.echo(f"Error: speculative decoding differs from greedy decoding on prompts "
                   f"{', '.join(online['mismatches'])} ({(online.get('greedy_check') or {}).get('rule', 'exact')})",
                   err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
