"""One ``peagle-eval`` run: :func:`plan_eval` (every check before the weights, into an :class:`EvalPlan` that keeps
what it resolved), then offline and/or online evaluation on the plan, the merged report, its JSON and PNG
(docs/design.md §9). The command line only builds an :class:`EvalRun` and prints."""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle_train.evaluate.checks import CheckedInputs, check_before_weights, template_mode
from peagle_train.evaluate.config import EvalConfig
from peagle_train.evaluate.cost_model import offline_cost_model
from peagle_train.evaluate.offline import check_complete, choose_blocks, replay_max_new_tokens, score_store
from peagle_train.evaluate.online import online_report
from peagle_train.evaluate.prompts import Prompt
from peagle_train.evaluate.report import check_report_output, write_acceptance_plot, write_json
from peagle_train.evaluate.vllm_eval import check_speculators_verifier, vllm_reference, vllm_speculative
from peagle_train.generate.checks import check_tree_verifier
from peagle_train.generate.inference import load_for_decoding
from peagle_train.generate.speculative import Truncation, check_draft_sample_method, served_truncation
from peagle_train.generate.vllm_engine import check_vllm_sampling, check_vllm_verifier, import_vllm, vllm_on_cpu
from peagle_train.model.checkpoint import find_drafter
from peagle_train.train.kinds import DrafterKind, checkpoint_kind
from stores.errors import InputError, StoreMismatchError
from stores.features.feature_store import FeatureStore
from runtime.progress import progress

__all__ = ["EvalRun", "EvalPlan", "OnlinePlan", "OfflinePlan", "plan_eval", "evaluate_plan", "plan_offline_report", "plan_online_report", "run_eval", "VLLM_COSTS_SKIPPED", "OFFLINE_COSTS_NOT_ASKED"]

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


@dataclass(frozen=True, kw_only=True)
class OnlinePlan:
    """The online half of an :class:`EvalPlan`: what the prompts are decoded with."""

    verifier: str
    """Verifier MODEL (``--verifier``, else the drafter's), its config and tokenizer checked against the drafter."""
    prompts_file: str
    prompts: list[Prompt]
    """The prompts read (``--num-prompts`` of them)."""
    truncation: Truncation
    """The verifier's top-k / top-p at T > 0 (:func:`served_truncation`)."""
    sampling: dict[str, Any]
    """Where ``truncation`` came from, for the report."""
    vllm_sampling_check: str | None = None
    """``--engine vllm``: :func:`check_vllm_sampling`'s words, for the report; None with peagle's engine."""
    recurrent_layers: list[int] = field(default_factory=list)
    """The verifier's layers with a recurrent state (a hybrid's steps are not timed for the cost model)."""


@dataclass(frozen=True, kw_only=True)
class OfflinePlan:
    """The offline half of an :class:`EvalPlan`: the store scored and its limits."""

    store: FeatureStore
    """The STORE opened, its layers and sizes checked against the drafter, complete (or ``--allow-partial``)."""
    verifier: str | None
    """Verifier MODEL (``--verifier``, else the store's), checked against the store; None: the store names none
    (refused when the evaluation reaches it)."""
    max_new_tokens: int
    """The replay's limit per turn (:func:`replay_max_new_tokens`), and ``max_new_tokens_from`` where it came from."""
    max_new_tokens_from: str
    recurrent_layers: list[int]
    """The verifier's layers with a recurrent state (a hybrid's steps are not timed for the cost model)."""


@dataclass(frozen=True, kw_only=True)
class EvalPlan:
    """One ``peagle-eval`` run after every check that needs no verifier weights (:func:`plan_eval`): what it
    resolved, so that the evaluation takes the plan instead of resolving again."""

    run: EvalRun
    """The run, its ``settings.chat_template_kwargs`` the template mode's (``template_mode``)."""
    drafter: str
    """The drafter checkpoint directory (a training output's final/ or newest checkpoint-N/)."""
    output: Path | None
    """The report's path, checked (a PNG beside it), or None."""
    template_mode: dict[str, Any]
    """The report's ``template_mode`` (:func:`template_mode`)."""
    kind: DrafterKind
    """The drafter's kind (its ``config.json``), which loads it."""
    num_draft_tokens: int
    """K: ``--num-draft-tokens`` or the drafter's ``num_depths``, checked against them."""
    online: OnlinePlan | None
    """With ``--prompts``."""
    offline: OfflinePlan | None
    """With ``--store``."""


