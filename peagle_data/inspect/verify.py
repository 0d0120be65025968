"""``peagle-data verify`` and ``inspect``: check a feature store (optionally its token ids against the packed table
it was extracted from) or a token table; one report and, when it fails, one line saying what to do."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stores.errors import StoreMismatchError
from stores.features.feature_repair import verify_store
from stores.features.feature_store import FeatureStore
from stores.files import is_zarr_store
from stores.merge import verify_table
from stores.tables.token_tables import TokenTable, manifest_sha256

__all__ = ["InspectConfig", "VerifyConfig", "verify_output", "inspect_output", "store_state", "EXIT_DAMAGED",
           "EXIT_UNFINISHED"]


@dataclass(frozen=True, kw_only=True)
class InspectConfig:
    """What ``peagle-data inspect`` describes."""

    path: str
    """A token table (tokenize or pack output) or a feature store."""


@dataclass(frozen=True, kw_only=True)
class VerifyConfig:
    """What ``peagle-data verify`` checks, and whether it repairs."""

    store: str
    """A feature store, or a token table (its totals, unique row sources and window ids, and for a
    merged table the union of its shards)."""
    packed: str | None = None
    """Also check token ids against this packed table."""
    repair: bool = field(default=False, metadata={"action": True})
    """Clear the done flag of every bad block, so that extract with its resume option extracts them again."""


def _expected_tokens(store: str, packed: str):
    """``block index -> input_ids`` of ``packed``'s blocks that ``store`` holds (a shard store holds
    blocks ``shard_index, shard_index + num_shards, ...``; a full-context store, shard or not, every
    block: its shards split the context blocks).

    Raises:
        StoreMismatchError: ``packed`` is no packed table, or not the table the store was made from.
    """
    table = TokenTable.open(packed)
    if table.kind != "packed":
        raise StoreMismatchError(f"--packed {packed}: expected a packed table, got a {table.kind} table")
    opened = FeatureStore.open(store)
    attrs = opened.attrs
    if attrs.get("source") != manifest_sha256(packed):
        raise StoreMismatchError(f"--packed {packed}: the store was made from another packed table "
                                 f"(manifest sha256 {attrs.get('source')}, this table {manifest_sha256(packed)})")
    rows = list(table.iter_rows(["input_ids"]))
    shard = {} if opened.has_views else attrs.get("shard") or {}
    rows = rows[shard.get("shard_index", 0)::shard.get("num_shards", 1)]
    return lambda i: rows[i]["input_ids"]


EXIT_DAMAGED = 1
"""``peagle-data verify``'s exit code for a store with damage (or a table that failed its checks)."""
EXIT_UNFINISHED = 3
"""``peagle-data verify``'s exit code for a store with blocks not extracted yet and no damage."""


def store_state(report: dict[str, Any]) -> str:
    """``"complete"``, ``"unfinished"`` (blocks not done yet, no damage in the done ones), ``"streaming"`` (a
    streamed store, docs/design.md §7: its blocks not done are evicted or still to come, no damage) or ``"damaged"``
    (a bad block, a damaged whole-store array; full-context stores: also of the context blocks)."""
    parts = [report, report.get("contexts") or {}]
    if any(r.get("bad_blocks") or r.get("damaged_arrays") for r in parts):
        return "damaged"
    if report.get("stream") is not None and report["not_done"]:
        return "streaming"  # blocks evicted or not extracted yet by a streaming run: no damage
    return "complete" if report["ok"] else "unfinished"


def _store_unfinished(path: str, report: dict[str, Any]) -> str:
    """The line of an undamaged store with blocks still to extract: how many are done and the command that
    extracts the rest."""
    contexts = report.get("contexts")
    if report["blocks_done"] is None:  # a full-context shard store: its training blocks are done once merged
        done = "its training blocks are done once the shards are merged"
    else:
        done = f"{report['blocks_done']} of {report['n_blocks']} {'training ' if contexts else ''}blocks done"
    if contexts is not None:
        done += f" ({contexts['blocks_done']} of {contexts['n_blocks']} context blocks)"
    command = FeatureStore.open(path).repair_command()
    return (f"store {path} is unfinished: {done}; no damage found in the blocks done. {command} extracts the rest "
            "(peagle-train trains on the blocks done with --allow-incomplete)")


