"""DFlash training samples of a packed row: anchors, block tokens, targets, weights and the attention rule."""

import torch

from peagle_train.data.anchors import AnchorBlocks, block_inputs, sample_anchors

# two segments: rows 0..6 and 7..11; supervised rows 2-4 and 8-11
CU = torch.tensor([0, 7, 12])
MASK = torch.tensor([0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1])
POS = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4])
IDS = torch.arange(100, 112)  # x_i = 100 + i
M = 7  # the mask token


def test_anchors_are_supervised_rows_with_context_and_a_supervised_slot():
    # B = 3: row 4's slots 5, 6 are unsupervised; row 11's slots leave the row; row 7 is no anchor (unsupervised)
    assert sample_anchors(CU, MASK, 3, None, torch.Generator()).anchor.tolist() == [2, 3, 8, 9, 10]
    # B = 4: row 4's slot 7 lies in the next segment (weight 0): still no anchor
    assert sample_anchors(CU, MASK, 4, None, torch.Generator()).anchor.tolist() == [2, 3, 8, 9, 10]
    first_row_supervised = torch.tensor([1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 1])
    assert sample_anchors(CU, first_row_supervised, 3, None, torch.Generator()).anchor.tolist() == [1, 2, 3, 8, 9, 10]


def test_max_anchors_draws_sorted_subsets_from_the_generator():
    draws = {tuple(sample_anchors(CU, MASK, 3, 2, torch.Generator().manual_seed(s)).anchor.tolist()) for s in range(20)}
    assert all(len(d) == 2 and list(d) == sorted(d) and set(d) <= {2, 3, 8, 9, 10} for d in draws) and len(draws) > 1
    again = sample_anchors(CU, MASK, 3, 2, torch.Generator().manual_seed(5)).anchor
    assert torch.equal(again, sample_anchors(CU, MASK, 3, 2, torch.Generator().manual_seed(5)).anchor)


def test_block_inputs_of_two_blocks():
    inp = block_inputs(AnchorBlocks(torch.tensor([3, 10]), 3), IDS, POS, CU, MASK, M)
    assert inp.input_ids.tolist() == [103, M, M, 110, M, M]
    assert inp.position_ids.tolist() == [3, 4, 5, 3, 4, 5]
    assert inp.depth.tolist() == [-1, 0, 1, -1, 0, 1]
    # slot j >= 1 is scored against final_hidden[p + j - 1]; row 12 (past the row) is clamped and weighs 0
    assert inp.target_index.tolist()[1:3] == [3, 4] and inp.target_index.tolist()[4:] == [10, 11]
    assert inp.weight.tolist() == [0, 1, 0, 0, 1, 0]  # m[4], m[5]; m[11], outside
    ctx, own = inp.mask[:, :12], inp.mask[:, 12:]
    assert all(ctx[q].nonzero().flatten().tolist() == [0, 1, 2] for q in range(3))  # rows before the anchor only
    assert all(ctx[q].nonzero().flatten().tolist() == [7, 8, 9] for q in range(3, 6))  # of its own segment
    assert own.tolist() == [[q // 3 == k // 3 for k in range(6)] for q in range(6)]  # its block, not causal
