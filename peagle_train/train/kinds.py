"""Drafter kinds (``--method``): what the trainer, the run and the checks ask of a drafter, by name
(docs/design.md §8, §8b).

A :class:`DrafterKind` is one idea: a model class, the training samples of a packed row and their loss, a
checkpoint format and the vLLM method that serves it. :data:`DRAFTER_KINDS` holds P-EAGLE (``peagle``: COD
elements, :class:`~peagle_train.model.drafter.PEagleDrafter`, speculators' ``peagle`` format, served by vLLM
as ``eagle3``) and DFlash (``dflash``: anchored blocks, :class:`~peagle_train.model.dflash.DFlashDrafter`,
speculators' ``dflash`` format, served as ``dflash``); :func:`drafter_kind` looks one up.

Legend: T tokens in a block (packed row), H hidden size, D draft vocab, K drafts per step.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from torch import nn

from peagle_train.data.anchors import AnchorBlocks, block_inputs, sample_anchors
from peagle_train.data.cod import CodElements
from peagle_train.data.loader import Block
from peagle_train.model.checkpoint import (CONFIG_FILE, WEIGHTS_FILE, check_servable, check_servable_checkpoint,
                                           drafter_config_json, load_drafter, save_checkpoint, save_drafter)
from peagle_train.model.config import DRAFTER_METHODS, DrafterConfig
from peagle_train.model.dflash import DFlashConfig, DFlashDrafter
from peagle_train.model.dflash_checkpoint import (check_dflash_servable, dflash_config_json, load_dflash, save_dflash,
                                                  save_dflash_checkpoint)
from peagle_train.model.drafter import PEagleDrafter
from peagle_train.model.warm_start import FORMAT_METHODS, InitSource, read_init_source
from peagle_train.train.loss import LogitTransform, LossOutput, loss_and_accuracy
from peagle_train.train.step import block_loss, sample_elements
from stores.errors import StoreFormatError
from runtime.vllm_runtime import LAST_PEAGLE_VLLM, check_vllm_serves_peagle

__all__ = ["DrafterKind", "DRAFTER_KINDS", "drafter_kind", "dflash_block_loss", "load_drafter_of_kind", "checkpoint_kind",
           "check_any_servable"]


@dataclass(frozen=True)
class DrafterKind:
    """A drafter kind: everything peagle does differently per kind, as functions of the run's ``TrainConfig``.

    Attributes:
        name: the ``--method`` value (speculators' algorithm name).
        speculators_model_type: ``config.json``'s ``speculators_model_type``.
        vllm_method: vLLM's ``speculative_config["method"]`` serving the checkpoint.
        model_class: the drafter module.
        make_config: ``(base DrafterConfig, TrainConfig) -> config`` of ``model_class``.
        sample: ``(block, TrainConfig, generator) -> samples`` (``len()``: elements or query tokens; ``.to(device)``).
        loss: ``(model, draft_head [D, H], verifier_head [D, H], block, samples, TrainConfig, attention backend,
            LogitTransform | None) -> LossOutput`` (per-draft ``correct`` / ``counts`` of length K).
        config_json: ``(config) -> dict``, the ``config.json`` a drafter of ``config`` gets.
        check_servable: ``(config.json dict, shapes | None, where)``, raising ``InputError`` when vLLM would
            not serve it as trained.
        save / save_checkpoint / load: the checkpoint format (:func:`peagle_train.model.checkpoint.save_drafter`'s
            signatures).

    Its warm-start sources (``--init-from``) are the layouts :data:`~peagle_train.model.warm_start.FORMAT_METHODS`
    maps to its name (:meth:`init_formats`, :meth:`read_init_source`).
    """

    name: str
    speculators_model_type: str
    vllm_method: str
    model_class: type
    make_config: Callable[[DrafterConfig, Any], DrafterConfig]
    sample: Callable[[Block, Any, torch.Generator], Any]
    loss: Callable[..., LossOutput]
    config_json: Callable[[DrafterConfig], dict]
    check_servable: Callable[[dict, Any, str], None]
    save: Callable
    save_checkpoint: Callable
    load: Callable
    parallel_drafting: bool = False
    """vLLM's ``speculative_config`` needs ``parallel_drafting`` (P-EAGLE served as ``eagle3``)."""
    served_until_vllm: tuple[int, int] | None = None
    """The last vLLM release (major, minor) that serves the kind; None: every vLLM from 0.32 on."""

    def check_installed_vllm(self, field: str = "--engine") -> None:
        """Refuse, before any engine starts, an installed vLLM newer than :attr:`served_until_vllm` (P-EAGLE after
        0.33: :func:`runtime.vllm_runtime.check_vllm_serves_peagle`, which reads the version without
        importing vLLM); a kind every vLLM serves passes.

        Raises:
            InputError: ``field``: the reason and the way forward (``--method dflash``).
        """
        if self.served_until_vllm is not None:
            check_vllm_serves_peagle(field)

    def speculative_config(self, model: str, num_drafts: int) -> dict[str, Any]:
        """vLLM's ``speculative_config`` serving the drafter at ``model`` with ``num_drafts`` drafts a step:
        ``model``, ``method`` (:attr:`vllm_method`), ``num_speculative_tokens`` and, for a kind that needs it,
        ``parallel_drafting``."""
        config = {"model": str(model), "method": self.vllm_method, "num_speculative_tokens": int(num_drafts)}
        return {**config, "parallel_drafting": True} if self.parallel_drafting else config

    @property
    def init_formats(self) -> tuple[str, ...]:
        """The ``--init-from`` layouts a run of this kind starts from (P-EAGLE: ``peagle``, ``eagle3``, ``vllm``;
        DFlash: ``dflash``)."""
        return tuple(f for f, m in FORMAT_METHODS.items() if m == self.name)

    def read_init_source(self, path: str | os.PathLike) -> InitSource:
        """The ``--init-from`` drafter at ``path`` read (config, tensor names and shapes, draft maps; no other
        weights) as the start of a run of this kind.

        Raises:
            InputError: a drafter of another kind, naming both kinds; one that does not compute as this kind's
                drafter. StoreFormatError: not a drafter checkpoint
                (:func:`peagle_train.model.warm_start.read_init_source`).
        """
        return read_init_source(path, self.name)

    def new_drafter(self, base: DrafterConfig, cfg) -> nn.Module:
        """A fresh drafter of this kind for the verifier shapes of ``base`` and the run's ``cfg``."""
        return self.model_class(self.make_config(base, cfg))


def _peagle_loss(model, draft_head: torch.Tensor, verifier_head: torch.Tensor, block: Block, elements: CodElements,
                 cfg, attention: str, transform: LogitTransform | None) -> LossOutput:
    return block_loss(model, draft_head, verifier_head, block, elements, cfg.model.num_depths,
                      cfg.optim.loss_chunk_size, attention, transform, cfg.optim.loss, cfg.depth_weights)


def _dflash_sample(block: Block, cfg, gen: torch.Generator) -> AnchorBlocks:
    return sample_anchors(block.cu_seqlens.cpu(), block.loss_mask.cpu(), cfg.model.block_size, cfg.data.max_anchors,
                          gen)


def dflash_block_loss(model, draft_head: torch.Tensor, verifier_head: torch.Tensor, block: Block,
                      blocks: AnchorBlocks, cfg, attention: str = "sdpa",
                      transform: LogitTransform | None = None) -> LossOutput:
    """The DFlash drafter's forward over the anchored ``blocks`` of ``block`` and its weighted loss to the verifier:
    slot j >= 1 of a block is the draft of depth ``j - 1`` (weights ``cfg.depth_weights``, the DFlash decay by
    default), scored against ``softmax(final_hidden[p + j - 1] @ verifier_head.T)`` with ``cfg.optim.loss``.
    ``attention`` is not read: the block attention runs as one dense ``[Q, T + Q]`` mask (sdpa)."""
    inner = getattr(model, "module", model)  # a DDP wrapper's drafter
    inp = block_inputs(blocks, block.input_ids, block.position_ids, block.cu_seqlens, block.loss_mask,
                       inner.config.mask_token_id)
    rows = torch.nonzero(inp.weight != 0).squeeze(1)  # [Q'] the slots the loss reads
    hidden = model(block.aux_hidden, block.position_ids, inp.input_ids, inp.position_ids, inp.mask)[rows]  # [Q', H]
    return loss_and_accuracy(hidden, draft_head, block.final_hidden, verifier_head, inp.weight[rows], inp.depth[rows],
                             cfg.model.num_depths, cfg.optim.loss_chunk_size, target_index=inp.target_index[rows],
                             logit_transform=transform, loss=cfg.optim.loss, depth_weights=cfg.depth_weights)


def _dflash_config(base: DrafterConfig, cfg) -> DFlashConfig:
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(DrafterConfig)}
    return DFlashConfig(**fields, block_size=cfg.model.block_size)


