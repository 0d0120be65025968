"""Online speculative decoding with a P-EAGLE drafter and a transformers verifier.

Algorithm: speculative decoding (Leviathan et al., 2023, arXiv:2211.17192; Chen et al., 2023,
arXiv:2302.01318), greedy or with rejection sampling, with the drafter of P-EAGLE (arXiv:2602.01469),
which drafts all K tokens in one parallel pass.

Legend: t index of the last token the verifier has read, K drafted tokens per step, H verifier hidden
size, L aux layers, V verifier vocab, D draft vocab, E drafter elements in one pass, N cached drafter
elements, nkv / hd drafter key-value heads / head dim.

One step, in the alignment of docs/design.md §4: the verifier has read ``x_0..x_t`` (they are in its KV
cache) and has emitted ``x_{t+1}``.
1. One drafter pass over the depth-0 elements ``(a, 0)`` not yet cached (token ``x_{a+1}``, feature
   ``g_a``) and the chain ``(t, 1..K-1)`` (mask token, ``mask_hidden``). Sorted (depth-0 by anchor,
   then the chain) the attention rule of §8 is exactly a causal mask, so the keys and values of the
   depth-0 elements never change once computed: :class:`DrafterSession` caches them (every layer)
   and each step runs only the ``n + 1`` new depth-0 elements and the ``K - 1`` chain elements.
   Element ``(t, d)`` drafts ``x_{t+d+2}``.
2. One verifier pass over ``[x_{t+1}, draft_1..draft_K]`` with the KV cache; its logits at input i
   are the verifier's distribution for the token after it.
3. :func:`accept_drafts`: greedy (temperature 0) keeps the longest prefix of drafts equal to the
   verifier's argmax plus the verifier's argmax after it (the bonus token); with temperature T > 0
   draft i is kept with probability ``min(1, p_i(x)/q_i(x))`` and the first rejected one is replaced
   by a sample of ``norm(max(0, p_i - q_i))``, which keeps the verifier's distribution exactly
   (``p_i = softmax(z_i / T)``). ``q_i`` depends on how drafts are picked (``draft_sample_method``,
   vLLM's ``SpeculativeConfig`` field and values): ``greedy`` (vLLM's default, so what users serve)
   drafts the drafter's argmax and takes ``q_i`` one-hot, so draft x is kept with probability
   ``p_i(x)`` and a rejection samples ``p_i`` with x's mass removed (vLLM 0.32
   ``rejection_sampler.py``, ``NO_DRAFT_PROBS``); ``probabilistic`` samples x from
   ``q_i = softmax(drafter logits / T)`` (0 outside the draft vocab). The verifier cache (full
   keys/values also for sliding-window layers, masked by the window) is cut back to the accepted
   tokens and their aux features feed the drafter. A hybrid verifier's recurrent state (gated DeltaNet,
   Mamba-2) cannot be cut back: it is put back to the state after the accepted tokens from the per-token
   states transformers records in the pass where it does (5.25), else from a copy taken before the pass,
   fed the accepted tokens again (snapshot and recompute, 5.19; :func:`~peagle_train.generate.verifier.keep_fed`).

The chain (:func:`speculative_generate`) and the tree (:func:`peagle_train.generate.tree.tree_generate`)
share their set-up and loop (:func:`run_decoder`); each brings its step.

Under greedy decoding every token emitted is the verifier's argmax given the tokens before it, so
the output is the verifier's own greedy output token for token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from peagle_train.generate.identity import TOP_K
from peagle_train.generate.verifier import (aux_hidden_states, keep_fed, new_cache, record_token_states,
                                            recurrent_layers, rollback_cache, snapshot_state, verifier_body_pass,
                                            verifier_pass)
from peagle_train.model.attention import DenseAttention
from peagle_train.model.dflash import DFlashDrafter
from peagle_train.model.drafter import DrafterCache
from stores.errors import InputError
from runtime.model_cache import load_generation_config

__all__ = [
    "DRAFT_SAMPLE_METHODS",
    "Truncation",
    "truncate_logits",
    "target_probs",
    "served_truncation",
    "GenerationResult",
    "DecodeContext",
    "DrafterSession",
    "DFlashSession",
    "drafter_session",
    "accept_drafts",
    "acceptance_scheme",
    "aux_features",
    "check_compatible",
    "check_draft_sample_method",
    "draft_tokens",
    "eos_set",
    "prompt_tensor",
    "record_step",
    "greedy_generate",
    "plain_generate",
    "propose_drafts",
    "run_decoder",
    "speculative_generate",
]

DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
"""How drafts are picked at temperature > 0: vLLM's ``SpeculativeConfig.draft_sample_method`` values
(vLLM 0.32's default ``greedy``: the drafter's argmax, taken as certain, q one-hot, in rejection sampling;
``probabilistic``: a sample of the drafter's ``softmax(logits / T)``, accepted with ``min(1, p/q)``)."""



@dataclass
class GenerationResult:
    """What one generation produced and how.

    ``tokens`` are the new tokens only (the prompt excluded), EOS included when it was emitted.
    For plain decoding the per-step lists are empty and ``drafted`` is 0.
    """

    tokens: list[int]
    """Generated verifier token ids, at most ``max_new_tokens``."""
    accepted_per_step: list[int] = field(default_factory=list)
    """Drafts accepted and emitted in each verifier step (0..K); each step emitted ``accepted + 1``
    tokens, so ``1 + sum(accepted + 1) == len(tokens)``. A step that ends at an EOS counts only the
    drafts before the EOS (the EOS takes the verifier token's place; later drafts are discarded)."""
    drafted_per_step: list[int] = field(default_factory=list)
    """Drafts scored in each verifier step: K, or fewer near ``max_new_tokens``, or, in a step that
    ends at an EOS, the drafts before the EOS (the EOS position and later ones are not scored)."""
    wall_time_s: float = 0.0
    """Seconds from the prefill to the last token."""
    top_logits: list[dict[int, float]] = field(default_factory=list)
    """Plain greedy decoding with ``top_logits=True``: per generated token, the verifier's
    :data:`~peagle_train.generate.identity.TOP_K` largest logits there, ``{token id: logit}``, for
    :func:`peagle_train.generate.identity.compare_to_greedy`; empty otherwise."""
    restored_steps: int = 0
    """Steps after which a verifier with recurrent layers (linear attention, state space) had its state put back
    to the kept tokens, because the step rejected a draft (:func:`~peagle_train.generate.verifier.keep_fed`); 0
    for attention-only verifiers, whose keys and values are cut back instead."""
    recomputed_steps: int = 0
    """Of :attr:`restored_steps`, those whose state was put back to the snapshot taken before the step and fed
    the kept tokens again (one more verifier pass); the others used the per-token states transformers recorded
    (:func:`~peagle_train.generate.verifier.record_token_states`)."""

    @property
    def drafted(self) -> int:
        return sum(self.drafted_per_step)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_per_step)

    @property
    def verifier_steps(self) -> int:
        """Verifier passes after the prefill (the prefill emits the first token)."""
        return len(self.accepted_per_step)


