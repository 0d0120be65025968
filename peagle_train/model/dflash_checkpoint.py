"""DFlash drafter checkpoints in speculators' ``dflash`` format, as vLLM 0.32 serves them (docs/design.md §8b).

A checkpoint directory holds
- ``config.json``: ``architectures ["DFlashSpeculator"]``, ``speculators_model_type "dflash"``,
  ``transformer_layer_config`` (a Qwen3 config dict, every layer ``full_attention``), ``draft_vocab_size``,
  ``block_size`` B, ``target_hidden_size``, ``aux_hidden_state_layer_ids``, ``mask_token_id``,
  ``sample_from_anchor`` false, ``sliding_window_non_causal`` true, ``speculators_config`` (greedy proposal
  with ``speculative_tokens = B - 1`` and the verifier), plus ``peagle`` (the full :class:`DFlashConfig`);
- ``model.safetensors``: :class:`~peagle_train.model.dflash.DFlashDrafter`'s state dict (its names are vLLM's
  and speculators'), the embedding and lm_head included (vLLM shares the verifier's when they are equal);
- ``training_state.pt`` (training checkpoints only, written last).

Which attention vLLM serves: ``update_dflash`` sets ``dflash_config.causal = not sliding_window_non_causal``
(absent: non-causal) and ``qwen3_dflash._dflash_layer_causal`` lets a ``transformer_layer_config.is_causal``
override it for every layer. speculators writes ``sliding_window_non_causal: false`` by default, which vLLM
serves causal inside the block although speculators trains full-attention layers non-causal; peagle trains
non-causal and writes ``true`` (and no ``is_causal``), and :func:`dflash_problems` refuses a checkpoint that
vLLM would serve causal.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peagle_train.model.checkpoint import (CONFIG_FILE, WEIGHTS_FILE, check_vocab_maps, layer_config_json,
                                           read_weights, save_with_state, served_differences, speculators_block,
                                           write_drafter_files)
from peagle_train.model.dflash import DFlashConfig, DFlashDrafter
from stores.errors import InputError, StoreFormatError
from stores.staging import replace_dir

__all__ = ["dflash_config_json", "dflash_layer_problems", "dflash_problems", "check_dflash_servable", "save_dflash",
           "save_dflash_checkpoint", "load_dflash"]


def dflash_config_json(cfg: DFlashConfig, extra_config: dict[str, Any] | None = None,
                       embed_requires_grad: bool = True) -> dict[str, Any]:
    """The ``config.json`` of a DFlash drafter with config ``cfg`` (``extra_config`` merged on top)."""
    layer = layer_config_json(cfg)
    layer.pop("num_aux_hidden_states", None)  # a P-EAGLE key; vLLM sizes DFlash's fc from the aux layer ids
    out: dict[str, Any] = {
        "architectures": ["DFlashSpeculator"],
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": cfg.hidden_size,
        "aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": False,
        "sliding_window_non_causal": True,  # vLLM: dflash_config.causal = not this -> non-causal, as trained
        "embed_requires_grad": embed_requires_grad,
        "speculators_config": speculators_block("dflash", cfg.block_size - 1, cfg),
        "peagle": {"drafter_config": cfg.to_dict()},
    }
    out.update(extra_config or {})
    return out


def dflash_layer_problems(layer: dict[str, Any]) -> list[str]:
    """What of ``transformer_layer_config`` vLLM would serve otherwise than peagle's DFlash layer computes."""
    out = []
    if layer.get("model_type", "qwen3") != "qwen3":
        out.append(f"transformer_layer_config.model_type {layer.get('model_type')!r}: the DFlash layer is qwen3")
    if layer.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act {layer.get('hidden_act')!r}: the drafter's MLP is silu")
    for key in ("attention_bias", "mlp_bias"):
        if layer.get(key):
            out.append(f"transformer_layer_config.{key} is true: the drafter is trained without biases")
    if "sliding_attention" in (layer.get("layer_types") or []) or layer.get("use_sliding_window"):
        out.append(f"transformer_layer_config has sliding-window layers ({layer.get('layer_types')}): peagle trains "
                   "full attention, and vLLM's V1 runner (the CPU build's) refuses mixed sliding/full drafters")
    if layer.get("is_causal") is not None:
        out.append(f"transformer_layer_config.is_causal is {layer['is_causal']}: vLLM would apply it to every "
                   "layer; the drafter is trained non-causal inside its block")
    if float(layer.get("logit_scale", 1.0) or 1.0) != 1.0:
        out.append(f"transformer_layer_config.logit_scale {layer['logit_scale']}: vLLM would scale the draft logits")
    return out


