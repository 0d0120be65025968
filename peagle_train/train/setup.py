"""What a training run derives and checks before the Trainer is built (docs/design.md §8).

Legend: H hidden size, V verifier vocab, D draft vocab, K ``num_depths``.

The checks that need no weights (:func:`check_before_weights`, the ``--resume`` checks against the saved
run), the verifier's heads, the draft vocab, the drafter's config and the output directory
(:func:`prepare_output`). The verifier is loaded only for its ``embed_tokens`` and ``lm_head``
weights; it is never run.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from peagle_train.data.multistore import StoreSet, store_identities
from peagle_train.model.checkpoint import (CONFIG_FILE, latest_checkpoint,
                                           load_training_state, rope_from_layer_config)
from peagle_train.model.config import ROPE_TYPES, DrafterConfig
from peagle_train.model.warm_start import InitSource, check_verifier_layers
from peagle_train.train.config import FIELD_DEFAULTS, TrainConfig, flat_settings
from peagle_train.train.kinds import DrafterKind, drafter_kind
from stores.errors import InputError, PeagleError, StoreMismatchError
from stores.features.feature_store import check_layer_convention
from runtime.model_cache import load_verifier, model_files, resolve_model
from runtime.model_identity import model_fingerprint
from runtime.model_config import load_model_config, text_config
from stores.staging import check_replaceable
from runtime.verifier_match import check_store_verifier

__all__ = [
    "VerifierHeads",
    "load_verifier_heads",
    "build_draft_vocab",
    "build_drafter_config",
    "QWEN3_FAMILIES",
    "default_drafter_layer",
    "resolve_drafter_layer",
    "verifier_rope",
    "val_split_warning",
    "check_before_weights",
    "resolve_init_from",
    "check_init_source",
    "prepare_output",
    "resume_mismatch_message",
    "resolve_epoch_order",
]


#: fields that must equal the saved ones for ``--resume`` to reproduce an uninterrupted run
#: (``grad_accum`` may change with the number of processes: their product, the blocks of one step, may
#: not; :func:`peagle_train.data.loader.resume_cursor` checks it)
_RESUME_FIELDS = ("store", "max_steps", "method", "block_size", "num_depths", "down_sample_ratio", "down_sample_ratio_min",
                  "max_anchors", "lr", "warmup_steps", "weight_decay", "seed",
                  "draft_vocab_size", "num_layers", "drafter_layer", "val_fraction", "lazy_embedding", "grad_clip",
                  "mask_token_id", "train_embedding", "init_layers", "loss", "depth_weights", "epoch_order")


_BEFORE_FIELD = {"drafter_layer": "llama", "epoch_order": "blocks"}
"""What a run saved before a field existed trained with, where that is not the field's default."""


@dataclass
class VerifierHeads:
    """What training takes from the verifier.

    Attributes:
        name_or_path: the MODEL argument.
        config: the verifier's transformers config.
        embed: ``[V, H] float32`` input embeddings.
        lm_head: ``[V, H] float32`` output projection (its final norm is already in the stored
            ``final_hidden``).
        mask_token_id: token fed at depth > 0.
        layers: the state dicts (``float32``, transformers names) of the verifier decoder layers the
            drafter's layers start from (``--init-layers verifier``), in the drafter's order; empty otherwise.
        architectures: the verifier's own ``architectures`` from its ``config.json`` (a multimodal
            wrapper's, e.g. ``Qwen3_5ForConditionalGeneration``, not its text config's, which has none).
    """

    name_or_path: str
    config: Any
    embed: torch.Tensor
    lm_head: torch.Tensor
    mask_token_id: int
    layers: list[dict[str, torch.Tensor]] = dataclasses.field(default_factory=list)
    architectures: list[str] = dataclasses.field(default_factory=list)


