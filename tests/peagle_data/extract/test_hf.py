"""The hf engine: a context block's conversations run in groups of the packed block size."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from peagle_data.extract.hf import HfEngine, segment_groups

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from families import build_family  # noqa: E402


def test_segment_groups():
    assert segment_groups([0, 10, 20, 30], None) == [(0, 3)]
    assert segment_groups([0, 10, 20, 30], 30) == [(0, 3)]
    assert segment_groups([0, 10, 20, 30], 25) == [(0, 2), (2, 3)]
    assert segment_groups([0, 10, 50, 60, 65], 20) == [(0, 1), (1, 2), (2, 4)]  # 40 tokens alone
    assert segment_groups([0, 40], 20) == [(0, 1)]


def test_grouped_block_equals_the_whole_block(one_thread):
    model = build_family("gemma2")  # sliding and full layers, soft-capping
    lengths = [9, 3, 12, 30, 5]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 509, (sum(lengths),), generator=g)
    row = {"input_ids": ids.numpy(), "position_ids": np.concatenate([np.arange(n) for n in lengths]),
           "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)])}
    whole = HfEngine(model, {}, [0, 1, 2])
    grouped = HfEngine(model, {}, [0, 1, 2], group_tokens=16)
    (_, aux, final), = whole.features([(0, row)])
    (_, aux_g, final_g), = grouped.features([(0, row)])
    assert aux_g.shape == aux.shape and final_g.shape == final.shape
    rel = ((final_g.float() - final.float()).norm(dim=-1) / final.float().norm(dim=-1)).max()
    assert float(rel) < 8e-3  # both are each segment alone, rounded to bf16
