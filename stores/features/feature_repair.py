"""Damage checks, ``verify`` and repair of a feature store (docs/design.md §7): the store's repair policy.

A block's data is trusted when every chunk exists, has the right size, passes its crc32c checksum
and its hidden states are finite; a done block that fails is listed (and, with ``repair``, its done
flag cleared so ``extract --resume`` extracts it again). On ``extract --resume`` the damaged whole-store
arrays are rewritten from the packed rows (:func:`repair_shared`) and each rank's damaged blocks are
made not done (:func:`repair_blocks`); whether a store may be resumed with a verifier, layers and a
packed table is :func:`check_compatible`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from stores.features.chunk_files import CHECKSUM_BYTES, raw_chunk_damage
from stores.errors import StoreFormatError, StoreMismatchError
from stores.features.feature_store import LAYER_CONVENTION, FeatureStore
from stores.files import is_local
from stores.stream.session import StreamSession

__all__ = ["chunk_damage", "block_damage", "shared_damage", "read_done_flags", "check_block", "verify_store", "stream_report",
           "check_compatible", "write_shared", "repair_shared", "windows_damage", "repair_windows", "repair_blocks"]


def chunk_damage(store: FeatureStore, name: str, i: int) -> str | None:
    """Why chunk ``i`` of array ``name`` cannot be trusted, or None when it reads back intact.

    Checks that a local chunk file exists and (uncompressed stores) has exactly its data bytes
    plus the 4 checksum bytes, then reads it through zarr, which verifies the crc32c checksum:
    a missing, truncated, empty, unreadable or altered chunk is named with its path.
    """
    arr = store.array(name)
    path = store.chunk_path(name, i)
    where = f"{name} chunk {path}" if path is not None else f"{name} chunk {i}"
    if path is not None:
        if not path.is_file():
            return f"{where} is {'not a regular file' if path.exists() else 'missing'}"
        if store.raw_chunks:
            want = int(np.prod(arr.chunks)) * arr.dtype.itemsize + CHECKSUM_BYTES
            size = path.stat().st_size
            if size != want:
                return f"{where} is {size} bytes, expected {want} ({'empty' if size == 0 else 'truncated or foreign'})"
            return raw_chunk_damage(path, where)  # the crc32c of the raw bytes, ~5x faster than zarr
    try:
        arr[i]
    except Exception as e:  # checksum mismatch, undecodable bytes, permission denied
        return f"{where} is unreadable ({type(e).__name__}: {e})"
    return None


def block_damage(store: FeatureStore, i: int) -> str | None:
    """The first damaged chunk of block ``i``'s data (see :func:`chunk_damage`), or None."""
    for name in store.block_arrays():
        reason = chunk_damage(store, name, i)
        if reason is not None:
            return f"block {i}: {reason}"
    return None


def shared_damage(store: FeatureStore) -> dict[str, str]:
    """``{array: reason}`` for the whole-store arrays ``n_tokens`` and ``token_freq`` (one chunk each;
    ``token_freq`` only once extraction has written it, attribute ``tokens_written``)."""
    names = ["n_tokens"] + (["token_freq"] if store.attrs.get("tokens_written") else [])  # both set by extract
    names += ["segment_keys"] if store.attrs.get("segment_keys") else []
    found = {name: chunk_damage(store, name, 0) for name in names}
    store.forget_n_tokens()
    return {name: reason for name, reason in found.items() if reason is not None}


def read_done_flags(store: FeatureStore) -> tuple[np.ndarray, dict[int, str]]:
    """``([N] bool done flags, {block: reason})``: a block whose flag chunk is damaged reads as
    not done and is listed with the reason (``done_mask`` would raise)."""
    try:
        return store.done_mask(), {}
    except Exception:  # one flag chunk is damaged: read them one by one
        pass
    done = np.zeros(store.n_blocks, dtype=bool)
    bad: dict[int, str] = {}
    for i in range(store.n_blocks):
        reason = chunk_damage(store, "done", i)
        if reason is not None:
            bad[i] = f"block {i}: its done flag's {reason}"
        else:
            done[i] = bool(store.group["done"][i])
    return done, bad


def _nonfinite(x: torch.Tensor) -> bool:
    """Whether a bf16 tensor holds a NaN or Inf: exponent bits all ones (no float copy)."""
    bits = x.contiguous().view(torch.int16).numpy()  # numpy: ~8x faster than the same torch ops on CPU
    return bool(((bits & 0x7F80) == 0x7F80).any())


