"""``peagle-data stats``: what a tokenize output, a pack output or a feature store holds.

Token tables are read through polars lazy scans collected with the streaming engine, and every
statistic is an aggregate over a bounded key (a length, a fraction bin, a window index, a source),
so peak memory does not grow with the number of rows; percentiles are exact, taken from the
length -> count tables. A feature store is read block by block (token arrays only, never hidden
states) into histograms bounded by its block size.

What each kind reports (``rows`` are conversations for a tokenize output, blocks otherwise; the
per-turn rows of a conversation a history-rewriting template split are one conversation, as long
as its longest row, and ``totals.table_rows`` counts the rows):

- totals: rows, tokens, supervised (loss) tokens, supervised fraction;
- length percentiles: tokens per conversation (tokenize output) or per window (pack output, store);
- supervised fraction per conversation (tokenize output) or per block (pack output, store);
- windows per conversation: from the segment ids (``conversation#k``) of a pack output (one
  group-by key per conversation: the only statistic whose memory grows with the data, by one id
  per conversation), or, for a tokenize output, the windows ``pack --max-seq-len W`` would cut
  (:func:`peagle_data.prepare.windows.count_windows`) when ``max_seq_len`` is given;
- per-source breakdown: the ``dataset`` column of a table (mixture sources) when present, else the
  file part of each row's ``source`` (``file:N``);
- packing efficiency: tokens / (blocks x block_size) of a pack output or store;
- a full-context store's (``extract --context full``) context part, ``contexts``: the context blocks
  the verifier ran (done, slots), the tokens extracted and per supervised token, the conversations
  and those longer than ``--max-context``, split (None for a window-context store). Its blocks,
  lengths and fractions above are the training blocks'.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from peagle_data.prepare.packing import packing_efficiency
from peagle_data.prepare.windows import SystemPrefixTooLongError, count_windows
from stores.errors import InputError
from stores.features.feature_store import FeatureStore
from stores.files import is_zarr_store
from stores.tables.token_tables import TokenTable

__all__ = ["KIND_NAMES", "PERCENTILES", "StatsConfig", "collect_stats", "format_stats", "percentiles_from_counts"]


@dataclass(frozen=True, kw_only=True)
class StatsConfig:
    """What ``peagle-data stats`` measures and how it prints."""

    path: str
    """A tokenize output, a pack output or a feature store."""
    json: bool = False
    """Print the statistics as JSON."""
    png: str | None = None
    """Also write a PNG: length histogram, supervised fraction, windows, per-source shares."""
    max_seq_len: int | None = None
    """For a tokenize output: count the windows `pack --max-seq-len N` would cut (tokens, >= 2)."""
    overlap: float = 0.5
    """The `pack --overlap` of those windows, in [0, 1)."""
    force: bool = field(default=False, metadata={"action": True})
    """Overwrite an existing --png file."""

    def __post_init__(self) -> None:
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise ValueError(f"--max-seq-len must be >= 2 tokens, got {self.max_seq_len}")
        if not 0.0 <= self.overlap < 1.0:
            raise ValueError(f"--overlap must be in [0, 1), got {self.overlap}")

PERCENTILES = (1, 5, 10, 25, 50, 75, 90, 95, 99)
KIND_NAMES = {"tokenized": "tokenize output", "packed": "pack output", "store": "feature store"}
"""What a ``stats['kind']`` is, in words, for the text and the plot's title (a directory is often named after its
kind: ``packed (packed)`` said nothing)."""
FRACTION_BINS = 50
"""Supervised-fraction histograms have this many equal bins over [0, 1]."""


def percentiles_from_counts(values: np.ndarray, counts: np.ndarray,
                            ps: tuple[int, ...] = PERCENTILES) -> dict[str, Any]:
    """Exact nearest-rank percentiles, min, max and mean of a distribution given as value -> count.

    Args:
        values: distinct values ``[K]`` (any order); counts: how often each occurs ``[K]``.

    Returns:
        ``{"p1": ..., "p50": ..., "min", "max", "mean"}`` (the p-th percentile is the smallest
        value with at least ``ceil(p/100 * N)`` of the N observations at or below it); all None
        when N is 0.
    """
    values, counts = np.asarray(values), np.asarray(counts, dtype=np.int64)
    n = int(counts.sum())
    if n == 0:
        return {**{f"p{p}": None for p in ps}, "min": None, "max": None, "mean": None}
    order = np.argsort(values, kind="stable")
    values, counts = values[order], counts[order]
    cum = np.cumsum(counts)
    out = {f"p{p}": _num(values[int(np.searchsorted(cum, max(1, math.ceil(p / 100 * n))))]) for p in ps}
    out.update(min=_num(values[counts > 0][0]), max=_num(values[counts > 0][-1]),
               mean=round(float((values.astype(np.float64) * counts).sum() / n), 3))
    return out


def _num(x) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def _fraction_histogram(bins: np.ndarray, counts: np.ndarray) -> list[int]:
    """``[FRACTION_BINS]`` counts from (bin index, count) pairs; a fraction of exactly 1 goes to the last bin."""
    hist = np.zeros(FRACTION_BINS, dtype=np.int64)
    np.add.at(hist, np.minimum(np.asarray(bins, dtype=np.int64), FRACTION_BINS - 1), np.asarray(counts))
    return hist.tolist()


def _length_block(values, counts) -> dict[str, Any]:
    values, counts = np.asarray(values, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    order = np.argsort(values)
    return {"percentiles": percentiles_from_counts(values, counts),
            "values": values[order].tolist(), "counts": counts[order].tolist()}


def collect_stats(path: str | os.PathLike, max_seq_len: int | None = None,
                  overlap: float = 0.5) -> dict[str, Any]:
    """Statistics of a tokenize output, a pack output or a feature store (see the module doc).

    Args:
        path: a token table directory (``manifest.json``) or a feature store (``zarr.json``).
        max_seq_len: for a tokenize output, count the windows ``pack --max-seq-len`` would cut
            (with ``overlap``); ignored for the other kinds, which hold their windows.
        overlap: the ``pack --overlap`` those windows use.

    Returns:
        A JSON-able dict: ``path``, ``kind``, ``totals``, ``lengths`` (``percentiles``, ``values``,
        ``counts``), ``supervised_fraction`` (``of``, ``histogram`` over FRACTION_BINS bins),
        ``windows_per_conversation`` (or None), ``sources`` (or None), ``packing`` (or None),
        ``manifest_counts``; a store's also ``contexts`` (a full-context store's context part, else None).

    Raises:
        InputError: ``path`` is neither a token table nor a feature store.
        StoreFormatError: the table or store cannot be read.
    """
    p = Path(path)
    if is_zarr_store(p):
        return _store_stats(p)
    if not (p / "manifest.json").is_file():
        raise InputError(f"{path}: not a token table (no manifest.json) nor a feature store (no zarr.json)")
    table = TokenTable.open(p)
    stats = _tokenized_stats(table, max_seq_len, overlap) if table.kind == "tokenized" else _packed_stats(table)
    return {"path": str(path), "kind": table.kind, **stats,
            "manifest_counts": {k: v for k, v in table.manifest.get("counts", {}).items()
                                if k in ("read", "used", "rejected", "duplicates", "rejected_by_reason")}}


def _source_key(lf):
    """The per-source key of a tokenize output: its ``dataset`` column, else the file of ``source``."""
    import polars as pl

    file = pl.col("source").str.replace(r":\d+(\*\d+)?$", "")
    if "dataset" in lf.collect_schema().names():
        return pl.coalesce(pl.col("dataset"), file)
    return file


def _conversations(table, lf):
    """The tokenize output as one row per conversation: itself, or, when a history-rewriting template
    split conversations into per-turn rows (each holding the history before its turn), its rows
    grouped by ``source`` (``file:N``, shared by a conversation's rows): the conversation is as long
    as its longest row and supervises the sum of its rows' supervised tokens. Returns ``(lf, split)``."""
    import polars as pl

    if not int(table.manifest.get("counts", {}).get("history_rewrite_rows", 0) or 0):
        return lf, False
    extra = [pl.col("dataset").first()] if "dataset" in lf.collect_schema().names() else []
    return lf.group_by("source").agg(pl.col("n_tokens").max(), pl.col("n_loss_tokens").sum(), *extra), True


def _tokenized_stats(table, max_seq_len: int | None, overlap: float) -> dict[str, Any]:
    import polars as pl

    lf = table.scan()
    conv, split = _conversations(table, lf)
    frac_bin = (pl.col("n_loss_tokens") * FRACTION_BINS // pl.col("n_tokens")).alias("bin")
    queries = [
        conv.group_by("n_tokens").agg(pl.len().alias("rows"), pl.col("n_loss_tokens").sum().alias("loss")),
        conv.select(frac_bin).group_by("bin").len(),
        lf.group_by(_source_key(lf).alias("src")).agg(
            pl.len().alias("rows"), pl.col("n_tokens").sum().alias("tokens"),
            pl.col("n_loss_tokens").sum().alias("loss")),
        lf.select(pl.len().alias("rows"), pl.col("n_tokens").cast(pl.Int64).sum().alias("tokens")),
        conv.group_by(_source_key(conv).alias("src")).len(),
    ]
    if max_seq_len is not None:
        queries.append(lf.group_by("n_tokens", "system_len").len())
    frames = pl.collect_all(queries, engine="streaming")
    lengths, fracs, sources, table_rows = frames[0], frames[1], frames[2], frames[3]
    tokens = int(table_rows["tokens"][0] or 0)
    loss = int(lengths["loss"].sum())
    per_source = dict(frames[4].iter_rows())
    sources = sources.with_columns(pl.col("src").replace_strict(per_source, default=0).alias("rows"))
    windows = _tokenized_windows(frames[5], max_seq_len, overlap) if max_seq_len is not None else None
    totals = {"rows": int(lengths["rows"].sum()), "tokens": tokens, "loss_tokens": loss,
              "supervised_fraction": round(loss / tokens, 6) if tokens else 0.0}
    if split:
        totals["table_rows"] = int(table_rows["rows"][0])
    return {
        "totals": totals,
        "lengths": {"of": "conversation", **_length_block(lengths["n_tokens"], lengths["rows"])},
        "supervised_fraction": {"of": "conversation", "histogram": _fraction_histogram(fracs["bin"], fracs["len"])},
        "windows_per_conversation": windows,
        "sources": _sources(sources, tokens, loss),
        "packing": None,
    }


def _tokenized_windows(frame, max_seq_len: int, overlap: float) -> dict[str, Any]:
    """Windows per conversation that ``pack --max-seq-len`` would cut (candidates, before dropping
    windows without a supervised token); conversations whose system prompt leaves no room are counted apart."""
    hist: dict[int, int] = {}
    too_long = 0
    for n, system_len, count in frame.iter_rows():
        try:
            k = count_windows(int(n), int(system_len), max_seq_len, overlap)
        except SystemPrefixTooLongError:
            too_long += int(count)
            continue
        hist[k] = hist.get(k, 0) + int(count)
    return _windows_block(hist, note=f"windows pack --max-seq-len {max_seq_len} --overlap {overlap} would cut",
                          system_prefix_too_long=too_long)


def _windows_block(hist: dict[int, int], **extra) -> dict[str, Any]:
    ks = np.array(sorted(hist), dtype=np.int64)
    cs = np.array([hist[k] for k in sorted(hist)], dtype=np.int64)
    return {"histogram": {int(k): int(c) for k, c in zip(ks, cs)},
            "percentiles": percentiles_from_counts(ks, cs, (50, 90, 99)), **extra}


def _sources(frame, tokens: int, loss: int) -> list[dict[str, Any]]:
    rows = sorted(frame.iter_rows(named=True), key=lambda r: (-r["tokens"], str(r["src"])))
    return [{"source": r["src"], "rows": int(r["rows"]), "tokens": int(r["tokens"]),
             "loss_tokens": int(r["loss"]),
             "token_share": round(r["tokens"] / tokens, 6) if tokens else 0.0,
             "loss_share": round(r["loss"] / loss, 6) if loss else 0.0} for r in rows]


def _packed_stats(table) -> dict[str, Any]:
    import polars as pl

    lf = table.scan()
    block_size = int(table.manifest.get("parameters", {}).get("block_size") or 0)
    blocks = lf.select(pl.col("n_tokens"), pl.col("loss_mask").list.sum().cast(pl.Int64).alias("loss"))
    seg = lf.select(pl.col("cu_seqlens").list.diff(null_behavior="drop").alias("n")).explode("n")
    conv = lf.select(pl.col("segment_ids").explode().str.replace(r"#\d+$", "").alias("conversation"))
    queries = [
        blocks.select(pl.len().alias("blocks"), pl.col("n_tokens").cast(pl.Int64).sum().alias("tokens"),
                      pl.col("loss").sum().alias("loss")),
        blocks.select((pl.col("loss") * FRACTION_BINS // pl.col("n_tokens")).alias("bin")).group_by("bin").len(),
        seg.group_by("n").len(),
        conv.group_by("conversation").len().group_by("len").agg(pl.len().alias("conversations")),
    ]
    if "segment_datasets" in lf.collect_schema().names():
        queries.append(_packed_sources_query(lf))
    frames = pl.collect_all(queries, engine="streaming")
    totals, fracs, lengths, per_conv = frames[:4]
    n_blocks, tokens, loss = (int(totals[c][0] or 0) for c in ("blocks", "tokens", "loss"))
    return {
        "totals": {"rows": n_blocks, "tokens": tokens, "loss_tokens": loss,
                   "supervised_fraction": round(loss / tokens, 6) if tokens else 0.0},
        "lengths": {"of": "window", **_length_block(lengths["n"], lengths["len"])},
        "supervised_fraction": {"of": "block", "histogram": _fraction_histogram(fracs["bin"], fracs["len"])},
        "windows_per_conversation": _windows_per_conversation(per_conv),
        "sources": _sources(frames[4], tokens, loss) if len(frames) > 4 and len(frames[4]) else None,
        "packing": _packing(n_blocks, tokens, block_size),
    }


def _packed_sources_query(lf):
    """Per mixture source of a pack output: windows, tokens and supervised tokens."""
    import polars as pl

    per_segment = lf.filter(pl.col("segment_datasets").is_not_null()).select(
        pl.col("segment_datasets").alias("src"),
        pl.col("cu_seqlens").list.diff(null_behavior="drop").alias("tokens"),
        pl.col("segment_loss_tokens").alias("loss"),
    ).explode("src", "tokens", "loss").filter(pl.col("src").is_not_null())
    return per_segment.group_by("src").agg(pl.len().alias("rows"), pl.col("tokens").cast(pl.Int64).sum(),
                                           pl.col("loss").cast(pl.Int64).sum())


def _windows_per_conversation(frame) -> dict[str, Any] | None:
    """Windows per conversation of a pack output from ``(windows, conversations)`` pairs (the
    windows of one conversation share the segment id prefix before ``#k``; windows dropped for
    having no supervised token are not counted, so indices may have gaps)."""
    hist = {int(k): int(c) for k, c in frame.iter_rows()}
    if not hist:
        return None
    return _windows_block(hist, conversations=sum(hist.values()))


def _packing(n_blocks: int, tokens: int, block_size: int) -> dict[str, Any]:
    return {"blocks": n_blocks, "block_size": block_size,
            "efficiency": round(packing_efficiency(tokens, n_blocks, block_size), 6) if block_size else None}


def _store_stats(path: Path) -> dict[str, Any]:
    """A feature store, block by block: token arrays only (bounded histograms, flat memory)."""
    store = FeatureStore.open(path)
    C = store.block_size
    seg_hist = np.zeros(C + 1, dtype=np.int64)
    frac_hist = np.zeros(FRACTION_BINS, dtype=np.int64)
    segs_per_block: dict[int, int] = {}
    tokens = loss = 0
    for i in range(store.n_blocks):
        tok = store.read_tokens(i)
        n, m = len(tok["input_ids"]), int(tok["loss_mask"].sum())
        tokens += n
        loss += m
        if n:
            frac_hist[min(m * FRACTION_BINS // n, FRACTION_BINS - 1)] += 1
        seg_hist += np.bincount(np.diff(tok["cu_seqlens"]), minlength=C + 1)[: C + 1]
        s = len(tok["cu_seqlens"]) - 1
        segs_per_block[s] = segs_per_block.get(s, 0) + 1
    seg_hist[0] = 0
    nz = np.flatnonzero(seg_hist)
    shard = store.has_views and store.attrs.get("shard")  # training blocks done once merged
    done = None if shard else store.done_mask()
    return {
        "path": str(path), "kind": "store",
        "totals": {"rows": store.n_blocks, "tokens": tokens, "loss_tokens": loss,
                   "supervised_fraction": round(loss / tokens, 6) if tokens else 0.0,
                   "blocks_done": None if done is None else int(done.sum())},
        "contexts": _context_stats(store, loss) if store.has_views else None,
        "lengths": {"of": "window", **_length_block(nz, seg_hist[nz])},
        "supervised_fraction": {"of": "block", "histogram": frac_hist.tolist()},
        "windows_per_conversation": None,
        "segments_per_block": {int(k): v for k, v in sorted(segs_per_block.items())},
        "sources": None,
        "packing": _packing(store.n_blocks, tokens, C),
        "manifest_counts": {},
        "verifier": store.attrs.get("verifier", {}).get("name_or_path"), "layers": store.layers,
    }


def _context_stats(store: FeatureStore, loss: int) -> dict[str, Any]:
    """The context part of a full-context store (module docstring); a shard store's holds its own context
    blocks (``shard``), the plan's ``conversations``/``conversations_split``/``max_context`` are the whole run's."""
    grid = store.contexts
    plan = store.attrs.get("context") or {}
    shard = store.attrs.get("shard")
    extracted = int(grid.n_tokens_per_block().astype(np.int64).sum())
    return {
        "blocks": grid.n_blocks, "blocks_done": int(grid.done_mask().sum()), "block_size": grid.block_size,
        "tokens_extracted": extracted,
        "tokens_extracted_per_supervised_token": None if shard or not loss else round(extracted / loss, 6),
        "packing_efficiency": round(packing_efficiency(extracted, grid.n_blocks, grid.block_size), 6)
        if grid.n_blocks else None,
        **{k: plan.get(k) for k in ("max_context", "conversations", "conversations_split")},
        **({"shard": {k: shard[k] for k in ("num_shards", "shard_index", "context_blocks")}} if shard else {}),
    }


def format_stats(stats: dict[str, Any]) -> str:
    """The statistics as a few lines of text."""
    t = stats["totals"]
    row_name = "conversations" if stats["kind"] == "tokenized" else "blocks"
    split = (f" (in {t['table_rows']:,} per-turn rows of a history-rewriting template; a conversation is as "
             "long as its longest row)") if "table_rows" in t else ""
    lines = [f"{stats['path']}  ({KIND_NAMES.get(stats['kind'], stats['kind'])})",
             f"{row_name} {t['rows']:,}  tokens {t['tokens']:,}  supervised tokens {t['loss_tokens']:,}  "
             f"supervised fraction {t['supervised_fraction']:.4f}{split}"]
    mc = stats.get("manifest_counts") or {}
    if mc:
        lines.append("input rows: " + "  ".join(f"{k} {v}" for k, v in mc.items() if not isinstance(v, dict))
                     + (f"  {mc['rejected_by_reason']}" if mc.get("rejected_by_reason") else ""))
    pc = stats["lengths"]["percentiles"]
    lines.append(f"tokens per {stats['lengths']['of']}: " + ("none (the table is empty)" if pc["min"] is None else
                                                             "  ".join(f"{k} {pc[k]}" for k in (
                                                                 "min", "p10", "p25", "p50", "p75", "p90", "p99",
                                                                 "max", "mean"))))
    w = stats.get("windows_per_conversation")
    if w:
        wp = w["percentiles"]
        lines.append(f"windows per conversation: mean {wp['mean']}  p50 {wp['p50']}  p90 {wp['p90']}  "
                     f"p99 {wp['p99']}  max {wp['max']}")
    if stats.get("packing"):
        pk = stats["packing"]
        lines.append(f"packing: {pk['blocks']:,} blocks x {pk['block_size']}  efficiency {pk['efficiency']}")
    cx = stats.get("contexts")
    if cx:
        per = cx["tokens_extracted_per_supervised_token"]
        sh = cx.get("shard")
        lines.append(f"full context: {cx['blocks']:,} context blocks x {cx['block_size']} ({cx['blocks_done']:,} done"
                     + (f"; shard {sh['shard_index']} of {sh['num_shards']}, {sh['context_blocks']:,} in the run"
                        if sh else "") + f")  tokens extracted {cx['tokens_extracted']:,}"
                     + (f" ({per} per supervised token)" if per is not None else "")
                     + f"  conversations {cx['conversations']:,} ({cx['conversations_split']:,} longer than "
                     f"--max-context {cx['max_context']}, split)")
    unit = "conversations" if stats["kind"] == "tokenized" else "windows"
    for s in stats.get("sources") or []:
        lines.append(f"  source {s['source']}: {s['rows']:,} {unit}  {s['tokens']:,} tokens ({s['token_share']:.1%})  "
                     f"{s['loss_tokens']:,} supervised ({s['loss_share']:.1%})")
    return "\n".join(lines)
