"""Drafter attention backends (docs/design.md §8): one class per backend, looked up by name.

Legend: E drafter elements of one row, R query rows, nh / nkv attention / key-value heads, hd head dim.

A backend is an :class:`ElementAttention`: built from one forward's ``CodElements`` (it makes its
own form of the §8 rule, :mod:`peagle_train.model.element_mask`), it attends ``q [nh, R, hd]`` over
``k, v [nkv, E, hd]``. :data:`ATTENTION_BACKENDS` maps ``--attention-backend`` names to the classes;
:func:`resolve_attention_backend` turns ``auto`` and the device into a name. Training
(:mod:`peagle_train.train.step`), offline evaluation and speculative decoding build backends through
:func:`element_attention`, and :class:`~peagle_train.model.drafter.PEagleDrafter` calls ``attend``. A new
backend is one :class:`ElementAttention` subclass and one entry of :data:`ATTENTION_BACKENDS`.

- ``sdpa`` (:class:`DenseAttention`): a dense ``[E, E] bool`` mask and
  ``scaled_dot_product_attention``, in checkpointed query chunks when the mask is large; every
  device. Also takes a given mask (speculative decoding's cached causal order, tests).
- ``flex`` (:class:`FlexElementMask`): ``flex_attention`` BlockMasks built from the structure,
  ``[E, E]`` for every layer and ``[R, E]`` for the last layer's query rows; trains on CUDA only.
- ``split`` (:class:`SplitElementAttention`): no element×element tensor at all; the depth-0 range
  and the chain keys are attended separately and merged by log-sum-exp; every device.

All give the same numbers up to float rounding (tests).
"""

from __future__ import annotations

import warnings
from typing import ClassVar

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from peagle_train.data.cod import CodElements
from peagle_train.model.element_mask import (DEFAULT_BLOCK_SIZE, MaskMod, block_mask_from_elements,
                                             build_attention_mask, chain_pairs, depth0_ranges, make_mask_mod)
from peagle_train.model.split_kernel import SplitAttention
from stores.errors import InputError

__all__ = ["ElementAttention", "DenseAttention", "FlexElementMask", "SplitElementAttention", "ATTENTION_BACKENDS", "ATTENTION_CHOICES",
           "AUTO_BACKEND", "resolve_attention_backend", "element_attention", "as_element_attention", "sdpa_dense",
           "SDPA_MASK_BUDGET_BYTES"]


