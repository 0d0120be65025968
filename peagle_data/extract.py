"""Hidden-state extraction: run the verifier over packed blocks and fill the feature store.

Legend: T tokens in a block, L aux layers, H hidden size, S segments.

- Attention stays inside each segment: the verifier gets a 4-D block-diagonal causal mask built
  from ``cu_seqlens`` (combined with, never replaced by, a caller's padding mask), and position
  ids restart in every segment, so a segment's hidden states equal those of the segment run alone.
- Only the decoder stack runs (no lm_head): full-vocabulary logits are never computed, and
  forward hooks keep only the chosen layers instead of all ``output_hidden_states``.
- Layer ``l`` follows Hugging Face ``output_hidden_states[l]``: 0 is the embedding output, ``l`` in
  1..L-1 the output of decoder layer ``l-1``, and ``L`` the final (post-norm) hidden state.
- Writes run on a background thread behind a bounded queue, so the next forward overlaps the
  store write; a block's ``done`` flag is written after its data.
- Under ``accelerate launch`` the not-done blocks are split round-robin between ranks; rank 0
  creates the store and every rank writes only its own blocks (one block = one chunk row).
"""

from __future__ import annotations

import dataclasses
import queue
import shutil
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from stores.errors import InputError, OutputExistsError, StoreFormatError
from stores.feature_store import STORAGE_DTYPES, FeatureStore, bytes_per_token, check_block, check_compatible
from stores.model_cache import load_verifier, model_fingerprint, resolve_model
from stores.token_tables import TokenTable, manifest_sha256

__all__ = [
    "ExtractConfig",
    "default_layers",
    "segment_attention_mask",
    "verifier_features",
    "run_extract",
]


@dataclass(frozen=True, kw_only=True)
class ExtractConfig:
    """Options of ``peagle-data extract``."""

    packed: str
    """Packed table directory (output of ``peagle-data pack``)."""
    verifier: str
    """MODEL: ``smollm2-135m``, a local directory or a hub id."""
    output: str
    """Feature store path (a zarr v3 group)."""
    layers: list[int] | None = None
    """Aux layers as HF ``output_hidden_states`` indices; default EAGLE-3's ``[2, L//2, L-3]``."""
    storage_dtype: str = "bf16"
    """``bf16`` (bit-exact) or ``fp8`` (float8_e4m3fn with a per-token, per-layer scale)."""
    compressor: str | None = None
    """None (raw chunks, memory-mapped reads) or ``zstd`` (smaller, read through zarr)."""
    resume: bool = False
    """Continue an existing store: check every done block, then extract the not-done and damaged ones."""
    force: bool = False
    """Overwrite an existing store; also skip the free-disk check."""
    device: str | None = None
    """``cpu`` or ``cuda``; default cuda when available."""
    max_blocks: int | None = None
    """Stop after this many blocks in this run (the store stays resumable); None = all."""
    writer_queue: int = 2
    """Blocks that may wait for the writer thread (bounds host memory)."""
    attn_implementation: str = "auto"
    """``auto`` (FlashAttention varlen on CUDA when installed, else SDPA with a block mask),
    ``sdpa``, ``eager`` or ``flash_attention_2``."""
    num_shards: int = 1
    """Split the packed table's blocks into this many shard stores (--num-shards)."""
    shard_index: int = 0
    """This run's shard: packed blocks ``shard_index, shard_index + num_shards, ...`` become the
    store's blocks ``0, 1, ...`` (--shard-index); ``peagle-data merge`` joins the shard stores."""

    def __post_init__(self) -> None:
        if self.resume and self.force:
            raise ValueError("--resume and --force contradict each other: choose one")
        if self.layers is not None and len(self.layers) == 0:
            raise ValueError("--layers: give at least one layer index")
        if self.layers is not None and len(set(self.layers)) != len(self.layers):
            raise ValueError(f"--layers: repeated index in {self.layers}")
        if self.max_blocks is not None and self.max_blocks < 1:
            raise ValueError("--max-blocks must be ≥ 1")
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"--storage-dtype: expected one of {STORAGE_DTYPES}, got {self.storage_dtype!r}")
        if self.attn_implementation not in ("auto", "sdpa", "eager", "flash_attention_2"):
            raise ValueError(f"--attn-implementation: unknown {self.attn_implementation!r}")
        if self.writer_queue < 1:
            raise ValueError("writer_queue must be ≥ 1")
        if self.num_shards < 1 or not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"--shard-index must be in [0, {self.num_shards - 1}] and --num-shards >= 1, "
                             f"got {self.shard_index} of {self.num_shards}")


