"""``peagle-data stats`` memory and time: a table, the same table 10x, and an import-only baseline.

For each token table given (a tokenize output, a pack output), the benchmark builds a synthetic
table ten times its size: a tokenize output's part files hard-linked (or copied across file
systems) ten times under new part names; a pack output's part files rewritten ten times with the
copy number prefixed to every segment id (``r3/conv#0``), so the 10x table has ten times the
conversations for the windows-per-conversation group-by, not the same ones ten times and runs the statistics (text + PNG) in fresh child
processes on both. Each child prints its own peak RSS (``ru_maxrss``) and wall time; the baseline
is a child that only imports the same modules. Flat memory means ``rss(10x) - baseline`` close to
``rss(1x) - baseline``, not ten times it.

Usage (from the repository root, inside .venv):
    OMP_NUM_THREADS=1 python bench/bench_stats.py TOKENIZED_DIR PACKED_DIR --work /tmp/stats-bench
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
import polars, matplotlib  # noqa: F401
from peagle_data.inspect.stats import collect_stats
from peagle_data.inspect.stats_plot import plot_stats
if sys.argv[1] != "-":
    s = collect_stats(sys.argv[1], max_seq_len=int(sys.argv[3]) if sys.argv[3] != "-" else None)
    plot_stats(s, sys.argv[2], force=True)
    rows = s["totals"]["rows"]; tokens = s["totals"]["tokens"]
else:
    rows = tokens = 0
print(json.dumps({"seconds": round(time.perf_counter() - t0, 2), "rows": rows, "tokens": tokens,
                  "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))
"""


def replicate(table: Path, out: Path, times: int) -> Path:
    """A table directory whose part files are ``times`` copies (hard links) of ``table``'s."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    parts = sorted(table.glob("part-*.parquet"))
    packed = json.loads((table / "manifest.json").read_text())["kind"] == "packed"
    k = 0
    for copy in range(times):
        for p in parts:
            dest = out / f"part-{k:05d}.parquet"
            if packed:
                _rewrite_ids(p, dest, f"r{copy}/")
            else:
                try:
                    os.link(p, dest)
                except OSError:
                    shutil.copy(p, dest)
            k += 1
    shutil.copy(table / "manifest.json", out / "manifest.json")
    return out


def _rewrite_ids(src: Path, dest: Path, prefix: str) -> None:
    """Copy a packed part file with ``prefix`` in front of every segment id."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    f = pq.ParquetFile(src)
    with pq.ParquetWriter(dest, f.schema_arrow, compression="zstd") as w:
        for batch in f.iter_batches(batch_size=1024):
            col = batch.column("segment_ids")
            values = pc.binary_join_element_wise(pa.scalar(prefix), col.values, "")
            ids = pa.ListArray.from_arrays(col.offsets, values, type=col.type)
            w.write_batch(batch.set_column(batch.schema.get_field_index("segment_ids"), "segment_ids", ids))


def child(path: str, png: str, max_seq_len: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, path, png, max_seq_len], check=True,
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tables", nargs="+", type=Path)
    ap.add_argument("--work", type=Path, required=True, help="Directory for the 10x tables and PNGs.")
    ap.add_argument("--times", type=int, default=10)
    ap.add_argument("--max-seq-len", default="2048", help="Windows of a tokenize output ('-' for none).")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    base = child("-", "-", "-")
    print(f"baseline (imports only): {base['peak_rss_mib']} MiB, {base['seconds']} s")
    for table in args.tables:
        big = replicate(table, args.work / f"{table.name}-x{args.times}", args.times)
        for path in (table, big):
            r = child(str(path), str(args.work / f"{path.name}.png"), args.max_seq_len)
            print(f"{path.name}: {r['rows']:,} rows, {r['tokens']:,} tokens: {r['seconds']} s, peak RSS "
                  f"{r['peak_rss_mib']} MiB ({r['peak_rss_mib'] - base['peak_rss_mib']:+.1f} MiB over baseline)")


if __name__ == "__main__":
    main()
