"""The P-EAGLE training loop (DESIGN.md §8): store in, drafter checkpoint out.

Legend: T tokens in a block, E drafter elements, L aux layers, H hidden size, V verifier vocab,
D draft vocab, K ``num_depths``.

One optimizer step reads ``grad_accum`` packed blocks (one per micro-step). For each block: COD
sampling (:mod:`peagle_train.cod`) with a generator seeded from ``(seed, block position)``, the §8
attention mask (:mod:`peagle_train.attention`; a dense mask for SDPA or flex_attention BlockMasks, see
``attention_backend``), one drafter forward, and the chunked weighted KL to
the verifier's stored final hidden states (:mod:`peagle_train.loss`). The step optimises the pooled
objective ``Σ w·KL / Σ w`` over all its blocks and data-parallel ranks (:func:`accumulate_step`),
the loss ``metrics.jsonl`` records. The verifier is loaded only for its ``embed_tokens`` and
``lm_head`` weights; it is never run.

Output directory layout:
- ``train_config.json``: the :class:`TrainConfig` (checked again on ``--resume``);
- ``metrics.jsonl``: one line per step (step, loss (the pooled objective), acc per depth, tokens/s, lr, the block ids read,
  grad norm, ...) and one per validation (``"split": "val"``);
- ``checkpoint-N/``: drafter (``config.json``, ``model.safetensors``) plus ``training_state.pt``
  (the AdamW moments of the trainable weights): a full copy per checkpoint, all kept unless
  ``save_total_limit`` (``--save-total-limit``) keeps only the newest N;
- ``final/``: the drafter at the last step, the directory to serve or evaluate;
- ``training.png``: loss and per-depth accuracy against steps;
- ``trackers/``: only with ``report_to`` (``--report-to``): the accelerate trackers' files (TensorBoard
  event files under ``trackers/peagle/``, wandb runs under ``trackers/wandb/``), fed the same rows as
  ``metrics.jsonl`` (see :func:`tracker_values`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peagle_train.attention import FlexElementMask, build_attention_mask
from peagle_train.checkpoint import (
    latest_checkpoint, load_training_state, prune_checkpoints, rope_from_layer_config, save_checkpoint,
    save_drafter,
)
from peagle_train.cod import CodElements, element_inputs, sample_cod_elements
from peagle_train.data import Block, BlockLoader, _seed_of, to_block
from peagle_train.loss import LossOutput, kl_loss_and_accuracy
from peagle_train.mask_token import resolve_mask_token
from peagle_train.model import ROPE_TYPES, DrafterConfig, PEagleDrafter
from peagle_train.optim import LazyRowAdamW, clip_grad_norm
from stores.errors import InputError, MissingDependencyError, OutputExistsError, StoreMismatchError

__all__ = [
    "TrainConfig",
    "VerifierHeads",
    "run_train",
    "load_verifier_heads",
    "build_draft_vocab",
    "build_drafter_config",
    "block_loss",
    "val_split_warning",
    "block_hidden",
    "accumulate_step",
    "cod_generator",
    "CosineWithWarmup",
    "build_optimizer",
    "ATTENTION_BACKENDS",
    "resolve_attention_backend",
    "TRACKERS",
    "parse_report_to",
    "resolve_trackers",
    "tracker_values",
]

#: accelerate trackers ``--report-to`` accepts: name -> (module that must import, pip requirement)
TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard>=2.14"),
    "wandb": ("wandb", "wandb"),
}
#: project name given to ``Accelerator.init_trackers`` (TensorBoard subdirectory, wandb project)
TRACKER_PROJECT = "peagle"


def parse_report_to(report_to: str | None) -> list[str]:
    """The tracker names of ``--report-to`` (comma-separated, ``all`` for every installed one).

    Returns the names in the given order without duplicates (``all`` among them as given); ``[]`` for None.

    Raises:
        InputError: an empty list or a name that is neither a key of :data:`TRACKERS` nor ``all``.
    """
    if report_to is None:
        return []
    names = list(dict.fromkeys(n.strip().lower() for n in report_to.split(",")))
    choices = ", ".join([*TRACKERS, "all"])
    if not names or any(not n for n in names):
        raise InputError(f"expected comma-separated tracker names ({choices}), got {report_to!r}",
                         field="--report-to")
    unknown = [n for n in names if n not in TRACKERS and n != "all"]
    if unknown:
        raise InputError(f"unknown tracker {', '.join(map(repr, unknown))}; choose from {choices} "
                         "(comma-separated)", field="--report-to")
    return names


def resolve_trackers(report_to: str | None) -> list[str]:
    """The tracker names to pass to ``Accelerator(log_with=...)``, each checked to be installed.

    ``all`` means every tracker of :data:`TRACKERS` whose package is installed (at least one).

    Raises:
        InputError: see :func:`parse_report_to`.
        MissingDependencyError: a named tracker (or, for ``all``, every tracker) is not installed;
            the message names the pip package.
    """
    names = parse_report_to(report_to)
    if not names:
        return []
    installed = [n for n in TRACKERS if importlib.util.find_spec(TRACKERS[n][0]) is not None]
    if names == ["all"]:
        if not installed:
            raise MissingDependencyError(
                "--report-to all found no tracker installed; install one: "
                + " or ".join(f"pip install '{req}'" for _, req in TRACKERS.values()))
        return installed
    missing = [n for n in names if n != "all" and n not in installed]  # named explicitly: must be there
    if missing:
        raise MissingDependencyError(
            f"--report-to {','.join(missing)} needs "
            + ", ".join(f"the {TRACKERS[n][0]!r} package" for n in missing)
            + ": pip install " + " ".join(f"'{TRACKERS[n][1]}'" for n in missing)
            + (" (or pip install -e '.[trackers]')" if missing == ["tensorboard"] else ""))
    return installed if "all" in names else names


def tracker_values(row: dict) -> dict[str, float]:
    """A ``metrics.jsonl`` row as tracker scalars: ``"<split>/<key>"``, lists as ``<key>_d<i>``.

    A validation key loses its ``val_`` prefix (``val_loss`` -> ``val/loss``, ``val_acc`` ->
    ``val/acc_d0``...); ``split``, ``step`` and ``blocks`` (ids, not a metric) are left out, and so
    is a None (a depth without elements this step).
    """
    split = row.get("split", "train")
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in ("split", "step", "blocks"):
            continue
        name = f"{split}/{key.removeprefix(split + '_')}"
        items = [(f"_d{i}", x) for i, x in enumerate(value)] if isinstance(value, list) else [("", value)]
        for suffix, v in items:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[name + suffix] = v
    return out


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
    """Optimizer steps (``--max-steps``); None: one pass over the training blocks."""
    num_depths: int = 8
    """K, parallel draft depths (``--num-depths``)."""
    down_sample_ratio: float = 0.7
    """COD keep ratio r per depth, in (0, 1] (``--down-sample-ratio``)."""
    down_sample_ratio_min: float = 0.2
    """Floor of the COD keep ratio, in (0, 1] (``--down-sample-ratio-min``)."""
    max_anchors: int | None = None
    """Cap on COD seeds per block (``--max-anchors``); None: no cap."""
    lr: float = 3e-4
    """Peak AdamW learning rate (``--lr``)."""
    warmup_steps: int | None = None
    """Linear warm-up steps (``--warmup-steps``); None: 5% of max_steps."""
    weight_decay: float = 0.0
    """AdamW weight decay (``--weight-decay``)."""
    grad_clip: float = 1.0
    """Max gradient norm (``--grad-clip``); must be > 0."""
    grad_accum: int = 1
    """Blocks per optimizer step and rank (``--grad-accum``); the step's loss pools their elements."""
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
    resume: bool = False
    """Continue from the latest ``checkpoint-N`` in output (``--resume``)."""
    force: bool = False
    """Delete an existing output directory first (``--force``)."""
    log_every: int = 1
    """Steps between metrics.jsonl lines (``--log-every``)."""
    lazy_embedding: bool = True
    """Update only the embedding rows a step touched (``--lazy-embedding/--dense-embedding``)."""
    attention_backend: str = "auto"
    """Drafter attention (``--attention-backend``): ``sdpa`` (dense mask), ``flex`` (flex_attention
    BlockMasks, CUDA only) or ``auto`` (flex on CUDA, sdpa otherwise); see
    :func:`resolve_attention_backend`."""
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
        need(self.attention_backend in ATTENTION_BACKENDS, "--attention-backend",
             f"one of {', '.join(ATTENTION_BACKENDS)}", self.attention_backend)
        parse_report_to(self.report_to)  # InputError (a ValueError) naming --report-to

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


