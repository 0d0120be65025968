"""Hidden-state extraction: run the verifier over packed blocks and fill the feature store.

Legend: T tokens in a block, L aux layers, H hidden size, S segments.

Attention stays inside each segment: the verifier gets a 4-D block-diagonal causal mask built
from ``cu_seqlens`` (a caller's all-ones mask is never used), and position ids restart in every
segment, so a segment's hidden states equal those of the segment run alone. Only the base model
runs (no lm_head): full-vocabulary logits are never computed.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from stores.errors import InputError, OutputExistsError, StoreFormatError
from stores.feature_store import FeatureStore, check_compatible
from stores.model_cache import load_verifier, model_fingerprint, resolve_model
from stores.token_tables import TokenTable, manifest_sha256

__all__ = ["ExtractConfig", "default_layers", "segment_attention_mask", "verifier_features", "run_extract"]


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
    resume: bool = False
    """Continue an existing store: redo the blocks whose done flag is 0."""
    force: bool = False
    """Overwrite an existing store; also skip the free-disk check."""
    device: str | None = None
    """``cpu`` or ``cuda``; default cuda when available."""
    max_blocks: int | None = None
    """Stop after this many blocks in this run (the store stays resumable); None = all."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Extra attributes recorded in the store."""

    def __post_init__(self) -> None:
        if self.resume and self.force:
            raise ValueError("--resume and --force contradict each other: choose one")
        if self.layers is not None and len(self.layers) == 0:
            raise ValueError("--layers: give at least one layer index")
        if self.max_blocks is not None and self.max_blocks < 1:
            raise ValueError("--max-blocks must be ≥ 1")


