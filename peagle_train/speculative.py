"""Online greedy speculative decoding with a P-EAGLE drafter and a transformers verifier.

Algorithm: speculative decoding (Leviathan et al., 2023, "Fast Inference from Transformers via
Speculative Decoding", arXiv:2211.17192) in its greedy form, with the drafter of P-EAGLE
(arXiv:2602.01469), which drafts all K tokens in one parallel pass.

Legend: T tokens read by the verifier so far, K drafted tokens per step, H verifier hidden size,
L aux layers, V verifier vocab, D draft vocab, E drafter elements.

One step, in the alignment of DESIGN.md §4: the verifier has read ``x_0..x_t`` (they are in its KV
cache, and their aux features ``g_0..g_t`` are kept) and has emitted ``x_{t+1}``.
1. One drafter pass over the depth-0 elements ``(a, 0)`` for ``a = 0..t`` (token ``x_{a+1}``,
   feature ``g_a``) and the chain ``(t, 1..K-1)`` (mask token, ``mask_hidden``). Sorted this way the
   attention rule of §8 is exactly a causal mask. Element ``(t, d)`` drafts ``x_{t+d+2}``.
2. One verifier pass over ``[x_{t+1}, draft_1..draft_K]`` with the KV cache; its argmax at input i
   is the verifier's own choice for the token after it.
3. Accept the longest prefix of drafts equal to the verifier's argmax (n tokens), append the
   verifier's argmax after it (the bonus token), crop the cache to the accepted tokens, keep their
   aux features. The step emits n + 1 tokens.

Under greedy decoding the emitted tokens are exactly the verifier's own greedy tokens: every token
emitted is the verifier's argmax given the tokens before it. The drafter is recomputed over the
whole context every step (it is one layer; no drafter KV cache).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from stores.errors import InputError

__all__ = [
    "GenerationResult",
    "check_compatible",
    "greedy_generate",
    "speculative_generate",
    "draft_tokens",
]


@dataclass
class GenerationResult:
    """What one generation produced and how.

    ``tokens`` are the new tokens only (the prompt excluded), EOS included when it was emitted.
    For plain greedy decoding the per-step lists are empty and ``drafted`` is 0.
    """

    tokens: list[int]
    """Generated verifier token ids, at most ``max_new_tokens``."""
    accepted_per_step: list[int] = field(default_factory=list)
    """Drafts accepted in each verifier step (0..K); each step emitted ``accepted + 1`` tokens."""
    drafted_per_step: list[int] = field(default_factory=list)
    """Drafts checked in each verifier step (K, or fewer near ``max_new_tokens``)."""
    wall_time_s: float = 0.0
    """Seconds from the prefill to the last token."""

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
    vcfg = verifier.config
    dcfg = drafter.config
    n_layers = vcfg.num_hidden_layers
    problems = []
    if dcfg.hidden_size != vcfg.hidden_size:
        problems.append(f"hidden size {dcfg.hidden_size} != verifier's {vcfg.hidden_size}")
    if dcfg.vocab_size != vcfg.vocab_size:
        problems.append(f"vocab size {dcfg.vocab_size} != verifier's {vcfg.vocab_size}")
    bad = [layer for layer in dcfg.aux_layer_ids if not 0 <= layer <= n_layers]
    if bad:
        problems.append(f"aux layers {bad} outside the verifier's hidden states 0..{n_layers}")
    if problems:
        raise InputError(
            "the drafter does not match the verifier (" + "; ".join(problems) + "); pass the "
            f"verifier it was trained for (its config names {dcfg.verifier_name_or_path!r})",
            field="--verifier",
        )


def _aux_features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """HF ``output_hidden_states`` (each ``[1, T, H]``) -> ``g [T, L*H]`` (layer l is entry l)."""
    return torch.cat([hidden_states[layer][0] for layer in layer_ids], dim=-1)


@torch.no_grad()
def draft_tokens(drafter, tokens: torch.Tensor, aux: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
    """One drafter pass: draft ``x_{t+2}..x_{t+K+1}`` from ``x_1..x_{t+1}`` and ``g_0..g_t``.

    Args:
        drafter: a ``PEagleDrafter``; ``num_draft_tokens`` may exceed its trained depth
            (extra depths are simply untrained).
        tokens: ``[t+2] int64``, the sequence ``x_0..x_{t+1}`` (prompt and generated tokens).
        aux: ``[t+1, L*H]`` float, the verifier's aux features ``g_0..g_t``.
        num_draft_tokens: K ≥ 1.

    Returns:
        ``[K] int64`` verifier token ids (draft ids mapped through ``drafter.draft_ids``).
    """
    K = num_draft_tokens
    n_ctx = aux.shape[0]  # t + 1 depth-0 elements
    device = drafter.d2t.device
    E = n_ctx + K - 1
    input_ids = torch.zeros(E, dtype=torch.long, device=device)
    input_ids[:n_ctx] = tokens[1:n_ctx + 1].to(device)  # x_{a+1}
    g = torch.zeros(E, aux.shape[1], dtype=aux.dtype, device=device)
    g[:n_ctx] = aux.to(device)
    is_mask = torch.arange(E, device=device) >= n_ctx
    # depth 0: position a + 1; chain (t, d): t + 1 + d, i.e. element index + 1 in both cases.
    position_ids = torch.arange(1, E + 1, device=device)
    attn_mask = torch.ones(E, E, dtype=torch.bool, device=device).tril()  # §8 rule for this order
    dtype = next(drafter.parameters()).dtype
    hidden = drafter(input_ids, g.to(dtype), is_mask, position_ids, attn_mask)  # [E, H]
    logits = drafter.logits(hidden[n_ctx - 1:])  # [K, D]: elements (t, 0..K-1)
    return drafter.draft_ids[logits.argmax(-1)]


def _new_cache(verifier):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=verifier.config)
    except TypeError:  # older transformers
        return DynamicCache()


def _cache_kwarg(verifier) -> str:
    """transformers ≥ 5.x names the cache argument ``cache``; earlier versions ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(verifier.forward).parameters else "past_key_values"


