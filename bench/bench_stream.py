"""Streaming (``peagle-train --extract-from --max-store-bytes``) against offline (extract, then train), on the
demo data or another packed table, such as the quality recipe's (issue 31).

Packs ``--conversations`` ShareGPT conversations as ``scripts/demo.sh`` does (``--max-seq-len 512 --max-windows 1``,
SmolLM2-135M's tokenizer), or, with ``--packed DIR``, takes that packed table's first ``--max-blocks`` blocks (a
copy under ``--work``: the table itself is only read), then, each as the commands a user runs (separate processes):

- offline: ``peagle-data extract --context window`` (timed, its store's size measured), then ``peagle-train`` for
  each of ``--epochs`` epochs (``--max-steps`` = epochs × one epoch's steps);
- streaming: ``peagle-train --extract-from ... --max-store-bytes B`` for each policy and epoch count, B the bytes
  of the offline store without its features plus ``--window-blocks`` + the validation blocks (so the store holds
  a window of that many training blocks).

Measured per run: wall time; time to the first optimizer step (the first line of ``metrics.jsonl``, polled every
0.05 s; offline: the extraction's wall plus the training's own); the peak bytes of the store directory (the sum
of its files' lengths, sampled every 0.05 s by this script, and by the extraction before each write); tokens
extracted (the extraction's ``verifier_tokens_this_run``) against the offline extraction's; whether the final weights
equal the offline run's, bit for bit.

Usage (from the repository root, inside .venv):
    python bench/bench_stream.py --work /tmp/bench_stream --conversations 40 > stream.json
    python bench/bench_stream.py --work /tmp/bench_stream_q --packed quality/packed --max-blocks 24 > stream_q.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from safetensors.numpy import load_file

from stores.feature_store import FeatureStore
from stores.stream_plan import apparent_bytes, block_feature_bytes
from stores.token_tables import TableWriter, TokenTable, write_manifest

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["--draft-vocab-size", "4096", "--num-depths", "4", "--lr", "1e-3", "--seed", "0"]


def log(msg: str) -> None:
    print(f"bench_stream: {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], watch_store: Path | None = None, metrics: Path | None = None) -> dict:
    """Run ``cmd`` (a peagle command, ``python -m ...``); sample the store's bytes and the first metrics line."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.monotonic()
    peak, first = [0], [None]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            if watch_store is not None and watch_store.exists():
                peak[0] = max(peak[0], apparent_bytes(watch_store))
            if metrics is not None and first[0] is None and metrics.is_file() and metrics.stat().st_size > 0:
                first[0] = time.monotonic() - t0
            time.sleep(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    res = subprocess.run([sys.executable, "-m", *cmd], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    done.set()
    thread.join()
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    out = res.stdout[res.stdout.index("{"):] if "{" in res.stdout else "{}"
    return {"wall_s": round(wall, 2), "first_step_s": None if first[0] is None else round(first[0], 2),
            "peak_store_bytes_sampled": peak[0], "summary": json.loads(out)}


def copy_packed(source: Path, dest: Path, max_blocks: int) -> int:
    """Write the first ``max_blocks`` blocks (rows) of the packed table ``source`` as a packed table ``dest``
    (every column as it is, the manifest with ``subset_of``); returns the blocks copied."""
    table = TokenTable.open(source)
    if table.kind != "packed":
        raise SystemExit(f"--packed {source}: a {table.kind} table, expected a packed one (peagle-data pack)")
    n = 0
    dest.mkdir(parents=True, exist_ok=True)
    with TableWriter(dest, "packed") as w:
        for row in table.iter_rows():
            if n == max_blocks:
                break
            w.write(row)
            n += 1
    write_manifest(dest, {**table.manifest, "subset_of": {"path": str(source), "first_blocks": n}})
    return n


def same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(str(a / "final" / "model.safetensors")), load_file(str(b / "final" / "model.safetensors"))
    return sorted(x) == sorted(y) and all(x[k].tobytes() == y[k].tobytes() for k in x)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--conversations", type=int, default=40)
    ap.add_argument("--epochs", default="1,2")
    ap.add_argument("--policies", default="reextract,keep")
    ap.add_argument("--window-blocks", type=int, default=8)
    ap.add_argument("--packed", type=Path, help="a packed table to take blocks from instead of packing ShareGPT "
                    "(read only; its first --max-blocks blocks are copied under --work)")
    ap.add_argument("--max-blocks", type=int, default=None, help="with --packed: blocks to take (default: all)")
    args = ap.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    epochs = [int(e) for e in args.epochs.split(",")]
    packed = work / "packed"
    if args.packed is not None:
        n = copy_packed(args.packed.resolve(), packed, args.max_blocks if args.max_blocks is not None else 2 ** 62)
        log(f"{n} blocks of {args.packed} copied to {packed}")
    else:
        log(f"pack {args.conversations} conversations")
        run(["cli.data", "pack", "sharegpt", "--tokenizer", "smollm2-135m", "--output", str(packed), "--limit",
             str(args.conversations), "--max-seq-len", "512", "--max-windows", "1", "--force"])

    offline_store = work / "offline.zarr"
    log("offline extraction")
    ext = run(["cli.data", "extract", str(packed), "--verifier", "smollm2-135m", "--output", str(offline_store),
               "--context", "window", "--device", "cpu", "--force"], watch_store=offline_store)
    store = FeatureStore.open(offline_store)
    offline_bytes = apparent_bytes(offline_store)
    block = block_feature_bytes(store.block_size, len(store.layers), store.hidden_size, store.storage_dtype)
    fixed = offline_bytes - store.n_blocks * block
    report = {"packed": str(args.packed) if args.packed else f"sharegpt, {args.conversations} conversations",
              "load_average_start": os.getloadavg(), "n_blocks": store.n_blocks, "block_size": store.block_size,
              "n_tokens": store.n_tokens, "block_feature_bytes": block, "offline_store_bytes": offline_bytes,
              "offline_extract": {"wall_s": ext["wall_s"], "tokens": ext["summary"]["verifier_tokens_this_run"]},
              "runs": []}

    per_epoch = None
    for e in epochs:
        out = work / f"offline-{e}ep"
        log(f"offline training, {e} epoch(s)")
        steps = [] if per_epoch is None else ["--max-steps", str(per_epoch * e)]
        r = run(["cli.train", "--store", str(offline_store), "--output", str(out), "--verifier", "smollm2-135m",
                 *TRAIN, *steps, "--force"], metrics=out / "metrics.jsonl")
        if per_epoch is None:
            per_epoch = int(r["summary"]["steps"]) // e
        n_val = int(r["summary"]["val_blocks"])
        report["runs"].append({"mode": "offline", "epochs": e, "steps": r["summary"]["steps"],
                               "train_wall_s": r["wall_s"], "wall_s": round(ext["wall_s"] + r["wall_s"], 2),
                               "first_step_s": round(ext["wall_s"] + r["first_step_s"], 2),
                               "peak_store_bytes": offline_bytes, "tokens_extracted": ext["summary"]["verifier_tokens_this_run"],
                               "load_average_end": os.getloadavg()})
        (work / "report.json").write_text(json.dumps(report, indent=2))
    budget = fixed + 8 * per_epoch * max(epochs) + 8192 + (min(16, n_val) + args.window_blocks) * block
    report["budget_bytes"] = budget
    report["window_blocks"] = args.window_blocks
    for policy in args.policies.split(","):
        for e in epochs:
            out, st = work / f"stream-{policy}-{e}ep", work / f"stream-{policy}-{e}ep.zarr"
            size = budget if policy == "reextract" else offline_bytes + 8 * per_epoch * e + 8192
            log(f"streaming, policy {policy}, {e} epoch(s), budget {size:,} bytes")
            r = run(["cli.train", "--store", str(st), "--output", str(out), "--verifier", "smollm2-135m", *TRAIN,
                     "--max-steps", str(per_epoch * e), "--extract-from", str(packed), "--max-store-bytes", str(size),
                     "--epoch-policy", policy, "--device", "cpu", "--force"], watch_store=st,
                    metrics=out / "metrics.jsonl")
            text = Path(r["summary"]["extraction_log"]).read_text()
            ext_summary = json.loads(text[text.rindex('{\n  "store"'):]) if '{\n  "store"' in text else {}
            report["runs"].append({
                "mode": "stream", "policy": policy, "epochs": e, "steps": r["summary"]["steps"],
                "budget_bytes": size, "wall_s": r["wall_s"], "first_step_s": r["first_step_s"],
                "peak_store_bytes": r["peak_store_bytes_sampled"],
                "peak_store_bytes_extraction": ext_summary.get("stream", {}).get("peak_store_bytes"),
                "tokens_extracted": ext_summary.get("verifier_tokens_this_run"),
                "tokens_extracted_per_epoch_vs_offline": round(ext_summary.get("verifier_tokens_this_run", 0) / e
                                                               / report["offline_extract"]["tokens"], 3),
                "extractions": ext_summary.get("stream", {}).get("extractions"),
                "extraction_waits": ext_summary.get("stream", {}).get("waits"),
                "extraction_wait_s": ext_summary.get("stream", {}).get("wait_s"),
                "train_read_wait_s": r["summary"].get("stream", {}).get("read_wait_s"),
                "weights_equal_offline": same_weights(out, work / f"offline-{e}ep")})
            report["runs"][-1]["load_average_end"] = os.getloadavg()
            (work / "report.json").write_text(json.dumps(report, indent=2))  # kept if a later run is cut short
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
