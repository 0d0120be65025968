"""Drafter evaluation (DESIGN.md §9): offline acceptance on stored features, online speculative decoding.

Legend: T tokens in a block, n tokens in a segment, L aux layers, H hidden size, V verifier vocab,
D draft vocab, K drafted tokens per step (``num_depths``), E drafter elements, A anchors.

Offline (:func:`evaluate_offline`, :func:`run_offline_eval`): on held-out blocks, every chain
``(a, 0..K-1)`` without sampling (alignment of §4). Element ``(a, d)`` is *correct* when the
drafter's argmax, mapped to a verifier id, equals the verifier's argmax over its full vocab
(``argmax lm_head(f_{a+d+1})``): exactly the test online greedy verification applies, so a token
outside the draft vocab is never drafted correctly. (Training's per-depth accuracy compares argmaxes
within the draft vocab and is therefore higher when the draft vocab is reduced.)
- per-depth accuracy: weighted agreement at depth d, weight ``m_{a+d+2}``. Within one segment the
  depth-d elements predict the tokens ``x_{d+2}..x_{n-1}``, so the depth-d weight is
  ``sum(m[d+2:])``: equal at every depth whenever the first K+1 tokens of each segment carry no
  loss (a system or user turn first: the usual case). Equal *correct* counts at depths >= 1 then
  mean the drafter drafts the same tokens at every depth > 0 (e.g. one frequent token);
- a chain is accepted up to the first depth that is wrong, does not exist (segment end), has
  weight 0 (a token the verifier does not generate as the assistant) or whose target is an EOS
  token (generation ends there whatever is drafted, so, as online, that depth is not scored);
  anchors count when their depth-0 element has weight 1 and a target that is not an EOS
  (``positions_scored``);
- per-position conditional acceptance: P(depth i accepted | depths < i accepted, (a, i) exists);
- simulated acceptance length: ``1 + mean accepted`` (bonus token counted).

Online (:func:`evaluate_prompts`, :func:`run_online_eval`): per prompt turn, plain greedy decoding and
greedy speculative decoding (:mod:`peagle_train.speculative`) with the same verifier, compared token
for token; with ``temperature > 0`` plain sampling and speculative sampling (rejection sampling, seeded
per prompt turn), which are not compared token for token. Acceptance length, rate and per-position acceptance are counted as vLLM reports them:
``AL = 1 + accepted / steps`` over verifier steps that checked at least one draft.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peagle_train.attention import build_attention_mask
from peagle_train.cod import CodElements, element_inputs
from peagle_train.speculative import (
    GenerationResult,
    check_compatible,
    greedy_generate,
    plain_generate,
    speculative_generate,
)
from stores.errors import InputError, StoreMismatchError

__all__ = [
    "EvalConfig",
    "Prompt",
    "read_prompts",
    "render_turn",
    "evaluate_prompts",
    "run_online_eval",
    "evaluate_offline",
    "segment_predictions",
    "run_offline_eval",
    "select_eval_blocks",
    "check_before_weights",
    "check_verifier_config",
    "format_report",
    "write_acceptance_plot",
    "wilson_interval",
]


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    """What ``peagle-eval`` measures and on how much."""

    max_new_tokens: int = 128
    """Most tokens generated per prompt turn (--max-new-tokens)."""
    num_prompts: int | None = None
    """Prompts read from the file, from the top; None = all (--num-prompts)."""
    num_draft_tokens: int | None = None
    """K drafts per verifier step; None = the drafter's num_depths (--num-draft-tokens)."""
    max_blocks: int | None = None
    """Offline: most validation blocks scored; None = all."""
    chunk_anchors: int = 256
    """Offline: anchors whose chains run through the drafter at once (bounds memory)."""
    warmup: bool = True
    """Online: one short untimed generation first, so one-time costs do not count in tokens/s."""
    temperature: float = 0.0
    """Online: 0 = greedy (checked token for token); T > 0 = sampling at T, with rejection sampling (--temperature)."""
    seed: int = 0
    """Online, T > 0: prompt turn i samples with generators seeded ``(seed, i)`` (--seed)."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 1:
            raise ValueError(f"--num-draft-tokens must be >= 1, got {self.num_draft_tokens}")
        if self.max_blocks is not None and self.max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {self.max_blocks}")
        if self.chunk_anchors < 1:
            raise ValueError(f"chunk_anchors must be >= 1, got {self.chunk_anchors}")
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")


# ------------------------------------------------------------------------------------------ prompts
@dataclass(frozen=True)
class Prompt:
    """One evaluation prompt: fixed leading messages, then user turns answered by the verifier.

    Turn i is rendered as ``prefix + [user_0, answer_0, ..., user_i]`` where ``answer_j`` is the
    verifier's own greedy answer to turn j (MT-Bench's multi-turn protocol).
    """

    prompt_id: str
    user_turns: list[str]
    prefix: list[dict[str, str]] = field(default_factory=list)


def _parse_prompt(obj: Any, file: str, row: int) -> Prompt:
    if not isinstance(obj, dict):
        raise InputError(f"expected a JSON object, got {type(obj).__name__}", file=file, row=row)
    pid = str(obj.get("question_id", obj.get("id", row)))
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise InputError("expected a non-empty list of strings", file=file, row=row, field="turns")
        return Prompt(pid, list(turns))
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise InputError("expected a list of {'role': str, 'content': str}", file=file, row=row,
                             field="messages")
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        if not users:
            raise InputError("no user message to answer", file=file, row=row, field="messages")
        last = users[-1]
        prefix = [{"role": m["role"], "content": m["content"]} for m in msgs[:last]]
        return Prompt(pid, [msgs[last]["content"]], prefix)
    raise InputError("expected an MT-Bench line with 'turns' or an OpenAI line with 'messages'",
                     file=file, row=row)


def read_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Read prompts from a JSONL file (blank lines skipped).

    Lines are MT-Bench ``{"question_id", "turns": [str, ...]}`` (every turn is evaluated, with the
    verifier's earlier answers as history) or OpenAI ``{"messages": [...]}`` (the messages up to
    the last user turn; that turn is evaluated). The id is ``question_id``, else ``id``, else the
    row number (1-based).

    Raises:
        InputError: missing file, bad JSON or a line of neither form (names file, row and field).
    """
    path = Path(path)
    if not path.is_file():
        raise InputError("prompts file not found", file=str(path), field="--prompts")
    prompts: list[Prompt] = []
    with path.open(encoding="utf-8") as f:
        for row, line in enumerate(f, start=1):
            if limit is not None and len(prompts) >= limit:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"invalid JSON ({e.msg})", file=str(path), row=row) from None
            prompts.append(_parse_prompt(obj, str(path), row))
    if not prompts:
        raise InputError("no prompts in the file", file=str(path), field="--prompts")
    return prompts


