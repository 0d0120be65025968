"""The P-EAGLE attention rule between drafter elements, as masks (docs/design.md §8).

Legend: E drafter elements of one row, sorted by (depth, anchor) as :mod:`peagle_train.data.cod` returns
them; E0 the depth-0 elements (the first E0 of them); R query rows, B a BlockMask tile side.

Element q = (a_q, d_q) may attend element k = (a_k, d_k) iff both are in the same segment and either
``d_k = 0 and a_k <= a_q`` (the verifier-feature context up to the anchor) or
``a_k = a_q and d_k <= d_q`` (its own chain). From P-EAGLE (arXiv:2602.01469), as in the
``speculators`` P-EAGLE flex-attention mask.

The rule's forms, built from the element structure (nothing evaluates it pair by pair but the
references): :func:`build_attention_mask` (dense ``[E, E] bool``), :func:`make_mask_mod` (a
``flex_attention`` mask_mod), :func:`block_mask_from_elements` (a ``flex_attention`` BlockMask),
the depth-0 ranges and chain pairs of each query. The attention backends that use them are in
:mod:`peagle_train.model.attention`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

from peagle_train.data.cod import CodElements

__all__ = ["build_attention_mask", "attention_mask_reference", "make_mask_mod", "MaskMod", "DEFAULT_BLOCK_SIZE",
           "block_mask_from_elements", "tile_counts", "depth0_ranges", "chain_pairs"]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``mask_mod(b, h, q_idx, kv_idx) -> bool`` as ``flex_attention`` takes it."""

DEFAULT_BLOCK_SIZE = 128
"""Tile of a flex_attention BlockMask (queries and keys), torch's default."""


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


def make_mask_mod(elements: CodElements) -> MaskMod:
    """A ``flex_attention`` ``mask_mod(b, h, q_idx, kv_idx) -> bool`` of the §8 rule.

    Closes over the ``[E]`` anchor, depth and segment tensors; ``q_idx`` and ``kv_idx`` index the
    elements. :class:`FlexElementMask` passes it to
    ``torch.nn.attention.flex_attention.create_block_mask``.
    """
    a, d, s = elements.anchor, elements.depth, elements.segment

    def mask_mod(b, h, q_idx, kv_idx):
        return _rule(a[q_idx], d[q_idx], s[q_idx], a[kv_idx], d[kv_idx], s[kv_idx])

    return mask_mod