DRAFTER_KINDS: dict[str, DrafterKind] = {
    "peagle": DrafterKind(
        name="peagle", speculators_model_type="peagle", vllm_method="eagle3", model_class=PEagleDrafter,
        make_config=lambda base, cfg: base, sample=sample_elements, loss=_peagle_loss,
        config_json=drafter_config_json, check_servable=check_servable, save=save_drafter,
        save_checkpoint=save_checkpoint, load=load_drafter, parallel_drafting=True,
        served_until_vllm=LAST_PEAGLE_VLLM),
    "dflash": DrafterKind(
        name="dflash", speculators_model_type="dflash", vllm_method="dflash", model_class=DFlashDrafter,
        make_config=_dflash_config, sample=_dflash_sample, loss=dflash_block_loss,
        config_json=dflash_config_json, check_servable=check_dflash_servable, save=save_dflash,
        save_checkpoint=save_dflash_checkpoint, load=load_dflash),
}
"""Every drafter kind by ``--method`` name (the names of :data:`peagle_train.model.config.DRAFTER_METHODS`)."""

assert tuple(DRAFTER_KINDS) == DRAFTER_METHODS


def drafter_kind(name: str) -> DrafterKind:
    """The kind named ``name`` (``--method``).

    Raises:
        ValueError: no such kind, naming ``--method`` and the kinds.
    """
    if name not in DRAFTER_KINDS:
        raise ValueError(f"--method must be one of {', '.join(DRAFTER_KINDS)}, got {name!r}")
    return DRAFTER_KINDS[name]