def load_verifier_heads(name: str, store, mask_token_id: int, last_layers: int = 0) -> VerifierHeads:
    """Load the verifier's embeddings and lm_head and check their shapes against the store (that the verifier is
    the store's, by content and tokenizer, the plan checked before the weights: :func:`check_before_weights`).

    ``mask_token_id`` is recorded as is (chosen before the weights load, see
    :func:`peagle_train.model.mask_token.resolve_mask_token`). ``last_layers``: keep the weights of the
    verifier's last ``last_layers`` decoder layers too (``--init-layers verifier``, checked before by
    :func:`peagle_train.model.warm_start.check_verifier_layers`).

    Raises:
        StoreMismatchError: the loaded verifier's hidden size or vocab size differs from the store's.
        ModelNotFoundError / MissingDependencyError: from :func:`runtime.model_cache.resolve_model`.
    """
    model = load_verifier(name, dtype=torch.float32, device="cpu")
    cfg = model.config.get_text_config()  # a multimodal wrapper's language model
    _check_verifier_shape(name, cfg, store)
    embed = model.get_input_embeddings().weight.detach().float().clone()  # [V, H]
    lm_head = model.get_output_embeddings().weight.detach().float().clone()  # [V, H]
    layers = []
    if last_layers:
        decoder_layers = getattr(model.get_decoder(), "layers", None)
        if not isinstance(decoder_layers, torch.nn.ModuleList) or len(decoder_layers) != cfg.num_hidden_layers:
            raise InputError(f"--init-layers verifier: verifier {name!r} ({type(model).__name__}) has no list of "
                             f"{cfg.num_hidden_layers} decoder layers at get_decoder().layers; use --init-layers random",
                             field="--init-layers")
        layers = [{k: v.detach().float().clone() for k, v in layer.state_dict().items()}
                  for layer in decoder_layers[len(decoder_layers) - last_layers:]]
    # config.json's: a wrapper loaded as its causal LM (Qwen3_5ForCausalLM) holds only the text config
    architectures = list(getattr(load_model_config(name), "architectures", None) or [type(model).__name__])
    del model
    return VerifierHeads(name_or_path=str(name), config=cfg, embed=embed, lm_head=lm_head,
                         mask_token_id=int(mask_token_id), layers=layers, architectures=architectures)


def build_draft_vocab(token_freq: np.ndarray, draft_vocab_size: int | None) -> torch.Tensor | None:
    """The draft vocab as ``d2t [D] int64`` offsets (``target_id = draft_id + d2t[draft_id]``).

    With ``draft_vocab_size`` N: the N most frequent tokens of ``token_freq [V] int64`` (ties broken
    by the smaller id), sorted by id, as in EAGLE-3's frequency-based draft vocabulary
    (arXiv:2503.01840). None: the verifier's vocab (returns None).

    Raises:
        InputError: N larger than V.
    """
    if draft_vocab_size is None:
        return None
    freq = np.asarray(token_freq, dtype=np.int64)
    V = freq.size
    if draft_vocab_size > V:
        raise InputError(f"--draft-vocab-size {draft_vocab_size} exceeds the verifier vocab size {V}")
    order = np.lexsort((np.arange(V), -freq))  # by count desc, then id asc
    ids = np.sort(order[:draft_vocab_size])
    return torch.from_numpy(ids - np.arange(draft_vocab_size)).to(torch.int64)  # [D]


def verifier_rope(text_config) -> dict[str, Any]:
    """The verifier's RoPE as the drafter takes it: flat ``rope_parameters`` (a per-layer-type RoPE,
    e.g. Gemma-3's, collapses to its sliding layers' entry, and ``partial_rotary_factor`` is dropped
    since the drafter rotates whole heads: both as speculators 0.9 builds a drafter)."""
    rope = rope_from_layer_config(text_config.to_dict())
    rope.pop("partial_rotary_factor", None)
    return rope


