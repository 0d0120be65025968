"""``PEagleDrafter.gradient_checkpointing`` (``--gradient-checkpointing``): each decoder layer is
recomputed in the backward, and the training loss and every parameter gradient equal those of the
run that keeps the activations, for 1 and 2 layers and every attention backend."""

from __future__ import annotations

import functools

import pytest
import torch

from peagle_train.data.cod import sample_cod_elements
from peagle_train.model import attention as attention_module
from peagle_train.model.attention import SplitElementAttention
from peagle_train.model.config import DrafterConfig
from peagle_train.model.drafter import DrafterCache, PEagleDrafter
from peagle_train.train.step import block_loss, block_to
from tests.peagle_train.model.test_flex_attention import _block

H, V, K = 32, 60, 5

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention trains on CUDA only")


def _model(num_layers: int) -> PEagleDrafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 2],
                        num_hidden_layers=num_layers, num_depths=K)
    return PEagleDrafter(cfg)


def _calls(model: PEagleDrafter) -> list[int]:
    """Forward calls of each decoder layer, counted by pre-hooks (a recomputation calls the layer again;
    it stops once the saved tensors are rebuilt, before a forward hook would run)."""
    calls = [0] * len(model.layers)
    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def _loss_and_grads(num_layers: int, backend: str, checkpointing: bool, device: str = "cpu"):
    """``block_loss`` (K = 5, loss chunks of 64, output rows) on a 4-segment block, its backward, every
    parameter gradient and each layer's forward calls."""
    block = _block(seg_lens=(37, 90, 14, 59))
    el = sample_cod_elements(block.cu_seqlens, block.loss_mask, K, 0.8, 0.2, None, torch.Generator().manual_seed(1))
    block, el = block_to(block, device), el.to(device)
    vhead = (0.1 * torch.randn(V, H, generator=torch.Generator().manual_seed(3))).to(device)
    model = _model(num_layers).to(device)
    model.gradient_checkpointing = checkpointing
    calls = _calls(model)
    res = block_loss(model, model.lm_head.weight, vhead, block, el, K, 64, attention_backend=backend)
    res.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return res.loss.detach(), grads, calls


@pytest.fixture
def small_chunks(monkeypatch):
    """Both chunked kernels run in many chunks: the dense mask in checkpointed query chunks of a
    few rows (nested in the layer's checkpoint) and the split kernel in chunks of 8 queries."""
    monkeypatch.setattr(attention_module, "SDPA_MASK_BUDGET_BYTES", 4 * 1024 * 16)
    monkeypatch.setitem(attention_module.ATTENTION_BACKENDS, "split",
                        functools.partial(SplitElementAttention, budget_bytes=4096))


@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("backend, chunked", [("sdpa", False), ("sdpa", True), ("split", False), ("split", True)],
                         ids=["sdpa", "sdpa-chunked", "split", "split-chunked"])
def test_checkpointed_loss_and_gradients_equal_the_kept_activations(num_layers, backend, chunked, request):
    """Exactly equal: the recomputation runs the same float32 ops on the same inputs on the CPU, so
    the loss and each gradient are bit-identical (measured: max abs difference 0)."""
    if chunked:
        request.getfixturevalue("small_chunks")
    loss, grads, calls = _loss_and_grads(num_layers, backend, checkpointing=False)
    loss_c, grads_c, calls_c = _loss_and_grads(num_layers, backend, checkpointing=True)
    assert calls == [1] * num_layers and calls_c == [2] * num_layers  # every layer was recomputed
    assert float(loss) > 0.1 and torch.equal(loss_c, loss)
    names = {"fc.weight", "mask_hidden", "embed_tokens.weight", "norm.weight",
             *(f"layers.{i}.{p}" for i in range(num_layers) for p in
               ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.down_proj.weight",
                "input_layernorm.weight", "post_attention_layernorm.weight")),
             "layers.0.hidden_norm.weight"}
    assert names <= grads.keys() and grads_c.keys() == grads.keys()
    for n in grads:
        assert torch.equal(grads_c[n], grads[n]), (n, float((grads_c[n] - grads[n]).abs().max()))


def test_checkpointing_changes_nothing_without_autograd_or_with_a_cache():
    """No recomputation where nothing is recorded (evaluation under no_grad) or with a drafter cache
    (speculative decoding: a recomputed layer would extend the cache twice); the outputs are equal."""
    block = _block(seg_lens=(30, 20))
    el = sample_cod_elements(block.cu_seqlens, block.loss_mask, K, 0.8, 0.2, None, torch.Generator().manual_seed(2))
    vhead = 0.1 * torch.randn(V, H, generator=torch.Generator().manual_seed(3))
    model = _model(2)
    with torch.no_grad():
        ref = block_loss(model, model.lm_head.weight, vhead, block, el, K, 64, attention_backend="split").loss
        model.gradient_checkpointing = True
        calls = _calls(model)
        got = block_loss(model, model.lm_head.weight, vhead, block, el, K, 64, attention_backend="split").loss
    assert torch.equal(got, ref) and calls == [1, 1]

    n = 6  # a cached forward of 6 depth-0 elements, with grad enabled
    ids, pos = torch.arange(n), torch.arange(n)
    is_mask = torch.zeros(n, dtype=torch.bool)
    aux = torch.randn(n, 2 * H, generator=torch.Generator().manual_seed(4))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    cache = DrafterCache()
    model(ids, aux, is_mask, pos, causal, cache=cache).sum().backward()
    assert calls == [2, 2] and cache.length == n and cache.layers[0].keys.shape[1] == n


def test_flex_with_checkpointing_on_cpu_is_still_torchs_refusal():
    """flex has no backward on CPU (``--attention-backend flex`` is refused there before training);
    the checkpointed layer reaches the same refusal rather than another error."""
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        _loss_and_grads(1, "flex", checkpointing=True)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("num_layers", [1, 2])
def test_cuda_flex_checkpointed_loss_and_gradients_equal(num_layers):
    """On CUDA the compiled flex kernel's recomputation may pick other reduction orders: float32
    rounding, hence the tolerance (unmeasured here: this machine has no GPU)."""
    loss, grads, calls = _loss_and_grads(num_layers, "flex", checkpointing=False, device="cuda")
    loss_c, grads_c, calls_c = _loss_and_grads(num_layers, "flex", checkpointing=True, device="cuda")
    assert calls == [1] * num_layers and calls_c == [2] * num_layers
    torch.testing.assert_close(loss_c, loss, rtol=1e-6, atol=1e-7)
    assert grads_c.keys() == grads.keys() and len(grads) > 5
    for n in grads:
        torch.testing.assert_close(grads_c[n], grads[n], rtol=1e-5, atol=1e-7, msg=n)
