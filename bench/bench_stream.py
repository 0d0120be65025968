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

``--context full`` does the same with full-context stores (``extract --context full --context-packing
training_blocks``, as the streaming runs' ``--context full`` extraction groups the conversations by default, so that
the weights can be compared): the units extracted and evicted are then context blocks, and ``--window-blocks``
counts context blocks beside those of the validation blocks. ``--context-packing best_fit`` (plan-only) shows what
a store grouped as ``extract`` does by default would cost a streaming run.

``--plan-only`` (either context) measures no run: it makes the store's token arrays and views (``extract
--max-blocks 1``: one block's forward), then, for each window of ``--plan-windows`` units and each epoch count,
the stream plan a ``peagle-train --max-store-bytes`` run makes (the same split, order and rules:
``make_plan``), and reports its planned extraction tokens (``planned_tokens``: each unit's tokens times the
times the plan extracts it, when the extraction runs as far ahead as the window lets it) against the offline
extraction's (every unit once). ``--max-windows`` sets ``pack --max-windows`` (the demo's 1; 0 keeps every
window, so long conversations are read by several training blocks).

Usage (from the repository root, inside .venv):
    python bench/bench_stream.py --work /tmp/bench_stream --conversations 40 > stream.json
    python bench/bench_stream.py --work /tmp/bench_full --context full --policies reextract --epochs 1,2
    python bench/bench_stream.py --work /tmp/plan_full --context full --plan-only --max-windows 0
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

from peagle_train.data.loader import BlockSequence
from peagle_train.data.multistore import conversation_groups
from peagle_train.data.split import split_store
from peagle_train.data.stream import make_plan, planned_tokens
from stores.errors import InputError
from stores.features.feature_store import FeatureStore
from stores.stream.plan import apparent_bytes, block_feature_bytes, unit_store
from stores.stream.session import StreamSession
from stores.tables.token_tables import TableWriter, TokenTable, write_manifest

REPO = Path(__file__).resolve().parents[1]
TRAIN = ["--draft-vocab-size", "4096", "--num-depths", "4", "--lr", "1e-3", "--seed", "0"]
SEED, VAL_FRACTION, VAL_MAX_BLOCKS = 0, 0.05, 16
"""The runs' seed and peagle-train's validation defaults (the plan-only figures use them)."""


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


def validation_units(store: FeatureStore) -> int:
    """The units the scored validation blocks of a run with the bench's seed and validation defaults read."""
    train_side, val_side = split_store(store, SEED, VAL_FRACTION)
    plan = make_plan(store, BlockSequence(train_side, train_side, SEED), val_side, max_steps=1, blocks_per_step=1,
                     val_max_blocks=VAL_MAX_BLOCKS, max_store_bytes=10 ** 15, policy="reextract",
                     run={"output": "bench"})
    return len(plan.val_units)


