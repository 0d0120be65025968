"""K from measured costs: the expected speedup of speculative decoding for every K ≤ num_depths and the
best K, from the acceptance ``peagle-eval`` measured and the costs of one step timed on this machine
(docs/design.md §9, issue 23).

Legend: K drafts per verifier step, P context tokens in the KV cache, s_i the share of verifier steps that
accept draft i (position i = 0..K-1), t_v(n) the verifier's pass over n tokens, t_d(K) one drafter pass
drafting K tokens.

The model (Leviathan et al., 2023, arXiv:2211.17192, §3.1 and §3.4; P-EAGLE, arXiv:2602.01469, parallel
drafting). Under greedy verification a step keeps the longest prefix of its K drafts that equals the
verifier's argmax, then emits the verifier's own next token (the bonus token). With ``A`` the drafts a step
keeps, it emits ``A + 1`` tokens, and since a draft is kept only when every draft before it is,
``A = Σ_{i<K} [draft i kept]``, so the expected tokens per verifier step are

    E[AL](K) = 1 + Σ_{i<K} P(draft i kept) = 1 + Σ_{i<K} s_i.

(Leviathan et al.'s ``(1 - α^{K+1}) / (1 - α)`` is this sum when every ``s_i = α^{i+1}``; here ``s_i`` is
measured per position.) One step costs one drafter pass (P-EAGLE drafts all K tokens in ONE pass; EAGLE-3's
autoregressive drafter would cost K passes) and one verifier pass over ``K + 1`` tokens (the last emitted
token and the K drafts), while greedy decoding emits one token per one-token pass. Tokens per second of
speculative over greedy decoding are therefore

    speedup(K) = E[AL](K) · t_v(1) / (t_v(K + 1) + t_d(K)),

Leviathan et al.'s walltime improvement ``(1 - α^{K+1}) / ((1 - α)(Kc + 1))`` with their two
simplifications replaced by measurements: the verifier's pass over ``K + 1`` tokens is not assumed to cost
the same as over one (on a CPU it costs about twice as much for K = 4), and the draft cost is one parallel
pass ``t_d(K)``, not ``K`` times ``c · t_v(1)``. The best K maximises ``speedup(K)``; when no K reaches 1,
greedy decoding is faster (``faster_than_greedy`` false).

Assumptions, stated in every report (``assumptions``):
- greedy decoding (temperature 0): the acceptance rule above; speculative sampling keeps drafts with
  another rule;
- the drafts at positions ``0..K-1`` are the same for every K (true of a P-EAGLE drafter: a depth-d
  element attends only to depths < d of its chain), so ``s_i`` measured with K drafts is taken as the
  acceptance at position i for every smaller K. The verifier steps land on other tokens when K changes, so
  this holds on average, not step for step;
- costs are medians of the step's parts timed with a KV cache of ``P`` tokens (a real prompt), on this
  machine and these threads; the prefill of each prompt (paid by both decoders), the drafter's pass over the
  prompt and the acceptance bookkeeping (< 0.5% of a step, docs/benchmarks.md) are not counted, so the
  prediction is of decoding steps, not of a whole generation's wall time;
- the costs are those of peagle's own speculative decoder (transformers, :mod:`.speculative`), not of vLLM,
  whose kernels, batching and scheduling cost otherwise.

Trust (issue 34): timings taken on a loaded machine can be noise (verifying 5 tokens measured cheaper than
verifying 2). Every timing has its spread (interquartile range / median over the rounds) and the machine's
1-minute load average before and after (``os.getloadavg``, beside the CPUs this process may use).
:func:`cost_problems` refuses a measurement whose verifier cost falls as K grows (a pass over more tokens
cannot cost less; :data:`MONOTONE_TOLERANCE`) or whose spread exceeds :data:`SPREAD_LIMIT`;
:func:`measure_trusted_costs` then measures once more, and when the problems remain the report recommends
no K (``recommended_K`` None, ``not_recommended`` the reasons) and leaves ``best_K`` unset. A load average
above the CPUs, or a prediction far from the run's measured speedup, is a warning (``warnings``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from peagle_train.evaluate.config import EvalConfig
from peagle_train.generate.inference import load_for_decoding
from peagle_train.generate.speculative import aux_features, drafter_session, propose_drafts
from peagle_train.generate.verifier import (aux_hidden_states, config_recurrent_layers, crop_cache, new_cache,
                                            rollback_cache, verifier_body_pass, verifier_pass)
from peagle_train.train.kinds import DrafterKind
from stores.errors import InputError
from runtime.progress import progress

__all__ = ["ASSUMPTIONS", "MONOTONE_TOLERANCE", "SPREAD_LIMIT", "PREDICTION_TOLERANCE", "StepCosts",
           "measure_step_costs", "measure_trusted_costs", "cost_problems", "load_average", "usable_cpus",
           "first_prompt_ids", "acceptance_shares", "expected_acceptance_length", "predict_speedups",
           "cost_model_report", "format_cost_model", "timing_notice", "HYBRID_COSTS_SKIPPED", "online_cost_model",
           "offline_cost_model"]

HYBRID_COSTS_SKIPPED = (
    "hybrid verifier (recurrent layers): its steps record per-token states or, where transformers cannot, feed "
    "the kept tokens again after a rejected draft (docs/design.md §9, \"Hybrid verifiers\"), costs the timed "
    "t_v(K + 1) does not hold; the online run's measured speedup counts them")
"""Why the cost model is not applied to a verifier with recurrent layers (:func:`measure_step_costs` refuses one)."""

MONOTONE_TOLERANCE = 0.10
"""A verifier pass over more tokens measured more than this fraction cheaper than one over fewer is noise."""
SPREAD_LIMIT = 0.25
"""A timing whose interquartile range exceeds this fraction of its median is noise."""
PREDICTION_TOLERANCE = 1.5
"""A predicted speedup more than this factor away from the run's measured one (either way) is warned about."""

