"""Cost of checking every chunk's crc32c on the store read path (issue 33), against a plain read of the
same bytes, in one run.

Builds (once per ``--work``; the stores of ``bench/bench_window_store_read.py``, SmolLM2 sizes: 3 aux
layers, H 576, bf16, uncompressed) a full-context store (format 2) and a window-context store (format 1)
of the same training blocks. Then times whole passes over every training block, page cache warm, the
readers alternating within a round, ``--rounds`` rounds, median pass per reader:

- ``blocks``: ``FeatureStore.read_block`` of the window-context store: every chunk of the block read
  whole (``C`` slots and the 4 checksum bytes, one ``preadv``) and its crc32c checked;
- ``blocks_plain``: the same bytes (each chunk file whole), each file opened and read by one ``preadv``
  into fresh arrays, no checksum;
- ``full_first``: ``read_block`` of the full-context store with a reader that has checked no context
  chunk yet (as a new process's first epoch): each context chunk a block reads is checked whole once
  (``ChunkFiles.check_crc``), then its runs are read;
- ``full``: the same with every context chunk already checked and unchanged (later epochs: an
  ``fstat`` per chunk);
- ``full_plain``: the bytes ``full`` reads (the root's token chunks whole, each run's range of its
  context chunk files), no checksum;
- ``contexts_plain``: every context chunk file read whole once (the bytes ``full_first`` reads on top of
  ``full``), no checksum.

Ratios are of median pass times (above 1: slower than the plain read).

Usage (from the repository root, inside .venv):
    OMP_NUM_THREADS=1 python bench/bench_checked_read.py --work /tmp/ckr --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_window_store_read import build, plain_reader, time_passes  # noqa: E402

from stores.features.chunk_files import CHECKSUM_BYTES  # noqa: E402
from stores.features.feature_schema import SEGMENTS, TOKEN_ARRAYS, hidden_arrays  # noqa: E402
from stores.features.feature_store import FeatureStore  # noqa: E402


def _chunk_bytes(store: FeatureStore, name: str) -> int:
    """Bytes of one chunk file of array ``name``: its data and the checksum."""
    return int(np.prod(store.array(name).chunks)) * store.array(name).dtype.itemsize + CHECKSUM_BYTES


def ranges_blocks(store: FeatureStore, i: int) -> list[list[tuple[str, int, int]]]:
    """The bytes the checked ``read_block(i)`` of a window-context store reads: every chunk file whole."""
    names = [s.name for s in TOKEN_ARRAYS] + [SEGMENTS.name] + [s.name for s in hidden_arrays(store.storage_dtype)]
    return [[(str(store.chunk_path(n, i)), 0, _chunk_bytes(store, n))] for n in names]


def ranges_full(store: FeatureStore, i: int) -> list[list[tuple[str, int, int]]]:
    """The bytes the checked ``read_block(i)`` of a full-context store reads once every context chunk is
    checked: the root's token chunk files whole, each run's slots of its context chunk files."""
    names = [s.name for s in TOKEN_ARRAYS] + [SEGMENTS.name]
    out = [[(str(store.chunk_path(n, i)), 0, _chunk_bytes(store, n))] for n in names]
    runs = store.runs(i, store.read_tokens(i, via="zarr")[SEGMENTS.name])
    ctx = store.contexts
    for spec in hidden_arrays(ctx.storage_dtype):
        slot = int(np.prod(spec.block_shape(ctx.sizes())[1:])) * np.dtype(spec.dtype).itemsize
        out.append([(str(ctx.chunk_path(spec.name, m)), s * slot, n * slot) for m, s, n in runs])
    return out


def ranges_contexts(store: FeatureStore) -> list[list[tuple[str, int, int]]]:
    """Every hidden-state chunk file of the context blocks, whole."""
    ctx = store.contexts
    return [[(str(ctx.chunk_path(spec.name, m)), 0, _chunk_bytes(ctx, spec.name))]
            for spec in hidden_arrays(ctx.storage_dtype) for m in range(ctx.n_blocks)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="directory of the two stores (built when absent)")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--min-len", type=int, default=1000)
    ap.add_argument("--system-len", type=int, default=20)
    ap.add_argument("--block-size", type=int, default=2048)
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    work = Path(args.work)
    if not (work / "built.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        build(work, args)
    facts = json.loads((work / "built.json").read_text())
    full, blocks = FeatureStore.open(work / "full.zarr"), FeatureStore.open(work / "blocks.zarr")
    n = full.n_blocks
    rb, rf, rc = ([ranges_blocks(blocks, i) for i in range(n)], [ranges_full(full, i) for i in range(n)],
                  ranges_contexts(full))
    plain_b, plain_f, plain_c = ([plain_reader(r) for r in rb], [plain_reader(r) for r in rf],
                                 [plain_reader([r]) for r in rc])

    def full_first():
        full.contexts._files._checked.clear()  # the context blocks' reader has checked nothing yet
        return [full.read_block(i, via="file") for i in range(n)]

    readers = {
        "blocks": lambda: [blocks.read_block(i, via="file") for i in range(n)],
        "blocks_plain": lambda: [f() for f in plain_b],
        "full_first": full_first,
        "full": lambda: [full.read_block(i, via="file") for i in range(n)],
        "full_plain": lambda: [f() for f in plain_f],
        "contexts_plain": lambda: [f() for f in plain_c],
    }
    for i in range(n):  # the checked readers return what the plain reads hold
        a, b = full.read_block(i, via="file"), blocks.read_block(i, via="file")
        assert torch.equal(a.aux_hidden, b.aux_hidden) and torch.equal(a.final_hidden, b.final_hidden), i
        p = plain_f[i]()
        assert torch.equal(p[-2].view(torch.bfloat16), a.aux_hidden.flatten()), i
    for f in readers.values():  # warm the page cache and the allocator
        f()
    times = time_passes(readers, args.rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    mib = {k: sum(b for r in rs for parts in r for _, _, b in parts) / 2 ** 20
           for k, rs in (("blocks", rb), ("blocks_plain", rb), ("full", rf), ("full_plain", rf),
                         ("contexts_plain", [rc]))}
    mib["full_first"] = mib["full"] + mib["contexts_plain"]
    print(f"{n} training blocks of {args.block_size} ({facts['segments']} segments), {facts['context_blocks']} context "
          f"blocks of {facts['context_size']}; {args.rounds} rounds; load average {os.getloadavg()[0]:.1f}\n")
    print("| reader | MiB per pass | median pass (ms) | MiB/s |")
    print("|---|---|---|---|")
    for k in readers:
        print(f"| {k} | {mib[k]:.0f} | {med[k] * 1e3:.1f} | {mib[k] / med[k]:.0f} |")
    print(f"\nblocks / blocks_plain {med['blocks'] / med['blocks_plain']:.3f}; full / full_plain "
          f"{med['full'] / med['full_plain']:.3f}; full_first / (full_plain + contexts_plain) "
          f"{med['full_first'] / (med['full_plain'] + med['contexts_plain']):.3f}; full_first / full "
          f"{med['full_first'] / med['full']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