class ElementAttention:
    """One forward's attention under the §8 rule (the base of every backend).

    Attributes:
        name: the ``--attention-backend`` value (class attribute).
        cuda_only: None, or why the backend cannot train without CUDA (class attribute; refused
            there by :func:`resolve_attention_backend`).
        takes_cached_keys: whether ``attend`` accepts N cached keys before the E (class attribute;
            a :class:`~peagle_train.model.drafter.DrafterCache` forward needs it).
        elements: the ``CodElements`` it was built for (None for a given mask).
    """

    name: ClassVar[str] = ""
    cuda_only: ClassVar[str | None] = None
    takes_cached_keys: ClassVar[bool] = False
    __slots__ = ()

    def __init__(self, elements: CodElements):
        raise NotImplementedError

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``q [nh, R, hd]`` (the elements ``rows [R] int64``; None: all, ``R = E``) over
        ``k, v [nkv, E', hd]`` (grouped-query: ``nh`` a multiple of ``nkv``), scale ``hd ** -0.5``.

        ``E'`` is E, or N + E after N cached keys where the backend allows it. Returns ``[nh, R, hd]``.
        """
        raise NotImplementedError


class DenseAttention(ElementAttention):
    """Backend ``sdpa``: a dense boolean mask (:func:`build_attention_mask` of the elements, or the
    one given) and :func:`sdpa_dense`.

    Attributes:
        mask: ``[E, E'] bool``, True where query row may attend key column.
    """

    name = "sdpa"
    takes_cached_keys = True
    __slots__ = ("elements", "mask")

    def __init__(self, elements: CodElements | None = None, *, mask: torch.Tensor | None = None):
        if (elements is None) == (mask is None):
            raise ValueError("DenseAttention takes elements or a mask, one of them")
        self.elements = elements
        self.mask = build_attention_mask(elements) if mask is None else mask

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        """See :meth:`ElementAttention.attend`; the mask's rows ``rows`` are taken (keys: all)."""
        rep = q.shape[0] // k.shape[0]
        k = k.repeat_interleave(rep, dim=0)  # [nh, E', hd]
        v = v.repeat_interleave(rep, dim=0)
        return sdpa_dense(q, k, v, self.mask, rows)  # [nh, R, hd]


class FlexElementMask(ElementAttention):
    """Backend ``flex``: the §8 rule as ``flex_attention`` BlockMasks over E elements of one row,
    made on demand, attended by the fused kernel (compiled on CUDA; eager, forward only, elsewhere).

    Every decoder layer
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

    name = "flex"
    cuda_only = "torch's flex_attention has no backward on CPU (it runs the forward only)"
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

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rows: torch.Tensor | None = None) -> torch.Tensor:
        """See :meth:`ElementAttention.attend`; GQA inside the kernel (k, v stay ``[nkv, E, hd]``)."""
        if q.shape[1] == 0:  # no query: nothing to attend (flex_attention wants a non-empty query)
            return torch.zeros_like(q)
        return _flex_attention(q[None], k[None], v[None], self.block_mask(rows))[0]  # [nh, R, hd]

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



class SplitElementAttention(ElementAttention):
    """Backend ``split``: the §8 rule with no element×element tensor, two attention calls merged by
    log-sum-exp.

    Every query q attends (A) the depth-0 keys of its segment up to its own anchor, a contiguous
    column range ``[lo_q, p_q]`` (causal attention within the segment, with q placed at its anchor's
    depth-0 column ``p_q``), and a chain query (``d_q >= 1``) also (B) the keys of its own chain at
    depths ``1..d_q`` (at most K-1 keys, found once by binary search). The two softmaxes are merged
    by their log-sum-exp, which equals one softmax over the union of the keys (docs/design.md §8).
    Queries are sorted by ``p_q`` and run in chunks whose float32 score tiles stay under
    ``budget_bytes``; the backward recomputes each chunk's scores from q, k, v and the saved
    log-sum-exp (FlashAttention's backward, written out in :class:`~peagle_train.model.split_kernel.SplitAttention`), so the largest
    tensor is ``[heads, chunk, key range]``, never ``[E, E]``, and nothing per chunk outlives it.

    ``PEagleDrafter.forward`` takes this in place of the dense mask; :meth:`attend` runs it. Plain
    torch ops, so it runs and trains on any device; equal to the dense SDPA backend's outputs and
    gradients up to float rounding (tested).

    Attributes:
        elements: the ``CodElements`` sorted by (depth, anchor), chains complete.
        budget_bytes: most bytes of float32 scores one chunk may hold (forward).
    """

    name = "split"
    __slots__ = ("elements", "budget_bytes", "_lo", "_p", "_chain")

    def __init__(self, elements: CodElements, budget_bytes: int = 64 * 2 ** 20):
        self.elements = elements
        self.budget_bytes = int(budget_bytes)
        E = len(elements)
        q = torch.arange(E, device=elements.anchor.device)
        self._lo, hi = depth0_ranges(elements, q)  # [E], [E]
        self._p = hi - 1  # [E] depth-0 column of each element's own anchor
        K1 = max(int(elements.depth.max()) if E else 0, 1)
        chain = torch.full((E, K1), -1, dtype=torch.int64, device=q.device)  # [E, K-1] chain keys, -1 pad
        r, c = chain_pairs(elements, q)
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
        return SplitAttention.apply(q, k, v, lo, p, self._chain[idx], order, chunk)


#: ``--attention-backend`` name -> backend class (``auto`` is resolved by :func:`resolve_attention_backend`)
ATTENTION_BACKENDS: dict[str, type[ElementAttention]] = {
    cls.name: cls for cls in (DenseAttention, FlexElementMask, SplitElementAttention)}
#: the values ``--attention-backend`` accepts
ATTENTION_CHOICES: tuple[str, ...] = ("auto", *ATTENTION_BACKENDS)
#: what ``auto`` runs: with CUDA (the compiled flex_attention kernel skips the masked tiles) and without
#: (no ``[E, E]`` tensor, and faster than the dense mask on CPU, docs/benchmarks.md)
AUTO_BACKEND = {"cuda": "flex", "cpu": "split"}


def resolve_attention_backend(backend: str, cuda_available: bool | None = None) -> str:
    """The name of the backend the drafter runs: ``auto`` by :data:`AUTO_BACKEND`, others as given.

    Args:
        backend: ``auto`` or a key of :data:`ATTENTION_BACKENDS`.
        cuda_available: None asks ``torch.cuda.is_available()``.

    Raises:
        InputError: an unknown name, or a backend that cannot train without CUDA (its ``cuda_only``
            reason) where CUDA is not available; ``field`` is ``--attention-backend``.
    """
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if backend != "auto" and backend not in ATTENTION_BACKENDS:
        raise InputError(f"expected one of {', '.join(['auto', *ATTENTION_BACKENDS])}, got {backend!r}",
                         field="--attention-backend")
    if backend == "auto":
        return AUTO_BACKEND["cuda" if cuda else "cpu"]
    reason = ATTENTION_BACKENDS[backend].cuda_only
    if reason and not cuda:
        others = [n for n, c in ATTENTION_BACKENDS.items() if not c.cuda_only]
        raise InputError(f"{backend} needs CUDA: {reason}, so it cannot train here; use --attention-backend "
                         f"{', '.join(others)} or auto", field="--attention-backend")
    return backend


def element_attention(backend: str, elements: CodElements) -> ElementAttention:
    """The backend named ``backend`` (a key of :data:`ATTENTION_BACKENDS`) for ``elements``.

    Raises:
        ValueError: an unknown name (``auto`` included: resolve it first).
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")
    return ATTENTION_BACKENDS[backend](elements)


def as_element_attention(attention: ElementAttention | torch.Tensor) -> ElementAttention:
    """``attention`` as it is, or a ``[E, E'] bool`` mask as a :class:`DenseAttention`."""
    return DenseAttention(mask=attention) if isinstance(attention, torch.Tensor) else attention


# ------------------------------------------------------------------------------------------ kernels
_compiled_flex_attention = None  # torch.compile(flex_attention), made on the first CUDA call


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask) -> torch.Tensor:
    """``flex_attention`` of ``q [1, nh, R, hd]`` over ``k, v [1, nkv, E, hd]`` -> ``[1, nh, R, hd]``.

    On CUDA through one ``torch.compile(flex_attention)`` per process (the fused kernel, with
    backward); elsewhere eagerly, which torch implements for the forward only (on CPU it refuses
    inputs that require grad: "FlexAttention does not support backward on CPU").
    """
    gqa = q.shape[1] != k.shape[1]
    if q.device.type != "cuda":
        with warnings.catch_warnings():  # the eager path is intended here (tests, CPU inference)
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)


SDPA_MASK_BUDGET_BYTES = 256 * 2**20
"""Most bytes of float mask one SDPA call may materialise; larger query sets run in chunks."""


def _sdpa_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               mask_rows: torch.Tensor | slice) -> torch.Tensor:
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask[mask_rows])[0]


