"""Read speed of a full-context store against a window-context store and a plain read of the same bytes
(issue 21: "read speed within 1.25x of a plain read of the same bytes").

Builds, once per ``--work`` directory, from synthetic conversations (SmolLM2 sizes: 3 aux layers,
H 576, bf16, uncompressed):

- a full-context store (format 2, ``FeatureStore.create_windows``): conversations of ``--min-len`` to
  ``--max-context`` (8,192) tokens with a ``--system-len``-token system prefix, cut into windows of ``--block-size``
  tokens by pack's own code (``make_windows``, overlap 0.5, ``skip``; ``pack_blocks_flexible``,
  ``make_packed_row``), planned by ``plan_contexts`` (``--max-context`` 8192: context blocks of up
  to 8,192 slots) and written with random bf16 hidden states in the context blocks; each window
  is a view of two runs (its prefix, its body);
- a window-context store (format 1, ``FeatureStore.create``) of the same training blocks holding the
  same features (each block's ``read_block`` of the full-context store, checked equal on the zarr
  path too).

Then times whole passes over every training block, page cache warm, the readers alternating within a
round, ``--rounds`` rounds, median pass (and best) per reader:

- ``full``: ``FeatureStore.read_block`` of the full-context store (``file`` path: token arrays from
  the root's chunk files, hidden states gathered by ``read_runs``, one ``preadv`` per run);
- ``blocks``: ``FeatureStore.read_block`` of the window-context store (whole chunk files);
- ``plain``: the same byte ranges ``full`` reads (the root's token chunks, each run's range of its
  context chunk files), each file opened once per block and read by ``preadv`` into fresh arrays of
  the same sizes (allocated as the store reader allocates its tensors; paths and offsets prepared
  beforehand);
- ``plain_prealloc``: the same ranges into one preallocated buffer (no page faults into fresh memory);
- ``plain_blocks``: the window-context store's chunk files read the same way (fresh arrays).

Ratios are of median pass times (above 1: slower than the plain read).

Usage (from the repository root, inside .venv; build once, then time):
    OMP_NUM_THREADS=1 python bench/bench_window_store_read.py --work /tmp/wsr --build-only
    OMP_NUM_THREADS=1 python bench/bench_window_store_read.py --work /tmp/wsr --rounds 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from peagle_data.extract.contexts import plan_contexts
from peagle_data.prepare.packing import make_packed_row, pack_blocks_flexible
from peagle_data.prepare.windows import make_windows, trim_window
from stores.features.feature_schema import SEGMENTS, TOKEN_ARRAYS, hidden_arrays
from stores.features.feature_store import FeatureStore

H, V = 576, 49152
LAYERS = [2, 15, 27]
VERIFIER = {"name_or_path": "bench", "num_hidden_layers": 30, "dtype": "bfloat16"}


def synthetic_packed(n_conversations: int, min_len: int, max_len: int, system_len: int, block_size: int,
                     seed: int) -> tuple[list[dict], dict[str, dict]]:
    """``(packed rows, conversations by id)`` as ``pack`` makes them for random conversations (one of
    ``max_len`` tokens, the others uniform in ``[min_len, max_len]``; 70% of body tokens supervised)."""
    g = np.random.default_rng(seed)
    lengths = [max_len, *g.integers(min_len, max_len + 1, n_conversations - 1).tolist()]
    conversations, windows = {}, []
    for c, T in enumerate(lengths):
        ids = g.integers(3, V, T).astype(np.int32)
        mask = (g.random(T) < 0.7).astype(np.uint8)
        mask[:system_len] = 0
        cid = f"c{c}"
        conversations[cid] = {"conversation_id": cid, "input_ids": ids, "loss_mask": mask, "system_len": system_len}
        windows += [(f"{cid}#{w.index}", w) for w in make_windows(ids, mask, system_len, block_size)]
    blocks, used = pack_blocks_flexible([w.n_tokens for _, w in windows],
                                        [w.n_tokens - w.trimmable for _, w in windows], block_size)
    rows = []
    for b, members in enumerate(blocks):
        segments = []
        for i in members:
            sid, w = windows[i]
            ids, mask = w.input_ids, w.loss_mask
            if used[i] != w.n_tokens:
                ids, mask = trim_window(ids, mask, w.prefix_len, used[i])
            segments.append((sid, ids, mask))
        row = make_packed_row(b, segments)
        r = {"input_ids": row.input_ids, "loss_mask": row.loss_mask, "position_ids": row.position_ids,
             "cu_seqlens": row.cu_seqlens, "n_tokens": row.n_tokens, "segment_ids": row.segment_ids,
             "segment_prefix_lens": [windows[i][1].prefix_len for i in members],
             "segment_starts": [windows[i][1].prefix_len + windows[i][1].body_start + windows[i][1].n_tokens - used[i]
                                for i in members]}
        rows.append(r)
    return rows, conversations


def write_stores(work: Path, rows: list[dict], plan, block_size: int, layers: list[int], hidden_size: int,
                 vocab_size: int, seed: int) -> tuple[FeatureStore, FeatureStore]:
    """``(full, blocks)``: the full-context store of ``plan`` at ``work/full.zarr`` (random bf16 hidden
    states in its context blocks) and a window-context store of the same training blocks with the same
    features at ``work/blocks.zarr``, every chunk written, as extraction leaves them (the full store's
    ``read_block`` checked equal on the file and zarr paths)."""
    S = max(len(r["cu_seqlens"]) - 1 for r in rows)
    n_tokens = np.array([r["n_tokens"] for r in rows])
    common = dict(layers=layers, hidden_size=hidden_size, vocab_size=vocab_size, verifier=VERIFIER, force=True)
    full = FeatureStore.create_windows(
        work / "full.zarr", n_blocks=len(rows), block_size=block_size, max_segments=S,
        n_context_blocks=len(plan.rows), context_size=plan.context_size,
        context_segments=max(len(r["cu_seqlens"]) - 1 for r in plan.rows), n_tokens=int(n_tokens.sum()),
        n_context_tokens=sum(int(r["n_tokens"]) for r in plan.rows), **common)
    full.write_all_n_tokens(n_tokens)
    freq = np.bincount(np.concatenate([r["input_ids"][r["loss_mask"] > 0] for r in rows]), minlength=vocab_size)
    full.set_token_freq(freq)
    for i, r in enumerate(rows):
        full.write_token_row(i, r)
        full.write_views(i, plan.views[i])
    ctx = full.contexts
    ctx.write_all_n_tokens(np.array([r["n_tokens"] for r in plan.rows]))
    ctx.set_token_freq(freq)
    gen = torch.Generator().manual_seed(seed)
    L = len(layers)
    for m, r in enumerate(plan.rows):
        T = int(r["n_tokens"])
        ctx.write_token_row(m, r)
        ctx.write_features(m, torch.randn(T, L, hidden_size, generator=gen).to(torch.bfloat16),
                           torch.randn(T, hidden_size, generator=gen).to(torch.bfloat16))
        ctx.mark_done(m)
    full.update_attrs(tokens_written=True)
    full = FeatureStore.open(work / "full.zarr")
    blocks = FeatureStore.create(work / "blocks.zarr", n_blocks=len(rows), block_size=block_size, max_segments=S,
                                 n_tokens=int(n_tokens.sum()), **common)
    blocks.write_all_n_tokens(n_tokens)
    blocks.set_token_freq(freq)
    for i, r in enumerate(rows):
        b = full.read_block(i, via="file")
        z = full.read_block(i, via="zarr")
        assert torch.equal(b.aux_hidden, z.aux_hidden) and torch.equal(b.final_hidden, z.final_hidden), i
        blocks.write_token_row(i, r)
        blocks.write_features(i, b.aux_hidden, b.final_hidden)
        blocks.mark_done(i)
    blocks.update_attrs(tokens_written=True)
    return full, FeatureStore.open(work / "blocks.zarr")


def build(work: Path, args) -> None:
    """Write both stores under ``work`` (module docstring) and their facts to ``work/built.json``."""
    rows, conversations = synthetic_packed(args.conversations, args.min_len, args.max_context, args.system_len,
                                           args.block_size, args.seed)
    plan = plan_contexts(rows, conversations, args.max_context, args.block_size)
    write_stores(work, rows, plan, args.block_size, LAYERS, H, V, args.seed)
    facts = {"training_blocks": len(rows), "context_blocks": len(plan.rows), "context_size": plan.context_size,
             "tokens": int(sum(int(r["n_tokens"]) for r in rows)), "segments": int(sum(len(r["segment_ids"]) for r in rows)),
             "context_tokens": int(sum(int(r["n_tokens"]) for r in plan.rows)), **vars(args)}
    (work / "built.json").write_text(json.dumps(facts, indent=1, default=str))


def ranges_full(store: FeatureStore, i: int) -> list[list[tuple[str, int, int]]]:
    """The byte ranges ``read_block(i)`` of a full-context store reads, one list per result array:
    ``[(path, offset, bytes)]`` (token arrays from the root, hidden states by run)."""
    tok = store.read_tokens(i, via="zarr")
    T = len(tok["input_ids"])
    out = [[(str(store.chunk_path(s.name, i)), 0, T * np.dtype(s.dtype).itemsize)] for s in TOKEN_ARRAYS]
    out.append([(str(store.chunk_path(SEGMENTS.name, i)), 0, 4 * (int(store.attrs["max_segments"]) + 1))])
    runs = store.runs(i, tok[SEGMENTS.name])
    ctx = store.contexts
    for spec in hidden_arrays(ctx.storage_dtype):
        slot = int(np.prod(spec.block_shape(ctx.sizes())[1:])) * np.dtype(spec.dtype).itemsize
        out.append([(str(ctx.chunk_path(spec.name, m)), s * slot, n * slot) for m, s, n in runs])
    return out


def ranges_blocks(store: FeatureStore, i: int) -> list[list[tuple[str, int, int]]]:
    """The byte ranges ``read_block(i)`` of a window-context store reads (whole chunks' first T slots)."""
    T = store.n_tokens_of(i)
    out = [[(str(store.chunk_path(s.name, i)), 0, T * np.dtype(s.dtype).itemsize)] for s in TOKEN_ARRAYS]
    out.append([(str(store.chunk_path(SEGMENTS.name, i)), 0, 4 * (int(store.attrs["max_segments"]) + 1))])
    for spec in hidden_arrays(store.storage_dtype):
        slot = int(np.prod(spec.block_shape(store.sizes())[1:])) * np.dtype(spec.dtype).itemsize
        out.append([(str(store.chunk_path(spec.name, i)), 0, T * slot)])
    return out


def plain_reader(ranges: list[list[tuple[str, int, int]]], buffer: np.ndarray | None = None):
    """A plain read of ``ranges``: per result array a fresh uint8 array (or consecutive views of
    ``buffer``), each file opened once, one ``preadv`` per range."""
    sizes = [sum(n for _, _, n in r) for r in ranges]

    def read():
        out, at = [], 0
        for parts, size in zip(ranges, sizes):
            if buffer is None:
                a = np.empty(size, dtype=np.uint8)
            else:
                a, at = buffer[at:at + size], at + size
            fds, pos = {}, 0
            try:
                for path, offset, n in parts:
                    fd = fds.get(path)
                    if fd is None:
                        fd = fds[path] = os.open(path, os.O_RDONLY)
                    os.preadv(fd, [a[pos:pos + n]], offset)
                    pos += n
            finally:
                for fd in fds.values():
                    os.close(fd)
            out.append(torch.from_numpy(a))
        return out
    return read


def time_passes(readers: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of one pass of each reader in each round, the readers alternating within a round."""
    times = {k: [] for k in readers}
    for _ in range(rounds):
        for k, f in readers.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="directory of the two stores (built when absent)")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--min-len", type=int, default=1000)
    ap.add_argument("--system-len", type=int, default=20)
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args(argv)
    work = Path(args.work)
    if args.rebuild or not (work / "built.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        build(work, args)
        print(f"built in {time.perf_counter() - t0:.0f} s", flush=True)
    facts = json.loads((work / "built.json").read_text())
    print({k: facts[k] for k in ("training_blocks", "segments", "tokens", "context_blocks", "context_size",
                                 "context_tokens")}, flush=True)
    if args.build_only:
        return 0
    full, blocks = FeatureStore.open(work / "full.zarr"), FeatureStore.open(work / "blocks.zarr")
    n = full.n_blocks
    n_runs = sum(len(full.runs(i, full.read_tokens(i)[SEGMENTS.name])) for i in range(n))
    rf = [ranges_full(full, i) for i in range(n)]
    rb = [ranges_blocks(blocks, i) for i in range(n)]
    payload = sum(sum(b for parts in r for _, _, b in parts) for r in rf)
    assert payload == sum(sum(b for parts in r for _, _, b in parts) for r in rb)
    buffer = np.empty(max(sum(b for parts in r for _, _, b in parts) for r in rf), dtype=np.uint8)
    plain, prealloc, plain_b = ([plain_reader(r) for r in rf], [plain_reader(r, buffer) for r in rf],
                                [plain_reader(r) for r in rb])
    readers = {
        "full": lambda: [full.read_block(i, via="file") for i in range(n)],
        "blocks": lambda: [blocks.read_block(i, via="file") for i in range(n)],
        "plain": lambda: [f() for f in plain],
        "plain_prealloc": lambda: [f() for f in prealloc],
        "plain_blocks": lambda: [f() for f in plain_b],
    }
    for i in range(n):  # the readers return the same bytes (the plain read: the full store's ranges)
        a, b = full.read_block(i, via="file"), blocks.read_block(i, via="file")
        assert torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.final_hidden, b.final_hidden), i
        p = plain[i]()
        assert torch.equal(p[-2].view(torch.bfloat16), a.aux_hidden.flatten()), i
    for f in readers.values():  # warm the page cache and the allocator
        f()
    times = time_passes(readers, args.rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    mib = payload / 2 ** 20
    load = os.getloadavg()[0]
    print(f"\n{n} training blocks of {args.block_size} ({facts['segments']} segments, {n_runs} runs), "
          f"{mib:.0f} MiB per pass; {args.rounds} rounds; load average {load:.1f}; torch threads {torch.get_num_threads()}\n")
    print("| reader | median pass (ms) | MiB/s | best pass (ms) | median / plain | median / plain_prealloc |")
    print("|---|---|---|---|---|---|")
    for k in readers:
        print(f"| {k} | {med[k] * 1e3:.1f} | {mib / med[k]:.0f} | {best[k] * 1e3:.1f} | **{med[k] / med['plain']:.2f}** | "
              f"{med[k] / med['plain_prealloc']:.2f} |")
    print(f"\nfull / plain {med['full'] / med['plain']:.3f}; blocks / plain_blocks {med['blocks'] / med['plain_blocks']:.3f}; "
          f"full / blocks {med['full'] / med['blocks']:.3f}; full / plain_prealloc {med['full'] / med['plain_prealloc']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
