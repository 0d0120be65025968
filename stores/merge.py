"""Joining the outputs of a sharded run (``peagle-data merge``) and checking the union (``verify``).

Token tables: the N shard tables of one run (``manifest["shard"]`` 0..N-1 of N, equal inputs,
parameters and tokenizer) become one table whose manifest lists the parts it holds
(``merged_from``: each shard's directory, index, manifest sha256 and rows). Tokenized part files
are hard-linked (copied across file systems) in shard order; packed part files are rewritten
batch by batch with ``block_id`` renumbered 0..B-1. ``rejects.jsonl`` is concatenated,
``token_freq.npy`` summed, counts summed (``packing_efficiency`` recomputed).

Feature stores: the N shard stores of ``extract --num-shards N`` (same packed table, verifier,
layers and storage) become one store in which packed block ``s + k*N`` (store block k of shard
s) is block ``s + k*N`` again, so the merged store equals the unsharded one array for array. The
shards of a full-context extraction (``--context full``, docs/design.md §7) hold the same root
(training blocks and views) and split the context blocks the same way: context block ``s + k*N`` is
block k of shard s's ``contexts`` sub-store; the merged store takes the root of shard 0 (checked
equal in every shard) and the context blocks interleaved.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stores.errors import ChunkDamageError, InputError, StoreFormatError, StoreMismatchError
from stores.features.feature_schema import hidden_arrays
from stores.features.feature_store import FeatureStore
from stores.staging import staged_output_dir
from stores.tables.token_tables import (
    CONVERSATIONS,
    REJECTS,
    TokenTable,
    conversations_record,
    manifest_sha256,
    write_manifest,
    write_token_freq,
)

__all__ = ["merge_tables", "verify_table", "merge_stores"]

_SAME = ("kind", "inputs", "tokenizer", "mixture")
"""Manifest entries every shard of one run shares."""


def _shard_of(table: TokenTable) -> tuple[int, int]:
    shard = table.manifest.get("shard")
    if not shard:
        raise InputError(f"{table.directory} is not a shard (its manifest has no 'shard'; made without "
                         "--num-shards)")
    return int(shard["num_shards"]), int(shard["shard_index"])


def _check_shard_set(indices: list[int], n: int, what: list[str]) -> None:
    """Raise unless ``indices`` are 0..n-1, each once (names the missing and repeated shards)."""
    missing = sorted(set(range(n)) - set(indices))
    repeated = sorted({i for i in indices if indices.count(i) > 1})
    if missing or repeated or len(indices) != n:
        raise InputError(f"the shards do not make up one run of {n} shards: "
                         + (f"missing shard index {missing}" if missing else "")
                         + ("; " if missing and repeated else "")
                         + (f"shard index {repeated} given twice" if repeated else "")
                         + f" (inputs: {', '.join(what)})")


def _parameters_without_shard(m: dict[str, Any]) -> dict[str, Any]:
    p = json.loads(json.dumps(m.get("parameters", {}), default=str))
    tok = p.get("tokenize", p)
    tok.pop("num_shards", None)
    tok.pop("shard_index", None)
    return p


_NO_EFFECT = ("num_workers",)
"""Parameters that do not change an output (the same rows for any value): shards may differ in them."""


def _output_parameters(m: dict[str, Any]) -> dict[str, Any]:
    """A shard's parameters that decide its rows, flattened (``tokenize.x`` for pack's tokenize options)."""
    p = _parameters_without_shard(m)
    flat = {k: v for k, v in p.items() if k != "tokenize"}
    flat.update({f"tokenize.{k}": v for k, v in p.get("tokenize", {}).items()})
    return {k: v for k, v in flat.items() if k.rpartition(".")[2] not in _NO_EFFECT}


def _open_shards(paths: list[str]) -> list[TokenTable]:
    tables = [TokenTable.open(p) for p in paths]
    shards = [_shard_of(t) for t in tables]
    n = shards[0][0]
    if any(s[0] != n for s in shards):
        raise StoreMismatchError(f"the shards come from runs of different --num-shards: {[s[0] for s in shards]}")
    _check_shard_set([s[1] for s in shards], n, [str(p) for p in paths])
    first = tables[0].manifest
    for t in tables[1:]:
        for key in _SAME:
            if t.manifest.get(key) != first.get(key):
                raise StoreMismatchError(f"{t.directory}: its {key!r} differs from {tables[0].directory}'s; "
                                         "shards of one run share inputs, tokenizer and mixture")
        theirs, ours = _output_parameters(t.manifest), _output_parameters(first)
        if theirs != ours:
            diff = ", ".join(f"{k}: {theirs.get(k)!r} vs {ours.get(k)!r}" for k in sorted(set(theirs) | set(ours))
                             if theirs.get(k) != ours.get(k))
            raise StoreMismatchError(f"{t.directory}: made with other parameters than {tables[0].directory} ({diff})")
    return sorted(tables, key=lambda t: _shard_of(t)[1])


def _sum_counts(counts: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts of shards added: numbers summed, dicts merged recursively (efficiency recomputed by the caller)."""
    out: dict[str, Any] = {}
    for c in counts:
        for k, v in c.items():
            if isinstance(v, bool) or k in ("block_size", "packing_efficiency"):
                out[k] = v
            elif isinstance(v, (int, float)):
                out[k] = out.get(k, 0) + v
            elif isinstance(v, dict):
                out[k] = _sum_counts([out.get(k, {}), v])
    return out


