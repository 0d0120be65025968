"""A/B of the verifier forward of extraction: this checkout's ``verifier_features`` against another
checkout's (e.g. main before a change), interleaved block by block in one process.

Both functions run the same blocks of a packed table on the same loaded verifier, alternating which
goes first, so machine load hits both alike; the ratio of the medians of per-block seconds is
printed (``new / old``: 1.00 = unchanged, < 1 faster).

Usage (from the repository root, inside .venv; OLD is a directory holding the other checkout):
    git worktree add /tmp/peagle-old <commit>   # or: git archive <commit> | tar -x -C /tmp/peagle-old
    python bench/bench_extract_ab.py --packed demo/packed --old /tmp/peagle-old --blocks 12 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from peagle_data.extract.hf_forward import default_layers, language_model, verifier_features
from runtime.model_cache import load_verifier
from stores.tables.token_tables import TokenTable


def _load_old(old: Path):
    # the forward's module: peagle_data/extract/hf_forward.py since the stage folders, extract.py before
    path = next((p for p in (old / "peagle_data" / "extract" / "hf_forward.py", old / "peagle_data" / "extract.py")
                 if p.is_file()), None)
    if path is None:
        raise SystemExit(f"--old {old}: neither peagle_data/extract/hf_forward.py nor peagle_data/extract.py")
    spec = importlib.util.spec_from_file_location("old_extract", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_extract"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.verifier_features


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--packed", required=True, type=Path)
    ap.add_argument("--old", required=True, type=Path, help="directory of the other checkout")
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    old_features = _load_old(args.old)
    verifier = load_verifier(args.verifier, device="cpu", attn_implementation="sdpa")
    decoder = language_model(verifier)
    layers = default_layers(len(decoder.layers))
    rows = []
    for i, r in enumerate(TokenTable.open(args.packed).iter_rows(["input_ids", "position_ids", "cu_seqlens"])):
        if i == args.blocks:
            break
        rows.append([torch.tensor(r[k], dtype=torch.long) for k in ("input_ids", "position_ids", "cu_seqlens")])
    times = {"old": [], "new": []}
    fns = {"old": old_features, "new": verifier_features}
    verifier_features(decoder, *rows[0], layers)  # warm-up
    for rnd in range(args.rounds):
        for i, row in enumerate(rows):
            order = ("old", "new") if (i + rnd) % 2 == 0 else ("new", "old")
            outs = {}
            for name in order:
                t0 = time.perf_counter()
                outs[name] = fns[name](decoder, *row, layers)
                times[name].append(time.perf_counter() - t0)
            same = torch.equal(outs["old"][0], outs["new"][0]) and torch.equal(outs["old"][1], outs["new"][1])
            assert same, f"block {i}: the two checkouts store different features"
    tokens = sum(int(r[0].numel()) for r in rows)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({"blocks": len(rows), "tokens_per_block": tokens / len(rows), "rounds": args.rounds,
                      "median_s_per_block": {k: round(v, 4) for k, v in med.items()},
                      "tokens_per_s": {k: round(tokens / len(rows) / v, 1) for k, v in med.items()},
                      "total_s": {k: round(sum(v), 2) for k, v in times.items()},
                      "new_over_old": round(med["new"] / med["old"], 3),
                      "features_identical": True}, indent=2))


if __name__ == "__main__":
    main()
