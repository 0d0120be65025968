"""The attention-backend table: a new backend is one ElementAttention class and one table entry."""

import pytest
import torch

from peagle_train.data.cod import sample_cod_elements
from peagle_train.model.attention import (ATTENTION_BACKENDS, ATTENTION_CHOICES, DenseAttention, ElementAttention,
                                          FlexElementMask, SplitElementAttention, as_element_attention,
                                          element_attention, resolve_attention_backend)
from peagle_train.model.element_mask import attention_mask_reference
from stores.errors import InputError
from tests.peagle_train.model.test_flex_attention import _block
from tests.peagle_train.model.test_split_attention import H, _model, assert_same_loss_and_grads


class ReferenceAttention(ElementAttention):
    """The §8 rule evaluated on the full grid and a plain softmax: a whole backend."""

    name = "reference"
    __slots__ = ("elements", "mask")

    def __init__(self, elements):
        self.elements, self.mask = elements, attention_mask_reference(elements)

    def attend(self, q, k, v, rows=None):
        rep = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        allowed = self.mask if rows is None else self.mask[rows]  # [R, E]
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


def test_the_table_names_each_backend_class():
    assert ATTENTION_BACKENDS == {"sdpa": DenseAttention, "flex": FlexElementMask, "split": SplitElementAttention}
    assert ATTENTION_CHOICES == ("auto", "sdpa", "flex", "split")
    assert resolve_attention_backend("auto", cuda_available=False) == "split"
    assert resolve_attention_backend("auto", cuda_available=True) == "flex"
    with pytest.raises(InputError, match="expected one of auto, sdpa, flex, split, got 'xformers'"):
        resolve_attention_backend("xformers", cuda_available=True)
    with pytest.raises(ValueError, match="resolve it first|one of sdpa, flex, split"):
        element_attention("auto", None)


def test_a_new_backend_is_one_class_and_one_table_entry(monkeypatch):
    """Registered, it resolves by name and trains: the loss and every gradient equal the sdpa backend's."""
    monkeypatch.setitem(ATTENTION_BACKENDS, "reference", ReferenceAttention)
    assert resolve_attention_backend("reference", cuda_available=False) == "reference"
    block = _block(seg_lens=(37, 90, 14))
    el = sample_cod_elements(block.cu_seqlens, block.loss_mask, 5, 0.8, 0.2, None, torch.Generator().manual_seed(1))
    assert isinstance(element_attention("reference", el), ReferenceAttention)
    assert_same_loss_and_grads(block, el, "reference", rtol=1e-4, atol=1e-6)


def test_a_mask_is_the_dense_backend_and_a_cache_needs_one():
    from peagle_train.model.drafter import DrafterCache

    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    dense = as_element_attention(mask)
    assert isinstance(dense, DenseAttention) and dense.mask is mask and dense.elements is None
    block = _block(seg_lens=(20,))
    el = sample_cod_elements(block.cu_seqlens, block.loss_mask, 3, 0.8, 0.2, None, torch.Generator().manual_seed(0))
    model = _model(num_layers=1)
    with pytest.raises(ValueError, match="needs a backend that takes cached keys.*SplitElementAttention"):
        model(torch.zeros(len(el), dtype=torch.long), torch.zeros(len(el), 2 * H), el.depth > 0,
              torch.arange(len(el)), SplitElementAttention(el), cache=DrafterCache())