def render_turn(tokenizer, prompt: Prompt, turn: int, answers: Sequence[str]) -> list[int]:
    """Token ids of turn ``turn`` of ``prompt`` with the chat template and a generation prompt.

    Args:
        answers: the verifier's answers to turns ``0..turn-1``.
    """
    messages = list(prompt.prefix)
    for i in range(turn + 1):
        messages.append({"role": "user", "content": prompt.user_turns[i]})
        if i < turn:
            messages.append({"role": "assistant", "content": answers[i]})
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(t) for t in ids]


def _eos_ids(tokenizer, verifier) -> list[int]:
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None),
                  getattr(getattr(verifier, "generation_config", None), "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


# ------------------------------------------------------------------------------------------- checks
def check_verifier_config(name: str, drafter) -> None:
    """:func:`~peagle_train.speculative.check_compatible` on MODEL ``name``'s config alone, before its
    weights load.

    Raises:
        InputError: the drafter does not fit the verifier. ModelNotFoundError: unknown MODEL.
    """
    from types import SimpleNamespace

    from stores.model_config import load_model_config, text_config

    check_compatible(SimpleNamespace(config=text_config(load_model_config(name))), drafter)


def check_before_weights(drafter_dir: str | Path, verifier_name: str | None = None,
                         prompts_file: str | Path | None = None, store: str | Path | None = None,
                         num_prompts: int | None = None) -> None:
    """Every check of a ``peagle-eval`` run that needs no verifier weights (docs/design.md §2): the
    prompts file, the drafter checkpoint, the store against the drafter, and each verifier's config
    (online: ``verifier_name`` or the drafter's; offline: ``verifier_name`` or the store's).

    Raises:
        InputError, StoreFormatError, StoreMismatchError, ModelNotFoundError: as the run would, later.
    """
    from peagle_train.checkpoint import load_drafter
    from stores.feature_store import FeatureStore

    if prompts_file is not None:
        read_prompts(prompts_file, num_prompts)
    drafter = load_drafter(drafter_dir)
    names = []
    if prompts_file is not None:
        names.append(verifier_name or drafter.config.verifier_name_or_path)
    if store is not None:
        fs = FeatureStore.open(store)
        _check_store_fits(fs, drafter)
        names.append(verifier_name or fs.attrs.get("verifier", {}).get("name_or_path"))
    for name in dict.fromkeys(n for n in names if n):
        check_verifier_config(name, drafter)


# ------------------------------------------------------------------------------------------- online
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


def _decode(tokenizer, tokens: Sequence[int], eos: Iterable[int]) -> str:
    """The text of generated ``tokens`` without EOS ids and special tokens."""
    eos = set(eos)
    return tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True)


