"""``extract --engine hf`` against ``--engine vllm`` in one run, on the same packed table.

For each engine, in a child process of its own (so peak memory is that engine's alone):
- ``run_extract`` into a store, split at the store's creation (logged right after the engine opened):
  start-up (weights load; for vLLM also its engine process and profiling) and extraction (features,
  store writes behind the writer thread, done flags): tokens/s of the latter; the store's bytes;
- peak resident memory of the child and every process it started (vLLM's engine core), sampled.
Then the two stores are compared: worst per-token relative difference per stored layer and final.

Threads: ``--threads 1`` pins torch (hf) and vLLM's OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND``) to
one core.

Usage (from the repository root, inside .venv-vllm; PYTHONPATH=$PWD):
    python bench/bench_extract_engines.py --packed demo/packed --verifier smollm2-135m --blocks 8 --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_extract import subset_table

REPO = Path(__file__).resolve().parents[1]


def child(args) -> dict:
    """One engine's ``run_extract`` of ``args.packed``: start-up, tokens/s, store bytes, peak memory."""
    import psutil
    import torch

    from peagle_data.extract.config import ExtractConfig
    from peagle_data.extract.run import run_extract

    me = psutil.Process()
    peak = [0]

    def sample():
        while True:
            rss = me.memory_info().rss + sum(c.memory_info().rss for c in me.children(recursive=True)
                                             if c.is_running())
            peak[0] = max(peak[0], rss)
            time.sleep(0.1)

    threading.Thread(target=sample, daemon=True).start()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ExtractConfig(packed=args.packed, verifier=args.verifier, output=args.output, layers=args.layers,
                        engine=args.engine, force=True, context="window",  # both engines on the same packed blocks
                        **({"device": "cpu"} if args.engine == "hf" else {}))
    stamps = []  # the store's creation is logged right after the engine is open
    t0 = time.perf_counter()
    summary = run_extract(cfg, progress=False, log=lambda m: stamps.append((time.perf_counter(), m)))
    end = time.perf_counter()
    opened = next(t for t, m in stamps if m.startswith("projected store size"))
    tokens = summary["verifier_tokens_this_run"]
    return {"engine": args.engine, "blocks": summary["training_blocks_done_this_run"], "tokens": tokens,
            "startup_s": round(opened - t0, 1), "extract_s": round(end - opened, 1),
            "tokens_per_s": round(tokens / (end - opened), 1), "store_bytes": summary["stored_bytes"],
            "peak_rss_gib": round(peak[0] / 2**30, 2)}


def compare(hf: str, vllm: str) -> dict:
    """Worst per-token relative difference ``|a - b| / |a|`` per stored layer and the final slot."""
    from stores.features.feature_store import FeatureStore

    a, b = FeatureStore.open(hf), FeatureStore.open(vllm)
    worst: dict[str, float] = {}
    for i in range(a.n_blocks):
        x, y = a.read_block(i), b.read_block(i)
        pairs = [(str(l), x.aux_hidden[:, k], y.aux_hidden[:, k]) for k, l in enumerate(a.layers)]
        for name, u, v in pairs + [("final", x.final_hidden, y.final_hidden)]:
            u, v = u.float(), v.float()
            d = float(((u - v).norm(dim=-1) / u.norm(dim=-1).clamp_min(1e-30)).max())
            worst[name] = max(worst.get(name, 0.0), d)
    return {k: float(f"{v:.2e}") for k, v in worst.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--packed", required=True)
    p.add_argument("--verifier", default="smollm2-135m")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--layers", type=lambda s: [int(x) for x in s.split(",")], default=None)
    p.add_argument("--threads", type=int, default=1, help="0: the libraries' defaults")
    p.add_argument("--engine", choices=["hf", "vllm"], help=argparse.SUPPRESS)
    p.add_argument("--output", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine:  # the child
        print("RESULT " + json.dumps(child(args)), flush=True)
        return
    work = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    packed = str(subset_table(Path(args.packed), args.blocks, work / "packed"))
    env = dict(os.environ, PYTHONPATH=str(REPO), VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), VLLM_CPU_OMP_THREADS_BIND=f"0-{args.threads - 1}")
    results = []
    try:
        for engine in ("hf", "vllm"):
            cmd = [sys.executable, __file__, "--packed", packed, "--verifier", args.verifier, "--blocks",
                   str(args.blocks), "--threads", str(args.threads), "--engine", engine,
                   "--output", str(work / f"{engine}.zarr"),
                   *(["--layers", ",".join(map(str, args.layers))] if args.layers else [])]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{engine} failed:\n{out.stderr[-3000:]}")
            results.append(json.loads(line[7:]))
            print(json.dumps(results[-1]), flush=True)
        report = {"runs": results, "worst_relative_difference": compare(str(work / "hf.zarr"), str(work / "vllm.zarr")),
                  "vllm_over_hf_tokens_per_s": round(results[1]["tokens_per_s"] / results[0]["tokens_per_s"], 2)}
        print(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
