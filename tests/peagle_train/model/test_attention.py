"""The §8 attention mask built from structure equals the brute-force rule."""

import itertools

import pytest
import torch

from peagle_train.data.cod import all_elements, sample_cod_elements
from peagle_train.model.element_mask import attention_mask_reference, build_attention_mask, make_mask_mod


def _python_rule(el):
    a, d, s = el.anchor.tolist(), el.depth.tolist(), el.segment.tolist()
    E = len(a)
    return torch.tensor([[s[q] == s[k] and ((d[k] == 0 and a[k] <= a[q]) or (a[k] == a[q] and d[k] <= d[q]))
                          for k in range(E)] for q in range(E)], dtype=torch.bool).reshape(E, E)


@pytest.mark.parametrize("seed", range(12))
def test_structured_mask_equals_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 40, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
    cu = torch.tensor([0, *itertools.accumulate(lens)])
    m = (torch.rand(sum(lens), generator=g) < 0.7).long()
    for el in (sample_cod_elements(cu, m, 6, 0.7, 0.2, None, g), all_elements(cu, m, 4)):
        mask = build_attention_mask(el)
        assert torch.equal(mask, attention_mask_reference(el))
        if len(el) < 200:
            assert torch.equal(mask, _python_rule(el))
        assert bool(mask.diagonal().all())


def test_mask_mod_on_index_grid_agrees():
    cu = torch.tensor([0, 20, 45])
    m = (torch.arange(45) % 3 != 0).long()
    el = sample_cod_elements(cu, m, 5, 0.8, 0.2, None, torch.Generator().manual_seed(3))
    E = len(el)
    q, k = torch.meshgrid(torch.arange(E), torch.arange(E), indexing="ij")
    assert torch.equal(make_mask_mod(el)(0, 0, q, k), build_attention_mask(el))


def test_empty_row():
    el = all_elements(torch.tensor([0, 2]), torch.tensor([1, 1]), 3)
    assert len(el) == 0 and build_attention_mask(el).shape == (0, 0)
