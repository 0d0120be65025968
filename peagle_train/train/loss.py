"""Weighted forward KL to the verifier and per-depth accuracy, in chunks (docs/design.md §8).

Legend: E drafter elements, E' elements with non-zero weight, U distinct target rows, H hidden
size, D draft vocab, K ``num_depths``, C elements per chunk.

The soft target of element ``(a, d)`` is ``p = softmax(g(f_{a+d+1} @ W_v[draft_ids].T))`` where ``f``
is the verifier's stored final (post-norm) hidden state, ``W_v`` its lm_head and ``g`` the
verifier's own logit transform (:class:`LogitTransform`: Gemma-2's soft-capping, Cohere's and
Granite's scaling; the identity for most models), so ``p`` is the verifier's real distribution
restricted to the draft vocab; the drafter's
prediction is ``log q = log_softmax(h @ W_d.T)``. The loss is ``Σ_e w_e KL(p_e || q_e) / Σ_e w_e``
(0 when Σw = 0), as in EAGLE-3 (arXiv:2503.01840) and P-EAGLE (arXiv:2602.01469).

How it is computed (one pass, no recomputation):
- elements with ``w = 0`` (the unsupervised depth-0 context) are skipped: they add nothing to the
  loss, the gradient or the weighted accuracy;
- the rest are visited in order of their target row, ``C`` at a time, so the verifier's logits are
  computed once per distinct target row of a chunk (a row is the target of up to K elements);
- the gradient of ``Σ w KL`` with respect to the drafter logits is ``w (softmax(q) - p)``; it is
  formed inside each chunk while the logits are at hand and multiplied back to ``h`` (and to
  ``W_d`` when it trains), so backward only scales stored ``[E, H]`` / ``[D, H]`` gradients. No
  ``[E, D]`` tensor exists whole; the peak is a few ``[C, D]`` float32 buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LogitTransform", "LossOutput", "kl_loss_and_accuracy"]


@dataclass(frozen=True)
class LogitTransform:
    """How a verifier's logits follow from ``lm_head(final hidden)``: ``g(x) = c·tanh(s·x / c)``
    with ``s`` the scale and ``c`` the soft-cap (``g(x) = s·x`` without a cap).

    Attributes:
        scale: Cohere's ``logit_scale`` times ``1 / logits_scaling`` (Granite); 1.0 for most models.
        softcap: Gemma-2's ``final_logit_softcapping``, or None.
    """

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def from_config(cls, text_config) -> "LogitTransform":
        """The transform of a (language-model) config: reads ``final_logit_softcapping``,
        ``logit_scale`` and ``logits_scaling`` as transformers' Gemma-2/3, Cohere and Granite do."""
        scale = float(getattr(text_config, "logit_scale", None) or 1.0)
        scale /= float(getattr(text_config, "logits_scaling", None) or 1.0)
        cap = getattr(text_config, "final_logit_softcapping", None)
        return cls(scale=scale, softcap=float(cap) if cap else None)

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """``g(logits)``, any shape."""
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


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


