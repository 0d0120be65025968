"""COD sampling (docs/design.md §8) against brute-force enumeration on small rows."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peagle_train.data.cod import all_elements, n_draw_formula, sample_cod_elements


def _row(lengths, mask):
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    return cu, torch.tensor(mask)


def _brute(cu, m, K):
    """{(a, d): weight} of every existing element, by direct enumeration."""
    out = {}
    for s in range(len(cu) - 1):
        lo, hi = int(cu[s]), int(cu[s + 1])
        for a in range(lo, hi):
            for d in range(K):
                if a + d + 2 <= hi - 1:
                    out[(a, d)] = float(m[a + d + 2])
    return out


rows = st.lists(st.integers(1, 12), min_size=1, max_size=4).flatmap(
    lambda lens: st.tuples(st.just(lens), st.lists(st.integers(0, 1), min_size=sum(lens), max_size=sum(lens))))


@settings(max_examples=150, deadline=None)
@given(rows, st.integers(1, 6), st.sampled_from([0.3, 0.7, 1.0]), st.sampled_from([0.1, 0.2, 1.0]),
       st.sampled_from([None, 1, 3, 100]), st.integers(0, 1000))
def test_sample_matches_the_rules(row, K, r, r_min, max_anchors, seed):
    lens, mask = row
    cu, m = _row(lens, mask)
    brute = _brute(cu, m, K)
    el = sample_cod_elements(cu, m, K, r, r_min, max_anchors, torch.Generator().manual_seed(seed))
    pairs = list(zip(el.anchor.tolist(), el.depth.tolist()))
    assert pairs == sorted(pairs, key=lambda ad: (ad[1], ad[0]))
    assert len(set(pairs)) == len(pairs)
    for (a, d), w, s in zip(pairs, el.weight.tolist(), el.segment.tolist()):
        assert (a, d) in brute and brute[(a, d)] == w  # exists, right weight
        assert int(cu[s]) <= a < int(cu[s + 1])  # its segment, no crossing
        if d > 0:
            assert w == 1.0 and (a, d - 1) in pairs  # chains nested
    assert sorted(a for a, d in pairs if d == 0) == sorted(a for a, d in brute if d == 0)  # depth 0 full
    # row-level counts: n_d from the row's seed count (after the cap), at most the pool
    seeds_all = [a for (a, d), w in brute.items() if d == 1 and w == 1.0]
    n_seeds = len(seeds_all) if max_anchors is None else min(len(seeds_all), max_anchors)
    pool = seeds_all
    for d in range(1, K):
        got = [a for a, dd in pairs if dd == d]
        assert set(got) <= set(pool)
        pool_size = n_seeds if d == 1 else len(pool)  # the capped seeds are the depth-1 pool
        assert len(got) == min(n_draw_formula(n_seeds, d, r, r_min), pool_size)
        pool = [a for a in got if brute.get((a, d + 1)) == 1.0]


@pytest.mark.parametrize("lengths", [[1024], [256] * 4, [64] * 16, [100, 300, 24, 600]])
def test_counts_per_depth_do_not_depend_on_packing(lengths):
    """A row of 1024 supervised tokens capped at 200 seeds: the same counts however it is split
    (r_min 0.1 keeps every pool larger than its draw, so the formula alone sets the counts)."""
    cu, m = _row(lengths, [1] * 1024)
    counts = [sample_cod_elements(cu, m, 8, 0.7, 0.1, 200, torch.Generator().manual_seed(s)).count_per_depth(8)
              for s in range(3)]
    expected = [1024 - 2 * len(lengths)] + [n_draw_formula(200, d, 0.7, 0.1) for d in range(1, 8)]
    assert counts == [expected] * 3


def test_counts_on_a_long_fully_supervised_segment():
    cu, m = _row([50], [1] * 50)
    el = sample_cod_elements(cu, m, 5, 0.7, 0.2, None, torch.Generator().manual_seed(0))
    n_seeds = 47  # anchors 0..46 have (a, 1)
    assert el.count_per_depth(5) == [48, 32, 22, 15, 10]  # floor((47 - d) * 0.7**d), no pool smaller
    assert el.count_per_depth(5) == [48] + [n_draw_formula(n_seeds, d, 0.7, 0.2) for d in range(1, 5)]


def test_max_anchors_caps_seeds_and_keeps_depth0_full():
    cu, m = _row([40, 40], [1] * 80)
    el = sample_cod_elements(cu, m, 4, 1.0, 1.0, 5, torch.Generator().manual_seed(1))
    counts = el.count_per_depth(4)
    assert counts[0] == 76 and counts[1] <= 5


def test_same_seed_same_sample_and_different_seed_differs():
    cu, m = _row([30, 20, 25], [1, 0, 1] * 25)
    a = sample_cod_elements(cu, m, 6, 0.7, 0.2, None, torch.Generator().manual_seed(7))
    b = sample_cod_elements(cu, m, 6, 0.7, 0.2, None, torch.Generator().manual_seed(7))
    c = sample_cod_elements(cu, m, 6, 0.7, 0.2, None, torch.Generator().manual_seed(8))
    assert torch.equal(a.anchor, b.anchor) and torch.equal(a.depth, b.depth)
    assert not (torch.equal(a.anchor, c.anchor) and torch.equal(a.depth, c.depth))


def test_all_zero_mask_gives_depth0_only():
    cu, m = _row([10, 7], [0] * 17)
    el = sample_cod_elements(cu, m, 8, 0.7, 0.2, None, torch.Generator().manual_seed(0))
    assert el.count_per_depth(8) == [8 + 5, 0, 0, 0, 0, 0, 0, 0]
    assert float(el.weight.sum()) == 0.0


def test_all_elements_is_the_brute_force_set():
    cu, m = _row([9, 1, 2, 6], [0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 0, 1, 1, 1])
    el = all_elements(cu, m, 5)
    got = {(a, d): w for a, d, w in zip(el.anchor.tolist(), el.depth.tolist(), el.weight.tolist())}
    assert got == _brute(cu, m, 5)


@pytest.mark.parametrize("kwargs, option", [
    (dict(num_depths=0), "--num-depths"),
    (dict(down_sample_ratio=0.0), "--down-sample-ratio"),
    (dict(down_sample_ratio=1.5), "--down-sample-ratio"),
    (dict(down_sample_ratio_min=0.0), "--down-sample-ratio-min"),
    (dict(max_anchors=0), "--max-anchors"),
])
def test_bad_parameters_raise(kwargs, option):
    args = dict(num_depths=4, down_sample_ratio=0.7, down_sample_ratio_min=0.2, max_anchors=None)
    args.update(kwargs)
    cu, m = _row([5], [1] * 5)
    with pytest.raises(ValueError, match=option):
        sample_cod_elements(cu, m, generator=torch.Generator(), **args)