def _eos_set(eos_token_id: int | Iterable[int] | None) -> set[int]:
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(e) for e in eos_token_id}


def check_compatible(verifier, drafter) -> None:
    """Check that ``drafter`` was built for ``verifier``'s shapes.

    Raises:
        InputError: hidden size, vocabulary or aux layer ids do not fit the verifier.
    """
    vcfg = verifier.config.get_text_config()  # a multimodal wrapper's language model
    dcfg = drafter.config
    n_layers = vcfg.num_hidden_layers
    problems = []
    if dcfg.hidden_size != vcfg.hidden_size:
        problems.append(f"hidden size {dcfg.hidden_size} != verifier's {vcfg.hidden_size}")
    if dcfg.vocab_size != vcfg.vocab_size:
        problems.append(f"vocab size {dcfg.vocab_size} != verifier's {vcfg.vocab_size}")
    bad = [layer for layer in dcfg.aux_layer_ids if not 0 <= layer <= n_layers]
    if bad:
        problems.append(f"aux layers {bad} outside the verifier's hidden states 0..{n_layers} "
                        f"(it has {n_layers} decoder layers)")
    if problems:
        raise InputError(
            "the drafter does not match the verifier (" + "; ".join(problems) + "); pass the "
            f"verifier it was trained for (its config names {dcfg.verifier_name_or_path!r})",
            field="--verifier",
        )


def aux_features(hidden_states: Sequence[torch.Tensor], last: dict[str, torch.Tensor],
                 layer_ids: Sequence[int]) -> torch.Tensor:
    """HF ``output_hidden_states`` (each ``[1, T, H]``) -> ``g [T, L*H]``: layer l < L is entry l, layer L
    the last decoder layer's output before the final norm (``last["last"]``, from
    :func:`peagle_train.generate.verifier.aux_hidden_states`), as extraction stores it and vLLM feeds it."""
    top = len(hidden_states) - 1
    return torch.cat([(last["last"] if layer == top else hidden_states[layer])[0] for layer in layer_ids], dim=-1)


