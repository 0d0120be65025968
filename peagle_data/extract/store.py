"""The feature-store side of extraction: create or resume the store, write blocks behind a queue.

Writes run on a background thread behind a bounded queue (:class:`BlockWriter`), so the next forward
overlaps the store write; a block's ``done`` flag is written after its data. What is about the store's
files (damage checks, repair on ``--resume``, the shared arrays written from the packed rows) is
:mod:`stores.features.feature_repair`; here is what is about the extraction run (its options, the verifier's
description). ``cfg`` is the run's :class:`peagle_data.extract.config.ExtractConfig` (not imported
here: that module imports the engines, which import this one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from peagle_data.extract.hf_forward import final_norm, language_model, layer_types
from stores.errors import DiskSpaceError, InputError, OutputExistsError, StoreFormatError
from stores.features.feature_repair import check_compatible, write_shared
from stores.features.feature_schema import bytes_per_token
from stores.features.feature_store import FeatureStore
from stores.files import disk_full_error, is_disk_full, is_local
from runtime.model_identity import compare_identity, identity_fingerprint
from stores.staging import ownership
from stores.tables.token_tables import TokenTable, manifest_sha256

__all__ = ["BlockWriter", "discard_block", "verifier_desc", "open_packed", "RESUME_HINT", "StoreAtOutput",
           "store_at_output", "open_or_create", "check_resumable", "RESUME_MAY_CHANGE", "check_same_plan"]


def _identity_differs(recorded: dict[str, Any], directory: Path) -> str | None:
    """What of the model in ``directory`` differs from a store's ``verifier`` record (by part, or by an older
    store's whole-file fingerprint: :func:`runtime.model_identity.compare_identity`), None when it is the same."""
    check = compare_identity(recorded, directory)
    return None if check.same else check.describe()


def verifier_desc(name: str, identity: dict[str, Any], verifier, dtype: torch.dtype) -> dict[str, Any]:
    """What the store records about the verifier: its content fingerprint and ``identity`` by part (the model
    directory's :func:`runtime.model_identity.model_identity`), the language model's shape and layer convention."""
    config = verifier.config
    text = config.get_text_config()
    decoder = language_model(verifier)
    return {
        "name_or_path": name,
        "fingerprint": identity_fingerprint(identity),
        "identity": identity,
        "architecture": (config.architectures or [type(verifier).__name__])[0],
        "language_model": type(decoder).__name__,
        "num_hidden_layers": len(decoder.layers),
        "hidden_size": text.hidden_size,
        "vocab_size": text.vocab_size,
        "layer_types": layer_types(decoder),
        "final_norm": type(final_norm(decoder)).__name__,
        "attn_implementation": getattr(text, "_attn_implementation", None),
        "dtype": str(dtype).replace("torch.", ""),
    }


def _check_disk(path: Path, needed_bytes: int, force: bool) -> None:
    probe = path if path.exists() else path.parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed_bytes > free and not force:
        raise DiskSpaceError(
            f"{path}: the store needs about {needed_bytes / 2**30:.2f} GiB but only "
            f"{free / 2**30:.2f} GiB are free; free disk or pass --force")


