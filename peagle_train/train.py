"""Training a P-EAGLE drafter (docs/design.md §8): :func:`run_train`, store in, drafter checkpoint out.

Legend: H hidden size, V verifier vocab, D draft vocab, K ``num_depths``.

This module holds the run's settings (:class:`TrainConfig`) and what is derived from them before
training: the checks that need no weights, the verifier's heads, the draft vocab and the drafter's
config. :func:`run_train` builds a :class:`peagle_train.trainer.Trainer` and trains it; the step,
validation and checkpoints live there, ``metrics.jsonl``, trackers and the plot in
:mod:`peagle_train.metrics`. The verifier is loaded only for its ``embed_tokens`` and ``lm_head``
weights; it is never run.

Output directory layout:
- ``train_config.json``: the :class:`TrainConfig`'s settings, without the actions ``--resume`` and
  ``--force`` (checked again on ``--resume``);
- ``metrics.jsonl``: one line per step (step, loss (the pooled objective), acc per depth, tokens/s, lr, the block ids read,
  grad norm, ...) and one per validation (``"split": "val"``);
- ``checkpoint-N/``: drafter (``config.json``, ``model.safetensors``) plus ``training_state.pt``
  (the AdamW moments of the trainable weights): a full copy per checkpoint, all kept unless
  ``save_total_limit`` (``--save-total-limit``) keeps only the newest N;
- ``final/``: the drafter at the last step, the directory to serve or evaluate;
- ``training.png``: loss and per-depth accuracy against steps;
- ``trackers/``: only with ``report_to`` (``--report-to``): the accelerate trackers' files (TensorBoard
  event files under ``trackers/peagle/``, wandb runs under ``trackers/wandb/``), fed the same rows as
  ``metrics.jsonl`` (see :func:`peagle_train.metrics.tracker_values`).
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

from peagle_train.attention import ATTENTION_CHOICES
from peagle_train.checkpoint import (CONFIG_FILE, check_servable, drafter_config_json, latest_checkpoint,
                                     load_training_state, rope_from_layer_config)
from peagle_train.metrics import parse_report_to
from peagle_train.model import ROPE_TYPES, DrafterConfig
from peagle_train.multistore import store_identities
from stores.errors import InputError, OutputExistsError, PeagleError, StoreMismatchError
from stores.feature_store import check_layer_convention
from stores.model_cache import model_fingerprint, resolve_model
from stores.verifier_match import check_store_verifier

__all__ = [
    "TrainConfig",
    "VerifierHeads",
    "run_train",
    "load_verifier_heads",
    "build_draft_vocab",
    "build_drafter_config",
    "verifier_rope",
    "val_split_warning",
    "check_before_weights",
]


def run_train(cfg: TrainConfig) -> dict[str, Any]:
    """Train a P-EAGLE drafter on a feature store and save it (docs/design.md §8).

    Returns:
        A summary: ``steps``, ``last_step_loss`` (the loss of one step, ``last_step``, the last),
        ``per_depth_accuracy_last_steps`` (pooled over the last 10 steps this process ran, first and
        last given as ``per_depth_accuracy_steps``: Σ weighted correct / Σ weight per depth; [] and
        None when this run took no step),
        ``val_loss``, ``val_per_depth_accuracy``, ``checkpoint`` (the ``final/`` directory),
        ``metrics``, ``plot``, ``tokens_per_second``, ``data_wait_fraction``, ``resumed_from``, ``rank``,
        ``world_size`` (data-parallel processes), ``mask_token``.

    Raises:
        StoreFormatError: missing or unfinished store (without ``allow_incomplete``).
        StoreMismatchError: the verifier does not match the store.
        OutputExistsError: output exists without ``resume`` or ``force``.
        InputError: ``--resume`` with settings that differ from the saved run, or a draft vocab
            larger than the verifier's, or ``attention_backend="flex"`` without CUDA.
        MissingDependencyError: a ``report_to`` tracker whose package is not installed.
    """
    from peagle_train.trainer import build_trainer

    trainer = build_trainer(cfg)
    summary = trainer.train()
    trainer.close()
    return summary


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything ``peagle-train`` needs; runtime handles (store, model) are built by :func:`run_train`."""

    store: str | list[str]
    """Feature store written by ``peagle-data extract`` (``--store``); repeat it (``--store A --store B``)
    or give a file listing one store per line to train on several stores of one verifier and layer
    set as one (:mod:`peagle_train.multistore`)."""
    output: str
    """Output directory: checkpoints, metrics.jsonl, the plot (``--output``)."""
    verifier: str | None = None
    """Verifier MODEL for embeddings and lm_head (``--verifier``); default: the store's verifier."""
    max_steps: int | None = None
    """Optimizer steps (``--max-steps``); None: one pass over the training blocks (those extracted when
    the run starts; a resume keeps the saved run's count)."""
    num_depths: int = 4
    """K, parallel draft depths (``--num-depths``). The default 4 is measured (docs/benchmarks.md,
    "Defaults from evidence"): K = 8 trained no better depth-for-depth in the same steps and took 31%
    longer, and the P-EAGLE ablations find depths past ~5 add < 2% of accepted tokens."""
    down_sample_ratio: float = 0.5
    """COD keep ratio r per depth, in (0, 1] (``--down-sample-ratio``). The default 0.5 is measured:
    the same held-out acceptance as 0.7 in 18% less time, as the P-EAGLE ablations found for a
    1-layer drafter."""
    down_sample_ratio_min: float = 0.2
    """Floor of the COD keep ratio, in (0, 1] (``--down-sample-ratio-min``)."""
    max_anchors: int | None = None
    """Cap on COD seeds per block (``--max-anchors``); None: no cap."""
    lr: float = 1e-3
    """Peak AdamW learning rate (``--lr``). The default 1e-3 is measured: held-out acceptance above
    3e-4's in the same steps (docs/benchmarks.md, "Defaults from evidence")."""
    warmup_steps: int | None = None
    """Linear warm-up steps (``--warmup-steps``); None: 5% of max_steps."""
    weight_decay: float = 0.0
    """AdamW weight decay (``--weight-decay``)."""
    grad_clip: float = 1.0
    """Max gradient norm (``--grad-clip``); must be > 0."""
    grad_accum: int = 1
    """Blocks per optimizer step and rank (``--grad-accum``); the step's loss pools their elements. A
    ``--resume`` on another number of processes keeps ``grad_accum`` × processes, the blocks of one step."""
    seed: int = 0
    """Seed of the split, the shuffles, COD sampling and the drafter init (``--seed``)."""
    draft_vocab_size: int | None = None
    """D, the most frequent loss-masked tokens (``--draft-vocab-size``); None: the verifier's vocab."""
    num_layers: int = 1
    """Drafter decoder layers (``--num-layers``)."""
    save_every: int | None = None
    """Steps between checkpoints (``--save-every``); None: only at the end."""
    save_total_limit: int | None = None
    """Keep only the newest N ``checkpoint-N/`` directories (``--save-total-limit``), each a full copy
    of the drafter weights plus the optimizer state; ``final/`` is never removed. None: keep all."""
    val_fraction: float = 0.05
    """Fraction of blocks held out for validation, in [0, 1) (``--val-fraction``)."""
    val_max_blocks: int = 16
    """Validation reads at most this many held-out blocks (``--val-max-blocks``)."""
    allow_incomplete: bool = False
    """Train on the done blocks of an unfinished store (``--allow-incomplete``)."""
    loss_chunk_size: int = 2048
    """Elements per logits chunk in the loss (``--loss-chunk-size``)."""
    resume: bool = dataclasses.field(default=False, metadata={"action": True})
    """Continue from the latest ``checkpoint-N`` in output (``--resume``)."""
    force: bool = dataclasses.field(default=False, metadata={"action": True})
    """Delete an existing output directory first (``--force``)."""
    log_every: int = 1
    """Steps between metrics.jsonl lines (``--log-every``)."""
    lazy_embedding: bool = True
    """Update only the embedding rows a step touched (``--lazy-embedding/--dense-embedding``)."""
    train_embedding: bool = True
    """Train the drafter's token embedding (initialised from the verifier's), or keep it frozen as
    EAGLE-3 does (``--train-embedding/--freeze-embedding``); recorded as ``embed_requires_grad``."""
    attention_backend: str = "auto"
    """Drafter attention backend (``--attention-backend``), a name of
    :data:`peagle_train.attention.ATTENTION_BACKENDS` (``sdpa``: dense mask; ``flex``: flex_attention
    BlockMasks, CUDA only; ``split``: no element×element tensor) or ``auto`` (flex on CUDA, split
    otherwise: :data:`peagle_train.attention.AUTO_BACKEND`)."""
    mask_token_id: int | None = None
    """Token fed at depth > 0; must never occur as a supervised token in the store (``--mask-token-id``);
    None: an unused special or reserved token, chosen by :func:`peagle_train.mask_token.choose_mask_token`
    (see the README)."""
    report_to: str | None = None
    """Accelerate trackers fed the metrics.jsonl rows, comma-separated: tensorboard, wandb, all installed
    (``--report-to``); files under OUTPUT/trackers; wandb runs offline with WANDB_MODE=offline. None:
    none (no tracker package imported)."""

    def __post_init__(self) -> None:
        def need(ok: bool, option: str, rule: str, value: Any) -> None:
            if not ok:
                raise ValueError(f"{option} must be {rule}, got {value!r}")

        need(self.num_depths >= 1, "--num-depths", ">= 1", self.num_depths)
        need(0.0 < self.down_sample_ratio <= 1.0, "--down-sample-ratio", "in (0, 1]", self.down_sample_ratio)
        need(0.0 < self.down_sample_ratio_min <= 1.0, "--down-sample-ratio-min", "in (0, 1]",
             self.down_sample_ratio_min)
        need(self.max_anchors is None or self.max_anchors >= 1, "--max-anchors", ">= 1 when set", self.max_anchors)
        need(self.max_steps is None or self.max_steps >= 1, "--max-steps", ">= 1 when set", self.max_steps)
        need(self.lr > 0, "--lr", "> 0", self.lr)
        need(self.warmup_steps is None or self.warmup_steps >= 0, "--warmup-steps", ">= 0", self.warmup_steps)
        need(self.weight_decay >= 0, "--weight-decay", ">= 0", self.weight_decay)
        need(self.grad_clip > 0, "--grad-clip", "> 0", self.grad_clip)
        need(self.grad_accum >= 1, "--grad-accum", ">= 1", self.grad_accum)
        need(self.draft_vocab_size is None or self.draft_vocab_size >= 1, "--draft-vocab-size", ">= 1 when set",
             self.draft_vocab_size)
        need(self.num_layers >= 1, "--num-layers", ">= 1", self.num_layers)
        need(self.save_every is None or self.save_every >= 1, "--save-every", ">= 1 when set", self.save_every)
        need(self.save_total_limit is None or self.save_total_limit >= 1, "--save-total-limit", ">= 1 when set",
             self.save_total_limit)
        need(0.0 <= self.val_fraction < 1.0, "--val-fraction", "in [0, 1)", self.val_fraction)
        need(self.val_max_blocks >= 0, "--val-max-blocks", ">= 0", self.val_max_blocks)
        need(self.loss_chunk_size >= 1, "--loss-chunk-size", ">= 1", self.loss_chunk_size)
        need(self.log_every >= 1, "--log-every", ">= 1", self.log_every)
        need(self.mask_token_id is None or self.mask_token_id >= 0, "--mask-token-id", ">= 0 when set",
             self.mask_token_id)
        need(not (self.resume and self.force), "--resume/--force", "used one at a time", "both")
        need(self.attention_backend in ATTENTION_CHOICES, "--attention-backend",
             f"one of {', '.join(ATTENTION_CHOICES)}", self.attention_backend)
        parse_report_to(self.report_to)  # InputError (a ValueError) naming --report-to

    def to_dict(self) -> dict[str, Any]:
        """The run's settings as written to ``train_config.json`` (and ``training_state.pt``, the
        trackers' hyper-parameters): every field but the actions ``resume`` and ``force``
        (``metadata={"action": True}``), which belong to one invocation, so that
        ``peagle-train --config OUTPUT/train_config.json --resume`` continues a run started with ``--force``."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if not type(self).__dataclass_fields__[k].metadata.get("action")}


#: fields that must equal the saved ones for ``--resume`` to reproduce an uninterrupted run
#: (``grad_accum`` may change with the number of processes: their product, the blocks of one step, may
#: not; :func:`peagle_train.data.resume_cursor` checks it)
_RESUME_FIELDS = ("store", "max_steps", "num_depths", "down_sample_ratio", "down_sample_ratio_min",
                  "max_anchors", "lr", "warmup_steps", "weight_decay", "seed",
                  "draft_vocab_size", "num_layers", "val_fraction", "lazy_embedding", "grad_clip", "mask_token_id",
                  "train_embedding")


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
    """

    name_or_path: str
    config: Any
    embed: torch.Tensor
    lm_head: torch.Tensor
    mask_token_id: int