ASSUMPTIONS = [
    "greedy verification (temperature 0)",
    "the acceptance of draft position i is the one measured with the run's K drafts, for every K >= i + 1 "
    "(a P-EAGLE drafter drafts position i the same whatever K)",
    "costs: medians of timed decoding steps with a KV cache of a real prompt on this machine, of peagle's own "
    "speculative decoder (transformers), not of vLLM; the prefill and the drafter's pass over the prompt are "
    "not counted",
]


@dataclass(frozen=True)
class StepCosts:
    """The measured costs of one decoding step, in seconds (medians over ``rounds``).

    ``verify_s[K - 1]`` and ``draft_s[K - 1]`` are the costs at K drafts, for K = 1..len(verify_s).
    """

    verify_1_s: float
    """A greedy step: the verifier's pass over 1 token with its lm_head row (plain decoding)."""
    verify_s: list[float]
    """``[K_max]``: the verifier's pass over K + 1 tokens with its K + 1 lm_head rows and the KV-cache cut-back."""
    draft_s: list[float]
    """``[K_max]``: one drafter pass adding one depth-0 element and drafting K tokens, with the proposal
    (argmax, draft-to-verifier ids)."""
    context_tokens: int
    """P: the tokens in the verifier's KV cache (a real prompt) when the steps are timed."""
    rounds: int
    """Timed rounds (one of each pass per round, interleaved), after ``warmup_rounds`` untimed ones."""
    warmup_rounds: int
    threads: int
    """``torch.get_num_threads()`` during the timing."""
    device: str
    verify_1_spread: float = 0.0
    """Spread of ``verify_1_s``: the interquartile range over the rounds / the median (0 with < 2 rounds)."""
    verify_spread: list[float] = field(default_factory=list)
    """``[K_max]``: spread of ``verify_s`` (as ``verify_1_spread``)."""
    draft_spread: list[float] = field(default_factory=list)
    """``[K_max]``: spread of ``draft_s`` (as ``verify_1_spread``)."""
    load_average: list[float] = field(default_factory=list)
    """The machine's 1-minute load average before and after the timing (``os.getloadavg``); empty when unknown."""
    cpus: int = 0
    """The CPUs this process may run on (``os.sched_getaffinity``)."""
    attempts: int = 1
    """Measurements taken (:func:`measure_trusted_costs` measures again when the first is noise)."""