#: fields that must equal the saved ones for ``--resume`` to reproduce an uninterrupted run
_RESUME_FIELDS = ("store", "max_steps", "num_depths", "down_sample_ratio", "down_sample_ratio_min",
                  "max_anchors", "lr", "warmup_steps", "weight_decay", "grad_accum", "seed",
                  "draft_vocab_size", "num_layers", "val_fraction", "lazy_embedding", "grad_clip", "mask_token_id")


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
        StoreMismatchError: the verifier's content fingerprint, hidden size or vocab size differs
            from the store's.
        ModelNotFoundError / MissingDependencyError: from :func:`stores.model_cache.resolve_model`.
    """
    from stores.model_cache import load_verifier, model_fingerprint, resolve_model

    recorded = store.attrs.get("verifier", {}).get("fingerprint")
    if recorded is not None and recorded != model_fingerprint(resolve_model(name)):
        raise StoreMismatchError(
            f"verifier {name!r} is not the model the store {store.path} was extracted with (content "
            f"fingerprint {model_fingerprint(resolve_model(name))} vs the store's {recorded}, verifier "
            f"{store.attrs['verifier'].get('name_or_path')!r}): its targets would come from another model; "
            "pass --verifier with the extraction's model")
    model = load_verifier(name, dtype=torch.float32, device="cpu")
    cfg = model.config.get_text_config()  # a multimodal wrapper's language model
    H, V = int(cfg.hidden_size), int(cfg.vocab_size)
    if H != store.hidden_size or V != store.vocab_size:
        raise StoreMismatchError(
            f"verifier {name!r} has hidden_size {H} and vocab_size {V}, but the store {store.path} was "
            f"extracted with hidden_size {store.hidden_size} and vocab_size {store.vocab_size} "
            f"(verifier {store.attrs['verifier'].get('name_or_path')!r}); pass --verifier with that model")
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
        hidden_act=str(getattr(vc, "hidden_act", None) or getattr(vc, "hidden_activation", None) or "silu"),
        verifier_name_or_path=heads.name_or_path,
        verifier_architectures=list(getattr(heads.config, "architectures", None) or ["LlamaForCausalLM"]),
    )


def build_optimizer(model: PEagleDrafter, cfg: TrainConfig) -> LazyRowAdamW:
    """AdamW over the trainable parameters; ``embed_tokens`` updated lazily by rows unless
    ``cfg.lazy_embedding`` is false (see :mod:`peagle_train.optim`)."""
    embed = model.embed_tokens.weight
    rest = [p for p in model.parameters() if p.requires_grad and p is not embed]
    groups = [{"params": rest}]
    if embed.requires_grad:
        groups.append({"params": [embed], "lazy_rows": cfg.lazy_embedding})
    return LazyRowAdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)


class CosineWithWarmup:
    """LR multiplier: linear warm-up to 1 over ``warmup`` steps, then cosine to 0 at ``total``."""

    def __init__(self, warmup: int, total: int):
        self.warmup, self.total = warmup, total

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        progress = (step - self.warmup) / max(1, self.total - self.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def cod_generator(seed: int, flat_position: int) -> torch.Generator:
    """The CPU generator of COD sampling for the block at ``flat_position`` of the run's sequence."""
    return torch.Generator().manual_seed(_seed_of(seed, 1, flat_position))


