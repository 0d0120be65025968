"""``peagle-data extract``, ``inspect`` and ``verify``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from cli.common import echo_json, handle_errors, parse_int_list

__all__ = ["extract", "inspect_cmd", "verify"]


@click.command()
@click.argument("packed_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--verifier", required=True, help="MODEL: smollm2-135m, a local directory or a hub id.")
@click.option("--output", required=True, type=click.Path(), help="Feature store path (zarr v3).")
@click.option("--layers", callback=parse_int_list, default=None,
              help="Aux layers as HF hidden_states indices, e.g. 2,18,33 (default: 2, L//2, L-3).")
@click.option("--storage-dtype", type=click.Choice(["bf16", "fp8"]), default="bf16", show_default=True,
              help="bf16 (bit-exact) or fp8 (float8_e4m3fn with per-token, per-layer scales; half the bytes).")
@click.option("--compressor", type=click.Choice(["none", "zstd"]), default="none", show_default=True,
              help="Chunk compressor; none keeps chunks memory-mappable (activations barely compress).")
@click.option("--attn-implementation", type=click.Choice(["auto", "sdpa", "eager", "flash_attention_2"]),
              default="auto", show_default=True,
              help="auto: FlashAttention varlen on CUDA when installed, else SDPA with a block-diagonal mask.")
@click.option("--resume", is_flag=True,
              help="Continue an existing store: check every done block (reads it once) and extract the "
                   "blocks not done and the damaged ones.")
@click.option("--force", is_flag=True, help="Overwrite an existing store; skip the free-disk check.")
@click.option("--device", default=None, help="cpu or cuda (default: cuda when available).")
@click.option("--max-blocks", type=int, default=None, help="Stop after this many blocks (resumable).")
@click.option("--num-shards", metavar="N", type=click.IntRange(min=1), default=1, show_default=True,
              help="Split the packed blocks into N shard stores (block I, I+N, ... go to shard I).")
@click.option("--shard-index", metavar="I", type=click.IntRange(min=0), default=0, show_default=True,
              help="The shard this run writes, 0..N-1; `peagle-data merge` joins the N stores.")
@handle_errors
def extract(packed_dir, verifier, output, layers, storage_dtype, compressor, attn_implementation, resume, force, device,
            max_blocks, num_shards, shard_index):
    """Run the verifier over PACKED_DIR and write hidden states into a feature store."""
    from peagle_data.extract import ExtractConfig, run_extract

    try:
        cfg = ExtractConfig(packed=packed_dir, verifier=verifier, output=output, layers=layers,
                            storage_dtype=storage_dtype,
                            compressor=None if compressor == "none" else compressor,
                            attn_implementation=attn_implementation, resume=resume, force=force, device=device, max_blocks=max_blocks,
                            num_shards=num_shards, shard_index=shard_index)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    summary = run_extract(cfg, log=lambda m: click.echo(m, err=True))
    echo_json(summary)


@click.command()
@click.argument("path", type=click.Path(exists=True))
@handle_errors
def inspect_cmd(path):
    """Describe a token table or a feature store, as JSON."""
    from stores.feature_store import FeatureStore
    from stores.token_tables import TokenTable

    p = Path(path)
    if (p / "zarr.json").is_file():
        info = FeatureStore.open(p).summary()
    else:
        table = TokenTable.open(p)
        info = {"path": str(p), "kind": table.kind, "rows": table.num_rows,
                **{k: v for k, v in table.manifest.items() if k not in ("library_versions",)}}
    echo_json(info)  # JSON, like verify: scripts parse it


@click.command()
@click.argument("store", type=click.Path(exists=True))
@click.option("--packed", type=click.Path(exists=True, file_okay=False), default=None,
              help="Also check token ids against this packed table.")
@click.option("--repair", is_flag=True,
              help="Clear the done flag of every bad block, so that `extract --resume` extracts them again.")
@handle_errors
def verify(store, packed, repair):
    """Check a feature store: shapes, dtypes, done flags, chunk files, checksums, NaN/Inf, token ids.

    STORE may also be a token table: its totals and unique row sources / window ids, and for a
    table made by `peagle-data merge` the union of its shards.
    """
    from stores.feature_store import verify_store

    if (Path(store) / "manifest.json").is_file():
        _verify_table(store)
        return
    from stores.token_tables import TokenTable

    from stores.errors import StoreMismatchError
    from stores.feature_store import FeatureStore
    from stores.token_tables import manifest_sha256

    expected = None
    if packed is not None:
        table = TokenTable.open(packed)
        if table.kind != "packed":
            raise StoreMismatchError(f"--packed {packed}: expected a packed table, got a {table.kind} table")
        source = FeatureStore.open(store).attrs.get("source")
        if source != manifest_sha256(packed):
            raise StoreMismatchError(f"--packed {packed}: the store was made from another packed table "
                                     f"(manifest sha256 {source}, this table {manifest_sha256(packed)})")
        rows = list(table.iter_rows(["input_ids"]))
        shard = FeatureStore.open(store).attrs.get("shard") or {}
        rows = rows[shard.get("shard_index", 0)::shard.get("num_shards", 1)]  # a shard store's blocks
        expected = lambda i: rows[i]["input_ids"]  # noqa: E731
    report = verify_store(store, expected_tokens=expected, repair=repair)
    echo_json(report)
    if not report["ok"]:
        bad = sorted(set(report["not_done"]) | set(int(k) for k in report["bad_blocks"]))
        damaged = "; ".join(report["damaged_arrays"].values())
        click.echo(f"Error: store {store} failed verification; blocks at fault: {bad}"
                   + (f"; {damaged}" if damaged else "")
                   + ("; their done flags are cleared" if report["repaired"] else "")
                   + ". `peagle-data extract PACKED --resume` (same --verifier and --layers) extracts "
                     "them again", err=True)
        sys.exit(1)


def _verify_table(path) -> None:
    from stores.merge import verify_table

    report = verify_table(path)
    echo_json(report)
    if not report["ok"]:
        click.echo(f"Error: table {path} failed verification: {'; '.join(report['problems'])}", err=True)
        sys.exit(1)


if __name__ == "__main__":  # `python -m cli.data_extract` (used by accelerate launch -m in tests)
    extract()