def _progress(desc: str, unit: str) -> Callable[[int], Any]:
    """A ``total -> bar`` factory writing to stderr (:func:`runtime.progress.progress`)."""
    return lambda total: progress(total=total, desc=desc, unit=unit, dynamic_ncols=True)


def _vllm_checks(drafter: str, settings: EvalConfig) -> str:
    """``--engine vllm``'s checks before any work: a vLLM that serves the drafter's kind, vLLM installed, and exact
    sampling at ``settings.temperature``; returns :func:`check_vllm_sampling`'s words."""
    checkpoint_kind(drafter).check_installed_vllm()  # P-EAGLE from vLLM 0.34 on: refused, no vLLM imported
    import_vllm()  # MissingDependencyError naming the set-up command, before any work
    return check_vllm_sampling(settings.temperature, vllm_on_cpu())  # T > 0 where vLLM samples wrongly: refused


def _online_plan(drafter: str, run: EvalRun, checked: CheckedInputs, sampling_check: str | None) -> OnlinePlan:
    """The online half: with peagle's engine the tree checked against the verifier's config and the verifier's
    top-k / top-p read; with vLLM the draft sample method, the loading and the verifier checked."""
    s, name = run.settings, checked.online_verifier
    if not name:
        raise InputError("the drafter's config names no verifier; pass one", field="--verifier")
    if s.engine == "vllm":
        check_draft_sample_method(s.draft_sample_method)
        check_vllm_verifier(name, vllm_on_cpu())
        if s.vllm_loading == "speculators":
            check_speculators_verifier(drafter, name)
    elif s.tree_topk is not None or s.tree_nodes is not None:
        check_tree_verifier(name)
    truncation, sampling = served_truncation(name, s.top_k, s.top_p)
    return OnlinePlan(verifier=name, prompts_file=str(run.prompts), prompts=checked.prompts, truncation=truncation,
                      sampling=sampling, vllm_sampling_check=sampling_check,
                      recurrent_layers=checked.recurrent_layers.get(name, []))


def plan_eval(run: EvalRun, log: Callable[[str], None] = print) -> EvalPlan:
    """Every check of a ``peagle-eval`` run that needs no verifier weights, in one pass: the drafter found, the
    output, vLLM (``--engine vllm``), the prompts, drafter, store and verifiers (:func:`check_before_weights`),
    the template mode, the store's completeness and replay limit, the online engine's own checks.

    Raises:
        OutputExistsError, ForeignFilesError: the output. MissingDependencyError: ``--engine vllm`` without vLLM.
        InputError, StoreFormatError, StoreMismatchError, ModelNotFoundError: from the checks.
    """
    found, note = find_drafter(run.drafter)  # a training output directory means its final/ checkpoint
    if note:
        log(note)
    drafter, s = str(found), run.settings
    output = check_report_output(run.output, run.force)
    vllm_online = run.prompts is not None and s.engine == "vllm"
    sampling_check = _vllm_checks(drafter, s) if vllm_online else None
    checked = check_before_weights(drafter, run.verifier, run.prompts, run.store, s.num_prompts, s.num_draft_tokens)
    mode = template_mode(drafter, s.chat_template_kwargs, s.allow_template_mode_mismatch, run.store,
                         s.mode_variables() if run.prompts is not None else None, s.seed)
    if mode["mismatches"]:
        log("WARNING: evaluating in another template mode (--allow-template-mode-mismatch): "
            + "; ".join(mode["mismatches"]))
    run = dataclasses.replace(run, settings=dataclasses.replace(s, chat_template_kwargs=mode["chat_template_kwargs"]))
    offline = None
    if checked.store is not None:
        check_complete(checked.store, s.allow_partial)
        limit, limit_from = replay_max_new_tokens(checked.store, s.max_new_tokens)
        offline = OfflinePlan(store=checked.store, verifier=checked.offline_verifier, max_new_tokens=limit,
                              max_new_tokens_from=limit_from,
                              recurrent_layers=checked.recurrent_layers.get(checked.offline_verifier, []))
    online = _online_plan(drafter, run, checked, sampling_check) if run.prompts is not None else None
    return EvalPlan(run=run, drafter=drafter, output=output, template_mode=mode, kind=checked.kind,
                    num_draft_tokens=checked.num_draft_tokens, online=online, offline=offline)