def load_verifier_heads(name: str, store, mask_token_id: int) -> VerifierHeads:
    """Load the verifier's embeddings and lm_head and check them against the store.

    ``mask_token_id`` is recorded as is (chosen before the weights load, see
    :func:`peagle_train.mask_token.resolve_mask_token`).

    Raises:
        StoreMismatchError: the verifier's content fingerprint, tokenizer, hidden size or vocab size
            differs from the store's (:func:`stores.verifier_match.check_store_verifier`).
        ModelNotFoundError / MissingDependencyError: from :func:`stores.model_cache.resolve_model`.
    """
    from stores.model_cache import load_verifier

    check_store_verifier(store, name)
    model = load_verifier(name, dtype=torch.float32, device="cpu")
    cfg = model.config.get_text_config()  # a multimodal wrapper's language model
    _check_verifier_shape(name, cfg, store)
    embed = model.get_input_embeddings().weight.detach().float().clone()  # [V, H]
    lm_head = model.get_output_embeddings().weight.detach().float().clone()  # [V, H]
    del model
    return VerifierHeads(name_or_path=str(name), config=cfg, embed=embed, lm_head=lm_head,
                         mask_token_id=int(mask_token_id))


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
        draft_vocab_size=draft_vocab_size, aux_layer_ids=list(store.layers), num_hidden_layers=cfg.num_layers,
        rms_norm_eps=float(getattr(vc, "rms_norm_eps", 1e-5)), rope_theta=theta, rope_parameters=rope,
        max_position_embeddings=int(getattr(vc, "max_position_embeddings", 8192)),
        mask_token_id=heads.mask_token_id, num_depths=cfg.num_depths,
        hidden_act="silu",  # the MLP trains from scratch; vLLM's EAGLE-3 drafter MLP computes only silu
        verifier_name_or_path=heads.name_or_path,
        verifier_architectures=list(getattr(heads.config, "architectures", None) or ["LlamaForCausalLM"]),
    )


