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
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from peagle_train.evaluate.speculative import DrafterSession, aux_features, propose_drafts
from peagle_train.evaluate.verifier import (aux_hidden_states, crop_cache, new_cache, rollback_cache,
                                            verifier_body_pass, verifier_pass)
from stores.errors import InputError

__all__ = ["ASSUMPTIONS", "StepCosts", "measure_step_costs", "first_prompt_ids", "acceptance_shares",
           "expected_acceptance_length", "predict_speedups", "cost_model_report", "format_cost_model"]

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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def measure_step_costs(verifier, drafter, context_ids: Sequence[int] | torch.Tensor, max_draft_tokens: int,
                       rounds: int = 15, warmup_rounds: int = 2) -> StepCosts:
    """Time a greedy step and, for every K = 1..``max_draft_tokens``, a speculative step's drafter pass and
    verifier pass, as :func:`~peagle_train.evaluate.speculative.speculative_generate` runs them.

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

    Returns:
        :class:`StepCosts`.

    Raises:
        InputError: an empty context, ``max_draft_tokens < 1`` or ``rounds < 1``.
    """
    ids = torch.as_tensor(context_ids, dtype=torch.long).flatten().cpu()
    if ids.numel() == 0:
        raise InputError("the context for timing the decoding steps is empty (0 tokens)")
    if max_draft_tokens < 1 or rounds < 1 or warmup_rounds < 0:
        raise InputError(f"cost timing needs max_draft_tokens >= 1, rounds >= 1, warmup_rounds >= 0; got "
                         f"{max_draft_tokens}, {rounds}, {warmup_rounds}")
    device = next(verifier.parameters()).device
    vocab = verifier.config.get_text_config().vocab_size
    layers = drafter.config.aux_layer_ids
    P = ids.numel()
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
        session = DrafterSession(drafter)
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
                draft_logits = session.draft(torch.tensor([last]), one_aux, K)  # [K, D]
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
    return StepCosts(verify_1_s=statistics.median(t_greedy), verify_s=[statistics.median(t) for t in t_verify],
                     draft_s=[statistics.median(t) for t in t_draft], context_tokens=P, rounds=rounds,
                     warmup_rounds=warmup_rounds, threads=torch.get_num_threads(), device=str(device))


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
        ``rows`` (:func:`predict_speedups`), ``best_K`` and ``best_expected_speedup`` (the row of the
        largest expected speedup), ``faster_than_greedy`` (that speedup > 1), ``greedy_step_ms`` (t_v(1)),
        ``acceptance_source`` (``online`` / ``offline``), ``acceptance_shares`` (s_i), ``costs``
        (:class:`StepCosts` as a dict), ``assumptions`` and, when the acceptance was measured with fewer
        drafts than the costs were timed for, ``note`` (the larger K are not predicted).
    """
    shares, source = acceptance_shares(acceptance)
    rows = predict_speedups(costs, shares)
    best = max(rows, key=lambda row: row["expected_speedup"])
    out = {"acceptance_source": source, "acceptance_shares": shares, "greedy_step_ms": costs.verify_1_s * 1e3,
           "rows": rows, "best_K": best["K"], "best_expected_speedup": best["expected_speedup"],
           "faster_than_greedy": best["expected_speedup"] > 1.0, "costs": asdict(costs),
           "assumptions": list(ASSUMPTIONS)}
    if len(shares) < len(costs.verify_s):
        out["note"] = (f"the acceptance was measured with K = {len(shares)} drafts: K = {len(shares) + 1}.."
                       f"{len(costs.verify_s)} are not predicted (run with --num-draft-tokens {len(costs.verify_s)})")
    return out


def format_cost_model(cm: dict[str, Any]) -> list[str]:
    """The table of a ``cost_model`` entry, as ``peagle-eval`` prints it."""
    c = cm["costs"]
    lines = [f"K from measured costs ({cm['acceptance_source']} acceptance; {c['device']}, {c['threads']} threads, "
             f"KV cache {c['context_tokens']} tokens, medians of {c['rounds']} rounds; greedy step "
             f"{cm['greedy_step_ms']:.2f} ms)",
             "  K  expected AL  t_draft ms  t_verify(K+1) ms  break-even AL  expected speedup"]
    lines += [f"  {r['K']:<2d} {r['expected_acceptance_length']:>11.3f} {r['draft_ms']:>11.2f} {r['verify_ms']:>17.2f} "
              f"{r['break_even_acceptance_length']:>14.3f} {r['expected_speedup']:>17.3f}" for r in cm["rows"]]
    verdict = "" if cm["faster_than_greedy"] else " (no K beats greedy decoding here)"
    lines.append(f"  best K {cm['best_K']}: expected speedup {cm['best_expected_speedup']:.3f}{verdict}")
    if cm.get("note"):
        lines.append(f"  {cm['note']}")
    return lines