#: values of ``--attention-backend``
ATTENTION_BACKENDS = ("auto", "sdpa", "flex")


def resolve_attention_backend(backend: str, cuda_available: bool | None = None) -> str:
    """The attention the drafter runs: ``"sdpa"`` or ``"flex"``.

    ``auto`` is ``flex`` where CUDA is available (the compiled flex_attention kernel skips the
    masked tiles) and ``sdpa`` otherwise; ``sdpa`` and ``flex`` are taken as given.

    Args:
        backend: one of :data:`ATTENTION_BACKENDS`.
        cuda_available: None asks ``torch.cuda.is_available()``.

    Raises:
        InputError: ``flex`` without CUDA (torch's flex_attention has no backward on CPU), or an
            unknown name; ``field`` is ``--attention-backend``.
    """
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if backend not in ATTENTION_BACKENDS:
        raise InputError(f"expected one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}",
                         field="--attention-backend")
    if backend == "auto":
        return "flex" if cuda else "sdpa"
    if backend == "flex" and not cuda:
        raise InputError("flex needs CUDA: torch's flex_attention has no backward on CPU (it runs the "
                         "forward only), so it cannot train here; use --attention-backend sdpa or auto",
                         field="--attention-backend")
    return backend


def block_loss(model, draft_head: torch.Tensor, verifier_head: torch.Tensor, block: Block,
               elements: CodElements, num_depths: int, chunk_size: int,
               attention_backend: str = "sdpa") -> LossOutput:
    """Drafter forward over ``elements`` of ``block`` and the weighted KL to the verifier.

    Args:
        model: the (possibly wrapped) :class:`PEagleDrafter`.
        draft_head: ``[D, H]`` the drafter's lm_head weight.
        verifier_head: ``[D, H]`` the verifier's lm_head rows of the draft vocab.
        block: tensors on the model's device.
        elements: from COD sampling, on the model's device.
        attention_backend: ``"sdpa"`` (dense ``[E, E]`` mask) or ``"flex"`` (a
            :class:`~peagle_train.attention.FlexElementMask`; backward on CUDA only); see
            :func:`resolve_attention_backend`.
    """
    hidden, rows, target_index = block_hidden(model, draft_head.dtype, block, elements, attention_backend)
    return kl_loss_and_accuracy(hidden, draft_head, block.final_hidden, verifier_head, elements.weight[rows],
                                elements.depth[rows], num_depths, chunk_size, target_index=target_index)