_WHOLE_INPUT = ("copies", "sampled_out")
"""Counts every shard makes over the whole input (weights draw before the shard filter): one value."""
_WHOLE_INPUT_PER_SOURCE = ("read", "copies", "sampled_out")


def _merged_counts(tables: list[TokenTable]) -> dict[str, Any]:
    """The shards' counts joined into those of the unsharded run.

    Per-shard counts (used, rejected, tokens, ...) are summed. Counts every shard takes over the
    whole input (top-level ``copies``/``sampled_out``; per source ``read``, ``copies``,
    ``sampled_out``) are the same in every shard and are taken once, and so is checked
    ``read + other_shards`` (the items every shard saw); ``other_shards`` is 0 in the union (per
    source) and absent at the top level, as in an unsharded run.

    Raises:
        StoreMismatchError: a whole-input count differs between shards (they read different data).
    """
    counts = [t.manifest.get("counts", {}) for t in tables]
    out = _sum_counts(counts)
    out.pop("other_shards", None)
    whole = [(k, (), lambda c, k=k: c.get(k)) for k in _WHOLE_INPUT]
    whole.append(("read + other_shards", (), lambda c: c.get("read", 0) + c.get("other_shards", 0)))
    for name in out.get("sources", {}):
        out["sources"][name]["other_shards"] = 0
        whole += [(k, ("sources", name), lambda c, k=k, name=name: c.get("sources", {}).get(name, {}).get(k))
                  for k in _WHOLE_INPUT_PER_SOURCE]
    for key, where, get in whole:
        values = [get(c) for c in counts]
        if values[0] is None and all(v is None for v in values):
            continue
        if any(v != values[0] for v in values):
            what = f"source {where[1]!r} {key}" if where else key
            raise StoreMismatchError(
                f"the shards read different input data: {what} is "
                + ", ".join(f"{v} in {t.directory}" for v, t in zip(values, tables))
                + " (every shard reads the whole input, so these must be equal)")
        target = out
        for part in where:
            target = target[part]
        if key in target:  # not a count of its own ("read + other_shards" only checks)
            target[key] = values[0]
    return out


def merge_tables(paths: list[str | os.PathLike], output: str | os.PathLike, force: bool = False) -> dict[str, Any]:
    """Join the shard tables of one sharded ``tokenize`` or ``pack`` run into one table.

    Returns:
        The merged manifest.

    Raises:
        InputError: a path is not a shard, or the shards are not exactly 0..N-1 of one N.
        StoreMismatchError: shards of different runs (inputs, parameters, tokenizer, mixture), or
            of different input data (a whole-input count differs, see :func:`_merged_counts`).
        OutputExistsError: ``output`` exists and ``force`` is false.
    """
    tables = _open_shards([str(p) for p in paths])
    counts = _merged_counts(tables)
    kind = tables[0].kind
    with staged_output_dir(output, force) as out:
        merged_from, k, block = [], 0, 0
        for t in tables:
            files = t._files()
            for f in files:
                dest = out / f"part-{k:05d}.parquet"
                k += 1
                if kind == "packed":
                    block = _rewrite_block_ids(f, dest, block)
                else:
                    _link_or_copy(f, dest)
            merged_from.append({"path": str(t.directory), "shard_index": _shard_of(t)[1],
                                "manifest_sha256": manifest_sha256(t.directory), "rows": t.num_rows,
                                "parts": len(files)})
        if kind == "packed":
            _merge_conversations(tables, out)
        with (out / REJECTS).open("wb") as dst:
            for t in tables:
                if t.rejects_path.is_file():
                    with t.rejects_path.open("rb") as src:
                        shutil.copyfileobj(src, dst)
        freqs = [t.token_freq() for t in tables]
        if all(f is not None for f in freqs):
            write_token_freq(out, np.sum(freqs, axis=0))
        if kind == "packed" and counts.get("n_blocks"):
            counts["packing_efficiency"] = round(counts["tokens"] / (counts["n_blocks"] * counts["block_size"]), 6)
        first = tables[0].manifest
        manifest = {key: first[key] for key in ("kind", "inputs", "files", "tokenizer", "mixture") if key in first}
        manifest.update(parameters=_parameters_without_shard(first), counts=counts,
                        merged_from=merged_from, num_shards=len(tables))
        if (out / CONVERSATIONS).is_dir() and all(CONVERSATIONS in t.manifest for t in tables):
            manifest[CONVERSATIONS] = conversations_record(out)  # of shards whose sub-tables were checked
        write_manifest(out, manifest)
    return manifest


