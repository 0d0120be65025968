"""bench/bench_context_disk.py and bench/bench_window_store_read.py on a tiny packed table: the disk
figures equal the chunk files of real stores written for the same plan, and the plain read reads
exactly the bytes ``read_block`` returns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from peagle_data.extract.contexts import plan_contexts
from stores.features.feature_schema import SEGMENTS
from tests.bench.bench_modules import load_bench


disk = load_bench("bench_context_disk")
read = load_bench("bench_window_store_read")

C, X, SYSTEM_LEN, LAYERS, H, V = 32, 48, 3, [0, 1], 4, 64


def chunk_bytes(root: Path) -> int:
    """Bytes of every chunk file under a zarr store (``NAME/c/...``), sub-stores included."""
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and "c" in p.relative_to(root).parts)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Seven conversations of 10-60 tokens (those over X = 48 split) packed at C = 32, planned at X = 48,
    and both stores written for them."""
    rows, conversations = read.synthetic_packed(7, 10, 60, SYSTEM_LEN, C, seed=0)
    rows = [dict(r, input_ids=r["input_ids"] % V) for r in rows]  # tiny vocabulary
    conversations = {k: dict(c, input_ids=c["input_ids"] % V) for k, c in conversations.items()}
    plan = plan_contexts(rows, conversations, X, C)
    work = tmp_path_factory.mktemp("disk")
    full, blocks = read.write_stores(work, rows, plan, C, LAYERS, H, V, seed=0)
    return rows, plan, full, blocks, work


def test_figures_equal_the_stores_chunk_files(tiny):
    rows, plan, full, blocks, work = tiny
    assert plan.counts["conversations_split"] >= 1 and len(rows) > 3 and len(plan.rows) > 1
    w = disk.window_figures(rows, C, len(LAYERS), H, V, "bf16")
    f = disk.full_figures(plan, C, len(LAYERS), H, V, "bf16")
    assert w["bytes"] == chunk_bytes(work / "blocks.zarr")
    assert f["bytes"] == chunk_bytes(work / "full.zarr")
    assert f["contexts_bytes"] == chunk_bytes(work / "full.zarr" / "contexts")
    assert w["tokens_extracted"] == sum(int(r["n_tokens"]) for r in rows) == blocks.n_tokens
    assert w["stored_slots"] == len(rows) * C
    assert f["tokens_extracted"] == sum(len(r["input_ids"]) for r in plan.rows) == full.contexts.n_tokens
    assert f["stored_slots"] == full.contexts.n_blocks * full.contexts.block_size == len(plan.rows) * plan.context_size


def test_fp8_figures_are_its_arrays():
    """fp8 stores: 1-byte codes plus a float32 scale per vector (L + 1 per slot), nothing else changes."""
    rows, _ = read.synthetic_packed(3, 10, 30, SYSTEM_LEN, C, seed=1)
    H8 = 8
    bf16 = disk.window_figures(rows, C, len(LAYERS), H8, V, "bf16")["bytes"]
    fp8 = disk.window_figures(rows, C, len(LAYERS), H8, V, "fp8")["bytes"]
    slots = len(rows) * C
    # per slot and vector: 2 bytes per value against 1 + a 4-byte scale; the two scale arrays add a crc per block
    assert bf16 - fp8 == slots * (len(LAYERS) + 1) * (2 * H8 - H8 - 4) - 2 * 4 * len(rows) > 0


def test_plain_read_reads_what_read_block_returns(tiny):
    rows, _, full, blocks, _ = tiny
    for i in range(full.n_blocks):
        a = full.read_block(i, via="file")
        b = blocks.read_block(i, via="file")
        assert torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.final_hidden, b.final_hidden)
        for ranges in (read.ranges_full(full, i), read.ranges_blocks(blocks, i)):
            ids, mask, pos, cu, aux, final = read.plain_reader(ranges)()
            assert torch.equal(ids.view(torch.int32).long(), a.input_ids)
            assert torch.equal(mask.long(), a.loss_mask) and torch.equal(pos.view(torch.int32).long(), a.position_ids)
            assert torch.equal(cu.view(torch.int32)[: len(a.cu_seqlens)].long(), a.cu_seqlens)
            assert torch.equal(aux.view(torch.bfloat16), a.aux_hidden.flatten())
            assert torch.equal(final.view(torch.bfloat16), a.final_hidden.flatten())
        runs = full.runs(i, full.read_tokens(i)[SEGMENTS.name])
        assert len(runs) == sum(1 + (p > 0) for p in np.asarray(rows[i]["segment_prefix_lens"]).tolist()
                                ) and sum(n for _, _, n in runs) == int(rows[i]["n_tokens"])