def _crop_cache(cache, keep_tokens: int) -> None:
    """Cut ``cache`` back to its first ``keep_tokens`` tokens (negative ``crop`` = tokens to remove)."""
    remove = cache.get_seq_length() - keep_tokens
    assert remove >= 0, (cache.get_seq_length(), keep_tokens)
    if remove > 0:
        cache.crop(-remove)


def _verifier_pass(verifier, ids: torch.Tensor, cache, want_hidden: bool):
    """Feed ``ids [n]`` after the cached tokens; returns (argmax ``[n]``, hidden_states or None)."""
    device = next(verifier.parameters()).device
    out = verifier(input_ids=ids.to(device)[None], use_cache=True, output_hidden_states=want_hidden,
                   **{_cache_kwarg(verifier): cache})
    return out.logits[0].argmax(-1).cpu(), (out.hidden_states if want_hidden else None)


def _prompt_tensor(prompt_ids) -> torch.Tensor:
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().cpu()
    if ids.numel() == 0:
        raise InputError("the prompt is empty (0 tokens)")
    return ids


@torch.no_grad()
def greedy_generate(verifier, prompt_ids, max_new_tokens: int,
                    eos_token_id: int | Iterable[int] | None = None) -> GenerationResult:
    """Plain greedy decoding with a KV cache, one verifier pass per token (the baseline).

    Args:
        verifier: a transformers causal LM (batch 1).
        prompt_ids: ``[P]`` int token ids.
        max_new_tokens: most tokens generated; generation also stops after an EOS token.
        eos_token_id: one id, several, or None.

    Returns:
        :class:`GenerationResult` with ``tokens`` only.
    """
    ids = _prompt_tensor(prompt_ids)
    eos = _eos_set(eos_token_id)
    start = time.perf_counter()
    tokens: list[int] = []
    if max_new_tokens > 0:
        cache = _new_cache(verifier)
        nxt, _ = _verifier_pass(verifier, ids, cache, want_hidden=False)
        tokens.append(int(nxt[-1]))
        while len(tokens) < max_new_tokens and tokens[-1] not in eos:
            nxt, _ = _verifier_pass(verifier, torch.tensor([tokens[-1]]), cache, want_hidden=False)
            tokens.append(int(nxt[-1]))
    return GenerationResult(tokens=tokens, wall_time_s=time.perf_counter() - start)