def _merge_conversations(tables: list[TokenTable], out: Path) -> None:
    """The packed shards' :data:`~stores.tables.token_tables.CONVERSATIONS` sub-tables joined in shard order
    (part files linked); nothing when no shard has one.

    Raises:
        StoreMismatchError: some shards have the sub-table and others not (packed by different peagle versions).
    """
    subs = [t.conversations() for t in tables]
    if all(s is None for s in subs):
        return
    if any(s is None for s in subs):
        lacking = [str(t.directory) for t, s in zip(tables, subs) if s is None]
        raise StoreMismatchError(f"{', '.join(lacking)}: no {CONVERSATIONS} sub-table, which the other shards have "
                                 "(packed by an older peagle); pack those shards again")
    (out / CONVERSATIONS).mkdir()
    k = rows = 0
    for sub in subs:
        for f in sub._files():
            _link_or_copy(f, out / CONVERSATIONS / f"part-{k:05d}.parquet")
            k += 1
        rows += sub.num_rows
    write_manifest(out / CONVERSATIONS, {**subs[0].manifest, "rows": rows})


def _link_or_copy(src: Path, dest: Path) -> None:
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)


def _rewrite_block_ids(src: Path, dest: Path, first_block: int) -> int:
    """Copy a packed part file with ``block_id`` renumbered from ``first_block``; returns the next id."""
    f = pq.ParquetFile(src)
    writer = pq.ParquetWriter(dest, f.schema_arrow, compression="zstd")
    try:
        for batch in f.iter_batches(batch_size=1024):
            ids = pa.array(np.arange(first_block, first_block + batch.num_rows, dtype=np.int64))
            batch = batch.set_column(batch.schema.get_field_index("block_id"), "block_id", ids)
            writer.write_batch(batch)
            first_block += batch.num_rows
    finally:
        writer.close()
    return first_block


