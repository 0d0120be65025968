"""One training step's parts (docs/design.md §8): COD sampling of a block, the drafter forward, the
loss, and the gradient of the pooled objective over micro-batches and ranks.

Legend: T tokens in a block, E drafter elements, H hidden size, D draft vocab, K ``num_depths``.
:class:`peagle_train.train.trainer.Trainer` puts them together; benchmarks and tests call them directly.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from peagle_train.data.cod import CodElements, element_inputs, sample_cod_elements
from peagle_train.data.loader import Block, derive_seed
from peagle_train.model.attention import element_attention
from peagle_train.train.loss import LogitTransform, LossOutput, loss_and_accuracy

__all__ = ["cod_generator", "block_loss", "block_hidden", "accumulate_step", "block_to", "sample_elements",
           "summarise", "add_sums", "gather_ids"]


def cod_generator(seed: int, cursor: int) -> torch.Generator:
    """The CPU generator of COD sampling for the block at ``cursor`` of the run's block sequence
    (:class:`peagle_train.data.loader.BlockSequence`): the same on any number of ranks."""
    return torch.Generator().manual_seed(derive_seed(seed, 1, cursor))




def block_loss(model, draft_head: torch.Tensor, verifier_head: torch.Tensor, block: Block,
               elements: CodElements, num_depths: int, chunk_size: int,
               attention_backend: str = "sdpa", logit_transform: LogitTransform | None = None,
               loss: str = "kl_div", depth_weights: tuple[float, ...] | None = None) -> LossOutput:
    """Drafter forward over ``elements`` of ``block`` and the weighted loss to the verifier.

    Args:
        model: the (possibly wrapped) :class:`PEagleDrafter`.
        draft_head: ``[D, H]`` the drafter's lm_head weight.
        verifier_head: ``[D, H]`` the verifier's lm_head rows of the draft vocab.
        block: tensors on the model's device.
        elements: from COD sampling, on the model's device.
        attention_backend: a key of :data:`peagle_train.model.attention.ATTENTION_BACKENDS` (resolved:
            see :func:`peagle_train.model.attention.resolve_attention_backend`).
        logit_transform: the verifier's :class:`peagle_train.train.loss.LogitTransform` (None: identity).
        loss: the per-element loss, a name of :data:`peagle_train.train.loss.LOSSES`.
        depth_weights: ``[K]`` per-depth loss weights (None: all 1).
    """
    hidden, rows, target_index = block_hidden(model, draft_head.dtype, block, elements, attention_backend)
    return loss_and_accuracy(hidden, draft_head, block.final_hidden, verifier_head, elements.weight[rows],
                             elements.depth[rows], num_depths, chunk_size, target_index=target_index,
                             logit_transform=logit_transform, loss=loss, depth_weights=depth_weights)


def block_hidden(model, dtype: torch.dtype, block: Block, elements: CodElements,
                 attention_backend: str = "sdpa") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafter forward of :func:`block_loss`, for the elements the loss reads.

    Returns:
        ``hidden [E', H]`` (the drafter's output at the elements of non-zero weight), ``rows [E']
        int64`` (their element indices) and ``target_index [E'] int64`` (the row of
        ``block.final_hidden`` each one is scored against, ``a + d + 1``).
    """
    inp = element_inputs(elements, block.input_ids, block.position_ids)
    aux = block.aux_hidden[inp.feature_index[~inp.is_mask]].to(dtype)  # [E0, L*H] depth-0 rows only
    attention = element_attention(attention_backend, elements)  # its form of the §8 rule
    rows = torch.nonzero(elements.weight != 0).squeeze(1)  # [E'] elements the loss reads
    hidden = model(inp.input_ids, aux, inp.is_mask, inp.position_ids, attention, output_rows=rows)  # [E', H]
    return hidden, rows, inp.target_index[rows]


def accumulate_step(accelerator, model, params: list[torch.nn.Parameter], micro_batches,
                    n_micro: int, loss_fn) -> dict[str, torch.Tensor]:
    """Accumulate one optimizer step's gradient: that of the pooled objective over every micro-batch
    and data-parallel rank, ``Σ w·ℓ / Σ w`` (sums over all the step's elements on all ranks; ``w`` the
    element weight times its depth's weight, ℓ the run's loss).

    Each micro-batch backpropagates its unnormalised ``Σ w·ℓ`` (under ``no_sync`` but the last);
    the accumulated, all-reduced gradient is then scaled by ``world / W`` with ``W`` the step's
    global weight sum (DDP averages over the ``world`` ranks). A block with 4 weighted elements thus
    counts 4/(4+293) of a step shared with a 293-element block, not 1/2 as a mean of block means.

    Args:
        accelerator: the run's ``Accelerator``; model: the prepared (possibly DDP-wrapped) drafter;
        params: its trainable parameters (their ``.grad`` is scaled in place; sparse allowed).
        micro_batches: ``n_micro`` items, each passed to ``loss_fn``.
        loss_fn: ``item -> LossOutput`` (the forward, e.g. :func:`block_loss` under autocast).

    Returns:
        ``loss_sum [1]``, ``weight_sum [1]``, ``correct [K]``, ``counts [K]`` summed over the step's
        micro-batches and ranks (``loss_sum / weight_sum`` is the objective just optimised).
    """
    sums = None
    for i, item in enumerate(micro_batches):
        last = i == n_micro - 1
        with nullcontext() if last or accelerator.num_processes == 1 else accelerator.no_sync(model):
            res = loss_fn(item)
            accelerator.backward(res.loss_sum)
        sums = add_sums(sums, _reduce(accelerator, res))
    total = float(sums["weight_sum"].sum())
    scale = accelerator.num_processes / total if total > 0 else 0.0  # no weight: the gradient is 0 anyway
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return sums


def block_to(block: Block, device) -> Block:
    return block.to(device)


def sample_elements(block: Block, cfg, gen: torch.Generator) -> CodElements:
    """COD elements of ``block`` with the settings of ``cfg`` (a ``TrainConfig``), drawn from ``gen``."""
    return sample_cod_elements(block.cu_seqlens.cpu(), block.loss_mask.cpu(), cfg.model.num_depths,
                               cfg.data.down_sample_ratio, cfg.data.down_sample_ratio_min, cfg.data.max_anchors, gen)




def _reduce(accelerator, out: LossOutput) -> dict[str, torch.Tensor]:
    vals = {"loss_sum": out.loss_sum.detach().float().reshape(1), "weight_sum": out.weight_sum.float().reshape(1),
            "correct": out.correct.detach(), "counts": out.counts.detach()}
    if accelerator.num_processes > 1:
        vals = {k: accelerator.reduce(v, reduction="sum") for k, v in vals.items()}
    return vals


def gather_ids(accelerator, ids: list[int]) -> list[int]:
    """Block ids read this step by every rank, rank-major (``[world * grad_accum]``)."""
    t = torch.tensor(ids, dtype=torch.int64, device=accelerator.device)
    return (accelerator.gather(t) if accelerator.num_processes > 1 else t).tolist()


def summarise(sums: dict[str, torch.Tensor]) -> tuple[float, list[float | None]]:
    w = float(sums["weight_sum"].sum())
    loss = float(sums["loss_sum"].sum()) / w if w > 0 else 0.0
    acc = [(c / n) if n > 0 else None for c, n in zip(sums["correct"].tolist(), sums["counts"].tolist())]
    return loss, acc


def add_sums(acc: dict | None, new: dict) -> dict:
    return new if acc is None else {k: acc[k] + new[k] for k in acc}