def plan_offline_report(plan: EvalPlan, log: Callable[[str], None]) -> dict[str, Any]:
    """The offline report of the plan's store (:func:`score_store`; its checks are the plan's)."""
    s, off = plan.run.settings, plan.offline
    chosen, contaminated = choose_blocks(off.store, plan.drafter, None, s.max_blocks, log)
    if not off.verifier:
        raise StoreMismatchError(f"{plan.run.store}: the store names no verifier; pass verifier_name")
    return score_store(plan.kind.load(plan.drafter).eval(), off.store, off.verifier, chosen, contaminated,
                       off.max_new_tokens, off.max_new_tokens_from, drafter_dir=plan.drafter, store=plan.run.store,
                       num_depths=s.num_draft_tokens, chunk_anchors=s.chunk_anchors,
                       progress_factory=_progress("offline eval", "block"), log=log, seed=s.seed,
                       all_anchor=s.all_anchor)


def plan_online_report(plan: EvalPlan, log: Callable[[str], None]) -> dict[str, Any]:
    """The online report: vLLM's (:func:`vllm_speculative`) or peagle's own decoder's (:func:`online_report`)."""
    s, on = plan.run.settings, plan.online
    if s.engine == "vllm":
        ref = vllm_reference(on.verifier, on.prompts_file, s, log, prompts=on.prompts,
                             served=(on.truncation, on.sampling))
        return vllm_speculative(ref, plan.drafter, s, log, kind=plan.kind, num_draft_tokens=plan.num_draft_tokens,
                                sampling_check=on.vllm_sampling_check)
    verifier, drafter = load_for_decoding(plan.kind.load(plan.drafter), on.verifier)
    report = online_report(verifier, drafter, on.verifier, on.prompts, s, on.truncation, on.sampling,
                           _progress("online eval (plain + speculative)", "tok"), recurrent_layers=on.recurrent_layers)
    return {"drafter": plan.drafter, "verifier": on.verifier, "prompts": on.prompts_file, **report}


def evaluate_plan(plan: EvalPlan, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The online report with the offline one under ``offline``, or the offline report alone."""
    s = plan.run.settings
    offline = plan_offline_report(plan, log) if plan.offline is not None else None
    online = plan_online_report(plan, log) if plan.online is not None else None
    if offline is not None and (online is None or s.engine == "vllm"):  # no online run of peagle's decoder
        if s.costs_measured(online_peagle=False):
            offline = {**offline, "cost_model": offline_cost_model(plan.kind, plan.drafter, plan.offline.store, offline,
                                                                   plan.offline.recurrent_layers, s.cost_rounds)}
        elif s.measure_costs is None:
            offline = {**offline, "cost_model": {"skipped": OFFLINE_COSTS_NOT_ASKED}}
    if online is None:
        return offline
    if s.measure_costs is not False and s.engine == "vllm":
        online = {**online, "cost_model": {"skipped": VLLM_COSTS_SKIPPED}}
    return online if offline is None else {**online, "offline": offline}


def run_eval(run: EvalRun, log: Callable[[str], None] = print, config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Evaluate a drafter: every check that needs no weights first (:func:`plan_eval`), then offline on
    ``run.store`` and online (speculative decoding) on ``run.prompts`` (:func:`evaluate_plan`); write the report
    atomically and its plot.

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
    plan = plan_eval(run, log)
    report = {**evaluate_plan(plan, log), "template_mode": plan.template_mode}
    if config is not None:
        report = {**report, "config": config}
    if plan.output is not None:
        write_json(report, plan.output)  # atomic (stores.staging)
        write_acceptance_plot(report if plan.online is not None else {"offline": report},
                              plan.output.with_suffix(".png"))
    return report