def check_block(store: FeatureStore, i: int, expected_ids=None) -> str | None:
    """Why done block ``i`` cannot be trusted (the first problem found), or None.

    Every chunk of the block must be present, of the right size and pass its checksum
    (:func:`block_damage`); the hidden states must be finite; and, when ``expected_ids [T]`` is
    given (the packed table's row), ``input_ids`` must equal it.
    """
    reason = block_damage(store, i)
    if reason is not None:
        return reason
    try:
        block = store.read_block(i)
    except Exception as e:  # e.g. a damaged n_tokens chunk
        return f"block {i}: cannot be read ({type(e).__name__}: {e})"
    if _nonfinite(block.aux_hidden) or _nonfinite(block.final_hidden):
        return f"block {i}: NaN or Inf in hidden states"
    if expected_ids is not None:
        exp = np.asarray(expected_ids)
        if len(exp) != block.n_tokens or not np.array_equal(exp, block.input_ids.numpy()):
            return f"block {i}: input_ids differ from the packed table"
    return None


def verify_store(path: str | os.PathLike, expected_tokens=None, repair: bool = False) -> dict[str, Any]:
    """Check a store: format, shapes and dtypes, done flags, chunk files, checksums, NaN/Inf, token ids.

    Args:
        expected_tokens: optional callable ``i -> (input_ids [T] array)`` from the packed table.
        repair: clear the done flag of every bad block (and rewrite damaged flag chunks), so that
            ``peagle-data extract --resume`` extracts exactly those blocks again.

    Returns:
        ``{"ok": bool, "n_blocks", "blocks_done", "not_done": [...], "bad_blocks": {id: reason},
        "damaged_arrays": {name: reason}, "repaired": [ids]}`` (``n_tokens``/``token_freq`` damage
        is repaired by ``extract --resume``, which rewrites them from the packed table).

    Raises:
        StoreFormatError: the store cannot be opened at all, or an array is missing or misshapen.
    """
    store = FeatureStore.open(path, mode="r+" if repair else "r")
    if store.has_views:
        report = _verify_windows(store, path, expected_tokens, repair)
    else:
        report = _verify_blocks(store, path, expected_tokens, repair)
    session = StreamSession(store)
    plan = session.read_plan() if is_local(str(path)) and session.has_plan() else None
    if plan is not None:  # a streamed store: blocks not done are evicted or not extracted yet, not damage
        grid = report.get("contexts") or {}
        report["stream"] = stream_report(session, report["not_done"], grid.get("not_done"))
        report["ok"] = not any(r.get("bad_blocks") or r.get("damaged_arrays") for r in (report, grid))
    return report


def stream_report(session: StreamSession, not_done: list[int], contexts_not_done: list[int] | None = None
                  ) -> dict[str, Any]:
    """What ``verify`` says of a streamed store's blocks that are not done (docs/design.md §7 "Streaming"),
    ``session`` holding the store's plan: the plan's ``policy``, ``consumed`` of ``n_entries``, and the not-done
    blocks by why: ``consumed`` (every entry reading them is consumed: evicted, or a block the run no longer reads),
    ``pending`` (an unconsumed entry reads them: extraction writes them when the window reaches them), ``unused``
    (the plan never reads them: validation blocks past ``--val-max-blocks``, or past the run's steps). A
    full-context store's ``not_done`` are training blocks (a context block they read is not done), and ``contexts``
    sorts its context blocks that are not done, ``contexts_not_done``, the same way (``pending``: read by the
    training block of an unconsumed entry or by a validation block)."""
    plan, consumed = session.plan, session.consumed()
    ahead = set(plan.order[consumed:].tolist()) | set(plan.val_blocks)
    ever = set(plan.order.tolist()) | set(plan.val_blocks)
    report = {"policy": plan.policy, "consumed": consumed, "n_entries": plan.n_entries, "window": plan.window,
              "output": plan.run.get("output"), **_sort_not_done(not_done, ahead, ever)}
    if plan.reads is not None:
        report["contexts"] = _sort_not_done(contexts_not_done or [], {u for b in ahead for u in plan.units_of(b)},
                                            {u for b in ever for u in plan.units_of(b)})
    return report


def _sort_not_done(not_done: list[int], ahead: set[int], ever: set[int]) -> dict[str, Any]:
    """``pending`` (in ``ahead``), ``unused`` (not in ``ever``) and the count of the others, ``consumed_blocks``."""
    pending = sorted(b for b in not_done if b in ahead)
    unused = sorted(b for b in not_done if b not in ever)
    return {"pending": pending, "unused": unused, "consumed_blocks": len(not_done) - len(pending) - len(unused)}


