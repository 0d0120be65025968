"""Disk figures of window-context and full-context feature stores (issue 21 "Disk"), from packed
tables alone: no verifier runs.

For each packed table (``peagle-data pack`` output with its ``conversations/`` sub-table) it reports,
per supervised token (the training blocks' ``loss_mask`` summed, the same tokens in both layouts):

- **window context** (``extract --context window``, format 1): the verifier runs every training
  block; tokens extracted = the packed tokens (``n_tokens`` summed); stored slots = blocks × block
  size (padding included); bytes = every array of :func:`stores.features.feature_schema.store_arrays` at the
  sizes ``extract`` gives the store.
- **full context** (``extract --context full --max-context X``, format 2): the plan of
  :func:`peagle_data.extract.contexts.plan_contexts` (the same function extraction calls); tokens
  extracted = the plan's ``tokens_extracted``; stored slots = context blocks × ``context_size``;
  bytes = :data:`stores.features.feature_schema.WINDOW_ARRAYS` of the training blocks (token arrays,
  ``cu_seqlens``, ``window_views``) + every array of the ``contexts`` sub-store.

Bytes are the arrays' payloads plus their crc32c (4 bytes per chunk) with uncompressed chunks, as
written on disk by a store whose blocks are all done; zarr.json metadata is left out.
(:func:`store_bytes` is checked against real stores' chunk files in tests/bench.)

Usage (from the repository root, inside .venv):
    OMP_NUM_THREADS=1 python bench/bench_context_disk.py PACKED_2048 PACKED_8192 \
        --verifier smollm2-135m --layers 2,15,27 [--max-context 8192,32768] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from peagle_data.extract.config import DEFAULT_MAX_CONTEXT
from peagle_data.extract.contexts import plan_contexts
from peagle_data.extract.run import PACKED_COLUMNS
from stores.features.feature_schema import WINDOW_ARRAYS, ArraySpec, bytes_per_token, dim_sizes, store_arrays
from runtime.model_config import load_model_config, text_config
from stores.tables.token_tables import TokenTable

WHERE = ["segment_ids", "segment_prefix_lens", "segment_starts"]
CRC_BYTES = 4


def store_bytes(specs: tuple[ArraySpec, ...], sizes: Mapping[str, int]) -> int:
    """Bytes on disk of ``specs`` at ``sizes`` (:func:`stores.features.feature_schema.dim_sizes`), every chunk
    written and uncompressed: payload + a crc32c per chunk (zarr.json files excluded)."""
    total = 0
    for spec in specs:
        shape = spec.shape(sizes)
        chunks = spec.chunks(sizes)
        n_chunks = math.prod(-(-n // c) for n, c in zip(shape, chunks)) if all(shape) else 0
        total += math.prod(shape) * np.dtype(spec.dtype).itemsize + CRC_BYTES * n_chunks
    return total


def window_figures(rows: list[Mapping[str, Any]], block_size: int, n_layers: int, hidden_size: int,
                   vocab_size: int, storage_dtype: str) -> dict[str, int]:
    """A window-context (format 1) store of ``rows``: sizes as ``extract`` makes them
    (``block_size`` = max(the table's, the longest block), ``max_segments`` = the most segments)."""
    C = max([block_size] + [int(r["n_tokens"]) for r in rows])
    S = max((len(r["cu_seqlens"]) - 1 for r in rows), default=1)
    sizes = dim_sizes(len(rows), C, S, n_layers, hidden_size, vocab_size)
    return {"tokens_extracted": int(sum(int(r["n_tokens"]) for r in rows)), "stored_slots": len(rows) * C,
            "blocks": len(rows), "block_size": C,
            "bytes": store_bytes(store_arrays(storage_dtype), sizes)}


def full_figures(plan, block_size: int, n_layers: int, hidden_size: int, vocab_size: int,
                 storage_dtype: str) -> dict[str, int]:
    """A full-context (format 2) store of ``plan`` (:class:`~peagle_data.extract.contexts.ContextPlan`)
    for a packed table of ``block_size``: the root's training-block arrays and the ``contexts``
    sub-store, sized as ``extract`` sizes them."""
    training = plan.training_rows
    C = max([block_size] + [int(r["n_tokens"]) for r in training])
    S = max((len(r["cu_seqlens"]) - 1 for r in training), default=1)
    S_ctx = max((len(r["cu_seqlens"]) - 1 for r in plan.rows), default=1)
    root = store_bytes(WINDOW_ARRAYS, dim_sizes(len(training), C, S, n_layers, hidden_size, vocab_size))
    contexts = store_bytes(store_arrays(storage_dtype), dim_sizes(len(plan.rows), plan.context_size, S_ctx, n_layers,
                                                                   hidden_size, vocab_size))
    return {"tokens_extracted": int(plan.counts["tokens_extracted"]),
            "stored_slots": len(plan.rows) * plan.context_size, "context_blocks": len(plan.rows),
            "context_size": plan.context_size, "conversations": int(plan.counts["conversations"]),
            "conversations_split": int(plan.counts["conversations_split"]), "root_bytes": root,
            "contexts_bytes": contexts, "bytes": root + contexts}


def read_table(packed: str) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], int]:
    """``(training rows, conversations by id, block_size)`` of a packed table, read as ``extract
    --context full`` reads them.

    Raises:
        SystemExit: a table without the conversations sub-table or the window columns.
    """
    table = TokenTable.open(packed)
    conversations = table.conversations()
    if conversations is None or not set(WHERE) <= set(table.columns()):
        raise SystemExit(f"{packed}: packed by an older peagle (no conversations sub-table / segment_starts): pack again")
    by_id = {r["conversation_id"]: r for r in conversations.iter_rows(["conversation_id", "input_ids", "loss_mask",
                                                                       "system_len"])}
    rows = list(table.iter_rows(PACKED_COLUMNS + WHERE))
    block_size = int(table.manifest.get("parameters", {}).get("block_size") or 0)
    return rows, by_id, block_size