def _store_failure(store: str, report: dict[str, Any]) -> str:
    """The error line of a store that failed verification: the blocks at fault and how to redo them. A streamed
    store's blocks not done are evicted or still to come, not at fault, and the way to redo the damaged ones is
    the streaming run's resume (``repair_command``'s full extraction would write every block, past the budget)."""
    damaged = "; ".join(report["damaged_arrays"].values())
    if report.get("stream") is not None:
        bad = sorted(int(k) for k in report["bad_blocks"])
        return (f"store {store} failed verification; damaged blocks: {bad}" + (f"; {damaged}" if damaged else "")
                + ("; their done flags are cleared" if report["repaired"] else
                   f"; stop the streaming run and run `peagle-data verify {store} --repair` to clear their done flags")
                + "; then resume the run (`peagle-train ... --resume`, or `peagle-data extract ... --stream` again): "
                "its extraction writes them again before the trainer reads them (blocks not done are evicted or "
                "still to come, not damage)")
    bad = sorted(set(report["not_done"]) | set(int(k) for k in report["bad_blocks"]))
    command = FeatureStore.open(store).repair_command()
    contexts = report.get("contexts")  # a full-context store: the verifier's blocks are its context blocks
    if contexts is not None:
        at_fault = sorted(set(contexts["not_done"]) | set(int(k) for k in contexts["bad_blocks"]))
        return (f"store {store} failed verification; training blocks at fault: {bad}; context blocks at fault: "
                f"{at_fault}" + (f"; {damaged}" if damaged else "")
                + ("; the done flags of those context blocks are cleared" if report["repaired"] else "")
                + f". {command} extracts them again and rewrites damaged training blocks")
    return (f"store {store} failed verification; blocks at fault: {bad}"
            + (f"; {damaged}" if damaged else "")
            + ("; their done flags are cleared" if report["repaired"] else "")
            + f". {command} extracts them again")


def verify_output(path: str | Path, packed: str | Path | None = None,
                  repair: bool = False) -> tuple[dict[str, Any], str | None]:
    """Verify a feature store (shapes, dtypes, done flags, chunk files, checksums, NaN/Inf, and with
    ``packed`` its token ids) or a token table (totals, unique row sources / window ids, a merged
    table's shards).

    Args:
        path: a feature store or a token table directory.
        packed: the packed table the store was extracted from (stores only).
        repair: clear the done flag of every bad block of a store, so that ``extract --resume``
            extracts them again.

    Returns:
        ``(report, failure)``: the JSON-able report, and None when it passed, else one line naming
        what is at fault. A store's report has ``state`` (:func:`store_state`): ``"unfinished"`` (blocks
        not done, no damage: the line says how many are done and the resume command) or ``"damaged"``.

    Raises:
        StoreMismatchError: ``packed`` is not the store's packed table.
        StoreFormatError: ``path`` is neither a store nor a table.
    """
    if (Path(path) / "manifest.json").is_file():
        report = verify_table(path)
        return report, (None if report["ok"] else f"table {path} failed verification: {'; '.join(report['problems'])}")
    expected = _expected_tokens(str(path), str(packed)) if packed is not None else None
    report = verify_store(path, expected_tokens=expected, repair=repair)
    report["state"] = store_state(report)
    if report["state"] == "unfinished":
        return report, _store_unfinished(str(path), report)
    return report, (None if report["ok"] else _store_failure(str(path), report))


def inspect_output(path: str | Path) -> dict[str, Any]:
    """``peagle-data inspect``: a feature store's summary, or a token table's kind, rows and manifest
    (without its ``library_versions``), JSON-able.

    Raises:
        StoreFormatError: ``path`` is neither a store nor a table.
    """
    p = Path(path)
    if is_zarr_store(p):
        return FeatureStore.open(p).summary()
    table = TokenTable.open(p)
    return {"path": str(p), "kind": table.kind, "rows": table.num_rows,
            **{k: v for k, v in table.manifest.items() if k not in ("library_versions",)}}
