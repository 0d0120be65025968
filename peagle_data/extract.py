"""Hidden-state extraction: run the verifier over packed blocks and fill the feature store.

Legend: T tokens in a block, L aux layers, H hidden size, S segments.

- Attention stays inside each segment, with every layer's own attention rule (full, sliding window,
  chunked, sinks, soft-capping): position ids restart in every segment and the model builds its
  per-layer-type masks from them (transformers' packed sequences), or FlashAttention's varlen kernel
  gets ``cu_seqlens``; so a segment's hidden states equal those of the segment run alone.
- Models with recurrent, state-space or linear-attention layers (state would flow across segments)
  are refused before their weights load (:func:`check_packable`).
- A multimodal wrapper runs its language model: layers, layer convention and final norm are the
  language model's (recorded in the store's ``verifier`` attributes).
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
from stores.feature_verify import read_done_flags, shared_damage
from stores.model_cache import load_verifier, model_fingerprint, resolve_model
from stores.token_tables import TokenTable, manifest_sha256

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "ExtractConfig",
    "default_layers",
    "language_model",
    "packs_like_transformers",
    "segments_alone",
    "segment_masks",
    "check_packable",
    "verifier_features",
    "run_extract",
]


ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2")
"""The verifier attention implementations ``--attn-implementation`` accepts."""


@dataclass(frozen=True, kw_only=True)
class ExtractConfig:
    """Options of ``peagle-data extract``."""

    packed: str
    """PACKED_DIR: the packed table directory (output of ``peagle-data pack``)."""
    verifier: str
    """MODEL: ``smollm2-135m``, a local directory or a hub id."""
    output: str
    """Feature store path (zarr v3)."""
    layers: list[int] | None = None
    """Aux layers as HF ``output_hidden_states`` indices, e.g. 2,18,33; default EAGLE-3's ``[2, L//2, L-3]``."""
    storage_dtype: str = "bf16"
    """``bf16`` (bit-exact) or ``fp8`` (float8_e4m3fn with a per-token, per-layer scale; half the bytes)."""
    compressor: str | None = None
    """Chunk compressor: None (``none`` on the command line: raw chunks, memory-mapped reads; activations
    barely compress) or ``zstd`` (smaller, read through zarr)."""
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
    """``auto`` (FlashAttention varlen on CUDA when installed and supported, else transformers'
    choice: SDPA, or eager for models without SDPA), ``sdpa``, ``eager`` or ``flash_attention_2``."""
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
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
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


def language_model(verifier: torch.nn.Module) -> torch.nn.Module:
    """The text decoder stack of ``verifier`` (``embed_tokens``, ``layers``, ``norm``).

    For a causal LM its ``.model``; for a multimodal wrapper (``Gemma3ForConditionalGeneration``,
    ``Mistral3ForConditionalGeneration``, ...) its language model, which text-only data runs through.
    """
    getter = getattr(verifier, "get_decoder", None)
    candidates = [getter() if callable(getter) else None, getattr(verifier, verifier.base_model_prefix, None),
                  getattr(verifier, "model", None)]
    for decoder in candidates:
        inner = getattr(decoder, "language_model", None)  # a multimodal model's text stack
        for module in (inner, decoder):
            if module is not None and module is not verifier and hasattr(module, "layers"):
                return module
    raise InputError(f"{type(verifier).__name__}: no decoder stack with .layers found; peagle extracts "
                     "from transformers decoder models", field="--verifier")


_base_model = language_model  # the name bench/ and older callers use


