"""The Python inference API: load a P-EAGLE drafter and its verifier once, then generate (docs/design.md §9).

::

    engine = PEAGLEInference(drafter_checkpoint="checkpoints/best_model", target_model="smollm2-135m",
                             speculation_depth=4)
    result = engine.generate("Explain quantum computing:", max_tokens=100, measure_speedup=True)
    result.text, result.token_ids, result.acceptance_length, result.acceptance_rate, result.speedup

One implementation: ``peagle-eval``'s online path (:func:`peagle_train.evaluate.online.evaluate_prompts`)
generates through :meth:`PEAGLEInference.generate_ids`. Decoding is peagle's own (transformers, batch 1,
float32: :func:`~peagle_train.generate.speculative.speculative_generate`, or with a tree
:func:`~peagle_train.generate.tree.tree_generate`); ``engine="vllm"`` generates through vLLM
(:mod:`peagle_train.generate.vllm_engine`).

Counts, as vLLM reports them and ``peagle-eval`` does (docs/design.md §3, §9):
- **acceptance length** ``AL = 1 + accepted / num_drafts``: the tokens emitted by the verifier steps that
  checked at least one draft, per such step (each emits ``accepted + 1``);
- **acceptance rate** = accepted drafts / drafted tokens (a tree counts its depths as drafted, as the chain of
  that depth would);
- **per-position acceptance** i: the share of steps that checked draft i in which draft i was accepted;
- **tokens/s** = generated tokens / the generation's wall time (prefill included);
- **speedup** = speculative tokens/s ÷ plain-decoding tokens/s, both measured in the same call on the same
  prompt (``measure_speedup=True``): > 1 means speculative decoding was faster.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from peagle_train.generate.checks import (check_drafter_tokenizer, check_tree_verifier, check_verifier_config,
                                          trained_template_kwargs)
from peagle_train.generate.render import eos_ids, render_messages, turn_text
from peagle_train.generate.speculative import (GenerationResult, Truncation, check_compatible, checked_num_draft_tokens,
                                               plain_generate, speculative_generate)
from peagle_train.generate.vllm_engine import VllmSpeculativeEngine
from peagle_train.generate.tree import (TreeGenerationResult, TreeSpec, check_tree_sampling, check_tree_supported,
                                        tree_depth, tree_generate)
from peagle_train.model.checkpoint import check_servable_checkpoint, find_drafter, load_drafter
from peagle_train.train.kinds import DRAFTER_KINDS, check_any_servable, checkpoint_kind
from peagle_train.model.drafter import PEagleDrafter
from peagle_train.model.warm_start import load_init_weights, read_init_source
from stores.errors import InputError
from runtime.model_cache import load_tokenizer, load_verifier, model_files

__all__ = ["PEAGLEInference", "InferenceResult", "StreamChunk", "acceptance_summary", "load_for_decoding",
           "load_any_drafter"]

Prompt = str | Sequence[dict[str, Any]] | Sequence[int]
"""A prompt: text (plain completion, no chat template), chat messages (``[{"role", "content": str}]``, rendered
with the verifier's chat template and a generation prompt), or token ids."""


def acceptance_summary(results: Sequence[GenerationResult], K: int) -> dict[str, Any]:
    """The acceptance counts of ``results`` together, as vLLM counts them (module docstring).

    Returns:
        ``acceptance_length`` (1.0 when no draft was checked), ``acceptance_rate`` (None: nothing drafted),
        ``per_position_acceptance`` (K values, None where no step reached position i), ``per_position_accepted``,
        ``per_position_reached``, ``num_drafts`` (steps that checked ≥ 1 draft), ``drafted``, ``accepted``.
    """
    steps = accepted = drafted = 0
    reached, at = [0] * K, [0] * K
    for r in results:
        for n, k in zip(r.accepted_per_step, r.drafted_per_step):
            if k == 0:  # no draft scored: max_new_tokens left no room, or the first draft's place was an EOS
                continue
            steps += 1
            accepted += n
            drafted += k
            for i in range(min(k, K)):
                reached[i] += 1
                at[i] += int(n > i)
    return {
        "acceptance_length": 1.0 + (accepted / steps if steps else 0.0),
        "acceptance_rate": accepted / drafted if drafted else None,
        "per_position_acceptance": [a / r if r else None for a, r in zip(at, reached)],
        "per_position_accepted": at, "per_position_reached": reached,
        "num_drafts": steps, "drafted": drafted, "accepted": accepted,
    }


@dataclass
class InferenceResult:
    """One prompt's generation by :class:`PEAGLEInference` (counts: module docstring)."""

    text: str
    """The generated text: special tokens kept, the EOS that ended it left out, not cleaned up."""
    token_ids: list[int]
    """Generated verifier token ids (prompt excluded), the ending EOS included."""
    finish_reason: str
    """``stop`` (it ended with an EOS) or ``length`` (at ``max_new_tokens``)."""
    prompt_tokens: int
    """Tokens of the rendered prompt."""
    acceptance_length: float
    """AL = 1 + accepted / num_drafts (tokens per verifier step that checked drafts); 1.0 when none did."""
    acceptance_rate: float | None
    """Accepted drafts / drafted tokens; None when nothing was drafted."""
    per_position_acceptance: list[float | None]
    """Per draft position i < K: accepted_i / reached_i."""
    num_drafts: int
    """Verifier steps that checked at least one draft."""
    drafted: int
    """Drafted tokens scored (a tree: its depths per step)."""
    accepted: int
    """Drafts accepted and emitted."""
    tokens_per_second: float | None
    """Generated tokens / wall time of the speculative generation (prefill included)."""
    wall_time_s: float
    """Seconds of the speculative generation."""
    speedup: float | None = None
    """Speculative tokens/s ÷ plain-decoding tokens/s on the same prompt in the same call (``measure_speedup``);
    None when not measured (``engine="vllm"`` refuses to: see :meth:`PEAGLEInference.generate`)."""
    baseline_tokens_per_second: float | None = None
    """Plain decoding's tokens/s (``measure_speedup``)."""
    identical_to_plain: bool | None = None
    """Greedy with ``measure_speedup``: the tokens equal plain greedy decoding's (they must); else None."""
    tree_nodes: int | None = None
    """Tree verification: nodes the verifier checked in all (the roots excluded); None for the chain."""
    engine: str = "peagle"
    """Which engine generated: ``peagle`` or ``vllm``."""
    vllm_counters: dict[str, Any] | None = None
    """``engine="vllm"``: the change of vLLM's spec-decode counters over the request (``num_drafts``,
    ``num_draft_tokens``, ``num_accepted_tokens``, ``accepted_per_pos``)."""
    speculative: GenerationResult | None = field(default=None, repr=False)
    """The decoder's own record (per-step counts)."""
    plain: GenerationResult | None = field(default=None, repr=False)
    """Plain decoding's record (``measure_speedup``)."""


@dataclass(frozen=True)
class StreamChunk:
    """What :meth:`PEAGLEInference.stream` yields: a verifier step's new tokens and text; the last chunk
    carries the whole :class:`InferenceResult`."""

    token_ids: list[int]
    """Tokens emitted since the previous chunk."""
    text: str
    """Their text (held back while it ends inside a multi-byte character)."""
    result: InferenceResult | None = None
    """Only on the last chunk (which has no tokens)."""


def load_for_decoding(drafter, verifier_name: str):
    """The verifier, and ``drafter`` (a loaded ``PEagleDrafter``) moved to it, as online decoding runs them:
    float32, on the verifier's device. float32 everywhere: a K+1-token verify pass and one-token decoding then
    agree to ~1e-6, so near-ties cannot flip an argmax the way they do in bf16. The caller runs the checks first.

    Returns:
        ``(verifier, drafter)``.
    """
    verifier = load_verifier(verifier_name, dtype=torch.float32)
    return verifier, drafter.eval().to(next(verifier.parameters()).device, torch.float32)


def load_any_drafter(path: str | Path, speculation_depth: int | None):
    """A drafter checkpoint of any layout ``--init-from`` reads, without the verifier's rows yet.

    A peagle checkpoint of either kind, P-EAGLE or DFlash (or a ``peagle-train`` output: its ``final/``, else its
    newest ``checkpoint-N``) loads as saved. A native vLLM P-EAGLE drafter (``PeagleLlamaForCausalLM``, ...) records no trained depth: give
    ``speculation_depth``, taken as its ``num_depths``; its missing embedding is the verifier's
    (``finish(verifier)`` copies it). An EAGLE-3 drafter is refused: it has no trained mask hidden state, so
    its depths ≥ 1 would draft from an untrained input.

    Returns:
        ``(directory, drafter, finish)``; ``finish(verifier)`` completes the drafter (a no-op for peagle's).

    Raises:
        StoreFormatError, InputError: not a drafter of those layouts, or one that cannot draft exactly.
    """
    directory, _ = find_drafter(path)
    kind = checkpoint_kind(directory)
    if kind is not DRAFTER_KINDS["peagle"]:  # another kind's checkpoint (DFlash) loads as saved
        check_any_servable(directory)
        return directory, kind.load(directory), lambda verifier: None
    source = read_init_source(directory)
    if source.format == "peagle":
        check_servable_checkpoint(directory)
        return directory, load_drafter(directory), lambda verifier: None
    if source.mask_token_id is None or "mask_hidden" not in source.names:
        raise InputError(f"{directory} is an {source.format} drafter without a mask token or a trained mask "
                         "hidden state: its depths >= 1 would draft from an untrained input; train it as a P-EAGLE "
                         "drafter first (peagle-train --init-from)", field="drafter_checkpoint")
    if speculation_depth is None:
        raise InputError(f"{directory} ({source.format} layout) records no trained number of depths: give "
                         "speculation_depth (the K it was trained for)", field="speculation_depth")
    drafter = PEagleDrafter(replace(source.config, num_depths=int(speculation_depth),
                                    mask_token_id=int(source.mask_token_id)))

    def finish(verifier) -> None:
        drafter.init_from_verifier(verifier.get_input_embeddings().weight.detach().cpu().float(),
                                   verifier.get_output_embeddings().weight.detach().cpu().float(), d2t=source.d2t)
        load_init_weights(source, drafter)

    return directory, drafter, finish


class _StreamClosed(Exception):
    """Raised in :meth:`PEAGLEInference.stream`'s worker thread when its reader has closed the stream."""


class _Handoff:
    """A stream's decoding thread and its reader, one verifier step at a time: the thread hands each step's
    tokens over and waits (:meth:`hand_over`) until the reader asks for more (:meth:`more`); after
    :meth:`close` that wait raises :class:`_StreamClosed`, so the decoding unwinds before its next step."""

    def __init__(self) -> None:
        self._items: queue.Queue = queue.Queue()
        self._more = threading.Semaphore(0)
        self._closed = threading.Event()

    def hand_over(self, tokens: list[int]) -> None:
        """The decoding thread's ``on_tokens``: hand ``tokens`` to the reader and wait for its next read.

        Raises:
            _StreamClosed: the reader closed the stream.
        """
        self._items.put(list(tokens))
        self._more.acquire()
        if self._closed.is_set():
            raise _StreamClosed

    def finish(self, outcome: InferenceResult | BaseException) -> None:
        """The decoding thread's last item: the result, or the error to raise in the reader."""
        self._items.put(outcome)

    def take(self) -> list[int] | InferenceResult | BaseException:
        """The next item for the reader (waits for it)."""
        return self._items.get()

    def more(self) -> None:
        """The reader wants the next step."""
        self._more.release()

    def close(self) -> None:
        """The reader is gone: the decoding thread's wait ends in :class:`_StreamClosed`."""
        self._closed.set()
        self._more.release()


class PEAGLEInference:
    """A P-EAGLE drafter and its verifier, loaded once, for generation from Python (module docstring).

    Args:
        drafter_checkpoint: a drafter directory of any ``--init-from`` layout, or a ``peagle-train`` output.
        target_model: the verifier: a name (the embedded ``smollm2-135m``, a hub id), or a directory; None = the
            verifier the drafter's config names.
        speculation_depth: K drafts per verifier step (1 ≤ K ≤ the drafter's trained ``num_depths``; default
            ``num_depths``); a dynamic tree's depth.
        tree: tree verification (greedy only): a :class:`~peagle_train.generate.tree.TreeSpec`, ``{"topk":
            [k_0, ...]}`` (fixed) or ``{"nodes": N}`` (dynamic); None = the chain.
        engine: ``peagle`` (transformers, float32, this process) or ``vllm`` (one vLLM engine with the drafter,
            ``speculative_config`` loading; greedy, chain, no streaming, no speedup: plain decoding would need a
            second engine, ``peagle-eval --engine vllm`` runs both; :meth:`close` stops it). vLLM 0.32-0.33 only:
            a newer vLLM no longer serves P-EAGLE and is refused before anything loads
            (:func:`runtime.vllm_runtime.check_vllm_serves_peagle`).
        chat_template_kwargs: the chat template's variables for message prompts (e.g. ``{"enable_thinking":
            False}``), as vLLM's ``chat_template_kwargs``; None: the mode the drafter was trained in (its
            checkpoint's record, :func:`~peagle_train.generate.checks.trained_template_kwargs`; none if unrecorded).
        warmup: run one short untimed generation now, so one-time costs do not count in tokens/s.

    Raises:
        InputError, StoreFormatError, StoreMismatchError, ModelNotFoundError: before any verifier weights load
            (the drafter against the verifier's config and tokenizer, K, the tree).
    """

    def __init__(self, drafter_checkpoint: str | Path, target_model: str | None = None,
                 speculation_depth: int | None = None, tree: TreeSpec | dict | None = None, engine: str = "peagle",
                 chat_template_kwargs: dict[str, Any] | None = None, warmup: bool = True):
        if engine not in ("peagle", "vllm"):
            raise InputError(f"engine must be 'peagle' or 'vllm', got {engine!r}", field="engine")
        if engine == "vllm":  # a vLLM that no longer serves the drafter's kind (P-EAGLE from 0.34), before any loading
            checkpoint_kind(find_drafter(drafter_checkpoint)[0]).check_installed_vllm("engine")
        directory, drafter, finish = load_any_drafter(drafter_checkpoint, speculation_depth)
        name = target_model or drafter.config.verifier_name_or_path
        if not name:
            raise InputError("the drafter's config names no verifier; pass target_model", field="target_model")
        tree = _tree_spec(tree)
        if engine == "vllm" and tree is not None:
            raise InputError("vLLM verifies P-EAGLE drafts as a chain (its tree attention was removed, vLLM PR "
                             "#42121): use engine='peagle' for a tree", field="tree")
        K = tree_depth(tree, speculation_depth, drafter) if tree is not None else \
            checked_num_draft_tokens(speculation_depth, drafter)
        check_verifier_config(name, drafter)  # before the weights load
        if tree is not None:
            check_tree_verifier(name)  # a hybrid verifier's tree: refused before its weights load
        check_drafter_tokenizer(directory, model_files(name))
        if chat_template_kwargs is None:
            chat_template_kwargs = trained_template_kwargs(directory)
        self.drafter_dir, self.verifier_name, self.engine = directory, str(name), engine
        self.tokenizer = load_tokenizer(name)
        self._vllm = None
        if engine == "vllm":
            self.verifier = self.drafter = None
            self._vllm = VllmSpeculativeEngine(self.verifier_name, directory, K, self.tokenizer)
        else:
            self.verifier, self.drafter = load_for_decoding(drafter, name)
            finish(self.verifier)
            self.drafter.to(next(self.verifier.parameters()).device, torch.float32)
        self._setup(K, tree, chat_template_kwargs)
        if warmup and engine == "peagle":
            self.warm_up(self.encode("Hello"))
        elif warmup:
            self._vllm.generate(self.encode("Hello"), 4)

    @classmethod
    def from_models(cls, verifier, drafter, tokenizer, speculation_depth: int | None = None,
                    tree: TreeSpec | dict | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None) -> PEAGLEInference:
        """The API over models already loaded (float32, the drafter on the verifier's device), as ``peagle-eval``
        loads them; no warm-up.

        Raises:
            InputError: the drafter does not match the verifier; K or the tree does not fit it.
        """
        self = cls.__new__(cls)
        check_compatible(verifier, drafter)
        tree = _tree_spec(tree)
        K = tree_depth(tree, speculation_depth, drafter) if tree is not None else \
            checked_num_draft_tokens(speculation_depth, drafter)
        self.drafter_dir = self.verifier_name = None
        self.engine, self.verifier, self.drafter, self.tokenizer = "peagle", verifier, drafter, tokenizer
        self._vllm = None
        self._setup(K, tree, chat_template_kwargs)
        return self

    def _setup(self, K: int, tree: TreeSpec | None, chat_template_kwargs: dict[str, Any] | None) -> None:
        self.K, self.tree, self.chat_template_kwargs = K, tree, dict(chat_template_kwargs or {})
        if tree is not None:
            check_tree_supported(self.verifier, 0.0)
        self.eos = eos_ids(self.tokenizer, self.verifier) if self.verifier is not None else self._vllm.eos

    # --------------------------------------------------------------------------------------- prompts
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of ``prompt`` (see :data:`Prompt`): text as the tokenizer encodes it (its special tokens,
        e.g. a BOS, added), messages rendered as every peagle stage renders them, ids as they are.

        Raises:
            InputError: an empty prompt, or messages that are not plain chat.
        """
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt, torch.Tensor):
            ids = [int(t) for t in prompt.flatten().tolist()]
        elif len(prompt) and all(isinstance(t, int) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            ids = render_messages(self.tokenizer, list(prompt), self.chat_template_kwargs)
        if not ids:
            raise InputError("the prompt is empty (0 tokens)", field="prompt")
        return list(ids)

    # ------------------------------------------------------------------------------------ generation
    def _speculative(self, ids: list[int], max_new_tokens: int, temperature: float, generator,
                     on_tokens: Callable[[list[int]], None] | None,
                     draft_sample_method: str = "greedy", truncation: Truncation = Truncation()) -> GenerationResult:
        if self.tree is not None:
            return tree_generate(self.verifier, self.drafter, ids, max_new_tokens, self.tree, self.K, self.eos,
                                 temperature, on_tokens=on_tokens)
        return speculative_generate(self.verifier, self.drafter, ids, max_new_tokens, self.K, self.eos, temperature,
                                    generator, draft_sample_method=draft_sample_method, on_tokens=on_tokens,
                                    truncation=truncation)

    def warm_up(self, ids: list[int]) -> None:
        """Two-token untimed generations, plain and speculative, so one-time costs do not count in tokens/s."""
        plain_generate(self.verifier, ids, 2, self.eos)
        self._speculative(ids, 2, 0.0, None, None)

    def generate_ids(self, ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                     seed: int | None = None, measure_speedup: bool = False,
                     on_tokens: Callable[[list[int]], None] | None = None,
                     on_progress: Callable[[int], None] | None = None, top_logits: bool = False,
                     draft_sample_method: str = "greedy", truncation: Truncation = Truncation()
                     ) -> tuple[GenerationResult, GenerationResult | None]:
        """Speculative decoding of ``ids`` and, with ``measure_speedup``, plain decoding of the same ids first
        (each at ``temperature``, each with its own generator seeded ``seed``). ``on_tokens`` gets the
        speculative decoding's new token ids as they are emitted (streaming); ``on_progress`` the number of
        new tokens of both decodings (a progress bar). ``top_logits``: at T = 0 the plain decoding also records
        each step's largest logits (the near-tie rule of :mod:`~peagle_train.generate.identity`).
        ``draft_sample_method``: at T > 0, how drafts are picked (``greedy``, vLLM's default, or ``probabilistic``;
        :func:`~peagle_train.generate.speculative.speculative_generate`). ``truncation``: at T > 0, the top-k / top-p
        of the verifier's distribution, for both decodings (:func:`~peagle_train.generate.speculative.target_probs`).

        Returns:
            ``(speculative, plain or None)`` records.

        Raises:
            InputError: T < 0, a tree at T > 0 (greedy only), an empty prompt.
        """
        if self.tree is not None:
            check_tree_sampling(temperature)  # the rest of check_tree_supported ran at set-up
        gens = [torch.Generator().manual_seed(seed) if (temperature > 0 and seed is not None) else None
                for _ in range(2)]
        counted = (lambda tokens: on_progress(len(tokens))) if on_progress is not None else None
        plain = plain_generate(self.verifier, ids, max_new_tokens, self.eos, temperature, gens[0],
                               top_logits=top_logits, on_tokens=counted, truncation=truncation) if measure_speedup else None

        def emitted(tokens: list[int]) -> None:
            if on_tokens is not None:
                on_tokens(tokens)
            if counted is not None:
                counted(tokens)

        spec = self._speculative(ids, max_new_tokens, temperature, gens[1],
                                 emitted if (on_tokens is not None or counted is not None) else None,
                                 draft_sample_method, truncation)
        return spec, plain

    def generate(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float = 0.0, *,
                 max_tokens: int | None = None, seed: int | None = None, measure_speedup: bool = False,
                 on_tokens: Callable[[list[int]], None] | None = None,
                 draft_sample_method: str = "greedy") -> InferenceResult:
        """Generate a continuation of ``prompt`` with speculative decoding.

        Args:
            prompt: text, chat messages or token ids (:data:`Prompt`).
            max_new_tokens: most tokens generated (``max_tokens`` is the same, vLLM's name).
            temperature: 0 = greedy (the verifier's own greedy output); T > 0 = speculative sampling, distributed
                exactly as the verifier sampled at T (chain only).
            seed: the sampling generator's seed at T > 0: the same seed, the same sample. None (the default): a
                fresh draw each call, from torch's global random generator (as transformers' ``generate``;
                ``torch.manual_seed`` before the calls makes a sequence of unseeded calls repeatable).
            measure_speedup: also run plain decoding of the same prompt and report ``speedup`` (costs that run).
            on_tokens: called with each verifier step's new token ids (streaming; see :meth:`stream`).
            draft_sample_method: at T > 0, how drafts are picked: ``greedy`` (vLLM's default: the drafter's argmax,
                accepted with probability p(draft)) or ``probabilistic`` (sampled from the drafter, accepted with
                min(1, p/q)); both keep the verifier's distribution.

        Returns:
            :class:`InferenceResult`.

        Raises:
            InputError: bad prompt or settings.
        """
        n = _max_new(max_new_tokens, max_tokens)
        ids = self.encode(prompt)
        if self.engine == "vllm":
            return self._vllm_generate(ids, n, temperature, measure_speedup)
        spec, plain = self.generate_ids(ids, n, temperature, seed, measure_speedup, on_tokens,
                                        draft_sample_method=draft_sample_method)
        return self._result(ids, spec, plain, temperature)

    def generate_batch(self, prompts: Sequence[Prompt], max_new_tokens: int = 128, temperature: float = 0.0, *,
                       max_tokens: int | None = None, seed: int | None = None,
                       measure_speedup: bool = False) -> list[InferenceResult]:
        """:meth:`generate` for each of ``prompts``, one after another (peagle's engine decodes one sequence at a
        time; through vLLM each request runs alone too, so its tokens/s is its own). Sampling: prompt i uses seed
        ``seed + i``; unseeded (None), a fresh draw for each prompt."""
        n = _max_new(max_new_tokens, max_tokens)
        return [self.generate(p, n, temperature, seed=None if seed is None else seed + i,
                              measure_speedup=measure_speedup) for i, p in enumerate(prompts)]

    def stream(self, prompt: Prompt, max_new_tokens: int = 128, temperature: float = 0.0, *,
               max_tokens: int | None = None, seed: int | None = None) -> Iterator[StreamChunk]:
        """Generate as :meth:`generate` does, yielding each verifier step's tokens as they are emitted; the last
        chunk has no tokens and carries the :class:`InferenceResult`. Errors are raised from the iterator.

        The decoding runs in a worker thread one verifier step ahead of the reader at most (it waits for the next
        read before its next step). Closing the iterator (``close()``, leaving a ``for`` loop, garbage
        collection) stops the decoding within that step and joins the thread; at interpreter exit an unclosed
        iterator's thread is left waiting outside any computation, so the program exits cleanly.
        """
        if self.engine == "vllm":
            raise InputError("stream() runs peagle's engine only; with engine='vllm' use generate()", field="engine")
        n = _max_new(max_new_tokens, max_tokens)
        ids = self.encode(prompt)
        handoff = _Handoff()

        def work() -> None:
            try:
                spec, plain = self.generate_ids(ids, n, temperature, seed, False, on_tokens=handoff.hand_over)
                handoff.finish(self._result(ids, spec, plain, temperature))
            except _StreamClosed:
                return
            except BaseException as e:  # noqa: BLE001 (handed to the reader)
                handoff.finish(e)

        worker = threading.Thread(target=work, name="peagle-stream", daemon=True)
        worker.start()
        try:
            yield from self._chunks(handoff)
        finally:
            if not sys.is_finalizing():  # at interpreter exit the thread may not run again: leave it waiting
                handoff.close()
                worker.join()

    def _chunks(self, handoff: _Handoff) -> Iterator[StreamChunk]:
        """The reader's side of :meth:`stream`: each step's tokens and their new text, then the result."""
        emitted: list[int] = []
        shown = ""
        while True:
            item = handoff.take()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, InferenceResult):
                yield StreamChunk([], item.text[len(shown):] if item.text.startswith(shown) else "", item)
                return
            emitted.extend(item)
            text = turn_text(self.tokenizer, emitted, self.eos)
            if text.endswith("\ufffd"):  # a multi-byte character not complete yet
                yield StreamChunk(list(item), "")
            else:
                delta = text[len(shown):] if text.startswith(shown) else text
                shown = text
                yield StreamChunk(list(item), delta)
            handoff.more()

    def _vllm_generate(self, ids: list[int], n: int, temperature: float, measure_speedup: bool) -> InferenceResult:
        """One request through the vLLM engine: vLLM's tokens, its per-step counts (it drafts K at every step, also
        where the output is then cut) and the change of its spec-decode counters."""
        if temperature != 0:
            raise InputError("engine='vllm' generates greedily only here (temperature 0); peagle's engine samples "
                             "exactly at T > 0", field="temperature")
        if measure_speedup:
            raise InputError("engine='vllm' cannot measure the speedup in this call: its engine holds the drafter, "
                             "and plain decoding needs a second engine; peagle-eval --engine vllm runs both and "
                             "reports their throughput", field="measure_speedup")
        tokens, steps, seconds, counters = self._vllm.generate(ids, n)
        spec = GenerationResult(tokens=tokens, accepted_per_step=list(steps["accepted"]),
                                drafted_per_step=list(steps["drafted"]), wall_time_s=seconds)
        result = self._result(ids, spec, None, 0.0)
        result.engine, result.vllm_counters = "vllm", counters
        return result

    def close(self) -> None:
        """Stop the vLLM engine (``engine="vllm"``); peagle's engine holds no processes."""
        if self._vllm is not None:
            self._vllm.close()

    def _result(self, ids: list[int], spec: GenerationResult, plain: GenerationResult | None,
                temperature: float) -> InferenceResult:
        counts = acceptance_summary([spec], self.K)
        rate = _rate(len(spec.tokens), spec.wall_time_s)
        base = _rate(len(plain.tokens), plain.wall_time_s) if plain is not None else None
        eos = set(self.eos)
        return InferenceResult(
            text=turn_text(self.tokenizer, spec.tokens, eos), token_ids=list(spec.tokens),
            finish_reason="stop" if spec.tokens and spec.tokens[-1] in eos else "length", prompt_tokens=len(ids),
            acceptance_length=counts["acceptance_length"], acceptance_rate=counts["acceptance_rate"],
            per_position_acceptance=counts["per_position_acceptance"], num_drafts=counts["num_drafts"],
            drafted=counts["drafted"], accepted=counts["accepted"], tokens_per_second=rate,
            wall_time_s=spec.wall_time_s, speedup=rate / base if rate and base else None,
            baseline_tokens_per_second=base,
            identical_to_plain=(spec.tokens == plain.tokens) if plain is not None and temperature == 0 else None,
            tree_nodes=sum(spec.nodes_per_step) if isinstance(spec, TreeGenerationResult) else None,
            engine="peagle", speculative=spec, plain=plain)


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def _max_new(max_new_tokens: int, max_tokens: int | None) -> int:
    n = int(max_tokens if max_tokens is not None else max_new_tokens)
    if n < 1:
        raise InputError(f"max_new_tokens must be >= 1, got {n}", field="max_new_tokens")
    return n


def _tree_spec(tree: TreeSpec | dict | None) -> TreeSpec | None:
    if tree is None or isinstance(tree, TreeSpec):
        return tree
    if not isinstance(tree, dict) or not set(tree) <= {"topk", "nodes"}:
        raise InputError(f"tree must be a TreeSpec, {{'topk': [k_0, ...]}} or {{'nodes': N}}, got {tree!r}",
                         field="tree")
    return TreeSpec(topk=tuple(tree["topk"]) if tree.get("topk") is not None else None, nodes=tree.get("nodes"))
