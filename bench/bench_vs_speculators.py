"""peagle against its anchors on the hot paths of training data, each ratio from one run.

Paths (``--paths``, comma-separated):
- ``cod``: ``sample_cod_elements`` against speculators' ``generate_cod_sample_indices`` on the same
  synthetic rows (segments of 2048 tokens, 70% supervised, K = 8, r = 0.7, r_min = 0.2), with
  ``max_anchors`` unset and 1024; the calls alternate, the ratio is of the medians. Also the
  elements per depth of both (row-level counts: equal where the pool is not the limit).

Speculators is the released 0.9.0 wheel installed with ``--no-deps`` (``bench/speculators_ref.py``).
Run with one torch thread; a ratio below 1 means peagle is faster.

Usage (from the repository root, inside .venv):
    OMP_NUM_THREADS=1 python bench/bench_vs_speculators.py --paths cod
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

from peagle_train.cod import sample_cod_elements  # noqa: E402

K, R, R_MIN = 8, 0.7, 0.2


def alternate(fns: dict, repeats: int) -> dict:
    """Median seconds of each callable, calling them in turn ``repeats`` times."""
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def bench_cod(tokens: list[int], repeats: int) -> None:
    spec_cod = speculators_ref.generate_cod_sample_indices()
    print("\n## COD sampling: sample_cod_elements vs speculators generate_cod_sample_indices\n")
    print("| T | max_anchors | peagle ms | speculators ms | peagle / speculators | "
          "elements per depth 1..7, peagle | speculators |")
    print("|---|---|---|---|---|---|---|")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--paths", default="cod")
    ap.add_argument("--tokens", default="2048,8192,32768")
    ap.add_argument("--repeats", type=int, default=31)
    args = ap.parse_args()
    paths = args.paths.split(",")
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, speculators {speculators_ref.VERSION}")
    if "cod" in paths:
        bench_cod(tokens, args.repeats)


if __name__ == "__main__":
    main()