# ------------------------------------------------------------------------------------------ drafter
class DrafterSession:
    """Incremental drafting for one sequence: the drafter's keys/values of depth-0 elements are cached.

    Feed it the depth-0 elements as they become known and ask for K drafts in the same pass::

        session.draft(new_tokens, new_aux, k)   # -> [k, D] draft logits of elements (t, 0..k-1)

    ``new_tokens [n]`` are ``x_{a+1}`` and ``new_aux [n, L*H]`` are ``g_a`` of the next n anchors
    (first call: the whole prompt). Drafters that are not a ``PEagleDrafter`` (anything with the same
    ``forward``/``logits`` interface but no ``layers``) are run over the whole context each step.
    """

    def __init__(self, drafter):
        self.drafter = drafter
        self.cached = hasattr(drafter, "layers")
        self.n_ctx = 0  # depth-0 elements seen (anchors 0..n_ctx-1)
        self.cache = DrafterCache() if self.cached else None  # keys/values of the depth-0 elements
        self.tokens: list[torch.Tensor] = []  # recompute path: all x_{a+1} and g_a so far
        self.aux: list[torch.Tensor] = []
        p = next(drafter.parameters())
        self.device, self.dtype = p.device, p.dtype

    @torch.no_grad()
    def draft(self, new_tokens: torch.Tensor, new_aux: torch.Tensor, k: int) -> torch.Tensor:
        """Add ``n ≥ 1`` depth-0 elements and draft ``k ≥ 1`` tokens: ``[k, D]`` draft-vocab logits."""
        n = new_tokens.numel()
        assert n >= 1 and k >= 1 and new_aux.shape[0] == n, (n, k, tuple(new_aux.shape))
        E = n + k - 1
        input_ids = torch.zeros(E, dtype=torch.long, device=self.device)
        input_ids[:n] = new_tokens.to(self.device)
        g = torch.zeros(E, new_aux.shape[1], dtype=self.dtype, device=self.device)
        g[:n] = new_aux.to(self.device, self.dtype)
        is_mask = torch.arange(E, device=self.device) >= n
        # depth 0: element (a, 0) is at position a + 1; the chain (t, d) at t + 1 + d.
        position_ids = torch.arange(self.n_ctx + 1, self.n_ctx + E + 1, device=self.device)
        if self.cached:
            hidden = self._forward_cached(input_ids, g, is_mask, position_ids, n)  # [E, H]
        else:
            hidden = self._forward_full(input_ids, g, n)
        self.n_ctx += n
        return self.drafter.logits(hidden[n - 1:])  # [k, D]: elements (t, 0..k-1)

    def _forward_full(self, input_ids: torch.Tensor, g: torch.Tensor, n: int) -> torch.Tensor:
        self.tokens.append(input_ids[:n])
        self.aux.append(g[:n])
        ids = torch.cat(self.tokens + [input_ids[n:]])  # [N + E - n]
        feats = torch.cat(self.aux + [g[n:]])
        E = ids.numel()
        is_mask = torch.arange(E, device=self.device) >= self.n_ctx + n
        pos = torch.arange(1, E + 1, device=self.device)
        mask = torch.ones(E, E, dtype=torch.bool, device=self.device).tril()  # §8 rule for this order
        return self.drafter(ids, feats, is_mask, pos, mask)[self.n_ctx:]

    def _forward_cached(self, input_ids, g, is_mask, position_ids, n: int) -> torch.Tensor:
        """:meth:`PEagleDrafter.forward` over the new elements with the session's
        :class:`~peagle_train.model.drafter.DrafterCache` (the ``n`` new depth-0 elements join it)."""
        E, N = input_ids.numel(), self.n_ctx
        # depth-0 by anchor then the chain: the §8 rule is causal after the N cached elements
        mask = torch.ones(E, N + E, dtype=torch.bool, device=self.device).tril(N)  # [E, N+E]
        return self.drafter(input_ids, g[:n], is_mask, position_ids, DenseAttention(mask=mask), cache=self.cache)


class DFlashSession:
    """Drafting for one sequence with a DFlash drafter (docs/design.md §8b), the :class:`DrafterSession` interface:
    ``draft(new_tokens, new_aux, k)`` adds the verifier's features ``g_a`` of the rows it has now read
    (``new_aux [n, L*H]``; ``new_tokens [n]`` are ``x_{a+1}``, the last of them the newest token ``x_{t+1}``) and
    drafts k tokens from one block of the anchor ``x_{t+1}`` and K mask tokens (K the run's drafts per step, as
    vLLM's block at ``num_speculative_tokens`` K) against the context ``g_0..g_t``. The drafter runs over the whole
    context each step (no cache)."""

    def __init__(self, drafter, num_drafts: int):
        self.drafter, self.num_drafts = drafter, int(num_drafts)
        self.aux: list[torch.Tensor] = []

    @torch.no_grad()
    def draft(self, new_tokens: torch.Tensor, new_aux: torch.Tensor, k: int) -> torch.Tensor:
        """Add ``n >= 1`` rows and draft ``1 <= k <= K`` tokens: ``[k, D]`` draft-vocab logits."""
        assert new_tokens.numel() >= 1 and new_aux.shape[0] == new_tokens.numel(), (tuple(new_tokens.shape),
                                                                                    tuple(new_aux.shape))
        self.aux.append(new_aux)
        return self.drafter.draft(torch.cat(self.aux), int(new_tokens[-1]), k, self.num_drafts)