def default_layers(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's default aux layers ``[2, L//2, L-3]`` (Qwen3-8B, L=36: ``[2, 18, 33]``)."""
    L = num_hidden_layers
    return sorted({min(2, L), L // 2, max(L - 3, 0)})


def segment_attention_mask(cu_seqlens: torch.Tensor, dtype: torch.dtype,
                           padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Additive block-diagonal causal mask from ``cu_seqlens [S+1]`` -> ``[1, 1, T, T]`` of ``dtype``.

    0 where query q may attend key k (same segment, k ≤ q, and key not padding), the dtype's
    minimum elsewhere. ``padding_mask [T]`` (1 = real token), when given, can only remove keys.
    """
    T = int(cu_seqlens[-1])
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [S]
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths.cpu())  # [T]
    idx = torch.arange(T)
    allowed = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])  # [T, T]
    if padding_mask is not None:
        allowed &= padding_mask.reshape(1, T).bool().cpu() | torch.eye(T, dtype=torch.bool)
    mask = torch.zeros(T, T, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@contextmanager
def _capture_layers(base_model: torch.nn.Module, layers: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Forward hooks that keep ``output_hidden_states[l]`` for ``l < L`` (``L`` comes from the output)."""
    captured: dict[int, torch.Tensor] = {}
    decoder = base_model.layers
    hooks = []
    for l in layers:
        if l == 0:
            hooks.append(base_model.embed_tokens.register_forward_hook(
                lambda m, i, o: captured.__setitem__(0, o)))
        elif l < len(decoder):
            hooks.append(decoder[l - 1].register_forward_hook(
                lambda m, i, o, l=l: captured.__setitem__(l, o[0] if isinstance(o, tuple) else o)))
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def verifier_features(base_model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      cu_seqlens: torch.Tensor, layers: list[int],
                      attention_mask: torch.Tensor | None = None,
                      to_host: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One block through the verifier's decoder stack (no lm_head).

    Args:
        base_model: the decoder stack (e.g. ``LlamaForCausalLM.model``) with ``embed_tokens``, ``layers``.
        input_ids: ``[T] int64``; position_ids: ``[T] int64`` (restart per segment, any start);
        cu_seqlens: ``[S+1] int64``; layers: HF ``output_hidden_states`` indices in ``0..L``;
        attention_mask: optional ``[T]`` padding mask (1 = token); it never widens attention
            beyond a segment (ignored on the FlashAttention varlen path, which has no padding).
        to_host: return CPU tensors (else tensors on the verifier's device).

    With ``flash_attention_2`` the segments go to FlashAttention's varlen kernel as
    ``cu_seq_lens``; otherwise a ``[1, 1, T, T]`` block-diagonal mask goes to SDPA/eager.

    Returns:
        ``aux_hidden [T, L, H] bf16`` and ``final_hidden [T, H] bf16`` (post final norm).
    """
    param = next(base_model.parameters())
    n_layers = len(base_model.layers)
    if getattr(base_model.config, "_attn_implementation", None) == "flash_attention_2":
        # FlashAttention varlen: segments given by cu_seqlens, no T x T mask at all
        cu = cu_seqlens.to(param.device, torch.int32)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        attn = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    else:
        attn = dict(attention_mask=segment_attention_mask(cu_seqlens, param.dtype, attention_mask).to(param.device))
    with _capture_layers(base_model, layers) as captured:
        out = base_model(input_ids=input_ids[None].to(param.device),
                         position_ids=position_ids[None].to(param.device), use_cache=False, **attn)
    final = out.last_hidden_state[0]  # [T, H]
    aux = torch.stack([final if l == n_layers else captured[l][0] for l in layers], dim=1)  # [T, L, H]
    if to_host:
        return aux.to(torch.bfloat16).cpu(), final.to(torch.bfloat16).cpu()
    return aux.to(torch.bfloat16), final.to(torch.bfloat16)


def _base_model(verifier: torch.nn.Module) -> torch.nn.Module:
    return getattr(verifier, verifier.base_model_prefix, verifier)


def _verifier_desc(name: str, directory: Path, config, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "name_or_path": name,
        "fingerprint": model_fingerprint(directory),
        "architecture": (config.architectures or [type(config).__name__])[0],
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "dtype": str(dtype).replace("torch.", ""),
    }


def _check_disk(path: Path, needed_bytes: int, force: bool) -> None:
    probe = path if path.exists() else path.parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed_bytes > free and not force:
        raise OutputExistsError(
            str(path), f"the store needs about {needed_bytes / 2**30:.2f} GiB but only "
                       f"{free / 2**30:.2f} GiB are free; free disk or pass --force")


class _BlockWriter:
    """A background thread that writes blocks and then their done flags, behind a bounded queue."""

    def __init__(self, store: FeatureStore, maxsize: int):
        self.store = store
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.copy_stream = None  # a CUDA side stream for device-to-host copies, made on first use
        self.error: BaseException | None = None
        self.nonfinite: list[int] = []  # blocks left not done: NaN/Inf hidden states
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
                self.store.write_features(i, aux, final)
                if torch.isfinite(aux).all() and torch.isfinite(final).all():
                    self.store.mark_done(i)
                else:  # verify would reject it: never mark it done
                    self.nonfinite.append(i)
            except BaseException as e:  # reported on the main thread
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
        self.queue.put((i, aux, final, copied, device_refs))

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error


def _open_packed(path: str) -> TokenTable:
    try:
        table = TokenTable.open(path)
    except StoreFormatError as e:
        raise InputError(str(e), file=path) from e
    if table.kind != "packed":
        raise InputError(f"expected a packed table (peagle-data pack), got a {table.kind} table", file=path)
    return table


def _create_store(cfg: ExtractConfig, rows, table: TokenTable, desc: dict, layers: list[int],
                  log: Callable[[str], None]) -> FeatureStore:
    block_size = int(table.manifest.get("parameters", {}).get("block_size") or 0)
    block_size = max([block_size] + [int(r["n_tokens"]) for r in rows])
    max_segments = max((len(r["cu_seqlens"]) - 1 for r in rows), default=1)
    H, V = desc["hidden_size"], desc["vocab_size"]
    per_token = bytes_per_token(len(layers), H, cfg.storage_dtype)
    projected = len(rows) * block_size * per_token
    out = Path(cfg.output)
    if _local(cfg.output) and out.exists() and not cfg.force:
        raise OutputExistsError(str(out), "pass --resume to continue it or --force to overwrite it")
    log(f"projected store size: {projected / 2**20:.1f} MiB for {len(rows)} blocks of {block_size} "
        f"token slots ({per_token} bytes per token, {cfg.storage_dtype})")
    if _local(cfg.output):
        _check_disk(out, projected, cfg.force)
    store = FeatureStore.create(
        cfg.output, compressor=cfg.compressor, n_blocks=len(rows), block_size=block_size, max_segments=max_segments, layers=layers,
        hidden_size=H, vocab_size=V, verifier=desc, tokenizer=table.manifest.get("tokenizer", {}),
        source=manifest_sha256(cfg.packed), storage_dtype=cfg.storage_dtype,
        n_tokens=int(sum(int(r["n_tokens"]) for r in rows)), force=cfg.force, extra=_shard_attrs(cfg, table),
    )
    for i, r in enumerate(rows):
        store.write_tokens(i, r["input_ids"], r["loss_mask"], r["position_ids"], r["cu_seqlens"])
    _write_shared(store, rows)
    store.update_attrs(tokens_written=True)  # last: a store without it is recreated on --resume
    return store


def _shard_attrs(cfg: ExtractConfig, table: TokenTable) -> dict[str, Any]:
    """Store attributes naming a shard store's part of the packed table (none for a whole store)."""
    if cfg.num_shards == 1:
        return {}
    return {"shard": {"num_shards": cfg.num_shards, "shard_index": cfg.shard_index,
                      "packed_blocks": table.num_rows,
                      "blocks": "packed block shard_index + k * num_shards is store block k"}}


def _write_shared(store: FeatureStore, rows) -> None:
    """Write the whole-store arrays ``n_tokens [N]`` and ``token_freq [V]`` from the packed rows."""
    freq = np.zeros(store.vocab_size, dtype=np.int64)
    for r in rows:
        ids = np.asarray(r["input_ids"], dtype=np.int64)[np.asarray(r["loss_mask"]) == 1]
        freq += np.bincount(ids, minlength=store.vocab_size)[:store.vocab_size]
    store.write_all_n_tokens(np.array([int(r["n_tokens"]) for r in rows], dtype=np.int32))
    store.set_token_freq(freq)


def _repair_shared(store: FeatureStore, rows, log: Callable[[str], None]) -> dict[str, str]:
    """On --resume (main process): rewrite ``n_tokens``/``token_freq`` from the packed rows if damaged."""
    damaged = store.shared_damage()
    if damaged:
        for reason in damaged.values():
            log(f"{store.path}: {reason}; rewriting it from the packed table")
        _write_shared(store, rows)
    return damaged


def _repair_blocks(store: FeatureStore, rows, rank: int, world: int, log: Callable[[str], None]) -> dict[int, str]:
    """On --resume: check this rank's share of the blocks and make every damaged one not done.

    A done block is damaged when :func:`stores.feature_store.check_block` finds a chunk missing,
    truncated, empty, unreadable or failing its checksum, non-finite hidden states, or ``input_ids``
    other than the packed row's (this reads every done block of the share once). A damaged done
    flag chunk counts as not done. Damaged blocks get their flag cleared, and every not-done block
    of the share gets its token arrays rewritten from the packed row, so the extraction that
    follows makes the store byte-identical to an undamaged one.

    Returns:
        ``{block: reason}`` of the damaged blocks found by this rank.
    """
    done, damaged = store.read_done_flags()
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
    for i in (i for i in mine if not done[i]):
        r = rows[i]
        store.write_tokens(i, r["input_ids"], r["loss_mask"], r["position_ids"], r["cu_seqlens"])
    return damaged


def _check_device(device: str | None) -> None:
    """Raise InputError for a device this torch cannot use (before anything heavy runs)."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InputError(f"unknown device {device!r}; use cpu or cuda", field="--device") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError("CUDA is not available (this torch is a CPU build or no GPU is visible); "
                         "use --device cpu", field="--device")
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"device {device!r} is not supported; use cpu or cuda", field="--device")


def _has_flash_attn() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def _local(path: str) -> bool:
    return "://" not in str(path)


def _open_or_create(cfg: ExtractConfig, rows, table, desc, layers, log) -> FeatureStore:
    out = Path(cfg.output)
    if cfg.resume and (out.exists() or not _local(cfg.output)):
        try:
            store = FeatureStore.open(cfg.output, mode="r+")
        except StoreFormatError:
            store = None  # killed before the attributes were written: start over
        if store is not None and store.attrs.get("tokens_written"):
            check_compatible(store, verifier=desc, layers=layers, source=manifest_sha256(cfg.packed))
            have = (store.attrs.get("shard") or {})
            if (have.get("num_shards", 1), have.get("shard_index", 0)) != (cfg.num_shards, cfg.shard_index):
                raise InputError(f"the store is shard {have.get('shard_index', 0)} of {have.get('num_shards', 1)}, "
                                 f"asked for shard {cfg.shard_index} of {cfg.num_shards}", field="--shard-index")
            if store.storage_dtype != cfg.storage_dtype:
                raise InputError(f"the store holds {store.storage_dtype}, asked for {cfg.storage_dtype}",
                                 field="--storage-dtype")
            return store
        if store is not None or _local(cfg.output):
            log(f"{cfg.output}: creation was interrupted; creating it again")
            cfg = dataclasses.replace(cfg, force=True, resume=False)
            if _local(cfg.output):
                shutil.rmtree(out)
    return _create_store(cfg, rows, table, desc, layers, log)


def _check_before_weights(cfg: ExtractConfig) -> Path:
    """The checks that need only the verifier's config and files and the store (docs/design.md §2),
    before the weights load; returns the verifier's directory (:func:`resolve_model`).

    Raises:
        InputError: a ``--layers`` index outside ``0..num_hidden_layers`` (read from the config, before
            the weights are even fetched), or ``--resume`` with another ``--storage-dtype``.
        StoreMismatchError: ``--resume`` with other layers, another verifier or another packed table.
    """
    from stores.model_config import load_model_config, text_config

    L = int(text_config(load_model_config(cfg.verifier)).num_hidden_layers)
    bad = [layer for layer in (cfg.layers or []) if not 0 <= layer <= L]
    if bad:
        raise InputError(f"layers {bad} out of range: the verifier has {L} layers, valid indices are 0..{L}",
                         field="--layers")
    directory = resolve_model(cfg.verifier)
    if cfg.resume and _local(cfg.output) and (Path(cfg.output) / "zarr.json").is_file():
        try:
            store = FeatureStore.open(cfg.output)
        except StoreFormatError:
            return directory  # interrupted creation: the store is made again
        if store.attrs.get("tokens_written"):
            layers = list(cfg.layers) if cfg.layers is not None else default_layers(L)
            check_compatible(store, verifier={"name_or_path": cfg.verifier, "fingerprint": model_fingerprint(directory)},
                             layers=layers, source=manifest_sha256(cfg.packed))
            if store.storage_dtype != cfg.storage_dtype:
                raise InputError(f"the store holds {store.storage_dtype}, asked for {cfg.storage_dtype}",
                                 field="--storage-dtype")
    return directory


def run_extract(cfg: ExtractConfig, progress: bool = True,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the verifier over every not-done block of a packed table and write the store.

    Under a launch of N processes (``accelerate launch --multi_gpu --num_processes N``; on CPU too,
    where ``--cpu`` alone would start a single process) each rank takes every N-th not-done block. With
    ``resume`` every done block is checked first (:func:`_repair_blocks`) and damaged ones are
    extracted again, so ``complete`` is true only for a store that ``verify_store`` accepts. A block
    whose hidden states are not finite is left not done and listed in ``nonfinite_blocks``.

    Returns:
        A summary: store path, this process's ``rank`` among ``world_size``, blocks done in this run
        (this rank), blocks done in all, layers, bytes.

    Raises:
        InputError: the packed path is not a packed table, or a layer index is out of range.
        OutputExistsError: the store exists without ``resume``/``force``, or the disk is short.
        StoreMismatchError: resuming with another verifier, other layers or another packed table.
    """
    from accelerate import PartialState

    _check_device(cfg.device)
    state = PartialState(cpu=cfg.device == "cpu")
    table = _open_packed(cfg.packed)
    if _local(cfg.output) and Path(cfg.output).exists() and not (cfg.resume or cfg.force):
        raise OutputExistsError(cfg.output, "pass --resume to continue it or --force to overwrite it")
    rows = list(table.iter_rows(["input_ids", "loss_mask", "position_ids", "cu_seqlens", "n_tokens"]))
    rows = rows[cfg.shard_index::cfg.num_shards]  # this shard's blocks (all of them unsharded)
    directory = _check_before_weights(cfg)
    device = cfg.device or (str(state.device) if state.device.type == "cuda" else "cpu")
    attn_impl = cfg.attn_implementation
    if attn_impl == "auto":
        attn_impl = "flash_attention_2" if device.startswith("cuda") and _has_flash_attn() else "sdpa"
    verifier = load_verifier(cfg.verifier, device=device, attn_implementation=attn_impl)
    config = verifier.config
    L = config.num_hidden_layers
    layers = list(cfg.layers) if cfg.layers is not None else default_layers(L)
    bad = [l for l in layers if not 0 <= l <= L]
    if bad:
        raise InputError(f"layers {bad} out of range: the verifier has {L} layers, valid indices are 0..{L}",
                         field="--layers")
    desc = _verifier_desc(cfg.verifier, directory, config, next(verifier.parameters()).dtype)

    if state.is_main_process:
        store = _open_or_create(cfg, rows, table, desc, layers, log)
        if cfg.resume:
            _repair_shared(store, rows, log)
    state.wait_for_everyone()
    if not state.is_main_process:
        store = FeatureStore.open(cfg.output, mode="r+")
    repaired = _repair_blocks(store, rows, state.process_index, state.num_processes, log) if cfg.resume else {}
    state.wait_for_everyone()
    todo = store.missing_blocks()
    state.wait_for_everyone()  # every rank reads the same list before any rank writes
    todo = todo[state.process_index::state.num_processes]
    if cfg.max_blocks is not None:
        todo = todo[: cfg.max_blocks]

    base = _base_model(verifier)
    writer = _BlockWriter(store, cfg.writer_queue)
    tokens = 0
    bar = tqdm(todo, desc=f"extract[{state.process_index}]" if state.num_processes > 1 else "extract",
               unit="block", disable=not progress)
    try:
        for i in bar:
            r = rows[i]  # numpy arrays from Arrow are read-only: copy into tensors
            aux, final = verifier_features(
                base, torch.tensor(r["input_ids"], dtype=torch.long),
                torch.tensor(r["position_ids"], dtype=torch.long),
                torch.tensor(r["cu_seqlens"], dtype=torch.long), layers, to_host=False)
            writer.put(i, aux, final)
            tokens += int(r["n_tokens"])
            bar.set_postfix(tokens=f"{tokens:,}")  # a string: tqdm prints numbers as 2e+4
    finally:
        writer.close()
    if writer.nonfinite:
        log(f"{cfg.output}: blocks {sorted(writer.nonfinite)} have NaN or Inf hidden states (verifier overflow?); "
            "they are left not done")
    state.wait_for_everyone()
    return {
        "store": str(cfg.output),
        "rank": state.process_index,
        "world_size": state.num_processes,
        "blocks_done_this_run": len(todo),
        "tokens_this_run": tokens,
        "blocks_done": int(store.done_mask().sum()),
        "n_blocks": store.n_blocks,
        "n_tokens": store.n_tokens,
        "layers": layers,
        "storage_dtype": store.storage_dtype,
        "repaired_blocks": {int(i): reason for i, reason in sorted(repaired.items())},
        "nonfinite_blocks": sorted(writer.nonfinite),
        "complete": store.is_complete(),
        "stored_bytes": store.summary()["stored_bytes"],
    }
