"""One ``peagle-eval`` run: the checks, offline and/or online evaluation, the merged report, its
JSON and PNG (docs/design.md §9). The command line only builds an :class:`EvalRun` and prints."""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle_train.evaluate.checks import check_before_weights, template_mode
from peagle_train.evaluate.config import EvalConfig
from peagle_train.evaluate.cost_model import (HYBRID_COSTS_SKIPPED, cost_model_report, first_prompt_ids,
                                              measure_trusted_costs)
from peagle_train.evaluate.offline import run_offline_eval
from peagle_train.generate.inference import load_for_decoding
from peagle_train.evaluate.online import run_online_eval
from peagle_train.generate.verifier import config_recurrent_layers
from peagle_train.evaluate.report import foreign_report_files, write_acceptance_plot, write_json
from peagle_train.generate.vllm_engine import check_vllm_sampling, import_vllm, vllm_on_cpu
from peagle_train.evaluate.vllm_eval import run_vllm_eval
from peagle_train.model.checkpoint import find_drafter
from peagle_train.train.kinds import checkpoint_kind, load_drafter_of_kind
from stores.errors import ForeignFilesError, OutputExistsError
from stores.features.feature_store import FeatureStore
from runtime.progress import progress
from runtime.model_config import load_model_config

__all__ = ["EvalRun", "run_eval", "VLLM_COSTS_SKIPPED", "OFFLINE_COSTS_NOT_ASKED"]

VLLM_COSTS_SKIPPED = ("--engine vllm: the cost model times peagle's own decoder (transformers), not vLLM, so it is "
                      "not applied to vLLM's acceptance; with --store and --measure-costs the offline report holds "
                      "the table for peagle's decoder")
OFFLINE_COSTS_NOT_ASKED = ("not asked: offline judging times no decoding; --measure-costs times peagle's decoding "
                           "steps on this machine for the table (seconds idle, minutes on a loaded machine)")


@dataclass(frozen=True, kw_only=True)
class EvalRun:
    """What one ``peagle-eval`` run evaluates, where it writes, and how (``settings``)."""

    drafter: str
    """Drafter checkpoint directory, or a peagle-train output (its final/, else its newest checkpoint-N/)."""
    verifier: str | None = None
    """Verifier MODEL; None: the verifier named in the drafter config (online) or the store (offline)."""
    prompts: str | None = None
    """Prompts JSONL (MT-Bench ``turns`` or OpenAI ``messages`` lines): run online evaluation."""
    store: str | None = None
    """Feature store: run offline evaluation."""
    output: str | None = None
    """Also write the JSON report here (and a PNG beside it)."""
    force: bool = field(default=False, metadata={"action": True})
    """Overwrite an existing output (and its PNG)."""
    settings: EvalConfig = field(default_factory=EvalConfig)
    """What is measured and on how much."""

    def __post_init__(self) -> None:
        if self.prompts is None and self.store is None:
            raise ValueError("give --prompts (online), --store (offline), or both")
        if self.prompts is None and self.settings.mode_variables():
            raise ValueError("--reasoning-effort, --enable-thinking and --template-mixture draw each online prompt's "
                             "mode: give --prompts, or evaluate the store in one mode (--chat-template-kwargs)")


def _progress(desc: str, unit: str) -> Callable[[int], Any]:
    """A ``total -> bar`` factory writing to stderr (:func:`runtime.progress.progress`)."""
    return lambda total: progress(total=total, desc=desc, unit=unit, dynamic_ncols=True)


def _check_output(run: EvalRun) -> None:
    """Raise OutputExistsError when the report or its PNG exists and ``force`` is not set, ForeignFilesError when
    ``force`` would replace files that are no report of peagle-eval's (:func:`foreign_report_files`)."""
    if run.output is None:
        return
    for existing in (Path(run.output), Path(run.output).with_suffix(".png")):
        if existing.exists() and not run.force:
            raise OutputExistsError(str(existing))
    foreign = foreign_report_files(run.output)
    if foreign:
        raise ForeignFilesError(str(run.output), [str(p) for p in foreign], "--output", ["an evaluation report"])


