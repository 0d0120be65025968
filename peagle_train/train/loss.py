"""The drafter's weighted loss against the verifier and per-depth accuracy, in chunks (docs/design.md §8).

Legend: E drafter elements, E' elements with non-zero weight, U distinct target rows, H hidden
size, D draft vocab, K ``num_depths``, C elements per chunk.

The soft target of element ``(a, d)`` is ``p = softmax(g(f_{a+d+1} @ W_v[draft_ids].T))`` where ``f``
is the verifier's stored final (post-norm) hidden state, ``W_v`` its lm_head and ``g`` the
verifier's own logit transform (:class:`LogitTransform`: Gemma-2's soft-capping, Cohere's and
Granite's scaling; the identity for most models), so ``p`` is the verifier's real distribution
restricted to the draft vocab; the drafter's prediction is ``q = softmax(z)``, ``z = h @ W_d.T``. The
loss is ``Σ_e λ_{d_e} m_e ℓ(p_e, q_e) / Σ_e λ_{d_e} m_e`` (0 when the denominator is 0), ``m`` the
element weight (loss mask), ``λ`` the per-depth weights (``--depth-weights``, default all 1), and
ℓ one of :data:`LOSSES`, named as the ``speculators`` trainer names them (its loss-fn option;
``speculators/losses/eager.py`` 0.9), with ``α = Σ_v min(p_v, q_v)`` the acceptance probability of a
token drafted from q and verified by rejection sampling against p (Leviathan et al. 2023):

- ``kl_div`` (default): forward ``KL(p || q)``, as in EAGLE-3 (arXiv:2503.01840) and P-EAGLE
  (arXiv:2602.01469); ``dℓ/dz = q - p``;
- ``tv``: total variation ``1 - α = ½ Σ |p - q|``, what sampled drafting (T > 0) accepts;
  ``dℓ/dz_j = -q_j (s_j - Σ_v s_v q_v)``, ``s_v = [q_v <= p_v]`` (the sub-gradient at ties that
  ``speculators``' fused kernel takes);
- ``nla``: ``-log max(α, 1e-5)``, the LK^α loss of Samarin et al., "LK Losses: Direct Acceptance Rate
  Optimization for Speculative Decoding" (arXiv:2602.23881); ``dℓ/dz = (1/α) d(1-α)/dz`` (0 where
  clamped);
- ``lk_hybrid``: ``λ KL + (1 - λ) TV`` with ``λ = exp(-η sg[α])``, η = 3, the same paper's hybrid
  LK^λ (λ not differentiated); ``dℓ/dz = λ (q - p) + (1 - λ) d TV/dz``;
- ``ce``: ``-log q_y``, ``y = argmax p``: the T = 0 acceptance surrogate. A T = 0 verifier accepts
  only its argmax y, i.e. its target is the point mass at y, for which ``α = q_y`` and LK^α reduces to
  this cross-entropy; the greedy acceptance ``[argmax q = y]`` itself has no gradient, and ``q_y`` is
  its smooth surrogate (our reading; ``speculators`` says the same of its ``nla``). ``dℓ/dz = q - onehot(y)``.

How it is computed (one pass, no recomputation):
- elements with ``m = 0`` (the unsupervised depth-0 context) are skipped: they add nothing to the
  loss, the gradient or the weighted accuracy;
- the rest are visited in order of their target row, ``C`` at a time, so the verifier's logits are
  computed once per distinct target row of a chunk (a row is the target of up to K elements);
- the gradient of ``Σ λ m ℓ`` with respect to the drafter logits (closed forms above, tested against
  autograd) is formed inside each chunk while the logits are at hand and multiplied back to ``h``
  (and to ``W_d`` when it trains), so backward only scales stored ``[E, H]`` / ``[D, H]`` gradients. No
  ``[E, D]`` tensor exists whole; the peak is a few ``[C, D]`` float32 buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LOSSES", "NLA_EPS", "LK_HYBRID_ETA", "LogitTransform", "LossOutput", "loss_and_accuracy"]

LOSSES = ("kl_div", "tv", "nla", "lk_hybrid", "ce")
"""The per-element losses (``--loss``), by ``speculators``' names; see the module docstring."""
NLA_EPS = 1e-5
"""``nla`` clamps α at this floor (``speculators``' ``_NLA_EPS``)."""
LK_HYBRID_ETA = 3.0
"""η of ``lk_hybrid`` (the paper's best hybrid setting, ``speculators``' default)."""


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
    """Result of :func:`loss_and_accuracy`.

    Attributes:
        loss: scalar float32 with grad, ``loss_sum / weight_sum`` (0 when ``weight_sum`` is 0).
        loss_sum: scalar float32 with grad, ``Σ λ m ℓ``.
        weight_sum: scalar float32, ``Σ λ m``.
        correct: ``[K] float32``, per depth ``Σ m [argmax q = argmax p]``.
        counts: ``[K] float32``, per depth ``Σ m``.
    """

    loss: torch.Tensor
    loss_sum: torch.Tensor
    weight_sum: torch.Tensor
    correct: torch.Tensor
    counts: torch.Tensor

    def accuracy(self) -> list[float | None]:
        """Per-depth accuracy, None where a depth has no weight."""
        return [(c / n) if n > 0 else None for c, n in zip(self.correct.tolist(), self.counts.tolist())]