def _turn_record(tokenizer, prompt: Prompt, turn: int, prompt_tokens: int, base: GenerationResult,
                 spec: GenerationResult, same: bool | None) -> dict[str, Any]:
    """One ``per_prompt`` entry: counts, the user turn, the speculative output (``text``) and the
    plain decoding's (``reference_text``: greedy at T = 0, a plain sample at T > 0), decoded with
    special tokens kept so an EOS or a template token in the output stays visible."""
    return {
        "prompt_id": prompt.prompt_id, "turn": turn, "prompt_tokens": prompt_tokens,
        "new_tokens": len(base.tokens), "spec_new_tokens": len(spec.tokens),
        "verifier_steps": spec.verifier_steps, "accepted": spec.accepted, "drafted": spec.drafted,
        "identical_to_greedy": same,
        "user": prompt.user_turns[turn],
        "text": tokenizer.decode(spec.tokens, skip_special_tokens=False),
        "reference_text": tokenizer.decode(base.tokens, skip_special_tokens=False),
    }


def evaluate_prompts(verifier, drafter, tokenizer, prompts: Sequence[Prompt], config: EvalConfig,
                     progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Greedy baseline and speculative decoding on every turn of ``prompts``; compare and measure.

    Args:
        verifier: a transformers causal LM (batch 1, any device).
        drafter: a ``PEagleDrafter`` for ``verifier``, on the verifier's device.
        tokenizer: the verifier's tokenizer (with a chat template).
        prompts: from :func:`read_prompts`.
        config: ``max_new_tokens`` and ``num_draft_tokens`` are used.
        progress: called with 1 after each prompt turn.

    Returns:
        The report (see :func:`run_online_eval`).

    Raises:
        InputError: the drafter does not match the verifier.
    """
    check_compatible(verifier, drafter)
    K = config.num_draft_tokens or drafter.config.num_depths
    eos = _eos_ids(tokenizer, verifier)
    if config.warmup:
        warm = render_turn(tokenizer, prompts[0], 0, [])
        greedy_generate(verifier, warm, 2, eos)
        speculative_generate(verifier, drafter, warm, 2, K, eos)
    totals = _OnlineTotals(K)
    per_prompt: list[dict[str, Any]] = []
    mismatches: list[str] = []
    start = time.perf_counter()
    T = config.temperature
    for prompt in prompts:
        answers: list[str] = []
        for turn in range(len(prompt.user_turns)):
            ids = render_turn(tokenizer, prompt, turn, answers)
            gens = [_turn_generator(config.seed, len(per_prompt)) if T > 0 else None for _ in range(2)]
            base = plain_generate(verifier, ids, config.max_new_tokens, eos, T, gens[0])
            spec = speculative_generate(verifier, drafter, ids, config.max_new_tokens, K, eos, T, gens[1])
            totals.add(base, spec)
            same = spec.tokens == base.tokens if T == 0 else None  # samples differ by design at T > 0
            if same is False and prompt.prompt_id not in mismatches:
                mismatches.append(prompt.prompt_id)
            per_prompt.append(_turn_record(tokenizer, prompt, turn, len(ids), base, spec, same))
            answers.append(_decode(tokenizer, base.tokens, eos))
            if progress is not None:
                progress(1)
    return {
        **totals.report(),
        "identical_to_greedy": not mismatches if T == 0 else None,
        "temperature": T,
        "seed": config.seed if T > 0 else None,
        "mismatches": mismatches,
        "wall_time_s": time.perf_counter() - start,
        "num_prompts": len(prompts),
        "num_turns": len(per_prompt),
        "max_new_tokens": config.max_new_tokens,
        "per_prompt": per_prompt,
    }


def run_online_eval(drafter_dir: str | Path, verifier_name: str | None, prompts_file: str | Path,
                    max_new_tokens: int = 128, num_prompts: int | None = None,
                    num_draft_tokens: int | None = None, output: str | Path | None = None,
                    progress_factory: Callable[[int], Any] | None = None, temperature: float = 0.0,
                    seed: int = 0) -> dict[str, Any]:
    """Online evaluation of a drafter checkpoint on a prompts file (DESIGN.md §9).

    Args:
        drafter_dir: a checkpoint written by ``peagle_train.checkpoint.save_drafter``.
        verifier_name: MODEL (``smollm2-135m``, a directory, a hub id); None = the verifier named in
            the drafter's config.
        prompts_file: MT-Bench or OpenAI-messages JSONL (see :func:`read_prompts`).
        max_new_tokens, num_prompts, num_draft_tokens, temperature, seed: see :class:`EvalConfig`.
        output: also write the JSON report there.
        progress_factory: ``total -> bar`` with ``update(n)`` and ``close()`` (e.g. ``tqdm``).

    Returns:
        A dict with ``acceptance_length``, ``acceptance_rate``, ``per_position_acceptance`` (K
        fractions), ``drafted``, ``accepted``, ``identical_to_greedy`` (None at T > 0), ``mismatches`` (prompt ids),
        ``tokens_per_second``, ``baseline_tokens_per_second``, ``speedup``, ``wall_time_s``,
        ``num_prompts``, ``per_prompt`` (per turn: counts, ``user``, the speculative ``text`` and the
        plain decoding's ``reference_text``) and the run's inputs.

    Raises:
        InputError: bad prompts file or options, or a drafter that does not match the verifier.
        StoreFormatError: not a drafter checkpoint. ModelNotFoundError: unknown verifier.
    """
    from peagle_train.checkpoint import load_drafter
    from stores.model_cache import load_tokenizer, load_verifier

    config = EvalConfig(max_new_tokens=max_new_tokens, num_prompts=num_prompts, num_draft_tokens=num_draft_tokens,
                        temperature=temperature, seed=seed)
    prompts = read_prompts(prompts_file, config.num_prompts)
    drafter = load_drafter(drafter_dir).eval()
    name = verifier_name or drafter.config.verifier_name_or_path
    if not name:
        raise InputError("the drafter's config names no verifier; pass one", field="--verifier")
    check_verifier_config(name, drafter)  # before the weights load
    # float32 everywhere: a K+1-token verify pass and one-token decoding then agree to ~1e-6, so
    # near-ties cannot flip an argmax the way they do in bf16.
    verifier = load_verifier(name, dtype=torch.float32)
    drafter = drafter.to(next(verifier.parameters()).device, torch.float32)
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
        _write_json(report, output)
    return report


# ------------------------------------------------------------------------------------------ offline
def _argmax_chunked(x: torch.Tensor, head: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """``argmax(x @ head^T)`` row by row in chunks: ``[N, H], [D, H] -> [N] int64``."""
    out = [(x[i:i + rows].float().to(head.device) @ head.T).argmax(-1).cpu() for i in range(0, x.shape[0], rows)]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


@torch.no_grad()
def segment_predictions(drafter, block, start: int, n: int, num_depths: int, chunk_anchors: int = 256) -> torch.Tensor:
    """The drafter's argmax for every element ``(a, d)`` of one segment ``[start, start+n)``, all chains.

    Anchors are processed ``chunk_anchors`` at a time: one pass holds the depth-0 elements up to the
    chunk's last anchor (the context its chains may attend) and the chunk's chains, with the §8 mask.

    Args:
        drafter: a ``PEagleDrafter``.
        block: ``input_ids, position_ids [T] int64``, ``aux_hidden [T, L, H]`` or ``[T, L*H]``.
        start, n: the segment's first row and length.
        num_depths: K.
        chunk_anchors: anchors per drafter pass.

    Returns:
        ``[A, K] int64`` draft-vocab ids for the ``A = max(n - 2, 0)`` anchors; -1 where the element
        does not exist (``a + d + 2 > n - 1``).
    """
    K = num_depths
    A = max(n - 2, 0)
    pred = torch.full((A, K), -1, dtype=torch.long)
    exists = (torch.arange(A)[:, None] + torch.arange(K)[None, :] + 2) <= n - 1  # [A, K]
    device = drafter.d2t.device
    dtype = next(drafter.parameters()).dtype
    aux = block.aux_hidden.reshape(block.aux_hidden.shape[0], -1)  # [T, L*H]
    for c0 in range(0, A, chunk_anchors):
        c1 = min(c0 + chunk_anchors, A)
        parts = [torch.arange(c1)] + [torch.arange(c0, c1)[exists[c0:c1, d]] for d in range(1, K)]
        anchor = torch.cat(parts) + start  # [E] row indices, sorted by (depth, anchor)
        depth = torch.cat([torch.full((p.numel(),), d) for d, p in enumerate(parts)])  # [E]
        elements = CodElements(anchor, depth, torch.zeros_like(anchor), torch.ones(anchor.numel()))
        inputs = element_inputs(elements, block.input_ids, block.position_ids)
        mask = build_attention_mask(elements)  # [E, E]
        hidden = drafter(inputs.input_ids.to(device), aux[inputs.feature_index].to(device, dtype),
                         inputs.is_mask.to(device), inputs.position_ids.to(device), mask.to(device))  # [E, H]
        keep = (depth > 0) | (anchor - start >= c0)  # depth-0 elements before c0 were scored already
        ids = torch.cat([drafter.logits(h).argmax(-1).cpu() for h in hidden[keep].split(1024)])  # [E']
        pred[anchor[keep] - start, depth[keep]] = ids
    return pred


@dataclass
class _OfflineTotals:
    K: int
    depth_correct: torch.Tensor = None  # [K] weighted correct
    depth_weight: torch.Tensor = None  # [K] weight sums
    reached: torch.Tensor = None  # [K] anchors whose chain reached depth i
    accepted_at: torch.Tensor = None  # [K] anchors whose depth i was accepted
    accepted: int = 0
    anchors: int = 0

    def __post_init__(self) -> None:
        for name in ("depth_correct", "depth_weight", "reached", "accepted_at"):
            setattr(self, name, torch.zeros(self.K, dtype=torch.long))

    def add(self, correct: torch.Tensor, valid: torch.Tensor, ends: torch.Tensor | None = None) -> None:
        """``correct, valid, ends [A, K] bool``; valid = element exists and has weight 1; ends = its
        target is an EOS token.

        An EOS target ends the output whether it is drafted or not, so (as online, see
        ``speculative._record_step``) it and the depths after it are not scored in chains: a chain
        counts the depths accepted before it, and an anchor whose depth-0 target is an EOS is not
        counted. Per-depth accuracy still scores every valid element.
        """
        self.depth_correct += (correct & valid).sum(0)
        self.depth_weight += valid.sum(0)
        scored = valid if ends is None else valid & ~ends  # [A, K]
        counted = scored[:, 0]
        ok = (correct & scored)[counted].long()  # [A', K]
        n_acc = ok.cumprod(1).sum(1)  # [A'] accepted depths per chain
        i = torch.arange(self.K)
        self.reached += ((n_acc[:, None] >= i[None, :]) & scored[counted]).sum(0)
        self.accepted_at += (n_acc[:, None] > i[None, :]).sum(0)
        self.accepted += int(n_acc.sum())
        self.anchors += int(counted.sum())

    def report(self) -> dict[str, Any]:
        def ratios(num: torch.Tensor, den: torch.Tensor) -> list[float | None]:
            return [n / d if d else None for n, d in zip(num.tolist(), den.tolist())]

        mean_acc = self.accepted / self.anchors if self.anchors else 0.0
        return {
            "per_depth_accuracy": ratios(self.depth_correct, self.depth_weight),
            "per_depth_correct": self.depth_correct.tolist(),
            "per_depth_weight": self.depth_weight.tolist(),
            "per_position_acceptance": ratios(self.accepted_at, self.reached),
            "per_position_accepted": self.accepted_at.tolist(),
            "per_position_reached": self.reached.tolist(),
            "simulated_acceptance_length": 1.0 + mean_acc,
            "mean_accepted": mean_acc,
            "positions_scored": self.anchors,
            "num_depths": self.K,
        }


def evaluate_offline(drafter, blocks: Iterable, lm_head_weight: torch.Tensor, num_depths: int | None = None,
                     chunk_anchors: int = 256, progress: Callable[[int], None] | None = None,
                     eos_token_ids: Iterable[int] = ()) -> dict[str, Any]:
    """Offline acceptance of ``drafter`` on stored blocks (see the module docstring for definitions).

    Args:
        drafter: a ``PEagleDrafter``.
        blocks: objects with ``input_ids, loss_mask, position_ids [T] int64``, ``cu_seqlens [S+1]``,
            ``aux_hidden [T, L, H]`` or ``[T, L*H]`` (bf16/float) and ``final_hidden [T, H]``
            (e.g. ``FeatureStore.read_block`` results).
        lm_head_weight: ``[V, H]`` the verifier's lm_head; the argmax over all V rows is the target.
        num_depths: K chain length scored; default the drafter's ``num_depths``.
        chunk_anchors: anchors per drafter pass; memory is ``O((T + chunk * K)^2)`` for the mask.
        progress: called with 1 after each block.
        eos_token_ids: ids that end generation; a chain stops before an element whose target is one
            of them, as online decoding does (see :meth:`_OfflineTotals.add`).

    Returns:
        ``per_depth_accuracy`` (K, None where no weight), ``per_depth_correct``,
        ``per_depth_weight``, ``per_position_acceptance`` (K conditional rates),
        ``simulated_acceptance_length``, ``mean_accepted``, ``positions_scored``, ``num_depths``.
    """
    K = num_depths or drafter.config.num_depths
    head = lm_head_weight.detach().float()  # [V, H]
    draft_ids = drafter.draft_ids.cpu()  # [D] verifier id of each draft id
    totals = _OfflineTotals(K)
    eos = torch.tensor(sorted({int(e) for e in eos_token_ids}), dtype=torch.long)
    drafter.eval()
    for block in blocks:
        cu = block.cu_seqlens.tolist()
        m = block.loss_mask.long()
        for start, end in zip(cu[:-1], cu[1:]):
            n = end - start
            if n < 3:
                continue
            seg_m = m[start:end]  # [n]
            # The verifier's full-vocab argmax z_r for the rows whose next token carries weight: the
            # only targets that are ever scored (an element's target row is label - 1).
            rows = torch.nonzero(seg_m[1:] == 1).flatten()  # [R] local rows r with m_{r+1} = 1
            target = torch.full((n,), -1, dtype=torch.long)
            target[rows] = _argmax_chunked(block.final_hidden[start + rows], head)  # verifier ids
            pred = segment_predictions(drafter, block, start, n, K, chunk_anchors)  # [A, K] draft ids
            exists = pred >= 0
            drafted = torch.where(exists, draft_ids[pred.clamp_min(0)], torch.full_like(pred, -1))  # [A, K]
            label = torch.arange(n - 2)[:, None] + torch.arange(K)[None, :] + 2  # [A, K] local x index
            label = torch.where(exists, label, torch.zeros_like(label))
            weight = exists & (seg_m[label] == 1)  # [A, K] w = m_{a+d+2}
            correct = weight & (drafted == target[label - 1])  # target of (a, d) is argmax z_{a+d+1}
            ends = exists & torch.isin(block.input_ids[start + label], eos)  # [A, K] target is an EOS
            totals.add(correct, weight, ends)
        if progress is not None:
            progress(1)
    return totals.report()


def select_eval_blocks(store, drafter_config: dict[str, Any] | None = None,
                       max_blocks: int | None = None) -> tuple[list[int], str]:
    """The blocks offline evaluation scores: the training run's validation split when known.

    The split is the ``val_blocks`` list that ``peagle-train`` records in the checkpoint's
    ``config.json`` (``peagle_training``); failing that ``peagle_train.data.split_blocks(done blocks,
    seed, val_fraction)`` with the recorded ``seed`` and ``val_fraction``; without either (or with an
    empty validation split) every done block is scored.

    Returns:
        (block ids, ``"validation"`` or ``"all"``).
    """
    import numpy as np

    from peagle_train.data import split_blocks

    done = np.flatnonzero(store.done_mask()).astype(np.int64)
    if done.size == 0:
        raise StoreMismatchError(f"{store.path}: no block is done; run `peagle-data extract` first")
    found = _find_keys(drafter_config or {}, ("seed", "val_fraction", "val_blocks"))
    ids, split = done, "all"
    if found.get("val_blocks"):  # recorded by peagle-train (config.json "peagle_training")
        ids, split = np.intersect1d(done, np.asarray(found["val_blocks"], dtype=np.int64)), "validation"
    elif "seed" in found and found.get("val_fraction"):
        _, val = split_blocks(done, int(found["seed"]), float(found["val_fraction"]))
        if val.size:
            ids, split = val, "validation"
    ids = ids.tolist()
    return (ids[:max_blocks] if max_blocks else ids), split


def _find_keys(tree: Any, keys: Sequence[str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k in keys and not isinstance(v, dict):
                found.setdefault(k, v)
            else:
                for k2, v2 in _find_keys(v, keys).items():
                    found.setdefault(k2, v2)
    return found


def _check_store_fits(store, drafter) -> None:
    cfg = drafter.config
    if list(store.layers) != list(cfg.aux_layer_ids) or store.hidden_size != cfg.hidden_size \
            or store.vocab_size != cfg.vocab_size:
        raise StoreMismatchError(
            f"{store.path}: store layers {store.layers}, hidden {store.hidden_size}, vocab {store.vocab_size}; "
            f"the drafter wants layers {cfg.aux_layer_ids}, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}. "
            "Evaluate on a store extracted from the drafter's verifier with its layers")


def run_offline_eval(drafter_dir: str | Path, store: str | Path, max_blocks: int | None = None,
                     blocks: Sequence[int] | None = None, verifier_name: str | None = None,
                     num_depths: int | None = None, chunk_anchors: int = 256,
                     progress_factory: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """Offline evaluation of a drafter checkpoint on a feature store (DESIGN.md §9).

    Args:
        drafter_dir: a drafter checkpoint directory.
        store: a feature store path.
        max_blocks: score at most this many of the selected blocks.
        blocks: score exactly these block ids (default: :func:`select_eval_blocks`).
        verifier_name: MODEL whose lm_head builds the targets; default the store's
            ``verifier.name_or_path``.
        num_depths: chain length K; default the drafter's.
        chunk_anchors, progress_factory: see :func:`evaluate_offline` / :func:`run_online_eval`.

    Returns:
        The :func:`evaluate_offline` report plus ``blocks``, ``split``, ``store``, ``drafter``,
        ``verifier``.

    Raises:
        StoreFormatError: not a feature store or not a drafter checkpoint.
        StoreMismatchError: the store's layers / sizes do not fit the drafter; no done block.
    """
    from peagle_train.checkpoint import load_drafter
    from stores.feature_store import FeatureStore
    from stores.model_cache import load_tokenizer, load_verifier

    EvalConfig(max_blocks=max_blocks, chunk_anchors=chunk_anchors, num_draft_tokens=num_depths)
    drafter = load_drafter(drafter_dir).eval()
    fs = FeatureStore.open(store)
    _check_store_fits(fs, drafter)
    if blocks is None:
        cfg_json = json.loads((Path(drafter_dir) / "config.json").read_text())
        ids, split = select_eval_blocks(fs, cfg_json, max_blocks)
    else:
        ids, split = list(blocks)[:max_blocks] if max_blocks else list(blocks), "given"
    name = verifier_name or fs.attrs.get("verifier", {}).get("name_or_path")
    if not name:
        raise StoreMismatchError(f"{store}: the store names no verifier; pass verifier_name")
    check_verifier_config(name, drafter)  # before the weights load
    verifier = load_verifier(name, device="cpu")
    lm_head = verifier.lm_head.weight.detach()  # [V, H]
    eos = _eos_ids(load_tokenizer(name), verifier)
    bar = progress_factory(len(ids)) if progress_factory else None
    try:
        report = evaluate_offline(drafter, (fs.read_block(i) for i in ids), lm_head, num_depths,
                                  chunk_anchors, progress=bar.update if bar is not None else None,
                                  eos_token_ids=eos)
    finally:
        if bar is not None:
            bar.close()
    return {"drafter": str(drafter_dir), "store": str(store), "verifier": str(name), "split": split,
            "blocks": ids, **report}


# ------------------------------------------------------------------------------------------- output
def _write_json(report: dict[str, Any], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    tmp.replace(path)


def _fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)


def format_report(report: dict[str, Any]) -> str:
    """A readable table of an online and/or offline report (the ``offline`` key)."""
    lines: list[str] = []
    if "acceptance_length" in report:
        lines += [
            f"online: {report['num_prompts']} prompts, {report['num_turns']} turns, K={report['num_draft_tokens']}",
            f"  acceptance length  {_fmt(report['acceptance_length'])}",
            f"  acceptance rate    {_fmt(report['acceptance_rate'])}  "
            f"({report['accepted']}/{report['drafted']})",
            f"  tokens/s           {_fmt(report['tokens_per_second'])} speculative, "
            f"{_fmt(report['baseline_tokens_per_second'])} {'plain sampling' if report.get('temperature') else 'greedy'} "
            f"(speedup {_fmt(report['speedup'])})",
            f"  identical to greedy {report['identical_to_greedy']}"
            + (f"  (temperature {report['temperature']}: sampled, not compared)" if report.get("temperature") else ""),
            f"  wall time          {_fmt(report.get('wall_time_s'))} s, {report.get('generated_tokens', '-')} tokens "
            "generated by speculative decoding",
            "  position  " + " ".join(f"{i:>6d}" for i in range(len(report["per_position_acceptance"]))),
            "  accepted  " + " ".join(f"{_fmt(x):>6s}" for x in report["per_position_acceptance"]),
        ]
    off = report.get("offline", report if "simulated_acceptance_length" in report else None)
    if off:
        K = off["num_depths"]
        lines += [
            f"offline: {len(off.get('blocks', []))} blocks ({off.get('split', '-')}), "
            f"{off['positions_scored']} positions",
            f"  simulated acceptance length {_fmt(off['simulated_acceptance_length'])}",
            "  depth     " + " ".join(f"{i:>6d}" for i in range(K)),
            "  accuracy  " + " ".join(f"{_fmt(x):>6s}" for x in off["per_depth_accuracy"]),
            "  cond.acc  " + " ".join(f"{_fmt(x):>6s}" for x in off["per_position_acceptance"]),
        ]
    return "\n".join(lines)


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float] | None:
    """Wilson score interval of a binomial proportion (Wilson, 1927; 95% for z = 1.96).

    Unlike ``p ± z·sqrt(p(1-p)/n)`` it stays inside [0, 1] and is honest for small ``trials`` and
    for ``p`` near 0 or 1 (0 of 10 gives [0, 0.278], not [0, 0]). None when ``trials`` is 0.
    """
    if trials <= 0:
        return None
    n, p = trials, successes / trials
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / denom
    # rounding can put a bound a few ulps past p when p is 0 or 1: the interval always holds p
    return max(0.0, min(p, center - half)), min(1.0, max(p, center + half))


def _plot_series(report: dict[str, Any]) -> list[tuple[str, list[int], list[int]]]:
    """``(label, successes [K], trials [K])`` per series: online per-position acceptance (the share of
    verifier steps with drafts whose draft i was kept, as vLLM counts it), offline conditional
    acceptance, offline per-depth accuracy."""
    series = []
    if "acceptance_length" in report and "per_position_reached" in report:
        series.append(("online: share of verifier steps accepting draft i (vLLM)", report["per_position_accepted"],
                       report["per_position_reached"]))
    off = report.get("offline")
    if off and "per_position_reached" in off:
        series.append(("offline: P(accept | earlier accepted)", off["per_position_accepted"],
                       off["per_position_reached"]))
        series.append(("offline: per-depth accuracy", off["per_depth_correct"], off["per_depth_weight"]))
    return series


def _plot_title(report: dict[str, Any]) -> str:
    lines = []
    if "acceptance_length" in report:
        lines.append(f"online: acceptance length {report['acceptance_length']:.3f} (K={report['num_draft_tokens']}, "
                     f"{report['num_turns']} turns, {report['num_drafts']} verifier steps with drafts)")
    off = report.get("offline")
    if off:
        lines.append(f"offline: simulated acceptance length {off['simulated_acceptance_length']:.3f} "
                     f"({off['positions_scored']} positions, {len(off.get('blocks', []))} blocks)")
    return "\n".join(lines)


def write_acceptance_plot(report: dict[str, Any], path: str | Path) -> Path:
    """PNG of acceptance per draft position with 95% Wilson intervals and the count under each bar.

    Bars: online per-position acceptance (``report``'s own keys) and offline conditional acceptance
    (``report["offline"]``); points: offline per-depth accuracy. The title gives the acceptance
    lengths. An offline-only run passes ``{"offline": offline_report}``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = _plot_series(report)
    K = max((len(t) for _, _, t in series), default=0)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * K + 2), 4.2))
    bars = [s for s in series if "accuracy" not in s[0]]
    width = 0.64 / max(len(bars), 1)  # the bars of a position span [-0.32, 0.32]; accuracy points at +0.42
    for j, (label, succ, trials) in enumerate(series):
        is_bar = "accuracy" not in label
        offset = (j - (len(bars) - 1) / 2) * width if is_bar else 0.42
        xs = [i + offset for i in range(len(trials))]
        p = [a / n if n else float("nan") for a, n in zip(succ, trials)]
        ci = [wilson_interval(a, n) for a, n in zip(succ, trials)]
        err = [[max(0.0, v - c[0]) if c else 0.0 for v, c in zip(p, ci)],  # max: rounding at p = 0 or 1
               [max(0.0, c[1] - v) if c else 0.0 for v, c in zip(p, ci)]]
        if is_bar:
            ax.bar(xs, [0 if n == 0 else v for v, n in zip(p, trials)], width=width * 0.95, label=label,
                   yerr=err, capsize=3, color=f"C{j}", ecolor="0.3")
            for x, n, c in zip(xs, trials, ci):
                ax.annotate(f"n={n}", (x, c[1] if c else 0.0), xytext=(0, 3), textcoords="offset points",
                            ha="center", fontsize=7, color="0.25")
        else:
            ax.errorbar(xs, p, yerr=err, fmt="kD", ms=4, capsize=3, label=label)
    ax.set_xticks(range(K))
    ax.set_xlim(-0.6, max(K, 1) - 0.4)
    ax.set_ylim(0, 1.08)
    ax.set_xlabel("draft position (0 = first drafted token)")
    ax.set_ylabel("fraction (whiskers: 95% Wilson interval)")
    ax.set_title(_plot_title(report) or "no acceptance data", fontsize=9)
    fig.tight_layout()
    if series:  # below the axes, so it never hides a bar
        fig.subplots_adjust(bottom=0.24)
        fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=7, frameon=False)
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