def _evaluate(run: EvalRun, drafter: str, log: Callable[[str], None]) -> dict[str, Any]:
    """The online report with the offline one under ``offline``, or the offline report alone."""
    s = run.settings
    offline = online = None
    if run.store is not None:
        offline = run_offline_eval(drafter, run.store, max_blocks=s.max_blocks, verifier_name=run.verifier,
                                   num_depths=s.num_draft_tokens, chunk_anchors=s.chunk_anchors,
                                   progress_factory=_progress("offline eval", "block"), log=log,
                                   max_new_tokens=s.max_new_tokens, seed=s.seed, allow_partial=s.allow_partial,
                                   all_anchor=s.all_anchor)
    if run.prompts is not None and s.engine == "vllm":
        online = run_vllm_eval(drafter, run.verifier, run.prompts, s, log=log)
    elif run.prompts is not None:
        online = run_online_eval(drafter, run.verifier, run.prompts, max_new_tokens=s.online_max_new_tokens(),
                                 num_prompts=s.num_prompts, num_draft_tokens=s.num_draft_tokens,
                                 progress_factory=_progress("online eval (plain + speculative)", "tok"), temperature=s.temperature,
                                 seed=s.seed, measure_costs=s.measure_costs, tree_topk=s.tree_topk, top_k=s.top_k, top_p=s.top_p,
                                 tree_nodes=s.tree_nodes, draft_sample_method=s.draft_sample_method,
                                 chat_template_kwargs=s.chat_template_kwargs, reasoning_parser=s.reasoning_parser,
                                 mixture={"reasoning_effort": s.reasoning_effort, "enable_thinking": s.enable_thinking,
                                          "template_mixture": s.template_mixture})
    if offline is not None and (online is None or s.engine == "vllm"):  # no online run of peagle's decoder
        if s.costs_measured(online_peagle=False):
            offline = {**offline, "cost_model": _offline_cost_model(drafter, run.store, offline, s.cost_rounds)}
        elif s.measure_costs is None:
            offline = {**offline, "cost_model": {"skipped": OFFLINE_COSTS_NOT_ASKED}}
    if online is None:
        return offline
    if s.measure_costs is not False and s.engine == "vllm":
        online = {**online, "cost_model": {"skipped": VLLM_COSTS_SKIPPED}}
    return online if offline is None else {**online, "offline": offline}


def _offline_cost_model(drafter: str, store: str, offline: dict[str, Any], rounds: int) -> dict[str, Any]:
    """The ``cost_model`` from the offline acceptance (no acceptance of peagle's own decoder was measured), the
    steps timed with a KV cache of the first scored block's prompt (:func:`first_prompt_ids`); ``{"skipped":
    reason}`` when no anchor was scored."""
    if "positions_scored" not in offline:
        return {"skipped": "the offline cost model predicts from the all-anchor acceptance: give --all-anchor"}
    if not offline["positions_scored"]:
        return {"skipped": "the offline evaluation scored no anchor: no acceptance to predict from"}
    if config_recurrent_layers(load_model_config(offline["verifier"])):
        return {"skipped": HYBRID_COSTS_SKIPPED}
    context = first_prompt_ids(FeatureStore.open(store).read_block(offline["blocks"][0]))
    # the verifier's config was checked before any weights (check_before_weights); the timing needs no
    # tokenizer check: token ids do not change a step's cost
    verifier, loaded = load_for_decoding(load_drafter_of_kind(drafter), offline["verifier"])
    return cost_model_report(measure_trusted_costs(verifier, loaded, context, int(loaded.config.num_depths), rounds),
                             offline)


def run_eval(run: EvalRun, log: Callable[[str], None] = print, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Evaluate a drafter: every check that needs no weights first, then offline on ``run.store``
    and online (speculative decoding) on ``run.prompts``; write the report atomically and its plot.

    Returns:
        The report: the online report (``identical_to_greedy``, ``mismatches``, acceptance, speed)
        with the offline one under ``offline``, or the offline report alone; with ``config`` (the
        command's resolved options, ``--print-config``) under ``config``, so that ``peagle-eval
        --config REPORT.json`` repeats the run.

    Raises:
        OutputExistsError: ``run.output`` or its PNG exists and ``run.force`` is not set.
        MissingDependencyError: ``--engine vllm`` without vLLM installed (names the set-up command).
        InputError: also ``--engine vllm`` with a vLLM that no longer serves P-EAGLE (from 0.34:
        :func:`runtime.vllm_runtime.check_vllm_serves_peagle`), or at T > 0 where vLLM's rejection sampler does not get the verifier's
        distribution (:func:`~peagle_train.generate.vllm_engine.check_vllm_sampling`).
        StoreFormatError, StoreMismatchError, ModelNotFoundError: from the checks.
    """
    found, note = find_drafter(run.drafter)  # a training output directory means its final/ checkpoint
    if note:
        log(note)
    drafter = str(found)
    _check_output(run)
    if run.prompts is not None and run.settings.engine == "vllm":
        checkpoint_kind(drafter).check_installed_vllm()  # P-EAGLE from vLLM 0.34 on: refused, no vLLM imported
        import_vllm()  # MissingDependencyError naming the set-up command, before any work
        check_vllm_sampling(run.settings.temperature, vllm_on_cpu())  # T > 0 where vLLM samples wrongly: refused
    check_before_weights(drafter, run.verifier, run.prompts, run.store, run.settings.num_prompts,
                         run.settings.num_draft_tokens)
    mode = template_mode(drafter, run.settings.chat_template_kwargs, run.settings.allow_template_mode_mismatch,
                         run.store, run.settings.mode_variables() if run.prompts is not None else None,
                         run.settings.seed)
    if mode["mismatches"]:
        log("WARNING: evaluating in another template mode (--allow-template-mode-mismatch): "
            + "; ".join(mode["mismatches"]))
    run = dataclasses.replace(run, settings=dataclasses.replace(run.settings,
                                                                chat_template_kwargs=mode["chat_template_kwargs"]))
    report = {**_evaluate(run, drafter, log), "template_mode": mode}
    if config is not None:
        report = {**report, "config": config}
    if run.output is not None:
        write_json(report, run.output)  # atomic (stores.staging)
        write_acceptance_plot(report if run.prompts is not None else {"offline": report},
                              Path(run.output).with_suffix(".png"))
    return report