class BlockWriter:
    """A background thread that writes blocks and then their done flags, behind a bounded queue."""

    def __init__(self, store: FeatureStore, maxsize: int, lock: threading.Lock | None = None,
                 after_write: Callable[[int], None] | None = None):
        """``lock``: held around each block's write and ``after_write(i)`` (a streaming extraction's eviction
        holds it too, so its measure after a write sees the store as the write left it)."""
        self.store = store
        self.lock, self.after_write = lock or contextlib.nullcontext(), after_write
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.copy_stream = None  # a CUDA side stream for device-to-host copies, made on first use
        self.error: BaseException | None = None
        self.nonfinite: list[int] = []  # blocks left not done: NaN/Inf hidden states
        self.write_s = 0.0
        """Seconds the writer thread spent writing blocks (features with their crc32c, done flags)."""
        self.put_s = 0.0
        """Seconds :meth:`put` and :meth:`close` held the caller (a full queue, the last writes)."""
        self.thread = threading.Thread(target=self._run, name="peagle-store-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if self.error is not None:
                continue
            i, aux, final, copied, device_refs = item
            item = None
            try:
                if copied is not None:
                    copied.synchronize()  # the device-to-host copy into pinned memory is done
                device_refs = None  # the device tensors may now return to the allocator
                t0 = time.perf_counter()
                with self.lock:
                    self.store.write_features(i, aux, final)
                    if torch.isfinite(aux).all() and torch.isfinite(final).all():
                        self.store.mark_done(i)
                    else:  # verify would reject it: never mark it done
                        self.nonfinite.append(i)
                    if self.after_write is not None:
                        self.after_write(i)
                self.write_s += time.perf_counter() - t0
            except BaseException as e:  # reported on the main thread
                if is_disk_full(e):  # one line naming the disk (cli.common.handle_errors), no half-written block
                    discard_block(self.store, i)
                    e = disk_full_error(e, self.store.path)
                self.error = e

    def put(self, i: int, aux: torch.Tensor, final: torch.Tensor) -> None:
        """Queue block ``i`` (``aux [T, L, H]``, ``final [T, H]``, bf16, CPU or CUDA).

        CUDA tensors are copied into pinned host memory on a side stream that waits only for the
        forward that made them, so the copy runs while the compute stream starts the next block's
        forward; the writer thread waits on the copy's event, and the device tensors are kept alive
        (queue item) until then, so the caching allocator cannot hand their memory out early.
        Blocks (back-pressure) when ``maxsize`` blocks are already queued.
        """
        self._raise()
        copied, device_refs = None, None
        if aux.device.type == "cuda":
            if self.copy_stream is None:
                self.copy_stream = torch.cuda.Stream(device=aux.device)
            self.copy_stream.wait_stream(torch.cuda.current_stream(aux.device))
            aux_h = torch.empty(aux.shape, dtype=aux.dtype, pin_memory=True)
            final_h = torch.empty(final.shape, dtype=final.dtype, pin_memory=True)
            with torch.cuda.stream(self.copy_stream):
                aux_h.copy_(aux, non_blocking=True)
                final_h.copy_(final, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.copy_stream)
            device_refs = (aux, final)
            aux, final = aux_h, final_h
        t0 = time.perf_counter()
        self.queue.put((i, aux, final, copied, device_refs))
        self.put_s += time.perf_counter() - t0

    def close(self) -> None:
        t0 = time.perf_counter()
        self.queue.put(None)
        self.thread.join()
        self.put_s += time.perf_counter() - t0
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error


def discard_block(store: FeatureStore, i: int) -> list[Path]:
    """Remove what a failed write (a full disk) left of block ``i``, which is not done: its feature chunk files,
    zarr's temporary files of its chunks (:meth:`FeatureStore.write_leftovers`) and the chunk directories left
    empty; ``--resume`` extracts the block again. Writes nothing (the disk may be full). A remote store: ``[]``.

    Returns:
        The paths removed.
    """
    if not is_local(store.path) or store.is_done(i):
        return []
    removed = []
    for path in [*store.write_leftovers([i]), *store.feature_chunk_paths(i)]:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            removed.append(path)
    root = Path(store.path).resolve()
    for name in store.block_arrays():
        parent = store.chunk_path(name, i).parent
        while parent.resolve() != root and parent.name != "c" and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            removed.append(parent)
            parent = parent.parent
    return removed


def open_packed(path: str) -> TokenTable:
    try:
        table = TokenTable.open(path)
    except StoreFormatError as e:  # its message names the path (and says what is there instead)
        raise InputError(str(e)) from e
    if table.kind != "packed":
        raise InputError(f"expected a packed table (peagle-data pack), got a {table.kind} table", file=path)
    return table


def _create_store(cfg, rows, table: TokenTable, desc: dict, layers: list[int],
                  log: Callable[[str], None], engine: dict[str, Any]) -> FeatureStore:
    block_size = int(table.manifest.get("parameters", {}).get("block_size") or 0)
    block_size = max([block_size] + [int(r["n_tokens"]) for r in rows])
    max_segments = max((len(r["cu_seqlens"]) - 1 for r in rows), default=1)
    H, V = desc["hidden_size"], desc["vocab_size"]
    per_token = bytes_per_token(len(layers), H, cfg.storage_dtype)
    projected = len(rows) * block_size * per_token
    out = Path(cfg.output)
    log(f"projected store size: {projected / 2**20:.1f} MiB for {len(rows)} blocks of {block_size} "
        f"token slots ({per_token} bytes per token, {cfg.storage_dtype})")
    if is_local(cfg.output):
        _check_disk(out, projected, cfg.force)
    store = FeatureStore.create(
        cfg.output, compressor=cfg.compressor, n_blocks=len(rows), block_size=block_size, max_segments=max_segments, layers=layers,
        hidden_size=H, vocab_size=V, verifier=desc, tokenizer=table.manifest.get("tokenizer", {}),
        source=manifest_sha256(cfg.packed), storage_dtype=cfg.storage_dtype,
        n_tokens=int(sum(int(r["n_tokens"]) for r in rows)), force=cfg.force,
        extra={"engine": engine, **_shard_attrs(cfg, table)},
    )
    for i, r in enumerate(rows):
        store.write_token_row(i, r)
    write_shared(store, rows)
    store.update_attrs(tokens_written=True)  # last: a store without it is recreated on --resume
    return store


def _create_windows_store(cfg, rows, plan, table: TokenTable, desc: dict, layers: list[int],
                          log: Callable[[str], None], engine: dict[str, Any]) -> FeatureStore:
    """A full-context store (docs/design.md §7): the training blocks' token arrays and views at the
    root from ``plan.training_rows``/``plan.views``, this shard's context blocks (``rows``) below."""
    block_size = int(table.manifest.get("parameters", {}).get("block_size") or 0)
    training = plan.training_rows
    block_size = max([block_size] + [int(r["n_tokens"]) for r in training])
    max_segments = max((len(r["cu_seqlens"]) - 1 for r in training), default=1)
    context_segments = max((len(r["cu_seqlens"]) - 1 for r in plan.rows), default=1)
    H, V = desc["hidden_size"], desc["vocab_size"]
    per_token = bytes_per_token(len(layers), H, cfg.storage_dtype)
    projected = len(rows) * plan.context_size * per_token + len(training) * block_size * 9
    out = Path(cfg.output)
    counts = plan.counts
    log(f"projected store size: {projected / 2**20:.1f} MiB: {len(rows)} context blocks of {plan.context_size} token "
        f"slots ({per_token} bytes per token, {cfg.storage_dtype}) holding {counts['tokens_extracted']:,} tokens of "
        f"{counts['conversations']:,} conversations ({counts['conversations_split']:,} longer than --max-context "
        f"{counts['max_context']}, split), for {len(training)} training blocks")
    if is_local(cfg.output):
        _check_disk(out, projected, cfg.force)
    store = FeatureStore.create_windows(
        cfg.output, compressor=cfg.compressor, n_blocks=len(training), block_size=block_size,
        max_segments=max_segments, n_context_blocks=len(rows), context_size=plan.context_size,
        context_segments=context_segments, layers=layers, hidden_size=H, vocab_size=V, verifier=desc,
        tokenizer=table.manifest.get("tokenizer", {}), source=manifest_sha256(cfg.packed),
        storage_dtype=cfg.storage_dtype, n_tokens=int(sum(int(r["n_tokens"]) for r in training)),
        n_context_tokens=int(sum(int(r["n_tokens"]) for r in rows)), force=cfg.force,
        extra={"engine": engine, "context": counts, **_shard_attrs(cfg, table, len(plan.rows))},
    )
    for i, r in enumerate(training):
        store.write_token_row(i, r)
        store.write_views(i, plan.views[i])
    write_shared(store, training)
    for i, r in enumerate(rows):
        store.contexts.write_token_row(i, r)
    write_shared(store.contexts, rows)
    store.update_attrs(tokens_written=True)  # last: a store without it is recreated on --resume
    return store


def _shard_attrs(cfg, table: TokenTable, n_blocks: int | None = None) -> dict[str, Any]:
    """Store attributes naming a shard store's part of the packed table (none for a whole store)."""
    if cfg.num_shards == 1:
        return {}
    if n_blocks is not None:  # a full-context store: shards split the context blocks
        return {"shard": {"num_shards": cfg.num_shards, "shard_index": cfg.shard_index, "context_blocks": n_blocks,
                          "blocks": "context block shard_index + k * num_shards is the sub-store's block k"}}
    return {"shard": {"num_shards": cfg.num_shards, "shard_index": cfg.shard_index,
                      "packed_blocks": table.num_rows,
                      "blocks": "packed block shard_index + k * num_shards is store block k"}}


RESUME_HINT = "pass --resume to continue it or --force to overwrite it"
"""What a refusal of an existing ``--output`` tells the user to do."""


@dataclass(frozen=True)
class StoreAtOutput:
    """What ``--output`` holds, read once before the weights load (:func:`store_at_output`): the store ``--resume``
    continues, and whether the run replaces what is there (the one ownership decision for ``--force``)."""

    store: FeatureStore | None
    """``--resume``: the store there, opened once (mode ``r+``); None without ``--resume``, with nothing there, or
    with something that is no feature store."""
    replace: bool
    """The output is a local directory of peagle's that this run removes before it creates the store (``--force``,
    or ``--resume`` of a store whose creation was interrupted), as :func:`stores.staging.ownership` decided."""
    recreate: bool
    """``--resume`` of a store whose creation was interrupted (no ``tokens_written``), or of a local path that is
    no store: it is created again."""

    @property
    def resumed(self) -> FeatureStore | None:
        """The finished store (``tokens_written``) whose blocks this run continues, else None."""
        return self.store if self.store is not None and self.store.attrs.get("tokens_written") else None

    @property
    def resumed_dtype(self) -> str | None:
        """The compute dtype (``verifier["dtype"]``, e.g. ``"bfloat16"``) of :attr:`resumed`, None without one."""
        return None if self.resumed is None else self.resumed.attrs.get("verifier", {}).get("dtype")


def store_at_output(cfg) -> StoreAtOutput:
    """Read ``cfg.output`` once: without ``--resume``, whether a local output may be replaced (``--force``, peagle's
    own files only: :func:`stores.staging.ownership`); with it, the store there (opened ``r+``), and whether
    it must be created again. Writes nothing.

    Raises:
        OutputExistsError: a local output exists (an empty directory too) without ``--resume``/``--force``.
        ForeignFilesError: the output holds files peagle did not write, and the run would replace it.
    """
    out, local = Path(cfg.output), is_local(cfg.output)
    if not cfg.resume:
        replace = local and ownership(out).refuse(cfg.force, RESUME_HINT)
        if local and out.exists() and not cfg.force:  # an empty directory: still the user's
            raise OutputExistsError(str(out), RESUME_HINT)
        return StoreAtOutput(store=None, replace=replace, recreate=False)
    if local and not out.exists():
        return StoreAtOutput(store=None, replace=False, recreate=False)
    try:
        store = FeatureStore.open(cfg.output, mode="r+")
    except StoreFormatError:
        store = None  # killed before the attributes were written: start over
    if store is not None and store.attrs.get("tokens_written"):
        return StoreAtOutput(store=store, replace=False, recreate=False)
    replace = local and ownership(out).refuse(True)  # a directory of another's files is no store being created
    return StoreAtOutput(store=store, replace=replace, recreate=store is not None or local)


def open_or_create(cfg, rows, table, desc, layers, log, engine: dict[str, Any], output: StoreAtOutput, plan=None,
                   directory: Path | None = None) -> FeatureStore:
    """The store of ``cfg.output``: ``output.resumed`` (checked by :func:`check_resumable`, with the verifier's
    model ``directory``) or created with the verifier ``desc`` and the ``engine`` attribute
    (:attr:`VerifierEngine.record`), after removing what ``output`` says this run replaces. With a full-context
    ``plan`` (:class:`peagle_data.extract.contexts.ContextPlan` with ``training_rows``), ``rows`` are
    this shard's context blocks and the store is a full-context one."""
    out = Path(cfg.output)
    if output.resumed is not None:
        check_resumable(output.resumed, cfg, desc, layers, directory)
        if plan is not None:
            check_same_plan(output.resumed, plan, cfg.packed)
        return output.resumed
    if output.recreate:
        log(f"{cfg.output}: creation was interrupted; creating it again")
        cfg = dataclasses.replace(cfg, force=True, resume=False)
        if is_local(cfg.output):
            shutil.rmtree(out)
    elif output.replace:
        shutil.rmtree(out)  # --force: a store of peagle's (store_at_output)
    try:
        if plan is not None:
            return _create_windows_store(cfg, rows, plan, table, desc, layers, log, engine)
        return _create_store(cfg, rows, table, desc, layers, log, engine)
    except OSError as e:
        if not (is_disk_full(e) and is_local(cfg.output)):
            raise
        shutil.rmtree(out, ignore_errors=True)  # a store this run began to create: nothing of it is kept
        raise disk_full_error(e, cfg.output) from None


def check_same_plan(store: FeatureStore, plan, packed: str) -> None:
    """``--resume`` of a full-context store: the plan made now from the packed table
    (:class:`peagle_data.extract.contexts.ContextPlan`) is the one the store was made with: the same
    counts (``context`` attribute), context blocks of the same size and number, and every training
    block's views (a block whose views chunk is damaged is rewritten from the plan by repair instead).
    Otherwise the context blocks still to extract would follow the new plan while the views and the
    done blocks follow the old one, and windows would read other tokens' features.

    Raises:
        InputError: a plan other than the store's, naming what differs.
    """
    diffs = []
    made = store.attrs.get("context") or {}
    if made != plan.counts:
        diffs.append("counts " + ", ".join(f"{k} {made.get(k)} -> {v}" for k, v in plan.counts.items()
                                           if made.get(k) != v))
    if store.contexts.block_size != plan.context_size or store.n_context_blocks() != len(plan.rows):
        diffs.append(f"context blocks {store.n_context_blocks()} of {store.contexts.block_size} slots -> "
                     f"{len(plan.rows)} of {plan.context_size}")
    if store.n_blocks != len(plan.views):
        diffs.append(f"training blocks {store.n_blocks} -> {len(plan.views)}")
    else:
        for i, v in enumerate(plan.views):
            try:
                row = store.view_row(i)
            except Exception:  # a damaged views chunk: repair_windows rewrites it from the plan
                continue
            if not (np.array_equal(row[:len(v)], v) and (row[len(v):] == -1).all()):
                diffs.append(f"the views of training block {i} (and maybe others)")
                break
    if diffs:
        raise InputError(f"{store.path} was made with another full-context plan than {packed} gives now "
                         f"({'; '.join(diffs)}): its conversations or the peagle that plans them changed since. "
                         "A resume would mix the two plans; start over with --force", field="--resume")


RESUME_MAY_CHANGE = ("--device", "--max-blocks", "--server", "--shared-storage", "--concurrency")
"""The ``extract`` options a ``--resume`` may change (``--device`` only to one that computes in the
store's dtype; ``--server`` and its connection to another server of the same verifier); every other
option is fixed by the store (:func:`check_resumable`)."""


def _resume_conflicts(store: FeatureStore, cfg, verifier: dict[str, Any]) -> list[str]:
    """``--option: the store's X, given Y`` for each option of ``cfg`` a resume cannot change that
    differs from the store's (layers, verifier and packed table: :func:`check_compatible`)."""
    have = store.attrs.get("shard") or {}
    engine = store.attrs.get("engine") or {}
    store_dtype = store.attrs.get("verifier", {}).get("dtype")
    store_attn = store.attrs.get("verifier", {}).get("attn_implementation")
    attn = verifier.get("attn_implementation") or (None if cfg.attn_implementation == "auto"
                                                    else cfg.attn_implementation)
    rows = [
        ("--storage-dtype", store.storage_dtype, cfg.storage_dtype),
        ("--compressor", store.attrs.get("compressor") or "none", cfg.compressor or "none"),
        ("--num-shards", have.get("num_shards", 1), cfg.num_shards),
        ("--shard-index", have.get("shard_index", 0), cfg.shard_index),
        ("--engine", engine.get("name", "hf"), cfg.engine),  # stores made before --engine: hf
        ("--context", store.context, cfg.context),
    ]
    if store.has_views and cfg.context == "full":
        rows.append(("--max-context", (store.attrs.get("context") or {}).get("max_context"), cfg.max_context))
    if engine.get("name") == "vllm" and cfg.engine == "vllm" and "tensor_parallel_size" in engine and not cfg.server:
        rows += [("--tensor-parallel-size", engine["tensor_parallel_size"], cfg.tensor_parallel_size),
                 ("--pipeline-parallel-size", engine["pipeline_parallel_size"], cfg.pipeline_parallel_size)]
    if store_attn is not None and attn is not None:
        rows.append(("--attn-implementation", store_attn, attn))
    out = [f"{option}: the store's {old}, given {new}" for option, old, new in rows if old != new]
    dtype = verifier.get("dtype")
    if store_dtype is not None and dtype is not None and dtype != store_dtype:
        out.append(f"--device: the store's blocks were computed in {store_dtype}, given {cfg.device or 'the default'}, "
                   f"which computes in {dtype} (bfloat16 on CUDA, float32 on CPU)")
    return out


def check_resumable(store: FeatureStore, cfg, verifier: dict[str, Any], layers: list[int],
                    directory: Path | None = None) -> None:
    """``--resume`` of ``store``: every option a resume cannot change is the store's.

    Fixed by the store: the packed table, the verifier (name and content fingerprint), ``--layers``,
    ``--storage-dtype``, ``--compressor``, ``--num-shards``/``--shard-index``, ``--engine`` (a store's
    blocks come from one engine) and vLLM's parallel sizes, ``--attn-implementation``
    (compared when given explicitly, and as resolved once the verifier is loaded) and the dtype the
    verifier computes in (``verifier["dtype"]``, which ``--device`` decides). A resume may change
    :data:`RESUME_MAY_CHANGE`. ``verifier`` is the store's ``verifier`` record of this run
    (:func:`verifier_desc`), or before the weights load its ``name_or_path``, ``fingerprint`` and
    predicted ``dtype``; ``directory``, the verifier's model directory, compares its content with the
    store's record (by part, or an older store's whole-file fingerprint: :func:`check_compatible`).

    Raises:
        StoreMismatchError: another verifier, other layers or another packed table.
        InputError: other values of the options above; names every one with the store's value and
            the given one.
    """
    check_compatible(store, verifier=verifier, layers=layers, source=manifest_sha256(cfg.packed),
                     content_differs=None if directory is None else (
                         lambda recorded: _identity_differs(recorded, directory)))
    conflicts = _resume_conflicts(store, cfg, verifier)
    if conflicts:
        raise InputError(
            f"{store.path} was extracted with other options, which a resume cannot change: {'; '.join(conflicts)}. "
            f"Resume with the store's values (its options: `peagle-data inspect {store.path}`, under config), or "
            f"start over with --force; a resume may change only {', '.join(RESUME_MAY_CHANGE)}", field="--resume")