def load_average() -> float | None:
    """The machine's 1-minute load average (``os.getloadavg()[0]``), None where the OS has none."""
    try:
        return float(os.getloadavg()[0])
    except (AttributeError, OSError):
        return None


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _spread(times: Sequence[float]) -> float:
    """Interquartile range / median of ``times`` (0 with fewer than 2)."""
    if len(times) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    median = statistics.median(times)
    return (q3 - q1) / median if median > 0 else 0.0

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_step_costs(verifier, drafter, context_ids: Sequence[int] | torch.Tensor, max_draft_tokens: int,
                       rounds: int = 15, warmup_rounds: int = 2,
                       on_round: Callable[[], None] | None = None) -> StepCosts:
    """Time a greedy step and, for every K = 1..``max_draft_tokens``, a speculative step's drafter pass and
    verifier pass, as :func:`~peagle_train.generate.speculative.speculative_generate` runs them.

    After a prefill of ``context_ids`` (P tokens) each round times, interleaved so that a change of load
    hits all of them alike: one greedy one-token pass (``verifier_pass`` with the plain KV cache, which
    then holds one more token, as decoding does), and for each K one drafter pass (one new depth-0 element,
    K drafts, their proposal) and one verifier pass over K + 1 tokens (``verifier_body_pass`` with the
    rollback cache, the aux-feature hook on, then the cache cut back to P tokens). Token ids do not change
    a dense model's cost; the context is a real prompt so that a mixture-of-experts verifier routes as it
    does when decoding.

    Args:
        verifier: a transformers causal LM (batch 1), as online decoding runs it (dtype, device).
        drafter: a ``PEagleDrafter`` for ``verifier`` on its device.
        context_ids: ``[P]`` int token ids, P ≥ 1: the KV cache the passes read.
        max_draft_tokens: the largest K timed (≥ 1).
        rounds: timed rounds (≥ 1); the medians are reported.
        warmup_rounds: untimed rounds first (one-time allocations, kernel selection).
        on_round: called after each round, warm-up ones included (a progress bar's update).

    Returns:
        :class:`StepCosts`.

    Raises:
        InputError: an empty context, ``max_draft_tokens < 1`` or ``rounds < 1``; a verifier with recurrent
            layers (:data:`HYBRID_COSTS_SKIPPED`).
    """
    ids = torch.as_tensor(context_ids, dtype=torch.long).flatten().cpu()
    if ids.numel() == 0:
        raise InputError("the context for timing the decoding steps is empty (0 tokens)")
    if config_recurrent_layers(verifier.config):
        raise InputError(HYBRID_COSTS_SKIPPED + "; skip the cost model (--no-measure-costs)", field="--measure-costs")
    if max_draft_tokens < 1 or rounds < 1 or warmup_rounds < 0:
        raise InputError(f"cost timing needs max_draft_tokens >= 1, rounds >= 1, warmup_rounds >= 0; got "
                         f"{max_draft_tokens}, {rounds}, {warmup_rounds}")
    device = next(verifier.parameters()).device
    vocab = verifier.config.get_text_config().vocab_size
    layers = drafter.config.aux_layer_ids
    P = ids.numel()
    load_before = load_average()
    greedy_cache = new_cache(verifier)
    logits, _ = verifier_pass(verifier, ids, greedy_cache, want_hidden=False, last_only=True)
    last = int(logits[-1].argmax())
    t_greedy: list[float] = []
    t_verify: list[list[float]] = [[] for _ in range(max_draft_tokens)]
    t_draft: list[list[float]] = [[] for _ in range(max_draft_tokens)]
    with aux_hidden_states(verifier) as hook:
        cache = rollback_cache(verifier)
        _, hs = verifier_pass(verifier, ids, cache, want_hidden=True, last_only=True)
        aux = aux_features(hs, hook, layers)  # [P, L*H]: g_0..g_{P-1}
        # one session per K, of the drafter's kind (a DFlash block of K + 1 drafts K), each past the prompt
        sessions = [drafter_session(drafter, K) for K in range(1, max_draft_tokens + 1)]
        for session in sessions:
            session.draft(torch.cat([ids[1:], torch.tensor([last])]), aux, 1)  # the drafter's pass over the prompt
        one_aux = aux[-1:]  # [1, L*H]: the feature of each new depth-0 element (its values cost nothing)
        for r in range(warmup_rounds + rounds):
            timed = r >= warmup_rounds
            _sync(device)
            t0 = time.perf_counter()
            logits, _ = verifier_pass(verifier, torch.tensor([last]), greedy_cache, want_hidden=False)
            last = int(logits[-1].argmax())
            if timed:
                t_greedy.append(time.perf_counter() - t0)
            for K in range(1, max_draft_tokens + 1):
                _sync(device)
                t0 = time.perf_counter()
                draft_logits = sessions[K - 1].draft(torch.tensor([last]), one_aux, K)  # [K, D]
                drafts, _ = propose_drafts(draft_logits, drafter.draft_ids, vocab, 0.0, None)  # [K]
                _sync(device)
                t1 = time.perf_counter()
                out, hs = verifier_body_pass(verifier, torch.cat([torch.tensor([last]), drafts]), cache)  # [K+1, V]
                aux_features(hs, hook, layers)
                crop_cache(cache, P)
                _sync(device)
                t2 = time.perf_counter()
                if timed:
                    t_draft[K - 1].append(t1 - t0)
                    t_verify[K - 1].append(t2 - t1)
            if on_round is not None:
                on_round()
    load_after = load_average()
    return StepCosts(verify_1_s=statistics.median(t_greedy), verify_s=[statistics.median(t) for t in t_verify],
                     draft_s=[statistics.median(t) for t in t_draft], context_tokens=P, rounds=rounds,
                     warmup_rounds=warmup_rounds, threads=torch.get_num_threads(), device=str(device),
                     verify_1_spread=_spread(t_greedy), verify_spread=[_spread(t) for t in t_verify],
                     draft_spread=[_spread(t) for t in t_draft],
                     load_average=[x for x in (load_before, load_after) if x is not None], cpus=usable_cpus())