def build_drafter_config(heads: VerifierHeads, store, cfg: TrainConfig, draft_vocab_size: int) -> DrafterConfig:
    """A :class:`DrafterConfig` mirroring the verifier's config, its RoPE included (type, scaling, theta).

    Raises:
        ValueError: a verifier RoPE the drafter cannot compute (``dynamic``, ``longrope``).
    """
    vc = heads.config.get_text_config()
    H = int(vc.hidden_size)
    nh = int(vc.num_attention_heads)
    rope = verifier_rope(vc)
    theta = float(rope["rope_theta"])
    return DrafterConfig(
        hidden_size=H, intermediate_size=int(vc.intermediate_size), num_attention_heads=nh,
        num_key_value_heads=int(getattr(vc, "num_key_value_heads", None) or nh),
        head_dim=int(getattr(vc, "head_dim", None) or H // nh), vocab_size=int(vc.vocab_size),
        draft_vocab_size=draft_vocab_size, aux_layer_ids=list(store.layers), num_hidden_layers=cfg.model.num_layers,
        rms_norm_eps=float(getattr(vc, "rms_norm_eps", 1e-5)), rope_theta=theta, rope_parameters=rope,
        max_position_embeddings=int(getattr(vc, "max_position_embeddings", 8192)),
        mask_token_id=heads.mask_token_id, num_depths=cfg.model.num_depths,
        layer_type=cfg.model.drafter_layer or default_drafter_layer(vc),
        hidden_act="silu",  # the MLP trains from scratch; vLLM's EAGLE-3 drafter MLP computes only silu
        verifier_name_or_path=heads.name_or_path,
        verifier_architectures=list(getattr(heads, "architectures", None)
                                    or getattr(heads.config, "architectures", None) or ["LlamaForCausalLM"]),
    )


QWEN3_FAMILIES = ("qwen3", "qwen3_moe")
"""Verifier ``model_type`` values (of the text config) whose attention is Qwen3's (per-head q/k RMSNorm):
their drafter layer defaults to ``qwen3``."""


def default_drafter_layer(text_config) -> str:
    """The drafter layer a verifier gets without ``--drafter-layer`` or ``--init-from``: ``qwen3`` for a
    verifier of :data:`QWEN3_FAMILIES` (the drafter's attention then mirrors the verifier's, as its RoPE and
    head shapes do), else ``llama``."""
    return "qwen3" if getattr(text_config, "model_type", None) in QWEN3_FAMILIES else "llama"


def resolve_drafter_layer(cfg: TrainConfig, verifier_name: str, init: InitSource | None) -> TrainConfig:
    """``cfg`` with ``model.drafter_layer`` set (so ``train_config.json`` records it): as given, else the
    ``--init-from`` drafter's layer type, else :func:`default_drafter_layer` of the verifier's config (read,
    no weights). A given one that is not the ``--init-from`` drafter's is refused by :func:`check_init_source`."""
    if cfg.model.drafter_layer is not None:
        return cfg
    layer = init.config.layer_type if init is not None else default_drafter_layer(
        text_config(load_model_config(verifier_name)))
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, drafter_layer=layer))


def val_split_warning(n_blocks: int, n_val: int, val_fraction: float, n_asked: int | None = None) -> str | None:
    """A warning when the validation split holds out more than twice ``val_fraction`` of the blocks, or fewer
    than the ``n_asked`` blocks ``val_fraction`` asks.

    A store of one block holds none out: that is said (no validation figures follow).
    :func:`peagle_train.data.split.split_store` holds out at least one block of a store with two or more
    (1 of 2 blocks is 50% for ``--val-fraction 0.05``); that is kept, and said. It holds out whole groups of
    blocks that share a conversation, so it may hold out fewer than asked (at least half); that is said too.
    None otherwise.
    """
    if n_val == 0 and val_fraction > 0 and n_blocks < 2:
        return (f"no block held out for validation: --val-fraction {val_fraction:g} needs a store of two or more "
                f"blocks, this one has {n_blocks}; training reports no validation loss or accuracy (more data, or "
                "--val-fraction 0 to train without validation)")
    if n_asked is not None and n_val < n_asked:
        return (f"holding out {n_val} of {n_blocks} blocks ({100 * n_val / n_blocks:.1f}%) for validation, fewer "
                f"than the {n_asked} --val-fraction {val_fraction:g} asks: validation takes whole groups of blocks "
                "that share a conversation (its windows, its copies), none of which fitted in the rest")
    if n_val == 0 or n_val <= 2 * val_fraction * n_blocks:
        return None
    return (f"holding out {n_val} of {n_blocks} blocks ({100 * n_val / n_blocks:.0f}%) for validation, more than "
            f"--val-fraction {val_fraction:g} asks, because at least one block is held out; train on "
            f"{n_blocks - n_val}, or pass --val-fraction 0 to train on all {n_blocks} (no validation)")


