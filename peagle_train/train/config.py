"""The settings of a training run (docs/design.md §8): :class:`TrainConfig`, grouped as
:class:`DataConfig`, :class:`ModelConfig`, :class:`OptimConfig` and :class:`RunConfig`.

Each field is one ``peagle-train`` option (cli/options.py: a group's fields are flags as any other,
``--lr`` for ``optim.lr``), so a field name is unique over the groups. ``train_config.json`` and
``--print-config`` hold the grouped form (:meth:`TrainConfig.to_dict`); :func:`flat_settings` reads it
and the flat form of the files written before the grouping alike.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from peagle_train.data.loader import EPOCH_ORDERS
from peagle_train.model.attention import ATTENTION_CHOICES
from peagle_train.model.config import DRAFTER_METHODS, LAYER_TYPES
from peagle_train.model.dflash import DFLASH_BLOCK_SIZE
from peagle_train.model.warm_start import INIT_LAYERS
from peagle_train.train.loss import LOSSES
from peagle_train.train.metrics import parse_report_to
from stores.stream.plan import parse_size

__all__ = ["depth_weight_values", "DataConfig", "ModelConfig", "OptimConfig", "RunConfig", "StreamConfig", "STREAM_POLICIES",
           "STREAM_CONTEXTS", "TrainConfig", "GROUPS", "FIELD_DEFAULTS", "DFLASH_DECAY_GAMMA",
           "flat_settings"]


DFLASH_DECAY_GAMMA = 4.0
"""γ of a DFlash drafter's per-position loss weights ``exp(-(j - 1) / γ)`` for block slot j >= 1 (the DFlash
paper's decay; speculators' ``dflash_decay_gamma`` default, the paper's value for B = 8)."""


def _need(ok: bool, option: str, rule: str, value: Any) -> None:
    """ValueError naming the option unless ``ok``."""
    if not ok:
        raise ValueError(f"{option} must be {rule}, got {value!r}")