def drafter_session(drafter, num_drafts: int) -> DrafterSession | DFlashSession:
    """The decoding session of ``drafter``'s kind for K = ``num_drafts`` drafts a step: :class:`DFlashSession`
    for a DFlash drafter (it drafts a block), else :class:`DrafterSession` (P-EAGLE's chains)."""
    return DFlashSession(drafter, num_drafts) if isinstance(drafter, DFlashDrafter) else DrafterSession(drafter)


@torch.no_grad()
def draft_tokens(drafter, tokens: torch.Tensor, aux: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
    """One drafter pass without a cache: draft ``x_{t+2}..x_{t+K+1}`` from ``x_1..x_{t+1}``, ``g_0..g_t``.

    Args:
        drafter: a ``PEagleDrafter``.
        tokens: ``[t+2] int64``, the sequence ``x_0..x_{t+1}``.
        aux: ``[t+1, L*H]`` float, the verifier's aux features ``g_0..g_t``.
        num_draft_tokens: K ≥ 1.

    Returns:
        ``[K] int64`` verifier token ids (the argmax draft ids mapped through ``drafter.draft_ids``).
    """
    n_ctx = aux.shape[0]
    logits = DrafterSession(drafter).draft(tokens[1:n_ctx + 1], aux, num_draft_tokens)  # [K, D]
    return drafter.draft_ids[logits.argmax(-1)]


# ------------------------------------------------------------------------------------------ sampling
@dataclass(frozen=True)
class Truncation:
    """The top-k / top-p truncation of the verifier's distribution at T > 0, as vLLM's sampler applies a request's
    ``top_k`` / ``top_p`` (:func:`truncate_logits`); the defaults are off. Greedy decoding (T = 0) is unchanged by
    it (the argmax is always kept).

    Raises:
        ValueError: ``top_k < 0`` or ``top_p`` outside ``(0, 1]``, naming the option.
    """

    top_k: int = 0
    """Keep the tokens whose logit is at least the k-th largest (ties at the k-th kept); 0 = off (--top-k)."""
    top_p: float = 1.0
    """Keep the most probable tokens, after top-k, up to probability mass top_p (at least one); 1 = off (--top-p)."""

    def __post_init__(self) -> None:
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"--top-k must be an integer >= 0 (0: off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1] (1: off), got {self.top_p}")

    @property
    def off(self) -> bool:
        return self.top_k == 0 and self.top_p == 1.0


def truncate_logits(logits: torch.Tensor, truncation: Truncation) -> torch.Tensor:
    """``logits [..., V]`` (already divided by T) with the tokens outside top-k / top-p set to ``-inf``: vLLM 0.32's
    ``apply_top_k_top_p_pytorch`` (``vllm/v1/sample/ops/topk_topp_sampler.py``, the rule its rejection sampler
    applies to the verifier's logits): sort ascending; top-k masks the logits below the k-th largest; top-p masks
    the sorted tokens whose cumulative probability (after top-k) is ``<= 1 - top_p``, the largest always kept.
    A ``top_k >= V`` is off. Returns a new float32 tensor."""
    out = logits.float().clone()
    if truncation.off:
        return out
    V = out.shape[-1]
    flat = out.reshape(-1, V)  # [N, V]
    ordered, index = flat.sort(dim=-1, descending=False)  # [N, V]
    if 0 < truncation.top_k < V:
        kth = ordered[:, V - truncation.top_k].unsqueeze(1)  # [N, 1] the k-th largest
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    if truncation.top_p < 1.0:
        cum = ordered.softmax(dim=-1).cumsum(dim=-1)  # [N, V]
        drop = cum <= 1 - truncation.top_p
        drop[:, -1] = False
        ordered = ordered.masked_fill(drop, float("-inf"))
    return flat.scatter(-1, index, ordered).reshape(out.shape)


def target_probs(logits: torch.Tensor, temperature: float, truncation: Truncation = Truncation()) -> torch.Tensor:
    """The verifier's distribution at ``temperature > 0``: ``softmax(truncate(logits / T))`` float32 on CPU, the
    distribution vLLM samples from and verifies drafts against (``logits [V]`` or ``[N, V]``)."""
    return torch.softmax(truncate_logits(logits.float().cpu() / temperature, truncation), -1)