def _saved_settings(cfg: TrainConfig) -> tuple[Path | None, Path, dict[str, Any] | None]:
    """``(latest checkpoint, OUTPUT/train_config.json, the saved settings by field name)``: the file, else
    (deleted) the ``train_config`` the checkpoint's ``training_state.pt`` holds, grouped or (a run saved
    before the grouping) flat (:func:`peagle_train.train.config.flat_settings`); None without a checkpoint."""
    out = Path(cfg.run.output)
    ckpt = latest_checkpoint(out)
    saved = out / "train_config.json"
    if ckpt is None:
        return None, saved, None
    if saved.is_file():
        return ckpt, saved, flat_settings(json.loads(saved.read_text()))
    old = load_training_state(ckpt).get("train_config")
    if old is None:
        raise InputError(f"--resume: {saved} is missing and {ckpt} records no settings, so this run cannot be "
                         "checked against the saved one; start over with --force", field="--resume")
    return ckpt, saved, flat_settings(old)


def resolve_epoch_order(cfg: TrainConfig, store) -> TrainConfig:
    """``cfg`` with ``--epoch-order`` set when it was left unset: with ``--resume`` of a saved run, that run's
    (``blocks`` for a run saved before the option or before this default), so a resumed run never changes order;
    else ``conversations`` when every store is a full-context store (``layout: "windows"``, what ``peagle-data
    extract`` and ``peagle-train --extract-from`` make by default) recording its segment keys: a conversation's
    windows trained one after another, which a streaming run extracts about once an epoch, and the same order in
    the offline run, so both commands' defaults train the same weights; else ``blocks``.

    Args:
        store: the run's store(s) (``FeatureStore``, ``StoreSet`` or a streaming run's ``StreamingStore``).
    """
    if cfg.data.epoch_order is not None:
        return cfg
    order = None
    if cfg.run.resume:
        _, _, old = _saved_settings(cfg)
        order = None if old is None else old.get("epoch_order") or "blocks"
    if order is None:
        stores = store.stores if isinstance(store, StoreSet) else [store]
        full = all(s.has_views and s.segment_keys() is not None for s in stores)
        order = "conversations" if full else "blocks"
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, epoch_order=order))


def _check_resume_settings(cfg: TrainConfig) -> Path | None:
    """``--resume``: the latest checkpoint in ``--output`` (or None); InputError when the saved
    run's settings differ from ``cfg`` in a field that must not change."""
    ckpt, saved, old = _saved_settings(cfg)
    if old is not None:
        new = cfg.flat()
        # a run saved before a field existed
        old = {k: old.get(k, _BEFORE_FIELD.get(k, FIELD_DEFAULTS[k])) for k in _RESUME_FIELDS}
        diff = {k: (old[k], new[k]) for k in _RESUME_FIELDS if old[k] != new[k]}
        if diff:
            raise InputError(resume_mismatch_message(saved, diff), field="--resume")
    return ckpt


def _check_resume_verifier(cfg: TrainConfig, store, verifier_name: str) -> None:
    """``--resume`` with another verifier than the saved run's (``--verifier``, default the store's) is
    refused unless both names resolve to one model (the same content fingerprint)."""
    _, saved, old = _saved_settings(cfg)
    if old is None:
        return
    before = old.get("verifier") or store.attrs.get("verifier", {}).get("name_or_path")
    if before is None or before == verifier_name:
        return
    try:
        same = model_fingerprint(resolve_model(before)) == model_fingerprint(resolve_model(verifier_name))
    except PeagleError:  # the saved verifier cannot be found any more
        same = False
    if not same:
        raise InputError(resume_mismatch_message(saved, {"verifier": (before, verifier_name)}), field="--resume")


_STORE_IDENTITY = ("source", "shard", "n_blocks", "layers", "verifier_fingerprint", "context")
"""The keys of :func:`peagle_train.data.multistore.store_identities` a resumed run's stores must keep (the
features' ``context`` too: a store extracted again with the other ``--context`` holds other features;
checkpoints saved before it was recorded are not checked for it)."""


