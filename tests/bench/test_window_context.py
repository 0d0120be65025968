"""bench/bench_window_context.py: the window-vs-full comparison on the tiny Llama, at exactly the
positions that feed supervised tokens, against the model's own forward."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch

from peagle_data.extract.hf_forward import language_model, verifier_features
from peagle_data.prepare.windows import make_windows

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_window_context", REPO / "bench" / "bench_window_context.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench  # dataclasses look their module up
spec.loader.exec_module(bench)

SYSTEM_LEN, W, LAYERS = 6, 40, [0, 1, 2, 4]  # 0: embeddings; 4 = L: the pre-norm output of the last layer


def conversation() -> tuple[np.ndarray, np.ndarray]:
    """100 tokens: a 6-token system prefix, then user (loss 0) and assistant (loss 1) turns."""
    rng = np.random.default_rng(0)
    ids = rng.integers(10, 49000, 100).astype(np.int32)
    mask = np.zeros(100, np.uint8)
    for lo, hi in ((15, 30), (38, 52), (61, 75), (83, 100)):
        mask[lo:hi] = 1
    return ids, mask


def test_first_window_agrees_and_later_window_is_measured_at_its_supervised_tokens(tiny_verifier, one_thread):
    ids, mask = conversation()
    windows = make_windows(ids, mask, SYSTEM_LEN, W)
    assert [(w.index, w.body_start) for w in windows] == [(0, 0), (1, 17), (2, 34), (3, 51), (4, 60)]
    full = bench.verifier_states(tiny_verifier, ids, LAYERS)
    # the store's convention (aux id L before the final norm): equal to extraction's own forward in bf16
    aux, final = verifier_features(language_model(tiny_verifier), torch.as_tensor(ids, dtype=torch.int64),
                                   torch.arange(100), torch.tensor([0, 100]), LAYERS)
    assert torch.equal(full.aux.to(torch.bfloat16), aux) and torch.equal(full.final.to(torch.bfloat16), final)

    first = bench.compare_window(tiny_verifier, ids, full, windows[0], SYSTEM_LEN, LAYERS)
    # supervised tokens 15..29 and 38..39 of the window -> positions t - 1: 14..28, 37, 38
    assert first.positions.tolist() == list(range(14, 29)) + [37, 38]
    assert not first.argmax_differs.any() and np.abs(first.kl).max() < 1e-9
    assert first.cosine.shape == (17, 5) and first.cosine.min() > 1 - 1e-6

    later = windows[1]  # prefix 0..5, body tokens 23..56 of the conversation; 40..51 newly supervised
    assert later.loss_mask.sum() == 12  # skip: 38..39 were supervised by window 0
    c = bench.compare_window(tiny_verifier, ids, full, later, SYSTEM_LEN, LAYERS)
    assert c.positions.tolist() == list(range(39, 51))
    assert len(c.kl) == len(c.argmax_differs) == len(c.argmax_differs_bf16) == c.cosine.shape[0] == 12
    # independent: the model's own logits of the whole conversation and of the window alone
    with torch.no_grad():
        lp_full = torch.log_softmax(tiny_verifier(torch.as_tensor(ids[None], dtype=torch.int64)).logits[0].double(), -1)
        lp_win = torch.log_softmax(tiny_verifier(torch.as_tensor(later.input_ids[None], dtype=torch.int64)).logits[0]
                                   .double(), -1)
    local = c.positions - 17  # window positions t - 1 of the same tokens (body_start 17)
    kl = (lp_full[c.positions].exp() * (lp_full[c.positions] - lp_win[local])).sum(-1).numpy()
    np.testing.assert_allclose(c.kl, kl, rtol=1e-4, atol=1e-7)
    assert c.kl.min() > 1e-6  # the missing context changes every target here
    assert c.argmax_differs.tolist() == (lp_full[c.positions].argmax(-1) != lp_win[local].argmax(-1)).tolist()
    # the same tokens: equal embeddings (layer 0), context-dependent states from layer 1 on
    assert c.cosine[:, 0].min() > 1 - 1e-6 and c.cosine[:, 1].min() < 1 - 1e-4 and c.cosine.max() < 1 + 1e-6

    # keep: the window's first body token (conversation token 23, after the prefix) is supervised;
    # it is compared where serving predicts it, conversation position 22, not the prefix's last (5)
    kept = make_windows(ids, mask, SYSTEM_LEN, W, overlap_loss="keep")[1]
    k = bench.compare_window(tiny_verifier, ids, full, kept, SYSTEM_LEN, LAYERS)
    assert k.positions.tolist() == list(range(22, 29)) + list(range(37, 51))
