"""Drafter checkpoints in the ``speculators`` / vLLM P-EAGLE format, and training state (docs/design.md §8).

A checkpoint directory holds
- ``config.json``: ``architectures ["PEagleSpeculator"]``, ``speculators_model_type "peagle"``,
  ``transformer_layer_config`` (a Llama config dict), ``draft_vocab_size``,
  ``eagle_aux_hidden_state_layer_ids``, ``mask_token_id``, ``speculators_config`` (greedy proposal
  with ``speculative_tokens = K`` and the verifier), plus ``peagle`` (the full
  :class:`DrafterConfig`, for an exact round trip);
- ``model.safetensors``: the drafter's state dict under the ``speculators`` 0.9 P-EAGLE names
  (``embed_tokens.weight [V, H]``, ``fc.weight [H, L*H]``, ``mask_hidden [1, 1, L*H]``,
  ``layers.N.*``, ``norm.weight [H]``, ``lm_head.weight [D, H]``; only with a reduced draft vocab
  (D < V) also ``d2t [D] int64`` and ``t2d [V] bool``, as speculators' ``PEagleDraftModel``);
  written with the umask's permissions (0644 under umask 022);
- ``training_segments.npy`` (checkpoints of ``peagle-train``): ``[M] uint64`` sorted hashes of the training
  side's segments (:mod:`peagle_train.data.segment_hashes`), against which ``peagle-eval --store`` counts the
  judged conversations the drafter was trained on;
- ``training_state.pt`` (training checkpoints only; written last, so its presence marks the
  checkpoint complete): optimizer, scheduler, RNG, data position, step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from peagle_train.model.config import LAYER_TYPES, DrafterConfig
from peagle_train.model.drafter import PEagleDrafter
from stores.errors import InputError, NonFiniteError, StoreFormatError
from stores.files import follow_umask, strict_json
from runtime.model_cache import EMBEDDED_MODELS, peagle_home
from stores.staging import atomic_file, replace_dir

__all__ = [
    "read_weights",
    "served_differences",
    "SERVED_LAYER_FIELDS",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "STATE_FILE",
    "TRAINING_SEGMENTS_FILE",
    "read_training_segments",
    "drafter_config_json",
    "speculators_block",
    "save_with_state",
    "rope_from_layer_config",
    "layer_config_json",
    "DEFAULT_ROPE_THETA",
    "layer_type_of",
    "save_drafter",
    "write_drafter_files",
    "load_drafter",
    "check_vocab_maps",
    "save_training_state",
    "load_training_state",
    "save_checkpoint",
    "latest_checkpoint",
    "prune_checkpoints",
    "find_drafter",
    "VLLM_MODEL_TYPES",
    "vllm_problems",
    "check_servable",
    "check_servable_checkpoint",
    "served_verifier_name",
]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
STATE_FILE = "training_state.pt"
TRAINING_SEGMENTS_FILE = "training_segments.npy"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def layer_config_json(cfg: DrafterConfig) -> dict[str, Any]:
    """The drafter layer as a transformers config dict of its ``layer_type`` (``LlamaConfig`` or
    ``Qwen3Config``: ``model_type`` is what vLLM maps to its P-EAGLE drafter), with the verifier's RoPE in
    both layouts.

    transformers ≥ 5 (and speculators 0.9 on it) read ``rope_parameters`` (``rope_type``,
    ``rope_theta``, scaling keys); transformers 4 and readers written for it (vLLM's config
    loading on v4) read top-level ``rope_theta`` and ``rope_scaling`` (None for default RoPE).
    ``num_aux_hidden_states`` (L aux layers) is here because vLLM's EAGLE-3 drafter sizes ``fc`` as
    ``target_hidden_size × num_aux_hidden_states`` read from this dict (else 3), never from the
    top-level ``eagle_aux_hidden_state_layer_ids``. Always without biases (``attention_bias``,
    ``mlp_bias`` false) and, for qwen3, without sliding windows (every ``layer_types`` entry
    ``full_attention``), as peagle trains the layer.
    """
    from transformers import LlamaConfig, Qwen3Config

    rope = dict(cfg.rope_parameters)
    shape = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_act=cfg.hidden_act,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=dict(rope), tie_word_embeddings=False, attention_bias=False)
    if cfg.layer_type == "qwen3":
        out = Qwen3Config(**shape, use_sliding_window=False, sliding_window=None,
                          layer_types=["full_attention"] * cfg.num_hidden_layers,
                          architectures=["Qwen3ForCausalLM"]).to_dict()
    else:
        out = LlamaConfig(**shape, mlp_bias=False, architectures=["LlamaForCausalLM"]).to_dict()
    out["rope_parameters"] = rope
    out["rope_theta"] = float(rope["rope_theta"])
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    out["rope_scaling"] = None if rope["rope_type"] == "default" else scaling
    out["num_aux_hidden_states"] = cfg.num_aux_layers
    return out


def served_verifier_name(name: str | os.PathLike) -> str:
    """What ``speculators_config.verifier.name_or_path`` holds: a name vLLM resolves without a hub.

    The embedded alias (``smollm2-135m``) becomes its converted directory
    (``$PEAGLE_HOME/models/smollm2-135m``, which vLLM loads as it is); a local directory its absolute
    path; anything else (a hub id) is kept. ``vllm serve final/`` then loads the verifier offline.
    """
    text = str(name)
    if text in EMBEDDED_MODELS:
        return str(peagle_home() / "models" / text)
    path = Path(text).expanduser()
    return str(path.resolve()) if path.is_dir() else text


DEFAULT_ROPE_THETA = {"qwen3": 1_000_000.0}
"""RoPE theta of a layer config without one, by ``model_type`` (vLLM's ``Qwen3DecoderLayer`` sets 1e6 by
``set_default_rope_theta``); others 10000."""


def rope_from_layer_config(layer: dict[str, Any]) -> dict[str, Any]:
    """The RoPE of a ``transformer_layer_config`` dict as flat ``rope_parameters``.

    Reads ``rope_parameters`` (transformers 5; a per-layer-type dict is collapsed to its
    ``sliding_attention`` entry, else ``full_attention``, as speculators 0.9 does), else the v4
    keys ``rope_scaling`` (``rope_type`` or legacy ``type``) and ``rope_theta``; no theta at all:
    :data:`DEFAULT_ROPE_THETA` of its ``model_type``.
    """
    theta = layer.get("rope_theta", DEFAULT_ROPE_THETA.get(layer.get("model_type"), 10000.0))
    rope = layer.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" not in rope and "rope_type" not in rope:
        rope = rope.get("sliding_attention") or rope.get("full_attention")
    if not isinstance(rope, dict):
        rope = dict(layer.get("rope_scaling") or {})
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope.setdefault("rope_theta", theta)
    rope = dict(rope)
    rope.pop("type", None)
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", theta)
    return rope


def layer_type_of(layer: dict[str, Any]) -> str:
    """The drafter layer type (:data:`~peagle_train.model.config.LAYER_TYPES`) of a ``transformer_layer_config``
    dict (its ``model_type``, llama when absent, as vLLM reads it), if peagle's drafter computes that layer
    exactly as vLLM does.

    Raises:
        ValueError: another ``model_type``; ``attention_bias`` or ``mlp_bias`` true (peagle's layers have no
            biases; vLLM would add q/k/v biases, transformers' Qwen3 an o_proj bias too); a qwen3 layer
            with a ``sliding_attention`` entry in ``layer_types`` (vLLM would attend within a window).
    """
    model_type = layer.get("model_type", "llama")
    if model_type not in LAYER_TYPES:
        raise ValueError(f"transformer_layer_config.model_type is {model_type!r}; peagle's drafter layer is one of "
                         f"{list(LAYER_TYPES)}")
    for key in ("attention_bias", "mlp_bias"):
        if layer.get(key):
            raise ValueError(f"transformer_layer_config.{key} is true; peagle's drafter layers have no biases")
    if model_type == "qwen3" and "sliding_attention" in (layer.get("layer_types") or []):
        raise ValueError(f"transformer_layer_config.layer_types is {layer['layer_types']}: vLLM would attend within "
                         f"a sliding window of {layer.get('sliding_window')} in those layers; peagle's drafter "
                         "attends fully")
    return model_type


def speculators_block(algorithm: str, speculative_tokens: int, cfg) -> dict[str, Any]:
    """``config.json``'s ``speculators_config`` of a drafter kind: its algorithm, one greedy proposal method of
    ``speculative_tokens`` drafts, and the verifier vLLM / speculators load (``vllm serve final/``): a local
    directory for an embedded alias (which only peagle resolves; the alias stays in
    ``peagle.drafter_config.verifier_name_or_path``)."""
    return {"algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": served_verifier_name(cfg.verifier_name_or_path),
                         "architectures": list(cfg.verifier_architectures)}}


def drafter_config_json(cfg: DrafterConfig, extra_config: dict[str, Any] | None = None,
                        embed_requires_grad: bool = True) -> dict[str, Any]:
    """The §8 ``config.json`` of a drafter with config ``cfg`` (``extra_config`` merged on top;
    ``embed_requires_grad``: whether training updated the token embedding)."""
    out: dict[str, Any] = {
        "architectures": ["PEagleSpeculator"],
        "speculators_model_type": "peagle",
        "transformer_layer_config": layer_config_json(cfg),
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "norm_before_residual": False,
        "embed_requires_grad": embed_requires_grad,
        "num_depths": cfg.num_depths,
        "speculators_config": speculators_block("peagle", cfg.num_depths, cfg),
        "peagle": {"drafter_config": cfg.to_dict()},
    }
    out.update(extra_config or {})
    return out


def _write_drafter(model: PEagleDrafter, directory: Path, extra_config: dict[str, Any] | None,
                   training_segments: np.ndarray | None = None) -> None:
    config = drafter_config_json(model.config, extra_config, model.embed_tokens.weight.requires_grad)
    write_drafter_files(model, directory, config, check_servable, training_segments)


def write_drafter_files(model, directory: Path, config: dict[str, Any], check,
                        training_segments: np.ndarray | None = None) -> None:
    """Write ``config`` as ``config.json`` and ``model``'s state dict as ``model.safetensors`` into ``directory``
    (any drafter kind: ``check(config, shapes, where)`` is its vLLM rule, raising when vLLM would not serve it),
    and ``training_segments`` (``[M] uint64`` hashes of the training segments; None: none) as
    :data:`TRAINING_SEGMENTS_FILE`.

    Raises:
        NonFiniteError: a weight holds NaN or Inf (nothing is written).
        StoreFormatError: ``d2t`` / ``t2d`` disagree (:func:`check_vocab_maps`).
        InputError: from ``check``.
    """
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:  # a drafter that would serve NaN drafts: never saved
        step = (config.get("peagle_training") or {}).get("step")
        raise NonFiniteError(f"{directory}: weights {bad} hold NaN or Inf" + (f" at step {step}" if step is not None else "")
                             + "; the drafter is not saved")
    if "d2t" in tensors:  # never write maps a reader would refuse
        check_vocab_maps(tensors["d2t"], tensors["t2d"], model.config.vocab_size, directory / WEIGHTS_FILE)
    check(config, {k: tuple(v.shape) for k, v in tensors.items()}, str(directory))
    (directory / CONFIG_FILE).write_text(strict_json(config, f"{directory / CONFIG_FILE}", indent=2))
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    follow_umask(directory / WEIGHTS_FILE)  # safetensors creates it 0600
    if training_segments is not None:
        np.save(directory / TRAINING_SEGMENTS_FILE, np.unique(np.asarray(training_segments, dtype=np.uint64)))


def read_training_segments(directory: str | os.PathLike) -> np.ndarray | None:
    """``[M] uint64`` the sorted segment hashes a checkpoint records (:data:`TRAINING_SEGMENTS_FILE`), or None
    when it records none (not written by ``peagle-train``, or by an earlier one).

    Raises:
        StoreFormatError: the file is not a 1-D uint64 array.
    """
    path = Path(directory) / TRAINING_SEGMENTS_FILE
    if not path.is_file():
        return None
    try:
        hashes = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise StoreFormatError(f"{path}: unreadable ({e})") from None
    if hashes.ndim != 1 or hashes.dtype != np.uint64:
        raise StoreFormatError(f"{path}: expected a 1-D uint64 array, found {hashes.dtype} of shape {hashes.shape}")
    return hashes


def save_drafter(model: PEagleDrafter, directory: str | os.PathLike,
                 extra_config: dict[str, Any] | None = None, training_segments: np.ndarray | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of ``model`` into ``directory`` (atomically).

    Args:
        model: the drafter (unwrapped from any DDP/accelerate wrapper).
        directory: created or replaced.
        extra_config: keys merged into ``config.json`` (e.g. training hyper-parameters).
        training_segments: ``[M] uint64`` hashes of the training segments, written to
            :data:`TRAINING_SEGMENTS_FILE` (None: none written).

    Returns:
        ``directory`` as a Path.
    """
    directory = Path(directory)
    replace_dir(directory, lambda tmp: _write_drafter(model, tmp, extra_config, training_segments))
    return directory


PEAGLE_SERVED_FIELDS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                        "mask_token_id", "norm_before_residual")
"""The top-level ``config.json`` fields vLLM builds a P-EAGLE drafter from (``transformers_utils/configs/
speculators``, ``llama_eagle3.py``), besides the layer and ``speculative_tokens``."""