def block_hidden(model, dtype: torch.dtype, block: Block, elements: CodElements,
                 attention_backend: str = "sdpa") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafter forward of :func:`block_loss`, for the elements the loss reads.

    Returns:
        ``hidden [E', H]`` (the drafter's output at the elements of non-zero weight), ``rows [E']
        int64`` (their element indices) and ``target_index [E'] int64`` (the row of
        ``block.final_hidden`` each one is scored against, ``a + d + 1``).
    """
    inp = element_inputs(elements, block.input_ids, block.position_ids)
    aux = block.aux_hidden[inp.feature_index[~inp.is_mask]].to(dtype)  # [E0, L*H] depth-0 rows only
    if attention_backend == "flex":
        mask = FlexElementMask(elements)  # BlockMasks [E, E] and [E', E], built in the forward
    elif attention_backend == "sdpa":
        mask = build_attention_mask(elements)  # [E, E] bool
    else:
        raise ValueError(f"attention_backend must be 'sdpa' or 'flex', got {attention_backend!r}")
    rows = torch.nonzero(elements.weight != 0).squeeze(1)  # [E'] elements the loss reads
    hidden = model(inp.input_ids, aux, inp.is_mask, inp.position_ids, mask, output_rows=rows)  # [E', H]
    return hidden, rows, inp.target_index[rows]


def accumulate_step(accelerator, model, params: list[torch.nn.Parameter], micro_batches,
                    n_micro: int, loss_fn) -> dict[str, torch.Tensor]:
    """Accumulate one optimizer step's gradient: that of the pooled objective over every micro-batch
    and data-parallel rank, ``Σ w·KL / Σ w`` (sums over all the step's elements on all ranks).

    Each micro-batch backpropagates its unnormalised ``Σ w·KL`` (under ``no_sync`` but the last);
    the accumulated, all-reduced gradient is then scaled by ``world / W`` with ``W`` the step's
    global weight sum (DDP averages over the ``world`` ranks). A block with 4 weighted elements thus
    counts 4/(4+293) of a step shared with a 293-element block, not 1/2 as a mean of block means.

    Args:
        accelerator: the run's ``Accelerator``; model: the prepared (possibly DDP-wrapped) drafter;
        params: its trainable parameters (their ``.grad`` is scaled in place; sparse allowed).
        micro_batches: ``n_micro`` items, each passed to ``loss_fn``.
        loss_fn: ``item -> LossOutput`` (the forward, e.g. :func:`block_loss` under autocast).

    Returns:
        ``loss_sum [1]``, ``weight_sum [1]``, ``correct [K]``, ``counts [K]`` summed over the step's
        micro-batches and ranks (``loss_sum / weight_sum`` is the objective just optimised).
    """
    sums = None
    for i, item in enumerate(micro_batches):
        last = i == n_micro - 1
        with nullcontext() if last or accelerator.num_processes == 1 else accelerator.no_sync(model):
            res = loss_fn(item)
            accelerator.backward(res.loss_sum)
        sums = _add(sums, _reduce(accelerator, res))
    total = float(sums["weight_sum"].sum())
    scale = accelerator.num_processes / total if total > 0 else 0.0  # no weight: the gradient is 0 anyway
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
    return sums


def _block_to(block: Block, device) -> Block:
    return dataclasses.replace(block, **{f: getattr(block, f).to(device) for f in
                                         ("input_ids", "loss_mask", "position_ids", "cu_seqlens",
                                          "aux_hidden", "final_hidden")})


def _sample(block: Block, cfg: TrainConfig, gen: torch.Generator) -> CodElements:
    return sample_cod_elements(block.cu_seqlens.cpu(), block.loss_mask.cpu(), cfg.num_depths,
                               cfg.down_sample_ratio, cfg.down_sample_ratio_min, cfg.max_anchors, gen)


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


def _check_resume_settings(cfg: TrainConfig) -> Path | None:
    """``--resume``: the latest checkpoint in ``--output`` (or None); InputError when the saved
    run's settings differ from ``cfg`` in a field that must not change."""
    out = Path(cfg.output)
    ckpt = latest_checkpoint(out)
    saved = out / "train_config.json"
    if ckpt is not None and saved.is_file():
        old = json.loads(saved.read_text())
        diff = {k: (old.get(k), getattr(cfg, k)) for k in _RESUME_FIELDS if old.get(k) != getattr(cfg, k)}
        if diff:
            raise InputError(f"--resume with settings that differ from the saved run in {out} "
                             f"(saved, given): {diff}; rerun with the saved settings or a new --output")
    return ckpt


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


def _reduce(accelerator, out: LossOutput) -> dict[str, torch.Tensor]:
    vals = {"loss_sum": out.loss_sum.detach().float().reshape(1), "weight_sum": out.weight_sum.float().reshape(1),
            "correct": out.correct.detach(), "counts": out.counts.detach()}
    if accelerator.num_processes > 1:
        vals = {k: accelerator.reduce(v, reduction="sum") for k, v in vals.items()}
    return vals


def _gather_ids(accelerator, ids: list[int]) -> list[int]:
    """Block ids read this step by every rank, rank-major (``[world * grad_accum]``)."""
    t = torch.tensor(ids, dtype=torch.int64, device=accelerator.device)
    return (accelerator.gather(t) if accelerator.num_processes > 1 else t).tolist()


def _summarise(sums: dict[str, torch.Tensor]) -> tuple[float, list[float | None]]:
    w = float(sums["weight_sum"].sum())
    loss = float(sums["loss_sum"].sum()) / w if w > 0 else 0.0
    acc = [(c / n) if n > 0 else None for c, n in zip(sums["correct"].tolist(), sums["counts"].tolist())]
    return loss, acc


def _add(acc: dict | None, new: dict) -> dict:
    return new if acc is None else {k: acc[k] + new[k] for k in acc}


@torch.no_grad()
def evaluate(model, draft_head, verifier_head, store, val_ids: np.ndarray, cfg: TrainConfig, device) -> dict:
    """Loss and per-depth accuracy on held-out blocks, COD-sampled with fixed per-block seeds."""
    sums = None
    for bid in val_ids[: cfg.val_max_blocks]:
        block = _block_to(to_block(int(bid), store.read_block(int(bid))), device)
        el = _sample(block, cfg, torch.Generator().manual_seed(_seed_of(cfg.seed, 2, int(bid)))).to(device)
        out = block_loss(model, draft_head, verifier_head, block, el, cfg.num_depths, cfg.loss_chunk_size,
                         resolve_attention_backend(cfg.attention_backend))
        sums = _add(sums, {"loss_sum": out.loss_sum.float().reshape(1), "weight_sum": out.weight_sum.reshape(1),
                           "correct": out.correct, "counts": out.counts})
    if sums is None:
        return {}
    loss, acc = _summarise(sums)
    return {"val_loss": loss, "val_acc": acc}


def plot_metrics(metrics_path: Path, png_path: Path) -> Path | None:
    """Write a PNG of training loss and per-depth accuracy against steps (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _read_metrics(metrics_path)
    train = [r for r in rows if r.get("split") == "train"]
    if not train:
        return None
    steps = [r["step"] for r in train]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, [r["loss"] for r in train], label="train")
    val = [r for r in rows if r.get("split") == "val"]
    if val:
        ax1.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val")
    ax1.set(xlabel="step", ylabel="KL loss", title="loss")
    ax1.legend()
    for d in range(len(train[0]["acc"])):
        ys = [r["acc"][d] if r["acc"][d] is not None else float("nan") for r in train]
        ax2.plot(steps, ys, label=f"depth {d}")
    top = max([a for r in train for a in r["acc"] if a is not None] or [0.0])
    # the axis follows the data (small accuracies early in training stay readable), never past 1
    ax2.set(xlabel="step", ylabel="weighted argmax agreement", title="per-depth accuracy",
            ylim=(0, min(1.0, max(0.02, 1.15 * top))))
    ax2.legend(fontsize=7)
    from matplotlib.ticker import MaxNLocator

    for ax in (ax1, ax2):  # steps are integers: no 0.5 ticks on a short run
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def _write_metrics(path: Path, rows: list[dict]) -> None:
    with path.open("a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _read_metrics(path: Path) -> list[dict]:
    """The rows of ``metrics.jsonl`` (``[]`` when it does not exist)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _truncate_metrics(path: Path, last_step: int) -> None:
    if path.is_file():
        path.write_text("".join(json.dumps(r) + "\n" for r in _read_metrics(path)
                                if r.get("step", 0) <= last_step))


def check_before_weights(cfg: TrainConfig, store, verifier_name: str) -> None:
    """Every check that needs only the options, the store, the file system and the verifier's config,
    run before the verifier's weights load (docs/design.md §2).

    Raises:
        OutputExistsError: ``--output`` holds files and neither ``--resume`` nor ``--force`` is given.
        InputError: ``--draft-vocab-size`` exceeds the store's vocab; ``--resume`` with settings that
            differ from the saved run.
        StoreMismatchError: the verifier's config has another hidden or vocab size than the store.
        InputError: a verifier RoPE the drafter cannot compute (``dynamic``, ``longrope``).
    """
    from stores.model_config import load_model_config, text_config

    out = Path(cfg.output)
    if not (cfg.resume or cfg.force) and out.exists() and any(out.iterdir()):
        raise OutputExistsError(str(out), "pass --resume to continue it or --force to overwrite it")
    if cfg.resume:
        _check_resume_settings(cfg)
    if cfg.draft_vocab_size is not None and cfg.draft_vocab_size > store.vocab_size:
        raise InputError(f"--draft-vocab-size {cfg.draft_vocab_size} exceeds the verifier vocab size "
                         f"{store.vocab_size} (store {store.path})", field="--draft-vocab-size")
    vc = text_config(load_model_config(verifier_name))
    H, V = int(vc.hidden_size), int(vc.vocab_size)
    if H != store.hidden_size or V != store.vocab_size:
        raise StoreMismatchError(
            f"verifier {verifier_name!r} has hidden_size {H} and vocab_size {V}, but the store {store.path} was "
            f"extracted with hidden_size {store.hidden_size} and vocab_size {store.vocab_size} "
            f"(verifier {store.attrs['verifier'].get('name_or_path')!r}); pass --verifier with that model")
    rope = verifier_rope(vc)
    if rope["rope_type"] not in ROPE_TYPES:
        raise InputError(f"verifier {verifier_name!r} uses RoPE type {rope['rope_type']!r}, whose frequencies "
                         f"change with the sequence length; the drafter supports {', '.join(ROPE_TYPES)}",
                         field="--verifier")


def run_train(cfg: TrainConfig) -> dict[str, Any]:
    """Train a P-EAGLE drafter on a feature store and save it (DESIGN.md §8).

    Returns:
        A summary: ``steps``, ``final_loss``, ``per_depth_accuracy`` (pooled over the last 10 steps:
        Σ weighted correct / Σ weight per depth, [] when this run took no step),
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
    from accelerate import Accelerator
    from peagle_train.multistore import open_stores, split_per_store, usable_blocks
    from tqdm.auto import tqdm

    trackers = resolve_trackers(cfg.report_to)  # before anything is read or written
    attention = resolve_attention_backend(cfg.attention_backend)  # InputError before any work
    store = open_stores(cfg.store)  # several stores: one StoreSet, a validation split per store
    usable = usable_blocks(store, cfg.allow_incomplete)
    train_ids, val_ids = split_per_store(store, usable, cfg.seed, cfg.val_fraction)
    verifier_name = cfg.verifier or store.attrs["verifier"]["name_or_path"]
    check_before_weights(cfg, store, verifier_name)
    mask = resolve_mask_token(verifier_name, store, cfg.mask_token_id)  # InputError before the weights load
    heads = load_verifier_heads(verifier_name, store, mask.id)
    d2t = build_draft_vocab(store.token_freq(), cfg.draft_vocab_size)
    D = int(d2t.numel()) if d2t is not None else store.vocab_size

    # cpu=True without CUDA: a multi-process launch then runs data-parallel on gloo (MULTI_CPU)
    tracking = {"log_with": trackers, "project_dir": str(Path(cfg.output) / "trackers")} if trackers else {}
    accelerator = Accelerator(mixed_precision="bf16" if torch.cuda.is_available() else "no",
                              cpu=not torch.cuda.is_available(), **tracking)
    if trackers and sorted(map(str, accelerator.log_with)) != sorted(trackers):
        raise MissingDependencyError(f"accelerate {accelerator.log_with} could not load every tracker of "
                                     f"--report-to {','.join(trackers)}; check that their packages import")
    main = accelerator.is_main_process
    note = val_split_warning(len(usable), len(val_ids), cfg.val_fraction)
    if note and main:
        print(f"warning: {note}", file=sys.stderr)
    resume_from = _prepare_output(cfg) if main else None
    accelerator.wait_for_everyone()
    if not main and cfg.resume:
        resume_from = latest_checkpoint(cfg.output)
    out = Path(cfg.output)
    metrics_path = out / "metrics.jsonl"
    if main:
        (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2))

    torch.manual_seed(cfg.seed)  # drafter init only; every later draw uses its own generator
    model = PEagleDrafter(build_drafter_config(heads, store, cfg, D))
    model.init_from_verifier(heads.embed, heads.lm_head, d2t)
    verifier_head = heads.lm_head[model.draft_ids].to(accelerator.device)  # [D, H]
    del heads

    world = accelerator.num_processes
    per_epoch = max(1, len(train_ids) // (cfg.grad_accum * world))
    max_steps = cfg.max_steps if cfg.max_steps is not None else per_epoch
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else max_steps // 20
    params = [p for p in model.parameters() if p.requires_grad]
    # a sparse embedding gradient never exists densely; DDP all-reduce needs it dense (NCCL)
    model.embed_tokens.sparse = cfg.lazy_embedding and world == 1
    optimizer = build_optimizer(model, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, CosineWithWarmup(warmup, max_steps))

    step, position = 0, 0
    if resume_from is not None:
        state = load_training_state(resume_from)
        from peagle_train.checkpoint import load_drafter

        model.load_state_dict(load_drafter(resume_from).state_dict())
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        step, position = int(state["step"]), int(state["data"]["position"])
        if main:
            _truncate_metrics(metrics_path, step)
    elif main and metrics_path.exists():
        metrics_path.unlink()

    model, optimizer = accelerator.prepare(model, optimizer)
    unwrapped = accelerator.unwrap_model(model)
    loader = BlockLoader(store, train_ids, cfg.seed, position=position, rank=accelerator.process_index,
                         world_size=world, pin_memory=accelerator.device.type == "cuda")
    batches = iter(loader)

    def save(name: str) -> Path:
        state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "rng": {"torch": torch.get_rng_state()}, "data": loader.state_dict(), "step": step,
                 "train_config": cfg.to_dict()}
        path = save_checkpoint(unwrapped, out / name, state, training_info())
        if cfg.save_total_limit is not None:
            prune_checkpoints(out, cfg.save_total_limit)
        return path

    def training_info() -> dict[str, Any]:
        """Recorded in config.json so evaluation can find the held-out split."""
        return {"peagle_training": {"step": step, "store": cfg.store, "seed": cfg.seed,
                                    "val_fraction": cfg.val_fraction, "num_depths": cfg.num_depths,
                                    "max_anchors": cfg.max_anchors, "down_sample_ratio": cfg.down_sample_ratio,
                                    "down_sample_ratio_min": cfg.down_sample_ratio_min,
                                    "val_blocks": [int(i) for i in val_ids], "mask_token": mask.to_dict()}}

    if trackers and main:
        hparams = {k: v for k, v in cfg.to_dict().items() if isinstance(v, (bool, int, float, str))}
        hparams.update(max_steps=max_steps, warmup_steps=warmup, draft_vocab_size=D, verifier=verifier_name,
                       world_size=world, train_blocks=int(len(train_ids)), val_blocks=int(len(val_ids)))
        (out / "trackers").mkdir(exist_ok=True)  # wandb falls back to a temp dir when its dir is missing
        # purge_step: TensorBoard hides the events a killed run wrote after the checkpoint resumed from
        accelerator.init_trackers(TRACKER_PROJECT, config=hparams, init_kwargs={
            # (with --resume and no checkpoint yet, all of them: the run starts again at step 1)
            "tensorboard": {"purge_step": step + 1} if cfg.resume else {},
            "wandb": {"name": out.name, "dir": str(out / "trackers")}})

    def record(row: dict) -> None:
        """Append ``row`` to metrics.jsonl and send it to the trackers (main process only)."""
        _write_metrics(metrics_path, [row])
        values = tracker_values(row) if trackers else {}
        if values:
            accelerator.log(values, step=row["step"])

    bar = tqdm(total=max_steps, initial=step, disable=not main, desc="peagle-train", dynamic_ncols=True)
    history: list[dict] = []
    recent: list[dict[str, torch.Tensor]] = []  # the last 10 steps' sums, for the summary's pooled accuracy
    t_start, tokens_total, wait0 = time.perf_counter(), 0, loader.wait_s
    model.train()
    try:
        while step < max_steps:
            t0 = time.perf_counter()
            seen, sizes = [], []

            def micro_batches():
                for _ in range(cfg.grad_accum):
                    flat = loader.position * world + accelerator.process_index
                    block = _block_to(next(batches), accelerator.device)
                    elements = _sample(block, cfg, cod_generator(cfg.seed, flat)).to(accelerator.device)
                    seen.append(block.block_id)
                    sizes.append((block.n_tokens, len(elements)))
                    yield block, elements

            def loss_fn(item):
                with accelerator.autocast():
                    return block_loss(model, unwrapped.lm_head.weight, verifier_head, *item, cfg.num_depths,
                                      cfg.loss_chunk_size, attention)

            sums = accumulate_step(accelerator, model, params, micro_batches(), cfg.grad_accum, loss_fn)
            n_tokens = sum(t for t, _ in sizes) * world
            n_elements = sum(e for _, e in sizes)
            grad_norm = float(clip_grad_norm(params, cfg.grad_clip))
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            dt = time.perf_counter() - t0
            tokens_total += n_tokens
            loss, acc = _summarise(sums)
            row = {"split": "train", "step": step, "loss": loss, "acc": acc, "tokens_per_s": n_tokens / dt,
                   "lr": lr, "n_elements": n_elements, "blocks": _gather_ids(accelerator, seen), "weight": float(sums["weight_sum"].sum()), "step_s": dt,
                   "grad_norm": grad_norm}
            history.append(row)
            recent = [*recent[-9:], {k: sums[k].detach().cpu() for k in ("correct", "counts")}]
            if main:
                if step % cfg.log_every == 0 or step == max_steps:
                    record(row)
                shown = " ".join(f"{a:.2f}" if a is not None else "-" for a in acc[:4])
                bar.set_postfix_str(f"loss {loss:.3f} acc {shown} tok/s {n_tokens / dt:.0f} lr {lr:.2e}")
                bar.update(1)
            if cfg.save_every and step % cfg.save_every == 0 and step < max_steps:
                accelerator.wait_for_everyone()
                if main:
                    save(f"checkpoint-{step}")
                    if len(val_ids):
                        model.eval()
                        record({"split": "val", "step": step, **evaluate(
                            unwrapped, unwrapped.lm_head.weight, verifier_head, store, val_ids, cfg,
                            accelerator.device)})
                        model.train()
    except BaseException:
        _finish_trackers(accelerator, trackers)
        raise
    finally:
        bar.close()
        loader.close()

    accelerator.wait_for_everyone()
    summary: dict[str, Any] = {"steps": step, "resumed_from": str(resume_from) if resume_from else None,
                               "rank": accelerator.process_index, "world_size": world}
    if main:
        try:
            save(f"checkpoint-{step}")
            final = save_drafter(unwrapped, out / "final", training_info())
            model.eval()
            val = evaluate(unwrapped, unwrapped.lm_head.weight, verifier_head, store, val_ids, cfg,
                           accelerator.device) if len(val_ids) else {}
            if val and not (resume_from is not None and _has_row(metrics_path, "val", step)):
                record({"split": "val", "step": step, **val})  # once, also when a finished run is resumed
            plot = plot_metrics(metrics_path, out / "training.png") if metrics_path.is_file() else None
            elapsed = time.perf_counter() - t_start
            summary.update({
                "final_loss": (history[-1] if history else _last_row(metrics_path, "train") or {}).get("loss"),
                "per_depth_accuracy": _pooled_acc(recent),
                "val_loss": val.get("val_loss"),
                "val_per_depth_accuracy": val.get("val_acc"),
                "checkpoint": str(final),
                "output": str(out),
                "metrics": str(metrics_path),
                "plot": str(plot) if plot else None,
                "tokens_per_second": tokens_total / elapsed if elapsed > 0 else None,
                "data_wait_fraction": (loader.wait_s - wait0) / elapsed if elapsed > 0 else None,
                "train_blocks": int(len(train_ids)),
                "val_blocks": int(len(val_ids)),
                "draft_vocab_size": D,
                "mask_token": mask.to_dict(),
            })
        except BaseException:
            _finish_trackers(accelerator, trackers)
            raise
    # finishes the trackers and destroys the process group: a rank that exits with its gloo/NCCL group
    # alive can abort in the group's threads (SIGABRT) and fail the launch
    accelerator.wait_for_everyone()  # not before rank 0 has saved final/
    accelerator.end_training()
    return summary


def _last_row(metrics_path: Path, split: str) -> dict | None:
    """The last ``metrics.jsonl`` row of ``split`` (None when there is none)."""
    return next((r for r in reversed(_read_metrics(metrics_path)) if r.get("split") == split), None)


def _has_row(metrics_path: Path, split: str, step: int) -> bool:
    """Whether ``metrics.jsonl`` already holds a row of ``split`` at ``step``."""
    return any(r.get("split") == split and r.get("step") == step for r in _read_metrics(metrics_path))


def _finish_trackers(accelerator, trackers: list[str]) -> None:
    """Error path: flush and close the trackers (``end_training`` would also tear down the process
    group, which the other ranks of a failing run may still be blocked in)."""
    for tracker in accelerator.trackers if trackers else []:
        try:
            tracker.finish()
        except Exception:  # the original error matters more
            pass


def _pooled_acc(sums: list[dict[str, torch.Tensor]]) -> list[float | None]:
    """Per-depth accuracy pooled over steps: ``Σ correct / Σ counts`` (weighted by elements, not
    one vote per step); None for a depth without weight, ``[]`` for no step."""
    if not sums:
        return []
    correct = torch.stack([s["correct"] for s in sums]).sum(0)
    counts = torch.stack([s["counts"] for s in sums]).sum(0)
    return [(float(c) / float(n)) if n > 0 else None for c, n in zip(correct, counts)]
