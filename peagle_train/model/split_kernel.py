"""The split attention backend's kernel (docs/design.md §8): two attention calls merged by log-sum-exp,
chunked, with a hand-written backward (:class:`peagle_train.model.attention.SplitElementAttention` runs it).

Legend: nh / nkv attention / key-value heads, rep = nh / nkv, hd head dim, R queries, c a chunk of
them, c' its chain queries, kr the chunk's depth-0 key range, K-1 chain keys.
"""

from __future__ import annotations

import torch

__all__ = ["SplitAttention"]


class SplitAttention(torch.autograd.Function):
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
        with torch.autocast(q.device.type, enabled=False):  # the kernel computes in float32 under bf16 autocast too
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
        with torch.autocast(q.device.type, enabled=False):
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
