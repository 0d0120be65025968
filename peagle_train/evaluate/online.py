"""Online evaluation: plain vs speculative decoding on prompts, counted as vLLM reports (docs/design.md §9)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peagle_train.evaluate.checks import check_drafter_tokenizer, check_verifier_config
from peagle_train.evaluate.config import EvalConfig
from peagle_train.evaluate.cost_model import cost_model_report, measure_step_costs
from peagle_train.evaluate.identity import EXACT_DTYPES, TIE_ULPS, compare_to_greedy, dtype_name
from peagle_train.evaluate.prompts import Prompt, eos_ids, read_prompts, render_turn
from peagle_train.evaluate.report import write_json
from peagle_train.evaluate.speculative import (
    GenerationResult,
    acceptance_scheme,
    check_compatible,
    checked_num_draft_tokens,
    greedy_generate,
    plain_generate,
    speculative_generate,
)
from peagle_train.model.checkpoint import load_drafter
from stores.errors import InputError
from stores.model_cache import load_tokenizer, load_verifier


def _turn_generator(seed: int, turn_index: int) -> torch.Generator:
    """The sampling randomness of one prompt turn: a function of ``(seed, turn_index)`` only."""
    return torch.Generator().manual_seed(seed * 1_000_003 + turn_index)


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


def answer_text(tokenizer, tokens: Sequence[int], eos: Iterable[int]) -> str:
    """The text of generated ``tokens`` without EOS ids and special tokens, not cleaned up (it is
    rendered into the next turn's prompt and re-tokenized: ``x != y`` must stay ``x != y``)."""
    eos = set(eos)
    return tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True,
                            clean_up_tokenization_spaces=False)