def _check_resume_stores(cfg: TrainConfig, store) -> None:
    """``--resume``: each store holds the data the saved run trained on (the identities its newest
    checkpoint records, ``peagle_training.stores``), not a store extracted anew at the same path.

    Raises:
        StoreMismatchError: names the store, the checkpoint, the key and both values.
    """
    ckpt = latest_checkpoint(cfg.run.output)
    if ckpt is None or not (ckpt / CONFIG_FILE).is_file():
        return
    saved = json.loads((ckpt / CONFIG_FILE).read_text()).get("peagle_training", {}).get("stores") or []
    for old, new in zip(saved, store_identities(store)):
        for key in (k for k in _STORE_IDENTITY if k in old and old[k] != new.get(k)):
            raise StoreMismatchError(
                f"--resume: {new['path']} is not the store the saved run trained on ({ckpt}): its {key} is "
                f"{new.get(key)!r}, the run's was {old[key]!r}; resume with the run's store, or start a new run "
                "(a new --output, or --force)")


def resume_mismatch_message(saved: Path, diff: dict[str, tuple[Any, Any]]) -> str:
    """The ``--resume`` refusal: which settings differ from ``saved`` (train_config.json), the command that
    resumes, the options that may change on resume, and why ``--max-steps`` may not (docs/design.md §8)."""
    free = [f"--{name.replace('_', '-')}" for name in FIELD_DEFAULTS
            if name not in (*_RESUME_FIELDS, "output", "verifier", "resume", "force", "grad_accum", "init_from",
                            "init_from_sha256")]
    free.append("--grad-accum (keeping --grad-accum × processes)")
    given = "; ".join(f"--{k.replace('_', '-')}: saved {a!r}, given {b!r}" for k, (a, b) in diff.items())
    message = (f"--resume continues the run saved in {saved.parent} with its own settings, and these differ "
               f"from it: {given}. Resume it with: peagle-train --config {saved} --resume (adding only options "
               f"that may change on resume: {', '.join(free)})")
    if "max_steps" in diff:
        message += (". --max-steps cannot change on resume: it is the length of the cosine learning-rate "
                    "schedule, so the resumed run would no longer be the saved run continued; to train longer, "
                    "start a new run (a new --output, or --force)")
    return message


def prepare_output(cfg: TrainConfig) -> Path | None:
    """Create or check the output directory; return the checkpoint to resume from, if any."""
    out = Path(cfg.run.output)
    if cfg.run.resume:
        ckpt = _check_resume_settings(cfg)
        out.mkdir(parents=True, exist_ok=True)
        return ckpt
    if check_replaceable(out, cfg.run.force, "pass --resume to continue it or --force to overwrite it"):
        shutil.rmtree(out)  # a training run's output only (check_replaceable refuses other files)
    out.mkdir(parents=True, exist_ok=True)
    return None


