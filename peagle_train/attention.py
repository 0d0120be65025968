"""The P-EAGLE attention rule between drafter elements (DESIGN.md §8).

Legend: E drafter elements of one row, sorted by (depth, anchor) as :mod:`peagle_train.cod` returns
them; E0 the depth-0 elements (the first E0 of them).

Element q = (a_q, d_q) may attend element k = (a_k, d_k) iff both are in the same segment and either
``d_k = 0 and a_k <= a_q`` (the verifier-feature context up to the anchor) or
``a_k = a_q and d_k <= d_q`` (its own chain). From P-EAGLE (arXiv:2602.01469), as in the
``speculators`` P-EAGLE flex-attention mask.

Three forms of the same rule feed the drafter's attention (``peagle_train.model``):
- :func:`build_attention_mask`: a dense ``[E, E] bool`` mask for ``scaled_dot_product_attention``
  (every device);
- :class:`FlexElementMask`: ``torch.nn.attention.flex_attention`` BlockMasks built from the element
  structure by :func:`block_mask_from_elements` (identical to ``create_block_mask``'s), ``[E, E]``
  for every layer and ``[R, E]`` for the last layer's query rows R (CUDA training; on CPU torch
  runs flex_attention forward only);
- :class:`SplitElementAttention`: no element×element tensor at all; the depth-0 range and the
  chain keys are attended separately and merged by log-sum-exp (every device).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from peagle_train.cod import CodElements

__all__ = ["build_attention_mask", "attention_mask_reference", "make_mask_mod", "FlexElementMask",
           "MaskMod", "DEFAULT_BLOCK_SIZE", "block_mask_from_elements", "tile_counts", "SplitElementAttention"]

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


def _depth0_ranges(elements: CodElements, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[lo, hi)`` columns of the depth-0 keys query elements ``q [Q]`` see (their segment's first
    depth-0 element up to their own anchor's); ``([Q], [Q]) int64``."""
    anchor, depth, segment = elements.anchor, elements.depth, elements.segment
    n0 = int((depth == 0).sum())
    lo = torch.searchsorted(segment[:n0], segment[q], right=False)  # [Q]
    hi = torch.searchsorted(anchor[:n0], anchor[q], right=True)  # [Q]
    return lo, hi