def _verify_windows(store: FeatureStore, path, expected_tokens, repair: bool) -> dict[str, Any]:
    """:func:`verify_store` of a full-context store: its context blocks as any store's (``contexts``: that
    report; ``repaired`` lists context blocks), its training blocks by :func:`windows_damage`."""
    _check_arrays(store, path)
    grid = _verify_blocks(store.contexts, f"{path}/contexts", None, repair)
    bad = windows_damage(store, expected_tokens)
    shared = {**shared_damage(store), **{f"contexts/{k}": v for k, v in grid["damaged_arrays"].items()}}
    bad.update({i: f"{reason} (the context block it reads)" for i, reason in _blocks_reading(store, grid["bad_blocks"]).items()})
    if store.attrs.get("shard"):  # its training blocks read the other shards' context blocks too: no done state
        done, ok = None, grid["ok"] and not bad and not shared
    else:
        context_done = np.ones(store.contexts.n_blocks, dtype=bool)
        context_done[grid["not_done"]] = False
        done = _training_done(store, context_done)
        ok = grid["ok"] and not bad and not shared and bool(done.all())
    return {
        "ok": ok,
        "n_blocks": store.n_blocks,
        "blocks_done": None if done is None else int(done.sum()),
        "not_done": [] if done is None else np.flatnonzero(~done).tolist(),
        "bad_blocks": bad,
        "damaged_arrays": shared,
        "repaired": grid["repaired"],
        "contexts": grid,
    }


def _training_done(store: FeatureStore, context_done: np.ndarray) -> np.ndarray:
    """``[N] bool``: :meth:`FeatureStore.done_mask` of a full-context store from its context blocks'
    done flags; a training block whose views chunk is damaged reads as not done."""
    done = np.zeros(store.n_blocks, dtype=bool)
    for i in range(store.n_blocks):
        views = _views_or_none(store, i)
        if views is not None:
            m = views[:, 0]
            done[i] = bool(context_done[m[m >= 0]].all())
    return done


def _views_or_none(store: FeatureStore, i: int) -> np.ndarray | None:
    """Training block ``i``'s views, None when their chunk is damaged."""
    try:
        return store.view_row(i)
    except Exception:  # a damaged views chunk (listed among the bad blocks)
        return None


def _blocks_reading(store: FeatureStore, bad_contexts: dict[int, str]) -> dict[int, str]:
    """``{training block: the reason of the first bad context block it reads}`` (``bad_contexts``: blocks
    of the sub-store, a shard's numbered in the shard)."""
    if not bad_contexts:
        return {}
    local = _local_context_block(store)
    out = {}
    for i in range(store.n_blocks):
        views = _views_or_none(store, i)
        hit = [] if views is None else [local(int(c)) for c in views[:, 0] if c >= 0 and local(int(c)) in bad_contexts]
        if hit:
            out[i] = f"context {bad_contexts[hit[0]]}"
    return out


def _verify_blocks(store: FeatureStore, path, expected_tokens, repair: bool) -> dict[str, Any]:
    """:func:`verify_store` of a store of blocks (a window-context store, or a full-context store's context blocks)."""
    _check_arrays(store, path)
    shared = shared_damage(store)
    done, problems = read_done_flags(store)
    for i in np.flatnonzero(done).tolist():
        if "n_tokens" in shared:  # block lengths unknown: only the chunks themselves can be checked
            reason = block_damage(store, i)
        else:
            reason = check_block(store, i, None if expected_tokens is None else expected_tokens(i))
        if reason is not None:
            problems[i] = reason
    repaired = sorted(problems) if repair else []
    for i in repaired:
        store.clear_done(i)
        done[i] = False
    return {
        "ok": bool(done.all()) and not problems and not shared,
        "n_blocks": store.n_blocks,
        "blocks_done": int(done.sum()),
        "not_done": np.flatnonzero(~done).tolist(),
        "bad_blocks": problems,
        "damaged_arrays": shared,
        "repaired": repaired,
    }


_CHECKED_ROLES = ("token", "hidden", "flag", "views")
"""The arrays ``verify`` checks the shape and dtype of (those it always did)."""