def verify_table(path: str | os.PathLike) -> dict[str, Any]:
    """Check a token table, and for a merged one the union of its shards.

    Checks: the manifest's totals equal the rows' (tokens, supervised tokens, rows/blocks); every
    row's ``(source, conversation_id)`` (tokenized: the rows of a conversation split per turn share
    a source) or window id (packed) occurs once; for a merged table, the parts
    per shard hold the rows its manifest records, and each shard directory that still exists has
    the manifest recorded (sha256); a packed table's conversations sub-table is the one its manifest
    records (:func:`~stores.tables.token_tables.conversations_record`).

    Returns:
        ``{"ok": bool, "kind", "rows", "problems": [str, ...]}``.
    """
    import polars as pl

    table = TokenTable.open(path)
    m, problems = table.manifest, []
    lf = table.scan()
    if table.kind == "tokenized":
        agg = lf.select(pl.len().alias("rows"), pl.col("n_tokens").cast(pl.Int64).sum().alias("tokens"),
                        pl.col("n_loss_tokens").cast(pl.Int64).sum().alias("loss"),
                        # one conversation split per assistant turn (history rewrite) gives rows
                        # sharing a source: a row is the pair (source, conversation_id "ID@turn")
                        pl.struct("source", "conversation_id").n_unique().alias("unique"))
    else:
        agg = lf.select(pl.len().alias("rows"), pl.col("n_tokens").cast(pl.Int64).sum().alias("tokens"),
                        pl.col("loss_mask").list.sum().cast(pl.Int64).sum().alias("loss"),
                        pl.col("segment_ids").list.len().sum().alias("windows"),
                        pl.col("segment_ids").explode().n_unique().alias("unique"))
    got = agg.collect(engine="streaming").row(0, named=True)
    counts = m.get("counts", {})
    for key, name in (("tokens", "tokens"), ("loss", "loss_tokens")):
        if name in counts and int(got[key] or 0) != int(counts[name]):
            problems.append(f"{name}: the rows hold {got[key]}, the manifest says {counts[name]}")
    if table.kind == "packed" and "n_blocks" in counts and got["rows"] != counts["n_blocks"]:
        problems.append(f"n_blocks: {got['rows']} rows, the manifest says {counts['n_blocks']}")
    n_ids = got["rows"] if table.kind == "tokenized" else got["windows"]
    if got["rows"] and got["unique"] != n_ids:
        what = "row sources" if table.kind == "tokenized" else "window ids"
        problems.append(f"{n_ids - got['unique']} repeated {what}: a shard given twice or overlapping runs")
    problems += _check_parts(table)
    if table.kind == "packed":
        try:
            table.conversations()  # the sub-table the manifest records
        except (StoreMismatchError, StoreFormatError) as e:
            problems.append(str(e))
    return {"ok": not problems, "kind": table.kind, "rows": got["rows"], "problems": problems}


def _check_parts(table: TokenTable) -> list[str]:
    problems = []
    files = table._files()
    k = 0
    for part in table.manifest.get("merged_from", []):
        rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files[k:k + part["parts"]])
        k += part["parts"]
        if rows != part["rows"]:
            problems.append(f"shard {part['shard_index']}: {rows} rows in its parts, {part['rows']} recorded")
        shard_dir = Path(part["path"])
        if (shard_dir / "manifest.json").is_file() and manifest_sha256(shard_dir) != part["manifest_sha256"]:
            problems.append(f"shard {part['shard_index']}: {shard_dir} has changed since the merge (manifest sha256)")
    if table.manifest.get("merged_from") and k != len(files):
        problems.append(f"{len(files)} part files, the shards recorded {k}")
    return problems


def merge_stores(paths: list[str | os.PathLike], output: str | os.PathLike, force: bool = False) -> dict[str, Any]:
    """Join the shard stores of ``extract --num-shards N`` into one store equal to the unsharded one
    (full-context shards: the full-context store; module docstring).

    Raises:
        InputError: a store is not a shard, not complete (a full-context shard: its context blocks), or
            the shards are not 0..N-1 of one N.
        StoreMismatchError: shards of other packed tables, verifiers, layers or storage; of both
            ``--context`` layouts; of other ``--max-context`` or context plans.
        OutputExistsError: ``output`` exists and ``force`` is false.
    """
    stores = [FeatureStore.open(p) for p in paths]
    _check_one_layout(stores)
    shards = []
    for s in stores:
        sh = s.attrs.get("shard")
        if not sh:
            raise InputError(f"{s.path} is not a shard store (made without extract --num-shards)")
        grid = s.verifier_blocks  # the blocks the verifier ran
        if not grid.is_complete():
            what = "context blocks" if s.has_views else "blocks"
            raise InputError(f"{s.path}: {len(grid.missing_blocks())} {what} not done; finish it with "
                             "`peagle-data extract --resume` first")
        shards.append((int(sh["num_shards"]), int(sh["shard_index"])))
    n = shards[0][0]
    if any(x[0] != n for x in shards):
        raise StoreMismatchError(f"the stores come from runs of different --num-shards: {[x[0] for x in shards]}")
    _check_shard_set([x[1] for x in shards], n, [str(p) for p in paths])
    stores = [s for _, s in sorted(zip([x[1] for x in shards], stores), key=lambda t: t[0])]
    first = stores[0]
    for s in stores[1:]:
        for key in ("source", "layers", "layer_convention", "storage_dtype", "compressor", "block_size"):
            if s.attrs.get(key) != first.attrs.get(key):
                raise StoreMismatchError(f"{s.path}: {key} {s.attrs.get(key)!r} differs from {first.path}'s "
                                         f"{first.attrs.get(key)!r}")
        if _engine_name(s) != _engine_name(first):
            raise StoreMismatchError(f"{s.path}: extracted with --engine {_engine_name(s)}, {first.path} with "
                                     f"--engine {_engine_name(first)}; a store's blocks come from one engine")
        dtypes = [x.attrs["verifier"].get("dtype") for x in (s, first)]
        if dtypes[0] != dtypes[1]:
            raise StoreMismatchError(f"{s.path}: features computed in {dtypes[0]}, {first.path}'s in {dtypes[1]} "
                                     "(servers or devices of other dtypes); a merged store's blocks come from one "
                                     "compute dtype: extract the shards again with one")
        if s.attrs["verifier"] != first.attrs["verifier"]:
            raise StoreMismatchError(f"{s.path}: made with another verifier than {first.path}")
    if first.has_views:
        _check_windows_shards(stores)
        return _write_merged_windows(stores, output, force)
    return _write_merged_store(stores, output, force)