def cost_problems(costs: StepCosts) -> list[str]:
    """Why ``costs`` are noise rather than this machine's decoding costs (empty: none found).

    - a verifier pass over n + 1 tokens measured more than :data:`MONOTONE_TOLERANCE` cheaper than the most
      expensive pass over fewer tokens (t_v(1), t_v(2), ... must not fall: more tokens, more work);
    - a timing (t_v(1), any t_v(K+1) or t_d(K)) whose spread exceeds :data:`SPREAD_LIMIT`.
    """
    problems = []
    chain = [(1, costs.verify_1_s)] + [(K + 1, t) for K, t in enumerate(costs.verify_s, start=1)]
    dearest = chain[0]
    for n, t in chain[1:]:
        if t < dearest[1] * (1 - MONOTONE_TOLERANCE):
            problems.append(f"verifying {n} tokens measured {t * 1e3:.2f} ms, cheaper than verifying {dearest[0]} "
                            f"({dearest[1] * 1e3:.2f} ms)")
        if t > dearest[1]:
            dearest = (n, t)
    spreads = [("t_v(1)", costs.verify_1_spread)]
    spreads += [(f"t_v({K + 1})", x) for K, x in enumerate(costs.verify_spread, start=1)]
    spreads += [(f"t_d({K})", x) for K, x in enumerate(costs.draft_spread, start=1)]
    noisy = [f"{name} {x:.0%}" for name, x in spreads if x > SPREAD_LIMIT]
    if noisy:
        problems.append(f"timings spread more than {SPREAD_LIMIT:.0%} of their median over {costs.rounds} rounds "
                        f"(interquartile range): {', '.join(noisy)}")
    return problems


def measure_trusted_costs(verifier, drafter, context_ids: Sequence[int] | torch.Tensor, max_draft_tokens: int,
                          rounds: int = 15, warmup_rounds: int = 2, attempts: int = 2,
                          show_progress: bool = True) -> StepCosts:
    """:func:`measure_step_costs`, measured again (up to ``attempts`` times in all) while :func:`cost_problems`
    finds the timings to be noise; returns the last measurement, its ``attempts`` set (the report then
    states the problems that remain).

    With ``show_progress`` a line on stderr first says what is timed and how to skip it (:func:`timing_notice`),
    and each measurement has its progress there (:func:`runtime.progress.progress`: ``cost model timing: done:
    17/17 round in ...``, a line every 30 s when stderr is no terminal), since a measurement takes seconds on an
    idle machine and minutes on a loaded one."""
    if show_progress:
        print(timing_notice(max_draft_tokens, rounds, warmup_rounds), file=sys.stderr, flush=True)
    for attempt in range(1, attempts + 1):
        desc = "cost model timing" + (f" (again: attempt {attempt} of {attempts})" if attempt > 1 else "")
        with progress(total=warmup_rounds + rounds, desc=desc, unit="round", disable=not show_progress,
                      dynamic_ncols=True) as bar:
            costs = measure_step_costs(verifier, drafter, context_ids, max_draft_tokens, rounds, warmup_rounds,
                                       on_round=lambda: bar.update(1))
        if not cost_problems(costs):
            break
    return StepCosts(**{**asdict(costs), "attempts": attempt})