def sdpa_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
               rows: torch.Tensor | None = None, budget_bytes: int | None = None) -> torch.Tensor:
    """``scaled_dot_product_attention`` under a dense boolean mask, in query chunks when it is large.

    SDPA turns a boolean mask into an additive float mask of the same shape and, with autograd on,
    keeps it for the backward: ``4 R E`` bytes, 1.4 GB at E = 18K elements. When ``4 R E`` exceeds
    ``budget_bytes`` the queries run in chunks of ``budget_bytes / 4E`` rows, each under
    ``torch.utils.checkpoint`` when a gradient is needed, so at most one chunk's float mask exists at
    a time (forward and recomputed backward); the cost is one more attention forward per chunk.

    Args:
        q: ``[nh, R, hd]``; k, v: ``[nh, E, hd]`` (GQA already expanded).
        mask: ``[E, E] bool``, True where query row may attend key column.
        rows: ``[R] int64``, the elements the queries are (None: all E, ``R = E``).
        budget_bytes: default :data:`SDPA_MASK_BUDGET_BYTES`.

    Returns:
        ``[nh, R, hd]``, equal to one SDPA call over all R queries up to float rounding.
    """
    R, E = q.shape[1], k.shape[1]
    budget = SDPA_MASK_BUDGET_BYTES if budget_bytes is None else budget_bytes
    chunk = max(1, budget // (4 * max(E, 1)))
    if R <= chunk:
        return _sdpa_rows(q, k, v, mask, slice(None) if rows is None else rows)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    outs = []
    for i in range(0, R, chunk):
        mask_rows = slice(i, i + chunk) if rows is None else rows[i:i + chunk]
        qc = q[:, i:i + chunk]  # [nh, c, hd]
        if grad:
            outs.append(torch.utils.checkpoint.checkpoint(_sdpa_rows, qc, k, v, mask, mask_rows,
                                                          use_reentrant=False))
        else:
            outs.append(_sdpa_rows(qc, k, v, mask, mask_rows))
    return torch.cat(outs, dim=1)  # [nh, R, hd]
