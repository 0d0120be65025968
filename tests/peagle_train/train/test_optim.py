"""LazyRowAdamW: AdamW on touched rows, untouched rows left alone; sparse and dense gradients agree."""

import torch

from peagle_train.train.optim import LazyRowAdamW, clip_grad_norm

V, H = 12, 4


def _steps(lazy: bool, rows_per_step, sparse: bool = False, wd: float = 0.1):
    torch.manual_seed(0)
    emb = torch.nn.Embedding(V, H, sparse=sparse)
    lin = torch.nn.Linear(H, 1, bias=False)
    opt = (LazyRowAdamW if lazy else torch.optim.AdamW)(
        [{"params": [lin.weight]}, {"params": [emb.weight], **({"lazy_rows": True} if lazy else {})}],
        lr=0.1, weight_decay=wd)
    for ids in rows_per_step:
        opt.zero_grad(set_to_none=True)
        lin(emb(torch.tensor(ids))).pow(2).sum().backward()
        clip_grad_norm([lin.weight, emb.weight], 0.5)
        opt.step()
    return emb.weight.detach().clone(), lin.weight.detach().clone(), opt


def test_equals_adamw_when_every_row_is_touched():
    steps = [list(range(V)) * 2, list(range(V))[::-1], list(range(V))]
    a, b = _steps(False, steps), _steps(True, steps)
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=1e-7)


def test_untouched_rows_stay_and_sparse_equals_dense():
    steps = [[1, 2, 2], [2, 5], [7]]
    init = _steps(True, [])[0]
    dense, _, opt = _steps(True, steps)
    sparse = _steps(True, steps, sparse=True)[0]
    torch.testing.assert_close(dense, sparse, rtol=1e-6, atol=1e-7)
    untouched = [r for r in range(V) if r not in (1, 2, 5, 7)]
    assert torch.equal(dense[untouched], init[untouched])
    assert opt.state[opt.param_groups[1]["params"][0]]["step"].tolist() == \
        [0, 1, 2, 0, 0, 1, 0, 1, 0, 0, 0, 0]


def test_state_dict_round_trip_continues_identically():
    steps = [[1, 2], [2, 3], [3, 4], [4, 1]]
    full = _steps(True, steps)[0]
    _, _, opt = _steps(True, steps[:2])
    sd = opt.state_dict()
    torch.manual_seed(0)
    emb, lin = torch.nn.Embedding(V, H), torch.nn.Linear(H, 1, bias=False)
    half_emb, half_lin, _ = _steps(True, steps[:2])
    emb.weight.data.copy_(half_emb)
    lin.weight.data.copy_(half_lin)
    opt2 = LazyRowAdamW([{"params": [lin.weight]}, {"params": [emb.weight], "lazy_rows": True}], lr=0.1,
                        weight_decay=0.1)
    opt2.load_state_dict(sd)
    for ids in steps[2:]:
        opt2.zero_grad(set_to_none=True)
        lin(emb(torch.tensor(ids))).pow(2).sum().backward()
        clip_grad_norm([lin.weight, emb.weight], 0.5)
        opt2.step()
    torch.testing.assert_close(emb.weight.detach(), full, rtol=1e-6, atol=1e-7)
