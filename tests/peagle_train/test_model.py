"""Drafter forward: output_rows and depth-0-only aux rows give the same numbers as the full forward."""

import torch

from peagle_train.attention import build_attention_mask
from peagle_train.cod import element_inputs, sample_cod_elements
from peagle_train.model import DrafterConfig, PEagleDrafter


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