def check_before_weights(cfg: TrainConfig, store, verifier_name: str, kind: DrafterKind,
                         init: InitSource | None = None) -> None:
    """Every check that needs only the options, the store, the file system and the verifier's config,
    run before the verifier's weights load (docs/design.md §2).

    Raises:
        OutputExistsError: ``--output`` holds files and neither ``--resume`` nor ``--force`` is given.
        InputError: ``--draft-vocab-size`` exceeds the store's vocab; a DFlash ``--block-size`` longer than the
            store's rows; ``--resume`` with settings that
            differ from the saved run, another verifier among them (compared by content fingerprint
            when the names differ).
        StoreMismatchError: ``--resume`` with a store other than the saved run's under its path
            (packed table, shard, block count, layers, verifier fingerprint or the features' context).
        StoreMismatchError: the verifier's config has another hidden or vocab size than the store, or
            the verifier is not the store's (content fingerprint, or the tokenizer the store's ids were
            made with: :func:`runtime.verifier_match.check_store_verifier`).
        InputError: a verifier RoPE the drafter cannot compute (``dynamic``, ``longrope``); a drafter
            vLLM could not serve as trained (:func:`peagle_train.model.checkpoint.vllm_problems`: aux layers
            not increasing, an activation other than silu, ...).
        StoreFormatError: a store whose aux layer L is the normed final state (extracted by an older
            peagle: :func:`stores.features.feature_store.check_layer_convention`).
        InputError: an ``--init-from`` drafter (``init``) that does not fit the store, the verifier or the
            options (:func:`check_init_source`); ``--init-layers verifier`` with a verifier whose layers the
            drafter's cannot copy (:func:`peagle_train.model.warm_start.check_verifier_layers`).
    """
    out = Path(cfg.run.output)
    if not cfg.run.resume:
        check_replaceable(out, cfg.run.force, "pass --resume to continue it or --force to overwrite it")
    if cfg.run.resume:
        _check_resume_settings(cfg)
        _check_resume_verifier(cfg, store, verifier_name)
        _check_resume_stores(cfg, store)
    if cfg.model.draft_vocab_size is not None and cfg.model.draft_vocab_size > store.vocab_size:
        raise InputError(f"--draft-vocab-size {cfg.model.draft_vocab_size} exceeds the verifier vocab size "
                         f"{store.vocab_size} (store {store.path})", field="--draft-vocab-size")
    rows = int(store.attrs["block_size"])
    if cfg.model.block_size is not None and cfg.model.block_size > rows:  # a DFlash block: its slots past a row
        raise InputError(f"--block-size {cfg.model.block_size} is longer than the store's rows ({rows} tokens, store "
                         f"{store.path}): no block fits, and each of the up to --max-anchors blocks a row trains "
                         "costs memory for every slot", field="--block-size")
    for one in getattr(store, "stores", [store]):  # a StoreSet's stores, or the store
        check_layer_convention(one.attrs, str(one.path))
    config = load_model_config(verifier_name)
    vc = text_config(config)
    _check_verifier_shape(verifier_name, vc, store)
    files = model_files(verifier_name)
    for s in getattr(store, "stores", [store]):  # each store of a StoreSet
        check_store_verifier(s, files)
    rope = verifier_rope(vc)
    if rope["rope_type"] not in ROPE_TYPES:
        raise InputError(f"verifier {verifier_name!r} uses RoPE type {rope['rope_type']!r}, whose frequencies "
                         f"change with the sequence length; the drafter supports {', '.join(ROPE_TYPES)}",
                         field="--verifier")
    # the config.json this run will write (the mask token is chosen later; any id stands for it here)
    D = init.config.draft_vocab_size if init is not None else cfg.model.draft_vocab_size or store.vocab_size
    planned = build_drafter_config(SimpleNamespace(config=config, name_or_path=verifier_name, mask_token_id=0),
                                   store, cfg, D)
    if init is not None:
        check_init_source(init, planned, cfg, store)
    if cfg.model.init_layers == "verifier":
        check_verifier_layers(vc, planned, verifier_name)
    kind.check_servable(kind.config_json(kind.make_config(planned, cfg)), None,
                        f"peagle-train on {store.path} (layers {list(store.layers)}, verifier {verifier_name!r})")


def _check_verifier_shape(name: str, text_cfg, store) -> None:
    """Raise :class:`StoreMismatchError` unless the verifier's (language model's) ``hidden_size`` and
    ``vocab_size`` are the store's."""
    H, V = int(text_cfg.hidden_size), int(text_cfg.vocab_size)
    if H != store.hidden_size or V != store.vocab_size:
        raise StoreMismatchError(
            f"verifier {name!r} has hidden_size {H} and vocab_size {V}, but the store {store.path} was "
            f"extracted with hidden_size {store.hidden_size} and vocab_size {store.vocab_size} "
            f"(verifier {store.attrs['verifier'].get('name_or_path')!r}); pass --verifier with that model")