def _check_one_layout(stores: list[FeatureStore]) -> None:
    """Raise :class:`StoreMismatchError` unless every store has the first one's layout (``--context``)."""
    for s in stores[1:]:
        if s.context != stores[0].context:
            raise StoreMismatchError(
                f"{s.path} was extracted with --context {s.context}, {stores[0].path} with --context "
                f"{stores[0].context}: shards of one run share --context; extract the odd ones again")


def _check_windows_shards(stores: list[FeatureStore]) -> None:
    """The shards of one full-context extraction: one ``--max-context``, one plan (the ``context``
    counts, the training blocks and their views, equal in every shard) and, together, every context
    block of the plan once.

    Raises:
        StoreMismatchError: naming the shard and what differs.
    """
    first, n = stores[0], len(stores)
    plan = first.attrs.get("context") or {}
    for s in stores[1:]:
        theirs = s.attrs.get("context") or {}
        if theirs.get("max_context") != plan.get("max_context"):
            raise StoreMismatchError(f"{s.path}: extracted with --max-context {theirs.get('max_context')}, "
                                     f"{first.path} with --max-context {plan.get('max_context')}; shards of one run "
                                     "share --max-context: extract the odd ones again")
        if theirs != plan:
            raise StoreMismatchError(f"{s.path}: its context plan {theirs} differs from {first.path}'s {plan} "
                                     "(made by another peagle version?): extract the shards again with one")
        keys = [(s, first, k) for k in ("n_blocks", "n_tokens", "max_segments")]
        keys += [(s.contexts, first.contexts, k) for k in ("block_size", "max_segments")]
        for a, b, key in keys:
            if a.attrs.get(key) != b.attrs.get(key):
                raise StoreMismatchError(f"{a.path}: {key} {a.attrs.get(key)!r} differs from {b.path}'s "
                                         f"{b.attrs.get(key)!r} (another plan): extract the shards again with one "
                                         "peagle version")
        if not np.array_equal(s.views(), first.views()) or \
                not np.array_equal(s.n_tokens_per_block(), first.n_tokens_per_block()):
            raise StoreMismatchError(f"{s.path}: its training blocks' views differ from {first.path}'s (another "
                                     "plan): extract the shards again with one peagle version")
    total = int(first.attrs["shard"].get("context_blocks", -1))
    for i, s in enumerate(stores):
        want = len(range(i, total, n))
        if s.contexts.n_blocks != want:
            raise StoreMismatchError(f"{s.path}: {s.contexts.n_blocks} context blocks, shard {i} of {n} of a plan of "
                                     f"{total} context blocks holds {want}")


def _write_merged_windows(stores: list[FeatureStore], output, force: bool) -> dict[str, Any]:
    """The merged full-context store: shard 0's root (training blocks, views, ``n_tokens``, ``token_freq``)
    and context block ``s + k*N`` = block k of shard s's sub-store; ``contexts/token_freq`` summed."""
    first, n = stores[0], len(stores)
    grids = [s.contexts for s in stores]
    total = sum(g.n_blocks for g in grids)
    attrs = dict(first.attrs)
    out = FeatureStore.create_windows(
        output, n_blocks=first.n_blocks, block_size=first.block_size, max_segments=int(attrs["max_segments"]),
        n_context_blocks=total, context_size=grids[0].block_size,
        context_segments=int(grids[0].attrs["max_segments"]), layers=first.layers, hidden_size=first.hidden_size,
        vocab_size=first.vocab_size, verifier=attrs["verifier"], tokenizer=attrs.get("tokenizer"),
        source=attrs.get("source", ""), storage_dtype=first.storage_dtype, compressor=attrs.get("compressor"),
        n_tokens=first.n_tokens, n_context_tokens=sum(g.n_tokens for g in grids), force=force,
        extra={"merged_from": [{"path": str(s.path), "shard_index": i} for i, s in enumerate(stores)],
               "engine": _merged_engine(stores), "context": attrs.get("context"),
               "layer_convention": attrs.get("layer_convention")})
    views = first.views()
    for i in range(first.n_blocks):
        out.write_token_row(i, first.read_tokens(i))
        out.write_views(i, views[i])  # padded with -1 as written
    out.write_all_n_tokens(first.n_tokens_per_block())
    out.set_token_freq(first.token_freq())
    keys = first.segment_keys()
    if keys is not None:  # the root is every shard's; a store made before peagle recorded keys has none
        out.write_segment_keys(list(keys))
    _copy_blocks(grids, out.contexts, n)
    out.update_attrs(tokens_written=True)
    return out.summary()


