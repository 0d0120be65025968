"""peagle against its anchors on the hot paths of training data, each ratio from one run.

Paths (``--paths``, comma-separated):
- ``cod``: ``sample_cod_elements`` against speculators' ``generate_cod_sample_indices`` on the same
  synthetic rows (segments of 2048 tokens, 70% supervised, K = 8, r = 0.7, r_min = 0.2), with
  ``max_anchors`` unset and 1024; the calls alternate, the ratio is of the medians. Also the
  elements per depth of both (row-level counts: equal where the pool is not the limit).
- ``blockmask``: ``block_mask_from_elements`` (the flex backend's BlockMask, from the element
  structure) against ``create_block_mask`` on speculators' ``create_peagle_mask_mod`` for the same
  elements (anchors, depths, segment of every token): time (median of ``--mask-repeats``) and peak
  resident memory above the resident memory before the call (the kernel's high-water mark, reset
  through ``/proc/self/clear_refs``); both BlockMasks are checked identical.
- ``attention``: one attention call (SmolLM2 heads: 9 query / 3 key-value heads of 64, float32)
  forward and backward over the elements of a row, ``SplitElementAttention`` (no ``[E, E]``
  tensor) against the dense backend (``build_attention_mask`` + ``sdpa_dense``, the mask built
  inside the timed call); time (median of ``--attn-repeats``, alternating) and peak resident
  memory above the start; outputs and gradients checked equal (max abs difference printed).
  speculators' own attention is flex_attention, which has no backward on CPU, so the dense
  backend is the anchor here; the training-memory table is ``bench/bench_train_memory.py``.
- ``store``: whole-block reads of a local bf16 store at SmolLM2 sizes (3 aux layers, H 576), full
  blocks of ``--store-blocks`` tokens, page cache warm: ``FeatureStore.read_blocks`` (the ``file``
  path, 4 blocks per request) and the zarr-API path against a plain read of the same chunk files'
  bytes into tensors of the same sizes (``open`` + ``readinto`` per file, paths prepared
  beforehand); whole passes over the store alternate, the least disturbed of ``--store-rounds``
  passes of each counts; the ratio is of throughputs (above 1: peagle faster).

Speculators is the released 0.9.0 wheel installed with ``--no-deps`` (``bench/speculators_ref.py``).
Run with one torch thread; a ratio below 1 means peagle is faster.

Usage (from the repository root, inside .venv):
    OMP_NUM_THREADS=1 python bench/bench_vs_speculators.py  # all paths; --paths cod,store for some
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import speculators_ref  # noqa: E402
from bench_train_memory import make_block  # noqa: E402

from peagle_train.data.cod import sample_cod_elements  # noqa: E402

K, R, R_MIN = 8, 0.7, 0.2


def alternate(fns: dict, repeats: int) -> dict:
    """Median seconds of each callable, calling them in turn ``repeats`` times."""
    return {k: statistics.median(v) for k, v in _rounds(fns, repeats).items()}


def _table(title: str, header: str) -> None:
    """Print a section title and a Markdown table header (``header`` is its first row)."""
    print(f"\n## {title}\n")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))


def bench_cod(tokens: list[int], repeats: int) -> None:
    spec_cod = speculators_ref.generate_cod_sample_indices()
    _table("COD sampling: sample_cod_elements vs speculators generate_cod_sample_indices",
           "| T | max_anchors | peagle ms | speculators ms | peagle / speculators | "
           "elements per depth 1..7, peagle | speculators |")
    for T in tokens:
        block = make_block(T)
        lm = block.loss_mask[None]
        for a in (None, 1024):
            gen = torch.Generator().manual_seed(0)
            torch.manual_seed(0)
            t = alternate({"peagle": lambda: sample_cod_elements(block.cu_seqlens, block.loss_mask, K, R, R_MIN,
                                                                 a, gen),
                           "spec": lambda: spec_cod(T, lm, K, R, R_MIN, True, a)}, repeats)
            ours = sample_cod_elements(block.cu_seqlens, block.loss_mask, K, R, R_MIN, a, gen).count_per_depth(K)
            theirs = torch.bincount(spec_cod(T, lm, K, R, R_MIN, True, a)[1], minlength=K).tolist()
            print(f"| {T} | {a} | {t['peagle'] * 1e3:.3f} | {t['spec'] * 1e3:.3f} | "
                  f"**{t['peagle'] / t['spec']:.2f}** | {ours[1:]} | {theirs[1:]} |", flush=True)


def _peak_above_start_mib(fn) -> float:
    """Peak resident memory (MiB) of ``fn()`` above the resident memory when it starts."""
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith(key)) / 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current VmRSS
    start = status("VmRSS:")
    fn()
    return status("VmHWM:") - start


def _element_cases(tokens: list[int]):
    """``(T, max_anchors, block, elements)`` for every T, uncapped and capped at 1024 (seed 0)."""
    for T in tokens:
        block = make_block(T)
        for a in (None, 1024):
            yield T, a, block, sample_cod_elements(block.cu_seqlens, block.loss_mask, K, R, R_MIN, a,
                                                   torch.Generator().manual_seed(0))


def bench_blockmask(tokens: list[int], repeats: int) -> None:
    from torch.nn.attention.flex_attention import create_block_mask

    from peagle_train.model.element_mask import block_mask_from_elements
    from peagle_train.data.cod import segment_ids

    spec_mod = speculators_ref.create_peagle_mask_mod()
    _table("flex BlockMask: block_mask_from_elements vs create_block_mask(speculators' mask_mod)",
           "| T | max_anchors | elements | peagle ms | create_block_mask ms | time ratio | peagle peak MiB | "
           "create_block_mask peak MiB | memory ratio | identical |")
    for T, a, block, el in _element_cases(tokens):
        E = len(el)
        mod = spec_mod(el.anchor, el.depth, segment_ids(block.cu_seqlens))
        ours = lambda: block_mask_from_elements(el)  # noqa: E731
        theirs = lambda: create_block_mask(mod, None, None, E, E, device="cpu")  # noqa: E731
        same = all(torch.equal(x, y) for x, y in zip(ours().as_tuple()[2:10], theirs().as_tuple()[2:10]))
        mem = {"ours": _peak_above_start_mib(ours), "theirs": _peak_above_start_mib(theirs)}
        t = alternate({"ours": ours, "theirs": theirs}, repeats)
        print(f"| {T} | {a} | {E} | {t['ours'] * 1e3:.1f} | {t['theirs'] * 1e3:.0f} | "
              f"**{t['ours'] / t['theirs']:.4f}** | {mem['ours']:.1f} | {mem['theirs']:.0f} | "
              f"**{max(mem['ours'], 0.1) / mem['theirs']:.4f}** | {same} |", flush=True)


def bench_attention(tokens: list[int], repeats: int) -> None:
    from peagle_train.model.attention import SplitElementAttention
    from peagle_train.model.element_mask import build_attention_mask
    from peagle_train.model.attention import sdpa_dense

    _table("Attention forward + backward: split (no [E, E] tensor) vs dense mask + SDPA",
           "| T | max_anchors | elements | split s | dense s | time ratio | split peak MiB | dense peak MiB | "
           "memory ratio | max abs diff |")
    for T, a, block, el in _element_cases(tokens):
        E = len(el)
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(n, E, 64, generator=g).requires_grad_() for n in (9, 3, 3))
        w = torch.randn(9, E, 64, generator=g)

        def split():
            out = SplitElementAttention(el).attend(q, k, v)
            return (out,) + torch.autograd.grad((out * w).sum(), (q, k, v))

        def dense():
            out = sdpa_dense(q, k.repeat_interleave(3, 0), v.repeat_interleave(3, 0), build_attention_mask(el))
            return (out,) + torch.autograd.grad((out * w).sum(), (q, k, v))

        diff = max(float((x - y).detach().abs().max()) for x, y in zip(split(), dense()))
        mem = {"split": _peak_above_start_mib(split), "dense": _peak_above_start_mib(dense)}
        t = alternate({"split": split, "dense": dense}, repeats)
        print(f"| {T} | {a} | {E} | {t['split']:.2f} | {t['dense']:.2f} | **{t['split'] / t['dense']:.2f}** | "
              f"{mem['split']:.0f} | {mem['dense']:.0f} | **{mem['split'] / max(mem['dense'], 1):.3f}** | "
              f"{diff:.1e} |", flush=True)


def _make_store(path: Path, C: int, n_blocks: int):
    import numpy as np

    from stores.features.feature_store import FeatureStore

    store = FeatureStore.create(path, n_blocks=n_blocks, block_size=C, max_segments=4, layers=[2, 15, 27],
                                hidden_size=576, vocab_size=49152, verifier={"name_or_path": "bench"}, force=True)
    g = torch.Generator().manual_seed(0)
    store.write_all_n_tokens(np.full(n_blocks, C))
    for i in range(n_blocks):
        store.write_tokens(i, torch.randint(0, 49152, (C,), generator=g).tolist(), [1] * C,
                           list(range(C)), [0, C])
        store.write_features(i, torch.randn(C, 3, 576, generator=g).to(torch.bfloat16),
                             torch.randn(C, 576, generator=g).to(torch.bfloat16))
        store.mark_done(i)
    return FeatureStore.open(path)


def _plain_reader(store, i: int):
    """A plain read of block i's chunk files (the payload bytes) into fresh tensors of the same sizes."""
    import numpy as np

    C, T = store.block_size, store.block_size
    files = [(store.chunk_path(n, i), T * k) for n, k in (("input_ids", 4), ("loss_mask", 1),
                                                           ("position_ids", 4))]
    files += [(store.chunk_path("cu_seqlens", i), 4 * (int(store.attrs["max_segments"]) + 1)),
              (store.chunk_path("aux_hidden", i), T * 3 * 576 * 2), (store.chunk_path("final_hidden", i), T * 576 * 2)]
    files = [(str(p), n) for p, n in files]

    def read():
        out = []
        for path, n in files:
            a = np.empty(n, dtype=np.uint8)  # allocated as the store reader allocates its tensors
            with open(path, "rb", buffering=0) as f:
                f.readinto(a)
            out.append(torch.from_numpy(a))
        return out
    return read