def val_split_warning(n_blocks: int, n_val: int, val_fraction: float) -> str | None:
    """A warning when the validation split holds out more than twice ``val_fraction`` of the blocks.

    :func:`peagle_train.data.split_blocks` holds out at least one block of a store with two or more
    (1 of 2 blocks is 50% for ``--val-fraction 0.05``); that is kept, and said. None otherwise.
    """
    if n_val == 0 or n_val <= 2 * val_fraction * n_blocks:
        return None
    return (f"holding out {n_val} of {n_blocks} blocks ({100 * n_val / n_blocks:.0f}%) for validation, more than "
            f"--val-fraction {val_fraction:g} asks, because at least one block is held out; train on "
            f"{n_blocks - n_val}, or pass --val-fraction 0 to train on all {n_blocks} (no validation)")


def _saved_settings(cfg: TrainConfig) -> tuple[Path | None, Path, dict[str, Any] | None]:
    """``(latest checkpoint, OUTPUT/train_config.json, the saved settings)``: the file, else (deleted) the
    ``train_config`` the checkpoint's ``training_state.pt`` holds; None without a checkpoint."""
    out = Path(cfg.output)
    ckpt = latest_checkpoint(out)
    saved = out / "train_config.json"
    if ckpt is None:
        return None, saved, None
    if saved.is_file():
        return ckpt, saved, json.loads(saved.read_text())
    old = load_training_state(ckpt).get("train_config")
    if old is None:
        raise InputError(f"--resume: {saved} is missing and {ckpt} records no settings, so this run cannot be "
                         "checked against the saved one; start over with --force", field="--resume")
    return ckpt, saved, old


