"""The drafter-kind registry, and the DFlash kind's loss against a direct computation of its definition."""

import math
from types import SimpleNamespace

import pytest
import torch

from peagle_train.data.anchors import sample_anchors
from peagle_train.model.checkpoint import save_drafter
from peagle_train.model.dflash import DFlashConfig, DFlashDrafter
from peagle_train.model.dflash_checkpoint import save_dflash
from peagle_train.model.drafter import PEagleDrafter
from peagle_train.train.config import TrainConfig
from peagle_train.train.kinds import DRAFTER_KINDS, dflash_block_loss, drafter_kind

H, V, L, B, T = 32, 50, 2, 4, 20


def test_the_registry_names_each_kind_once():
    assert {n: (k.speculators_model_type, k.vllm_method, k.model_class) for n, k in DRAFTER_KINDS.items()} == {
        "peagle": ("peagle", "eagle3", PEagleDrafter), "dflash": ("dflash", "dflash", DFlashDrafter)}
    assert drafter_kind("peagle").save is save_drafter and drafter_kind("dflash").save is save_dflash
    with pytest.raises(ValueError, match="--method"):
        drafter_kind("eagle3")


def test_each_kind_starts_only_from_its_own_kinds_drafters():
    assert {n: k.init_formats for n, k in DRAFTER_KINDS.items()} == {"peagle": ("peagle", "eagle3", "vllm"),
                                                                      "dflash": ("dflash",)}


def _row():
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(T, dtype=torch.long)
    mask[4:9] = 1
    mask[13:19] = 1
    return SimpleNamespace(input_ids=torch.randint(0, V, (T,), generator=g), cu_seqlens=torch.tensor([0, 10, T]),
                           position_ids=torch.cat([torch.arange(10), torch.arange(10)]), loss_mask=mask,
                           aux_hidden=torch.randn(T, L * H, generator=g), final_hidden=torch.randn(T, H, generator=g))


def test_dflash_loss_is_the_decayed_kl_of_each_slot_to_the_verifier_at_the_row_before_it():
    torch.manual_seed(0)
    cfg = TrainConfig.from_flat(store="s", output="o", method="dflash", block_size=B)
    model = DFlashDrafter(DFlashConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=8, vocab_size=V, draft_vocab_size=V, aux_layer_ids=[1, 2],
                                       mask_token_id=3, block_size=B))
    verifier_head = torch.randn(V, H)
    block = _row()
    blocks = sample_anchors(block.cu_seqlens, block.loss_mask, B, None, torch.Generator())
    out = dflash_block_loss(model, model.lm_head.weight, verifier_head, block, blocks, cfg)
    num, den, counts = 0.0, 0.0, [0, 0, 0]
    for p in blocks.anchor.tolist():  # one block alone: its context rows, its own B tokens
        seg_end = 10 if p < 10 else T
        ids = torch.tensor([int(block.input_ids[p])] + [3] * (B - 1))
        pos = block.position_ids[p] + torch.arange(B)
        ctx = (torch.arange(T) < p) & ((torch.arange(T) < 10) == (p < 10))
        mask = torch.cat([ctx.expand(B, T), torch.ones(B, B, dtype=torch.bool)], dim=1)
        with torch.no_grad():
            logq = torch.log_softmax(model.logits(model(block.aux_hidden, block.position_ids, ids, pos, mask)), -1)
        for j in range(1, B):
            if p + j >= seg_end or not block.loss_mask[p + j]:
                continue
            target = torch.softmax(block.final_hidden[p + j - 1] @ verifier_head.T, -1)
            kl = float((target * (target.log() - logq[j])).sum())
            w = math.exp(-(j - 1) / 4)
            num, den = num + w * kl, den + w
            counts[j - 1] += 1
    assert float(out.loss_sum.detach()) == pytest.approx(num, rel=1e-4) and float(out.weight_sum) == pytest.approx(den)
    assert out.counts.tolist() == counts


def test_dflash_gradient_checkpointing_gives_the_same_gradients():
    cfg = TrainConfig.from_flat(store="s", output="o", method="dflash", block_size=B)
    block = _row()
    blocks = sample_anchors(block.cu_seqlens, block.loss_mask, B, None, torch.Generator())
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = DFlashDrafter(DFlashConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=8, vocab_size=V, draft_vocab_size=V,
                                           aux_layer_ids=[1, 2], num_hidden_layers=2, mask_token_id=3, block_size=B))
        model.gradient_checkpointing = recompute
        dflash_block_loss(model, model.lm_head.weight, torch.randn(V, H), block, blocks, cfg).loss_sum.backward()
        grads.append(model.fc.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def test_each_kind_says_how_vllm_serves_it():
    """vLLM's speculative_config of each kind: P-EAGLE as eagle3 with parallel_drafting, DFlash as dflash without."""
    from peagle_train.train.kinds import DRAFTER_KINDS

    assert DRAFTER_KINDS["peagle"].speculative_config("d", 4) == {
        "model": "d", "method": "eagle3", "num_speculative_tokens": 4, "parallel_drafting": True}
    assert DRAFTER_KINDS["dflash"].speculative_config("d", 7) == {
        "model": "d", "method": "dflash", "num_speculative_tokens": 7}
