"""DFlash training samples: which blocks one packed row trains, and what each block reads (docs/design.md §8b).

Legend: T tokens in a packed row, N anchors (blocks), B block size, Q = N*B query tokens.

Row conventions of the feature store (§4): ``input_ids[i] = x_i``, ``aux_hidden[i]`` the verifier's aux feature
after reading ``x_i``, ``final_hidden[i]`` its final state predicting ``x_{i+1}``, ``loss_mask[i]`` whether
``x_i`` is supervised. A block anchored at row ``p`` stands for the step of speculative decoding where ``x_p``
is the newest accepted token: it takes ``x_p`` then B-1 mask tokens at positions ``pos[p] + 0..B-1``, sees the
aux features of the rows before ``p`` in its segment (the verifier has not read ``x_p`` yet, so its feature
is not there; vLLM's DFlash proposer and speculators' ``create_anchor_block_mask_mod`` alike), and its slot
``j >= 1`` drafts ``x_{p+j}`` with the soft target of ``final_hidden[p+j-1]`` and weight ``loss_mask[p+j]``
(0 past the segment's end). Slot 0 (the anchor) drafts nothing (speculators' ``sample_from_anchor`` false).

Anchors are rows with a supervised token (``loss_mask[p] = 1``: the newest accepted token of a served step is
a generated one) that have at least one context row before them in their segment and at least one supervised
slot; at most ``max_anchors`` of them are drawn uniformly, without replacement, from an explicit generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from peagle_train.data.cod import segment_ids

__all__ = ["AnchorBlocks", "BlockInputs", "DFLASH_MAX_ANCHORS", "sample_anchors", "block_inputs"]

DFLASH_MAX_ANCHORS = 512
"""Anchors per packed row unless ``--max-anchors`` is given: speculators' default ``max_anchors``."""


@dataclass(frozen=True)
class AnchorBlocks:
    """The DFlash blocks of one row, in increasing anchor order.

    Attributes:
        anchor: ``[N] int64`` row index ``p`` of each block's anchor.
        block_size: B.
    """

    anchor: torch.Tensor
    block_size: int

    def __len__(self) -> int:
        """Q, the query tokens of the row's blocks."""
        return int(self.anchor.numel()) * self.block_size

    def to(self, device: torch.device | str) -> "AnchorBlocks":
        return AnchorBlocks(self.anchor.to(device), self.block_size)


@dataclass(frozen=True)
class BlockInputs:
    """What the drafter and the loss read for the Q query tokens of a row's blocks (``[Q]`` each unless said).

    Attributes:
        input_ids: ``int64`` the anchor token at slot 0, ``mask_token_id`` elsewhere.
        position_ids: ``int64`` ``pos[p] + j``.
        target_index: ``int64`` row ``p + j - 1`` of ``final_hidden`` (the soft target of slot j >= 1; the
            anchor's own row at slot 0, never read there).
        depth: ``int64`` ``j - 1`` (the draft's index among the step's B-1 drafts; -1 at slot 0).
        weight: ``float32`` ``loss_mask[p + j]`` for slots j >= 1 inside the segment, else 0.
        mask: ``[Q, T + Q] bool`` the attention rule: block b's queries see the rows before its anchor in its
            segment, and the B tokens of block b (not causal inside the block).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    target_index: torch.Tensor
    depth: torch.Tensor
    weight: torch.Tensor
    mask: torch.Tensor


def _candidates(cu_seqlens: torch.Tensor, loss_mask: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[M] int64`` the rows that may anchor a block (see the module doc)."""
    seg = segment_ids(cu_seqlens)  # [T]
    T = seg.numel()
    m = loss_mask.to(torch.bool).cpu()
    cu = cu_seqlens.to(torch.int64).cpu()
    start, end = cu[seg], cu[seg + 1]  # [T] each row's segment bounds
    rows = torch.arange(T)
    supervised_slot = torch.zeros(T, dtype=torch.bool)
    for j in range(1, block_size):
        inside = rows + j < end
        supervised_slot |= inside & m[(rows + j).clamp(max=T - 1)]
    return torch.nonzero(m & (rows > start) & supervised_slot).squeeze(1)


def sample_anchors(cu_seqlens: torch.Tensor, loss_mask: torch.Tensor, block_size: int, max_anchors: int | None,
                   gen: torch.Generator) -> AnchorBlocks:
    """The blocks one packed row trains: every candidate anchor, or ``max_anchors`` of them drawn from ``gen``.

    Args:
        cu_seqlens: ``[S+1] int`` segment bounds of the row; loss_mask: ``[T]`` 0/1.
        block_size: B >= 2.
        max_anchors: cap on blocks per row (None: :data:`DFLASH_MAX_ANCHORS`).
        gen: a CPU generator (the draw's only randomness).
    """
    cand = _candidates(cu_seqlens, loss_mask, block_size)
    cap = DFLASH_MAX_ANCHORS if max_anchors is None else max_anchors
    if cand.numel() > cap:
        cand = torch.sort(cand[torch.randperm(cand.numel(), generator=gen)[:cap]]).values
    return AnchorBlocks(cand, block_size)


def block_inputs(blocks: AnchorBlocks, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 cu_seqlens: torch.Tensor, loss_mask: torch.Tensor, mask_token_id: int) -> BlockInputs:
    """The query tokens, targets, weights and attention rule of ``blocks`` in a row (``[T]`` arrays, any device:
    the outputs are on ``input_ids``'s)."""
    device, B = input_ids.device, blocks.block_size
    T = input_ids.numel()
    seg = segment_ids(cu_seqlens.cpu()).to(device)  # [T]
    end = cu_seqlens.to(device=device, dtype=torch.int64)[seg + 1]  # [T]
    p = blocks.anchor.to(device)  # [N]
    N = p.numel()
    j = torch.arange(B, device=device)  # [B]
    slot_row = (p[:, None] + j[None, :]).reshape(-1)  # [Q] p + j
    slot = j.repeat(N)  # [Q]
    inside = slot_row < end[p].repeat_interleave(B)  # [Q]
    ids = torch.full((N * B,), mask_token_id, dtype=torch.int64, device=device)
    ids[slot == 0] = input_ids[p].to(torch.int64)
    weight = torch.where(inside & (slot > 0), loss_mask.to(device)[slot_row.clamp(max=T - 1)].float(),
                         torch.zeros((), device=device))
    position = position_ids.to(device=device, dtype=torch.int64)[p].repeat_interleave(B) + slot  # [Q]
    anchor_q = p.repeat_interleave(B)  # [Q] each query's anchor row
    rows = torch.arange(T, device=device)
    context = (seg[None, :] == seg[anchor_q][:, None]) & (rows[None, :] < anchor_q[:, None])  # [Q, T]
    block_of = torch.arange(N, device=device).repeat_interleave(B)  # [Q]
    own = block_of[:, None] == block_of[None, :]  # [Q, Q]
    return BlockInputs(input_ids=ids, position_ids=position, target_index=(slot_row - 1).clamp(0, T - 1),
                       depth=slot - 1, weight=weight, mask=torch.cat([context, own], dim=1))