def timing_notice(max_draft_tokens: int, rounds: int, warmup_rounds: int) -> str:
    """The line ``peagle-eval`` prints before the cost timing: what it times, how long that can take (with the
    load average now) and the option that skips it."""
    load = load_average()
    now = f"; load {load:.1f} on {usable_cpus()} CPUs now" if load is not None else ""
    return (f"cost model: timing a greedy step and, for K = 1..{max_draft_tokens}, a drafter pass and a verifier "
            f"pass over K + 1 tokens on this machine, {warmup_rounds} + {rounds} rounds, to predict the speedup per "
            f"K (seconds on an idle machine, minutes on a loaded one{now}); --no-measure-costs skips it")


def first_prompt_ids(block) -> torch.Tensor:
    """A real prompt from a store block for :func:`measure_step_costs`: its first segment's tokens before
    the first supervised one (``loss_mask`` 1: the answer starts there), or the whole segment when it has
    none before it.

    Args:
        block: ``input_ids, loss_mask [T]``, ``cu_seqlens [S+1]`` (a ``FeatureStore.read_block`` result).

    Returns:
        ``[P] int64``, P ≥ 1.
    """
    start, end = int(block.cu_seqlens[0]), int(block.cu_seqlens[1])
    supervised = torch.nonzero(torch.as_tensor(block.loss_mask[start:end]) == 1).flatten()
    stop = start + int(supervised[0]) if supervised.numel() and int(supervised[0]) > 0 else end
    return torch.as_tensor(block.input_ids[start:stop], dtype=torch.long)


def acceptance_shares(report: dict[str, Any]) -> tuple[list[float], str]:
    """``(s [K], source)``: the share of verifier steps (online) or of scored anchors (offline) that kept
    draft i, from an online or an offline report's counts, so that ``1 + Σ s`` is the report's own AL.

    Online: ``per_position_accepted[i] / num_drafts`` (vLLM's rate: steps that checked at least one draft).
    Offline: ``per_position_accepted[i] / positions_scored`` (every chain of the held-out blocks).

    Raises:
        InputError: the report holds no acceptance counts, or no step / anchor was scored.
    """
    if "num_drafts" in report:
        steps, source = report["num_drafts"], "online"
    elif "positions_scored" in report:
        steps, source = report["positions_scored"], "offline"
    else:
        raise InputError("the report holds neither online (num_drafts) nor offline (positions_scored) acceptance "
                         "counts to predict the speedup from")
    if not steps:
        raise InputError(f"the {source} evaluation scored no draft (0 verifier steps or anchors): no acceptance "
                         "to predict the speedup from; give more prompts, longer generations or more blocks")
    return [a / steps for a in report["per_position_accepted"]], source


def expected_acceptance_length(shares: Sequence[float], K: int) -> float:
    """``E[AL](K) = 1 + Σ_{i<K} s_i``: expected tokens per verifier step with K drafts (module docstring)."""
    if not 1 <= K <= len(shares):
        raise InputError(f"K = {K} outside the {len(shares)} positions whose acceptance was measured")
    return 1.0 + float(sum(shares[:K]))


def predict_speedups(costs: StepCosts, shares: Sequence[float]) -> list[dict[str, float | int]]:
    """One row per K = 1..min(len(shares), len(costs.verify_s)): ``K``, ``expected_acceptance_length``,
    ``draft_ms`` (t_d(K)), ``verify_ms`` (t_v(K+1)), ``step_ms`` (their sum),
    ``break_even_acceptance_length`` (``step / t_v(1)``: the AL at which K drafts match greedy decoding, as
    docs/benchmarks.md's "break-even acceptance length"), ``expected_speedup`` (``E[AL](K) · t_v(1) /
    (t_v(K+1) + t_d(K))``, module docstring)."""
    rows = []
    for K in range(1, min(len(shares), len(costs.verify_s)) + 1):
        al = expected_acceptance_length(shares, K)
        step = costs.verify_s[K - 1] + costs.draft_s[K - 1]
        rows.append({"K": K, "expected_acceptance_length": al, "draft_ms": costs.draft_s[K - 1] * 1e3,
                     "verify_ms": costs.verify_s[K - 1] * 1e3, "step_ms": step * 1e3,
                     "break_even_acceptance_length": step / costs.verify_1_s,
                     "expected_speedup": al * costs.verify_1_s / step})
    return rows