def turn_text(tokenizer, tokens: Sequence[int], eos: Iterable[int]) -> str:
    """A generated turn's text: its tokens decoded with special tokens kept (a template token in the
    output stays visible), without the EOS that ends the turn (``finish_reason`` says it was there)."""
    cut = list(tokens[:-1]) if tokens and tokens[-1] in set(eos) else list(tokens)
    return tokenizer.decode(cut, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def greedy_check_summary(dtype, checks: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The top-level identity keys of a T = 0 report from each turn's ``(prompt id,``
    :func:`~peagle_train.evaluate.identity.compare_to_greedy` ``result)``.

    Returns:
        ``identical_to_greedy`` (every turn token for token), ``near_tie_divergences`` (turns that differ
        at a near tie only, accepted), ``near_tie_prompts``, ``mismatches`` (prompt ids with any other
        difference: ``peagle-eval`` exits 1), ``greedy_check`` (the dtype and the rule applied).
    """
    name = dtype_name(dtype)
    mismatches = list(dict.fromkeys(pid for pid, c in checks if not c["consistent"]))
    near = [(pid, c) for pid, c in checks if c["consistent"] and not c["identical"]]
    rule = ("exact: every token equal" if name in EXACT_DTYPES else
            "exact, but a turn's first difference is accepted (a near-tie divergence) where the reference's logit "
            f"of the speculative token is below its top logit z1 by at most {TIE_ULPS} ulps of {name} at |z1| "
            "(peagle_train/evaluate/identity.py)")
    return {"identical_to_greedy": all(c["identical"] for _, c in checks), "near_tie_divergences": len(near),
            "near_tie_prompts": list(dict.fromkeys(pid for pid, _ in near)), "mismatches": mismatches,
            "greedy_check": {"dtype": name, "rule": rule}}


def _turn_record(tokenizer, prompt: Prompt, turn: int, prompt_tokens: int, base: GenerationResult,
                 spec: GenerationResult, check: dict[str, Any] | None, eos: Iterable[int]) -> dict[str, Any]:
    """One ``per_prompt`` entry: counts, the user turn, the speculative output (``text``) and the
    plain decoding's (``reference_text``: greedy at T = 0, a plain sample at T > 0), each without the
    EOS that ends it (:func:`turn_text`), ``finish_reason`` (``stop``: it ended with an EOS;
    ``length``: at ``max_new_tokens``), and at T = 0 the identity ``check``
    (:func:`~peagle_train.evaluate.identity.compare_to_greedy`: ``identical_to_greedy``, ``divergence``)."""
    eos = set(eos)
    return {
        "prompt_id": prompt.prompt_id, "turn": turn, "prompt_tokens": prompt_tokens,
        "new_tokens": len(base.tokens), "spec_new_tokens": len(spec.tokens),
        "verifier_steps": spec.verifier_steps, "accepted": spec.accepted, "drafted": spec.drafted,
        "identical_to_greedy": None if check is None else check["identical"],
        "divergence": None if check is None else check["divergence"],
        "user": prompt.user_turns[turn],
        "text": turn_text(tokenizer, spec.tokens, eos),
        "reference_text": turn_text(tokenizer, base.tokens, eos),
        "finish_reason": "stop" if spec.tokens and spec.tokens[-1] in eos else "length",
    }


def evaluate_prompts(verifier, drafter, tokenizer, prompts: Sequence[Prompt], config: EvalConfig,
                     progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Greedy baseline and speculative decoding on every turn of ``prompts``; compare and measure.

    Args:
        verifier: a transformers causal LM (batch 1, any device).
        drafter: a ``PEagleDrafter`` for ``verifier``, on the verifier's device.
        tokenizer: the verifier's tokenizer (with a chat template).
        prompts: from :func:`read_prompts`.
        config: ``max_new_tokens``, ``num_draft_tokens``, ``temperature``, ``seed``, ``draft_sample_method``,
            ``warmup``, ``measure_costs`` are used.
        progress: called with 1 after each prompt turn.

    Returns:
        The report (see :func:`run_online_eval`).

    Raises:
        InputError: the drafter does not match the verifier; ``num_draft_tokens`` exceeds its ``num_depths``.
    """
    check_compatible(verifier, drafter)
    K = checked_num_draft_tokens(config.num_draft_tokens, drafter)
    eos = eos_ids(tokenizer, verifier)
    if config.warmup:
        warm = render_turn(tokenizer, prompts[0], 0, [])
        greedy_generate(verifier, warm, 2, eos)
        speculative_generate(verifier, drafter, warm, 2, K, eos)
    totals = _OnlineTotals(K)
    per_prompt: list[dict[str, Any]] = []
    checks: list[tuple[str, dict[str, Any]]] = []
    start = time.perf_counter()
    T = config.temperature
    dtype = next(verifier.parameters()).dtype
    tops = dtype_name(dtype) not in EXACT_DTYPES  # the near-tie rule needs the reference's top logits
    for prompt in prompts:
        answers: list[str] = []
        for turn in range(len(prompt.user_turns)):
            ids = render_turn(tokenizer, prompt, turn, answers)
            gens = [_turn_generator(config.seed, len(per_prompt)) if T > 0 else None for _ in range(2)]
            base = plain_generate(verifier, ids, config.max_new_tokens, eos, T, gens[0], top_logits=tops)
            spec = speculative_generate(verifier, drafter, ids, config.max_new_tokens, K, eos, T, gens[1],
                                        draft_sample_method=config.draft_sample_method)
            totals.add(base, spec)
            check = None  # samples differ by design at T > 0
            if T == 0:
                check = compare_to_greedy(spec.tokens, base.tokens, base.top_logits if tops else None, dtype)
                checks.append((prompt.prompt_id, check))
            per_prompt.append(_turn_record(tokenizer, prompt, turn, len(ids), base, spec, check, eos))
            answers.append(answer_text(tokenizer, base.tokens, eos))
            if progress is not None:
                progress(1)
    wall_time_s = time.perf_counter() - start
    report = totals.report()
    identity = greedy_check_summary(dtype, checks) if T == 0 else {
        "identical_to_greedy": None, "near_tie_divergences": None, "near_tie_prompts": [], "mismatches": [],
        "greedy_check": None}
    return {
        **report,
        **identity,
        "temperature": T,
        "seed": config.seed if T > 0 else None,
        "draft_sample_method": config.draft_sample_method if T > 0 else None,
        "acceptance_scheme": acceptance_scheme(T, config.draft_sample_method),
        "wall_time_s": wall_time_s,
        "num_prompts": len(prompts),
        "num_turns": len(per_prompt),
        "max_new_tokens": config.max_new_tokens,
        **({"cost_model": online_cost_model(verifier, drafter, render_turn(tokenizer, prompts[0], 0, []), report,
                                            config)} if config.measure_costs else {}),
        "per_prompt": per_prompt,
    }


def online_cost_model(verifier, drafter, context_ids: Sequence[int], online: dict[str, Any],
                      config: EvalConfig) -> dict[str, Any]:
    """The ``cost_model`` of an online report (:mod:`.cost_model`): the steps timed with a KV cache of
    ``context_ids`` (the first prompt turn) for K = 1..num_depths, the acceptance of ``online``'s counts;
    ``{"skipped": reason}`` at temperature > 0 (the model is greedy verification's) or with no scored draft."""
    if config.temperature > 0:
        return {"skipped": f"temperature {config.temperature}: the cost model predicts greedy decoding; run at "
                           "--temperature 0 for the table"}
    if not online["num_drafts"]:
        return {"skipped": "no verifier step checked a draft: no acceptance to predict from"}
    costs = measure_step_costs(verifier, drafter, context_ids, int(drafter.config.num_depths), config.cost_rounds)
    return cost_model_report(costs, online)


def load_for_decoding(drafter, verifier_name: str):
    """The verifier, and ``drafter`` (a loaded ``PEagleDrafter``) moved to it, as online decoding runs them:
    float32, on the verifier's device. float32
    everywhere: a K+1-token verify pass and one-token decoding then agree to ~1e-6, so near-ties cannot flip
    an argmax the way they do in bf16. The caller runs the checks first (:func:`run_online_eval`).

    Returns:
        ``(verifier, drafter)``.
    """
    verifier = load_verifier(verifier_name, dtype=torch.float32)
    return verifier, drafter.eval().to(next(verifier.parameters()).device, torch.float32)


def run_online_eval(drafter_dir: str | Path, verifier_name: str | None, prompts_file: str | Path,
                    max_new_tokens: int = 128, num_prompts: int | None = None,
                    num_draft_tokens: int | None = None, output: str | Path | None = None,
                    progress_factory: Callable[[int], Any] | None = None, temperature: float = 0.0,
                    seed: int = 0, measure_costs: bool = True, draft_sample_method: str = "greedy") -> dict[str, Any]:
    """Online evaluation of a drafter checkpoint on a prompts file (docs/design.md §9).

    Args:
        drafter_dir: a checkpoint written by ``peagle_train.model.checkpoint.save_drafter``.
        verifier_name: MODEL (``smollm2-135m``, a directory, a hub id); None = the verifier named in
            the drafter's config.
        prompts_file: MT-Bench or OpenAI-messages JSONL (see :func:`read_prompts`).
        max_new_tokens, num_prompts, num_draft_tokens, temperature, seed, measure_costs, draft_sample_method:
            see :class:`EvalConfig`.
        output: also write the JSON report there.
        progress_factory: ``total -> bar`` with ``update(n)`` and ``close()`` (e.g. ``tqdm``).

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
                        temperature=temperature, seed=seed, measure_costs=measure_costs,
                        draft_sample_method=draft_sample_method)
    prompts = read_prompts(prompts_file, config.num_prompts)
    drafter = load_drafter(drafter_dir)
    name = verifier_name or drafter.config.verifier_name_or_path
    if not name:
        raise InputError("the drafter's config names no verifier; pass one", field="--verifier")
    check_verifier_config(name, drafter)  # before the weights load
    check_drafter_tokenizer(drafter_dir, name)
    verifier, drafter = load_for_decoding(drafter, name)
    tokenizer = load_tokenizer(name)
    bar = progress_factory(sum(len(p.user_turns) for p in prompts)) if progress_factory else None
    try:
        report = evaluate_prompts(verifier, drafter, tokenizer, prompts, config,
                                  progress=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    report = {"drafter": str(drafter_dir), "verifier": str(name), "prompts": str(prompts_file), **report}
    if output is not None:
        write_json(report, output)
    return report
