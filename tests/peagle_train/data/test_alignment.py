"""docs/design.md §4 worked example as a test: one segment [SYS, USR, HDR, A1, A2, EOT], m = [0,0,0,1,1,1]."""

import torch

from peagle_train.data.cod import all_elements, element_inputs, sample_cod_elements

SYS, USR, HDR, A1, A2, EOT = 10, 11, 12, 13, 14, 15
IDS = torch.tensor([SYS, USR, HDR, A1, A2, EOT])
MASK = torch.tensor([0, 0, 0, 1, 1, 1])
CU = torch.tensor([0, 6])
POS = torch.arange(6)

# (a, d): (input token or None for the mask, predicted token, target z index, weight)
TABLE = {
    (0, 0): (USR, HDR, 1, 0.0),
    (1, 0): (HDR, A1, 2, 1.0),
    (2, 0): (A1, A2, 3, 1.0),
    (3, 0): (A2, EOT, 4, 1.0),
    (0, 1): (None, A1, 2, 1.0),
    (1, 1): (None, A2, 3, 1.0),
    (2, 1): (None, EOT, 4, 1.0),
    (0, 2): (None, A2, 3, 1.0),
    (1, 2): (None, EOT, 4, 1.0),
    (0, 3): (None, EOT, 4, 1.0),
}


def test_all_elements_match_the_worked_example():
    el = all_elements(CU, MASK, num_depths=4)
    pairs = list(zip(el.anchor.tolist(), el.depth.tolist()))
    assert pairs == sorted(TABLE, key=lambda ad: (ad[1], ad[0]))  # sorted by (depth, anchor)
    assert (3, 1) not in pairs  # would predict x_6
    inp = element_inputs(el, IDS, POS)
    for i, (a, d) in enumerate(pairs):
        token, predicts, target, weight = TABLE[(a, d)]
        assert bool(inp.is_mask[i]) == (token is None)
        if token is not None:
            assert int(inp.input_ids[i]) == token and int(inp.feature_index[i]) == a  # g_a, x_{a+1}
        assert int(IDS[inp.label_index[i]]) == predicts
        assert int(inp.target_index[i]) == target
        assert float(el.weight[i]) == weight
        assert int(inp.position_ids[i]) == a + 1 + d


def test_sampling_never_leaves_the_table():
    for seed in range(20):
        el = sample_cod_elements(CU, MASK, 4, 1.0, 1.0, None, torch.Generator().manual_seed(seed))
        pairs = list(zip(el.anchor.tolist(), el.depth.tolist()))
        assert set(pairs) <= set(TABLE)
        assert [p for p in pairs if p[1] == 0] == [(0, 0), (1, 0), (2, 0), (3, 0)]
        # §8 step 3 with r = 1: n_seeds = 3 seeds (anchors 0, 1, 2), n_1 = 2, n_2 = 1, n_3 = 0
        assert el.count_per_depth(4) == [4, 2, 1, 0]