def _check_resume_settings(cfg: TrainConfig) -> Path | None:
    """``--resume``: the latest checkpoint in ``--output`` (or None); InputError when the saved
    run's settings differ from ``cfg`` in a field that must not change."""
    ckpt, saved, old = _saved_settings(cfg)
    if old is not None:
        defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
        old = {k: old.get(k, defaults[k]) for k in _RESUME_FIELDS}  # a run saved before a field existed
        diff = {k: (old[k], getattr(cfg, k)) for k in _RESUME_FIELDS if old[k] != getattr(cfg, k)}
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


_STORE_IDENTITY = ("source", "shard", "n_blocks", "layers", "verifier_fingerprint")
"""The keys of :func:`peagle_train.multistore.store_identity` a resumed run's stores must keep."""


def _check_resume_stores(cfg: TrainConfig, store) -> None:
    """``--resume``: each store holds the data the saved run trained on (the identities its newest
    checkpoint records, ``peagle_training.stores``), not a store extracted anew at the same path.

    Raises:
        StoreMismatchError: names the store, the checkpoint, the key and both values.
    """
    ckpt = latest_checkpoint(cfg.output)
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
    free = [f"--{f.name.replace('_', '-')}" for f in dataclasses.fields(TrainConfig)
            if f.name not in (*_RESUME_FIELDS, "output", "verifier", "resume", "force", "grad_accum")]
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