def cost_model_report(costs: StepCosts, acceptance: dict[str, Any]) -> dict[str, Any]:
    """The ``cost_model`` entry of a ``peagle-eval`` report from the step costs and an online or offline
    report (its counts, :func:`acceptance_shares`).

    Returns:
        ``rows`` (:func:`predict_speedups`), ``recommended_K`` / ``best_K`` and ``best_expected_speedup`` (the
        row of the largest expected speedup), ``faster_than_greedy`` (that speedup > 1), all None with
        ``not_recommended`` (the reasons, :func:`cost_problems`) when the timings are noise;
        ``greedy_step_ms`` (t_v(1)), ``load_average`` (1-minute, before and after the timing) and ``cpus``,
        ``warnings`` (a load average above the CPUs; online, a prediction at the run's K more than
        :data:`PREDICTION_TOLERANCE` away from the measured ``speedup``), ``acceptance_source`` (``online`` /
        ``offline``), ``acceptance_shares`` (s_i), ``costs`` (:class:`StepCosts` as a dict), ``assumptions``
        and, when the acceptance was measured with fewer drafts than the costs were timed for, ``note`` (the
        larger K are not predicted).
    """
    shares, source = acceptance_shares(acceptance)
    rows = predict_speedups(costs, shares)
    best = max(rows, key=lambda row: row["expected_speedup"])
    problems = cost_problems(costs)
    trusted = not problems
    out = {"acceptance_source": source, "acceptance_shares": shares, "greedy_step_ms": costs.verify_1_s * 1e3,
           "load_average": list(costs.load_average), "cpus": costs.cpus,
           "rows": rows, "recommended_K": best["K"] if trusted else None,
           "best_K": best["K"] if trusted else None,
           "best_expected_speedup": best["expected_speedup"] if trusted else None,
           "faster_than_greedy": best["expected_speedup"] > 1.0 if trusted else None,
           "warnings": _warnings(costs, rows, acceptance, source),
           "costs": asdict(costs), "assumptions": list(ASSUMPTIONS)}
    if problems:
        out["not_recommended"] = (f"the step timings are noise ({'; '.join(problems)}; measured {costs.attempts} "
                                  f"times): no K is recommended; measure again on an idle machine")
    if len(shares) < len(costs.verify_s):
        out["note"] = (f"the acceptance was measured with K = {len(shares)} drafts: K = {len(shares) + 1}.."
                       f"{len(costs.verify_s)} are not predicted (run with --num-draft-tokens {len(costs.verify_s)})")
    return out


def _warnings(costs: StepCosts, rows: list[dict[str, Any]], acceptance: dict[str, Any], source: str) -> list[str]:
    """The report's ``warnings`` (:func:`cost_model_report`)."""
    out = []
    if costs.load_average and costs.cpus and max(costs.load_average) > costs.cpus:
        out.append(f"the load average ({_loads(costs.load_average)}) exceeds the {costs.cpus} CPUs: the timings are "
                   "of a shared machine, not of decoding alone")
    measured = acceptance.get("speedup") if source == "online" else None
    K = len(acceptance.get("per_position_accepted") or [])
    if measured and 1 <= K <= len(rows):
        predicted = rows[K - 1]["expected_speedup"]
        if not 1 / PREDICTION_TOLERANCE <= predicted / measured <= PREDICTION_TOLERANCE:
            out.append(f"at the run's K = {K} the table predicts a speedup of {predicted:.3f}, the run measured "
                       f"{measured:.3f}: the timings do not describe this run (load changed, or the prefill, "
                       "not counted, dominates short generations)")
    return out


def _loads(loads: Sequence[float]) -> str:
    return " -> ".join(f"{x:.2f}" for x in loads) if loads else "unknown"