SERVED_LAYER_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                       "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters")
"""The fields of ``transformer_layer_config`` that shape the layer vLLM builds (the others are transformers'
bookkeeping, written by whichever version saved the checkpoint)."""


def served_differences(config: dict[str, Any], want: dict[str, Any], fields: Sequence[str], num_drafts: int,
                       present_only: bool = False) -> list[str]:
    """Where the ``config.json`` vLLM reads (``config``) differs from the one the drafter peagle loads implies
    (``want``, written from its ``peagle`` block): each top-level field of ``fields``, each of
    :data:`SERVED_LAYER_FIELDS` and ``speculative_tokens`` (``num_drafts``), with both values; empty: vLLM serves
    the drafter peagle evaluates. ``present_only``: compare only the fields ``config`` holds (checkpoints written
    before a field was)."""
    want = json.loads(json.dumps(want))  # as written: JSON's keys and lists
    layer, trained = config.get("transformer_layer_config") or {}, want["transformer_layer_config"]
    pairs = [(k, config, want, "") for k in fields] + [(k, layer, trained, "transformer_layer_config.")
                                                      for k in SERVED_LAYER_FIELDS]
    out = [f"{where}{k} is {got.get(k)!r} where the trained drafter has {ref.get(k)!r}"
           for k, got, ref, where in pairs if got.get(k) != ref.get(k) and not (present_only and k not in got)]
    methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
    if methods[0].get("speculative_tokens") != num_drafts:
        out.append(f"speculators_config.proposal_methods[0].speculative_tokens is "
                   f"{methods[0].get('speculative_tokens')!r} where the trained drafter drafts {num_drafts}")
    return out