def bench_store(block_sizes: list[int], mib: int, rounds: int) -> None:
    import tempfile

    _table("Store reads: FeatureStore.read_blocks vs a plain read of the same bytes",
           "| block tokens | blocks | MiB | plain MiB/s | file path MiB/s | file / plain | zarr API MiB/s | zarr / plain |")
    for C in block_sizes:
        n = max(4, mib * 2 ** 20 // (C * (3 * 576 * 2 + 576 * 2 + 9)))
        with tempfile.TemporaryDirectory(prefix="peagle-bench-store-") as tmp:
            store = _make_store(Path(tmp) / "s.zarr", C, n)
            plain = [_plain_reader(store, i) for i in range(n)]
            batches = [list(range(i, min(i + 4, n))) for i in range(0, n, 4)]  # 4 blocks per request
            passes = {"plain": lambda: [[plain[j]() for j in ids] for ids in batches],
                      "file": lambda: [store.read_blocks(ids, via="file") for ids in batches]}
            zarr_pass = {"zarr": lambda: [store.read_blocks(ids, via="zarr") for ids in batches]}
            for f in passes.values():  # warm the page cache and the allocator
                f()
            best = {k: min(v) for k, v in _rounds(passes, rounds).items()}  # least disturbed pass
            best["zarr"] = min(_rounds(zarr_pass, max(1, rounds // 3))["zarr"])  # after: its frees change the heap
            mb = n * C * (3 * 576 * 2 + 576 * 2 + 9) / 2 ** 20
            rate = {k: mb / v for k, v in best.items()}
            print(f"| {C} | {n} | {mb:.0f} | {rate['plain']:.0f} | {rate['file']:.0f} | "
                  f"**{rate['file'] / rate['plain']:.2f}** | {rate['zarr']:.0f} | {rate['zarr'] / rate['plain']:.2f} |",
                  flush=True)


def _rounds(fns: dict, rounds: int) -> dict:
    """Seconds of each callable in each of ``rounds`` rounds (callables alternate within a round)."""
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", default="cod,blockmask,attention,store")
    ap.add_argument("--tokens", default="2048,8192,32768")
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--mask-tokens", default="2048,8192", help="T values for --paths blockmask")
    ap.add_argument("--mask-repeats", type=int, default=3)
    ap.add_argument("--attn-tokens", default="2048,8192", help="T values for --paths attention")
    ap.add_argument("--attn-repeats", type=int, default=3)
    ap.add_argument("--store-blocks", default="512,1024,2048", help="block sizes (tokens) for --paths store")
    ap.add_argument("--store-mib", type=int, default=96, help="MiB of blocks per store size")
    ap.add_argument("--store-rounds", type=int, default=40, help="passes over the store per reader (best kept)")
    args = ap.parse_args()
    paths = args.paths.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, speculators {speculators_ref.VERSION}")
    if "cod" in paths:
        bench_cod(tokens, args.repeats)
    if "blockmask" in paths:
        bench_blockmask([int(t) for t in args.mask_tokens.split(",")], args.mask_repeats)
    if "attention" in paths:
        bench_attention([int(t) for t in args.attn_tokens.split(",")], args.attn_repeats)
    if "store" in paths:
        bench_store([int(c) for c in args.store_blocks.split(",")], args.store_mib, args.store_rounds)


if __name__ == "__main__":
    main()