@contextmanager
def _capture_layers(decoder: torch.nn.Module, layers: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Hooks that keep ``output_hidden_states[l]`` for ``l < L`` (``L`` comes from the output).

    Layer 0 is the input of the first decoder layer (the embeddings after any model-specific
    scaling, e.g. Gemma's ``sqrt(H)``), ``l ≥ 1`` the output of decoder layer ``l - 1``.
    """
    captured: dict[int, torch.Tensor] = {}
    blocks = decoder.layers
    hooks = []

    def first_input(module, args, kwargs):
        captured[0] = args[0] if args else kwargs["hidden_states"]

    for l in layers:
        if l == 0:
            hooks.append(blocks[0].register_forward_pre_hook(first_input, with_kwargs=True))
        elif l < len(blocks):
            hooks.append(blocks[l - 1].register_forward_hook(
                lambda m, i, o, l=l: captured.__setitem__(l, o[0] if isinstance(o, tuple) else o)))
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()


def packs_like_transformers(position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
    """Whether transformers' packed-sequence detection finds exactly the segments of ``cu_seqlens``.

    transformers (``masking_utils.find_packed_sequence_indices``) starts a new sequence wherever the
    position id does not grow by 1; the block's segments must be those: positions ``+1`` inside every
    segment, a jump at every boundary (``pack`` writes ``0..n-1`` per segment, which always holds).
    """
    pos = position_ids.reshape(-1).cpu()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).cpu()
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # [T]
    diff = torch.diff(pos, prepend=pos[:1] - 1)
    return torch.equal((diff != 1).cumsum(0), seg)


#: layer types extraction packs exactly (transformers ``config.layer_types`` names)
PACKABLE_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")

#: model types with recurrent, state-space or linear-attention layers: their state would flow from
#: one packed segment into the next, so peagle refuses them (docs/design.md §7)
RECURRENT_MODEL_TYPES = {
    "mamba": "mamba", "mamba2": "mamba2", "falcon_mamba": "mamba", "falcon_h1": "mamba (hybrid)",
    "jamba": "mamba (hybrid)", "bamba": "mamba2 (hybrid)", "zamba": "mamba (hybrid)",
    "zamba2": "mamba2 (hybrid)", "nemotron_h": "mamba2 (hybrid)", "granitemoehybrid": "mamba2 (hybrid)",
    "rwkv": "rwkv recurrence", "recurrent_gemma": "recurrent (RG-LRU)", "xlstm": "xLSTM recurrence",
    "qwen3_next": "linear_attention (gated DeltaNet)", "lfm2": "short convolution", "lfm2_moe": "short convolution",
    "minimax": "linear_attention (lightning)", "plamo2": "mamba (hybrid)",
}


def check_packable(config) -> None:
    """Refuse verifiers whose layers carry state across tokens other than attention.

    Reads only the config (call it before the weights load). ``config`` may be a multimodal
    wrapper's; its text config is checked.

    Raises:
        InputError: naming the model type and layer type (a recurrent, state-space, linear-attention
            or convolution layer, or a ``layer_types`` entry that is not full, sliding or chunked attention).
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for c in {id(config): config, id(text): text}.values():
        kind = RECURRENT_MODEL_TYPES.get(getattr(c, "model_type", ""))
        kinds = [t for t in (getattr(c, "layer_types", None) or []) if t not in PACKABLE_LAYER_TYPES]
        kinds += [t for t in (getattr(c, "layers_block_type", None) or []) if t not in ("attention",)]
        if kind or kinds:
            raise InputError(
                f"verifier model type {c.model_type!r} has {kind or sorted(set(kinds))[0]!r} layers, whose state "
                "would flow from one packed segment into the next: peagle cannot extract exact features for "
                "it (supported: models whose layers are all full, sliding-window or chunked attention)",
                field="--verifier")


def _layer_types(decoder) -> list[str]:
    """The attention type of each decoder layer, as the model itself chooses its masks.

    ``config.layer_types`` when the config has it; otherwise every layer is sliding when the config
    sets ``sliding_window`` (Mistral, Phi-3, Qwen3-MoE build one sliding mask for all layers), else full.
    """
    cfg, n = decoder.config, len(decoder.layers)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"] * n
    if len(types) < n:
        raise InputError(f"config.layer_types has {len(types)} entries for {n} decoder layers", field="--verifier")
    for i, t in enumerate(types[:n]):
        attn = getattr(decoder.layers[i], "self_attn", None)
        window = getattr(attn, "sliding_window", "absent")
        expect = getattr(cfg, "sliding_window", None) if t == "sliding_attention" else None
        if window != "absent" and window != expect:
            raise InputError(f"decoder layer {i} is {t!r} by the config but its attention has sliding_window "
                             f"{window}: peagle cannot tell which mask it uses", field="--verifier")
    return list(types[:n])


def segment_masks(decoder, position_ids: torch.Tensor, types: set[str]) -> dict[str, Any]:
    """The model's own attention mask of each layer type for one packed block.

    transformers' mask functions (``create_causal_mask``, ``create_sliding_window_causal_mask``,
    ``create_chunked_causal_mask``) with the block's ``position_ids [T]``, from which they take the
    packed segments (block-diagonal ∧ causal ∧ window/chunk, in the model's attention backend's form:
    bool for SDPA, additive float for eager). Check :func:`packs_like_transformers` first.
    """
    from transformers import masking_utils as mu

    param = next(decoder.parameters())
    pos = position_ids.reshape(1, -1).to(param.device)
    dummy = torch.empty(1, pos.shape[1], 0, dtype=param.dtype, device=param.device)  # shape, dtype, device only
    makers = {"full_attention": mu.create_causal_mask, "sliding_attention": mu.create_sliding_window_causal_mask,
              "chunked_attention": mu.create_chunked_causal_mask}
    return {t: makers[t](config=decoder.config, inputs_embeds=dummy, attention_mask=None, cache=None,
                         position_ids=pos) for t in types}


@contextmanager
def _layer_masks(decoder, masks: dict[str, Any], types: list[str]) -> Iterator[None]:
    """Give decoder layer ``i`` the mask of its type ``types[i]`` whatever mask the model built."""
    def hook(i):
        def set_mask(module, args, kwargs):
            if "attention_mask" not in kwargs:
                raise InputError(f"{type(module).__name__} does not take attention_mask as a keyword: peagle cannot "
                                 "give each layer its packed-segment mask", field="--verifier")
            kwargs["attention_mask"] = masks[types[i]]
            return args, kwargs
        return set_mask

    hooks = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(decoder.layers)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def verifier_features(base_model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      cu_seqlens: torch.Tensor, layers: list[int],
                      to_host: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One block through the verifier's decoder stack (no lm_head), each segment as if run alone.

    Args:
        base_model: the text decoder stack (:func:`language_model`) with ``layers``.
        input_ids: ``[T] int64``; position_ids: ``[T] int64`` (restart per segment, any start);
        cu_seqlens: ``[S+1] int64``; layers: HF ``output_hidden_states`` indices in ``0..L``;
        to_host: return CPU tensors (else tensors on the verifier's device).

    Every layer keeps its own attention rule (docs/design.md §7). With ``flash_attention_2`` the
    segments go to FlashAttention's varlen kernel as ``cu_seq_lens`` (each layer passes its own
    window and soft-cap). With SDPA/eager each layer gets the model's own mask of its layer type
    built for the packed segments (:func:`segment_masks`: block-diagonal ∧ causal ∧ window). When the
    positions would not tell the segments apart (:func:`packs_like_transformers`), each segment runs
    alone (:func:`segments_alone`).

    Returns:
        ``aux_hidden [T, L, H] bf16`` and ``final_hidden [T, H] bf16`` (post final norm).
    """
    param = next(base_model.parameters())
    if getattr(base_model.config, "_attn_implementation", None) == "flash_attention_2":
        cu = cu_seqlens.to(param.device, torch.int32)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        attn = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        aux, final = _run(base_model, input_ids, position_ids, layers, attn)
    elif len(cu_seqlens) <= 2:  # one segment: the model's own forward
        aux, final = _run(base_model, input_ids, position_ids, layers, {})
    elif packs_like_transformers(position_ids, cu_seqlens):
        types = _layer_types(base_model)
        masks = segment_masks(base_model, position_ids, set(types))
        with _layer_masks(base_model, masks, types):  # a 4-D mask also spares the model building its own
            aux, final = _run(base_model, input_ids, position_ids, layers,
                              {"attention_mask": masks[types[0]]})
    else:
        aux, final = segments_alone(base_model, input_ids, position_ids, cu_seqlens, layers)
    if to_host:
        return aux.cpu(), final.cpu()
    return aux, final


def _run(decoder, input_ids, position_ids, layers, attn: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder forward without a cache: ``aux [T, L, H] bf16``, ``final [T, H] bf16`` on its device."""
    device = next(decoder.parameters()).device
    n_layers = len(decoder.layers)
    with _capture_layers(decoder, layers) as captured:
        out = decoder(input_ids=input_ids[None].to(device), position_ids=position_ids[None].to(device),
                      use_cache=False, **attn)
    final = out.last_hidden_state[0]  # [T, H]
    aux = torch.stack([final if l == n_layers else captured[l][0] for l in layers], dim=1)  # [T, L, H]
    return aux.to(torch.bfloat16), final.to(torch.bfloat16)


@torch.no_grad()
def segments_alone(decoder: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   cu_seqlens: torch.Tensor, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every segment through ``decoder`` on its own (the reference packing must equal; slower).

    Same arguments and results as :func:`verifier_features` (tensors on the verifier's device).
    """
    outs = [_run(decoder, input_ids[lo:hi], position_ids[lo:hi], layers, {})
            for lo, hi in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()) if hi > lo]
    return torch.cat([a for a, _ in outs]), torch.cat([f for _, f in outs])


def _verifier_desc(name: str, directory: Path, verifier, dtype: torch.dtype) -> dict[str, Any]:
    """What the store records about the verifier: the language model's shape and layer convention."""
    config = verifier.config
    text = config.get_text_config()
    decoder = language_model(verifier)
    return {
        "name_or_path": name,
        "fingerprint": model_fingerprint(directory),
        "architecture": (config.architectures or [type(verifier).__name__])[0],
        "language_model": type(decoder).__name__,
        "num_hidden_layers": len(decoder.layers),
        "hidden_size": text.hidden_size,
        "vocab_size": text.vocab_size,
        "layer_types": _layer_types(decoder),
        "final_norm": type(getattr(decoder, "norm", None)).__name__,
        "attn_implementation": getattr(text, "_attn_implementation", None),
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
    damaged = shared_damage(store)
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


def _load_for_extract(cfg: ExtractConfig, device: str, log: Callable[[str], None]):
    """The verifier with the attention backend of ``cfg.attn_implementation``.

    ``auto``: FlashAttention varlen on CUDA when installed and the model supports it, else
    transformers' choice (SDPA when the model supports it, else eager: Gemma-2, gpt-oss).

    Raises:
        InputError: an explicit backend the model does not support (names the alternatives).
    """
    impl = cfg.attn_implementation
    if impl == "auto":
        if device.startswith("cuda") and _has_flash_attn():
            try:
                return load_verifier(cfg.verifier, device=device, attn_implementation="flash_attention_2")
            except (ValueError, ImportError) as e:
                log(f"flash_attention_2 is not available for this verifier ({e}); using transformers' default")
        return load_verifier(cfg.verifier, device=device)
    try:
        return load_verifier(cfg.verifier, device=device, attn_implementation=impl)
    except ValueError as e:
        if "support" not in str(e):
            raise
        raise InputError(f"the verifier cannot run with {impl}: {e}; pass --attn-implementation auto "
                         "(the model's own choice) or eager", field="--attn-implementation") from e


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
            _check_resumable(store, cfg, desc, layers)
            return store
        if store is not None or _local(cfg.output):
            log(f"{cfg.output}: creation was interrupted; creating it again")
            cfg = dataclasses.replace(cfg, force=True, resume=False)
            if _local(cfg.output):
                shutil.rmtree(out)
    return _create_store(cfg, rows, table, desc, layers, log)


def _check_resumable(store: FeatureStore, cfg: ExtractConfig, verifier: dict[str, Any], layers: list[int]) -> None:
    """``--resume`` of ``store``: same verifier, layers, packed table, shard and storage dtype.

    Raises:
        StoreMismatchError: another verifier, other layers or another packed table.
        InputError: another shard or storage dtype.
    """
    check_compatible(store, verifier=verifier, layers=layers, source=manifest_sha256(cfg.packed))
    have = (store.attrs.get("shard") or {})
    if (have.get("num_shards", 1), have.get("shard_index", 0)) != (cfg.num_shards, cfg.shard_index):
        raise InputError(f"the store is shard {have.get('shard_index', 0)} of {have.get('num_shards', 1)}, "
                         f"asked for shard {cfg.shard_index} of {cfg.num_shards}", field="--shard-index")
    if store.storage_dtype != cfg.storage_dtype:
        raise InputError(f"the store holds {store.storage_dtype}, asked for {cfg.storage_dtype}",
                         field="--storage-dtype")


def _check_before_weights(cfg: ExtractConfig) -> Path:
    """The checks that need only the verifier's config and files and the store (docs/design.md §2),
    before the weights load; returns the verifier's directory (:func:`resolve_model`).

    Raises:
        InputError: a ``--layers`` index outside ``0..num_hidden_layers`` (read from the config, before
            the weights are even fetched), ``--resume`` with another ``--storage-dtype`` or shard, or a
            verifier with recurrent / linear-attention layers (:func:`check_packable`).
        StoreMismatchError: ``--resume`` with other layers, another verifier or another packed table.
    """
    from stores.model_config import load_model_config, text_config

    config = load_model_config(cfg.verifier)
    check_packable(config)
    L = int(text_config(config).num_hidden_layers)
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
            _check_resumable(store, cfg, {"name_or_path": cfg.verifier, "fingerprint": model_fingerprint(directory)},
                             layers)
    return directory


def run_extract(cfg: ExtractConfig, progress: bool = True, log: Callable[[str], None] = print,
                config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run the verifier over every not-done block of a packed table and write the store.

    Under a launch of N processes (``accelerate launch --multi_gpu --num_processes N``; on CPU too,
    where ``--cpu`` alone would start a single process) each rank takes every N-th not-done block. With
    ``resume`` every done block is checked first (:func:`_repair_blocks`) and damaged ones are
    extracted again, so ``complete`` is true only for a store that ``verify_store`` accepts. A block
    whose hidden states are not finite is left not done and listed in ``nonfinite_blocks``.
    ``config``, the command's resolved options (``--print-config``), is recorded in the store's
    ``config`` attribute, so that ``--config`` can repeat the run.

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
    verifier = _load_for_extract(cfg, device, log)
    L = len(language_model(verifier).layers)
    layers = list(cfg.layers) if cfg.layers is not None else default_layers(L)
    bad = [l for l in layers if not 0 <= l <= L]
    if bad:
        raise InputError(f"layers {bad} out of range: the verifier has {L} layers, valid indices are 0..{L}",
                         field="--layers")
    desc = _verifier_desc(cfg.verifier, directory, verifier, next(verifier.parameters()).dtype)

    if state.is_main_process:
        store = _open_or_create(cfg, rows, table, desc, layers, log)
        if config is not None:
            store.update_attrs(config=config)
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

    base = language_model(verifier)
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
    summary = {
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
    # a rank that exits with its gloo/NCCL group alive can abort in the group's threads (SIGABRT,
    # "terminate called without an active exception") and fail the launch
    state.destroy_process_group()
    return summary