def _config_from_json(cfg: dict[str, Any], path: Path) -> DrafterConfig:
    """The :class:`DrafterConfig` of a ``config.json``; its RoPE is the ``transformer_layer_config``'s.

    Raises:
        StoreFormatError: a RoPE or layer the drafter cannot compute (:func:`layer_type_of`), or a ``peagle``
            block whose RoPE or layer type disagrees with the ``transformer_layer_config`` (which vLLM reads).
    """
    layer = cfg["transformer_layer_config"]
    rope = rope_from_layer_config(layer)
    saved = cfg.get("peagle", {}).get("drafter_config")
    try:
        layer_type = layer_type_of(layer)
        if saved is not None:
            out = DrafterConfig(**saved)  # written before layer_type existed: llama
            if out.layer_type != layer_type:
                raise StoreFormatError(f"{path}: transformer_layer_config.model_type is {layer_type!r} (what vLLM "
                                       f"serves) but the peagle block's layer_type is {out.layer_type!r}; the "
                                       "checkpoint was edited by hand?")
            if out.rope_parameters != DrafterConfig(**{**saved, "rope_parameters": rope}).rope_parameters:
                raise StoreFormatError(f"{path}: transformer_layer_config has RoPE {rope} but the peagle block "
                                       f"has {out.rope_parameters}; the checkpoint was edited by hand?")
            edited = served_differences(cfg, drafter_config_json(out), PEAGLE_SERVED_FIELDS, out.num_depths,
                                        present_only=True)
            if edited:
                raise StoreFormatError(f"{path}: the fields vLLM serves the drafter from differ from the drafter "
                                       f"peagle trained (its peagle.drafter_config): {'; '.join(edited)}; vLLM would "
                                       "serve another drafter than peagle evaluates (edited by hand?)")
            return out
        return _foreign_config(cfg, layer, rope, layer_type, path)
    except StoreFormatError:
        raise
    except ValueError as e:  # DrafterConfig refuses the RoPE, layer_type_of the layer
        raise StoreFormatError(f"{path}: {e}") from e