def _check_arrays(store: FeatureStore, path) -> None:
    """Every array is present with the shape and dtype the attributes imply (StoreFormatError otherwise)."""
    g, sizes = store.group, store.sizes()
    specs = store.array_specs()
    for spec in specs:
        if spec.role not in _CHECKED_ROLES:
            continue
        shape, dtype = spec.shape(sizes), spec.dtype
        if spec.name not in g:
            raise StoreFormatError(f"{path}: array {spec.name!r} is missing")
        arr = g[spec.name]
        if tuple(arr.shape) != shape or str(arr.dtype) != dtype:
            raise StoreFormatError(f"{path}: {spec.name} is {arr.shape} {arr.dtype}, expected {shape} {dtype}")


def check_compatible(store: FeatureStore, *, verifier: dict[str, Any], layers: list[int], source: str,
                     content_differs: Callable[[dict[str, Any]], str | None] | None = None) -> None:
    """Raise :class:`StoreMismatchError` when resuming ``store`` with another verifier, layers or table.

    The verifier: its ``name_or_path``, and its content: by ``content_differs`` where given (called with the
    store's ``verifier`` record, returns what differs, e.g. "config fields (num_hidden_layers)", or None when the
    content is the same), else by ``verifier["fingerprint"]``."""
    have = store.attrs
    if have.get("layer_convention") != LAYER_CONVENTION:
        raise StoreMismatchError(f"{store.path}: store has layer_convention {have.get('layer_convention')!r}, "
                                 "made by an older peagle; a resumed run would mix two conventions: extract "
                                 "again into a new --output (or --force)")
    if list(have["layers"]) != list(layers):
        raise StoreMismatchError(f"{store.path}: store has layers {have['layers']}, asked for {layers}")
    recorded = have["verifier"]
    differs = content_differs(recorded) if content_differs is not None and recorded.get("fingerprint") else None
    if differs is not None:
        raise StoreMismatchError(f"{store.path}: store was made with verifier {recorded.get('name_or_path')!r}, "
                                 f"another model than {verifier.get('name_or_path')!r} ({differs})")
    for key in ("name_or_path",) if content_differs is not None else ("name_or_path", "fingerprint"):
        if have["verifier"].get(key) != verifier.get(key):
            raise StoreMismatchError(
                f"{store.path}: store was made with verifier {have['verifier'].get(key)!r} ({key}), "
                f"asked for {verifier.get(key)!r}"
            )
    if have.get("source") != source:
        raise StoreMismatchError(f"{store.path}: store was made from another packed table "
                                 f"(manifest sha256 {have.get('source')!r}, now {source!r}: the table was packed "
                                 "again or its manifest changed); resume with the table it was made from, or start "
                                 "over with --force")


def write_shared(store: FeatureStore, rows) -> None:
    """Write the whole-store arrays ``n_tokens [N]`` and ``token_freq [V]`` from the packed rows, and
    ``segment_keys [N, S_max]`` when the rows have them (not in a ``contexts`` sub-store)."""
    V = store.vocab_size
    freq = np.zeros(V, dtype=np.int64)
    for i, r in enumerate(rows):
        ids = np.asarray(r["input_ids"], dtype=np.int64)[np.asarray(r["loss_mask"]) == 1]
        outside = ids[(ids < 0) | (ids >= V)]
        if outside.size:  # extract checks every id before the weights load: an invariant
            raise StoreMismatchError(f"{store.path}: block {i} holds token id {int(outside[0])} outside the "
                                     f"verifier's {V} ids; token_freq cannot count it")
        freq += np.bincount(ids, minlength=V)
    store.write_all_n_tokens(np.array([int(r["n_tokens"]) for r in rows], dtype=np.int32))
    store.set_token_freq(freq)
    if store.holds_segments and rows and all(r.get("segment_keys") is not None for r in rows):
        store.write_segment_keys([r["segment_keys"] for r in rows])  # packed tables since peagle recorded them


def repair_shared(store: FeatureStore, rows, log: Callable[[str], None]) -> dict[str, str]:
    """On --resume (main process): rewrite ``n_tokens``/``token_freq`` from the packed rows if damaged."""
    damaged = shared_damage(store)
    if damaged:
        for reason in damaged.values():
            log(f"{store.path}: {reason}; rewriting it from the packed table")
        write_shared(store, rows)
    return damaged