def depth0_ranges(elements: CodElements, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[lo, hi)`` columns of the depth-0 keys query elements ``q [Q]`` see (their segment's first
    depth-0 element up to their own anchor's); ``([Q], [Q]) int64``."""
    anchor, depth, segment = elements.anchor, elements.depth, elements.segment
    n0 = int((depth == 0).sum())
    lo = torch.searchsorted(segment[:n0], segment[q], right=False)  # [Q]
    hi = torch.searchsorted(anchor[:n0], anchor[q], right=True)  # [Q]
    return lo, hi


def chain_pairs(elements: CodElements, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(query position in ``q``, key column) of every chain pair ``(a_q, d)``, ``1 <= d <= d_q``:
    ``sum(d_q)`` pairs, found by binary search among each depth's sorted anchors."""
    anchor, depth = elements.anchor, elements.depth
    dev = anchor.device
    if q.numel() == 0 or int(depth.max()) == 0:
        return torch.zeros(0, dtype=torch.int64, device=dev), torch.zeros(0, dtype=torch.int64, device=dev)
    max_depth = int(depth.max())
    starts = torch.searchsorted(depth, torch.arange(max_depth + 2, device=dev))  # [K+1]
    aq, dq = anchor[q], depth[q]  # [Q]
    pos = torch.arange(q.numel(), device=dev)
    rows, cols = [], []
    for d in range(1, max_depth + 1):
        ad = anchor[starts[d]:starts[d + 1]]  # [E_d] sorted
        sel = pos[dq >= d]
        if ad.numel() == 0 or sel.numel() == 0:
            continue
        j = torch.searchsorted(ad, aq[sel]).clamp(max=ad.numel() - 1)
        hit = ad[j] == aq[sel]  # always true for complete chains
        rows.append(sel[hit])
        cols.append(starts[d] + j[hit])
    if not rows:
        return torch.zeros(0, dtype=torch.int64, device=dev), torch.zeros(0, dtype=torch.int64, device=dev)
    return torch.cat(rows), torch.cat(cols)


def tile_counts(elements: CodElements, rows: torch.Tensor | None = None,
                block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """Allowed (query, key) pairs of the §8 rule in every ``block_size``-square tile, from structure.

    The depth-0 range of each query adds its overlap with each key tile through a difference array
    over tiles (the range is contiguous), and the chain keys add one pair each (``bincount``), so the
    cost is O(Q·K + Qb·Kb) time and memory with nothing ``[Q, E]``.

    Args:
        elements: sorted by (depth, anchor) with complete chains (as COD sampling returns them).
        rows: ``[R] int64`` query elements (None: all E).
        block_size: tile side B.

    Returns:
        ``[Qb, Kb] int64`` with ``Qb = ceil(Q / B)``, ``Kb = ceil(E / B)``.
    """
    dev = elements.anchor.device
    E = len(elements)
    q = torch.arange(E, device=dev) if rows is None else rows.to(dev)
    B = int(block_size)
    Qb, Kb = -(-q.numel() // B), -(-E // B)
    counts = torch.zeros(Qb * Kb, dtype=torch.int64, device=dev)
    if q.numel() == 0 or E == 0:
        return counts.view(Qb, Kb)
    lo, hi = depth0_ranges(elements, q)  # [Q]
    qb = torch.arange(q.numel(), device=dev) // B  # [Q] query tile
    bl, bh = lo // B, (hi - 1) // B  # [Q] first and last key tile the range touches
    one = bl == bh
    # the range's first tile, its last tile (when different) and every tile between them
    counts.index_add_(0, qb * Kb + bl, torch.where(one, hi - lo, (bl + 1) * B - lo))
    counts.index_add_(0, (qb * Kb + bh)[~one], (hi - bh * B)[~one])
    diff = torch.zeros(Qb * (Kb + 1), dtype=torch.int64, device=dev)  # +B on tiles bl+1 .. bh-1
    mid = bh > bl + 1
    diff.index_add_(0, (qb * (Kb + 1) + bl + 1)[mid], torch.full_like(bl[mid], B))
    diff.index_add_(0, (qb * (Kb + 1) + bh)[mid], torch.full_like(bl[mid], -B))
    counts += diff.view(Qb, Kb + 1).cumsum(1)[:, :Kb].reshape(-1)
    r, c = chain_pairs(elements, q)
    counts += torch.bincount((r // B) * Kb + c // B, minlength=Qb * Kb)
    return counts.view(Qb, Kb)


def _ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[Qb, Kb] bool`` -> (``[1, 1, Qb] int32`` count, ``[1, 1, Qb, Kb] int32`` listed tiles first,
    each part ascending): the layout ``create_block_mask`` gives (a stable descending argsort)."""
    t = tiles.to(torch.int32)
    idx = torch.argsort(t, dim=-1, descending=True, stable=True)
    return t.sum(-1).to(torch.int32)[None, None], idx.to(torch.int32)[None, None]


def block_mask_from_elements(elements: CodElements, rows: torch.Tensor | None = None,
                             block_size: int = DEFAULT_BLOCK_SIZE,
                             mask_mod: MaskMod | None = None) -> BlockMask:
    """The §8 rule's ``flex_attention`` BlockMask built from the element structure.

    Identical (every index tensor) to ``create_block_mask(mask_mod, None, None, Q, E,
    BLOCK_SIZE=block_size)`` for the rule's mask_mod, without evaluating it on the ``[Q, E]`` grid: a
    tile is full when :func:`tile_counts` finds ``B * B`` allowed pairs in it, partial when it finds
    fewer but some (tiles past the edge hold padding, so they are never full, as in torch).

    Args:
        elements: sorted by (depth, anchor) with complete chains.
        rows: ``[R] int64`` query elements; None: all E (shape ``[1, 1, E, E]``, else ``[1, 1, R, E]``).
        block_size: tile side, queries and keys.
        mask_mod: the mask_mod stored in the BlockMask (the kernel applies it inside partial tiles);
            default :func:`make_mask_mod` (restricted to ``rows``).

    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` on the elements' device.
    """
    B = int(block_size)
    counts = tile_counts(elements, rows, B)  # [Qb, Kb]
    full = counts == B * B
    partial = (counts > 0) & ~full
    if mask_mod is None:
        mask_mod = make_mask_mod(elements)
        if rows is not None:
            base, idx = mask_mod, rows.to(elements.anchor.device)

            def mask_mod(b, h, q_idx, kv_idx):
                return base(b, h, idx[q_idx], kv_idx)
    Q = len(elements) if rows is None else int(rows.numel())
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(B, B), mask_mod=mask_mod,
                                    seq_lengths=(Q, len(elements)))