@torch.no_grad()
def speculative_generate(verifier, drafter, prompt_ids, max_new_tokens: int, num_draft_tokens: int | None = None,
                         eos_token_id: int | Iterable[int] | None = None) -> GenerationResult:
    """Greedy speculative decoding: the drafter drafts K tokens, the verifier checks them in one pass.

    Near the end a step drafts only ``min(K, max_new_tokens - generated - 1)`` tokens, so no token
    beyond ``max_new_tokens`` is ever computed or emitted; tokens after an EOS are dropped.

    Args:
        verifier: a transformers causal LM (batch 1) that returns ``hidden_states``.
        drafter: a ``PEagleDrafter`` built for ``verifier`` (see :func:`check_compatible`).
        prompt_ids: ``[P]`` int token ids.
        max_new_tokens: most tokens generated.
        num_draft_tokens: K ≥ 1 drafts per step; default the drafter's ``num_depths``.
        eos_token_id: one id, several, or None.

    Returns:
        :class:`GenerationResult` with the tokens and per-step drafted/accepted counts.

    Raises:
        InputError: empty prompt, K < 1, or a drafter that does not match the verifier.
    """
    K = drafter.config.num_depths if num_draft_tokens is None else int(num_draft_tokens)
    if K < 1:
        raise InputError(f"the number of draft tokens must be at least 1, got {K}", field="--num-draft-tokens")
    check_compatible(verifier, drafter)
    ids = _prompt_tensor(prompt_ids)
    eos = _eos_set(eos_token_id)
    layers = drafter.config.aux_layer_ids
    result = GenerationResult(tokens=[])
    start = time.perf_counter()
    if max_new_tokens <= 0:
        return result
    cache = _new_cache(verifier)
    nxt, hs = _verifier_pass(verifier, ids, cache, want_hidden=True)
    aux = _aux_features(hs, layers).float().cpu()  # [t+1, L*H]: g_0..g_t
    seq = torch.cat([ids, nxt[-1:]])  # [t+2]: x_0..x_{t+1}
    result.tokens.append(int(nxt[-1]))
    while len(result.tokens) < max_new_tokens and result.tokens[-1] not in eos:
        k = min(K, max_new_tokens - len(result.tokens) - 1)
        drafts = draft_tokens(drafter, seq, aux, k).cpu() if k > 0 else seq[:0]  # [k]
        verify_in = torch.cat([seq[-1:], drafts])  # [k+1]: x_{t+1}, drafts
        target, hs = _verifier_pass(verifier, verify_in, cache, want_hidden=True)  # [k+1]
        n = int((drafts == target[:k]).long().cumprod(0).sum()) if k > 0 else 0
        emitted = torch.cat([drafts[:n], target[n:n + 1]])  # [n+1]: accepted drafts, bonus
        # x_{t+1} and the n accepted drafts are now read; the rest of the pass is discarded.
        _crop_cache(cache, seq.numel() + n)
        aux = torch.cat([aux, _aux_features(hs, layers)[:n + 1].float().cpu()])
        seq = torch.cat([seq, emitted])
        result.accepted_per_step.append(n)
        result.drafted_per_step.append(k)
        for tok in emitted.tolist():
            result.tokens.append(tok)
            if tok in eos:
                break
    result.wall_time_s = time.perf_counter() - start
    return result
