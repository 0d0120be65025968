"""flex_attention BlockMasks of the §8 rule give what the dense SDPA mask gives (docs/design.md §8).

CPU (everywhere): the BlockMasks' tiles and mask_mod equal the dense rule, and the drafter forward
(full and ``output_rows``) and the weighted KL with :class:`FlexElementMask` equal the dense ones
under ``no_grad`` (torch runs flex_attention forward only on CPU); a mask_mod that allows one key
too many changes the output. CUDA (``-m cuda``, skipped without a GPU): the loss and gradients of
one step and a short ``run_train`` agree between ``attention_backend="sdpa"`` and ``"flex"``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch.nn.attention.flex_attention import create_block_mask

from peagle_train.data.cod import CodElements, all_elements, element_inputs, sample_cod_elements
from peagle_train.data.loader import Block
from peagle_train.model.attention import FlexElementMask
from peagle_train.model.attention import resolve_attention_backend
from peagle_train.model.config import DrafterConfig
from peagle_train.model.drafter import PEagleDrafter
from peagle_train.model.element_mask import block_mask_from_elements, build_attention_mask, make_mask_mod
from peagle_train.train.config import TrainConfig
from peagle_train.train.run import run_train
from peagle_train.train.step import block_loss, block_to
from stores.errors import InputError

H, V, L = 32, 60, 2
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs CUDA: torch's flex_attention has no backward on CPU")


def _config(num_layers: int = 2) -> DrafterConfig:
    return DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 2],
                         num_hidden_layers=num_layers)


def _block(seg_lens=(37, 90, 14, 59), seed: int = 0) -> Block:
    """A packed row of several segments with random tokens, features and targets (bf16, as stored)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(seg_lens)
    cu = torch.cumsum(torch.tensor([0, *seg_lens]), 0)
    mask = torch.cat([torch.cat([torch.zeros(min(3, n)), torch.ones(n - min(3, n))]) for n in seg_lens]).long()
    mask[torch.rand(T, generator=g) < 0.15] = 0  # holes inside the supervised spans
    return Block(block_id=0, input_ids=torch.randint(0, V, (T,), generator=g), loss_mask=mask,
                 position_ids=torch.cat([torch.arange(n) for n in seg_lens]), cu_seqlens=cu,
                 aux_hidden=torch.randn(T, L * H, generator=g).to(torch.bfloat16),
                 final_hidden=(3 * torch.randn(T, H, generator=g)).to(torch.bfloat16))


def _elements(block: Block, num_depths: int = 5, seed: int = 1) -> CodElements:
    return sample_cod_elements(block.cu_seqlens, block.loss_mask, num_depths, 0.8, 0.2, None,
                               torch.Generator().manual_seed(seed))


def _model(seed: int = 0, num_layers: int = 2) -> PEagleDrafter:
    torch.manual_seed(seed)
    return PEagleDrafter(_config(num_layers))


def _forward(model, block, el, mask, rows=None):
    inp = element_inputs(el, block.input_ids, block.position_ids)
    aux = block.aux_hidden[inp.feature_index].float()  # [E, L*H]
    return model(inp.input_ids, aux, inp.is_mask, inp.position_ids, mask, output_rows=rows)


def _tiles(num_blocks: torch.Tensor, indices: torch.Tensor, n_kv_tiles: int) -> torch.Tensor:
    """``[Qb, Kb] bool`` of the tiles a BlockMask lists (``kv_num_blocks [1, 1, Qb]``, ``kv_indices``)."""
    out = torch.zeros(num_blocks.shape[-1], n_kv_tiles, dtype=torch.bool)
    for i, n in enumerate(num_blocks[0, 0].tolist()):
        out[i, indices[0, 0, i, :n].long()] = True
    return out