def _kl_chunks(hidden, draft_head, target_hidden, target_index, verifier_head, weight, chunk: int,
               grad_hidden: bool, grad_head: bool, transform: LogitTransform | None = None):
    """The chunk loop. ``hidden [E', H]`` sorted by ``target_index [E']`` (rows of ``target_hidden``).

    Returns:
        (``Σ w KL`` float32 scalar, ``agree [E'] float32``, ``d loss_sum / d hidden [E', H]`` or None,
        ``d loss_sum / d draft_head [D, H] float32`` or None).
    """
    n = hidden.shape[0]
    dtype = hidden.dtype
    head = draft_head.to(dtype)  # [D, H]
    vhead = verifier_head.float()  # [D, H]
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    agree = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [E']
    g_hidden = torch.empty_like(hidden) if grad_hidden else None  # [E', H]
    g_head = torch.zeros(draft_head.shape, dtype=torch.float32, device=hidden.device) if grad_head else None
    for s in range(0, n, chunk):
        h = hidden[s:s + chunk]  # [C, H]
        w = weight[s:s + chunk, None]  # [C, 1]
        rows, inv = torch.unique_consecutive(target_index[s:s + chunk], return_inverse=True)  # [U], [C]
        t_logits = target_hidden[rows].float() @ vhead.T  # [U, D]
        t_logp = torch.log_softmax(transform(t_logits) if transform is not None else t_logits, dim=-1)
        p = t_logp.exp()  # [U, D]
        neg_entropy = (p * t_logp).sum(-1)  # [U]  Σ p log p
        t_arg = t_logp.argmax(-1)  # [U]
        del t_logp
        logq = (h @ head.T).float()  # [C, D]
        agree[s:s + chunk] = (logq.argmax(-1) == t_arg[inv]).float()
        logq -= torch.logsumexp(logq, dim=-1, keepdim=True)
        p_c = p[inv]  # [C, D]
        del p
        kl = neg_entropy[inv] - (p_c * logq).sum(-1)  # [C]
        loss_sum += (kl * w[:, 0]).sum()
        if g_hidden is None and g_head is None:
            continue
        grad = logq.exp_().sub_(p_c).mul_(w)  # [C, D]  w (softmax(q) - p) = d(Σ w KL)/d logits
        del p_c
        if g_hidden is not None:
            g_hidden[s:s + chunk] = (grad.to(dtype) @ head).to(dtype)  # [C, H]
        if g_head is not None:
            g_head.addmm_(grad.T, h.float())  # [D, H]
    return loss_sum, agree, g_hidden, g_head


class _WeightedKL(torch.autograd.Function):
    """``Σ w KL`` with its gradient formed in forward (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, draft_head, target_hidden, target_index, verifier_head, weight, chunk, transform):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):
            loss_sum, agree, g_h, g_w = _kl_chunks(hidden, draft_head, target_hidden, target_index,
                                                   verifier_head, weight, chunk, need_h, need_w, transform)
        ctx.save_for_backward(g_h if g_h is not None else hidden.new_zeros(0),
                              g_w.to(draft_head.dtype) if g_w is not None else draft_head.new_zeros(0))
        ctx.mark_non_differentiable(agree)
        return loss_sum, agree

    @staticmethod
    def backward(ctx, grad_loss, _grad_agree):
        g_h, g_w = ctx.saved_tensors
        out_h = g_h * grad_loss.to(g_h.dtype) if ctx.needs_input_grad[0] else None
        out_w = g_w * grad_loss.to(g_w.dtype) if ctx.needs_input_grad[1] else None
        return out_h, out_w, None, None, None, None, None, None


def kl_loss_and_accuracy(hidden: torch.Tensor, draft_head: torch.Tensor, target_hidden: torch.Tensor,
                         verifier_head: torch.Tensor, weight: torch.Tensor, depth: torch.Tensor,
                         num_depths: int, chunk_size: int | None = 2048,
                         target_index: torch.Tensor | None = None,
                         logit_transform: LogitTransform | None = None) -> LossOutput:
    """Weighted forward KL from the verifier's draft-vocab distribution to the drafter's.

    Args:
        hidden: ``[E, H]`` drafter output (after its final norm), float32 or bf16, with grad.
        draft_head: ``[D, H]`` the drafter's lm_head weight (may require grad).
        target_hidden: verifier final hidden states (no grad): ``[E, H]`` one per element
            (``f_{a+d+1}``) when ``target_index`` is None, else ``[T, H]`` the block's rows.
        verifier_head: ``[D, H]`` the verifier's lm_head rows of the draft vocab (frozen).
        weight: ``[E] float`` element weights ``w``.
        depth: ``[E] int64`` element depths, each in ``[0, num_depths)``.
        num_depths: K.
        chunk_size: elements per chunk; None computes all weighted elements in one piece.
        target_index: ``[E] int64`` row of ``target_hidden`` of each element (``a + d + 1``); lets
            the verifier's logits be computed once per distinct row.
        logit_transform: the verifier's :class:`LogitTransform` (None: the identity).

    Returns:
        :class:`LossOutput`.

    Raises:
        ValueError: mismatched leading dimensions or ``chunk_size < 1``.
    """
    E = hidden.shape[0]
    n_target = target_index.shape[0] if target_index is not None else target_hidden.shape[0]
    if not (n_target == weight.shape[0] == depth.shape[0] == E):
        raise ValueError(f"element counts differ: hidden {E}, target {n_target}, "
                         f"weight {weight.shape[0]}, depth {depth.shape[0]}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    dev = hidden.device
    weight = weight.to(dev).float()
    if target_index is None:
        target_index = torch.arange(E, device=dev)
    target_index = target_index.to(dev)
    keep = torch.nonzero(weight != 0).squeeze(1)  # [E']
    keep = keep[torch.argsort(target_index[keep], stable=True)]  # by target row
    chunk = max(1, keep.numel() if chunk_size is None else min(chunk_size, max(keep.numel(), 1)))
    loss_sum, agree_kept = _WeightedKL.apply(hidden[keep], draft_head, target_hidden.to(dev), target_index[keep],
                                             verifier_head.to(dev), weight[keep], chunk, logit_transform)
    loss_sum = loss_sum + 0.0 * hidden.sum()  # keeps the graph (and zero gradients) when E' = 0
    weight_sum = weight.sum().detach()
    loss = loss_sum / weight_sum if float(weight_sum) > 0 else loss_sum * 0.0
    dep = depth.to(dev)[keep]
    correct = torch.zeros(num_depths, device=dev).index_add_(0, dep, agree_kept * weight[keep])  # [K]
    counts = torch.zeros(num_depths, device=dev).index_add_(0, depth.to(dev), weight)  # [K]
    return LossOutput(loss=loss, loss_sum=loss_sum, weight_sum=weight_sum, correct=correct, counts=counts)
