"""COD sampling: which drafter elements ``(anchor, depth)`` one packed row trains (docs/design.md §4, §8).

Legend: T tokens in a block, S segments, E drafter elements, K ``num_depths``.

An element ``(a, d)`` (``a`` a row index, ``0 <= d < K``) stands for position ``a + 1 + d``: it takes
the input token ``x_{a+1}`` (depth 0) or the mask token (depth > 0), predicts ``x_{a+d+2}`` with the
soft target ``softmax(z_{a+d+1})`` and has weight ``m_{a+d+2}``. It exists iff ``a + d + 2`` is
inside the segment of ``a``. COD (conditional drop-token, PARD arXiv:2504.18583) sampling keeps every depth-0 element
and geometrically thins the deeper ones along nested chains (P-EAGLE, arXiv:2602.01469; the
``generate_cod_sample_indices`` of the ``speculators`` P-EAGLE trainer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "CodElements",
    "ElementInputs",
    "sample_cod_elements",
    "all_elements",
    "element_inputs",
    "segment_ids",
    "n_draw_formula",
]


@dataclass(frozen=True)
class CodElements:
    """Drafter elements of one row, sorted by (depth, anchor).

    Attributes:
        anchor: ``[E] int64`` row index ``a`` of the element's anchor token.
        depth: ``[E] int64`` depth ``d``.
        segment: ``[E] int64`` index of the segment holding ``a`` (into ``cu_seqlens``).
        weight: ``[E] float32`` loss weight ``m_{a+d+2}`` (0 or 1).
    """

    anchor: torch.Tensor
    depth: torch.Tensor
    segment: torch.Tensor
    weight: torch.Tensor

    def __len__(self) -> int:
        return int(self.anchor.numel())

    def to(self, device: torch.device | str) -> "CodElements":
        """The same elements on ``device``."""
        return CodElements(*(t.to(device) for t in (self.anchor, self.depth, self.segment, self.weight)))

    def count_per_depth(self, num_depths: int) -> list[int]:
        """Number of elements at each depth ``0..num_depths-1``."""
        return torch.bincount(self.depth, minlength=num_depths).tolist()


@dataclass(frozen=True)
class ElementInputs:
    """What the drafter and the loss read for each element (all ``[E] int64`` except ``is_mask``).

    Attributes:
        input_ids: token id ``x_{a+1}`` (replaced by the mask token where ``is_mask``).
        feature_index: row index ``a`` of the aux feature ``g_a`` (used at depth 0 only).
        target_index: row index ``a+d+1`` of the verifier final hidden state whose logits are the
            soft target.
        label_index: row index ``a+d+2`` of the predicted token.
        position_ids: rope position ``position_ids[a] + 1 + d``.
        is_mask: ``[E] bool``, ``depth > 0``.
    """

    input_ids: torch.Tensor
    feature_index: torch.Tensor
    target_index: torch.Tensor
    label_index: torch.Tensor
    position_ids: torch.Tensor
    is_mask: torch.Tensor


def segment_ids(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Segment index of every token: ``cu_seqlens [S+1] int`` -> ``[T] int64``.

    Raises:
        ValueError: ``cu_seqlens`` does not start at 0 or is not non-decreasing.
    """
    cu = cu_seqlens.to(torch.int64)
    if cu.numel() < 1 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu.tolist()[:16]}")
    lengths = cu[1:] - cu[:-1]  # [S]
    return torch.repeat_interleave(torch.arange(lengths.numel(), dtype=torch.int64), lengths)  # [T]


def _row_tables(cu_seqlens: torch.Tensor, loss_mask: torch.Tensor):
    cu = cu_seqlens.to(torch.int64).cpu()
    m = loss_mask.to(torch.int64).cpu()
    seg = segment_ids(cu)  # [T]
    if seg.numel() != m.numel():
        raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but loss_mask has {m.numel()} tokens")
    end = cu[1:][seg]  # [T] exclusive end of each token's segment
    return cu, m, seg, end


def _emit(parts: list[tuple[torch.Tensor, int]], seg: torch.Tensor, m: torch.Tensor) -> CodElements:
    anchors = [a for a, _ in parts]
    depths = [torch.full_like(a, d) for a, d in parts]
    anchor = torch.cat(anchors) if anchors else torch.zeros(0, dtype=torch.int64)  # [E]
    depth = torch.cat(depths) if depths else torch.zeros(0, dtype=torch.int64)  # [E]
    weight = m[(anchor + depth + 2).clamp(max=max(m.numel() - 1, 0))].to(torch.float32) if anchor.numel() \
        else torch.zeros(0)  # [E]
    return CodElements(anchor=anchor, depth=depth, segment=seg[anchor], weight=weight)


