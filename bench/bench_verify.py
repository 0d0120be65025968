"""Store verification speed (``peagle-data verify``, and the check ``extract --resume`` runs first),
against a baseline measured in the same run.

- ``verify``: :func:`stores.features.feature_repair.verify_store` as shipped: each raw chunk file read once,
  its crc32c computed with google_crc32c, NaN/Inf found from the bf16 exponent bits.
- ``zarr baseline``: the same checks the straightforward way: every chunk of every done block read
  through the zarr API (which verifies the checksum), then the block read again and
  ``torch.isfinite`` on its float32 copy.

Both read from the page cache (one untimed warm-up pass first).

Usage (from the repository root, inside .venv):
    python bench/bench_verify.py --store demo/features.zarr --repeat 3
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from stores.features.feature_repair import verify_store
from stores.features.feature_store import FeatureStore


def zarr_baseline(path: str) -> bool:
    """Every done block through the zarr API, then ``torch.isfinite`` on float copies; True if all pass."""
    store = FeatureStore.open(path)
    arrays = {name: store.group[name] for name in store.block_arrays()}
    ok = True
    for i in np.flatnonzero(store.done_mask()).tolist():
        for arr in arrays.values():
            arr[i]  # raises on a checksum mismatch
        block = store.read_block(i, via="zarr")
        ok &= bool(torch.isfinite(block.aux_hidden.float()).all() and torch.isfinite(block.final_hidden.float()).all())
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", required=True)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    store = FeatureStore.open(args.store)
    size = store.summary()["stored_bytes"]
    assert verify_store(args.store)["ok"] and zarr_baseline(args.store)  # warm-up, and both accept it
    times = {"verify": [], "zarr_baseline": []}
    for _ in range(args.repeat):
        for name, fn in (("verify", lambda: verify_store(args.store)), ("zarr_baseline", lambda: zarr_baseline(args.store))):
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in times.items()}
    print(json.dumps({"store": args.store, "blocks": store.n_blocks, "stored_MiB": round(size / 2**20, 1),
                      "seconds": {k: round(v, 3) for k, v in best.items()},
                      "MiB_per_s": {k: round(size / 2**20 / v) for k, v in best.items()},
                      "speedup": round(best["zarr_baseline"] / best["verify"], 2)}, indent=2))


if __name__ == "__main__":
    main()