def depth_weight_values(spec: str | None, num_depths: int) -> tuple[float, ...] | None:
    """The per-depth loss weights λ_0..λ_{K-1} of ``--depth-weights``.

    Args:
        spec: None (every depth 1: returns None); ``K`` comma-separated numbers (``1,0.8,0.6,0.4``); or
            ``exp:G``, ``λ_d = G**d`` (``speculators``' ``fixed-exp-decay`` rule, ``gamma ** pos_idx``).
        num_depths: K.

    Returns:
        ``K`` floats, each finite and >= 0, at least one > 0; or None.

    Raises:
        ValueError: naming ``--depth-weights``: not numbers, not K of them, a negative or non-finite one,
            all zero, or ``G`` outside (0, inf).
    """
    if spec is None:
        return None
    text = str(spec).strip()
    try:
        if text.startswith("exp:"):
            gamma = float(text[4:])
            _need(math.isfinite(gamma) and gamma > 0, "--depth-weights exp:G", "a rule with G > 0", spec)
            values = tuple(gamma ** d for d in range(num_depths))
        else:
            values = tuple(float(v) for v in text.split(","))
    except ValueError as err:
        if "--depth-weights" in str(err):
            raise
        raise ValueError(f"--depth-weights must be {num_depths} comma-separated numbers (one per depth, "
                         f"--num-depths) or exp:G, got {spec!r}") from None
    _need(len(values) == num_depths, "--depth-weights", f"{num_depths} numbers, one per depth (--num-depths)", spec)
    _need(all(math.isfinite(v) and v >= 0 for v in values), "--depth-weights", "finite numbers >= 0", spec)
    _need(any(v > 0 for v in values), "--depth-weights", "not all zero", spec)
    return values


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What the run trains on: the store(s), COD sampling of each block, the held-out split."""

    store: str | list[str]
    """Feature store written by ``peagle-data extract`` (``--store``); repeat it (``--store A --store B``)
    or give a file listing one store per line to train on several stores of one verifier and layer
    set as one (one draft vocab from their summed counts, each store holding out its own validation blocks)."""
    down_sample_ratio: float = 0.5
    """Keep ratio r of COD sampling (conditional drop-token, from PARD: which drafter positions a training step
    trains; every one at depth 0 and, at each depth d >= 1, about a share max(r^d, r_min) of the block's seeds,
    the positions with a supervised token at depth 1, drawn among those trained at depth d-1), in (0, 1]
    (``--down-sample-ratio``). The default 0.5 is measured:
    the same held-out acceptance as 0.7 in 18% less time, as the P-EAGLE ablations found for a
    1-layer drafter."""
    down_sample_ratio_min: float = 0.2
    """Floor r_min of the COD keep ratio (see --down-sample-ratio), in (0, 1] (``--down-sample-ratio-min``)."""
    max_anchors: int | None = None
    """Cap on COD seeds per block (see --down-sample-ratio): a block with more keeps a random subset of this
    many (``--max-anchors``); None: no cap. With ``--method dflash``: the cap on DFlash blocks (anchors) per
    packed row, None: 512 (speculators' default)."""
    val_fraction: float = 0.05
    """Fraction of blocks held out for validation, in [0, 1) (``--val-fraction``)."""
    val_max_blocks: int = 16
    """Validation reads at most this many held-out blocks (``--val-max-blocks``)."""
    allow_incomplete: bool = False
    """Train on the done blocks of an unfinished store (``--allow-incomplete``)."""
    epoch_order: str | None = None
    """Each epoch's order (``--epoch-order``): ``blocks``, a seeded shuffle of the training blocks;
    ``conversations``, a seeded shuffle of the groups of blocks that share a conversation, each group's blocks one
    after another (a long conversation's windows trained together). With ``--context full`` streaming,
    ``conversations`` extracts each conversation once per epoch at any budget, where ``blocks`` extracts a
    long conversation again for windows that the shuffle puts far apart (the run's summary gives the planned
    extraction tokens). Unset: a resumed run's own (``blocks`` for a run saved before this default), else
    ``conversations`` on full-context stores that record their segment keys (``peagle-data extract``'s default
    store, and a streaming run's: both commands' defaults so train the same order), else ``blocks``."""

    def __post_init__(self) -> None:
        _need(0.0 < self.down_sample_ratio <= 1.0, "--down-sample-ratio", "in (0, 1]", self.down_sample_ratio)
        _need(0.0 < self.down_sample_ratio_min <= 1.0, "--down-sample-ratio-min", "in (0, 1]",
              self.down_sample_ratio_min)
        _need(self.max_anchors is None or self.max_anchors >= 1, "--max-anchors", ">= 1 when set", self.max_anchors)
        _need(0.0 <= self.val_fraction < 1.0, "--val-fraction", "in [0, 1)", self.val_fraction)
        _need(self.val_max_blocks >= 0, "--val-max-blocks", ">= 0", self.val_max_blocks)
        _need(self.epoch_order is None or self.epoch_order in EPOCH_ORDERS, "--epoch-order", f"one of {', '.join(EPOCH_ORDERS)}",
              self.epoch_order)


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The drafter: its verifier, depths, layers, draft vocab, mask token and attention backend."""

    method: str = "peagle"
    """The drafter kind (``--method``): ``peagle`` (P-EAGLE: K parallel depths from one feature) or ``dflash``
    (DFlash: a block of the newest token and ``--block-size`` - 1 mask tokens attending to the context's
    features, arXiv:2602.06036); recorded in the checkpoint's ``speculators_model_type``."""
    verifier: str | None = None
    """Verifier MODEL for embeddings and lm_head (``--verifier``); default: the store's verifier."""
    num_depths: int | None = None
    """K, parallel draft depths (``--num-depths``); None: 4 for P-EAGLE, ``--block-size`` - 1 for DFlash (which
    must be that when given). The default 4 is measured on SmolLM2-135M: K = 8 trained no better depth-for-depth
    in the same steps and took 31% longer, and the P-EAGLE ablations find depths past ~5 add < 2% of accepted
    tokens."""
    block_size: int | None = None
    """B, tokens in a DFlash block, the newest token and B-1 mask tokens (``--block-size``, ``--method dflash``
    only); None: 8 with DFlash (speculators' default), or with ``--init-from`` the source drafter's (the run
    records it; a given one must be the source's)."""
    draft_vocab_size: int | None = None
    """D, the most frequent loss-masked tokens (``--draft-vocab-size``); None: the verifier's vocab."""
    num_layers: int = 1
    """Drafter decoder layers (``--num-layers``)."""
    mask_token_id: int | None = None
    """Token fed at depth > 0; must never occur as a supervised token in the store (``--mask-token-id``);
    None: the first of these that is unused: the tokenizer's mask token, an embedding row beyond the
    tokenizer, the unk token, a reserved special token, the pad token, another special token."""
    init_from: str | None = None
    """Start from this drafter instead of a fresh one (``--init-from``): a peagle checkpoint (or training
    output: its ``final/``, else its newest ``checkpoint-N/``), a speculators P-EAGLE or EAGLE-3 checkpoint, or
    a native vLLM-layout one (as the public gpt-oss P-EAGLE drafters). Checked against the store and the
    verifier before any weights load; its draft vocab and mask token are the run's. With ``--method dflash``: a
    DFlash checkpoint in speculators' ``dflash`` format (peagle's or speculators' own), whose block size the run
    takes. Not a resume: a new optimizer and schedule from step 0. A run records the checkpoint directory here."""
    init_from_sha256: str | None = None
    """sha256 of the ``--init-from`` drafter's ``model.safetensors`` (``--init-from-sha256``): recorded by
    the run; when given, a drafter with other weights is refused."""
    drafter_layer: str | None = None
    """The drafter's decoder layer (``--drafter-layer``): ``llama``, or ``qwen3`` (llama plus a per-head RMSNorm
    of q and k before RoPE), the two layers vLLM serves a P-EAGLE drafter with. None: the ``--init-from``
    drafter's, else the verifier's own family when it is Qwen3 (``model_type`` qwen3 or qwen3_moe), else
    llama; the run records the layer it chose."""
    init_layers: str = "random"
    """How a fresh drafter's decoder layers start (``--init-layers``):
    ``random`` (normal, std 0.02) or ``verifier``, copies of the verifier's last ``--num-layers`` decoder
    layers and their norms (the embedding and
    lm_head come from the verifier either way). Not with ``--init-from``, whose drafter's layers are the start.
    The default is measured on SmolLM2-135M: ``verifier`` reached no higher held-out acceptance in 100-400 steps."""
    attention_backend: str = "auto"
    """Drafter attention backend (``--attention-backend``): ``sdpa`` (a dense element×element mask), ``flex``
    (flex_attention block masks, CUDA only), ``split`` (depth 0 and the chain keys attended apart and merged: no
    element×element tensor) or ``auto`` (flex on CUDA, split otherwise); all give the same loss and gradients
    up to rounding."""

    def __post_init__(self) -> None:
        _need(self.method in DRAFTER_METHODS, "--method", f"one of {', '.join(DRAFTER_METHODS)}", self.method)
        if self.method == "dflash":
            self._resolve_dflash()
        else:
            _need(self.block_size is None, "--block-size", "left out with --method peagle (a DFlash setting)",
                  self.block_size)
            object.__setattr__(self, "num_depths", 4 if self.num_depths is None else self.num_depths)
        _need(self.num_depths is None or self.num_depths >= 1, "--num-depths", ">= 1", self.num_depths)
        _need(self.draft_vocab_size is None or self.draft_vocab_size >= 2, "--draft-vocab-size", ">= 2 when set (one "
              "draft token makes the loss over the draft vocab 0 and every draft the same token)", self.draft_vocab_size)
        _need(self.num_layers >= 1, "--num-layers", ">= 1", self.num_layers)
        _need(self.mask_token_id is None or self.mask_token_id >= 0, "--mask-token-id", ">= 0 when set",
              self.mask_token_id)
        _need(self.init_from_sha256 is None or self.init_from is not None, "--init-from-sha256",
              "given with --init-from", self.init_from_sha256)
        _need(self.drafter_layer is None or self.drafter_layer in LAYER_TYPES, "--drafter-layer",
              f"one of {', '.join(LAYER_TYPES)} when set", self.drafter_layer)
        _need(self.init_layers in INIT_LAYERS, "--init-layers", f"one of {', '.join(INIT_LAYERS)}", self.init_layers)
        _need(self.init_layers == "random" or self.init_from is None, "--init-layers verifier",
              "left out with --init-from (that drafter's layers are the start)", self.init_from)
        _need(self.attention_backend in ATTENTION_CHOICES, "--attention-backend",
              f"one of {', '.join(ATTENTION_CHOICES)}", self.attention_backend)

    def _resolve_dflash(self) -> None:
        """``--method dflash``: the block size (default 8; with ``--init-from`` and neither ``--block-size`` nor
        ``--num-depths``, left unset until the run reads the source's), K = B - 1, the qwen3 layer (vLLM's only
        DFlash layer)."""
        B = self.block_size
        if B is None and self.init_from is None:
            B = DFLASH_BLOCK_SIZE
        elif B is None and self.num_depths is not None:  # a warm start's K given: its block size
            B = self.num_depths + 1
        _need(B is None or B >= 2, "--block-size", ">= 2 (the newest token and at least one mask token)", B)
        _need(self.num_depths in (None, (B or 0) - 1), "--num-depths", f"left out or --block-size - 1 = "
              f"{(B or 0) - 1} with --method dflash (a block drafts B - 1 tokens)", self.num_depths)
        _need(self.drafter_layer in (None, "qwen3"), "--drafter-layer", "qwen3 or left out with --method dflash "
              "(vLLM serves DFlash with Qwen3 layers only)", self.drafter_layer)
        _need(self.init_layers == "random", "--init-layers", "random with --method dflash", self.init_layers)
        for name, value in (("block_size", B), ("num_depths", None if B is None else B - 1),
                            ("drafter_layer", "qwen3")):
            object.__setattr__(self, name, value)


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """The optimisation: steps, AdamW and its schedule, gradient accumulation and clipping, the loss chunks,
    gradient checkpointing, the embedding's updates."""

    max_steps: int | None = None
    """Optimizer steps (``--max-steps``); None: one pass over the training blocks (those extracted when
    the run starts; a resume keeps the saved run's count)."""
    lr: float = 1e-3
    """Peak AdamW learning rate (``--lr``). The default 1e-3 is measured: held-out acceptance above
    3e-4's in the same steps on SmolLM2-135M."""
    warmup_steps: int | None = None
    """Linear warm-up steps (``--warmup-steps``); None: 5% of max_steps."""
    weight_decay: float = 0.0
    """AdamW weight decay (``--weight-decay``)."""
    grad_clip: float = 1.0
    """Max gradient norm (``--grad-clip``); must be > 0."""
    grad_accum: int = 1
    """Blocks per optimizer step and rank (``--grad-accum``); the step's loss pools their elements. A
    ``--resume`` on another number of processes keeps ``grad_accum`` × processes, the blocks of one step."""
    loss: str = "kl_div"
    """The per-element loss (``--loss``), by speculators' own loss names:
    ``kl_div`` forward KL to the verifier (EAGLE-3, P-EAGLE);
    ``tv`` total variation, 1 minus the acceptance probability of a sampled draft; ``nla`` its negative log
    (LK^α, arXiv:2602.23881); ``lk_hybrid`` the same paper's KL/TV blend; ``ce`` cross-entropy to the
    verifier's argmax, the T = 0 surrogate. The default stays forward KL: on SmolLM2-135M no other loss
    beat it beyond two standard errors (the benchmarks' "Acceptance-targeted losses")."""
    depth_weights: str | None = None
    """Per-depth loss weights λ_d (``--depth-weights``): K comma-separated numbers (``1,1,1.5,2``) or
    ``exp:G`` for ``G**d``; the loss is ``Σ λ_d m ℓ / Σ λ_d m``. None: every depth 1 for P-EAGLE; for DFlash
    the DFlash paper's ``exp(-d / 4)`` (speculators' ``fixed-exp-decay`` with its ``dflash_decay_gamma`` 4)."""
    loss_chunk_size: int = 2048
    """Elements per logits chunk in the loss (``--loss-chunk-size``)."""
    gradient_checkpointing: bool = False
    """Recompute each drafter decoder layer's activations in the backward instead of keeping them
    (``--gradient-checkpointing``): less memory for long rows, one more forward of the layers per step
    (4 layers at SmolLM2 sizes: 0.70x the peak memory for 1.29x the step time at 8K tokens); the same loss and gradients up to float rounding."""
    lazy_embedding: bool = True
    """Update only the embedding rows a step touched (``--lazy-embedding/--dense-embedding``)."""
    train_embedding: bool = True
    """Train the drafter's token embedding (initialised from the verifier's), or keep it frozen as
    EAGLE-3 does (``--train-embedding/--freeze-embedding``); recorded as ``embed_requires_grad``."""

    def __post_init__(self) -> None:
        _need(self.max_steps is None or self.max_steps >= 1, "--max-steps", ">= 1 when set", self.max_steps)
        _need(self.lr > 0, "--lr", "> 0", self.lr)
        _need(self.warmup_steps is None or self.warmup_steps >= 0, "--warmup-steps", ">= 0", self.warmup_steps)
        _need(self.weight_decay >= 0, "--weight-decay", ">= 0", self.weight_decay)
        _need(self.grad_clip > 0, "--grad-clip", "> 0", self.grad_clip)
        _need(self.grad_accum >= 1, "--grad-accum", ">= 1", self.grad_accum)
        _need(self.loss_chunk_size >= 1, "--loss-chunk-size", ">= 1", self.loss_chunk_size)
        _need(self.loss in LOSSES, "--loss", f"one of {', '.join(LOSSES)}", self.loss)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """The run itself: its output directory, seed, checkpoints, logging, trackers and the actions on an
    existing output."""

    output: str
    """Output directory: checkpoints, metrics.jsonl, the plot (``--output``)."""
    seed: int = 0
    """Seed of the split, the shuffles, COD sampling and the drafter init (``--seed``)."""
    save_every: int | None = None
    """Steps between checkpoints (``--save-every``); None: only at the end."""
    save_total_limit: int | None = None
    """Keep only the newest N ``checkpoint-N/`` directories (``--save-total-limit``), each a full copy
    of the drafter weights plus the optimizer state; ``final/`` is never removed. None: keep all."""
    log_every: int = 1
    """Steps between metrics.jsonl lines (``--log-every``)."""
    val_every: int | None = None
    """Steps between validations on the held-out blocks (``--val-every``), each written as a row with
    ``"split": "val"`` in metrics.jsonl and a point of training.png, besides the one at the end; None: every
    ``--save-every`` steps when set, else every max(50, max_steps // 10) steps. May change on ``--resume``."""
    report_to: str | None = None
    """Accelerate trackers fed the metrics.jsonl rows, comma-separated: tensorboard, wandb, all installed
    (``--report-to``); files under OUTPUT/trackers; wandb runs offline with WANDB_MODE=offline. None:
    none (no tracker package imported)."""
    resume: bool = dataclasses.field(default=False, metadata={"action": True})
    """Continue from the latest ``checkpoint-N`` in output (``--resume``)."""
    force: bool = dataclasses.field(default=False, metadata={"action": True})
    """Delete an existing output directory first (``--force``)."""

    def val_interval(self, max_steps: int) -> int:
        """The steps between validations (``--val-every``, resolved): ``val_every``, else ``save_every``, else
        max(50, ``max_steps`` // 10)."""
        return self.val_every or self.save_every or max(50, max_steps // 10)

    def __post_init__(self) -> None:
        _need(self.save_every is None or self.save_every >= 1, "--save-every", ">= 1 when set", self.save_every)
        _need(self.save_total_limit is None or self.save_total_limit >= 1, "--save-total-limit", ">= 1 when set",
              self.save_total_limit)
        _need(self.log_every >= 1, "--log-every", ">= 1", self.log_every)
        _need(self.val_every is None or self.val_every >= 1, "--val-every", ">= 1 when set", self.val_every)
        _need(not (self.resume and self.force), "--resume/--force", "used one at a time", "both")
        parse_report_to(self.report_to)  # InputError (a ValueError) naming --report-to


STREAM_POLICIES = ("reextract", "keep")
"""``--epoch-policy`` choices (:data:`stores.stream.plan.POLICIES`)."""
STREAM_CONTEXTS = ("window", "full")
"""``--context`` values of a streaming run (docs/design.md §7 "Streaming")."""


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """Training while the store is extracted, within a byte budget (docs/design.md §7 "Streaming"). Unset
    ``max_store_bytes``: the store is complete before training (the offline run)."""

    max_store_bytes: str | None = None
    """Train while the store is extracted and keep it within this size (``--max-store-bytes``): ``20GB``,
    ``512MiB`` or bytes. With ``--extract-from`` this command starts the extraction; without it, extraction
    runs elsewhere (``peagle-data extract`` in its streaming mode) on the same store. None: train on a finished store."""
    epoch_policy: str = "reextract"
    """With --max-store-bytes: ``reextract`` (stay within the budget: each block's features are deleted once a
    saved checkpoint is past it, and extracted again for a later epoch) or ``keep`` (every block stays once
    extracted; the budget must hold them all)."""
    extract_from: str | None = None
    """Packed table to extract from while training (``--extract-from``; needs --max-store-bytes and
    --verifier); the extraction runs as a subprocess, its log beside the store (``STORE.extract.log``)."""
    layers: list[int] | None = None
    """--extract-from: the aux layers to extract (``peagle-data extract --layers``); default EAGLE-3's."""
    engine: str = "hf"
    """--extract-from: the extraction engine (``peagle-data extract --engine``): ``hf`` or ``vllm``."""
    context: str | None = None
    """--extract-from: ``full`` (each conversation run whole, as the verifier serves it, as ``peagle-data extract``
    does by default; the packed table must keep its conversations, as ``peagle-data pack`` does; the extraction
    writes and deletes the conversations' blocks) or ``window`` (each packed block as it is: a later window of a
    long conversation is seen without the tokens before it). Unset: ``full``, or with ``--resume`` the store's own
    (a run started when ``window`` was this command's default continues as it started)."""
    device: str | None = None
    """--extract-from: the device extraction runs on (``peagle-data extract --device``)."""
    storage_dtype: str = "bf16"
    """--extract-from: ``bf16`` or ``fp8`` (``peagle-data extract --storage-dtype``)."""
    stream_timeout_s: float = 600.0
    """With --max-store-bytes: seconds a read waits, with neither a block extracted nor the extraction's heartbeat
    meanwhile (a dead extraction; a slow one is waited for), before the run stops naming the extraction's log
    (``--stream-timeout-s``); with --extract-from, also the extraction's own time-out."""

    def __post_init__(self) -> None:
        self.budget_bytes  # noqa: B018  parsed once, here: InputError (a ValueError) naming --max-store-bytes
        _need(self.epoch_policy in STREAM_POLICIES, "--epoch-policy", f"one of {', '.join(STREAM_POLICIES)}",
              self.epoch_policy)
        _need(self.context is None or self.context in STREAM_CONTEXTS, "--context",
              f"one of {', '.join(STREAM_CONTEXTS)}", self.context)
        _need(self.stream_timeout_s > 0, "--stream-timeout-s", "> 0", self.stream_timeout_s)
        _need(self.extract_from is None or self.streaming, "--extract-from",
              "given with --max-store-bytes (the budget of the store it fills)", self.extract_from)
        extract_only = {"--layers": self.layers is not None, "--engine": self.engine != "hf",
                        "--context": self.context is not None, "--device": self.device is not None,
                        "--storage-dtype": self.storage_dtype != "bf16"}
        given = [k for k, v in extract_only.items() if v]
        _need(not given or self.extract_from is not None, given[0] if given else "--layers",
              "given only with --extract-from (an option of the extraction this command starts)", "set")
        _need(self.engine != "vllm" or self.device is None, "--device", "left out with --engine vllm (vLLM runs on its "
              "platform's devices; CUDA_VISIBLE_DEVICES chooses GPUs)", self.device)

    @cached_property
    def budget_bytes(self) -> int | None:
        """``--max-store-bytes`` in bytes, parsed once when the config is made
        (:func:`stores.stream.plan.parse_size`); None: no streaming."""
        return None if self.max_store_bytes is None else parse_size(self.max_store_bytes)

    @property
    def streaming(self) -> bool:
        """Whether the run trains while the store is extracted, within :attr:`budget_bytes`."""
        return self.budget_bytes is not None


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything ``peagle-train`` needs, by group; runtime handles (store, model) are built by
    :func:`peagle_train.train.run.run_train`."""

    data: DataConfig
    """What the run trains on."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The drafter."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """The optimisation."""
    run: RunConfig
    """The output and the run's bookkeeping."""
    stream: StreamConfig = dataclasses.field(default_factory=StreamConfig)
    """Training while the store is extracted."""

    def __post_init__(self) -> None:
        _need(not self.stream.streaming or not self.data.allow_incomplete, "--allow-incomplete",
              "left out with --max-store-bytes (a streaming run waits for every block it reads; it never trains "
              "on part of the store)", True)
        _need(not self.stream.streaming or isinstance(self.data.store, str), "--store",
              "one store with --max-store-bytes", self.data.store)
        _need(self.stream.extract_from is None or self.model.verifier is not None, "--verifier",
              "given with --extract-from (the verifier the extraction runs)", None)
        if self.model.method == "dflash":  # COD sampling is P-EAGLE's: DFlash trains blocks at anchors
            defaults = {f.name: f.default for f in dataclasses.fields(DataConfig)}
            for name in ("down_sample_ratio", "down_sample_ratio_min"):
                _need(getattr(self.data, name) == defaults[name], "--" + name.replace("_", "-"),
                      f"left out with --method dflash (COD sampling is P-EAGLE's; DFlash trains a block at each "
                      f"anchor: --max-anchors caps them)", getattr(self.data, name))
        if self.model.num_depths is not None:  # None: a DFlash warm start's, until the source's block size is read
            depth_weight_values(self.optim.depth_weights, self.model.num_depths)  # ValueError naming --depth-weights

    @classmethod
    def from_flat(cls, **settings: Any) -> TrainConfig:
        """A config from the flat settings (``lr=...``, ``store=...``: the options' names), each given to
        its group; a field left out takes its default.

        Raises:
            TypeError: a name that is no field of any group.
        """
        unknown = set(settings) - set(_GROUP_OF)
        if unknown:
            raise TypeError(f"TrainConfig has no field {', '.join(sorted(unknown))}")
        parts: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
        for name, value in settings.items():
            parts[_GROUP_OF[name]][name] = value
        return cls(**{g: GROUPS[g](**kw) for g, kw in parts.items()})

    @property
    def depth_weights(self) -> tuple[float, ...] | None:
        """The per-depth loss weights of ``--depth-weights`` (:func:`depth_weight_values`), None: all 1; DFlash
        unset: :data:`DFLASH_DECAY_GAMMA`'s ``exp(-d / γ)``."""
        if self.optim.depth_weights is None and self.model.method == "dflash":
            return tuple(math.exp(-d / DFLASH_DECAY_GAMMA) for d in range(self.model.num_depths))
        return depth_weight_values(self.optim.depth_weights, self.model.num_depths)

    def to_dict(self) -> dict[str, Any]:
        """The run's settings as written to ``train_config.json`` (and ``training_state.pt``), by group:
        every field but the actions ``resume`` and ``force`` (``metadata={"action": True}``), which belong
        to one invocation, so that ``peagle-train --config OUTPUT/train_config.json --resume`` continues a
        run started with ``--force``."""
        return {g: {f.name: getattr(getattr(self, g), f.name) for f in dataclasses.fields(GROUPS[g])
                     if not f.metadata.get("action")} for g in GROUPS}

    def flat(self) -> dict[str, Any]:
        """Every setting by its field name, actions included (``{"lr": ..., "resume": ...}``)."""
        return {f.name: getattr(getattr(self, g), f.name) for g in GROUPS for f in dataclasses.fields(GROUPS[g])}


GROUPS: dict[str, type] = {"data": DataConfig, "model": ModelConfig, "optim": OptimConfig, "run": RunConfig,
                           "stream": StreamConfig}
"""The groups of :class:`TrainConfig`, by field name, in order."""

_GROUP_OF = {f.name: g for g, klass in GROUPS.items() for f in dataclasses.fields(klass)}
"""Field name -> its group."""

FIELD_DEFAULTS: dict[str, Any] = {f.name: f.default for klass in GROUPS.values() for f in dataclasses.fields(klass)}
"""Every field's default by name (``dataclasses.MISSING`` for ``store`` and ``output``)."""


def flat_settings(saved: dict[str, Any]) -> dict[str, Any]:
    """Settings saved by a run, by field name: the grouped form of :meth:`TrainConfig.to_dict` (a
    ``{"data": {...}, ...}`` mapping) or the flat form ``train_config.json`` held before the grouping."""
    flat = {k: v for k, v in saved.items() if not (k in GROUPS and isinstance(v, dict))}
    for group in GROUPS:
        if isinstance(saved.get(group), dict):
            flat.update(saved[group])
    return flat
