"""Extraction on CUDA (issue 4): SDPA block mask and FlashAttention varlen keep attention inside
each segment, the result equals the CPU store, and the side-stream device-to-host copies are exact.

Every test here needs a CUDA device and skips without one (this project's CI machine has none);
``scripts/gpu_check.sh`` runs them with the CUDA benchmarks on a lent GPU.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from peagle_data.extract.config import ExtractConfig
from peagle_data.extract.hf_forward import verifier_features
from peagle_data.extract.run import run_extract
from peagle_data.extract.store import BlockWriter
from stores.features.feature_repair import verify_store
from stores.features.feature_store import FeatureStore
from tests.peagle_data.extract.test_run import write_packed

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
LAYERS = [1, 2, 4]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _load(tiny_verifier_dir, attn: str):
    from runtime.model_cache import load_verifier

    return load_verifier(str(tiny_verifier_dir), device="cuda", attn_implementation=attn)


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_cuda_segments_equal_segments_alone(tiny_verifier_dir, attn):
    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    verifier = _load(tiny_verifier_dir, attn)
    torch.manual_seed(0)
    lengths = [9, 31, 6, 17]
    segs = [torch.randint(10, 49152, (n,)) for n in lengths]
    cu = torch.tensor([0] + lengths).cumsum(0)
    pos = torch.cat([torch.arange(n) + (5 if k == 0 else 0) for k, n in enumerate(lengths)])  # first starts at 5
    aux, final = verifier_features(verifier.model, torch.cat(segs), pos, cu, LAYERS)
    assert aux.device.type == "cpu" and aux.dtype == torch.bfloat16 and aux.shape == (sum(lengths), 3, 64)
    for k, seg in enumerate(segs):
        lo, hi = int(cu[k]), int(cu[k + 1])
        with torch.no_grad():
            out = verifier(seg[None].cuda(), position_ids=pos[lo:hi][None].cuda(), output_hidden_states=True)
        for j, layer in enumerate(LAYERS):
            assert _rel_err(aux[lo:hi, j], out.hidden_states[layer][0].cpu()) < 2e-2, (k, layer)
        logits = verifier.lm_head(final[lo:hi].cuda().to(verifier.lm_head.weight.dtype))
        agree = (logits.argmax(-1) == out.logits[0].argmax(-1)).float().mean()
        assert agree > 0.95  # bf16 on both sides: near-ties may flip a few argmaxes


def test_cuda_store_equals_cpu_store(tmp_path, tiny_verifier_dir):
    packed = write_packed(tmp_path / "packed", n_blocks=6, block_size=96)
    stores = {}
    for device in ("cpu", "cuda"):
        out = tmp_path / f"{device}.zarr"
        s = run_extract(ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir), output=str(out),
                                      layers=LAYERS, device=device, writer_queue=1, context="window"), progress=False)
        assert s["complete"] and verify_store(out)["ok"]
        stores[device] = FeatureStore.open(out)
    for i in range(6):
        a, b = stores["cpu"].read_block(i), stores["cuda"].read_block(i)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.cu_seqlens, b.cu_seqlens)
        assert _rel_err(b.aux_hidden, a.aux_hidden) < 2e-2 and _rel_err(b.final_hidden, a.final_hidden) < 2e-2


def test_side_stream_copies_are_exact_under_load(tmp_path, tiny_verifier_dir):
    """Large CUDA tensors handed to the writer, overwritten-by-reuse pressure from later allocations,
    come back bit-exact: the device tensors stay alive until their copy's event has fired."""
    packed = write_packed(tmp_path / "packed", n_blocks=8, block_size=96)
    run_extract(ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir), output=str(tmp_path / "f.zarr"),
                              layers=LAYERS, device="cpu", max_blocks=0, context="window"), progress=False)
    store = FeatureStore.open(tmp_path / "f.zarr", mode="r+")
    writer = BlockWriter(store, maxsize=2)
    want = {}
    g = torch.Generator(device="cuda").manual_seed(0)
    n_tokens = store.n_tokens_per_block()
    for i in range(8):
        n = int(n_tokens[i])
        aux = torch.randn(n, 3, 64, device="cuda", generator=g).to(torch.bfloat16)
        final = torch.randn(n, 64, device="cuda", generator=g).to(torch.bfloat16)
        want[i] = (aux.cpu(), final.cpu())
        writer.put(i, aux, final)
        del aux, final
        torch.randn(4096, 4096, device="cuda")  # allocations that would reuse freed blocks early
    writer.close()
    for i in range(8):
        b = store.read_block(i)
        assert torch.equal(b.aux_hidden, want[i][0]) and torch.equal(b.final_hidden, want[i][1])