def plan_figures(store_path: Path, windows: list[int], epochs: list[int], policies: list[str],
                 epoch_order: str = "blocks") -> dict:
    """The stream plans of runs on ``store_path`` (token arrays and views written; features not needed) for a
    budget of each window of ``windows`` units beside the validation blocks' and each epoch count, the epochs
    ordered by ``epoch_order`` (``--epoch-order``): the window in entries, the planned extraction tokens, and
    per epoch against the offline extraction's."""
    store = FeatureStore.open(store_path)
    units = unit_store(store)
    offline_tokens = int(units.n_tokens_per_block().sum())
    unit_bytes = block_feature_bytes(units.block_size, len(store.layers), store.hidden_size, store.storage_dtype)
    train_side, val_side = split_store(store, SEED, VAL_FRACTION)
    groups = conversation_groups(store) if epoch_order == "conversations" else None
    sequence = BlockSequence(train_side, train_side, SEED, str(store_path), block_group=groups)
    per_epoch = len(train_side)
    out = {"epoch_order": epoch_order, "units": "context_blocks" if store.has_views else "blocks", "n_units": units.n_blocks,
           "unit_bytes": unit_bytes, "training_blocks": store.n_blocks, "train_side": per_epoch,
           "offline_tokens": offline_tokens, "feature_bytes_all_units": units.n_blocks * unit_bytes, "plans": []}
    for policy in policies:
        for e in epochs:
            for w in windows if policy == "reextract" else [units.n_blocks]:
                def plan_for(budget):
                    return make_plan(store, sequence, val_side, max_steps=per_epoch * e, blocks_per_step=1,
                                     val_max_blocks=VAL_MAX_BLOCKS, max_store_bytes=budget, policy=policy,
                                     run={"output": "bench", "epoch_order": epoch_order})
                probe = plan_for(10 ** 15)  # the fixed bytes and the validation units of this run
                budget = probe.fixed_bytes + (len(probe.val_units) + w) * unit_bytes
                try:
                    plan = plan_for(budget)
                except InputError as err:  # a window smaller than one step's units
                    out["plans"].append({"policy": policy, "epochs": e, "window_units": w, "refused": str(err)})
                    continue
                tokens = planned_tokens(StreamSession(store), plan)
                val_tokens = sum(int(units.n_tokens_of(u)) for u in plan.val_units)
                out["plans"].append({
                    "policy": policy, "epochs": e, "window_units": w, "budget_bytes": budget,
                    "window_entries": plan.window, "planned_extractions": plan.extractions(),
                    "planned_tokens": tokens,
                    "tokens_per_epoch_vs_offline": round((tokens - val_tokens) / e / (offline_tokens - val_tokens), 4)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--conversations", type=int, default=40)
    ap.add_argument("--epochs", default="1,2")
    ap.add_argument("--policies", default="reextract,keep")
    ap.add_argument("--window-blocks", type=int, default=8)
    ap.add_argument("--context", choices=["window", "full"], default="window")
    ap.add_argument("--max-windows", type=int, default=1, help="pack --max-windows (0: every window)")
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--plan-windows", default="2,4,8,16")
    ap.add_argument("--context-packing", choices=["training_blocks", "best_fit"], default="training_blocks")
    ap.add_argument("--epoch-order", choices=["blocks", "conversations"], default="blocks",
                    help="peagle-train --epoch-order of every run (offline and streaming)")
    ap.add_argument("--verifier", default="smollm2-135m",
                    help="the verifier (plan-only: any model of SmolLM2's tokenizer and max_position_embeddings plans "
                         "the same contexts, e.g. a tiny random one, which runs its one block at once)")
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
        windows = ["--max-windows", str(args.max_windows)] if args.max_windows else []
        run(["cli.data", "pack", "sharegpt", "--tokenizer", "smollm2-135m", "--output", str(packed), "--limit",
             str(args.conversations), "--max-seq-len", "512", *windows, "--force"])

    offline_store = work / "offline.zarr"
    log("offline extraction" + (" (token arrays and views only: --max-blocks 1)" if args.plan_only else ""))
    ext = run(["cli.data", "extract", str(packed), "--verifier", args.verifier, "--output", str(offline_store),
               "--context", args.context, "--device", "cpu", "--force",
               *(["--context-packing", args.context_packing] if args.context == "full" else []),
               *(["--max-blocks", "1"] if args.plan_only else [])], watch_store=offline_store)
    if args.plan_only:
        report = {"conversations": args.conversations, "context": args.context, "max_windows": args.max_windows,
                  "context_packing": args.context_packing if args.context == "full" else None,
                  **plan_figures(offline_store, [int(w) for w in args.plan_windows.split(",")], epochs,
                                 args.policies.split(","), args.epoch_order)}
        print(json.dumps(report, indent=2))
        return
    store = FeatureStore.open(offline_store)
    units = unit_store(store)
    offline_bytes = apparent_bytes(offline_store)
    block = block_feature_bytes(units.block_size, len(store.layers), store.hidden_size, store.storage_dtype)
    fixed = offline_bytes - units.n_blocks * block
    report = {"packed": str(args.packed) if args.packed else f"sharegpt, {args.conversations} conversations",
              "load_average_start": os.getloadavg(), "context": args.context, "n_blocks": store.n_blocks,
              "block_size": store.block_size, "n_tokens": store.n_tokens,
              "units": "context_blocks" if store.has_views else "blocks", "n_units": units.n_blocks,
              "unit_tokens": units.n_tokens, "block_feature_bytes": block, "offline_store_bytes": offline_bytes,
              "offline_extract": {"wall_s": ext["wall_s"], "tokens": ext["summary"]["verifier_tokens_this_run"]},
              "runs": []}

    per_epoch = None
    for e in epochs:
        out = work / f"offline-{e}ep"
        log(f"offline training, {e} epoch(s)")
        steps = [] if per_epoch is None else ["--max-steps", str(per_epoch * e)]
        r = run(["cli.train", "--store", str(offline_store), "--output", str(out), "--verifier", "smollm2-135m",
                 *TRAIN, "--epoch-order", args.epoch_order, *steps, "--force"], metrics=out / "metrics.jsonl")
        if per_epoch is None:
            per_epoch = int(r["summary"]["steps"]) // e
        report["runs"].append({"mode": "offline", "epochs": e, "steps": r["summary"]["steps"],
                               "train_wall_s": r["wall_s"], "wall_s": round(ext["wall_s"] + r["wall_s"], 2),
                               "first_step_s": round(ext["wall_s"] + r["first_step_s"], 2),
                               "peak_store_bytes": offline_bytes, "tokens_extracted": ext["summary"]["verifier_tokens_this_run"],
                               "load_average_end": os.getloadavg()})
        (work / "report.json").write_text(json.dumps(report, indent=2))
    val_units = validation_units(store)  # with --context window, the validation blocks themselves
    budget = fixed + 8 * per_epoch * max(epochs) + 8192 + (val_units + args.window_blocks) * block
    report["budget_bytes"] = budget
    report["window_blocks"] = args.window_blocks
    for policy in args.policies.split(","):
        for e in epochs:
            out, st = work / f"stream-{policy}-{e}ep", work / f"stream-{policy}-{e}ep.zarr"
            size = budget if policy == "reextract" else offline_bytes + 8 * per_epoch * e + 8192
            log(f"streaming, policy {policy}, {e} epoch(s), budget {size:,} bytes")
            r = run(["cli.train", "--store", str(st), "--output", str(out), "--verifier", "smollm2-135m", *TRAIN,
                     "--epoch-order", args.epoch_order, "--max-steps", str(per_epoch * e), "--extract-from", str(packed), "--max-store-bytes", str(size),
                     "--epoch-policy", policy, "--context", args.context, "--device", "cpu", "--force"],
                    watch_store=st, metrics=out / "metrics.jsonl")
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
                "planned_extraction_tokens": r["summary"].get("stream", {}).get("planned_extraction_tokens"),
                "extraction_waits": ext_summary.get("stream", {}).get("waits"),
                "extraction_wait_s": ext_summary.get("stream", {}).get("wait_s"),
                "train_read_wait_s": r["summary"].get("stream", {}).get("read_wait_s"),
                "weights_equal_offline": same_weights(out, work / f"offline-{e}ep")})
            report["runs"][-1]["load_average_end"] = os.getloadavg()
            (work / "report.json").write_text(json.dumps(report, indent=2))  # kept if a later run is cut short
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