def _copy_blocks(stores: list[FeatureStore], out: FeatureStore, n: int) -> None:
    """Block k of ``stores[s]`` to block ``s + k*n`` of ``out`` (token arrays, hidden states, ``n_tokens``,
    done), ``token_freq`` summed.

    Raises:
        ChunkDamageError: a shard's chunk is missing, truncated or fails its crc32c checksum, naming the
            shard, the block and the command that re-extracts it.
    """
    n_tokens = np.zeros(out.n_blocks, dtype=np.int32)
    hidden = {spec.name: out.group[spec.name].with_config({"write_empty_chunks": True})
              for spec in hidden_arrays(out.storage_dtype)}
    for s_index, s in enumerate(stores):
        per_block = s.n_tokens_per_block()
        for k in range(s.n_blocks):
            g = s_index + k * n
            try:  # both reads check every chunk's crc32c: a damaged shard block is not copied
                out.write_token_row(g, s.read_tokens(k))
                for name, arr in hidden.items():
                    arr[g] = s.zarr_chunk(name, k)
            except ChunkDamageError as e:
                raise ChunkDamageError(s.damage_message(k, str(e))) from None
            n_tokens[g] = per_block[k]
    out.write_all_n_tokens(n_tokens)
    out.set_token_freq(np.sum([s.token_freq() for s in stores], axis=0))
    keys = [s.segment_keys() for s in stores]
    if out.holds_segments and all(k is not None for k in keys):  # every shard recorded them
        rows: list = [None] * out.n_blocks
        for s_index, k in enumerate(keys):
            for j, row in enumerate(k):
                rows[s_index + j * n] = row  # padded rows: their repeats add no key
        out.write_segment_keys(rows)
    for g in range(out.n_blocks):
        out.mark_done(g)


def _engine_name(store) -> str:
    """The ``--engine`` a feature store was extracted with (stores older than the option: ``hf``)."""
    return (store.attrs.get("engine") or {}).get("name", "hf")


def _merged_engine(stores) -> dict[str, Any]:
    """The merged store's ``engine`` attribute: the shards' when they agree, else their name and each
    shard's record under ``shards`` (e.g. servers of different tensor parallel sizes)."""
    records = [s.attrs.get("engine") or {"name": "hf"} for s in stores]
    if all(r == records[0] for r in records):
        return records[0]
    return {"name": records[0]["name"], "shards": records}


def _write_merged_store(stores, output, force: bool) -> dict[str, Any]:
    first, n = stores[0], len(stores)
    total = sum(s.n_blocks for s in stores)
    attrs = dict(first.attrs)
    out = FeatureStore.create(
        output, n_blocks=total, block_size=first.block_size,
        max_segments=max(int(s.attrs["max_segments"]) for s in stores), layers=first.layers,
        hidden_size=first.hidden_size, vocab_size=first.vocab_size, verifier=attrs["verifier"],
        tokenizer=attrs.get("tokenizer"), source=attrs.get("source", ""), storage_dtype=first.storage_dtype,
        compressor=attrs.get("compressor"), n_tokens=sum(s.n_tokens for s in stores), force=force,
        extra={"merged_from": [{"path": str(s.path), "shard_index": i} for i, s in enumerate(stores)],
               "engine": _merged_engine(stores),
               # the shards' own convention: shards of an older peagle stay recognisable as such
               "layer_convention": attrs.get("layer_convention")})
    _copy_blocks(stores, out, n)
    out.update_attrs(tokens_written=True)
    return out.summary()
