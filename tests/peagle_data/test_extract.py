"""Extraction exactness: segments of a packed block equal the segment run alone."""

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


def test_packed_segments_equal_segments_run_alone(tiny_verifier):
    torch.manual_seed(0)
    lengths = [7, 1, 12, 5]
    segs = [torch.randint(3, 49152, (n,)) for n in lengths]
    ids = torch.cat(segs)
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, 7, 8, 20, 25])
    layers = [0, 2, 4]
    base = tiny_verifier.model
    aux, final = verifier_features(base, ids, pos, cu, layers)
    assert aux.shape == (25, 3, 64) and final.shape == (25, 64)
    for k, seg in enumerate(segs):
        with torch.no_grad():
            out = tiny_verifier(seg[None], output_hidden_states=True)
        lo, hi = int(cu[k]), int(cu[k + 1])
        alone = torch.stack([out.hidden_states[l][0] for l in layers], dim=1).to(torch.bfloat16)
        torch.testing.assert_close(aux[lo:hi].float(), alone.float(), atol=2e-2, rtol=2e-2)
        # the verifier's own logits: lm_head(final) has the same argmax on every token
        logits = tiny_verifier.lm_head(final[lo:hi].float())
        assert torch.equal(logits.argmax(-1), out.logits[0].argmax(-1))


def test_layer_convention_matches_decoder_layer_hooks(tiny_verifier):
    captured = {}
    hooks = [layer.register_forward_hook(lambda m, i, o, k=k: captured.__setitem__(k, (o[0] if isinstance(o, tuple) else o).detach()))
             for k, layer in enumerate(tiny_verifier.model.layers)]
    ids = torch.arange(10, 20)
    try:
        aux, _ = verifier_features(tiny_verifier.model, ids, torch.arange(10), torch.tensor([0, 10]), [1, 2, 3])
    finally:
        for h in hooks:
            h.remove()
    for j, l in enumerate([1, 2, 3]):  # layer l = output of decoder layer l-1
        torch.testing.assert_close(aux[:, j].float(), captured[l - 1][0].to(torch.bfloat16).float())