def _element_loss_and_grad(loss: str, logq: torch.Tensor, p: torch.Tensor, neg_entropy: torch.Tensor,
                           t_arg: torch.Tensor, need_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's per-element loss and its gradient with respect to the drafter logits ``z``.

    Args:
        loss: a name of :data:`LOSSES`.
        logq: ``[C, D] float32`` ``log softmax(z)`` (not changed).
        p: ``[C, D] float32`` the verifier's target distribution.
        neg_entropy: ``[C] float32`` ``Σ p log p``.
        t_arg: ``[C] int64`` ``argmax p``.
        need_grad: form the gradient.

    Returns:
        (``[C] float32`` the loss of each element, ``[C, D] float32`` ``d loss / d z`` or None).
    """
    q = logq.exp()  # [C, D]
    if loss == "kl_div":  # KL(p || q) = Σ p log p - Σ p log q;  d/dz = q - p
        value = neg_entropy - (p * logq).sum(-1)
        return value, (q.sub_(p) if need_grad else None)
    if loss == "ce":  # -log q_y, y = argmax p;  d/dz = q - onehot(y)
        value = -logq.gather(1, t_arg[:, None])[:, 0]
        if need_grad:
            q[torch.arange(q.shape[0], device=q.device), t_arg] -= 1.0
        return value, (q if need_grad else None)
    # alpha = Σ min(p, q) = Σ_{q <= p} q + Σ_{q > p} p;  TV = 1 - alpha = 1/2 Σ |p - q|
    below = q <= p  # [C, D] s_v
    alpha = torch.where(below, q, p).sum(-1)  # [C]
    tv = 1.0 - alpha
    g_tv = None
    if need_grad:  # d TV / d z_j = -q_j (s_j - Σ_v s_v q_v)
        s_q = torch.where(below, q, 0.0).sum(-1, keepdim=True)  # [C, 1]
        g_tv = q.mul_(s_q - below.float()) if loss != "lk_hybrid" else q * (s_q - below.float())
    if loss == "tv":
        return tv, g_tv
    if loss == "nla":  # -log max(alpha, eps);  d/dz = (1 / alpha) d TV / d z, 0 where clamped
        value = -torch.log(alpha.clamp_min(NLA_EPS))
        if need_grad:
            g_tv.mul_(torch.where(alpha >= NLA_EPS, 1.0 / alpha.clamp_min(NLA_EPS), 0.0)[:, None])
        return value, g_tv
    # lk_hybrid: lam KL + (1 - lam) TV, lam = exp(-eta sg[alpha]), not differentiated
    lam = torch.exp(-LK_HYBRID_ETA * alpha)  # [C]
    kl = neg_entropy - (p * logq).sum(-1)
    value = lam * kl + (1.0 - lam) * tv
    if not need_grad:
        return value, None
    return value, q.sub_(p).mul_(lam[:, None]).add_(g_tv.mul_((1.0 - lam)[:, None]))


def _loss_chunks(hidden, draft_head, target_hidden, target_index, verifier_head, weight, chunk: int,
                 grad_hidden: bool, grad_head: bool, transform: LogitTransform | None = None,
                 loss: str = "kl_div"):
    """The chunk loop. ``hidden [E', H]`` sorted by ``target_index [E']`` (rows of ``target_hidden``).

    Returns:
        (``Σ w ℓ`` float32 scalar, ``agree [E'] float32``, ``d loss_sum / d hidden [E', H]`` or None,
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
    need_grad = g_hidden is not None or g_head is not None
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
        value, grad = _element_loss_and_grad(loss, logq, p_c, neg_entropy[inv], t_arg[inv], need_grad)  # [C], [C, D]
        del p_c, logq
        loss_sum += (value * w[:, 0]).sum()
        if not need_grad:
            continue
        grad.mul_(w)  # [C, D]  d(Σ w ℓ)/d logits
        if g_hidden is not None:
            g_hidden[s:s + chunk] = (grad.to(dtype) @ head).to(dtype)  # [C, H]
        if g_head is not None:
            g_head.addmm_(grad.T, h.float())  # [D, H]
    return loss_sum, agree, g_hidden, g_head


class _WeightedLoss(torch.autograd.Function):
    """``Σ w ℓ`` with its gradient formed in forward (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, draft_head, target_hidden, target_index, verifier_head, weight, chunk, transform, loss):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        with torch.autocast(hidden.device.type, enabled=False):
            loss_sum, agree, g_h, g_w = _loss_chunks(hidden, draft_head, target_hidden, target_index,
                                                     verifier_head, weight, chunk, need_h, need_w, transform, loss)
        ctx.save_for_backward(g_h if g_h is not None else hidden.new_zeros(0),
                              g_w.to(draft_head.dtype) if g_w is not None else draft_head.new_zeros(0))
        ctx.mark_non_differentiable(agree)
        return loss_sum, agree

    @staticmethod
    def backward(ctx, grad_loss, _grad_agree):
        g_h, g_w = ctx.saved_tensors
        out_h = g_h * grad_loss.to(g_h.dtype) if ctx.needs_input_grad[0] else None
        out_w = g_w * grad_loss.to(g_w.dtype) if ctx.needs_input_grad[1] else None
        return out_h, out_w, None, None, None, None, None, None, None


def loss_and_accuracy(hidden: torch.Tensor, draft_head: torch.Tensor, target_hidden: torch.Tensor,
                      verifier_head: torch.Tensor, weight: torch.Tensor, depth: torch.Tensor,
                      num_depths: int, chunk_size: int | None = 2048,
                      target_index: torch.Tensor | None = None,
                      logit_transform: LogitTransform | None = None, loss: str = "kl_div",
                      depth_weights: tuple[float, ...] | list[float] | None = None) -> LossOutput:
    """The weighted loss (:data:`LOSSES`, default forward KL) of the drafter's draft-vocab distribution
    against the verifier's, and the per-depth accuracy.

    Args:
        hidden: ``[E, H]`` drafter output (after its final norm), float32 or bf16, with grad.
        draft_head: ``[D, H]`` the drafter's lm_head weight (may require grad).
        target_hidden: verifier final hidden states (no grad): ``[E, H]`` one per element
            (``f_{a+d+1}``) when ``target_index`` is None, else ``[T, H]`` the block's rows.
        verifier_head: ``[D, H]`` the verifier's lm_head rows of the draft vocab (frozen).
        weight: ``[E] float`` element weights ``m`` (the loss mask: 0 or 1).
        depth: ``[E] int64`` element depths, each in ``[0, num_depths)``.
        num_depths: K.
        chunk_size: elements per chunk; None computes all weighted elements in one piece.
        target_index: ``[E] int64`` row of ``target_hidden`` of each element (``a + d + 1``); lets
            the verifier's logits be computed once per distinct row.
        logit_transform: the verifier's :class:`LogitTransform` (None: the identity).
        loss: the per-element loss ℓ, a name of :data:`LOSSES`.
        depth_weights: ``[K]`` non-negative weights λ_d (None: all 1); the loss is then
            ``Σ λ_d m ℓ / Σ λ_d m`` while the accuracy stays weighted by ``m`` alone.

    Returns:
        :class:`LossOutput` (``weight_sum`` is ``Σ λ_d m``).

    Raises:
        ValueError: mismatched leading dimensions, ``chunk_size < 1``, an unknown ``loss``, or
            ``depth_weights`` not K finite non-negative numbers.
    """
    E = hidden.shape[0]
    n_target = target_index.shape[0] if target_index is not None else target_hidden.shape[0]
    if not (n_target == weight.shape[0] == depth.shape[0] == E):
        raise ValueError(f"element counts differ: hidden {E}, target {n_target}, "
                         f"weight {weight.shape[0]}, depth {depth.shape[0]}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
    dev = hidden.device
    weight = weight.to(dev).float()
    loss_weight = weight
    if depth_weights is not None:
        lam = torch.as_tensor(list(depth_weights), dtype=torch.float32, device=dev)  # [K]
        if lam.numel() != num_depths or not bool(torch.isfinite(lam).all()) or bool((lam < 0).any()):
            raise ValueError(f"depth_weights must be {num_depths} finite numbers >= 0, got {list(depth_weights)}")
        loss_weight = weight * lam[depth.to(dev)]  # [E]
    if target_index is None:
        target_index = torch.arange(E, device=dev)
    target_index = target_index.to(dev)
    keep = torch.nonzero(weight != 0).squeeze(1)  # [E']
    keep = keep[torch.argsort(target_index[keep], stable=True)]  # by target row
    chunk = max(1, keep.numel() if chunk_size is None else min(chunk_size, max(keep.numel(), 1)))
    loss_sum, agree_kept = _WeightedLoss.apply(hidden[keep], draft_head, target_hidden.to(dev), target_index[keep],
                                               verifier_head.to(dev), loss_weight[keep], chunk, logit_transform, loss)
    loss_sum = loss_sum + 0.0 * hidden.sum()  # keeps the graph (and zero gradients) when E' = 0
    weight_sum = loss_weight.sum().detach()
    loss_value = loss_sum / weight_sum if float(weight_sum) > 0 else loss_sum * 0.0
    dep = depth.to(dev)[keep]
    correct = torch.zeros(num_depths, device=dev).index_add_(0, dep, agree_kept * weight[keep])  # [K]
    counts = torch.zeros(num_depths, device=dev).index_add_(0, depth.to(dev), weight)  # [K]
    return LossOutput(loss=loss_value, loss_sum=loss_sum, weight_sum=weight_sum, correct=correct, counts=counts)