def _prepare_output(cfg: TrainConfig) -> Path | None:
    """Create or check the output directory; return the checkpoint to resume from, if any."""
    out = Path(cfg.output)
    if cfg.resume:
        ckpt = _check_resume_settings(cfg)
        out.mkdir(parents=True, exist_ok=True)
        return ckpt
    if out.exists() and any(out.iterdir()):
        if not cfg.force:
            raise OutputExistsError(str(out), "pass --resume to continue it or --force to overwrite it")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    return None


def check_before_weights(cfg: TrainConfig, store, verifier_name: str) -> None:
    """Every check that needs only the options, the store, the file system and the verifier's config,
    run before the verifier's weights load (docs/design.md §2).

    Raises:
        OutputExistsError: ``--output`` holds files and neither ``--resume`` nor ``--force`` is given.
        InputError: ``--draft-vocab-size`` exceeds the store's vocab; ``--resume`` with settings that
            differ from the saved run, another verifier among them (compared by content fingerprint
            when the names differ).
        StoreMismatchError: ``--resume`` with a store other than the saved run's under its path
            (packed table, shard, block count, layers or verifier fingerprint).
        StoreMismatchError: the verifier's config has another hidden or vocab size than the store, or
            the verifier is not the store's (content fingerprint, or the tokenizer the store's ids were
            made with: :func:`stores.verifier_match.check_store_verifier`).
        InputError: a verifier RoPE the drafter cannot compute (``dynamic``, ``longrope``); a drafter
            vLLM could not serve as trained (:func:`peagle_train.checkpoint.vllm_problems`: aux layers
            not increasing, an activation other than silu, ...).
        StoreFormatError: a store whose aux layer L is the normed final state (extracted by an older
            peagle: :func:`stores.feature_store.check_layer_convention`).
    """
    from stores.model_config import load_model_config, text_config

    out = Path(cfg.output)
    if not (cfg.resume or cfg.force) and out.exists() and any(out.iterdir()):
        raise OutputExistsError(str(out), "pass --resume to continue it or --force to overwrite it")
    if cfg.resume:
        _check_resume_settings(cfg)
        _check_resume_verifier(cfg, store, verifier_name)
        _check_resume_stores(cfg, store)
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > store.vocab_size:
        raise InputError(f"--draft-vocab-size {cfg.draft_vocab_size} exceeds the verifier vocab size "
                         f"{store.vocab_size} (store {store.path})", field="--draft-vocab-size")
    for one in getattr(store, "stores", [store]):  # a StoreSet's stores, or the store
        check_layer_convention(one.attrs, str(one.path))
    config = load_model_config(verifier_name)
    vc = text_config(config)
    _check_verifier_shape(verifier_name, vc, store)
    for s in getattr(store, "stores", [store]):  # each store of a StoreSet
        check_store_verifier(s, verifier_name)
    rope = verifier_rope(vc)
    if rope["rope_type"] not in ROPE_TYPES:
        raise InputError(f"verifier {verifier_name!r} uses RoPE type {rope['rope_type']!r}, whose frequencies "
                         f"change with the sequence length; the drafter supports {', '.join(ROPE_TYPES)}",
                         field="--verifier")
    # the config.json this run will write (the mask token is chosen later; any id stands for it here)
    planned = build_drafter_config(SimpleNamespace(config=config, name_or_path=verifier_name, mask_token_id=0),
                                   store, cfg, cfg.draft_vocab_size or store.vocab_size)
    check_servable(drafter_config_json(planned), None,
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
