"""The P-EAGLE attention rule between drafter elements (DESIGN.md §8).

Legend: E drafter elements of one row, sorted by (depth, anchor) as :mod:`peagle_train.cod` returns
them; E0 the depth-0 elements (the first E0 of them).

Element q = (a_q, d_q) may attend element k = (a_k, d_k) iff both are in the same segment and either
``d_k = 0 and a_k <= a_q`` (the verifier-feature context up to the anchor) or
``a_k = a_q and d_k <= d_q`` (its own chain). From P-EAGLE (arXiv:2602.01469), as in the
``speculators`` P-EAGLE flex-attention mask.

Two forms of the same rule feed the drafter's attention (``peagle_train.model``):
- :func:`build_attention_mask`: a dense ``[E, E] bool`` mask for ``scaled_dot_product_attention``
  (every device; the only form with a backward on CPU);
- :class:`FlexElementMask`: ``torch.nn.attention.flex_attention`` BlockMasks made with
  ``create_block_mask`` from :func:`make_mask_mod`, ``[E, E]`` for every layer and ``[R, E]`` for the
  last layer's query rows R (CUDA training; on CPU torch runs flex_attention forward only).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from peagle_train.cod import CodElements

__all__ = ["build_attention_mask", "attention_mask_reference", "make_mask_mod", "FlexElementMask",
           "MaskMod", "DEFAULT_BLOCK_SIZE"]

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


class FlexElementMask:
    """The §8 rule for ``flex_attention``: BlockMasks over E elements of one row, made on demand.

    ``PEagleDrafter.forward`` takes this in place of the dense ``[E, E]`` mask. Every decoder layer
    asks for :meth:`block_mask` (``[E, E]``); the last layer, which runs queries for ``output_rows``
    R only, asks for ``block_mask(rows)`` (``[R, E]``: query i is element ``rows[i]``, keys are all E
    elements). Each is built once with ``create_block_mask`` on the elements' device and cached for
    the object's life (one forward/backward of one row). ``create_block_mask`` evaluates the
    mask_mod on the ``[Q, E]`` index grid, so building it costs about what the dense mask does; the
    attention itself then skips the ``BLOCK_SIZE``-square tiles with no allowed pair.

    Attributes:
        elements: the ``CodElements`` (``[E]`` tensors) sorted by (depth, anchor).
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx)`` over element indices; :func:`make_mask_mod`
            unless another was given (tests pass a wrong one to see that the output changes).
        block_size: BlockMask tile, queries and keys.
    """

    __slots__ = ("elements", "mask_mod", "block_size", "_full", "_rows")

    def __init__(self, elements: CodElements, mask_mod: MaskMod | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        self.elements = elements
        self.mask_mod: MaskMod = mask_mod if mask_mod is not None else make_mask_mod(elements)
        self.block_size = int(block_size)
        self._full: BlockMask | None = None
        self._rows: tuple[torch.Tensor, BlockMask] | None = None

    def __len__(self) -> int:
        return len(self.elements)

    @property
    def device(self) -> torch.device:
        return self.elements.anchor.device

    def block_mask(self, rows: torch.Tensor | None = None) -> BlockMask:
        """The BlockMask of all E queries (``rows`` None), shape ``[1, 1, E, E]``, or of the queries
        ``rows [R] int64`` (element indices), shape ``[1, 1, R, E]``; keys are always all E."""
        E = len(self)
        if rows is None:
            if self._full is None:
                self._full = create_block_mask(self.mask_mod, None, None, E, E, device=self.device,
                                               BLOCK_SIZE=self.block_size)
            return self._full
        if self._rows is not None and self._rows[0] is rows:
            return self._rows[1]
        base, idx = self.mask_mod, rows.to(self.device)

        def rows_mask_mod(b, h, q_idx, kv_idx):
            return base(b, h, idx[q_idx], kv_idx)

        bm = create_block_mask(rows_mask_mod, None, None, int(idx.numel()), E, device=self.device,
                               BLOCK_SIZE=self.block_size)
        self._rows = (rows, bm)
        return bm

    def to_dense(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The mask_mod on the full index grid: ``[E, E] bool`` (``[R, E]`` for ``rows``), for tests."""
        E = len(self)
        q = torch.arange(E, device=self.device) if rows is None else rows.to(self.device)
        k = torch.arange(E, device=self.device)
        zero = torch.zeros((), dtype=torch.long, device=self.device)
        return self.mask_mod(zero, zero, q[:, None], k[None, :])