def _tile_reduce(dense: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``dense [Q, K] bool`` -> (any, all) per ``bs``-square tile, padding counted as masked for 'all'
    only where the tile holds real pairs (a ragged edge tile is 'full' when all its real pairs are)."""
    Q, K = dense.shape
    Qb, Kb = -(-Q // bs), -(-K // bs)
    pad = torch.zeros(Qb * bs, Kb * bs, dtype=torch.bool)
    real = torch.zeros_like(pad)
    pad[:Q, :K], real[:Q, :K] = dense, True
    t = pad.view(Qb, bs, Kb, bs)
    r = real.view(Qb, bs, Kb, bs)
    return t.any(3).any(1), (t | ~r).all(3).all(1) & r.any(3).any(1)


# ---------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("seed", [1, 2])
def test_block_masks_equal_the_dense_rule(seed):
    """The mask_mod on the index grid is the dense mask; listed tiles are exactly the tiles with an
    allowed pair, and a tile listed as full (mask_mod skipped there by the kernel) allows every pair."""
    block = _block(seed=seed)
    el = _elements(block, seed=seed)
    dense = build_attention_mask(el)  # [E, E]
    rows = torch.nonzero(el.weight != 0).squeeze(1)
    bs = 16  # small tiles so a row of a few hundred elements spans many of them
    fm = FlexElementMask(el, block_size=bs)
    assert torch.equal(fm.to_dense(), dense) and torch.equal(fm.to_dense(rows), dense[rows])
    for bm, want in ((fm.block_mask(), dense), (fm.block_mask(rows), dense[rows])):
        assert tuple(bm.shape[-2:]) == tuple(want.shape)
        any_t, all_t = _tile_reduce(want, bs)
        Kb = any_t.shape[1]
        partial = _tiles(bm.kv_num_blocks, bm.kv_indices, Kb)
        full = _tiles(bm.full_kv_num_blocks, bm.full_kv_indices, Kb)
        assert torch.equal(partial | full, any_t)
        assert not (full & ~all_t).any()
        assert not (partial & full).any()
        assert 0 < int(full.sum()) and int((partial | full).sum()) < any_t.numel()  # sparse, not trivial
    assert fm.block_mask() is fm.block_mask() and fm.block_mask(rows) is fm.block_mask(rows)  # cached


def _assert_same_block_mask(got, want):
    """Every index tensor and size of two BlockMasks equal (the mask_mods are compared by the caller)."""
    assert got.seq_lengths == want.seq_lengths and got.BLOCK_SIZE == want.BLOCK_SIZE
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("bs", [4, 16, 128])
def test_block_mask_from_structure_is_create_block_mask(seed, bs):
    """Built from anchors, depths and segments, the BlockMask is identical to create_block_mask's on
    the rule's mask_mod, for all queries and for the loss rows, sampled or complete elements, with and
    without max_anchors, ragged edge tiles and tiles straddling the depth-0 / depth-1 boundary."""
    g = torch.Generator().manual_seed(seed)
    seg_lens = torch.randint(1, 70, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
    block = _block(tuple(seg_lens), seed=seed)
    if seed == 5:
        el = all_elements(block.cu_seqlens, block.loss_mask, 4)
    else:
        el = sample_cod_elements(block.cu_seqlens, block.loss_mask, 6, 0.8, 0.2, [None, 7][seed % 2],
                                 torch.Generator().manual_seed(seed))
    rule = make_mask_mod(el)
    rows = torch.nonzero(el.weight != 0).squeeze(1)
    for r in (None, rows, rows[:0]):
        Q = len(el) if r is None else int(r.numel())
        ref_mod = rule if r is None else (lambda b, h, q, k, r=r: rule(b, h, r[q], k))
        want = create_block_mask(ref_mod, None, None, Q, len(el), device="cpu", BLOCK_SIZE=bs)
        got = block_mask_from_elements(el, r, bs)
        _assert_same_block_mask(got, want)
        assert torch.equal(got.to_dense(), want.to_dense())
        q = torch.arange(Q)[:, None]
        k = torch.arange(len(el))[None, :]
        zero = torch.zeros((), dtype=torch.long)
        assert torch.equal(got.mask_mod(zero, zero, q, k), want.mask_mod(zero, zero, q, k))
    fm = FlexElementMask(el, block_size=bs)
    _assert_same_block_mask(fm.block_mask(), block_mask_from_elements(el, None, bs))
    _assert_same_block_mask(fm.block_mask(rows), block_mask_from_elements(el, rows, bs))


def test_flex_forward_equals_sdpa_full_and_output_rows():
    block = _block()
    el = _elements(block)
    model = _model().eval()
    rows = torch.nonzero(el.weight != 0).squeeze(1)
    assert 128 < len(el) and 0 < rows.numel() < len(el)  # several 128-tiles, some unweighted elements
    dense = build_attention_mask(el)
    with torch.no_grad():
        ref_full = _forward(model, block, el, dense)  # [E, H]
        ref_rows = _forward(model, block, el, dense, rows)  # [E', H]
        flex_full = _forward(model, block, el, FlexElementMask(el))
        flex_rows = _forward(model, block, el, FlexElementMask(el), rows)
    torch.testing.assert_close(flex_full, ref_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex_rows, ref_rows, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_rows, ref_full[rows], rtol=1e-5, atol=1e-5)

    # the comparison can fail: let one depth>0 query also see a later depth-0 key of its segment
    a, d, s = el.anchor, el.depth, el.segment
    deeper = set(a[d == 2].tolist())  # qi at depth 1 with a depth-2 element that reads it in layer 2
    qi = next(i for i in range(len(el)) if int(d[i]) == 1 and int(a[i]) in deeper)
    later = torch.nonzero((d == 0) & (s == s[qi]) & (a > a[qi])).squeeze(1)
    assert later.numel() > 0 and not dense[qi, later[-1]]
    ki, rule = int(later[-1]), make_mask_mod(el)

    def one_key_too_many(b, h, q_idx, kv_idx):
        return rule(b, h, q_idx, kv_idx) | ((q_idx == qi) & (kv_idx == ki))

    wrong = FlexElementMask(el, mask_mod=one_key_too_many)
    assert int((wrong.to_dense() != dense).sum()) == 1
    with torch.no_grad():
        bad_full = _forward(model, block, el, wrong)
        bad_rows = _forward(model, block, el, wrong, rows)
    assert (bad_full[qi] - ref_full[qi]).abs().max() > 1e-3
    assert (bad_rows - ref_rows).abs().max() > 1e-3
    others = torch.ones(len(el), dtype=torch.bool)
    others[qi] = False
    assert (bad_full[others] - ref_full[others]).abs().max() > 1e-5  # layer 2 reads qi as a key


def test_flex_loss_equals_sdpa_loss():
    block = _block(seg_lens=(70, 45, 101), seed=3)
    el = _elements(block, num_depths=6, seed=4)
    model = _model(1)
    head = model.lm_head.weight
    vhead = torch.randn(V, H, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = block_loss(model, head, vhead, block, el, 6, 16, attention_backend="sdpa")
        flex = block_loss(model, head, vhead, block, el, 6, 16, attention_backend="flex")
    assert float(ref.weight_sum) > 0 and float(ref.loss) > 0.1
    torch.testing.assert_close(flex.loss, ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flex.loss_sum, ref.loss_sum, rtol=1e-5, atol=1e-6)
    assert torch.equal(flex.counts, ref.counts)
    torch.testing.assert_close(flex.correct, ref.correct)


def test_flex_with_grad_on_cpu_is_torchs_refusal():
    """What ``--attention-backend flex`` avoids by refusing CPU up front."""
    block = _block(seg_lens=(30, 20))
    el = _elements(block)
    with pytest.raises(NotImplementedError, match="backward on CPU"):
        _forward(_model(), block, el, FlexElementMask(el))


def test_backend_resolution():
    assert resolve_attention_backend("auto", cuda_available=False) == "split"  # fastest on CPU
    assert resolve_attention_backend("auto", cuda_available=True) == "flex"
    assert resolve_attention_backend("sdpa", cuda_available=True) == "sdpa"
    assert resolve_attention_backend("split", cuda_available=False) == "split"
    assert resolve_attention_backend("split", cuda_available=True) == "split"
    assert resolve_attention_backend("flex", cuda_available=True) == "flex"
    with pytest.raises(InputError, match="--attention-backend.*backward on CPU") as e:
        resolve_attention_backend("flex", cuda_available=False)
    assert e.value.field == "--attention-backend"
    with pytest.raises(ValueError, match="--attention-backend"):
        TrainConfig.from_flat(store="s", output="o", attention_backend="xformers")
    assert TrainConfig.from_flat(store="s", output="o").model.attention_backend == "auto"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_flex_without_cuda_fails_before_training(tmp_path):
    with pytest.raises(InputError, match="--attention-backend"):
        run_train(TrainConfig.from_flat(store=str(tmp_path / "missing.zarr"), output=str(tmp_path / "out"),
                              attention_backend="flex"))
    assert not (tmp_path / "out").exists()
    from cli.train import main

    res = CliRunner().invoke(main, ["--store", str(tmp_path / "missing.zarr"), "--output", str(tmp_path / "o2"),
                                    "--attention-backend", "flex"])
    assert res.exit_code == 2 and "--attention-backend" in res.output and "backward on CPU" in res.output
    assert not (tmp_path / "o2").exists()
    res = CliRunner().invoke(main, ["--store", "s", "--output", "o", "--attention-backend", "xformers"])
    assert res.exit_code == 2 and "--attention-backend" in res.output


# --------------------------------------------------------------------------------------- CUDA


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in float32 (0 when both are 0)."""
    a, b = a.float(), b.float()
    den = float(b.norm())
    return float((a - b).norm()) / den if den > 0 else float(a.norm())


def _step(model, block, el, vhead, backend: str, bf16: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        res = block_loss(model, model.lm_head.weight, vhead, block, el, 6, 64, attention_backend=backend)
    res.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return res, grads


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("bf16, loss_rtol, grad_rtol", [(False, 5e-5, 5e-4), (True, 2e-2, 5e-2)],
                         ids=["fp32", "bf16-autocast"])
def test_cuda_step_loss_and_grads_equal(bf16, loss_rtol, grad_rtol):
    dev = torch.device("cuda")
    block = _block(seg_lens=(37, 190, 14, 159), seed=6)
    el = _elements(block, num_depths=6, seed=7)
    block = block_to(block, dev)
    el = el.to(dev)
    model = _model(2).to(dev)
    vhead = torch.randn(V, H, generator=torch.Generator().manual_seed(8)).to(dev)
    assert len(el) > 256  # several 128-tiles, so block sparsity is exercised
    ref, g_ref = _step(model, block, el, vhead, "sdpa", bf16)
    flex, g_flex = _step(model, block, el, vhead, "flex", bf16)
    assert float(ref.loss) > 0.1
    torch.testing.assert_close(flex.loss, ref.loss, rtol=loss_rtol, atol=1e-6)
    assert sorted(g_flex) == sorted(g_ref) and "layers.0.self_attn.q_proj.weight" in g_ref
    bad = {n: _rel(g_flex[n], g_ref[n]) for n in g_ref if _rel(g_flex[n], g_ref[n]) > grad_rtol}
    assert not bad, bad


def _train_helpers():
    """``_store``, ``_cfg`` and ``_rows`` of test_train.py (one store builder for the trainer tests)."""
    spec = importlib.util.spec_from_file_location("_peagle_test_train_helpers",
                                                  Path(__file__).parents[1] / "train" / "test_train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("layer", ["llama", "qwen3"])
def test_cuda_run_train_flex_equals_sdpa(tmp_path, make_tiny_llama, layer):
    t = _train_helpers()
    verifier = make_tiny_llama(tmp_path / "verifier", hidden=t.H, vocab=t.V)
    store = t._store(tmp_path / "s.zarr", verifier, n_blocks=3)
    runs = {}
    for backend in ("sdpa", "flex"):
        out = tmp_path / backend
        summary = run_train(t._cfg(store, out, max_steps=4, attention_backend=backend, drafter_layer=layer))
        assert summary["steps"] == 4
        assert json.loads((out / "train_config.json").read_text())["model"]["attention_backend"] == backend
        runs[backend] = t._rows(out)
    a, b = runs["sdpa"], runs["flex"]
    assert [r["n_elements"] for r in a] == [r["n_elements"] for r in b]
    assert [r["blocks"] for r in a] == [r["blocks"] for r in b]
    for x, y in zip(a, b):  # bf16 autocast on CUDA: the two kernels round differently
        assert y["loss"] == pytest.approx(x["loss"], rel=3e-2), (x["step"], x["loss"], y["loss"])