def dflash_problems(config: dict[str, Any], shapes: dict[str, tuple[int, ...]] | None = None) -> list[str]:
    """Why vLLM 0.32 would not serve the DFlash checkpoint of ``config`` exactly as peagle trains it; empty when
    it does. What vLLM reads: ``update_dflash`` (``aux_hidden_state_layer_ids``, ``mask_token_id``,
    ``sample_from_anchor``, ``sliding_window_non_causal``), ``qwen3_dflash.py`` (layers, causality, ``fc`` of
    ``target_hidden_size × len(aux ids)``, ``d2t``), the proposer (``speculative_tokens`` query masks after
    the newest token). Besides the layer (:func:`dflash_layer_problems`):
    - ``speculators_model_type`` dflash, ``speculative_tokens = block_size - 1`` (vLLM drafts one block of
      ``1 + speculative_tokens`` tokens: another count is another block than the trained one);
    - ``sample_from_anchor`` false; ``sliding_window_non_causal`` true (else vLLM serves causal attention);
    - ``mask_token_id`` an integer; ``aux_hidden_state_layer_ids`` strictly increasing;
    - ``target_hidden_size`` (when given) equal to ``hidden_size``;
    - with ``shapes``: ``fc.weight [H, L·H]``, no ``mask_hidden`` (vLLM asserts), ``d2t`` when D < V.
    """
    out: list[str] = []
    if config.get("speculators_model_type") != "dflash":
        out.append(f"speculators_model_type is {config.get('speculators_model_type')!r}, not 'dflash'")
    spec = config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    B = config.get("block_size")
    if not isinstance(B, int) or methods[0].get("speculative_tokens") != B - 1:
        out.append(f"speculators_config.proposal_methods[0].speculative_tokens is "
                   f"{methods[0].get('speculative_tokens')!r} but block_size is {B!r}: vLLM would draft another "
                   "block than the trained one (speculative_tokens must be block_size - 1)")
    if not (spec.get("verifier") or {}).get("name_or_path"):
        out.append("speculators_config.verifier.name_or_path is missing")
    if config.get("sample_from_anchor", False):
        out.append("sample_from_anchor is true: the drafter is trained with the anchor as the newest token")
    if not config.get("sliding_window_non_causal", True):
        out.append("sliding_window_non_causal is false: vLLM would serve causal attention inside the block; the "
                   "drafter is trained non-causal")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return out + ["transformer_layer_config (a dict) is missing"]
    out += dflash_layer_problems(layer)
    if not isinstance(config.get("mask_token_id"), int):
        out.append("mask_token_id is missing: vLLM needs it to draft")
    ids = config.get("aux_hidden_state_layer_ids") or []
    if not ids or list(ids) != sorted(set(ids)):
        out.append(f"aux_hidden_state_layer_ids {list(ids)} is not a strictly increasing list: vLLM captures "
                   "sorted(set(ids))")
    H = layer.get("hidden_size")
    if config.get("target_hidden_size") not in (None, H):
        out.append(f"target_hidden_size {config['target_hidden_size']} != hidden_size {H}")
    if shapes is not None and H is not None and ids:
        D, V = config.get("draft_vocab_size"), layer.get("vocab_size")
        if "mask_hidden" in shapes:
            out.append("mask_hidden is present: vLLM's DFlash loader refuses it")
        if D is not None and V is not None and D < V and "d2t" not in shapes:
            out.append(f"d2t is missing but the draft vocab is reduced ({D} < {V})")
        if shapes.get("fc.weight") not in (None, (H, len(ids) * H)):
            out.append(f"fc.weight {shapes['fc.weight']} is not [{H}, {len(ids) * H}]")
    return out


