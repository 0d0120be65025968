"""Extraction exactness: segments of a packed block equal the segment run alone; layer convention."""

import torch

from peagle_data.extract import default_layers, segment_attention_mask, verifier_features


def test_default_layers_follow_eagle3():
    assert default_layers(36) == [2, 18, 33]
    assert default_layers(30) == [2, 15, 27]


def test_segment_mask_is_block_diagonal_causal():
    m = segment_attention_mask(torch.tensor([0, 2, 5]), torch.float32)[0, 0] == 0
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(m, expected)
    # an all-ones padding mask from a caller never widens attention across segments
    ones = segment_attention_mask(torch.tensor([0, 2, 5]), torch.float32, torch.ones(5))[0, 0] == 0
    assert torch.equal(ones, expected)


def _alone(model, seg, pos, layers):
    with torch.no_grad():
        out = model(seg[None], position_ids=pos[None], output_hidden_states=True)
    return torch.stack([out.hidden_states[l][0] for l in layers], dim=1), out


def _check_packed(tiny_verifier, lengths, starts=None):
    torch.manual_seed(len(lengths))
    starts = starts or [0] * len(lengths)
    segs = [torch.randint(3, 49152, (n,)) for n in lengths]
    poss = [torch.arange(s, s + n) for s, n in zip(starts, lengths)]
    cu = torch.tensor([0] + lengths).cumsum(0)
    layers = [0, 2, 4]  # embeddings, a middle layer, and L (= the final post-norm state)
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


def test_layer_convention_matches_decoder_layer_hooks(tiny_verifier):
    captured = {}
    hooks = [layer.register_forward_hook(
        lambda m, i, o, k=k: captured.__setitem__(k, (o[0] if isinstance(o, tuple) else o).detach()))
        for k, layer in enumerate(tiny_verifier.model.layers)]
    ids = torch.arange(10, 20)
    try:
        aux, _ = verifier_features(tiny_verifier.model, ids, torch.arange(10), torch.tensor([0, 10]), [1, 2, 3])
    finally:
        for h in hooks:
            h.remove()
    for j, l in enumerate([1, 2, 3]):  # layer l = output of decoder layer l-1
        assert torch.equal(aux[:, j], captured[l - 1][0].to(torch.bfloat16))


def test_lm_head_is_never_run(tiny_verifier):
    def boom(*a):
        raise AssertionError("lm_head ran")

    h = tiny_verifier.lm_head.register_forward_pre_hook(boom)
    try:
        verifier_features(tiny_verifier.model, torch.arange(5), torch.arange(5), torch.tensor([0, 5]), [1])
    finally:
        h.remove()
