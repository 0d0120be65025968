"""Drafter forward: output_rows and depth-0-only aux rows give the same numbers as the full forward; the
qwen3 layer equals transformers' Qwen3 attention and runs on every backend."""

import dataclasses

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


def _qwen3_drafter(num_layers: int = 2, seed: int = 0) -> PEagleDrafter:
    """A qwen3-layer drafter (H 32, GQA 4/2 heads of 16) whose q_norm/k_norm and other norms are random,
    not ones, so a norm left out or misplaced changes the output."""
    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=60, draft_vocab_size=60, aux_layer_ids=[1, 2],
                        num_hidden_layers=num_layers, rms_norm_eps=1e-6, layer_type="qwen3",
                        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})
    torch.manual_seed(seed)
    model = PEagleDrafter(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _transformers_qwen3(model: PEagleDrafter, ids: torch.Tensor, aux: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The drafter's forward over E depth-0 elements under a causal mask, computed with transformers' own
    Qwen3 modules (``Qwen3Attention`` with its q_norm/k_norm and RoPE, ``Qwen3RMSNorm``, ``Qwen3MLP``,
    ``Qwen3RotaryEmbedding``), the weights copied from ``model`` (layer 0's q/k/v read 2H: its projections are
    put into the transformers attention); the EAGLE-3 wiring as vLLM's ``Qwen3Eagle3DecoderLayer``."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

    c = model.config
    qc = Qwen3Config(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                     head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_parameters=dict(c.rope_parameters),
                     num_hidden_layers=c.num_hidden_layers, attention_bias=False, vocab_size=c.vocab_size)
    qc._attn_implementation = "eager"

    def norm(ours):
        n = Qwen3RMSNorm(ours.weight.shape[0], eps=c.rms_norm_eps)
        n.weight.data.copy_(ours.weight)
        return n

    E = ids.shape[0]
    causal = torch.full((E, E), float("-inf")).triu(1)[None, None]  # [1, 1, E, E]
    cos_sin = Qwen3RotaryEmbedding(qc)(aux[None], pos[None])
    residual = model.fc(aux)[None]  # [1, E, H]
    for i, layer in enumerate(model.layers):
        attn = Qwen3Attention(qc, i).eval()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(attn, name, getattr(layer.self_attn, name))
        attn.q_norm, attn.k_norm = norm(layer.self_attn.q_norm), norm(layer.self_attn.k_norm)
        mlp = Qwen3MLP(qc)
        mlp.load_state_dict(layer.mlp.state_dict())
        if i == 0:
            x = torch.cat([norm(layer.input_layernorm)(model.embed_tokens(ids)[None]),
                           norm(layer.hidden_norm)(residual)], dim=-1)
        else:
            x = norm(layer.input_layernorm)(residual)
        residual = residual + attn(x, cos_sin, causal)[0]
        residual = residual + mlp(norm(layer.post_attention_layernorm)(residual))
    return norm(model.norm)(residual)[0]  # [E, H]


def test_qwen3_layer_forward_equals_transformers_qwen3_attention():
    model = _qwen3_drafter().eval()
    E = 11
    g = torch.Generator().manual_seed(1)
    ids, aux, pos = torch.randint(0, 60, (E,), generator=g), torch.randn(E, 64, generator=g), torch.arange(3, 3 + E)
    causal = torch.ones(E, E, dtype=torch.bool).tril()
    with torch.no_grad():
        ours = model(ids, aux, torch.zeros(E, dtype=torch.bool), pos, causal)
        theirs = _transformers_qwen3(model, ids, aux, pos)
        # the same weights as a llama layer (q_norm/k_norm left out) compute otherwise
        llama = PEagleDrafter(dataclasses.replace(model.config, layer_type="llama")).eval()
        llama.load_state_dict({k: v for k, v in model.state_dict().items() if "q_norm" not in k and "k_norm" not in k})
        other = llama(ids, aux, torch.zeros(E, dtype=torch.bool), pos, causal)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (other - theirs).abs().max() > 1e-2
    names = [k for k in model.state_dict() if "q_norm" in k or "k_norm" in k]
    assert names == [f"layers.{i}.self_attn.{n}_norm.weight" for i in (0, 1) for n in ("q", "k")]
    assert {tuple(model.state_dict()[k].shape) for k in names} == {(16,)}


def test_qwen3_layer_on_every_backend():
    """Loss and every gradient (q_norm/k_norm included) of the split backend equal the sdpa backend's on a
    qwen3 drafter; flex's forward (CPU: forward only) equals sdpa's; a cached forward (speculative decoding)
    equals one forward over all elements."""
    from peagle_train.model.attention import FlexElementMask
    from peagle_train.model.drafter import DrafterCache
    from peagle_train.train.step import block_loss
    from tests.peagle_train.model.test_flex_attention import _block, _elements, _forward

    block = _block(seg_lens=(37, 90, 14))
    el = _elements(block)
    vhead = 0.1 * torch.randn(60, 32, generator=torch.Generator().manual_seed(3))
    results = {}
    for backend in ("sdpa", "split"):
        model = _qwen3_drafter()
        res = block_loss(model, model.lm_head.weight, vhead, block, el, 5, 64, attention_backend=backend)
        res.loss.backward()
        results[backend] = res.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                if p.grad is not None}
    (la, ga), (lb, gb) = results["sdpa"], results["split"]
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    assert {"layers.0.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight"} <= ga.keys() == gb.keys()
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=1e-5, atol=1e-5, msg=n)
    assert float(ga["layers.1.self_attn.k_norm.weight"].abs().max()) > 0
    model = _qwen3_drafter().eval()
    with torch.no_grad():
        dense = _forward(model, block, el, build_attention_mask(el))
        flex = _forward(model, block, el, FlexElementMask(el))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    ids, aux = torch.randint(0, 60, (9,)), torch.randn(9, 64)
    is_mask = torch.arange(9) >= 7
    with torch.no_grad():
        full = model(ids, aux, is_mask, torch.arange(1, 10), torch.ones(9, 9, dtype=torch.bool).tril())
        cache = DrafterCache()
        first = model(ids[:4], aux[:4], torch.zeros(4, dtype=torch.bool), torch.arange(1, 5),
                      torch.ones(4, 4, dtype=torch.bool).tril(), cache=cache)
        rest = model(ids[4:], aux[4:7], is_mask[4:], torch.arange(5, 10), torch.ones(5, 9, dtype=torch.bool).tril(4),
                     cache=cache)
    torch.testing.assert_close(torch.cat([first, rest]), full, rtol=1e-5, atol=1e-6)


def test_unknown_layer_type_is_refused():
    import pytest

    with pytest.raises(ValueError,
                       match=r"drafter layer type 'gemma2' is not supported; supported: \('llama', 'qwen3'\)"):
        DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      vocab_size=50, draft_vocab_size=50, aux_layer_ids=[1], layer_type="gemma2")
