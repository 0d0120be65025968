"""Online evaluation: plain vs speculative decoding on prompts, counted as vLLM reports (docs/design.md §9)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from peagle_train.generate.checks import check_drafter_tokenizer, check_tree_verifier, check_verifier_config
from peagle_train.evaluate.config import EvalConfig
from peagle_train.evaluate.cost_model import online_cost_model
from peagle_train.generate.identity import EXACT_DTYPES, compare_to_greedy, dtype_name, greedy_check_summary
from peagle_train.evaluate.prompts import Prompt, history_message, prompt_modes, read_prompts, render_turn
from peagle_train.generate.render import turn_text
from peagle_train.evaluate.report import per_mode_report, write_json
from peagle_train.generate.inference import PEAGLEInference, load_for_decoding
from peagle_train.generate.speculative import GenerationResult, Truncation, acceptance_scheme, served_truncation
from peagle_train.generate.tree import TreeGenerationResult, TreeSpec
from peagle_train.generate.verifier import config_recurrent_layers
from peagle_train.train.kinds import load_drafter_of_kind
from stores.errors import InputError
from runtime.model_cache import load_tokenizer, model_files


def _turn_seed(seed: int, turn_index: int) -> int:
    """The sampling seed of one prompt turn: a function of ``(seed, turn_index)`` only."""
    return seed * 1_000_003 + turn_index


def tree_spec(config: EvalConfig) -> TreeSpec | None:
    """The tree of ``--tree-topk`` / ``--tree-nodes``, None for the chain."""
    if config.tree_topk is None and config.tree_nodes is None:
        return None
    return TreeSpec(topk=tuple(config.tree_topk) if config.tree_topk is not None else None, nodes=config.tree_nodes)


@dataclass
class _OnlineTotals:
    K: int
    accepted: int = 0
    drafted: int = 0
    steps: int = 0
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    spec_tokens: int = 0
    spec_time_s: float = 0.0
    base_tokens: int = 0
    base_time_s: float = 0.0

    def __post_init__(self) -> None:
        self.reached = [0] * self.K
        self.accepted_at = [0] * self.K

    def add(self, base: GenerationResult, spec: GenerationResult) -> None:
        for n, k in zip(spec.accepted_per_step, spec.drafted_per_step):
            if k == 0:  # no draft scored: max_new_tokens left no room, or the first draft's place was an EOS
                continue
            self.steps += 1
            self.accepted += n
            self.drafted += k
            for i in range(k):
                self.reached[i] += 1
                self.accepted_at[i] += int(n > i)
        self.spec_tokens += len(spec.tokens)
        self.spec_time_s += spec.wall_time_s
        self.base_tokens += len(base.tokens)
        self.base_time_s += base.wall_time_s

    def report(self) -> dict[str, Any]:
        def ratio(a: float, b: float) -> float | None:
            return a / b if b else None

        return {
            "acceptance_length": 1.0 + (self.accepted / self.steps if self.steps else 0.0),
            "acceptance_rate": ratio(self.accepted, self.drafted),
            "per_position_acceptance": [ratio(a, r) for a, r in zip(self.accepted_at, self.reached)],
            "per_position_accepted": list(self.accepted_at),
            "per_position_reached": list(self.reached),
            "num_draft_tokens": self.K,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "num_drafts": self.steps,  # verifier steps that checked >= 1 draft (vLLM's num_drafts)
            "generated_tokens": self.spec_tokens,
            "tokens_per_second": ratio(self.spec_tokens, self.spec_time_s),
            "baseline_tokens_per_second": ratio(self.base_tokens, self.base_time_s),
            "speedup": ratio(ratio(self.spec_tokens, self.spec_time_s) or 0.0,
                             ratio(self.base_tokens, self.base_time_s) or 0.0),
        }


def _turn_record(tokenizer, prompt: Prompt, turn: int, prompt_tokens: int, base: GenerationResult,
                 spec: GenerationResult, check: dict[str, Any] | None, eos: Iterable[int],
                 mode: dict[str, Any]) -> dict[str, Any]:
    """One ``per_prompt`` entry: counts (``num_drafts``: verifier steps that checked >= 1 draft; ``steps``: each
    verifier step's accepted and drafted counts, as ``vllm_steps`` in vLLM's report), the
    prompt's template variables (``chat_template_kwargs``, ``mode``), the user turn, the speculative output (``text``) and the
    plain decoding's (``reference_text``: greedy at T = 0, a plain sample at T > 0), each without the
    EOS that ends it (:func:`turn_text`), ``finish_reason`` (``stop``: it ended with an EOS;
    ``length``: at ``max_new_tokens``), and at T = 0 the identity ``check``
    (:func:`~peagle_train.generate.identity.compare_to_greedy`: ``identical_to_greedy``, ``divergence``)."""
    eos = set(eos)
    return {
        "prompt_id": prompt.prompt_id, "turn": turn, "prompt_tokens": prompt_tokens,
        "new_tokens": len(base.tokens), "spec_new_tokens": len(spec.tokens),
        "verifier_steps": spec.verifier_steps, "accepted": spec.accepted, "drafted": spec.drafted,
        "num_drafts": sum(1 for k in spec.drafted_per_step if k > 0),
        "steps": {"accepted": list(spec.accepted_per_step), "drafted": list(spec.drafted_per_step)},
        "chat_template_kwargs": dict(mode),
        "identical_to_greedy": None if check is None else check["identical"],
        "divergence": None if check is None else check["divergence"],
        "user": prompt.user_turns[turn],
        "text": turn_text(tokenizer, spec.tokens, eos),
        "reference_text": turn_text(tokenizer, base.tokens, eos),
        "finish_reason": "stop" if spec.tokens and spec.tokens[-1] in eos else "length",
        **({"tree_nodes": sum(spec.nodes_per_step)} if isinstance(spec, TreeGenerationResult) else {}),
    }


def progress_total(prompts: Sequence[Prompt], max_new_tokens: int) -> int:
    """The progress total of :func:`evaluate_prompts`: ``2 * max_new_tokens`` tokens per turn (the plain decoding
    and speculative decoding each generate up to ``max_new_tokens``)."""
    return 2 * max_new_tokens * sum(len(p.user_turns) for p in prompts)


def evaluate_prompts(verifier, drafter, tokenizer, prompts: Sequence[Prompt], config: EvalConfig,
                     progress: Callable[[int], None] | None = None, truncation: Truncation = Truncation(),
                     sampling: dict[str, Any] | None = None, *, recurrent_layers: Sequence[int]) -> dict[str, Any]:
    """Greedy baseline and speculative decoding on every turn of ``prompts``; compare and measure.

    Args:
        verifier: a transformers causal LM (batch 1, any device).
        drafter: a ``PEagleDrafter`` for ``verifier``, on the verifier's device.
        tokenizer: the verifier's tokenizer (with a chat template).
        prompts: from :func:`read_prompts`.
        config: ``max_new_tokens``, ``num_draft_tokens``, ``temperature``, ``seed``, ``draft_sample_method``,
            ``warmup``, ``measure_costs``, the tree options, ``chat_template_kwargs`` (the prompts' template
            variables, also given to the reasoning parser), the mode mixture (``mode_variables``: each prompt
            draws its variables, :func:`~peagle_train.evaluate.prompts.prompt_modes`) and ``reasoning_parser``
            (how an answer becomes the next turn's history, :func:`~peagle_train.evaluate.prompts.history_message`)
            are used.
        progress: called with each decoding step's new tokens, of the plain decoding and of speculative
            decoding, and at a turn's end with both decodings' unused ``max_new_tokens``: a bar of total
            ``2 * max_new_tokens * turns`` tokens (:func:`progress_total`) advances within a turn.
        truncation: at T > 0, the top-k / top-p of the verifier's distribution, both decodings
            (:func:`~peagle_train.generate.speculative.served_truncation`); ``sampling`` its record for the report.
        recurrent_layers: the verifier's layers with a recurrent state
            (:func:`~peagle_train.generate.verifier.config_recurrent_layers`; a hybrid's cost model is skipped).

    Returns:
        The report (see :func:`run_online_eval`).

    Raises:
        InputError: the drafter does not match the verifier; ``num_draft_tokens`` exceeds its ``num_depths``.
    """
    engine = PEAGLEInference.from_models(verifier, drafter, tokenizer, config.num_draft_tokens, tree_spec(config))
    K, eos = engine.K, engine.eos
    variables = config.mode_variables()
    modes = prompt_modes(prompts, config.chat_template_kwargs, variables, config.seed)
    if config.warmup:
        engine.warm_up(render_turn(tokenizer, prompts[0], 0, [], modes[0]))
    totals = _OnlineTotals(K)
    per_prompt: list[dict[str, Any]] = []
    checks: list[tuple[str, dict[str, Any]]] = []
    start = time.perf_counter()
    T = config.temperature
    dtype = next(verifier.parameters()).dtype
    tops = dtype_name(dtype) not in EXACT_DTYPES  # the near-tie rule needs the reference's top logits
    for prompt, mode in zip(prompts, modes):
        answers: list[dict[str, Any]] = []
        for turn in range(len(prompt.user_turns)):
            ids = render_turn(tokenizer, prompt, turn, answers, mode)
            seed = _turn_seed(config.seed, len(per_prompt))
            spec, base = engine.generate_ids(ids, config.online_max_new_tokens(), T, seed=seed, measure_speedup=True,
                                             on_progress=progress, top_logits=tops,
                                             draft_sample_method=config.draft_sample_method,
                                             truncation=truncation)
            check = None  # samples differ by design at T > 0
            if T == 0:
                check = compare_to_greedy(spec.tokens, base.tokens, base.top_logits if tops else None, dtype)
                checks.append((prompt.prompt_id, check))
            totals.add(base, spec)
            per_prompt.append(_turn_record(tokenizer, prompt, turn, len(ids), base, spec, check, eos, mode))
            if turn + 1 < len(prompt.user_turns):  # the answer as served becomes the next turn's history
                answers.append(history_message(tokenizer, base.tokens, eos, config.reasoning_parser, mode,
                                               where=f"prompt {prompt.prompt_id!r} turn {turn}"))
            if progress is not None:  # a turn that stopped early (EOS) completes its share of the total
                progress(2 * config.online_max_new_tokens() - len(base.tokens) - len(spec.tokens))
    wall_time_s = time.perf_counter() - start
    report = totals.report()
    identity = greedy_check_summary(dtype, checks) if T == 0 else {
        "identical_to_greedy": None, "near_tie_divergences": None, "near_tie_prompts": [], "mismatches": [],
        "greedy_check": None}
    return {
        **report,
        **identity,
        "temperature": T,
        "sampling": sampling or {"top_k": truncation.top_k, "top_p": truncation.top_p},
        "seed": config.seed if T > 0 else None,
        "draft_sample_method": config.draft_sample_method if T > 0 else None,
        "acceptance_scheme": acceptance_scheme(T, config.draft_sample_method),
        "wall_time_s": wall_time_s,
        "num_prompts": len(prompts),
        "num_turns": len(per_prompt),
        "max_new_tokens": config.online_max_new_tokens(),
        "tree": engine.tree.describe() if engine.tree is not None else None,
        **({"tree_nodes_verified": sum(t["tree_nodes"] for t in per_prompt)} if engine.tree is not None else {}),
        **({"cost_model": online_cost_model(verifier, drafter, render_turn(tokenizer, prompts[0], 0, [], modes[0]),
                                            report, config, recurrent_layers)}
           if config.costs_measured(online_peagle=True) else {}),
        **({"per_mode": per_mode_report(per_prompt)} if variables else {}),
        "per_prompt": per_prompt,
    }


def run_online_eval(drafter_dir: str | Path, verifier_name: str | None, prompts_file: str | Path,
                    max_new_tokens: int = 128, num_prompts: int | None = None,
                    num_draft_tokens: int | None = None, output: str | Path | None = None,
                    progress_factory: Callable[[int], Any] | None = None, temperature: float = 0.0,
                    seed: int = 0, measure_costs: bool | None = True, tree_topk: list[int] | None = None,
                    tree_nodes: int | None = None, draft_sample_method: str = "greedy",
                    chat_template_kwargs: dict[str, Any] | None = None,
                    reasoning_parser: str | None = None, mixture: dict[str, Any] | None = None,
                    top_k: int | None = None, top_p: float | None = None) -> dict[str, Any]:
    """Online evaluation of a drafter checkpoint on a prompts file (docs/design.md §9).

    Args:
        drafter_dir: a checkpoint written by ``peagle_train.model.checkpoint.save_drafter``.
        verifier_name: MODEL (``smollm2-135m``, a directory, a hub id); None = the verifier named in
            the drafter's config.
        prompts_file: MT-Bench or OpenAI-messages JSONL (see :func:`read_prompts`).
        max_new_tokens, num_prompts, num_draft_tokens, temperature, seed, measure_costs, tree_topk, tree_nodes,
            draft_sample_method, chat_template_kwargs, reasoning_parser, top_k, top_p:
            see :class:`EvalConfig` (here chat_template_kwargs None: none, the template's defaults; top_k / top_p
            None: the verifier's generation_config.json values, as vLLM serves them; recorded as ``sampling``).
        mixture: the mode mixture, :class:`EvalConfig`'s ``reasoning_effort``, ``enable_thinking`` and
            ``template_mixture`` by name (None: every prompt in the fixed mode).
        output: also write the JSON report there.
        progress_factory: ``total -> bar`` with ``update(n)`` and ``close()`` (:func:`runtime.progress.progress`):
            its total is in tokens (:func:`progress_total`), so it advances within a turn.

    Returns:
        A dict with ``acceptance_length``, ``acceptance_rate``, ``per_position_acceptance`` (K
        fractions), ``drafted``, ``accepted``, ``identical_to_greedy`` (None at T > 0), ``mismatches`` (prompt
        ids that differ from greedy decoding other than at a near tie), ``near_tie_divergences`` /
        ``near_tie_prompts`` / ``greedy_check`` (:func:`greedy_check_summary`), ``draft_sample_method`` (T > 0)
        and ``acceptance_scheme``,
        ``tokens_per_second``, ``baseline_tokens_per_second``, ``speedup``, ``wall_time_s``,
        ``num_prompts``, ``per_prompt`` (per turn: counts, ``user``, the speculative ``text`` and the
        plain decoding's ``reference_text``), with ``measure_costs`` the ``cost_model``
        (:func:`online_cost_model`), and the run's inputs.

    Raises:
        InputError: bad prompts file or options, or a drafter that does not match the verifier.
        StoreMismatchError: a verifier of another tokenizer than the drafter's training data.
        StoreFormatError: not a drafter checkpoint. ModelNotFoundError: unknown verifier.
    """
    config = EvalConfig(max_new_tokens=max_new_tokens, num_prompts=num_prompts, num_draft_tokens=num_draft_tokens,
                        temperature=temperature, seed=seed, measure_costs=measure_costs, tree_topk=tree_topk,
                        tree_nodes=tree_nodes, draft_sample_method=draft_sample_method,
                        chat_template_kwargs=dict(chat_template_kwargs or {}), reasoning_parser=reasoning_parser,
                        top_k=top_k, top_p=top_p, **(mixture or {}))
    prompts = read_prompts(prompts_file, config.num_prompts)
    drafter = load_drafter_of_kind(drafter_dir)
    name = verifier_name or drafter.config.verifier_name_or_path
    if not name:
        raise InputError("the drafter's config names no verifier; pass one", field="--verifier")
    recurrent = config_recurrent_layers(check_verifier_config(name, drafter))  # before the weights load
    if config.tree_topk is not None or config.tree_nodes is not None:
        check_tree_verifier(name)
    check_drafter_tokenizer(drafter_dir, model_files(name))
    truncation, sampling = served_truncation(name, config.top_k, config.top_p)
    verifier, drafter = load_for_decoding(drafter, name)
    report = online_report(verifier, drafter, name, prompts, config, truncation, sampling, progress_factory,
                           recurrent_layers=recurrent)
    report = {"drafter": str(drafter_dir), "verifier": str(name), "prompts": str(prompts_file), **report}
    if output is not None:
        write_json(report, output)
    return report


def online_report(verifier, drafter, name: str, prompts: Sequence[Prompt], config: EvalConfig, truncation: Truncation,
                  sampling: dict[str, Any], progress_factory: Callable[[int], Any] | None = None, *,
                  recurrent_layers: Sequence[int]) -> dict[str, Any]:
    """:func:`evaluate_prompts` of verifier MODEL ``name`` and the ``drafter``, both loaded for decoding
    (:func:`~peagle_train.generate.inference.load_for_decoding`, after the checks that need no weights), on the
    read ``prompts``: loads the verifier's tokenizer, then decodes with ``truncation`` (``sampling``: where its
    top-k / top-p came from, :func:`served_truncation`; ``recurrent_layers``: the verifier's, from its config)."""
    tokenizer = load_tokenizer(name)
    bar = progress_factory(progress_total(prompts, config.online_max_new_tokens())) if progress_factory else None
    try:
        return evaluate_prompts(verifier, drafter, tokenizer, prompts, config,
                                progress=bar.update if bar is not None else None, truncation=truncation,
                                sampling=sampling, recurrent_layers=recurrent_layers)
    finally:
        if bar is not None:
            bar.close()