def windows_damage(store: FeatureStore, expected_tokens=None) -> dict[int, str]:
    """``{training block: reason}`` of a full-context store's root (docs/design.md §7): a damaged chunk of
    its token arrays or views (:func:`block_damage`), a view that does not fit, or tokens other than the
    context blocks hold at the view's slots; with ``expected_tokens`` (``i -> input_ids [T]``, the packed
    table's), tokens other than the packed table's. Context blocks not done are not compared, nor, in a
    shard store, those of the other shards (the tokens of the runs in this shard's context blocks are)."""
    problems: dict[int, str] = {}
    grid = store.contexts
    context_done = grid.done_mask()
    context_ids: dict[int, np.ndarray] = {}
    local = _local_context_block(store)
    for i in range(store.n_blocks):
        reason = block_damage(store, i)
        if reason is None:
            try:
                tok = store.read_tokens(i)
                runs = store.view_runs(i, tok["cu_seqlens"])
            except Exception as e:  # a damaged n_tokens, a view that does not fit
                reason = f"block {i}: cannot be read ({type(e).__name__}: {e})"
        if reason is None:
            ids, offset, parts = tok["input_ids"], 0, []
            for m, s, n in runs:
                k = local(m)
                if k is not None and context_done[k]:
                    if k not in context_ids:
                        context_ids[k] = grid.read_tokens(k)["input_ids"]
                    parts.append((ids[offset:offset + n], context_ids[k][s:s + n]))
                offset += n
            if any(not np.array_equal(a, b) for a, b in parts):
                reason = f"block {i}: its tokens differ from those its views read in the context blocks"
        if reason is None and expected_tokens is not None:
            exp = np.asarray(expected_tokens(i))
            if len(exp) != len(tok["input_ids"]) or not np.array_equal(exp, tok["input_ids"]):
                reason = f"block {i}: input_ids differ from the packed table"
        if reason is not None:
            problems[i] = reason
    return problems


def _local_context_block(store: FeatureStore) -> Callable[[int], int | None]:
    """Context block ``m`` of the whole extraction -> its block in ``store.contexts`` (a shard's sub-store
    holds blocks ``shard_index + k * num_shards`` as block k), None when another shard holds it."""
    shard = store.attrs.get("shard")
    if not shard:
        return lambda m: m
    n, i = int(shard["num_shards"]), int(shard["shard_index"])
    return lambda m: m // n if m % n == i else None


def repair_windows(store: FeatureStore, rows, views, log: Callable[[str], None]) -> dict[int, str]:
    """On --resume of a full-context store (main process): rewrite every damaged training block's token
    arrays and views from the packed rows and the plan's ``views`` (:func:`windows_damage`).

    Returns:
        ``{block: reason}`` of the blocks rewritten.
    """
    damaged = windows_damage(store)
    for i, reason in sorted(damaged.items()):
        log(f"{store.path}: {reason}; rewriting it from the packed table")
        store.write_token_row(i, rows[i])
        store.write_views(i, views[i])
    return damaged


def repair_blocks(store: FeatureStore, rows, rank: int, world: int, log: Callable[[str], None]) -> dict[int, str]:
    """On --resume: check this rank's share of the blocks and make every damaged one not done.

    A done block is damaged when :func:`check_block` finds a chunk missing,
    truncated, empty, unreadable or failing its checksum, non-finite hidden states, or ``input_ids``
    other than the packed row's (this reads every done block of the share once). A damaged done
    flag chunk counts as not done. Damaged blocks get their flag cleared, every not-done block of the
    share loses the temporary chunk files of writes a killed run left (``FeatureStore.write_leftovers``)
    and gets its token arrays rewritten from the packed row, so the extraction that follows makes the
    store byte-identical to an undamaged one.

    Returns:
        ``{block: reason}`` of the damaged blocks found by this rank.
    """
    done, damaged = read_done_flags(store)
    mine = range(rank, store.n_blocks, world)
    for i in (i for i in mine if done[i]):
        reason = check_block(store, i, rows[i]["input_ids"])
        if reason is not None:
            damaged[i] = reason
    damaged = {i: reason for i, reason in damaged.items() if i % world == rank}
    for i, reason in sorted(damaged.items()):
        log(f"{store.path}: {reason}; extracting block {i} again")
        store.clear_done(i)
        done[i] = False
    leftovers = store.write_leftovers(i for i in mine if not done[i])
    for path in leftovers:
        path.unlink(missing_ok=True)
    if leftovers:
        log(f"{store.path}: removed {len(leftovers)} temporary chunk file{'s' if len(leftovers) > 1 else ''} of "
            f"writes a killed run left (e.g. {leftovers[0]})")
    for i in (i for i in mine if not done[i]):
        r = rows[i]
        store.write_token_row(i, r)
    return damaged
