"""Drafter forward: output_rows and depth-0-only aux rows give the same numbers as the full forward."""

import torch

from peagle_train.data.cod import element_inputs, sample_cod_elements
from peagle_train.model.config import DrafterConfig
from peagle_train.model.drafter import PEagleDrafter
from peagle_train.model.element_mask import build_attention_mask


def test_output_rows_and_depth0_aux_equal_full_forward():
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=50, draft_vocab_size=50, aux_layer_ids=[1, 2], num_hidden_layers=2)
    torch.manual_seed(0)
    model = PEagleDrafter(cfg)
    T = 40
    cu, m = torch.tensor([0, 15, 40]), (torch.arange(T) % 4 != 0).long()
    el = sample_cod_elements(cu, m, 4, 0.8, 0.2, None, torch.Generator().manual_seed(1))
    inp = element_inputs(el, torch.randint(0, 50, (T,)), torch.cat([torch.arange(15), torch.arange(25)]))
    aux = torch.randn(T, 64)
    mask = build_attention_mask(el)
    full = model(inp.input_ids, aux[inp.feature_index], inp.is_mask, inp.position_ids, mask)  # [E, H]
    rows = torch.nonzero(el.weight != 0).squeeze(1)
    part = model(inp.input_ids, aux[inp.feature_index[~inp.is_mask]], inp.is_mask, inp.position_ids, mask,
                 output_rows=rows)
    assert 0 < rows.numel() < len(el)
    torch.testing.assert_close(part, full[rows], rtol=1e-5, atol=1e-6)


def test_chunked_dense_attention_equals_one_call_values_and_grads(monkeypatch):
    """Above the mask budget the queries run in checkpointed chunks: same outputs and gradients."""
    import torch.nn.functional as F

    from peagle_train.model import attention as model_mod

    torch.manual_seed(0)
    E, nh, hd = 70, 2, 8
    mask = torch.rand(E, E) < 0.4
    mask |= torch.eye(E, dtype=torch.bool)
    rows = torch.tensor([3, 5, 6, 20, 21, 40, 41, 42, 69])
    calls = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(model_mod.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k["attn_mask"].shape) or real(*a, **k))
    for r in (None, rows):
        q0 = torch.randn(nh, E if r is None else len(rows), hd, requires_grad=True)
        k0, v0 = torch.randn(nh, E, hd, requires_grad=True), torch.randn(nh, E, hd, requires_grad=True)
        want = real(q0[None], k0[None], v0[None], attn_mask=mask if r is None else mask[r])[0]
        g_want = torch.autograd.grad(want.square().sum(), (q0, k0, v0))
        calls.clear()
        got = model_mod.sdpa_dense(q0, k0, v0, mask, r, budget_bytes=4 * E * 4)  # 4 query rows a chunk
        g_got = torch.autograd.grad(got.square().sum(), (q0, k0, v0))
        n = q0.shape[1]
        assert sorted(s[0] for s in calls) == sorted([min(4, n - i) for i in range(0, n, 4)] * 2)  # forward + recompute
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    calls.clear()
    with torch.no_grad():  # no gradient wanted: chunks without checkpoint, one call each
        model_mod.sdpa_dense(torch.randn(nh, E, hd), torch.randn(nh, E, hd), torch.randn(nh, E, hd), mask,
                             budget_bytes=4 * E * 4)
    assert len(calls) == (E + 3) // 4
    calls.clear()  # under the budget: one call
    model_mod.sdpa_dense(torch.randn(nh, E, hd), torch.randn(nh, E, hd), torch.randn(nh, E, hd), mask)
    assert [s for s in calls] == [(E, E)]


def test_cached_forward_equals_one_forward_over_all_elements():
    """Elements in the decoding order (depth-0 by anchor, then a chain): the §8 rule is causal, so two
    forwards through a DrafterCache give the rows of one forward over everything; only depth-0 stays."""
    import pytest

    from peagle_train.model.drafter import DrafterCache

    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=50, draft_vocab_size=50, aux_layer_ids=[1, 2], num_hidden_layers=2)
    torch.manual_seed(0)
    model = PEagleDrafter(cfg).eval()
    ids, aux = torch.randint(0, 50, (9,)), torch.randn(9, 64)
    # all at once: 7 depth-0 elements, then the chain (anchor 6, depths 1..2)
    is_mask = torch.arange(9) >= 7
    full = model(ids, aux, is_mask, torch.arange(1, 10), torch.ones(9, 9, dtype=torch.bool).tril())
    cache = DrafterCache()
    with torch.no_grad():
        first = model(ids[:4], aux[:4], torch.zeros(4, dtype=torch.bool), torch.arange(1, 5),
                      torch.ones(4, 4, dtype=torch.bool).tril(), cache=cache)
        rest = model(ids[4:], aux[4:7], is_mask[4:], torch.arange(5, 10),
                     torch.ones(5, 9, dtype=torch.bool).tril(4), cache=cache)
    torch.testing.assert_close(torch.cat([first, rest]), full, rtol=1e-5, atol=1e-6)
    assert cache.length == 7 and [tuple(c.keys.shape) for c in cache.layers] == [(2, 7, 8)] * 2
    with pytest.raises(ValueError, match="must come first"):
        cache.start(torch.tensor([True, False]), 2)
