"""Weighted forward KL to the verifier and per-depth accuracy, in chunks (DESIGN.md §8).

Legend: E drafter elements, H hidden size, D draft vocab, K ``num_depths``.

The soft target of element ``(a, d)`` is ``softmax(f_{a+d+1} @ W_v[draft_ids].T)`` where ``f`` is the
verifier's stored final (post-norm) hidden state and ``W_v`` its lm_head; the drafter's prediction
is ``log_softmax(h @ W_d.T)``. The loss is ``Σ_e w_e KL(p_e || q_e) / Σ_e w_e`` (0 when Σw = 0), as
in EAGLE-3 (arXiv:2503.01840) and P-EAGLE (arXiv:2602.01469). Logits are computed ``chunk_size``
elements at a time and recomputed in backward (``torch.utils.checkpoint``), so no ``[E, D]`` tensor
exists whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["LossOutput", "kl_loss_and_accuracy"]


@dataclass
class LossOutput:
    """Result of :func:`kl_loss_and_accuracy`.

    Attributes:
        loss: scalar float32 with grad, ``loss_sum / weight_sum`` (0 when ``weight_sum`` is 0).
        loss_sum: scalar float32 with grad, ``Σ w KL``.
        weight_sum: scalar float32, ``Σ w``.
        correct: ``[K] float32``, per depth ``Σ w [argmax q = argmax p]``.
        counts: ``[K] float32``, per depth ``Σ w``.
    """

    loss: torch.Tensor
    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    correct: torch.Tensor
    counts: torch.Tensor

    def accuracy(self) -> list[float | None]:
        """Per-depth accuracy, None where a depth has no weight."""
        return [(c / n) if n > 0 else None for c, n in zip(self.correct.tolist(), self.counts.tolist())]


def _chunk_kl(hidden: torch.Tensor, draft_head: torch.Tensor, target_hidden: torch.Tensor,
              verifier_head: torch.Tensor, weight: torch.Tensor):
    """``[C, H]`` drafter hidden, ``[C, H]`` verifier final hidden -> (Σ w KL scalar, agree [C] float)."""
    with torch.no_grad():
        t_logits = target_hidden.float() @ verifier_head.float().T  # [C, D]
        t_logp = F.log_softmax(t_logits, dim=-1)  # [C, D]
        t_arg = t_logits.argmax(-1)  # [C]
        del t_logits
    logq = F.log_softmax((hidden @ draft_head.T).float(), dim=-1)  # [C, D]
    kl = (t_logp.exp() * (t_logp - logq)).sum(-1)  # [C]
    agree = (logq.detach().argmax(-1) == t_arg).float()  # [C]
    return (kl * weight).sum(), agree


def kl_loss_and_accuracy(hidden: torch.Tensor, draft_head: torch.Tensor, target_hidden: torch.Tensor,
                         verifier_head: torch.Tensor, weight: torch.Tensor, depth: torch.Tensor,
                         num_depths: int, chunk_size: int | None = 2048) -> LossOutput:
    """Weighted forward KL from the verifier's draft-vocab distribution to the drafter's.

    Args:
        hidden: ``[E, H]`` drafter output (after its final norm), float32 or bf16, with grad.
        draft_head: ``[D, H]`` the drafter's lm_head weight (may require grad).
        target_hidden: ``[E, H]`` verifier final hidden ``f_{a+d+1}`` of each element (no grad).
        verifier_head: ``[D, H]`` the verifier's lm_head rows of the draft vocab (frozen).
        weight: ``[E] float`` element weights ``w``.
        depth: ``[E] int64`` element depths, each in ``[0, num_depths)``.
        num_depths: K.
        chunk_size: elements per chunk; None or >= E computes in one piece without checkpointing.

    Returns:
        :class:`LossOutput`.

    Raises:
        ValueError: mismatched leading dimensions or ``chunk_size < 1``.
    """
    E = hidden.shape[0]
    if not (target_hidden.shape[0] == weight.shape[0] == depth.shape[0] == E):
        raise ValueError(f"element counts differ: hidden {E}, target {target_hidden.shape[0]}, "
                         f"weight {weight.shape[0]}, depth {depth.shape[0]}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    weight = weight.float()
    step = E if chunk_size is None or chunk_size >= E else chunk_size
    loss_sum = hidden.new_zeros((), dtype=torch.float32) + 0.0 * hidden.sum()  # keeps the graph when E=0
    agree_parts = []
    for s in range(0, E, max(step, 1)):
        args = (hidden[s:s + step], draft_head, target_hidden[s:s + step], verifier_head, weight[s:s + step])
        if step < E and torch.is_grad_enabled():
            part, agree = checkpoint(_chunk_kl, *args, use_reentrant=False)
        else:
            part, agree = _chunk_kl(*args)
        loss_sum = loss_sum + part
        agree_parts.append(agree)
    agree = torch.cat(agree_parts) if agree_parts else hidden.new_zeros(0, dtype=torch.float32)  # [E]
    weight_sum = weight.sum().detach()
    loss = loss_sum / weight_sum if float(weight_sum) > 0 else loss_sum * 0.0
    dep = depth.to(hidden.device)
    correct = torch.zeros(num_depths, device=hidden.device).index_add_(0, dep, agree * weight)  # [K]
    counts = torch.zeros(num_depths, device=hidden.device).index_add_(0, dep, weight)  # [K]
    return LossOutput(loss=loss, loss_sum=loss_sum, weight_sum=weight_sum, correct=correct, counts=counts)
