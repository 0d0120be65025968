"""Is speculative decoding's greedy output the verifier's greedy output? Decided as the dtype allows.

Speculative decoding verifies K + 1 tokens in one pass; plain decoding reads one token per pass. The two
compute the same logits with different kernels and accumulation orders, so in bfloat16 (8 significant
bits: a logit of magnitude 16 is held to 2^4 * 2^-7 = 0.125) two candidates whose logits are that close
can swap places between the two passes (vLLM RFC #54506: batch-invariant numerics). A correct drafter
would then fail an exact check on every GPU serving bf16. In float32 (24 significant bits) the two
passes agree to ~1e-6 and the check stays exact.

The rule (:func:`compare_to_greedy`), per prompt turn, at the first position ``j`` where the outputs
differ (after it they continue from different prefixes and are not compared):
- float32 or float64 (:data:`EXACT_DTYPES`): any difference fails;
- otherwise the difference is a **near-tie divergence**, accepted and counted, only when the speculative
  token is among the reference's :data:`TOP_K` best at ``j`` and its logit there is below the reference's
  top logit ``z1`` by at most :func:`tie_tolerance` = :data:`TIE_ULPS` units in the last place of the
  dtype at ``|z1|`` (``ulp(z) = 2^floor(log2 |z|) * eps``, ``eps = torch.finfo(dtype).eps``, 2^-7 for
  bf16); any other difference fails. (Not only the second-best: bf16 logits are quantized, so several
  tokens often share the top value; on SmolLM2 a tie of margin 0 swapped the top token for the third.)
The logits are the reference's own (plain decoding's, the dtype's values read as float32).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["EXACT_DTYPES", "TIE_ULPS", "TOP_K", "dtype_name", "logit_ulp", "tie_tolerance", "compare_to_greedy",
           "greedy_check_summary"]

EXACT_DTYPES = ("float32", "float64")
"""Dtypes in which speculative decoding's greedy output must equal plain greedy decoding's token for token."""

TOP_K = 20
"""How many of the reference's best logits are kept per token for the near-tie rule (vLLM's default
``max_logprobs``)."""

TIE_ULPS = 8
"""Near-tie width in units in the last place of the dtype at the top logit (:func:`tie_tolerance`): twice the
largest change of the top-2 margin between one-token decoding and (K+1)-token passes measured on SmolLM2-135M in
bf16 on CPU (5 ulps; ``bench/bench_bf16_margins.py``, docs/benchmarks.md)."""


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` or ``"bfloat16"`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def logit_ulp(z: float, dtype: torch.dtype | str) -> float:
    """The spacing of ``dtype``'s numbers at ``|z|``: ``2^floor(log2 |z|) * finfo(dtype).eps`` (``eps``
    below 1: a logit smaller than 1 in magnitude is held to at least that)."""
    eps = torch.finfo(getattr(torch, dtype_name(dtype))).eps
    return eps * 2.0 ** math.floor(math.log2(max(abs(z), 1.0)))


def tie_tolerance(z1: float, dtype: torch.dtype | str) -> float:
    """The widest logit gap below the top at which ``dtype``'s numerics may swap two tokens: 0 for
    :data:`EXACT_DTYPES`, else :data:`TIE_ULPS` ``* logit_ulp(z1, dtype)`` (bf16 at ``z1 = 20``: 1.0)."""
    return 0.0 if dtype_name(dtype) in EXACT_DTYPES else TIE_ULPS * logit_ulp(z1, dtype)


def compare_to_greedy(tokens: Sequence[int], reference: Sequence[int],
                      reference_top_logits: Sequence[dict[int, float]] | None,
                      dtype: torch.dtype | str) -> dict[str, Any]:
    """Compare one turn's speculative ``tokens`` with plain greedy decoding's ``reference`` (module rule).

    Args:
        tokens, reference: generated token ids of the turn.
        reference_top_logits: per reference token, ``{token id: logit}`` of the reference's :data:`TOP_K`
            best logits there; None when not recorded (then every difference fails).
        dtype: the dtype both decodings ran in.

    Returns:
        ``{"identical": bool, "consistent": bool, "divergence": None | {...}}``: ``identical`` token for
        token; ``consistent`` identical or a near-tie divergence; ``divergence`` at the first difference:
        ``position``, ``reference_token``, ``token`` (None when one output is a prefix of the other),
        ``margin`` (``z1`` minus the reference's logit of ``token``; None when ``token`` is not among its
        best), ``tolerance``, ``near_tie``.
    """
    tokens, reference = list(tokens), list(reference)
    if tokens == reference:
        return {"identical": True, "consistent": True, "divergence": None}
    j = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    token = tokens[j] if j < len(tokens) else None
    ref_token = reference[j] if j < len(reference) else None
    top = reference_top_logits[j] if reference_top_logits is not None and j < len(reference_top_logits) else None
    margin = tolerance = None
    near = False
    if top and token is not None and ref_token is not None:
        z1 = max(top.values())
        tolerance = tie_tolerance(z1, dtype)
        if token in top:
            margin = z1 - top[token]
            near = margin <= tolerance
    return {"identical": False, "consistent": near,
            "divergence": {"position": j, "reference_token": ref_token, "token": token, "margin": margin,
                           "tolerance": tolerance, "near_tie": near}}


def greedy_check_summary(dtype, checks: Sequence[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The top-level identity keys of a T = 0 report from each turn's ``(prompt id,``
    :func:`compare_to_greedy` ``result)``.

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
            "(peagle_train/generate/identity.py)")
    return {"identical_to_greedy": all(c["identical"] for _, c in checks), "near_tie_divergences": len(near),
            "near_tie_prompts": list(dict.fromkeys(pid for pid, _ in near)), "mismatches": mismatches,
            "greedy_check": {"dtype": name, "rule": rule}}