def default_max_context(verifier: str) -> int:
    """``extract --context full``'s default ``--max-context``: the verifier's
    ``max_position_embeddings`` capped at :data:`~peagle_data.extract.config.DEFAULT_MAX_CONTEXT`."""
    limit = getattr(text_config(load_model_config(verifier)), "max_position_embeddings", None)
    return min(int(limit), DEFAULT_MAX_CONTEXT) if limit else DEFAULT_MAX_CONTEXT


def table_figures(packed: str, max_contexts: list[int], n_layers: int, hidden_size: int, vocab_size: int,
                  storage_dtype: str) -> dict[str, Any]:
    """Every figure of one packed table: ``supervised``, ``window`` and ``full[X]`` for each X."""
    rows, by_id, block_size = read_table(packed)
    supervised = int(sum(int(np.asarray(r["loss_mask"]).sum()) for r in rows))
    out: dict[str, Any] = {"packed": packed, "block_size": block_size, "supervised": supervised,
                           "longest_conversation": max(len(r["input_ids"]) for r in by_id.values()),
                           "window": window_figures(rows, block_size, n_layers, hidden_size, vocab_size,
                                                    storage_dtype), "full": {}}
    for X in max_contexts:
        t0 = time.perf_counter()
        plan = plan_contexts(rows, by_id, X, block_size, packed)
        out["full"][X] = {**full_figures(plan, block_size, n_layers, hidden_size, vocab_size, storage_dtype),
                          "plan_seconds": round(time.perf_counter() - t0, 1)}
    return out


def per_supervised(figures: Mapping[str, int], supervised: int) -> dict[str, float]:
    """Tokens extracted, stored slots and bytes, each per supervised token."""
    return {k: figures[k] / supervised for k in ("tokens_extracted", "stored_slots", "bytes")}


def print_table(results: list[dict[str, Any]], bpt: int) -> None:
    print(f"\nbytes per stored slot (hidden states + token arrays): {bpt}\n")
    print("| max_seq_len | supervised tokens | layout | tokens extracted | per supervised | stored slots | "
          "per supervised | bytes stored | per supervised |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        S = r["supervised"]
        layouts = [("window context", r["window"])] + [(f"full context, --max-context {X}", f)
                                                       for X, f in r["full"].items()]
        for name, f in layouts:
            p = per_supervised(f, S)
            print(f"| {r['block_size']} | {S:,} | {name} | {f['tokens_extracted']:,} | **{p['tokens_extracted']:.3f}** | "
                  f"{f['stored_slots']:,} | {p['stored_slots']:.3f} | {f['bytes'] / 1e9:.2f} GB | "
                  f"**{p['bytes']:,.0f} B** |")
    for r in results:
        for X, f in r["full"].items():
            print(f"{r['block_size']} X={X}: {f['conversations']:,} conversations, {f['conversations_split']:,} split, "
                  f"{f['context_blocks']:,} context blocks of {f['context_size']}; root {f['root_bytes'] / 1e6:.1f} MB; "
                  f"plan {f['plan_seconds']} s; longest conversation {r['longest_conversation']:,}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packed", nargs="+", help="packed tables (pack outputs with a conversations/ sub-table)")
    ap.add_argument("--verifier", default="smollm2-135m", help="for the default --max-context, H and V")
    ap.add_argument("--layers", default="2,15,27")
    ap.add_argument("--storage-dtype", default="bf16")
    ap.add_argument("--max-context", default=None,
                    help="comma-separated X values (default: extract's default for the verifier, and 32768 if different)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    config = text_config(load_model_config(args.verifier))
    H, V, L = int(config.hidden_size), int(config.vocab_size), len(args.layers.split(","))
    if args.max_context:
        xs = [int(x) for x in args.max_context.split(",")]
    else:
        xs = sorted({default_max_context(args.verifier), DEFAULT_MAX_CONTEXT})
    print(f"verifier {args.verifier}: H {H}, V {V}, {L} layers, {args.storage_dtype}; --max-context {xs} "
          f"(default {default_max_context(args.verifier)})", flush=True)
    results = []
    for p in args.packed:
        t0 = time.perf_counter()
        results.append(table_figures(p, xs, L, H, V, args.storage_dtype))
        print(f"{p}: {time.perf_counter() - t0:.0f} s", flush=True)
    print_table(results, bytes_per_token(L, H, args.storage_dtype))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