def _check_depths(num_depths: int) -> None:
    if num_depths < 1:
        raise ValueError(f"num_depths must be >= 1 (--num-depths), got {num_depths}")


def all_elements(cu_seqlens: torch.Tensor, loss_mask: torch.Tensor, num_depths: int) -> CodElements:
    """Every element that exists in the row, weighted or not, without sampling (for evaluation).

    Args:
        cu_seqlens: ``[S+1] int`` segment starts, ending at T.
        loss_mask: ``[T] int`` 0/1.
        num_depths: K >= 1.

    Returns:
        :class:`CodElements` sorted by (depth, anchor); a chain ``(a, 0..d)`` is present whenever
        ``(a, d)`` is.

    Raises:
        ValueError: bad ``cu_seqlens`` or ``num_depths < 1``.
    """
    _check_depths(num_depths)
    _, m, seg, end = _row_tables(cu_seqlens, loss_mask)
    pos = torch.arange(m.numel(), dtype=torch.int64)  # [T]
    parts = [(pos[pos + d + 2 < end], d) for d in range(num_depths)]
    return _emit(parts, seg, m)


def _offsets_and_keys(cu: torch.Tensor, m: torch.Tensor, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token t of the row: (``offset [T] int64``, its index inside its segment;
    ``key [T + pad] int64``, the offset where ``m_t = 1`` and -1 elsewhere and in the tail).

    Element ``(a, d)`` has target ``t = a + d + 2``; it exists iff ``offset[t] >= d + 2`` (t lies in
    the anchor's segment) and exists with weight 1 iff ``key[t] >= d + 2``.
    """
    T = m.numel()
    lengths = cu[1:] - cu[:-1]  # [S]
    offset = torch.arange(T, dtype=torch.int64) - torch.repeat_interleave(cu[:-1], lengths)  # [T]
    key = torch.full((T + pad,), -1, dtype=torch.int64)
    key[:T] = torch.where(m, offset, -1)
    return offset, key


def _checked_row(cu_seqlens: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``cu [S+1] int64``, ``m [T] bool``) on CPU; ValueError if they do not describe one row."""
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64)
    m = loss_mask.to(device="cpu", dtype=torch.bool)
    if cu.numel() < 1 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {cu.tolist()[:16]}")
    if int(cu[-1]) != m.numel():
        raise ValueError(f"cu_seqlens ends at {int(cu[-1])} but loss_mask has {m.numel()} tokens")
    return cu, m


def _emit_sampled(parts: list[torch.Tensor], cu: torch.Tensor, m: torch.Tensor) -> CodElements:
    """CodElements from ``parts[d]``, the sorted anchors of depth d (depth > 0 all weighted)."""
    anchor = torch.cat(parts)  # [E]
    counts = torch.tensor([p.numel() for p in parts])
    depth = torch.repeat_interleave(torch.arange(len(parts), dtype=torch.int64), counts)  # [E]
    segment = torch.searchsorted(cu[1:], anchor, right=True)  # [E]
    weight = torch.ones(anchor.numel(), dtype=torch.float32)
    weight[:parts[0].numel()] = m[parts[0] + 2].to(torch.float32)  # depth 0: m_{a+2}
    return CodElements(anchor=anchor, depth=depth, segment=segment, weight=weight)


def _draw(pool: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """A uniform random subset of ``n`` anchors of the sorted ``pool [N]`` (all of it if ``n >= N``),
    in pool order (so sorted)."""
    if n >= pool.numel():
        return pool
    keep = torch.zeros(pool.numel(), dtype=torch.bool)
    keep[torch.randperm(pool.numel(), generator=generator)[:n]] = True
    return pool[keep]


def sample_cod_elements(cu_seqlens: torch.Tensor, loss_mask: torch.Tensor, num_depths: int,
                        down_sample_ratio: float, down_sample_ratio_min: float,
                        max_anchors: int | None, generator: torch.Generator) -> CodElements:
    """COD-sample the drafter elements of one packed row (docs/design.md §8, steps 1-4).

    1. Depth 0: every existing ``(a, 0)``, weighted or not (the attention context).
    2. Seeds: anchors whose ``(a, 1)`` exists and has weight 1; with ``max_anchors`` set and more
       seeds than that in the row, a uniform random subset of ``max_anchors`` of them.
    3. For d = 1..K-1: draw ``n_d = floor((n_seeds - d) * max(r**d, r_min))`` anchors (at most the
       pool) uniformly from the row's pool and emit ``(a, d)``; the next pool is the drawn anchors
       whose ``(a, d+1)`` exists and has weight 1, so chains are nested and never cross a segment.
       ``n_seeds`` counts the row's seeds after the ``max_anchors`` cap: the counts are row-level,
       so the number of elements per depth does not depend on how many segments the row packs.
    4. Depth > 0 elements all have weight 1; the result is sorted by (depth, anchor).

    From P-EAGLE (arXiv:2602.01469) and the ``generate_cod_sample_indices`` of the ``speculators``
    P-EAGLE trainer (same row-level counts, same draws by random permutation); vectorised over
    positions (the only Python loop is over depths). Runs on CPU.

    Args:
        cu_seqlens: ``[S+1] int`` segment starts, ending at T.
        loss_mask: ``[T] int`` 0/1.
        num_depths: K >= 1.
        down_sample_ratio: r in (0, 1].
        down_sample_ratio_min: r_min in (0, 1], the floor of the keep ratio.
        max_anchors: cap on the row's seeds, >= 1, or None.
        generator: a CPU ``torch.Generator``; the only source of randomness.

    Returns:
        :class:`CodElements`.

    Raises:
        ValueError: bad ``cu_seqlens``, ``num_depths < 1``, a ratio outside (0, 1] or
            ``max_anchors < 1``.
    """
    _check_depths(num_depths)
    for name, r in (("down_sample_ratio", down_sample_ratio), ("down_sample_ratio_min", down_sample_ratio_min)):
        if not 0.0 < r <= 1.0:
            raise ValueError(f"{name} must be in (0, 1] (--{name.replace('_', '-')}), got {r}")
    if max_anchors is not None and max_anchors < 1:
        raise ValueError(f"max_anchors must be >= 1 when set (--max-anchors), got {max_anchors}")
    cu, m = _checked_row(cu_seqlens, loss_mask)
    offset, key = _offsets_and_keys(cu, m, num_depths + 2)  # [T], [T + K + 2]
    anchors0 = torch.nonzero(offset[2:] >= 2).squeeze(1)  # [E0] (a, 0) exists: target a + 2 in segment
    seeds = anchors0[key[anchors0 + 3] >= 3]  # [N0] (a, 1) exists with weight 1
    if max_anchors is not None and seeds.numel() > max_anchors:
        seeds = _draw(seeds, max_anchors, generator)
    n_seeds = seeds.numel()
    parts, pool = [anchors0], seeds
    for d in range(1, num_depths):
        drawn = _draw(pool, n_draw_formula(n_seeds, d, down_sample_ratio, down_sample_ratio_min), generator)
        if drawn.numel() == 0:
            break
        parts.append(drawn)
        pool = drawn[key[drawn + d + 3] >= d + 3]
    return _emit_sampled(parts, cu, m)


def n_draw_formula(n_seeds: int, depth: int, down_sample_ratio: float, down_sample_ratio_min: float) -> int:
    """``floor((n_seeds - d) * max(r**d, r_min))`` clamped at 0 (before the pool limit)."""
    return max(0, math.floor(max(n_seeds - depth, 0) * max(down_sample_ratio ** depth, down_sample_ratio_min)))


def element_inputs(elements: CodElements, input_ids: torch.Tensor, position_ids: torch.Tensor) -> ElementInputs:
    """Gather the drafter inputs and loss indices of ``elements`` (docs/design.md §4).

    Args:
        elements: from :func:`sample_cod_elements` or :func:`all_elements`.
        input_ids: ``[T] int64`` the row's tokens.
        position_ids: ``[T] int64`` the row's positions (restart at 0 in every segment).

    Returns:
        :class:`ElementInputs` on ``input_ids.device``.
    """
    dev = input_ids.device
    a = elements.anchor.to(dev)  # [E]
    d = elements.depth.to(dev)  # [E]
    return ElementInputs(
        input_ids=input_ids[a + 1],  # [E] x_{a+1}
        feature_index=a,  # [E] g_a
        target_index=a + d + 1,  # [E] z_{a+d+1}
        label_index=a + d + 2,  # [E] x_{a+d+2}
        position_ids=position_ids.to(dev)[a] + 1 + d,  # [E]
        is_mask=d > 0,  # [E]
    )