def served_truncation(verifier_name: str, top_k: int | None = None,
                      top_p: float | None = None) -> tuple[Truncation, dict[str, Any]]:
    """The top-k / top-p a vLLM server of MODEL ``verifier_name`` applies by default, with the given ones in their
    place: vLLM 0.32 (its ``generation_config`` default ``auto``, ``ModelConfig.get_diff_sampling_param``) takes a request's unset
    ``top_k`` / ``top_p`` from the model's ``generation_config.json`` (else the one its ``config.json`` implies).

    Returns:
        ``(truncation, record)``: the record gives ``top_k``, ``top_p`` and where each came from (``option``,
        ``generation_config``, or ``off``: neither sets it), for reports and manifests.

    Raises:
        ValueError: a value out of range (:class:`Truncation`).
    """
    own = load_generation_config(verifier_name)
    values, record = {}, {}
    for name, given, off in (("top_k", top_k, 0), ("top_p", top_p, 1.0)):
        served = own.to_diff_dict().get(name)  # the values the file sets, as vLLM reads them
        value, source = (given, "option") if given is not None else (served, "generation_config") \
            if served is not None else (off, "off")
        if name == "top_k" and value is not None and value < 0:  # vLLM's -1: off
            value = 0
        values[name] = value
        record.update({name: value, f"{name}_from": source})
    return Truncation(int(values["top_k"]), float(values["top_p"])), record


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One id from ``probs [V]`` (need not sum to 1)."""
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator))


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None,
          truncation: Truncation = Truncation()) -> int:
    """The next token from verifier ``logits [V]``: argmax at temperature 0, else a sample of :func:`target_probs`."""
    if temperature == 0:
        return int(logits.argmax())
    return _sample(target_probs(logits, temperature, truncation), generator)


def propose_drafts(draft_logits: torch.Tensor, draft_ids: torch.Tensor, vocab_size: int, temperature: float,
                   generator: torch.Generator | None,
                   draft_sample_method: str = "greedy") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Drafts ``[k]`` (verifier ids) from ``draft_logits [k, D]``, and their distributions ``q [k, V]``.

    ``greedy`` (any temperature) or temperature 0: the argmax, ``q`` None (one-hot at the draft, as
    vLLM's ``draft_sample_method="greedy"`` treats it). ``probabilistic`` at T > 0: one sample per
    depth from ``softmax(logits / T)`` over the draft vocab, placed on the verifier vocab (0 outside it).
    """
    ids = draft_ids.cpu()
    if temperature == 0 or draft_sample_method == "greedy":
        return ids[draft_logits.argmax(-1).cpu()], None
    q_draft = torch.softmax(draft_logits.float().cpu() / temperature, -1)  # [k, D]
    picks = torch.multinomial(q_draft, 1, generator=generator)[:, 0]  # [k] draft ids
    q = torch.zeros(q_draft.shape[0], vocab_size)
    q[:, ids] = q_draft  # [k, V]
    return ids[picks], q


def accept_drafts(drafts: torch.Tensor, target_logits, temperature: float = 0.0,
                  draft_probs: torch.Tensor | None = None,
                  generator: torch.Generator | None = None,
                  truncation: Truncation = Truncation()) -> tuple[int, torch.Tensor]:
    """Verify ``k`` drafts against the verifier: how many are kept, and the tokens the step emits.

    Rows of ``target_logits`` are read in order and only up to the first rejection.

    Args:
        drafts: ``[k] int64`` verifier ids.
        target_logits: ``[k+1, V]`` (a tensor, or anything whose ``[i]`` gives row i): the
            verifier's logits after ``x_{t+1}`` and after each draft.
        temperature: 0 for greedy verification; T > 0 for rejection sampling of ``p = softmax(z / T)``, truncated
            by ``truncation`` (:func:`target_probs`, as vLLM; the drafts' ``q`` is not truncated, as vLLM's).
        draft_probs: ``[k, V]`` the distributions the drafts were sampled from (T > 0,
            ``probabilistic``), or None: each draft taken as certain (q one-hot; ``greedy`` drafting).
        generator: the randomness (T > 0 only).

    Returns:
        ``(n, emitted [n+1])``: the first n drafts, then the bonus token (greedy: the verifier's
        argmax; sampling: a sample of the residual ``norm(max(0, p_n - q_n))`` after a rejection, which
        for a one-hot ``q_n`` is ``p_n`` without the rejected draft, or of ``p_k`` when all k were kept).
        Draft i is kept when ``u * q_i(x) < p_i(x)``, ``u ~ U[0, 1)``: with probability
        ``min(1, p_i(x) / q_i(x))``, which is ``p_i(x)`` for a one-hot q (vLLM 0.32 keeps it when
        ``p / q >= u``, the same up to a measure-zero event).
    """
    k = drafts.numel()
    assert temperature == 0 or draft_probs is None or draft_probs.shape[0] == k
    for i in range(k):
        x = int(drafts[i])
        if temperature == 0:
            best = int(target_logits[i].argmax())
            if best == x:
                continue
            return i, torch.cat([drafts[:i], torch.tensor([best])])
        p = target_probs(target_logits[i], temperature, truncation)  # [V]
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if float(torch.rand((), generator=generator)) * q_x < float(p[x]):
            continue  # kept with probability min(1, p/q)
        if draft_probs is None:  # one-hot q: max(0, p - q) is p without the draft
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0)  # [V]
        if float(residual.sum()) <= 0:  # p == q up to rounding: any sample of p is right
            residual = p
        return i, torch.cat([drafts[:i], torch.tensor([_sample(residual, generator)])])
    return k, torch.cat([drafts, torch.tensor([_pick(target_logits[k], temperature, generator, truncation)])])


