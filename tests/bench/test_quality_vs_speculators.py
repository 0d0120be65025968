"""bench/bench_quality_vs_speculators.py: the store block as speculators' P-EAGLE forward takes it (each segment
shifted as speculators' ``shift_batch`` does), exact elements; against speculators' own ``shift_batch`` when the
bench extra is installed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from stores.features.feature_schema import Block

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_quality_vs_speculators",
                                              REPO / "bench" / "bench_quality_vs_speculators.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench
spec.loader.exec_module(bench)

H, L = 2, 3


def _block() -> Block:
    """Two segments of 4 and 3 tokens, and a 1-token one (nothing to predict: left out)."""
    T = 8
    aux = torch.arange(T * L * H, dtype=torch.float32).reshape(T, L * H)
    final = 1000 + torch.arange(T * H, dtype=torch.float32).reshape(T, H)
    return Block(input_ids=torch.tensor([10, 11, 12, 13, 20, 21, 22, 30]), loss_mask=torch.tensor([0, 0, 1, 1, 0, 1, 1, 1]),
                 position_ids=torch.tensor([0, 1, 2, 3, 0, 1, 2, 0]), cu_seqlens=torch.tensor([0, 4, 7, 8]),
                 aux_hidden=aux.to(torch.bfloat16), final_hidden=final.to(torch.bfloat16))


def test_each_segment_is_shifted_by_one_and_keeps_its_document_id():
    b = _block()
    out = bench.speculators_batch(b, torch.float32)
    assert out["input_ids"].tolist() == [[11, 12, 13, 21, 22]]  # x[t+1]
    assert out["document_ids"].tolist() == [[0, 0, 0, 1, 1]]
    assert out["loss_mask"].tolist() == [[0.0, 1.0, 1.0, 1.0, 1.0]]  # loss_mask[t+1]
    rows_g = [0, 1, 2, 4, 5]  # g[t]
    rows_y = [1, 2, 3, 5, 6]  # y[t+1]
    assert torch.equal(out["hidden_states"][0], b.aux_hidden[rows_g].float())
    assert torch.equal(out["verifier_last_hidden_states"][0], b.final_hidden[rows_y].float())


def test_the_same_as_speculators_shift_batch_segment_by_segment():
    if importlib.util.find_spec("speculators") is None:
        pytest.skip('speculators is not installed (the bench extra: PEAGLE_BENCH=1 bash scripts/setup_env.sh)')
    sys.path.insert(0, str(REPO / "bench"))
    import speculators_ref

    speculators_ref.speculators_peagle()  # imports the package with its absent services in place
    from speculators.models.eagle3.data import shift_batch

    b = _block()
    out = bench.speculators_batch(b, torch.float32)
    want = []
    for a, e in ((0, 4), (4, 7)):
        n = e - a
        want.append(shift_batch({"input_ids": b.input_ids[a:e], "hidden_states": b.aux_hidden[a:e].float(),
                                 "verifier_last_hidden_states": b.final_hidden[a:e].float(),
                                 "loss_mask": b.loss_mask[a:e].float(), "lengths": torch.tensor([n]),
                                 "position_ids": torch.arange(n)}))
    for key in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask"):
        assert torch.equal(out[key][0], torch.cat([w[key] for w in want])), key


def test_the_shifted_loss_mask_gives_peagle_speculators_weights():
    """``--peagle-loss-mask shifted``: m'[t] = m[t-1] inside each segment, 0 at every segment start, so
    peagle's weight of element (a, d), m'[a+d+2], is speculators' m[a+d+1]."""
    b = _block()
    out = bench.mask_shifted_right(b)
    assert out.loss_mask.tolist() == [0, 0, 0, 1, 0, 0, 1, 0]
    assert torch.equal(out.input_ids, b.input_ids) and torch.equal(out.aux_hidden, b.aux_hidden)
    assert b.loss_mask.tolist() == [0, 0, 1, 1, 0, 1, 1, 1]  # the block itself is untouched
    from peagle_train.data.cod import all_elements

    el = all_elements(out.cu_seqlens, out.loss_mask, num_depths=2)  # every (a, d) with a + d + 2 in its segment
    want = b.loss_mask[el.anchor + el.depth + 1].float()  # speculators' weight m[a+d+1], from the unshifted mask
    assert el.weight.tolist() == want.tolist() == [0.0, 1.0, 1.0, 1.0]  # (0,0) (1,0) (4,0) (0,1)


@pytest.mark.parametrize("flags", [["--trainers", "speculators", "--peagle-loss-mask", "shifted"],
                                   ["--trainers", "speculators", "--peagle-mask-hidden-std", "1"],
                                   ["--peagle-mask-hidden-std", "0"]])
def test_an_ablation_that_would_change_nothing_is_refused(flags, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench", "--store", "S", "--out", "O", *flags])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert ("which --trainers speculators does not train" in err) or ("must be > 0, got 0.0" in err)