def resolve_init_from(cfg: TrainConfig) -> tuple[TrainConfig, InitSource | None]:
    """The run's ``--init-from`` drafter, read (no weights) by the run's drafter kind
    (:meth:`~peagle_train.train.kinds.DrafterKind.read_init_source`) and recorded in the config (its checkpoint
    directory and weights' sha256; a DFlash source's block size where ``--block-size`` was left out); on
    ``--resume`` of a warm start, the saved run's record, and its newest checkpoint read as the source (its draft
    vocab and mask token are the run's; its weights are loaded anyway by the resume), or, without a checkpoint
    yet, the saved drafter again.

    Returns:
        (``cfg`` with ``init_from`` the absolute checkpoint directory and ``init_from_sha256`` set, the
        :class:`~peagle_train.model.warm_start.InitSource` or None: no ``--init-from``).

    Raises:
        InputError: ``--resume`` with an ``--init-from`` (or sha256) other than the saved run's (a warm
            start begins a run; a resume continues one); ``--init-from-sha256`` other than the drafter's; a
            drafter of another kind than ``--method``'s (naming both).
        StoreFormatError / InputError: from :func:`peagle_train.model.warm_start.read_init_source`.
    """
    kind = drafter_kind(cfg.model.method)
    if cfg.run.resume:
        _, saved, old = _saved_settings(cfg)
        before = (old or {}).get("init_from"), (old or {}).get("init_from_sha256")
        given = cfg.model.init_from, cfg.model.init_from_sha256
        if given[0] is not None and (given[0] != before[0] or given[1] not in (None, before[1])):
            raise InputError(f"--init-from cannot be combined with --resume: --resume continues the run saved in "
                             f"{saved.parent} from its checkpoint (started from {before[0]!r}), --init-from "
                             f"{given[0]!r} starts a new run from a drafter; drop --init-from to resume, or "
                             "start a new run (a new --output, or --force)", field="--init-from")
        model = dataclasses.replace(cfg.model, init_from=before[0], init_from_sha256=before[1])
        cfg = dataclasses.replace(cfg, model=model)
        ckpt = latest_checkpoint(cfg.run.output)
        if before[0] is None:
            return cfg, None
        if ckpt is not None:  # the run's own checkpoint: its draft vocab and mask token, which are the drafter's
            return _with_block_size(cfg, kind.read_init_source(ckpt))
    if cfg.model.init_from is None:
        return cfg, None
    init = kind.read_init_source(cfg.model.init_from)
    if cfg.model.init_from_sha256 not in (None, init.weights_sha256):
        raise InputError(f"--init-from {init.path}: its {init.path / 'model.safetensors'} has sha256 "
                         f"{init.weights_sha256}, --init-from-sha256 is {cfg.model.init_from_sha256}: not the "
                         "drafter the run was started from; give that drafter, or drop --init-from-sha256",
                         field="--init-from-sha256")
    model = dataclasses.replace(cfg.model, init_from=str(init.path), init_from_sha256=init.weights_sha256)
    return _with_block_size(dataclasses.replace(cfg, model=model), init)


def _with_block_size(cfg: TrainConfig, init: InitSource) -> tuple[TrainConfig, InitSource]:
    """``(cfg, init)``, ``cfg``'s ``--block-size`` the DFlash source's where it was left out (a given one
    that differs is refused by :func:`check_init_source`)."""
    if init.block_size is None or cfg.model.block_size is not None:
        return cfg, init
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, block_size=init.block_size)), init


def _rope_key(rope: dict[str, Any]) -> dict[str, Any]:
    """A RoPE dict comparable across writers: numbers as floats, ``partial_rotary_factor`` 1 dropped."""
    out = {k: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for k, v in rope.items()}
    if out.get("partial_rotary_factor") == 1.0:
        out.pop("partial_rotary_factor")
    return out