def acceptance_scheme(temperature: float, draft_sample_method: str) -> str:
    """How a run's drafts were accepted, in words, for reports and plots: greedy verification at T = 0,
    else rejection sampling at T with vLLM's ``draft_sample_method`` (:func:`accept_drafts`)."""
    if temperature == 0:
        return "greedy verification (T=0)"
    how = ("argmax draft, q one-hot: kept with prob. p" if draft_sample_method == "greedy"
           else "draft sampled from q: kept with prob. min(1, p/q)")
    return f"rejection sampling at T={temperature:g}, draft_sample_method={draft_sample_method} ({how})"


def _prompt_tensor(prompt_ids) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().cpu()
    if ids.numel() == 0:
        raise InputError("the prompt is empty (0 tokens)")
    return ids


def _check_temperature(temperature: float) -> float:
    if not temperature >= 0:
        raise InputError(f"the temperature must be >= 0, got {temperature}", field="--temperature")
    return float(temperature)


@torch.no_grad()
def plain_generate(verifier, prompt_ids, max_new_tokens: int, eos_token_id: int | Iterable[int] | None = None,
                   temperature: float = 0.0, generator: torch.Generator | None = None,
                   top_logits: bool = False,
                   on_tokens: Callable[[list[int]], None] | None = None,
                   truncation: Truncation = Truncation()) -> GenerationResult:
    """Plain decoding with a KV cache, one verifier pass per token (the baseline).

    Args:
        verifier: a transformers causal LM (batch 1).
        prompt_ids: ``[P]`` int token ids.
        max_new_tokens: most tokens generated; generation also stops after an EOS token.
        eos_token_id: one id, several, or None.
        temperature: 0 = greedy; T > 0 samples ``softmax(z / T)`` truncated by ``truncation`` (:func:`target_probs`)
            with ``generator``.
        top_logits: at T = 0, also record each step's largest logits (``GenerationResult.top_logits``).
        on_tokens: called with each new token, as a one-element list, as it is emitted (streaming, progress).

    Returns:
        :class:`GenerationResult` with ``tokens`` (and ``top_logits``).
    """
    temperature = _check_temperature(temperature)
    ids = _prompt_tensor(prompt_ids)
    eos = _eos_set(eos_token_id)
    start = time.perf_counter()
    tokens: list[int] = []
    tops: list[dict[int, float]] = []
    record = top_logits and temperature == 0
    if max_new_tokens > 0:
        cache = new_cache(verifier)
        logits, _ = verifier_pass(verifier, ids, cache, want_hidden=False, last_only=True)
        while True:
            tokens.append(_pick(logits[-1], temperature, generator, truncation))
            if record:
                top = torch.topk(logits[-1], min(TOP_K, logits.shape[-1]))
                tops.append(dict(zip(top.indices.tolist(), top.values.tolist())))
            if on_tokens is not None:
                on_tokens(tokens[-1:])
            if len(tokens) >= max_new_tokens or tokens[-1] in eos:
                break
            logits, _ = verifier_pass(verifier, torch.tensor([tokens[-1]]), cache, want_hidden=False)
    return GenerationResult(tokens=tokens, wall_time_s=time.perf_counter() - start, top_logits=tops)


def greedy_generate(verifier, prompt_ids, max_new_tokens: int,
                    eos_token_id: int | Iterable[int] | None = None) -> GenerationResult:
    """Plain greedy decoding: :func:`plain_generate` at temperature 0."""
    return plain_generate(verifier, prompt_ids, max_new_tokens, eos_token_id)


def _record_step(result: GenerationResult, emitted: list[int], k: int, eos: set[int]) -> None:
    """Append one step's ``emitted`` tokens (cut after the first EOS) and its counters to ``result``.

    Counting convention (docs/design.md §9): a step emits ``accepted + 1`` tokens; its last emitted
    token plays the verifier token's role. When that token is an EOS, the EOS ends the output
    whether it was drafted or not, so the position holding it and every position after it are not
    scored: ``accepted = drafted = drafts before the EOS``. Without an EOS ``accepted`` is the
    number of drafts kept and ``drafted`` is ``k``. So ``1 + Σ(accepted + 1) == len(tokens)``.
    """
    cut = next((i for i, tok in enumerate(emitted) if tok in eos), None)
    if cut is not None:
        emitted = emitted[:cut + 1]
    result.tokens.extend(emitted)
    result.accepted_per_step.append(len(emitted) - 1)
    result.drafted_per_step.append(k if cut is None else min(k, cut))


