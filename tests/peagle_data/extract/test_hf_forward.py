"""Extraction exactness: segments of a packed block equal the segment run alone; layer convention."""

import torch

import sys
from pathlib import Path

import pytest

from peagle_data.extract.hf_forward import (default_layers, packs_like_transformers, padded_batches, segment_masks,
                                            verifier_features)

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from families import WINDOW, build_family, hidden_states_as_stored  # noqa: E402


def test_default_layers_follow_eagle3():
    assert default_layers(36) == [2, 18, 33]
    assert default_layers(30) == [2, 15, 27]


def test_padded_batches_group_like_lengths_within_the_budget():
    lengths = [3, 12, 9, 12, 2, 30]
    batches = padded_batches(lengths, 30)
    assert batches == [[5], [1, 3], [2, 0, 4]]  # 30 alone; 2 x 12 = 24; 3 x 9 = 27 slots
    assert sorted(k for b in batches for k in b) == list(range(len(lengths)))
    assert all(len(b) * lengths[b[0]] <= 30 for b in batches)
    assert padded_batches([40, 5], 30) == [[0], [1]]  # a segment longer than the budget runs alone


def _expected_mask(lengths, window=None):
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    idx = torch.arange(len(seg))
    allowed = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])
    if window is not None:
        allowed &= idx[:, None] - idx[None, :] < window
    return allowed


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_segment_masks_are_block_diagonal_causal_and_windowed(impl):
    model = build_family("gemma3_text", attn_implementation=impl)  # sliding and full layers
    lengths = [6, 2, 7]
    pos = torch.cat([torch.arange(n) for n in lengths])
    masks = segment_masks(model.model, pos, {"full_attention", "sliding_attention"})
    for kind, window in (("full_attention", None), ("sliding_attention", WINDOW)):
        m = masks[kind][0, 0]
        allowed = m if m.dtype == torch.bool else m == 0  # SDPA: bool; eager: additive float
        assert torch.equal(allowed, _expected_mask(lengths, window)), kind


def test_packed_segments_are_told_apart_by_positions():
    cu = torch.tensor([0, 3, 5])
    assert packs_like_transformers(torch.tensor([0, 1, 2, 0, 1]), cu)
    assert packs_like_transformers(torch.tensor([4, 5, 6, 9, 10]), cu)
    assert not packs_like_transformers(torch.tensor([0, 1, 2, 3, 4]), cu)  # would read as one sequence
    assert not packs_like_transformers(torch.tensor([0, 1, 5, 0, 1]), cu)  # would read as three


def _alone(model, seg, pos, layers):
    hidden, out = hidden_states_as_stored(model, input_ids=seg[None], position_ids=pos[None])
    return torch.stack([hidden[l][0] for l in layers], dim=1), out


def _check_packed(tiny_verifier, lengths, starts=None):
    torch.manual_seed(len(lengths))
    starts = starts or [0] * len(lengths)
    segs = [torch.randint(3, 49152, (n,)) for n in lengths]
    poss = [torch.arange(s, s + n) for s, n in zip(starts, lengths)]
    cu = torch.tensor([0] + lengths).cumsum(0)
    layers = [0, 2, 4]  # embeddings, a middle layer, and L (the last layer's output before the final norm)
    aux, final = verifier_features(tiny_verifier.model, torch.cat(segs), torch.cat(poss), cu, layers)
    assert aux.shape == (sum(lengths), 3, 64) and final.shape == (sum(lengths), 64)
    assert aux.dtype == torch.bfloat16 and final.dtype == torch.bfloat16
    for k, (seg, pos) in enumerate(zip(segs, poss)):
        alone, out = _alone(tiny_verifier, seg, pos, layers)
        lo, hi = int(cu[k]), int(cu[k + 1])
        torch.testing.assert_close(aux[lo:hi].float(), alone.to(torch.bfloat16).float(), atol=2e-2, rtol=2e-2)
        logits = tiny_verifier.lm_head(final[lo:hi].float())
        assert torch.equal(logits.argmax(-1), out.logits[0].argmax(-1))


def test_one_segment(tiny_verifier):
    _check_packed(tiny_verifier, [9])


def test_two_segments(tiny_verifier):
    _check_packed(tiny_verifier, [6, 11])


def test_many_segments(tiny_verifier):
    _check_packed(tiny_verifier, [7, 1, 12, 5, 3, 9])


def test_position_ids_not_starting_at_zero(tiny_verifier):
    _check_packed(tiny_verifier, [5, 8], starts=[3, 17])


def _decoder_outputs(model, ids):
    """Every decoder layer's output (forward hooks) and the final normed state of an independent forward."""
    captured = {}
    decoder = model.model
    hooks = [layer.register_forward_hook(
        lambda m, i, o, k=k: captured.__setitem__(k, (o[0] if isinstance(o, tuple) else o).detach()))
        for k, layer in enumerate(decoder.layers)]
    try:
        with torch.no_grad():
            out = decoder(input_ids=ids[None], position_ids=torch.arange(len(ids))[None])
    finally:
        for h in hooks:
            h.remove()
    return captured, out.last_hidden_state[0]


@pytest.mark.parametrize("family", ["tiny_llama", "llama31", "qwen3"])
def test_layer_l_is_the_last_decoder_output_before_the_final_norm(tiny_verifier, family):
    """Aux layer l is decoder layer l-1's output, for l = L too (vLLM's ``hidden_states + residual``
    after the last layer, before the final norm); the final slot is after the norm."""
    model = tiny_verifier if family == "tiny_llama" else build_family(family)
    L = len(model.model.layers)
    ids = torch.arange(10, 20)
    layers = list(range(1, L + 1))
    aux, final = verifier_features(model.model, ids, torch.arange(10), torch.tensor([0, 10]), layers)
    captured, normed = _decoder_outputs(model, ids)
    for j, l in enumerate(layers):  # layer l = output of decoder layer l-1
        assert torch.equal(aux[:, j], captured[l - 1][0].to(torch.bfloat16)), l
    assert torch.equal(final, normed.to(torch.bfloat16))
    assert torch.equal(final, model.model.norm(captured[L - 1][0]).to(torch.bfloat16))
    assert not torch.allclose(aux[:, -1].float(), final.float(), atol=0.1)  # the two differ: the test can fail


def test_lm_head_is_never_run(tiny_verifier):
    def boom(*a):
        raise AssertionError("lm_head ran")

    h = tiny_verifier.lm_head.register_forward_pre_hook(boom)
    try:
        verifier_features(tiny_verifier.model, torch.arange(5), torch.arange(5), torch.tensor([0, 5]), [1])
    finally:
        h.remove()