def _foreign_config(cfg: dict[str, Any], layer: dict[str, Any], rope: dict[str, Any], layer_type: str,
                    path: Path) -> DrafterConfig:
    """A config written by another tool (speculators): everything from its layer config.

    Raises:
        StoreFormatError: no ``mask_token_id`` or no ``speculative_tokens`` (vLLM requires both; a default
            would draft with another token or K than the drafter was trained for).
    """
    spec = cfg.get("speculators_config", {})
    verifier = spec.get("verifier", {})
    methods = spec.get("proposal_methods") or [{}]
    for key, value in (("mask_token_id", cfg.get("mask_token_id")),
                       ("speculators_config.proposal_methods[0].speculative_tokens", methods[0].get("speculative_tokens"))):
        if not isinstance(value, int):
            raise StoreFormatError(f"{path}: {key} is {value!r}, expected an integer (vLLM requires it); the "
                                   "drafter's mask token and K cannot be guessed")
    return DrafterConfig(
        hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
        num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer.get("num_key_value_heads") or layer["num_attention_heads"],
        head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        vocab_size=layer["vocab_size"], draft_vocab_size=cfg["draft_vocab_size"],
        aux_layer_ids=list(cfg["eagle_aux_hidden_state_layer_ids"]),
        num_hidden_layers=layer.get("num_hidden_layers", 1), rms_norm_eps=layer.get("rms_norm_eps", 1e-5),
        rope_theta=float(rope["rope_theta"]), rope_parameters=rope,
        max_position_embeddings=layer.get("max_position_embeddings", 8192),
        mask_token_id=cfg["mask_token_id"], num_depths=methods[0]["speculative_tokens"], layer_type=layer_type,
        verifier_name_or_path=verifier.get("name_or_path", ""),
        verifier_architectures=verifier.get("architectures") or ["LlamaForCausalLM"],
    )