def checked_num_draft_tokens(num_draft_tokens: int | None, drafter) -> int:
    """K drafts per step: ``num_draft_tokens``, default the drafter's trained ``num_depths``.

    Drafting past the trained depths is refused (docs/design.md §9): depth ``d >= num_depths`` was
    never trained (its position ids and mask-token chains never occurred in training), so its drafts
    would be measured as if they were the drafter's.

    Raises:
        InputError: ``K < 1`` or ``K > num_depths``.
    """
    trained = int(drafter.config.num_depths)
    K = trained if num_draft_tokens is None else int(num_draft_tokens)
    if K < 1:
        raise InputError(f"the number of draft tokens must be at least 1, got {K}", field="--num-draft-tokens")
    if K > trained:
        raise InputError(f"--num-draft-tokens {K} exceeds the drafter's trained num_depths {trained}: depths "
                         f"{trained}..{K - 1} were never trained; use at most {trained} (or train with "
                         f"--num-depths {K})", field="--num-draft-tokens")
    return K


def check_draft_sample_method(draft_sample_method: str) -> str:
    """``draft_sample_method`` if it is one of vLLM's values (:data:`DRAFT_SAMPLE_METHODS`).

    Raises:
        InputError: another value.
    """
    if draft_sample_method not in DRAFT_SAMPLE_METHODS:
        raise InputError(f"the draft sample method must be one of {', '.join(DRAFT_SAMPLE_METHODS)} (vLLM's "
                         f"draft_sample_method), got {draft_sample_method!r}", field="--draft-sample-method")
    return draft_sample_method


def _checked_settings(verifier, drafter, num_draft_tokens: int | None, temperature: float) -> tuple[int, float]:
    """``(K, temperature)`` of :func:`speculative_generate`, checked (1 ≤ K ≤ num_depths, T ≥ 0, the
    drafter fits)."""
    K = checked_num_draft_tokens(num_draft_tokens, drafter)
    temperature = _check_temperature(temperature)
    check_compatible(verifier, drafter)
    return K, temperature


@dataclass
class DecodeContext:
    """What the chain and tree decoders share between steps (:func:`run_decoder`): the verifier's cache, the
    drafter's session and the depth-0 elements not yet given to it."""

    verifier: Any
    drafter: Any
    cache: Any
    """The verifier's :func:`~peagle_train.generate.verifier.rollback_cache`."""
    session: DrafterSession | DFlashSession
    recurrent: bool
    """The verifier has recurrent layers (:func:`~peagle_train.generate.verifier.recurrent_layers`)."""
    hook: dict[str, torch.Tensor]
    """:func:`~peagle_train.generate.verifier.aux_hidden_states`' output: the last decoder layer's output."""
    past: int
    """Tokens in the verifier's cache: ``x_0..x_t`` (P = t + 1)."""
    new_tokens: torch.Tensor
    """``[n] int64`` tokens ``x_{a+1}`` of the depth-0 elements not yet given to the drafter."""
    new_aux: torch.Tensor
    """``[n, L*H]`` their features ``g_a``."""

    def features(self, hidden_states) -> torch.Tensor:
        """``[n, L*H]`` aux features of the newest verifier pass (:func:`aux_features`)."""
        return aux_features(hidden_states, self.hook, self.drafter.config.aux_layer_ids)


Step = Callable[[DecodeContext, int, int], tuple[list[int], int]]
"""One decoder step: ``(context, x_{t+1}, k) -> (emitted tokens, drafted count)``; it drafts at most k ≥ 0 tokens,
verifies them, leaves the cache holding ``x_0..x_{t+1}`` and the kept tokens, and updates the context."""