def check_init_source(init: InitSource, planned: DrafterConfig, cfg: TrainConfig, store) -> None:
    """The ``--init-from`` drafter fits this run: the store's hidden size, vocab size and aux layers, the
    verifier's RoPE and attention/MLP shapes (``planned``: the drafter this run would build), and the
    options ``--drafter-layer``, ``--num-layers``, ``--block-size`` (DFlash), ``--num-depths``, ``--mask-token-id``
    and ``--draft-vocab-size``.

    The draft vocab is the drafter's (its lm_head rows are trained for its tokens): without
    ``--draft-vocab-size`` the run takes it; with it, its size and the maps it builds from the store's
    token counts (:func:`build_draft_vocab`) must be the drafter's. The mask token is the drafter's
    (EAGLE-3 has none: the run chooses one); ``--mask-token-id`` must equal it when given.

    Raises:
        InputError: naming ``--init-from``, the field, both values and the fix (``field`` the option to change).
    """
    d = init.config
    where = f"--init-from {init.path}"

    def refuse(what: str, theirs: Any, ours: Any, of: str, fix: str, option: str = "--init-from") -> None:
        raise InputError(f"{where}: the drafter's {what} is {theirs!r} but {of} is {ours!r}; {fix}", field=option)

    other = "train a fresh drafter (drop --init-from) or start from a drafter of this verifier and store"
    if d.hidden_size != store.hidden_size:
        refuse("hidden_size", d.hidden_size, store.hidden_size, f"the store {store.path}'s", other)
    if d.vocab_size != store.vocab_size:
        refuse("vocab_size (the verifier vocab)", d.vocab_size, store.vocab_size, f"the store {store.path}'s", other)
    if list(d.aux_layer_ids) != list(store.layers):
        ids_key = "aux_hidden_state_layer_ids" if init.format == "dflash" else "eagle_aux_hidden_state_layer_ids"
        refuse(f"{ids_key} ({d.num_aux_layers} layers)", list(d.aux_layer_ids),
               list(store.layers), f"the store's layers ({len(store.layers)})",
               f"extract a store with --layers {','.join(map(str, d.aux_layer_ids))}, or {other}")
    if _rope_key(d.rope_parameters) != _rope_key(planned.rope_parameters):
        refuse("RoPE (type, theta, scaling)", d.rope_parameters, planned.rope_parameters,
               f"the verifier {planned.verifier_name_or_path!r}'s", other)
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps"):
        if getattr(d, key) != getattr(planned, key):
            refuse(key, getattr(d, key), getattr(planned, key), f"the verifier {planned.verifier_name_or_path!r}'s "
                   "(the drafter peagle trains mirrors it)", other)
    if d.layer_type != planned.layer_type:
        refuse("layer type", d.layer_type, planned.layer_type, "--drafter-layer",
               f"pass --drafter-layer {d.layer_type} or drop --drafter-layer (the run takes the drafter's)",
               "--drafter-layer")
    if d.num_hidden_layers != cfg.model.num_layers:
        refuse("num_hidden_layers", d.num_hidden_layers, cfg.model.num_layers, "--num-layers",
               f"pass --num-layers {d.num_hidden_layers}", "--num-layers")
    if init.block_size is not None and init.block_size != cfg.model.block_size:
        refuse("block_size", init.block_size, cfg.model.block_size, "--block-size",
               f"drop --block-size (the run takes the drafter's) or pass --block-size {init.block_size}",
               "--block-size")
    if init.num_depths is not None and init.num_depths != cfg.model.num_depths:
        refuse("num_depths (speculative_tokens)", init.num_depths, cfg.model.num_depths, "--num-depths",
               f"pass --num-depths {init.num_depths}", "--num-depths")
    if init.mask_token_id is not None and cfg.model.mask_token_id not in (None, init.mask_token_id):
        refuse("mask token", init.mask_token_id, cfg.model.mask_token_id, "--mask-token-id",
               f"drop --mask-token-id (the run takes the drafter's) or pass --mask-token-id {init.mask_token_id}",
               "--mask-token-id")
    asked = cfg.model.draft_vocab_size
    if asked is not None:
        if asked != d.draft_vocab_size:
            refuse("draft_vocab_size", d.draft_vocab_size, asked, "--draft-vocab-size",
                   "drop --draft-vocab-size (the run takes the drafter's draft vocab)", "--draft-vocab-size")
        ours = build_draft_vocab(store.token_freq(), asked)  # [D] offsets; all 0 when D == V
        theirs = init.d2t if init.d2t is not None else torch.zeros(asked, dtype=torch.int64)
        if not torch.equal(ours, theirs):
            i = int(torch.nonzero(ours != theirs).flatten()[0])
            refuse(f"draft vocab (d2t) at draft id {i}: verifier token", i + int(theirs[i]), i + int(ours[i]),
                   f"the {asked} most frequent tokens of the store {store.path} there",
                   "drop --draft-vocab-size (the run takes the drafter's draft vocab)", "--draft-vocab-size")