def default_layers(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's default aux layers ``[2, L//2, L-3]`` (Qwen3-8B, L=36: ``[2, 18, 33]``)."""
    L = num_hidden_layers
    return sorted({min(2, L), L // 2, max(L - 3, 0)})


def segment_attention_mask(cu_seqlens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive block-diagonal causal mask from ``cu_seqlens [S+1]`` -> ``[1, 1, T, T]`` of ``dtype``.

    0 where query q may attend key k (same segment, k ≤ q), the dtype's minimum elsewhere.
    """
    T = int(cu_seqlens[-1])
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [S]
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # [T]
    idx = torch.arange(T)
    allowed = (seg[:, None] == seg[None, :]) & (idx[None, :] <= idx[:, None])  # [T, T]
    mask = torch.zeros(T, T, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


@torch.no_grad()
def verifier_features(base_model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      cu_seqlens: torch.Tensor, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One block through the verifier's base model (no lm_head).

    Args:
        base_model: the decoder stack (e.g. ``LlamaForCausalLM.model``).
        input_ids: ``[T] int64``; position_ids: ``[T] int64`` (restart per segment);
        cu_seqlens: ``[S+1] int64``; layers: HF ``output_hidden_states`` indices.

    Returns:
        ``aux_hidden [T, L, H] bf16`` and ``final_hidden [T, H] bf16`` (post final norm).
    """
    device = next(base_model.parameters()).device
    dtype = next(base_model.parameters()).dtype
    mask = segment_attention_mask(cu_seqlens.cpu(), dtype).to(device)
    out = base_model(input_ids=input_ids[None].to(device), position_ids=position_ids[None].to(device),
                     attention_mask=mask, output_hidden_states=True, use_cache=False)
    aux = torch.stack([out.hidden_states[l][0] for l in layers], dim=1)  # [T, L, H]
    final = out.last_hidden_state[0]  # [T, H]
    return aux.to(torch.bfloat16).cpu(), final.to(torch.bfloat16).cpu()


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


def _read_packed(table: TokenTable) -> list[dict[str, np.ndarray]]:
    return list(table.iter_rows(["input_ids", "loss_mask", "position_ids", "cu_seqlens", "n_tokens"]))


def _check_disk(path: Path, needed_bytes: int, force: bool) -> None:
    probe = path if path.exists() else path.parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed_bytes > free and not force:
        raise OutputExistsError(
            str(path), f"the store needs about {needed_bytes / 2**30:.2f} GiB but only "
                       f"{free / 2**30:.2f} GiB are free; free disk or pass --force")


def run_extract(cfg: ExtractConfig, progress: bool = True,
                log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the verifier over every not-done block of a packed table and write the store.

    Returns:
        A summary: store path, blocks done in this run, total blocks, tokens, layers, bytes.

    Raises:
        InputError: the packed path is not a packed table, or a layer index is out of range.
        OutputExistsError: the store exists without ``resume``/``force``, or the disk is short.
        StoreMismatchError: resuming with another verifier, other layers or another packed table.
    """
    try:
        table = TokenTable.open(cfg.packed)
    except StoreFormatError as e:
        raise InputError(str(e), file=cfg.packed) from e
    if table.kind != "packed":
        raise InputError(f"expected a packed table (peagle-data pack), got a {table.kind} table", file=cfg.packed)
    rows = _read_packed(table)
    params = table.manifest.get("parameters", table.manifest.get("config", {}))
    block_size = int(params.get("block_size") or max((int(r["n_tokens"]) for r in rows), default=1))
    block_size = max(block_size, max((int(r["n_tokens"]) for r in rows), default=1))
    max_segments = max((len(r["cu_seqlens"]) - 1 for r in rows), default=1)
    source = manifest_sha256(cfg.packed)

    directory = resolve_model(cfg.verifier)
    verifier = load_verifier(cfg.verifier, device=cfg.device)
    config = verifier.config
    L = config.num_hidden_layers
    layers = list(cfg.layers) if cfg.layers is not None else default_layers(L)
    bad = [l for l in layers if not 0 <= l <= L]
    if bad:
        raise InputError(f"layers {bad} out of range: the verifier has {L} layers, valid indices are 0..{L}",
                         field="--layers")
    desc = _verifier_desc(cfg.verifier, directory, config, next(verifier.parameters()).dtype)
    out = Path(cfg.output)
    n_tokens_total = int(sum(int(r["n_tokens"]) for r in rows))

    if cfg.resume and out.exists():
        store = FeatureStore.open(out, mode="r+")
        check_compatible(store, verifier=desc, layers=layers, source=source)
    else:
        bytes_per_token = 2 * (len(layers) + 1) * config.hidden_size + 9
        projected = len(rows) * block_size * bytes_per_token
        log(f"projected store size: {projected / 2**20:.1f} MiB for {len(rows)} blocks "
            f"({bytes_per_token} bytes per token slot, block_size {block_size})")
        if out.exists() and not cfg.force:
            raise OutputExistsError(str(out), "pass --resume to continue it or --force to overwrite it")
        _check_disk(out, projected, cfg.force)
        store = FeatureStore.create(
            out, n_blocks=len(rows), block_size=block_size, max_segments=max_segments, layers=layers,
            hidden_size=config.hidden_size, vocab_size=config.vocab_size, verifier=desc,
            tokenizer=table.manifest.get("tokenizer", {}), source=source, n_tokens=n_tokens_total,
            extra=dict(cfg.extra), force=cfg.force,
        )
        freq = np.zeros(config.vocab_size, dtype=np.int64)
        for i, r in enumerate(rows):
            store.write_tokens(i, r["input_ids"], r["loss_mask"], r["position_ids"], r["cu_seqlens"])
            ids = np.asarray(r["input_ids"], dtype=np.int64)[np.asarray(r["loss_mask"]) == 1]
            freq += np.bincount(ids, minlength=config.vocab_size)[: config.vocab_size]
        store.write_all_n_tokens(np.array([int(r["n_tokens"]) for r in rows], dtype=np.int32))
        store.set_token_freq(freq)

    todo = store.missing_blocks()
    if cfg.max_blocks is not None:
        todo = todo[: cfg.max_blocks]
    base = _base_model(verifier)
    tokens_done = 0
    bar = tqdm(todo, desc="extract", unit="block", disable=not progress)
    for i in bar:
        r = rows[i]
        aux, final = verifier_features(
            base, torch.as_tensor(r["input_ids"], dtype=torch.long), torch.as_tensor(r["position_ids"], dtype=torch.long),
            torch.as_tensor(r["cu_seqlens"], dtype=torch.long), layers)
        store.write_features(i, aux, final)
        store.mark_done(i)
        tokens_done += int(r["n_tokens"])
        bar.set_postfix(tokens=tokens_done)
    return {
        "store": str(out),
        "blocks_done_this_run": len(todo),
        "blocks_done": int(store.done_mask().sum()),
        "n_blocks": store.n_blocks,
        "n_tokens": store.n_tokens,
        "layers": layers,
        "complete": store.is_complete(),
        "stored_bytes": store.summary()["stored_bytes"],
    }
