"""The P-EAGLE attention rule between drafter elements (DESIGN.md §8).

Legend: E drafter elements of one row, sorted by (depth, anchor) as :mod:`peagle_train.cod` returns
them; E0 the depth-0 elements (the first E0 of them).

Element q = (a_q, d_q) may attend element k = (a_k, d_k) iff both are in the same segment and either
``d_k = 0 and a_k <= a_q`` (the verifier-feature context up to the anchor) or
``a_k = a_q and d_k <= d_q`` (its own chain). From P-EAGLE (arXiv:2602.01469), as in the
``speculators`` P-EAGLE flex-attention mask.
"""

from __future__ import annotations

import torch

from peagle_train.cod import CodElements

__all__ = ["build_attention_mask", "attention_mask_reference", "make_mask_mod"]


def build_attention_mask(elements: CodElements) -> torch.Tensor:
    """Dense boolean mask of the §8 rule, built from its structure.

    A query sees one contiguous range of depth-0 keys (its segment's first anchor up to its own
    anchor) plus the keys of its own chain at depths 1..d_q; the range is made with one broadcast
    comparison against ``[lo, hi)`` bounds and the chain keys are found by binary search per depth,
    so nothing evaluates the rule pair by pair.

    Args:
        elements: ``CodElements`` sorted by (depth, anchor), with every chain complete below its
            deepest element (true for ``sample_cod_elements`` and ``all_elements``).

    Returns:
        ``[E, E] bool`` on the elements' device; True where query row may attend key column. Every
        row allows its own element.
    """
    anchor, depth, segment = elements.anchor, elements.depth, elements.segment
    dev = anchor.device
    E = anchor.numel()
    mask = torch.zeros(E, E, dtype=torch.bool, device=dev)
    if E == 0:
        return mask
    n0 = int((depth == 0).sum())
    a0, s0 = anchor[:n0], segment[:n0]  # [E0] sorted by anchor, so segments are non-decreasing
    lo = torch.searchsorted(s0, segment, right=False)  # [E] first depth-0 key of the segment
    hi = torch.searchsorted(a0, anchor, right=True)  # [E] one past the last depth-0 key with a_k <= a_q
    cols = torch.arange(n0, device=dev)  # [E0]
    mask[:, :n0] = (cols[None, :] >= lo[:, None]) & (cols[None, :] < hi[:, None])  # [E, E0]
    rows = torch.arange(E, device=dev)
    max_depth = int(depth.max())
    starts = torch.searchsorted(depth, torch.arange(max_depth + 2, device=dev))  # [K+1] depth offsets
    for d in range(1, max_depth + 1):
        ad = anchor[starts[d]:starts[d + 1]]  # [E_d] anchors at depth d, sorted
        q = rows[depth >= d]
        if ad.numel() == 0 or q.numel() == 0:
            continue
        j = torch.searchsorted(ad, anchor[q]).clamp(max=ad.numel() - 1)
        hit = ad[j] == anchor[q]
        mask[q[hit], starts[d] + j[hit]] = True
    return mask


def _rule(aq, dq, sq, ak, dk, sk) -> torch.Tensor:
    return (sq == sk) & (((dk == 0) & (ak <= aq)) | ((ak == aq) & (dk <= dq)))


def attention_mask_reference(elements: CodElements) -> torch.Tensor:
    """The §8 rule evaluated on the full ``[E, E]`` index grid (for tests): ``[E, E] bool``."""
    a, d, s = elements.anchor, elements.depth, elements.segment
    return _rule(a[:, None], d[:, None], s[:, None], a[None, :], d[None, :], s[None, :])


def make_mask_mod(elements: CodElements):
    """A ``flex_attention`` ``mask_mod(b, h, q_idx, kv_idx) -> bool`` of the §8 rule.

    Closes over the ``[E]`` anchor, depth and segment tensors; pass it to
    ``torch.nn.attention.flex_attention.create_block_mask`` on CUDA.
    """
    a, d, s = elements.anchor, elements.depth, elements.segment

    def mask_mod(b, h, q_idx, kv_idx):
        return _rule(a[q_idx], d[q_idx], s[q_idx], a[kv_idx], d[kv_idx], s[kv_idx])

    return mask_mod
