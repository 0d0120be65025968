"""Chunked weighted KL equals the unchunked one, in value and gradients; Σw = 0 gives 0."""

import math

import pytest
import torch
import torch.nn.functional as F

from peagle_train.train.loss import LOSSES, loss_and_accuracy

E, H, D, K = 37, 16, 50, 4


def _inputs(seed=0, zero_weight=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(E, H, generator=g, requires_grad=True)
    head = torch.randn(D, H, generator=g, requires_grad=True)
    target = torch.randn(E, H, generator=g).to(torch.bfloat16)
    vhead = torch.randn(D, H, generator=g)
    w = torch.zeros(E) if zero_weight else (torch.rand(E, generator=g) < 0.7).float()
    depth = torch.randint(0, K, (E,), generator=g)
    return hidden, head, target, vhead, w, depth


def _naive(hidden, head, target, vhead, w):
    p = F.softmax(target.float() @ vhead.T, -1)
    logq = F.log_softmax(hidden @ head.T, -1)
    kl = (p * (p.log() - logq)).sum(-1)
    return (kl * w).sum() / w.sum()


def test_chunked_equals_unchunked_value_and_grads():
    results = []
    for chunk in (None, 5, 16, 1000):
        hidden, head, target, vhead, w, depth = _inputs()
        out = loss_and_accuracy(hidden, head, target, vhead, w, depth, K, chunk_size=chunk)
        out.loss.backward()
        results.append((out.loss.detach(), hidden.grad.clone(), head.grad.clone(), out.correct, out.counts))
    for r in results[1:]:
        for x, y in zip(results[0], r):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    hidden, head, target, vhead, w, depth = _inputs()
    torch.testing.assert_close(results[0][0], _naive(hidden, head, target, vhead, w).detach(), rtol=1e-5, atol=1e-6)


def test_accuracy_is_weighted_argmax_agreement_per_depth():
    hidden, head, target, vhead, w, depth = _inputs(1)
    out = loss_and_accuracy(hidden, head, target, vhead, w, depth, K, chunk_size=7)
    agree = ((hidden @ head.T).argmax(-1) == (target.float() @ vhead.T).argmax(-1)).float()
    for d in range(K):
        sel = depth == d
        assert torch.isclose(out.correct[d], (agree * w)[sel].sum())
        assert torch.isclose(out.counts[d], w[sel].sum())


def test_zero_weight_gives_zero_loss_and_finite_grads():
    hidden, head, target, vhead, w, depth = _inputs(2, zero_weight=True)
    out = loss_and_accuracy(hidden, head, target, vhead, w, depth, K, chunk_size=8)
    out.loss.backward()
    assert float(out.loss.detach()) == 0.0
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(head.grad).all()


def test_kl_is_zero_when_drafter_matches_verifier():
    hidden, head, target, vhead, w, depth = _inputs(3)
    out = loss_and_accuracy(target.float(), vhead, target, vhead, w, depth, K, chunk_size=10)
    assert abs(float(out.loss.detach())) < 1e-5
    assert torch.equal(out.correct, out.counts)


def test_target_index_rows_equal_gathered_targets_value_and_grads():
    """Targets given as block rows + index (computed once per distinct row) equal per-element targets."""
    hidden, head, target, vhead, w, depth = _inputs(4)
    rows = torch.randint(0, 9, (E,), generator=torch.Generator().manual_seed(5))  # many repeats
    block = torch.randn(9, H, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    a = loss_and_accuracy(hidden, head, block[rows], vhead, w, depth, K, chunk_size=None)
    a.loss.backward()
    ga = (hidden.grad.clone(), head.grad.clone())
    hidden.grad, head.grad = None, None
    b = loss_and_accuracy(hidden, head, block, vhead, w, depth, K, chunk_size=6, target_index=rows)
    b.loss.backward()
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ga[0], hidden.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ga[1], head.grad, rtol=1e-5, atol=1e-6)
    assert torch.equal(a.correct, b.correct) and torch.equal(a.counts, b.counts)


def test_analytic_gradient_equals_autograd_of_the_naive_loss():
    hidden, head, target, vhead, w, depth = _inputs(7)
    _naive(hidden, head, target, vhead, w).backward()
    expect = (hidden.grad.clone(), head.grad.clone())
    hidden.grad, head.grad = None, None
    loss_and_accuracy(hidden, head, target, vhead, w, depth, K, chunk_size=5).loss.backward()
    torch.testing.assert_close(hidden.grad, expect[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(head.grad, expect[1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite"])
def test_logit_transform_of_a_config_gives_the_models_own_logits(family):
    """Gemma-2 soft-caps, Cohere multiplies by ``logit_scale``, Granite divides by ``logits_scaling``:
    ``LogitTransform.from_config`` applied to ``lm_head(final hidden)`` must give the model's logits."""
    from transformers import (CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM, GraniteConfig,
                              GraniteForCausalLM)

    from peagle_train.train.loss import LogitTransform

    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, eos_token_id=1, bos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = {"gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(final_logit_softcapping=0.5, head_dim=8, **shape)),
             "cohere": lambda: CohereForCausalLM(CohereConfig(logit_scale=0.25, **shape)),
             "granite": lambda: GraniteForCausalLM(GraniteConfig(logits_scaling=4.0, **shape))}[family]().eval()
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        want = model(input_ids=ids).logits[0]
        raw = model.get_output_embeddings()(model.base_model(input_ids=ids).last_hidden_state[0])
    g = LogitTransform.from_config(model.config)
    assert not g.identity
    assert not torch.allclose(raw, want, atol=1e-3)  # the transform matters for these models
    torch.testing.assert_close(g(raw), want, rtol=1e-5, atol=1e-6)


def test_kl_targets_are_the_verifiers_transformed_distribution():
    """With a soft-capping verifier the target is softmax(cap·tanh(f W_v^T / cap)), not softmax(f W_v^T)."""
    from peagle_train.train.loss import LogitTransform

    g = torch.Generator().manual_seed(3)
    E, H, D = 7, 8, 11
    hidden, draft_head = torch.randn(E, H, generator=g), torch.randn(D, H, generator=g)
    target, vhead = torch.randn(E, H, generator=g) * 3, torch.randn(D, H, generator=g)
    weight, depth = torch.rand(E, generator=g), torch.arange(E) % 2
    cap = LogitTransform(softcap=2.0)
    out = loss_and_accuracy(hidden, draft_head, target, vhead, weight, depth, 2, chunk_size=3, logit_transform=cap)
    p = torch.softmax(2.0 * torch.tanh(target @ vhead.T / 2.0), -1)
    logq = torch.log_softmax(hidden @ draft_head.T, -1)
    want = (weight * (p * (p.log() - logq)).sum(-1)).sum() / weight.sum()
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-6)
    plain = loss_and_accuracy(hidden, draft_head, target, vhead, weight, depth, 2, chunk_size=3)
    assert abs(float(plain.loss) - float(want)) > 1e-2  # without the transform the target differs


# ---------------------------------------------------------------------------- the acceptance-targeted losses
def _reference_elementwise(name, z, target_logits):
    """speculators 0.9's eager definitions (speculators/losses/eager.py), written out with autograd."""
    q = torch.softmax(z, -1)
    p = torch.softmax(target_logits, -1)
    logq = torch.log_softmax(z, -1)
    kl = (p * (torch.log_softmax(target_logits, -1) - logq)).sum(-1)
    alpha = torch.minimum(p, q).sum(-1)
    if name == "kl_div":
        return kl
    if name == "tv":
        return 1.0 - alpha
    if name == "nla":
        return -torch.log(alpha.clamp_min(1e-5))
    if name == "lk_hybrid":
        lam = torch.exp(-3.0 * alpha.detach())
        return lam * kl + (1.0 - lam) * (1.0 - alpha)
    if name == "ce":
        return F.cross_entropy(z, target_logits.argmax(-1), reduction="none")
    raise AssertionError(name)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("chunk", [None, 4])
def test_each_loss_and_its_analytic_gradient_equal_autograd_of_the_definition(name, chunk):
    """Value and the in-chunk gradients (w.r.t. hidden and the draft head) equal autograd through the
    definition in float32, with weights, depth weights and repeated target rows."""
    g = torch.Generator().manual_seed(11)
    n, h, d, k = 23, 8, 12, 3
    hidden = (2 * torch.randn(n, h, generator=g)).requires_grad_()
    head = torch.randn(d, h, generator=g).requires_grad_()
    block = 2 * torch.randn(7, h, generator=g)
    vhead = torch.randn(d, h, generator=g)
    rows = torch.randint(0, 7, (n,), generator=g)
    w = (torch.rand(n, generator=g) < 0.8).float()
    depth = torch.randint(0, k, (n,), generator=g)
    lam = [1.0, 0.5, 2.0]
    out = loss_and_accuracy(hidden, head, block, vhead, w, depth, k, chunk, target_index=rows, loss=name,
                            depth_weights=lam)
    out.loss.backward()
    got = (out.loss.detach(), hidden.grad.clone(), head.grad.clone())
    hidden.grad = head.grad = None
    z = hidden @ head.T
    lw = w * torch.tensor(lam)[depth]
    ref = (_reference_elementwise(name, z, block[rows] @ vhead.T) * lw).sum() / lw.sum()
    ref.backward()
    torch.testing.assert_close(got[0], ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], hidden.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got[2], head.grad, rtol=1e-4, atol=1e-6)
    assert float(got[1].abs().max()) > 1e-3  # a gradient that could have been wrong


def test_tv_is_half_the_l1_distance_and_nla_minus_log_overlap():
    """On a hand case: p = (0.5, 0.5, 0), q = softmax(z) with z = log(0.2, 0.2, 0.6): α = 0.4, TV = 0.6."""
    vhead = torch.eye(3)
    target = torch.log(torch.tensor([[0.5, 0.5, 1e-30]]))  # final hidden = logits with an identity head
    hidden = torch.log(torch.tensor([[0.2, 0.2, 0.6]]))
    w, depth = torch.ones(1), torch.zeros(1, dtype=torch.long)
    tv = loss_and_accuracy(hidden, vhead, target, vhead, w, depth, 1, loss="tv").loss
    nla = loss_and_accuracy(hidden, vhead, target, vhead, w, depth, 1, loss="nla").loss
    ce = loss_and_accuracy(hidden, vhead, target, vhead, w, depth, 1, loss="ce").loss
    assert abs(float(tv) - 0.6) < 1e-6
    assert abs(float(nla) + math.log(0.4)) < 1e-5
    assert abs(float(ce) + math.log(0.2)) < 1e-5  # y = argmax p = 0 (the first of a tie)


def test_depth_weights_weigh_the_loss_not_the_accuracy_and_are_checked():
    hidden, head, target, vhead, w, depth = _inputs(7)
    plain = loss_and_accuracy(hidden, head, target, vhead, w, depth, K, chunk_size=5)
    only0 = loss_and_accuracy(hidden, head, target, vhead, w, depth, K, chunk_size=5, depth_weights=[1, 0, 0, 0])
    sel = (depth == 0) & (w > 0)
    ref0 = loss_and_accuracy(hidden[sel], head, target[sel], vhead, w[sel], depth[sel], K, chunk_size=5)
    torch.testing.assert_close(only0.loss, ref0.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(only0.correct, plain.correct) and torch.equal(only0.counts, plain.counts)
    assert float(only0.weight_sum) == float(w[depth == 0].sum())
    with pytest.raises(ValueError, match="depth_weights must be 4"):
        loss_and_accuracy(hidden, head, target, vhead, w, depth, K, depth_weights=[1, 1])
    with pytest.raises(ValueError, match="depth_weights must be 4"):
        loss_and_accuracy(hidden, head, target, vhead, w, depth, K, depth_weights=[1, -1, 1, 1])
    with pytest.raises(ValueError, match="loss must be one of"):
        loss_and_accuracy(hidden, head, target, vhead, w, depth, K, loss="kl")
