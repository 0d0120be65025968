"""bench/bench_hybrid_served.py: the store's features of a hybrid against the served computation (chunked prefill,
then decode steps), at the positions that feed supervised tokens."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_hybrid_served", REPO / "bench" / "bench_hybrid_served.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench
spec.loader.exec_module(bench)

sys.path.insert(0, str(REPO / "tests"))
from families import build_family, hidden_states_as_stored  # noqa: E402


def test_served_states_equal_the_full_forward_and_supervised_positions(one_thread):
    model = build_family("qwen3_next")
    ids = torch.randint(3, 509, (40,), generator=torch.Generator().manual_seed(0))
    aux, final = bench.served_states(model, ids, [0, 1, 4], prompt_len=20, chunk=8)  # 8, 8, 4, then 20 steps
    alone, out = hidden_states_as_stored(model, input_ids=ids[None])
    assert aux.shape == (40, 3, 64) and final.shape == (40, 64)
    for j, layer in enumerate([0, 1, 4]):
        assert float((aux[:, j] - alone[layer][0]).abs().max()) < 1e-4
    assert float((final - out.hidden_states[-1][0]).abs().max()) < 1e-4
    mask = np.array([0, 0, 1, 1, 0, 1], np.uint8)
    assert bench.supervised_positions(mask).tolist() == [1, 2, 4]
    c = bench.compare(model, ids, np.r_[np.zeros(20, np.uint8), np.ones(20, np.uint8)], [0, 1, 4], 20, 8)
    assert c["supervised"] == 20 and c["argmax_differs_f32"] == 0 and c["max_abs"] < 1e-4
    assert min(c["cos_min"]) > 0.999


def test_a_served_state_dropped_between_chunks_is_seen(one_thread):
    """Control: chunks that each start from a zero state (no cache carried) differ from the store's features."""
    model = build_family("nemotron_h")
    ids = torch.randint(3, 509, (32,), generator=torch.Generator().manual_seed(1))
    aux, _ = bench.served_states(model, ids, [4], prompt_len=32, chunk=32)
    halves = torch.cat([bench.served_states(model, ids[lo:lo + 16], [4], prompt_len=16, chunk=16)[0]
                        for lo in (0, 16)])
    rel = (halves[16:, 0] - aux[16:, 0]).norm(dim=-1) / aux[16:, 0].norm(dim=-1)
    assert float(rel.max()) > 0.05