def run_decoder(verifier, drafter, prompt_ids, max_new_tokens: int, K: int, eos_token_id, result: GenerationResult,
                pick: Callable[[torch.Tensor], int], step: Step,
                on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """The set-up and loop the chain (:func:`speculative_generate`) and tree
    (:func:`~peagle_train.generate.tree.tree_generate`) decoders share: the prefill (its last logits ``[V]`` go
    to ``pick`` for the first token), then ``step`` with ``k = min(K, max_new_tokens - generated - 1)`` until
    ``max_new_tokens`` tokens or an EOS; each step's tokens are recorded (:func:`record_step`) and streamed to
    ``on_tokens``. Fills ``result`` (tokens, counts, ``wall_time_s``) and returns it.

    Raises:
        InputError: an empty prompt.
    """
    ids = _prompt_tensor(prompt_ids)
    eos = _eos_set(eos_token_id)
    start = time.perf_counter()
    if max_new_tokens <= 0:
        return result
    with aux_hidden_states(verifier) as hook:
        cache = rollback_cache(verifier)
        logits, hs = verifier_pass(verifier, ids, cache, want_hidden=True, last_only=True)
        result.tokens.append(pick(logits[-1]))
        if on_tokens is not None:
            on_tokens(result.tokens[:])
        recurrent = bool(recurrent_layers(cache))
        if recurrent:  # per-token states from here on, where transformers records them (not for the prefill)
            record_token_states(cache, K + 1)
        # depth-0 elements for the drafter: tokens x_1..x_{t+1} and features g_0..g_t
        ctx = DecodeContext(verifier, drafter, cache, drafter_session(drafter, K), recurrent, hook, past=ids.numel(),
                            new_tokens=torch.cat([ids[1:], torch.tensor(result.tokens)]), new_aux=torch.empty(0))
        ctx.new_aux = ctx.features(hs)
        while len(result.tokens) < max_new_tokens and result.tokens[-1] not in eos:
            k = min(K, max_new_tokens - len(result.tokens) - 1)
            emitted, drafted = step(ctx, result.tokens[-1], k)
            before = len(result.tokens)
            _record_step(result, emitted, drafted, eos)
            if on_tokens is not None:
                on_tokens(result.tokens[before:])
    result.wall_time_s = time.perf_counter() - start
    return result


@torch.no_grad()
def speculative_generate(verifier, drafter, prompt_ids, max_new_tokens: int, num_draft_tokens: int | None = None,
                         eos_token_id: int | Iterable[int] | None = None, temperature: float = 0.0,
                         generator: torch.Generator | None = None,
                         draft_sample_method: str = "greedy",
                         on_tokens: Callable[[list[int]], None] | None = None,
                         truncation: Truncation = Truncation()) -> GenerationResult:
    """Speculative decoding: the drafter drafts K tokens, the verifier checks them in one pass.

    Near the end a step drafts only ``min(K, max_new_tokens - generated - 1)`` tokens, so no token
    beyond ``max_new_tokens`` is ever computed or emitted; tokens after an EOS are dropped. A verifier with
    recurrent layers (linear attention, state space) has its state put back to the kept tokens after a step
    that rejected a draft (``GenerationResult.restored_steps``; ``recomputed_steps`` those that fed them again).

    Args:
        verifier: a transformers causal LM (batch 1) that returns ``hidden_states``.
        drafter: a ``PEagleDrafter`` built for ``verifier`` (see :func:`check_compatible`).
        prompt_ids: ``[P]`` int token ids.
        max_new_tokens: most tokens generated.
        num_draft_tokens: K ≥ 1 drafts per step; default the drafter's ``num_depths``.
        eos_token_id: one id, several, or None.
        temperature: 0 = greedy (output identical to :func:`greedy_generate`); T > 0 = speculative
            sampling, distributed exactly as :func:`plain_generate` at T.
        generator: the randomness at T > 0.
        draft_sample_method: at T > 0, how drafts are picked, as vLLM's ``SpeculativeConfig`` field:
            ``greedy`` (vLLM's default: the drafter's argmax, q one-hot) or ``probabilistic`` (sampled
            from the drafter's ``softmax(logits / T)``); both keep the verifier's distribution, their
            acceptance differs (:func:`accept_drafts`). Ignored at T = 0.
        on_tokens: called with the new tokens of the prefill and of each step, as they are emitted (streaming).
        truncation: at T > 0, vLLM's top-k / top-p of the verifier's distribution (:func:`target_probs`).

    Returns:
        :class:`GenerationResult` with the tokens and per-step drafted/accepted counts.

    Raises:
        InputError: empty prompt, K < 1, T < 0, an unknown ``draft_sample_method``, or a drafter that does
            not match the verifier.
    """
    K, temperature = _checked_settings(verifier, drafter, num_draft_tokens, temperature)
    check_draft_sample_method(draft_sample_method)
    vocab = verifier.config.get_text_config().vocab_size
    result = GenerationResult(tokens=[])

    def step(ctx: DecodeContext, root: int, k: int) -> tuple[list[int], int]:
        drafts, q = torch.zeros(0, dtype=torch.long), None
        if k > 0:
            draft_logits = ctx.session.draft(ctx.new_tokens, ctx.new_aux, k)  # [k, D]
            drafts, q = propose_drafts(draft_logits, drafter.draft_ids, vocab, temperature, generator,
                                       draft_sample_method)
        fed = torch.cat([torch.tensor([root]), drafts])  # [k+1]: x_{t+1}, drafts
        snapshot = snapshot_state(ctx.cache, ctx.past)
        logits, hs = verifier_body_pass(verifier, fed, ctx.cache)  # [k+1, V]
        n, emitted = accept_drafts(drafts, logits, temperature, q, generator, truncation)  # [n+1]
        features = ctx.features(hs)[:n + 1]  # anchors t+1..t+n+1; before a recompute pass replaces the hook's output
        # x_{t+1} and the n accepted drafts are now read; the rest of the pass is discarded.
        result.recomputed_steps += keep_fed(verifier, ctx.cache, fed, n + 1, snapshot)
        result.restored_steps += ctx.recurrent and n < k
        ctx.past += n + 1
        if k > 0:
            ctx.new_tokens, ctx.new_aux = emitted, features
        return emitted.tolist(), k

    return run_decoder(verifier, drafter, prompt_ids, max_new_tokens, K, eos_token_id, result,
                       lambda logits: _pick(logits, temperature, generator, truncation), step, on_tokens)


# Public names of the helpers above, for the other decoders of this package (tree.py)
eos_set = _eos_set
prompt_tensor = _prompt_tensor
record_step = _record_step
