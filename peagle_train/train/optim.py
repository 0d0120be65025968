"""AdamW with lazy row updates for the embedding table (docs/design.md §8: ``embed_tokens`` trains).

Legend: V rows of an embedding table, H its width, R rows touched in a step.

A drafter step looks up a few hundred of the verifier's 49152 embedding rows, yet dense AdamW
reads and writes all ``V x H`` weights and both moment buffers every step (about 1 s on one CPU
core at SmolLM2 sizes, more than the model's own compute). :class:`LazyRowAdamW` is
``torch.optim.AdamW`` for every parameter group except those marked ``lazy_rows=True``: there it
updates only the rows whose gradient is non-zero, with AdamW's formula and a per-row step count for
the bias correction, and leaves the other rows and their moments untouched (the "lazy Adam" of
TensorFlow's ``LazyAdam`` and ``torch.optim.SparseAdam``). Gradients stay dense, so gradient
clipping and data-parallel all-reduce work unchanged; after an all-reduce every rank sees the same
non-zero rows and applies the same update. A sparse gradient (``nn.Embedding(sparse=True)``, used in
a single process) is taken as is and never made dense; :func:`clip_grad_norm` clips both kinds.
"""

from __future__ import annotations

import math

import torch

from peagle_train.train.config import OptimConfig

__all__ = ["LazyRowAdamW", "clip_grad_norm", "build_optimizer", "CosineWithWarmup"]


class LazyRowAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW``; parameter groups with ``lazy_rows=True`` update touched rows only.

    A lazy group's parameters must be 2-D (``[V, H]``); its state is ``exp_avg [V, H]``,
    ``exp_avg_sq [V, H]`` and ``step [V] int64`` (per-row step counts). ``amsgrad``, ``maximize`` and complex
    parameters are not supported in a lazy group.
    """

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        for group in self.param_groups:
            group.setdefault("lazy_rows", False)
            if group["lazy_rows"]:
                if group["amsgrad"] or group["maximize"]:
                    raise ValueError("lazy_rows groups support neither amsgrad nor maximize")
                if any(p.dim() != 2 for p in group["params"]):
                    raise ValueError("lazy_rows groups take 2-D [rows, width] parameters only")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group in self.param_groups:
            if not group.get("lazy_rows"):
                continue
            for p in group["params"]:
                if p.grad is not None:
                    self._lazy_update(p, group)
                    hidden.append((p, p.grad))
                    p.grad = None  # AdamW below skips parameters without a gradient
        try:
            super().step()
        finally:
            for p, g in hidden:
                p.grad = g
        return loss

    def _lazy_update(self, p: torch.Tensor, group: dict) -> None:
        grad = p.grad
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] = torch.zeros(p.shape[0], dtype=torch.int64, device=p.device)
        if grad.is_sparse:  # nn.Embedding(sparse=True): the looked-up rows only
            grad = grad.coalesce()
            rows, g = grad.indices()[0], grad.values()  # [R], [R, H]
            touched = g.ne(0).any(dim=1)  # [R] same rule as the dense path
            rows, g = rows[touched], g[touched]
        else:
            rows = torch.nonzero(grad.ne(0).any(dim=1)).squeeze(1)  # [R]
            g = grad.index_select(0, rows)  # [R, H]
        if rows.numel() == 0:
            return
        lr = float(group["lr"])
        beta1, beta2 = (float(b) for b in group["betas"])
        m = state["exp_avg"].index_select(0, rows).lerp_(g, 1 - beta1)  # [R, H]
        v = state["exp_avg_sq"].index_select(0, rows).mul_(beta2).addcmul_(g, g, value=1 - beta2)  # [R, H]
        step = state["step"].index_select(0, rows) + 1  # [R]
        bc1 = 1 - beta1 ** step.to(torch.float64)  # [R]
        bc2 = 1 - beta2 ** step.to(torch.float64)  # [R]
        denom = (v.sqrt() / bc2.sqrt().to(v.dtype)[:, None]).add_(group["eps"])  # [R, H]
        w = p.index_select(0, rows)  # [R, H]
        if group["weight_decay"]:
            w.mul_(1 - lr * group["weight_decay"])
        w.addcdiv_(m, denom * (bc1.to(v.dtype)[:, None] / lr), value=-1.0)
        p.index_copy_(0, rows, w)
        state["exp_avg"].index_copy_(0, rows, m)
        state["exp_avg_sq"].index_copy_(0, rows, v)
        state["step"].index_copy_(0, rows, step)


@torch.no_grad()
def clip_grad_norm(params, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` (L2, same coefficient) that also takes sparse gradients.

    Sparse gradients (``nn.Embedding(sparse=True)``) are coalesced in place first.

    Returns:
        The total gradient norm before clipping, a float32 scalar.
    """
    dense, sparse = [], []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            p.grad = p.grad.coalesce()
            sparse.append(p.grad.values())
        else:
            dense.append(p.grad)
    norms = [torch.linalg.vector_norm(g.float()) for g in dense + sparse]
    if not norms:
        return torch.zeros(())
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in dense + sparse:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def build_optimizer(model, cfg: OptimConfig) -> LazyRowAdamW:
    """AdamW over the trainable parameters of ``model`` (a ``PEagleDrafter``) with ``cfg.lr`` and
    ``cfg.weight_decay``; ``embed_tokens`` updated lazily by rows unless ``cfg.lazy_embedding`` is false."""
    embed = model.embed_tokens.weight
    rest = [p for p in model.parameters() if p.requires_grad and p is not embed]
    groups = [{"params": rest}]
    if embed.requires_grad:
        groups.append({"params": [embed], "lazy_rows": cfg.lazy_embedding})
    return LazyRowAdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)


class CosineWithWarmup:
    """LR multiplier: linear warm-up to 1 over ``warmup`` steps, then cosine to 0 at ``total``."""

    def __init__(self, warmup: int, total: int):
        self.warmup, self.total = warmup, total

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