def load_drafter_of_kind(directory: str | os.PathLike, device: str | torch.device = "cpu") -> nn.Module:
    """The drafter of checkpoint ``directory``, of whichever kind its ``config.json`` names
    (``speculators_model_type``), loaded by that kind's ``load``; anything else goes to P-EAGLE's loader, which
    names what is wrong.

    Raises:
        StoreFormatError: not a drafter checkpoint of a known kind, or its tensors do not fit its config.
    """
    return checkpoint_kind(directory).load(directory, device)


def checkpoint_kind(directory: str | os.PathLike) -> DrafterKind:
    """The kind whose ``speculators_model_type`` checkpoint ``directory``'s ``config.json`` names; P-EAGLE when
    it names none of them or cannot be read (P-EAGLE's loader and checks then name what is wrong)."""
    try:
        model_type = json.loads((Path(directory) / "config.json").read_text()).get("speculators_model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    return next((k for k in DRAFTER_KINDS.values() if k.speculators_model_type == model_type), DRAFTER_KINDS["peagle"])


def check_any_servable(directory: str | os.PathLike) -> None:
    """Its kind's ``check_servable`` on checkpoint ``directory``'s ``config.json`` and tensor shapes (read from
    the safetensors header, no weights loaded).

    Raises:
        InputError: vLLM would not serve it as trained. StoreFormatError: not a drafter checkpoint.
    """
    kind = checkpoint_kind(directory)
    if kind.name == "peagle":
        check_servable_checkpoint(directory)
        return
    cfg_path, w_path = Path(directory) / CONFIG_FILE, Path(directory) / WEIGHTS_FILE
    if not cfg_path.is_file() or not w_path.is_file():
        raise StoreFormatError(f"{directory} is not a drafter checkpoint: expected {CONFIG_FILE} and {WEIGHTS_FILE}")
    with safe_open(str(w_path), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    kind.check_servable(json.loads(cfg_path.read_text()), shapes, str(directory))