def _drop_identity_vocab_maps(tensors: dict[str, torch.Tensor], cfg: DrafterConfig, path: Path) -> dict:
    """Accept a full-vocab checkpoint written before d2t/t2d were left out when D == V: drop them
    if they are the identity maps (``d2t`` all 0, ``t2d`` all True).

    Raises:
        StoreFormatError: a full-vocab checkpoint whose ``d2t``/``t2d`` are not identities.
    """
    if cfg.draft_vocab_size != cfg.vocab_size or not ({"d2t", "t2d"} & tensors.keys()):
        return tensors
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if (d2t is not None and bool(d2t.any())) or (t2d is not None and not bool(t2d.all())):
        raise StoreFormatError(f"{path}: draft_vocab_size equals the vocab size ({cfg.vocab_size}) but d2t/t2d "
                               "are not the identity maps")
    return {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}


def check_vocab_maps(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int, path: str | os.PathLike) -> None:
    """A reduced draft vocab's maps agree with each other (docs/design.md §3, §8).

    ``d2t [D]`` holds offsets (``verifier_id = draft_id + d2t[draft_id]``): the ids ``arange(D) + d2t``
    must lie in ``[0, V)`` and increase strictly, and ``t2d [V]`` (bool, or 0/1) must mark exactly
    those D ids. A ``d2t`` holding absolute verifier ids instead of offsets (a bug of other
    writers) fails here, at draft id 1.

    Raises:
        StoreFormatError: names ``path`` (the weights file) and the first offending draft id.
    """
    D = int(d2t.numel())
    if d2t.dim() != 1 or t2d.dim() != 1 or t2d.numel() != vocab_size:
        raise StoreFormatError(f"{path}: d2t has shape {list(d2t.shape)} and t2d {list(t2d.shape)}; expected "
                               f"[D] and [{vocab_size}] (the vocab size)")
    if d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise StoreFormatError(f"{path}: d2t is {d2t.dtype}, expected integer offsets (int64)")
    if t2d.dtype != torch.bool and not bool(((t2d == 0) | (t2d == 1)).all()):
        raise StoreFormatError(f"{path}: t2d holds values other than 0 and 1; expected a bool mask [{vocab_size}]")
    ids = torch.arange(D, dtype=torch.int64) + d2t.to(torch.int64)  # [D] verifier id of each draft id
    fix = ("d2t must hold offsets, verifier_id = draft_id + d2t[draft_id], of strictly increasing verifier ids, "
           "and t2d mark exactly those ids (a d2t rewritten as absolute ids is a known bug of other writers); "
           "rebuild the maps or re-export the checkpoint")
    mark = t2d.to(torch.bool)
    outside = (ids < 0) | (ids >= vocab_size)
    falls = torch.zeros(D, dtype=torch.bool)
    falls[1:] = ids[1:] <= ids[:-1]
    unmarked = ~outside & ~mark[ids.clamp(0, vocab_size - 1)]
    bad = torch.nonzero(outside | falls | unmarked).flatten()
    if bad.numel():
        i = int(bad[0])
        to = f"draft id {i} maps to verifier id {int(ids[i])} (d2t[{i}] = {int(d2t[i])})"
        why = (f"outside [0, {vocab_size})" if outside[i] else
               f"not above draft id {i - 1}'s {int(ids[i - 1])}" if falls[i] else "which t2d does not mark")
        raise StoreFormatError(f"{path}: {to}, {why} ({int(unmarked.sum())} of {D} draft ids map to ids t2d "
                               f"does not mark, {int(outside.sum())} outside the vocab); {fix}")
    n = int(mark.sum())
    if n != D:  # every mapped id is marked, so t2d marks more
        extra = torch.nonzero(mark).flatten()
        extra = extra[~torch.isin(extra, ids)]
        raise StoreFormatError(f"{path}: t2d marks {n} verifier ids but d2t maps {D} draft ids: verifier id "
                               f"{int(extra[0])} is marked but no draft id maps to it; {fix}")