def _chain_pairs(elements: CodElements, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
    lo, hi = _depth0_ranges(elements, q)  # [Q]
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
    r, c = _chain_pairs(elements, q)
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


class FlexElementMask:
    """The §8 rule for ``flex_attention``: BlockMasks over E elements of one row, made on demand.

    ``PEagleDrafter.forward`` takes this in place of the dense ``[E, E]`` mask. Every decoder layer
    asks for :meth:`block_mask` (``[E, E]``); the last layer, which runs queries for ``output_rows``
    R only, asks for ``block_mask(rows)`` (``[R, E]``: query i is element ``rows[i]``, keys are all E
    elements). Each is built once on the elements' device and cached for the object's life (one
    forward/backward of one row): with the rule's own mask_mod by :func:`block_mask_from_elements`
    from the element structure (no ``[Q, E]`` grid); with another mask_mod (tests) by
    ``create_block_mask``, which evaluates it on the grid. The attention then skips the
    ``BLOCK_SIZE``-square tiles with no allowed pair.

    Attributes:
        elements: the ``CodElements`` (``[E]`` tensors) sorted by (depth, anchor).
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx)`` over element indices; :func:`make_mask_mod`
            unless another was given (tests pass a wrong one to see that the output changes).
        block_size: BlockMask tile, queries and keys.
    """

    __slots__ = ("elements", "mask_mod", "block_size", "_full", "_rows", "_structural")

    def __init__(self, elements: CodElements, mask_mod: MaskMod | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        self.elements = elements
        self._structural = mask_mod is None
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
                self._full = (block_mask_from_elements(self.elements, None, self.block_size, self.mask_mod)
                              if self._structural else
                              create_block_mask(self.mask_mod, None, None, E, E, device=self.device,
                                                BLOCK_SIZE=self.block_size))
            return self._full
        if self._rows is not None and self._rows[0] is rows:
            return self._rows[1]
        if self._structural:
            bm = block_mask_from_elements(self.elements, rows.to(self.device), self.block_size)
            self._rows = (rows, bm)
            return bm
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


class SplitElementAttention:
    """The §8 rule with no element×element tensor: two attention calls merged by log-sum-exp.

    Every query q attends (A) the depth-0 keys of its segment up to its own anchor, a contiguous
    column range ``[lo_q, p_q]`` (causal attention within the segment, with q placed at its anchor's
    depth-0 column ``p_q``), and a chain query (``d_q >= 1``) also (B) the keys of its own chain at
    depths ``1..d_q`` (at most K-1 keys, found once by binary search). The two softmaxes are merged
    by their log-sum-exp, which equals one softmax over the union of the keys (docs/design.md §8).
    Queries are sorted by ``p_q`` and run in chunks whose float32 score tiles stay under
    ``budget_bytes``; the backward recomputes each chunk's scores from q, k, v and the saved
    log-sum-exp (FlashAttention's backward, written out in :class:`_SplitAttention`), so the largest
    tensor is ``[heads, chunk, key range]``, never ``[E, E]``, and nothing per chunk outlives it.

    ``PEagleDrafter.forward`` takes this in place of the dense mask; :meth:`attend` runs it. Plain
    torch ops, so it runs and trains on any device; equal to the dense SDPA backend's outputs and
    gradients up to float rounding (tested).

    Attributes:
        elements: the ``CodElements`` sorted by (depth, anchor), chains complete.
        budget_bytes: most bytes of float32 scores one chunk may hold (forward).
    """

    __slots__ = ("elements", "budget_bytes", "_lo", "_p", "_chain")

    def __init__(self, elements: CodElements, budget_bytes: int = 64 * 2 ** 20):
        self.elements = elements
        self.budget_bytes = int(budget_bytes)
        E = len(elements)
        q = torch.arange(E, device=elements.anchor.device)
        self._lo, hi = _depth0_ranges(elements, q)  # [E], [E]
        self._p = hi - 1  # [E] depth-0 column of each element's own anchor
        K1 = max(int(elements.depth.max()) if E else 0, 1)
        chain = torch.full((E, K1), -1, dtype=torch.int64, device=q.device)  # [E, K-1] chain keys, -1 pad
        r, c = _chain_pairs(elements, q)
        chain[r, elements.depth[c] - 1] = c
        self._chain = chain

    def __len__(self) -> int:
        return len(self.elements)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``q [nh, R, hd]`` (the elements ``rows [R]``, all E if None) over ``k, v
        [nkv, E, hd]`` (grouped-query: ``nh`` a multiple of ``nkv``), scale ``hd ** -0.5``.

        Returns:
            ``[nh, R, hd]`` in ``q``'s dtype (computed in float32 or wider).
        """
        nh, R, hd = q.shape
        idx = torch.arange(R, device=q.device) if rows is None else rows.to(q.device)  # [R] element ids
        if R == 0:
            return q.new_zeros(nh, 0, hd)
        p, lo = self._p[idx], self._lo[idx]
        order = torch.argsort(p, stable=True)  # queries by anchor column: chunks cover short key ranges
        span = int((p - lo).max()) + 1
        chunk = max(8, self.budget_bytes // (4 * nh * (span + 64)))
        return _SplitAttention.apply(q, k, v, lo, p, self._chain[idx], order, chunk)


class _SplitAttention(torch.autograd.Function):
    """:meth:`SplitElementAttention.attend` with a hand-written chunked backward (FlashAttention's:
    the scores are recomputed chunk by chunk from q, k, v and the saved log-sum-exp), so neither
    pass keeps more than one chunk's ``[heads, chunk, key range]`` scores and the gradients of q, k
    and v are accumulated in place instead of one full-size gradient per chunk."""

    @staticmethod
    def forward(ctx, q, k, v, lo, p, chain, order, chunk):
        # [nh, R, hd] over [R, nh, hd] memory: the caller's transpose(0, 1).reshape(R, nh * hd) for
        # o_proj is then a view, not a second copy kept for the backward
        out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device).transpose(0, 1)
        lse = torch.empty(q.shape[:2], dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
        for sel in order.split(chunk):
            c = _SplitChunk(q, k, v, sel, lo[sel], p[sel], chain[sel])
            out[:, sel] = c.out.reshape(out.shape[0], -1, out.shape[2]).to(out.dtype)
            lse[:, sel] = c.lse.reshape(lse.shape[0], -1)
        ctx.save_for_backward(q, k, v, lo, p, chain, order, out, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, lo, p, chain, order, out, lse = ctx.saved_tensors
        dt = lse.dtype
        dq, dk, dv = (torch.zeros(t.shape, dtype=dt, device=t.device) for t in (q, k, v))
        delta = (dout.to(dt) * out.to(dt)).sum(-1)  # [nh, R] rowsum(dO * O)
        for sel in order.split(ctx.chunk):
            c = _SplitChunk(q, k, v, sel, lo[sel], p[sel], chain[sel], lse=lse[:, sel])
            dq[:, sel] = c.backward(dout[:, sel], delta[:, sel], dk, dv).reshape(dq.shape[0], -1, dq.shape[2])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


class _SplitChunk:
    """One query chunk: the depth-0 range scores ``sa [nkv, rep, c, kr]`` and the chain scores
    ``sb [nkv, rep, c', K-1]`` of its chain queries (``deep``), their probabilities under the
    joint log-sum-exp, the output (forward) or the gradients (backward)."""

    def __init__(self, q, k, v, sel, lo, p, chain, lse=None):
        nh, _, hd = q.shape
        nkv = k.shape[0]
        dt = torch.promote_types(q.dtype, torch.float32)
        self.scale = hd ** -0.5
        self.qg = q[:, sel].to(dt).view(nkv, nh // nkv, -1, hd)  # [nkv, rep, c, hd]
        self.klo, self.khi = int(lo.min()), int(p.max()) + 1
        self.ka, self.va = k[:, self.klo:self.khi].to(dt), v[:, self.klo:self.khi].to(dt)  # [nkv, kr, hd]
        cols = torch.arange(self.klo, self.khi, device=q.device)
        allowed = (cols[None, :] >= lo[:, None]) & (cols[None, :] <= p[:, None])  # [c, kr]
        sa = torch.matmul(self.qg, self.ka[:, None].transpose(-1, -2)) * self.scale  # [nkv, rep, c, kr]
        sa.masked_fill_(~allowed, float("-inf"))
        self.deep = torch.nonzero(chain[:, 0] >= 0).squeeze(1)  # [c'] chain queries
        self.ch = chain[self.deep].clamp(min=0)  # [c', K-1]
        self.kb, self.vb = k[:, self.ch].to(dt), v[:, self.ch].to(dt)  # [nkv, c', K-1, hd]
        sb = torch.einsum("grch,gckh->grck", self.qg[:, :, self.deep], self.kb) * self.scale
        sb.masked_fill_(chain[self.deep] < 0, float("-inf"))  # [nkv, rep, c', K-1]
        if lse is None:  # forward: merge the two parts' log-sum-exps
            lse = torch.logsumexp(sa, dim=-1)  # finite: p itself is allowed
            lse[:, :, self.deep] = torch.logaddexp(lse[:, :, self.deep], torch.logsumexp(sb, dim=-1))
        else:
            lse = lse.view(nkv, nh // nkv, -1)
        self.lse = lse
        self.pa = torch.exp(sa - lse[..., None])  # [nkv, rep, c, kr] joint probabilities, part A
        self.pb = torch.exp(sb - lse[:, :, self.deep, None])  # [nkv, rep, c', K-1] part B
        if self.deep.numel() == 0:
            self.out = torch.matmul(self.pa, self.va[:, None])
        else:
            out = torch.matmul(self.pa, self.va[:, None])  # [nkv, rep, c, hd]
            out[:, :, self.deep] += torch.einsum("grck,gckh->grch", self.pb, self.vb)
            self.out = out

    def backward(self, dout, delta, dk, dv):
        """Add this chunk's terms to ``dk, dv [nkv, E, hd]``; return its ``dq [nkv, rep, c, hd]``.

        ``dout [nh, c, hd]``, ``delta [nh, c]`` = rowsum(dO * O): with P the joint probabilities,
        dV += Pᵀ dO, dS = P (dO Vᵀ - delta), dQ = scale dS K, dK += scale dSᵀ Q.
        """
        nkv, rep, c, hd = self.qg.shape
        do = dout.to(self.pa.dtype).view(nkv, rep, c, hd)
        dl = delta.view(nkv, rep, c, 1)
        dv[:, self.klo:self.khi] += torch.einsum("grck,grch->gkh", self.pa, do)
        ds = self.pa * (torch.matmul(do, self.va[:, None].transpose(-1, -2)) - dl)  # [nkv, rep, c, kr]
        dq = torch.matmul(ds, self.ka[:, None]) * self.scale  # [nkv, rep, c, hd]
        dk[:, self.klo:self.khi] += torch.einsum("grck,grch->gkh", ds, self.qg) * self.scale
        if self.deep.numel():
            dod, qd = do[:, :, self.deep], self.qg[:, :, self.deep]  # [nkv, rep, c', hd]
            flat = self.ch.reshape(-1)
            dvb = torch.einsum("grck,grch->gckh", self.pb, dod)  # [nkv, c', K-1, hd]
            dv.index_add_(1, flat, dvb.reshape(nkv, -1, hd))
            dsb = self.pb * (torch.einsum("grch,gckh->grck", dod, self.vb) - dl[:, :, self.deep])
            dq[:, :, self.deep] += torch.einsum("grck,gckh->grch", dsb, self.kb) * self.scale
            dkb = torch.einsum("grck,grch->gckh", dsb, qd) * self.scale
            dk.index_add_(1, flat, dkb.reshape(nkv, -1, hd))
        return dq


