"""The split attention backend (depth-0 range + own chain, merged by log-sum-exp) equals the dense
SDPA backend in outputs and gradients (docs/design.md §8), and never builds an [E, E] tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peagle_train.data.cod import all_elements, element_inputs, sample_cod_elements
from peagle_train.model.attention import SplitElementAttention
from peagle_train.model.config import DrafterConfig
from peagle_train.model.drafter import PEagleDrafter
from peagle_train.model.element_mask import build_attention_mask
from peagle_train.train.step import block_loss
from tests.peagle_train.model.test_flex_attention import _block

H, V, L = 32, 60, 2


def _model(num_layers: int = 2) -> PEagleDrafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 2],
                        num_hidden_layers=num_layers)
    return PEagleDrafter(cfg)


@pytest.mark.parametrize("budget", [64 * 2 ** 20, 4096])  # one chunk; many chunks of 8 queries
@pytest.mark.parametrize("with_rows", [False, True])
def test_split_attention_equals_dense_sdpa_outputs_and_grads(budget, with_rows):
    """One attention call (GQA 4/2 heads) on random q, k, v: outputs and q/k/v gradients."""
    block = _block()
    el = sample_cod_elements(block.cu_seqlens, block.loss_mask, 6, 0.8, 0.2, None, torch.Generator().manual_seed(2))
    E = len(el)
    rows = torch.nonzero(el.weight != 0).squeeze(1) if with_rows else None
    R = E if rows is None else rows.numel()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(4, R, 16, generator=g, requires_grad=True)
    k = torch.randn(2, E, 16, generator=g, requires_grad=True)
    v = torch.randn(2, E, 16, generator=g, requires_grad=True)
    dense = build_attention_mask(el)
    m = dense if rows is None else dense[rows]
    ref = F.scaled_dot_product_attention(q[None], k.repeat_interleave(2, 0)[None], v.repeat_interleave(2, 0)[None],
                                         attn_mask=m)[0]
    got = SplitElementAttention(el, budget_bytes=budget).attend(q, k, v, rows)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    w = torch.randn(ref.shape, generator=g)
    gr = torch.autograd.grad((ref * w).sum(), (q, k, v))
    gg = torch.autograd.grad((got * w).sum(), (q, k, v))
    for a, b in zip(gg, gr):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("make", ["sampled", "capped", "all"])
def test_block_loss_and_gradients_equal_the_dense_backend(make):
    """The full training loss (2 layers, output rows, chunked KL) and every parameter gradient."""
    block = _block(seg_lens=(37, 90, 14, 59, 3))
    gen = torch.Generator().manual_seed(1)
    el = {"sampled": lambda: sample_cod_elements(block.cu_seqlens, block.loss_mask, 5, 0.8, 0.2, None, gen),
          "capped": lambda: sample_cod_elements(block.cu_seqlens, block.loss_mask, 5, 0.8, 0.2, 20, gen),
          "all": lambda: all_elements(block.cu_seqlens, block.loss_mask, 4)}[make]()
    assert_same_loss_and_grads(block, el, "split", atol=1e-5)


def assert_same_loss_and_grads(block, el, backend: str, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """``block_loss`` (K = 5, chunks of 64) and every parameter gradient of ``backend`` equal the sdpa
    backend's on the same fresh model."""
    vhead = 0.1 * torch.randn(V, H, generator=torch.Generator().manual_seed(3))
    results = {}
    for name in ("sdpa", backend):
        model = _model()
        res = block_loss(model, model.lm_head.weight, vhead, block, el, 5, 64, attention_backend=name)
        res.loss.backward()
        results[name] = (res.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                             if p.grad is not None})
    (la, ga), (lb, gb) = results["sdpa"], results[backend]
    torch.testing.assert_close(lb, la, rtol=rtol, atol=atol)
    assert ga.keys() == gb.keys() and len(ga) > 5
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=rtol, atol=atol, msg=n)


def test_split_attention_notices_a_wrong_rule():
    """The comparison can fail: attend one chain key too few and the output moves."""
    block = _block()
    el = sample_cod_elements(block.cu_seqlens, block.loss_mask, 5, 0.8, 0.2, None, torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(4, len(el), 16, generator=g), torch.randn(2, len(el), 16, generator=g), \
        torch.randn(2, len(el), 16, generator=g)
    split = SplitElementAttention(el)
    good = split.attend(q, k, v)
    deep = int(torch.nonzero(el.depth == 2)[0])
    split._chain[deep, 0] = -1  # forget (a, 1) for one depth-2 query
    bad = split.attend(q, k, v)
    assert not torch.allclose(bad[:, deep], good[:, deep], atol=1e-3)
    others = torch.arange(len(el)) != deep
    torch.testing.assert_close(bad[:, others], good[:, others])


def test_no_element_by_element_tensor_is_built(monkeypatch):
    """Every tensor the split forward and backward allocate is far below E x E elements."""
    block = _block(seg_lens=(300, 200))
    el = sample_cod_elements(block.cu_seqlens, block.loss_mask, 6, 0.8, 0.2, None, torch.Generator().manual_seed(0))
    E = len(el)
    model = _model(num_layers=1)
    inp = element_inputs(el, block.input_ids, block.position_ids)
    aux = block.aux_hidden[inp.feature_index[~inp.is_mask]].float()
    biggest = []

    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    biggest.append(t.numel())
            return out

    split = SplitElementAttention(el, budget_bytes=256 * 1024)
    with Watch():
        hidden = model(inp.input_ids, aux, inp.is_mask, inp.position_ids, split)
        hidden.sum().backward()
    assert E > 1000 and max(biggest) < E * E // 8