def read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The tensors of a drafter's ``model.safetensors``, every floating-point one finite.

    Raises:
        StoreFormatError: not readable as safetensors (truncated or corrupted), naming the file.
        NonFiniteError: a tensor holding NaN or Inf, naming it: a drafter so would draft garbage and its AL
            would be reported as if measured.
    """
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise StoreFormatError(f"{path} cannot be read as safetensors ({e}): truncated or corrupted after it was "
                               "written (peagle writes a checkpoint whole); use another checkpoint of the run") from e
    bad = [k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise NonFiniteError(f"{path}: tensor(s) {', '.join(sorted(bad)[:5])} hold NaN or Inf: this drafter cannot "
                             "be evaluated, served or trained from")
    return tensors


def load_drafter(directory: str | os.PathLike, device: str | torch.device = "cpu") -> PEagleDrafter:
    """Load a drafter written by :func:`save_drafter` (bit-exact round trip).

    Raises:
        StoreFormatError: ``config.json`` or ``model.safetensors`` is missing, not a P-EAGLE
            checkpoint, its tensors do not match the config, or its ``d2t``/``t2d`` disagree
            (:func:`check_vocab_maps`).
    """
    directory = Path(directory)
    cfg_path, w_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not cfg_path.is_file() or not w_path.is_file():
        raise StoreFormatError(f"{directory} is not a drafter checkpoint: expected {CONFIG_FILE} and "
                               f"{WEIGHTS_FILE}")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("speculators_model_type") == "dflash":
        raise StoreFormatError(f"{directory} is a DFlash drafter (speculators_model_type 'dflash'): peagle reads it "
                               "with its DFlash kind (peagle_train.train.kinds.load_drafter_of_kind), as peagle-eval and the "
                               "Python API do")
    if cfg.get("speculators_model_type") != "peagle":
        raise StoreFormatError(f"{cfg_path}: speculators_model_type is "
                               f"{cfg.get('speculators_model_type')!r}, expected 'peagle'")
    model = PEagleDrafter(_config_from_json(cfg, cfg_path))
    tensors = _drop_identity_vocab_maps(read_weights(w_path), model.config, w_path)
    if model.config.draft_vocab_size < model.config.vocab_size and {"d2t", "t2d"} <= tensors.keys():
        check_vocab_maps(tensors["d2t"], tensors["t2d"], model.config.vocab_size, w_path)
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise StoreFormatError(f"{w_path} does not match {cfg_path}: {e}") from e
    model.lm_head.weight.requires_grad_(False)
    return model.to(device)


def save_training_state(directory: str | os.PathLike, state: dict[str, Any]) -> None:
    """Write ``training_state.pt`` (a dict: optimizer, scheduler, rng, data, step, ...) atomically."""
    path = Path(directory) / STATE_FILE
    with atomic_file(path) as tmp:
        torch.save(state, tmp)


def load_training_state(directory: str | os.PathLike) -> dict[str, Any]:
    """Read ``training_state.pt`` of a checkpoint directory.

    Raises:
        StoreFormatError: the file is missing (the checkpoint is incomplete).
    """
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise StoreFormatError(f"{path} is missing: {directory} is not a complete training checkpoint")
    return torch.load(path, map_location="cpu", weights_only=False)


def save_checkpoint(model: PEagleDrafter, directory: str | os.PathLike, state: dict[str, Any],
                    extra_config: dict[str, Any] | None = None, training_segments: np.ndarray | None = None) -> Path:
    """Drafter files (``training_segments`` as :func:`save_drafter`) plus training state, in one atomic directory
    swap; state written last."""
    return save_with_state(directory, lambda tmp: _write_drafter(model, tmp, extra_config, training_segments), state)


def save_with_state(directory: str | os.PathLike, write_files: Callable[[Path], None], state: dict[str, Any]) -> Path:
    """A checkpoint of any drafter kind: ``write_files(tmp)`` (its drafter files), then ``training_state.pt``
    (:func:`save_training_state`, written last), in one atomic directory swap of ``directory``."""
    directory = Path(directory)

    def write(tmp: Path) -> None:
        write_files(tmp)
        save_training_state(tmp, state)

    replace_dir(directory, write)
    return directory


def latest_checkpoint(output: str | os.PathLike) -> Path | None:
    """The complete ``checkpoint-N`` under ``output`` with the largest N, or None."""
    best: tuple[int, Path] | None = None
    root = Path(output)
    if not root.is_dir():
        return None
    for p in root.iterdir():
        m = _CHECKPOINT_RE.match(p.name)
        if m and (p / STATE_FILE).is_file() and (best is None or int(m.group(1)) > best[0]):
            best = (int(m.group(1)), p)
    return best[1] if best else None


def prune_checkpoints(output: str | os.PathLike, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete ``checkpoint-N`` under ``output`` (never ``final/``).

    Only complete checkpoints (with ``training_state.pt``) count and are deleted, so the latest one,
    which ``--resume`` reads, always stays. Returns the deleted directories, oldest first.

    Raises:
        ValueError: ``keep < 1``.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = Path(output)
    done = sorted((int(m.group(1)), p) for p in root.iterdir()
                  if (m := _CHECKPOINT_RE.match(p.name)) and (p / STATE_FILE).is_file())
    old = [p for _, p in done[:-keep]]
    for p in old:
        shutil.rmtree(p)
    return old


def _is_drafter(directory: Path) -> bool:
    return (directory / CONFIG_FILE).is_file() and (directory / WEIGHTS_FILE).is_file()


def find_drafter(path: str | os.PathLike) -> tuple[Path, str | None]:
    """The drafter checkpoint a user means by ``path``: ``path`` itself when it is one, else, for a
    ``peagle-train`` output directory, its ``final/``, else its newest complete ``checkpoint-N``.

    Returns:
        (the checkpoint directory, None when it is ``path`` itself, else a sentence saying which
        checkpoint of the training output was taken and why).

    Raises:
        StoreFormatError: ``path`` is neither a drafter checkpoint nor a training output holding one.
    """
    path = Path(path)
    if _is_drafter(path):
        return path, None
    if _is_drafter(path / "final"):
        return path / "final", f"{path} is a training output: using its final checkpoint {path / 'final'}"
    latest = latest_checkpoint(path)
    if latest is not None and _is_drafter(latest):
        return latest, (f"{path} is a training output without final/ (an unfinished run): using its newest "
                        f"checkpoint {latest}")
    if (path / "train_config.json").is_file():  # a run that has not saved a checkpoint yet
        raise StoreFormatError(f"{path} is a peagle-train output with no checkpoint yet: the run writes "
                               "checkpoint-N/ every --save-every steps and final/ at its end; evaluate it then")
    raise StoreFormatError(f"{path} is not a drafter checkpoint ({CONFIG_FILE} and {WEIGHTS_FILE}) nor a "
                           "peagle-train output holding final/ or a checkpoint-N/")


# ------------------------------------------------------------------------------ vLLM's rules
VLLM_MODEL_TYPES = ("llama", "qwen3")
"""``transformer_layer_config.model_type`` values vLLM 0.32 maps a P-EAGLE checkpoint to
(``PeagleLlamaForCausalLM``, ``PeagleQwen3ForCausalLM``; vllm/transformers_utils/configs/speculators/algos.py)."""

_UNTRAINED_NORMS = ("norm_before_fc", "fc_norm", "norm_output")


def vllm_problems(config: dict[str, Any], shapes: dict[str, tuple[int, ...]] | None = None) -> list[str]:
    """Why vLLM 0.32 would not serve the checkpoint of ``config`` (a ``config.json`` dict) as it was
    trained, or would serve something else; empty when it serves it exactly.

    The rules are what vLLM reads (``update_peagle``, ``llama_eagle3.py`` / ``qwen3_eagle3.py``,
    ``gpu_model_runner._get_eagle3_aux_layers_from_config``, ``EagleModelMixin``):
    - ``speculators_config`` with a proposal method's ``speculative_tokens`` and ``verifier.name_or_path``;
    - ``transformer_layer_config.model_type`` one of :data:`VLLM_MODEL_TYPES`, ``hidden_act`` silu (vLLM's
      Llama MLP has no other), no attention or MLP bias, no ``logit_scale`` other than 1, no qwen3
      ``sliding_attention`` layer (``Qwen3Eagle3DecoderLayer`` reads ``layer_types``);
    - ``mask_token_id`` (vLLM's ``pard_token``), required under parallel drafting;
    - ``eagle_aux_hidden_state_layer_ids`` strictly increasing (vLLM captures ``sorted(set(ids))`` and
      concatenates them in that order) and as many as ``fc`` is wide: ``num_aux_hidden_states`` inside
      ``transformer_layer_config`` (else 3) for llama, ``num_aux_layers`` / ``num_aux_hidden_states`` /
      the ids' count for qwen3;
    - ``norm_before_residual`` false (peagle's drafter adds the un-normed fc output as its residual),
      ``norm_before_fc``, ``fc_norm``, ``norm_output`` absent or false at either level: peagle trains none
      of those norms, and vLLM reads them only inside ``transformer_layer_config``;
    - ``target_hidden_size`` (when given) equal to ``hidden_size``;
    - with ``shapes`` (tensor name -> shape): ``mask_hidden`` of L·H values, ``d2t [D]`` whenever
      ``draft_vocab_size`` D < the vocab size (without it vLLM maps draft id i to token i), ``fc.weight
      [H, L·H]``.
    """
    out: list[str] = []
    spec = config.get("speculators_config")
    methods = (spec or {}).get("proposal_methods") or [{}]
    if config.get("speculators_model_type") != "peagle":
        out.append(f"speculators_model_type is {config.get('speculators_model_type')!r}, not 'peagle'")
    if not isinstance(spec, dict) or methods[0].get("speculative_tokens") is None \
            or not (spec.get("verifier") or {}).get("name_or_path"):
        out.append("speculators_config needs proposal_methods[0].speculative_tokens and verifier.name_or_path")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        return out + ["transformer_layer_config (a dict) is missing"]
    model_type = layer.get("model_type", "llama")
    if model_type not in VLLM_MODEL_TYPES:
        out.append(f"transformer_layer_config.model_type {model_type!r}: vLLM maps only {list(VLLM_MODEL_TYPES)}")
    if layer.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act {layer.get('hidden_act')!r}: vLLM's drafter MLP supports only silu")
    for key in ("attention_bias", "mlp_bias"):
        if layer.get(key):
            out.append(f"transformer_layer_config.{key} is true: the drafter is trained without biases")
    if model_type == "qwen3" and "sliding_attention" in (layer.get("layer_types") or []):
        out.append(f"transformer_layer_config.layer_types {layer['layer_types']}: vLLM's qwen3 drafter would "
                   "attend within a sliding window there; the drafter is trained with full attention")
    if float(layer.get("logit_scale", 1.0) or 1.0) != 1.0:
        out.append(f"transformer_layer_config.logit_scale {layer['logit_scale']}: vLLM would scale the draft logits")
    if not isinstance(config.get("mask_token_id"), int):
        out.append("mask_token_id is missing: vLLM needs it (pard_token) to draft in parallel")
    ids = config.get("eagle_aux_hidden_state_layer_ids") or []
    if not ids:
        out.append("eagle_aux_hidden_state_layer_ids is missing: vLLM would capture its default layers")
    elif list(ids) != sorted(set(ids)):
        out.append(f"eagle_aux_hidden_state_layer_ids {list(ids)} is not strictly increasing: vLLM feeds the "
                   f"layers {sorted(set(ids))}, in that order; extract with --layers "
                   f"{','.join(map(str, sorted(set(ids))))}")
    eagle = layer.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        out.append("transformer_layer_config.eagle_config.use_aux_hidden_state is false: vLLM would skip fc")
    if model_type == "qwen3":
        # vLLM's update_peagle overwrites the inner ids with the top-level ones when those are set
        width = layer.get("num_aux_layers") or layer.get("num_aux_hidden_states") or len(
            ids or layer.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids") or
            [0, 0, 0])
    else:
        width = layer.get("num_aux_hidden_states") or len(eagle.get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
    if ids and int(width) != len(ids):
        out.append(f"vLLM sizes fc for {width} aux layers but the checkpoint has {len(ids)} "
                   f"({list(ids)}); write \"num_aux_hidden_states\": {len(ids)} inside transformer_layer_config")
    if config.get("norm_before_residual", False):
        out.append("norm_before_residual is true: peagle's drafter adds the un-normed fc output as its residual")
    for key in _UNTRAINED_NORMS:
        if config.get(key) or layer.get(key) or eagle.get(key):
            out.append(f"{key} is set: peagle's drafter has no such norm (and vLLM reads it only inside "
                       "transformer_layer_config)")
    H = layer.get("hidden_size")
    if config.get("target_hidden_size") not in (None, H):
        out.append(f"target_hidden_size {config['target_hidden_size']} != hidden_size {H}")
    if shapes is not None and H is not None and ids:
        D, V = config.get("draft_vocab_size"), layer.get("vocab_size")
        mask = shapes.get("mask_hidden")
        if mask is None or int(torch.Size(mask).numel()) != len(ids) * H:
            out.append(f"mask_hidden {mask} must hold {len(ids)} x {H} values (vLLM requires it under parallel "
                       "drafting)")
        if D is not None and V is not None and D < V and "d2t" not in shapes:
            out.append(f"d2t is missing but the draft vocab is reduced ({D} < {V}): vLLM would map draft id i "
                       "to token i")
        if shapes.get("fc.weight") not in (None, (H, len(ids) * H)):
            out.append(f"fc.weight {shapes['fc.weight']} is not [{H}, {len(ids) * H}]")
    return out


def check_servable(config: dict[str, Any], shapes: dict[str, tuple[int, ...]] | None, where: str) -> None:
    """Raise when vLLM would not serve ``config`` exactly as trained (:func:`vllm_problems`).

    Raises:
        InputError: naming ``where`` (the checkpoint, or the training settings) and every problem.
    """
    problems = vllm_problems(config, shapes)
    if problems:
        raise InputError(f"{where}: vLLM cannot serve this drafter as it is trained: " + "; ".join(problems))


def check_servable_checkpoint(directory: str | os.PathLike) -> None:
    """:func:`check_servable` on a checkpoint directory's ``config.json`` and tensor shapes (read from
    the safetensors header, no weights loaded): how ``peagle-eval`` checks a drafter, peagle's or not.

    Raises:
        InputError: vLLM would not serve it as trained (naming every reason).
        StoreFormatError: not a drafter checkpoint.
    """
    directory = Path(directory)
    cfg_path, w_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not cfg_path.is_file() or not w_path.is_file():
        raise StoreFormatError(f"{directory} is not a drafter checkpoint: expected {CONFIG_FILE} and {WEIGHTS_FILE}")
    with safe_open(str(w_path), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    check_servable(json.loads(cfg_path.read_text()), shapes, str(directory))