def check_dflash_servable(config: dict[str, Any], shapes: dict[str, tuple[int, ...]] | None, where: str) -> None:
    """Raise :class:`InputError` naming ``where`` and every :func:`dflash_problems`."""
    problems = dflash_problems(config, shapes)
    if problems:
        raise InputError(f"{where}: vLLM cannot serve this DFlash drafter as it is trained: " + "; ".join(problems))


def _write(model: DFlashDrafter, directory: Path, extra_config: dict[str, Any] | None,
           training_segments: np.ndarray | None = None) -> None:
    config = dflash_config_json(model.config, extra_config, model.embed_tokens.weight.requires_grad)
    write_drafter_files(model, directory, config, check_dflash_servable, training_segments)


def save_dflash(model: DFlashDrafter, directory: str | os.PathLike, extra_config: dict[str, Any] | None = None,
                training_segments: np.ndarray | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of ``model`` into ``directory`` (atomically), with
    ``training_segments`` as :func:`peagle_train.model.checkpoint.save_drafter` writes them."""
    directory = Path(directory)
    replace_dir(directory, lambda tmp: _write(model, tmp, extra_config, training_segments))
    return directory


def save_dflash_checkpoint(model: DFlashDrafter, directory: str | os.PathLike, state: dict[str, Any],
                           extra_config: dict[str, Any] | None = None,
                           training_segments: np.ndarray | None = None) -> Path:
    """Drafter files plus ``training_state.pt`` (written last), in one atomic directory swap."""
    return save_with_state(directory, lambda tmp: _write(model, tmp, extra_config, training_segments), state)


DFLASH_SERVED_FIELDS = ("draft_vocab_size", "block_size", "target_hidden_size", "aux_hidden_state_layer_ids",
                        "mask_token_id", "sample_from_anchor", "sliding_window_non_causal")
"""The top-level ``config.json`` fields vLLM builds a DFlash drafter from (``update_dflash``, ``qwen3_dflash.py``),
besides the layer (:data:`~peagle_train.model.checkpoint.SERVED_LAYER_FIELDS`) and ``speculative_tokens``."""


def load_dflash(directory: str | os.PathLike, device: str | torch.device = "cpu") -> DFlashDrafter:
    """Load a DFlash drafter written by :func:`save_dflash` (bit-exact round trip).

    Raises:
        StoreFormatError: files missing, not a peagle DFlash checkpoint (no ``peagle`` block: peagle reads
            back only its own), or tensors that do not match the config or whose ``d2t`` / ``t2d`` disagree.
    """
    directory = Path(directory)
    cfg_path, w_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not cfg_path.is_file() or not w_path.is_file():
        raise StoreFormatError(f"{directory} is not a drafter checkpoint: expected {CONFIG_FILE} and {WEIGHTS_FILE}")
    config = json.loads(cfg_path.read_text())
    saved = (config.get("peagle") or {}).get("drafter_config")
    if config.get("speculators_model_type") != "dflash" or saved is None:
        raise StoreFormatError(f"{cfg_path}: not a DFlash checkpoint written by peagle (speculators_model_type "
                               f"{config.get('speculators_model_type')!r}, peagle block "
                               f"{'present' if saved is not None else 'absent'})")
    model = DFlashDrafter(DFlashConfig(**saved))
    edited = served_differences(config, dflash_config_json(model.config), DFLASH_SERVED_FIELDS,
                                model.config.block_size - 1)
    if edited:
        raise StoreFormatError(f"{cfg_path}: the fields vLLM serves the drafter from differ from the drafter peagle "
                               f"trained (its peagle.drafter_config): {'; '.join(edited)}; vLLM would serve another "
                               "drafter than peagle evaluates (was the checkpoint edited by hand?)")
    tensors = read_weights(w_path)
    if "d2t" in tensors:
        check_vocab_maps(tensors["d2t"], tensors["t2d"], model.config.vocab_size, w_path)
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise StoreFormatError(f"{w_path} does not match {cfg_path}: {e}") from e
    model.lm_head.weight.requires_grad_(False)
    return model.to(device)
