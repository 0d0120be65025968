"""``peagle-eval --engine vllm``: the prompts through vLLM, with and without the drafter (docs/design.md §9).

The engines are :mod:`peagle_train.generate.vllm_engine`'s (vLLM imported only when they run).
One engine without the drafter gives the reference: each prompt turn's greedy token ids with their 20
largest raw logits (for the near-tie rule of :mod:`peagle_train.generate.identity`: bf16 on an accelerator), or
at ``--temperature T > 0`` a seeded sample (later turns take the reference answers as history, as
peagle's own engine does). The engine with the drafter runs at the same temperature, with vLLM's
``draft_sample_method`` set to ``--draft-sample-method`` (vLLM's default ``greedy`` unless asked). One engine with the drafter
(vLLM's P-EAGLE: ``method eagle3`` with ``parallel_drafting``; a DFlash drafter: ``method dflash``, its
kind's :meth:`~peagle_train.train.kinds.DrafterKind.speculative_config`) then runs the same token-id prompts:
- one request at a time, counted: vLLM's spec-decode counters (``llm.get_metrics()``: drafts, draft
  tokens, accepted tokens, accepted per position; their change over this pass) and its per-request
  per-step counts (``per_request_spec_decode_metrics="detailed"``), and the token identity with the
  reference; timed, this is the concurrency-1 throughput;
- then all requests at once with up to ``concurrency`` running together (the list of prompt turns
  repeated to at least that many requests), timed: the concurrency-C throughput.
The reference engine is timed the same two ways. Every timed pass follows an untimed warm-up request.

vLLM counts as peagle reports (docs/design.md §9): AL ``= 1 + accepted / num_drafts``, per-position
acceptance ``accepted_per_pos[i] / num_drafts``. vLLM drafts K tokens at every step, also the last
steps of a turn where fewer tokens are left (peagle drafts ``min(K, left - 1)`` there), and counts
the accepted drafts the output then cuts at ``max_new_tokens`` or an EOS; so on the same tokens its
counts can exceed peagle's at each turn's last step.

At T > 0 on CPU the run is refused, before any engine starts, while vLLM's CPU rejection sampler gives draft tokens
uninitialized memory as their temperature (:func:`~peagle_train.generate.vllm_engine.check_vllm_sampling`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from peagle_train.evaluate.config import VLLM_LOADINGS, EvalConfig
from peagle_train.evaluate.prompts import Prompt, history_message, prompt_modes, read_prompts, render_turn
from peagle_train.evaluate.report import per_mode_report
from peagle_train.generate.identity import compare_to_greedy, greedy_check_summary
from peagle_train.generate.render import eos_ids, turn_text
from peagle_train.generate.speculative import (Truncation, acceptance_scheme, check_draft_sample_method,
                                               checked_num_draft_tokens, served_truncation)
from peagle_train.generate.vllm_engine import (SPEC_METRICS, VllmRun, check_vllm_sampling, check_vllm_verifier,
                                               import_vllm, verifier_generation_config, vllm_generate, vllm_on_cpu)
from peagle_train.model.checkpoint import find_drafter
from peagle_train.train.kinds import DrafterKind, checkpoint_kind, load_drafter_of_kind
from stores.errors import InputError, ModelNotFoundError
from runtime.model_cache import load_tokenizer, resolve_model
from runtime.model_identity import model_fingerprint

__all__ = ["VllmReference", "vllm_report", "next_turn_prompts", "per_position_counts", "check_speculators_verifier",
           "vllm_reference", "speculative_drafter", "vllm_speculative", "run_vllm_eval"]


def next_turn_prompts(tokenizer, prompts: Sequence[Prompt], eos: Iterable[int], order: list[tuple[int, int]],
                      answers: list[list[dict[str, Any]]], outputs: list[list[int]] | None,
                      modes: Sequence[dict[str, Any]] | None = None,
                      reasoning_parser: str | None = None) -> list[list[int]]:
    """The next turn's token-id prompts, given the greedy answers of the previous turn's requests.

    Args:
        prompts: the prompts read; eos: ids that end a turn (dropped from the history).
        order: ``(prompt index, turn)`` of each request so far; the new requests are appended.
        answers: per prompt, the answers so far; ``outputs``' are appended as the assistant messages a
            client of ``vllm serve --reasoning-parser reasoning_parser`` sends back, as peagle's own engine
            makes them (:func:`~peagle_train.evaluate.prompts.history_message`: never cleaned up, so
            ``x != y`` stays ``x != y`` in the next prompt).
        outputs: per request of the previous turn (the last ``len(outputs)`` of ``order``), the
            generated token ids; None: the first turn.
        modes: per prompt, the template's variables (vLLM's ``chat_template_kwargs``,
            :func:`~peagle_train.evaluate.prompts.prompt_modes`; None: none): each prompt's turns are rendered
            with its own and the reasoning parser reads them (``enable_thinking``, ``thinking``).
        reasoning_parser: vLLM's ``--reasoning-parser`` name the answers are parsed with (None: none).

    Returns:
        per prompt that has one more user turn, its rendered prompt token ids (empty: no turn left).
    """
    turn = 0
    if outputs is not None:
        for (i, t), tokens in zip(order[-len(outputs):], outputs):
            if t + 1 < len(prompts[i].user_turns):
                answers[i].append(history_message(tokenizer, tokens, eos, reasoning_parser, modes[i] if modes else None,
                                                  where=f"prompt {prompts[i].prompt_id!r} turn {t}"))
        turn = order[-1][1] + 1
    batch = []
    for i, p in enumerate(prompts):
        if turn < len(p.user_turns):
            order.append((i, turn))
            batch.append(render_turn(tokenizer, p, turn, answers[i], modes[i] if modes else None))
    return batch


@dataclass
class VllmReference:
    """The prompts as vLLM requests and vLLM's own greedy output for them (no drafter).

    Attributes:
        name: the verifier MODEL; directory: what vLLM loads; tokenizer; eos: ids that end a turn.
        prompts: the prompts read; order: ``(prompt index, turn)`` of each request; requests: their
            token ids (later turns with the reference answers as history); plain: the engine's run; modes: per
            prompt, its template variables (:func:`~peagle_train.evaluate.prompts.prompt_modes`); served: the
            verifier's top-k / top-p at T > 0 and where they came from (:func:`served_truncation`), None: not read.
    """

    name: str
    directory: str
    tokenizer: Any
    eos: set[int]
    prompts_file: str
    prompts: list
    order: list[tuple[int, int]]
    requests: list[list[int]]
    plain: VllmRun
    modes: list[dict[str, Any]] = field(default_factory=list)
    served: tuple[Truncation, dict[str, Any]] | None = None


def vllm_reference(verifier_name: str, prompts_file: str | Path, config: EvalConfig,
                   log: Callable[[str], None] = print, prompts: list[Prompt] | None = None, *,
                   served: tuple[Truncation, dict[str, Any]]) -> VllmReference:
    """Run every prompt turn through vLLM without a drafter (turn by turn, each later turn with the
    answers before it as history, as peagle's own engine does), timed at concurrency 1 and
    ``config.concurrency``; at ``config.temperature`` (T > 0: sampled, seeded per request from
    ``config.seed``); at T = 0 with each token's largest logits (the near-tie rule of
    :mod:`peagle_train.generate.identity`).

    Args:
        prompts: the prompts of ``prompts_file`` already read (``config.num_prompts`` of them); None: read here.
        served: :func:`served_truncation` of the verifier and ``config``: the top-k / top-p both engines apply.

    Raises:
        MissingDependencyError: no vLLM. ModelNotFoundError: unknown verifier. InputError: bad prompts.
    """
    directory = str(resolve_model(verifier_name))
    tokenizer = load_tokenizer(verifier_name)
    eos = set(eos_ids(tokenizer, SimpleNamespace(generation_config=verifier_generation_config(directory))))
    prompts = read_prompts(prompts_file, config.num_prompts) if prompts is None else prompts
    order: list[tuple[int, int]] = []
    answers: list[list[dict[str, Any]]] = [[] for _ in prompts]
    modes = prompt_modes(prompts, config.chat_template_kwargs, config.mode_variables(), config.seed)

    def next_turns(outputs: list[list[int]] | None) -> list[list[int]]:
        return next_turn_prompts(tokenizer, prompts, eos, order, answers, outputs, modes,
                                 config.reasoning_parser)

    plain = vllm_generate(directory, next_turns(None), config.online_max_new_tokens(), sorted(eos),
                          concurrency=config.concurrency, turns=next_turns, log=log, memory=config.vllm_memory,
                          temperature=config.temperature, seed=config.seed, top_logits=True,
                          truncation=served[0])
    requests = [render_turn(tokenizer, prompts[i], t, answers[i][:t], modes[i]) for i, t in order]
    return VllmReference(name=str(verifier_name), directory=directory, tokenizer=tokenizer, eos=eos,
                         prompts_file=str(prompts_file), prompts=prompts, order=order, requests=requests, plain=plain,
                         served=served,
                         modes=modes)


def speculative_drafter(drafter_dir: str | Path, config: EvalConfig) -> tuple[DrafterKind, int]:
    """The drafter checkpoint's kind and K (``config.num_draft_tokens``, default the drafter's ``num_depths``),
    for :func:`vllm_speculative`.

    Raises:
        InputError: K above the drafter's ``num_depths``. StoreFormatError: not a drafter checkpoint.
    """
    kind = checkpoint_kind(drafter_dir)
    return kind, checked_num_draft_tokens(config.num_draft_tokens, kind.load(drafter_dir))


def vllm_speculative(ref: VllmReference, drafter_dir: str | Path, config: EvalConfig,
                     log: Callable[[str], None] = print, *, kind: DrafterKind, num_draft_tokens: int,
                     sampling_check: str) -> dict[str, Any]:
    """The requests of ``ref`` through vLLM with the drafter of ``kind`` (loaded the ``config.vllm_loading`` way,
    K = ``num_draft_tokens``, at ``config.temperature`` with vLLM's ``draft_sample_method`` =
    ``config.draft_sample_method``, the top-k / top-p of ``ref.served``): the report of :func:`run_vllm_eval`.

    Args:
        kind, num_draft_tokens: the drafter's kind and K, checked (:func:`speculative_drafter`).
        sampling_check: the check that vLLM samples exactly at ``config.temperature``, in words, for the report
            (:func:`check_vllm_sampling`, or a benchmark's own that fixes vLLM in its process).

    Raises:
        InputError: an unknown draft sample method.
    """
    vllm = import_vllm()
    method = check_draft_sample_method(config.draft_sample_method)
    truncation, sampling = ref.served
    common = dict(stop_token_ids=sorted(ref.eos), concurrency=config.concurrency, log=log, memory=config.vllm_memory,
                  temperature=config.temperature, seed=config.seed, truncation=truncation)
    if config.vllm_loading == "speculative_config":
        model, speculative = ref.directory, kind.speculative_config(str(drafter_dir), num_draft_tokens)
    else:  # vLLM reads speculators_config of the drafter and loads the verifier it names
        model, speculative = str(drafter_dir), {"num_speculative_tokens": num_draft_tokens}
    spec = vllm_generate(model, ref.requests, config.online_max_new_tokens(), **common,
                         speculative_config={**speculative, "draft_sample_method": method})
    return {**vllm_report(drafter_dir, ref, spec, config, vllm.__version__), "sampling": sampling,
            "vllm_sampling_check": sampling_check}


def check_speculators_verifier(drafter_dir: str | Path, verifier_name: str) -> None:
    """With ``--vllm-loading speculators`` vLLM loads the verifier the drafter's ``config.json`` names
    (``speculators_config.verifier.name_or_path``), while the plain reference runs on ``verifier_name``:
    both must be the same model (:func:`~runtime.model_identity.model_fingerprint` of the resolved
    directories). Reads configs and hashes files only; no engine starts.

    Raises:
        InputError: the names resolve to different models, or the drafter's name does not resolve
            (names both and the fix: ``--vllm-loading speculative_config``).
    """
    config_file = Path(drafter_dir) / "config.json"
    named = ((json.loads(config_file.read_text()).get("speculators_config") or {}).get("verifier") or {}).get(
        "name_or_path")
    fix = ("pass --vllm-loading speculative_config (the verifier given to vLLM as the model, the drafter as "
           "speculative_config) or --verifier " + repr(named))
    if not named:
        raise InputError(f"--vllm-loading speculators: the drafter's speculators_config names no verifier; {fix}",
                         file=str(config_file), field="--vllm-loading")
    try:
        theirs = model_fingerprint(resolve_model(named))
    except ModelNotFoundError as e:
        raise InputError(f"--vllm-loading speculators: vLLM would load the verifier {named!r} the drafter names, "
                         f"which does not resolve here ({e}); {fix}", file=str(config_file),
                         field="--vllm-loading") from e
    if theirs != model_fingerprint(resolve_model(verifier_name)):
        raise InputError(f"--vllm-loading speculators: vLLM would load the verifier {named!r} that the drafter's "
                         f"speculators_config names, but the reference runs on --verifier {verifier_name!r}, a "
                         f"different model; {fix}", file=str(config_file), field="--verifier")


def run_vllm_eval(drafter_dir: str | Path, verifier_name: str | None, prompts_file: str | Path,
                  config: EvalConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The online report of ``peagle-eval`` (same keys; docs/design.md §9), measured by vLLM.

    Args:
        drafter_dir: a drafter checkpoint (or a peagle-train output).
        verifier_name: MODEL; None: the drafter's verifier.
        config: ``max_new_tokens``, ``num_prompts``, ``num_draft_tokens`` (K; default the drafter's
            ``num_depths``), ``temperature`` and ``seed`` (T > 0: every request seeded, :func:`request_seed`),
            ``draft_sample_method`` (vLLM's speculative config field), ``concurrency`` (C of the second
            throughput measurement), ``vllm_loading`` (:data:`~peagle_train.evaluate.config.VLLM_LOADINGS`).

    Returns:
        ``acceptance_length``, ``acceptance_rate``, ``per_position_acceptance`` / ``_accepted`` /
        ``_reached``, ``num_drafts``, ``drafted``, ``accepted``, ``identical_to_greedy``,
        ``mismatches``, ``near_tie_divergences`` / ``near_tie_prompts`` / ``greedy_check`` (T = 0: token
        identity decided as the engine's dtype allows, :mod:`peagle_train.generate.identity`; None / empty at
        T > 0), ``draft_sample_method``, ``acceptance_scheme``,
        ``tokens_per_second`` / ``baseline_tokens_per_second`` / ``speedup`` (concurrency 1),
        ``throughput`` (per concurrency: ``plain``, ``speculative`` tokens/s and ``speedup``),
        ``vllm_counters`` (vLLM's own names), ``per_prompt`` (per turn: ``text``, ``reference_text``,
        vLLM's per-step ``accepted`` / ``drafted``), ``engine: "vllm"``, ``vllm_version``, ``loading``,
        ``vllm_sampling_check`` (:func:`check_vllm_sampling`).

    Raises:
        MissingDependencyError: no vLLM (names the set-up command). InputError: a vLLM that no longer serves
        P-EAGLE (from 0.34: :meth:`~peagle_train.train.kinds.DrafterKind.check_installed_vllm`), an unknown loading or draft
        sample method, K above the drafter's ``num_depths``, T > 0 where vLLM's rejection sampler does not get
        the verifier's distribution (:func:`check_vllm_sampling`), a verifier whose drafts vLLM does not verify
        exactly on this platform (:func:`check_vllm_verifier`), each before any engine starts.
    """
    found, note = find_drafter(drafter_dir)
    checkpoint_kind(found).check_installed_vllm()  # P-EAGLE from vLLM 0.34: refused
    check_draft_sample_method(config.draft_sample_method)
    if config.vllm_loading not in VLLM_LOADINGS:
        raise InputError(f"{config.vllm_loading!r}: expected one of {VLLM_LOADINGS}", field="--vllm-loading")
    sampling_check = check_vllm_sampling(config.temperature, vllm_on_cpu())
    if note:
        log(note)
    name = verifier_name or load_drafter_of_kind(found).config.verifier_name_or_path
    if not name:
        raise InputError("the drafter's config names no verifier; pass one", field="--verifier")
    check_vllm_verifier(name, vllm_on_cpu())
    if config.vllm_loading == "speculators":
        check_speculators_verifier(found, name)
    ref = vllm_reference(name, prompts_file, config, log, served=served_truncation(name, config.top_k, config.top_p))
    kind, K = speculative_drafter(found, config)
    return vllm_speculative(ref, found, config, log, kind=kind, num_draft_tokens=K, sampling_check=sampling_check)


def per_position_counts(counters: dict[str, Any], K: int) -> tuple[list[int], list[int]] | None:
    """Per draft position i < K: (accepted, reached) from vLLM's counters (:data:`SPEC_METRICS` keys).

    vLLM exports accepted drafts per position but not drafts per position
    (``SpecDecodingStats.num_draft_tokens_per_pos`` is not a metric): ``reached[i] = num_drafts`` holds
    only when every draft step drafted K tokens, i.e. ``num_draft_tokens == K * num_drafts``.

    Returns:
        ``(accepted_per_pos [K], reached [K])`` as ints; None when some step drafted fewer than K
        (per-position rates are then not known and are not reported).
    """
    drafts = counters["num_drafts"]
    if counters["num_draft_tokens"] != K * drafts:
        return None
    return (counters["accepted_per_pos"] + [0] * K)[:K], [drafts] * K


def vllm_report(found, ref: VllmReference, spec: VllmRun, config: EvalConfig, version: str) -> dict[str, Any]:
    """The report of :func:`run_vllm_eval` from the reference run ``ref`` and the run with the drafter ``spec``
    (T = 0: each turn compared with :func:`~peagle_train.generate.identity.compare_to_greedy` in the
    engine's dtype, from the reference's top logits)."""
    prompts, plain, tokenizer, eos = ref.prompts, ref.plain, ref.tokenizer, ref.eos
    c = spec.counters
    K = spec.num_speculative_tokens
    drafts = c["num_drafts"]
    counts = per_position_counts(c, K)
    per_pos, reached = counts if counts is not None else (None, None)
    T = config.temperature
    dtype = spec.engine_settings.get("dtype", "float32")
    checks: list[tuple[str, dict[str, Any]]] = []
    per_prompt = []
    tops = plain.top_logits or [None] * len(plain.tokens)
    rows = sorted(zip(ref.order, ref.requests, plain.tokens, spec.tokens, spec.per_request, tops), key=lambda r: r[0])
    for (i, t), ids, base, got, steps, top in rows:  # prompt by prompt, turn by turn, as peagle's own report
        check = compare_to_greedy(got, base, top, dtype) if T == 0 else None  # samples differ at T > 0
        if check is not None:
            checks.append((prompts[i].prompt_id, check))
        per_prompt.append({
            "prompt_id": prompts[i].prompt_id, "turn": t, "prompt_tokens": len(ids), "new_tokens": len(base),
            "spec_new_tokens": len(got), "verifier_steps": len(steps.get("accepted", [])),
            "accepted": sum(steps.get("accepted", [])), "drafted": sum(steps.get("drafted", [])),
            "num_drafts": sum(1 for k in steps.get("drafted", []) if k > 0),
            "chat_template_kwargs": dict(ref.modes[i]) if ref.modes else dict(config.chat_template_kwargs or {}),
            "identical_to_greedy": None if check is None else check["identical"],
            "divergence": None if check is None else check["divergence"], "user": prompts[i].user_turns[t],
            "text": turn_text(tokenizer, got, eos), "reference_text": turn_text(tokenizer, base, eos),
            "finish_reason": "stop" if got and got[-1] in eos else "length",
            "vllm_steps": steps,
        })
    identity = greedy_check_summary(dtype, checks) if T == 0 else {
        "identical_to_greedy": None, "near_tie_divergences": None, "near_tie_prompts": [], "mismatches": [],
        "greedy_check": None}

    def ratio(a, b):
        return a / b if b else None

    throughput = {str(n): {"plain": plain.tokens_per_second.get(n), "speculative": spec.tokens_per_second.get(n),
                           "speedup": ratio(spec.tokens_per_second.get(n), plain.tokens_per_second.get(n))}
                  for n in sorted(set(plain.tokens_per_second) | set(spec.tokens_per_second))}
    return {
        "drafter": str(found), "verifier": ref.name, "prompts": ref.prompts_file, "engine": "vllm",
        "vllm_version": version, "loading": config.vllm_loading,
        "vllm_dtype": spec.engine_settings.get("dtype"),
        "vllm_enforce_eager": spec.engine_settings.get("enforce_eager"),
        "vllm_memory": {k: spec.engine_settings[k] for k in ("kv_cache_memory_bytes", "gpu_memory_utilization")
                        if k in spec.engine_settings},
        "acceptance_length": 1.0 + (c["num_accepted_tokens"] / drafts if drafts else 0.0),
        "acceptance_rate": ratio(c["num_accepted_tokens"], c["num_draft_tokens"]),
        "per_position_acceptance": [ratio(a, r) for a, r in zip(per_pos, reached)] if counts else None,
        "per_position_accepted": per_pos,
        "per_position_reached": reached,
        "per_position_note": None if counts else (
            f"vLLM drafted {c['num_draft_tokens']} tokens in {drafts} steps, not K={K} at each, and does not "
            "export drafts per position: per-position figures are not reported"),
        "num_draft_tokens": K,
        "drafted": c["num_draft_tokens"],
        "accepted": c["num_accepted_tokens"],
        "num_drafts": drafts,
        "generated_tokens": sum(len(t) for t in spec.tokens),
        "tokens_per_second": spec.tokens_per_second.get(1),
        "baseline_tokens_per_second": plain.tokens_per_second.get(1),
        "speedup": throughput.get("1", {}).get("speedup"),
        "throughput": throughput,
        "concurrency": [int(n) for n in throughput],
        "engine_start_s": {"plain": plain.start_s, "speculative": spec.start_s},
        "vllm_counters": {SPEC_METRICS[k]: v for k, v in c.items()},
        **identity,
        "temperature": T,
        "seed": config.seed if T > 0 else None,
        "draft_sample_method": config.draft_sample_method if T > 0 else None,
        "acceptance_scheme": acceptance_scheme(T, config.draft_sample_method),
        "num_prompts": len(prompts),
        "num_turns": len(per_prompt),
        "max_new_tokens": config.online_max_new_tokens(),
        **({"per_mode": per_mode_report(per_prompt)} if config.mode_variables() else {}),
        "per_prompt": per_prompt,
    }

