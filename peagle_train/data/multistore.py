"""Training on several feature stores (``peagle-train --store A --store B`` or a store list file).

:class:`StoreSet` shows the stores to the trainer as one store: block ``offset_j + k`` is block k of
store j (stores in the order given), ``token_freq`` is the sum of theirs (so the draft vocab comes
from the summed frequencies), and ``done_mask`` the concatenation. :func:`split_per_store` holds
out each store's own validation blocks (:func:`peagle_train.data.split.split_store` of all that store's
block ids with the run's seed, extracted or not: whole groups of blocks that share a conversation; no
conversation is held out in one store and trained on in another), so every source is represented in validation, adding a store does
not move the split of the others, and finishing an extraction moves no block between the sides.
The run's block sequence (:class:`peagle_train.data.loader.BlockSequence`) is a pure function of the seed,
the epoch and the train side, so ``--resume`` with the same stores in the same order restores the
exact sample order.

Stores from different verifiers (content fingerprint, name, hidden or vocab size) or with other
aux layers are refused: their hidden states are not the same features. Stores that hold the same
blocks of one packed table (a merged store beside its shards, a copy of a store) are refused too:
those blocks would train twice and validate on training data.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from peagle_train.data.loader import check_store_ready
from peagle_train.data.split import SPLIT_CONVERSATIONS, block_groups, block_leads, split_store
from runtime.chat.chat_template import chat_template_kwargs_record, describe_kwargs
from stores.errors import InputError, StoreFormatError, StoreMismatchError
from stores.features.feature_store import FeatureStore
from stores.files import is_local

__all__ = ["expand_store_args", "open_stores", "StoreSet", "split_per_store", "store_identities", "store_identity",
           "usable_blocks", "conversation_groups"]


def expand_store_args(values: Sequence[str]) -> str | list[str]:
    """``--store`` values -> one path (one store) or the list of store paths.

    A value that is a regular file is a store list: one store path per line (blank lines and lines
    starting with ``#`` skipped; relative paths are relative to the list file's directory).

    Raises:
        InputError: an empty list file, or no store at all.
    """
    paths: list[str] = []
    for v in values:
        p = Path(v)
        if p.is_file():
            lines = [line.strip() for line in p.read_text(encoding="utf-8").splitlines()]
            entries = [line for line in lines if line and not line.startswith("#")]
            if not entries:
                raise InputError(f"store list {v} names no store", field="--store")
            paths += [e if os.path.isabs(e) or not is_local(e) else str(p.parent / e) for e in entries]
        else:
            paths.append(str(v))
    if not paths:
        raise InputError("no --store given", field="--store")
    return paths[0] if len(paths) == 1 else paths


def open_stores(store: str | Sequence[str]):
    """A ``FeatureStore`` for one path, a :class:`StoreSet` for a list.

    Raises:
        StoreFormatError: a store cannot be opened.
        StoreMismatchError: the stores come from different verifiers or aux layers, or two hold the same
            blocks of one packed table.
        InputError: a store given twice (the same directory under any spelling).
    """
    if isinstance(store, (str, os.PathLike)):
        return FeatureStore.open(store)
    paths = [str(s) for s in store]
    if len(paths) == 1:
        return FeatureStore.open(paths[0])
    real = [os.path.realpath(p) if is_local(p) else p for p in paths]
    repeated = sorted({p for p, r in zip(paths, real) if real.count(r) > 1})
    if repeated:
        raise InputError(f"store {repeated} given more than once", field="--store")
    return StoreSet([FeatureStore.open(p) for p in paths])


def _packed_blocks(store) -> tuple[str, range]:
    """(packed table sha256, the packed block ids the store holds): a shard store of ``extract
    --num-shards N --shard-index I`` holds packed blocks ``I, I + N, ...``, a whole store ``0..n-1``."""
    shard = store.attrs.get("shard") or {}
    n, i = int(shard.get("num_shards", 1)), int(shard.get("shard_index", 0))
    return str(store.attrs.get("source") or ""), range(i, i + n * store.n_blocks, n)


def store_identity(store) -> dict[str, Any]:
    """What makes one feature store's blocks the same data as another's, whatever its path: the packed
    table it was extracted from (``source`` sha256) and shard, its block count, the verifier's
    content fingerprint and the aux layers (docs/design.md §9: offline evaluation recognises the
    training store by it)."""
    shard = store.attrs.get("shard") or {}
    return {"source": str(store.attrs.get("source") or ""),
            "shard": [int(shard.get("shard_index", 0)), int(shard.get("num_shards", 1))],
            "n_blocks": int(store.n_blocks), "layers": [int(x) for x in store.layers],
            "verifier_fingerprint": store.attrs.get("verifier", {}).get("fingerprint")}


def store_identities(store) -> list[dict[str, Any]]:
    """One entry per training store (a ``FeatureStore`` or a :class:`StoreSet`, in order): its resolved
    ``path``, its :func:`store_identity`, ``context`` (where its features come from: ``"window"``, each
    window extracted alone, or ``"full"``, a full-context store's) and ``first_block``, the global id of
    its block 0 (the run's block ids, ``val_blocks`` included, are global). Recorded in checkpoints'
    ``config.json`` (``peagle_training.stores``). ``context`` is no part of the identity: the two stores
    of one packed table hold the same windows (and held-out split), with other features."""
    stores = store.stores if isinstance(store, StoreSet) else [store]
    out, first = [], 0
    for s in stores:
        out.append({"path": str(Path(s.path).resolve()), **store_identity(s),
                    "context": s.context, "first_block": first})
        first += int(s.n_blocks)
    return out


def _check_disjoint(stores) -> None:
    """Raise unless no two stores hold the same block of one packed table (a merged store and one of
    its shards, a store copied elsewhere, one shard twice): those features would train twice, and
    one copy's validation blocks would be another's training blocks."""
    seen: dict[str, list[tuple[Any, set[int]]]] = {}
    for s in stores:
        source, blocks = _packed_blocks(s)
        if not source:
            continue
        mine = set(blocks)
        for other, theirs in seen.get(source, []):
            shared = mine & theirs
            if shared:
                raise StoreMismatchError(
                    f"{s.path} and {other.path} hold the same {len(shared)} block(s) of one packed table "
                    f"(packed block {min(shared)} among them; the packed table's manifest sha256 {source}): "
                    "their features would train twice and validate on training blocks; give each block once "
                    "(the merged store, or its shard stores, not both)")
        seen.setdefault(source, []).append((s, mine))


def _check_same_features(stores) -> None:
    first = stores[0]
    fv = first.attrs.get("verifier", {})
    for s in stores[1:]:
        v = s.attrs.get("verifier", {})
        for key in ("fingerprint", "name_or_path", "hidden_size", "vocab_size"):
            if v.get(key) != fv.get(key):
                raise StoreMismatchError(
                    f"{s.path} was extracted with verifier {v.get('name_or_path')!r} ({key} {v.get(key)!r}), "
                    f"{first.path} with {fv.get('name_or_path')!r} ({key} {fv.get(key)!r}); one drafter trains on "
                    "the features of one verifier")
        if list(s.layers) != list(first.layers):
            raise StoreMismatchError(f"{s.path} holds aux layers {s.layers}, {first.path} holds {first.layers}; "
                                     "extract every store with the same --layers")
        mode, first_mode = (chat_template_kwargs_record((x.attrs.get("tokenizer") or {}).get("chat_template_kwargs"))
                            for x in (s, first))
        if mode != first_mode:  # the checkpoint records one mode (peagle_training.tokenizer), peagle-eval checks it
            raise StoreMismatchError(
                f"{s.path} holds data rendered with chat template kwargs {describe_kwargs(mode)}, {first.path} with "
                f"{describe_kwargs(first_mode)}; one drafter trains in the mode its verifier is served in: pack every "
                "store's data with the same --chat-template-kwargs")
        for key in ("final",):  # layer_convention: stores.features.feature_store.check_layer_convention, per store
            if s.attrs.get(key) != first.attrs.get(key):
                raise StoreMismatchError(f"{s.path}: {key} {s.attrs.get(key)!r} differs from {first.path}'s "
                                         f"{first.attrs.get(key)!r}")


class StoreSet:
    """Several feature stores of one verifier and layer set read as one (see the module doc).

    Args:
        stores: open ``FeatureStore`` objects, in order.
    """

    def __init__(self, stores: list):
        if not stores:
            raise InputError("no store given", field="--store")
        _check_same_features(stores)
        _check_disjoint(stores)
        self.stores = list(stores)
        self.offsets = np.cumsum([0] + [s.n_blocks for s in self.stores]).astype(np.int64)
        self.path = " + ".join(str(s.path) for s in self.stores)
        self.attrs: dict[str, Any] = self.stores[0].attrs

    @property
    def n_blocks(self) -> int:
        return int(self.offsets[-1])

    @property
    def layers(self) -> list[int]:
        return self.stores[0].layers

    @property
    def hidden_size(self) -> int:
        return self.stores[0].hidden_size

    @property
    def vocab_size(self) -> int:
        return self.stores[0].vocab_size

    @property
    def block_size(self) -> int:
        return max(s.block_size for s in self.stores)

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.stores)

    def bytes_per_token(self) -> int:
        return max(s.bytes_per_token() for s in self.stores)

    def locate(self, block: int) -> tuple[int, int]:
        """(store index, block within that store) of a global block id."""
        if not 0 <= block < self.n_blocks:
            raise IndexError(f"block {block} out of range [0, {self.n_blocks})")
        j = int(np.searchsorted(self.offsets, block, side="right")) - 1
        return j, int(block - self.offsets[j])

    def done_mask(self) -> np.ndarray:
        """``[N] bool`` over all stores."""
        return np.concatenate([s.done_mask() for s in self.stores])

    def token_freq(self) -> np.ndarray:
        """``[V] int64``: the stores' supervised-token counts summed."""
        return np.sum([np.asarray(s.token_freq(), dtype=np.int64) for s in self.stores], axis=0)

    def read_block(self, i: int, **kw):
        j, k = self.locate(int(i))
        return self.stores[j].read_block(k, **kw)

    def read_blocks(self, ids, **kw) -> list:
        """:meth:`read_block` of each id, in order (consecutive ids of one store in one request)."""
        out: list = []
        run: list[int] = []
        run_store = -1
        for i in ids:
            j, k = self.locate(int(i))
            if j != run_store and run:
                out += self.stores[run_store].read_blocks(run, **kw)
                run = []
            run_store = j
            run.append(k)
        if run:
            out += self.stores[run_store].read_blocks(run, **kw)
        return out


def usable_blocks(store, allow_incomplete: bool) -> np.ndarray:
    """:func:`peagle_train.data.loader.check_store_ready` of every store (each must have a done block), global ids."""
    if not isinstance(store, StoreSet):
        return check_store_ready(store, allow_incomplete)
    return np.concatenate([check_store_ready(s, allow_incomplete) + store.offsets[j]
                           for j, s in enumerate(store.stores)])


def split_per_store(store, seed: int, val_fraction: float, rule: int = SPLIT_CONVERSATIONS
                    ) -> tuple[np.ndarray, np.ndarray]:
    """The train side and the validation side of every block id, extracted or not (global ids, sorted):
    :func:`peagle_train.data.split.split_store` of each store of a :class:`StoreSet` (offset to global ids),
    else of the store, by ``rule`` (whole groups of blocks that share a conversation; rule 1, blocks alone,
    only for a resumed run that started with it). A store's block count and segment keys are fixed when
    ``extract`` creates it, so a block's side never changes as the extraction finishes, and adding a store
    does not move the others'; training reads the sides' extracted blocks (``np.intersect1d`` with
    :func:`usable_blocks`).

    Raises:
        StoreFormatError, InputError: see :func:`peagle_train.data.split.split_store`; with several stores
            also a conversation held out in one store that another store trains on (same content key).
    """
    if not isinstance(store, StoreSet):
        return split_store(store, seed, val_fraction, rule)
    train, val = [], []
    for j, s in enumerate(store.stores):
        t, v = split_store(s, seed, val_fraction, rule)
        train.append(t + store.offsets[j])
        val.append(v + store.offsets[j])
    train, val = np.concatenate(train), np.concatenate(val)
    if rule == SPLIT_CONVERSATIONS and val.size:
        _check_no_shared_conversation(store, train, val)
    return train, val


def conversation_groups(store) -> tuple[np.ndarray, np.ndarray]:
    """``(groups [N] int64, leads [N] int64)`` of every block id (global over a :class:`StoreSet`): blocks that
    share a conversation, directly or through others, in one store or across stores, are one group
    (:func:`peagle_train.data.split.block_groups`); a block's lead orders it within its group
    (:func:`peagle_train.data.split.block_leads`). What ``--epoch-order conversations`` shuffles.

    Raises:
        StoreFormatError: a store without segment keys (which conversation each segment comes from is unknown).
    """
    stores = store.stores if isinstance(store, StoreSet) else [store]
    keys = [s.segment_keys() for s in stores]
    for s, k in zip(stores, keys):
        if k is None:
            raise StoreFormatError(
                f"{s.path}: the store does not record which conversation each segment comes from, so "
                "--epoch-order conversations cannot group its blocks. Record them with `peagle-data extract PACKED "
                "--output STORE ... --resume` (the store's own options; nothing is extracted again; a packed table "
                "without a conversations/ sub-table must be packed and extracted again), or train with "
                "--epoch-order blocks")
    rows = _padded_keys(keys)
    return block_groups(rows), block_leads(rows)


def _padded_keys(keys: list[np.ndarray]) -> np.ndarray:
    """``[N, S] int64`` the stores' segment keys in global block order, a short row padded with its own last key
    (padding adds no link)."""
    width = max(k.shape[1] for k in keys)
    return np.concatenate([np.pad(k, ((0, 0), (0, width - k.shape[1])), mode="edge") for k in keys])


def _check_no_shared_conversation(store: StoreSet, train: np.ndarray, val: np.ndarray) -> None:
    """Raise unless no conversation content key of a validation block is in a training block of another store
    (one store's groups never cross its sides; two stores of overlapping data can)."""
    keys = [s.segment_keys() for s in store.stores]
    if any(k is None for k in keys):
        return  # split_store refused a store without keys already, unless nothing is held out
    owner = np.concatenate([np.full(k.shape[0], j) for j, k in enumerate(keys)])
    rows = _padded_keys(keys)
    shared = np.intersect1d(rows[val].reshape(-1), rows[train].reshape(-1))
    if shared.size:
        b = int(val[np.isin(rows[val], shared).any(axis=1)][0])
        t = int(train[np.isin(rows[train], shared).any(axis=1)][0])
        raise StoreMismatchError(
            f"{store.stores[owner[b]].path} holds out {shared.size} conversation(s) that "
            f"{store.stores[owner[t]].path} trains on (same tokens; global validation block {b}, training block "
            f"{t}): validation would score memorisation. Pack the overlapping data into one store (or drop the "
            "repeats from one of them), or pass --val-fraction 0")