def format_cost_model(cm: dict[str, Any]) -> list[str]:
    """The table of a ``cost_model`` entry, as ``peagle-eval`` prints it: the load average beside the timings,
    each timing's spread, the recommended K or why none is."""
    c = cm["costs"]
    spread = lambda xs, i: f"±{xs[i]:.0%}" if i < len(xs) else ""  # noqa: E731
    lines = [f"K from measured costs ({cm['acceptance_source']} acceptance; {c['device']}, {c['threads']} threads, "
             f"KV cache {c['context_tokens']} tokens, medians of {c['rounds']} rounds; load average "
             f"{_loads(c.get('load_average') or [])} on {c.get('cpus') or '?'} CPUs; greedy step "
             f"{cm['greedy_step_ms']:.2f} ms {spread([c.get('verify_1_spread', 0.0)], 0)})",
             "  K  expected AL  t_draft ms (spread)  t_verify(K+1) ms (spread)  break-even AL  expected speedup"]
    for r in cm["rows"]:
        i = r["K"] - 1
        lines.append(f"  {r['K']:<2d} {r['expected_acceptance_length']:>11.3f} {r['draft_ms']:>11.2f} "
                     f"{spread(c.get('draft_spread') or [], i):>8} {r['verify_ms']:>17.2f} "
                     f"{spread(c.get('verify_spread') or [], i):>9} {r['break_even_acceptance_length']:>14.3f} "
                     f"{r['expected_speedup']:>17.3f}")
    if cm.get("not_recommended"):
        lines.append(f"  no K recommended: {cm['not_recommended']}")
    else:
        verdict = "" if cm["faster_than_greedy"] else " (no K beats greedy decoding here)"
        lines.append(f"  best K {cm['best_K']}: expected speedup {cm['best_expected_speedup']:.3f}{verdict}")
    lines += [f"  warning: {w}" for w in cm.get("warnings") or []]
    if cm.get("note"):
        lines.append(f"  {cm['note']}")
    return lines


def online_cost_model(verifier, drafter, context_ids: Sequence[int], online: dict[str, Any], config: EvalConfig,
                      recurrent_layers: Sequence[int]) -> dict[str, Any]:
    """The ``cost_model`` of an online report: the steps timed with a KV cache of
    ``context_ids`` (the first prompt turn) for K = 1..num_depths, the acceptance of ``online``'s counts;
    ``{"skipped": reason}`` at temperature > 0 (the model is greedy verification's), with no scored draft, or for a
    verifier with ``recurrent_layers`` (a hybrid)."""
    if config.tree_topk is not None or config.tree_nodes is not None:
        return {"skipped": "tree verification: the cost model times chain steps (a verifier pass over K + 1 tokens); "
                           "bench/bench_tree.py times tree passes"}
    if config.temperature > 0:
        return {"skipped": f"temperature {config.temperature}: the cost model predicts greedy decoding; run at "
                           "--temperature 0 for the table"}
    if not online["num_drafts"]:
        return {"skipped": "no verifier step checked a draft: no acceptance to predict from"}
    if recurrent_layers:
        return {"skipped": HYBRID_COSTS_SKIPPED}
    costs = measure_trusted_costs(verifier, drafter, context_ids, int(drafter.config.num_depths), config.cost_rounds)
    return cost_model_report(costs, online)


def offline_cost_model(kind: DrafterKind, drafter_dir: str | os.PathLike, store, offline: dict[str, Any],
                       recurrent_layers: Sequence[int], rounds: int) -> dict[str, Any]:
    """The ``cost_model`` of an offline report ``offline`` (its all-anchor acceptance; no acceptance of peagle's
    own decoder was measured): the drafter of ``kind`` at ``drafter_dir`` and the report's verifier loaded for
    decoding, the steps timed ``rounds`` times with a KV cache of the first scored block's prompt of ``store``
    (:func:`first_prompt_ids`); ``{"skipped": reason}`` when no anchor was scored or the verifier has
    ``recurrent_layers`` (a hybrid)."""
    if "positions_scored" not in offline:
        return {"skipped": "the offline cost model predicts from the all-anchor acceptance: give --all-anchor"}
    if not offline["positions_scored"]:
        return {"skipped": "the offline evaluation scored no anchor: no acceptance to predict from"}
    if recurrent_layers:
        return {"skipped": HYBRID_COSTS_SKIPPED}
    context = first_prompt_ids(store.read_block(offline["blocks"][0]))
    # the verifier's config was checked before any weights (plan_eval); the timing needs no
    # tokenizer check: token ids do not change a step's cost
    verifier, loaded = load_for_decoding(kind.load(drafter_dir), offline["verifier"])
    return cost_model_report(measure_trusted_costs(verifier, loaded, context, int(loaded.config.num_depths), rounds),
                             offline)
