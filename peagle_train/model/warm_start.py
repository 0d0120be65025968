"""Warm start (``peagle-train --init-from DIR``, docs/design.md §8): an existing drafter as the initial
weights of a new training run, read and checked before any weights load.

Legend: H hidden size, L aux layers, V verifier vocab, D draft vocab.

Three layouts are read (:data:`INIT_FORMATS`):
- ``peagle``: a peagle checkpoint (``final/``, ``checkpoint-N/``, or a training output holding one), or a
  speculators P-EAGLE one (``speculators_model_type "peagle"``);
- ``eagle3``: a speculators EAGLE-3 checkpoint (``speculators_model_type "eagle3"``): no ``mask_hidden`` and
  no mask token (both come fresh from this run); vLLM reads its ``norm_before_residual`` as true when absent;
- ``dflash``: a DFlash checkpoint in speculators' ``dflash`` format (peagle's or speculators' own): its
  ``aux_hidden_state_layer_ids``, ``mask_token_id`` and ``block_size`` at the top, a Qwen3
  ``transformer_layer_config`` whose layers compute as :class:`~peagle_train.model.dflash.DFlashDrafter`'s
  (:func:`peagle_train.model.dflash_checkpoint.dflash_layer_problems`); read as a
  :class:`~peagle_train.model.dflash.DFlashConfig`. Only a DFlash run (``--method dflash``) starts from it,
  and only from it (:data:`FORMAT_METHODS`);
- ``vllm``: the native vLLM layout (a Llama or Qwen3 config with ``architectures`` an EAGLE-3 / P-EAGLE
  drafter of :data:`NATIVE_ARCHITECTURES`, the mask token as ``ptd_token_id`` or ``pard_token``, the aux layers as
  ``eagle_aux_hidden_state_layer_ids`` at the top or in ``eagle_config``), as the public gpt-oss P-EAGLE
  drafters; ``midlayer.*`` is read as ``layers.0.*``.

In every layout a missing ``embed_tokens`` or ``lm_head`` is the verifier's (:data:`FROM_VERIFIER`: what vLLM
serves then), recorded in ``peagle_training.init_from.from_verifier``.

Both drafter layer types are read (``llama``, ``qwen3`` with its ``q_norm``/``k_norm`` tensors); the run's
``--drafter-layer`` must be the source's. Tensors are read under the peagle names
(:class:`peagle_train.model.drafter.PEagleDrafter`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from peagle_train.model.checkpoint import (CONFIG_FILE, WEIGHTS_FILE, check_vocab_maps, find_drafter,
                                           layer_type_of, rope_from_layer_config)
from peagle_train.model.config import DrafterConfig
from peagle_train.model.dflash import DFlashConfig, DFlashDrafter
from peagle_train.model.dflash_checkpoint import dflash_layer_problems
from peagle_train.model.drafter import PEagleDrafter
from stores.errors import InputError, StoreFormatError

__all__ = ["INIT_FORMATS", "FORMAT_METHODS", "FROM_VERIFIER", "INIT_LAYERS", "NATIVE_ARCHITECTURES", "InitSource", "read_init_source", "file_sha256",
           "check_verifier_layers", "copy_verifier_layers", "COPYABLE_LAYERS",
           "load_init_weights"]

INIT_FORMATS = ("peagle", "eagle3", "vllm", "dflash")
"""The checkpoint layouts ``--init-from`` reads."""

FORMAT_METHODS = {"peagle": "peagle", "eagle3": "peagle", "vllm": "peagle", "dflash": "dflash"}
"""Layout -> the ``--method`` (drafter kind) a run starting from it trains: a P-EAGLE run starts from a P-EAGLE,
EAGLE-3 or native vLLM drafter, a DFlash run from a DFlash one; any other pairing is refused
(:func:`read_init_source`), since the two kinds' tensors and forwards differ."""

NATIVE_ARCHITECTURES = {"Eagle3LlamaForCausalLM": "llama", "LlamaForCausalLMEagle3": "llama",
                        "PeagleLlamaForCausalLM": "llama", "PEagleDraftModel": "llama",
                        "Eagle3Qwen3ForCausalLM": "qwen3", "PeagleQwen3ForCausalLM": "qwen3"}
"""``architectures`` of a native vLLM-layout drafter -> the drafter layer type vLLM 0.32 builds for it
(vllm/model_executor/models/registry.py -> ``llama_eagle3.Eagle3LlamaForCausalLM`` or
``qwen3_eagle3.Eagle3Qwen3ForCausalLM``)."""

FROM_VERIFIER = ("embed_tokens.weight", "lm_head.weight")
"""Tensors any layout may lack: vLLM 0.32 then serves the drafter with the verifier's own module
(``llm_base_proposer._maybe_share_embeddings`` / ``_maybe_share_lm_head``: "Sharing target model ... weights"),
so the run keeps the verifier's: its embedding ``[V, H]``, and its whole lm_head ``[V, H]``, of whose logits
vLLM's drafter keeps the first D (``LogitsProcessor(draft_vocab_size)``) and places draft id i's at token
``i + d2t[i]``. With D < V that is row i for token ``i + d2t[i]``: refused unless ``d2t`` is all zero
(:func:`_check_tensors`)."""

_FRESH = {"eagle3": ("mask_hidden",), "vllm": (), "peagle": (), "dflash": ()}
"""Tensors a layout may lack that keep this run's fresh initialisation (EAGLE-3 has no ``mask_hidden``)."""


@dataclass
class InitSource:
    """A drafter checkpoint to start from, read without its weights.

    Attributes:
        path: the checkpoint directory (a training output's ``final/`` or newest ``checkpoint-N/``).
        format: one of :data:`INIT_FORMATS`.
        config: the drafter's shape; its ``mask_token_id`` is meaningful only when :attr:`mask_token_id` is set.
        mask_token_id: the drafter's mask token (``mask_token_id`` / ``ptd_token_id``), None for EAGLE-3.
        num_depths: the drafter's K (speculators ``speculative_tokens``; DFlash ``block_size - 1``), None where the
            layout has none.
        block_size: a DFlash drafter's B (``block_size``); None for the other layouts.
        names: peagle tensor name -> the name in the file.
        shapes: peagle tensor name -> shape, from the safetensors header.
        d2t: ``[D] int64`` offsets of a reduced draft vocab (None with D == V).
        t2d: ``[V] bool`` (None with D == V).
        weights_sha256: sha256 of ``model.safetensors``.
        config_sha256: sha256 of ``config.json``.
        from_verifier: the tensors of :data:`FROM_VERIFIER` the file lacks: the run keeps the verifier's.
        fresh: the tensors the file lacks that keep the run's fresh initialisation (EAGLE-3's ``mask_hidden``).
    """

    path: Path
    format: str
    config: DrafterConfig
    mask_token_id: int | None
    num_depths: int | None
    names: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    d2t: torch.Tensor | None
    t2d: torch.Tensor | None
    weights_sha256: str
    config_sha256: str
    from_verifier: tuple[str, ...] = ()
    fresh: tuple[str, ...] = ()
    block_size: int | None = None

    def record(self) -> dict[str, Any]:
        """What the run records (``peagle_training.init_from``): also which tensors the file lacked, taken
        from the verifier (``from_verifier``) or freshly initialised (``fresh``)."""
        return {"path": str(self.path), "format": self.format, "weights_sha256": self.weights_sha256,
                "config_sha256": self.config_sha256, "from_verifier": list(self.from_verifier),
                "fresh": list(self.fresh)}


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes (read in 16 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _refuse(where: Path, problem: str) -> None:
    raise InputError(f"--init-from {where}: {problem}", field="--init-from")


def _layout(cfg: dict[str, Any], where: Path) -> tuple[str, dict[str, Any]]:
    """``(format, the Llama layer dict)`` of a ``config.json``.

    Raises:
        StoreFormatError: neither a speculators P-EAGLE / EAGLE-3 config nor a native vLLM-layout one.
    """
    kind = cfg.get("speculators_model_type")
    if kind in ("peagle", "eagle3", "dflash"):
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise StoreFormatError(f"{where}: speculators_model_type {kind!r} without a transformer_layer_config")
        return kind, layer
    if kind is None and set(cfg.get("architectures") or []) & set(NATIVE_ARCHITECTURES):
        return "vllm", cfg
    raise StoreFormatError(
        f"{where}: not a drafter --init-from reads: speculators_model_type {kind!r}, architectures "
        f"{cfg.get('architectures')!r}; expected speculators_model_type 'peagle', 'eagle3' or 'dflash', or a native vLLM "
        f"config with architectures one of {list(NATIVE_ARCHITECTURES)}")


def _check_computes_as_peagle(fmt: str, cfg: dict[str, Any], layer: dict[str, Any], where: Path) -> str:
    """The drafter's layer type (:data:`~peagle_train.model.config.LAYER_TYPES`); refuse a drafter whose
    forward, as vLLM computes it, is not peagle's: another layer type, an activation other than silu,
    biases, sliding windows, a norm peagle's drafter lacks, no aux hidden states. A native config's layer
    type is its architecture's (:data:`NATIVE_ARCHITECTURES`, which vLLM builds), and its ``model_type``,
    when given, must agree."""
    eagle = layer.get("eagle_config") or cfg.get("eagle_config") or {}
    try:
        layer_type = layer_type_of(layer)
    except ValueError as e:
        _refuse(where, f"{e}; train a fresh drafter instead")
    if fmt == "vllm":
        archs = {NATIVE_ARCHITECTURES[a] for a in cfg.get("architectures") or [] if a in NATIVE_ARCHITECTURES}
        if len(archs) != 1 or ("model_type" in layer and layer_type not in archs):
            _refuse(where, f"architectures {cfg.get('architectures')} (vLLM builds a {' or '.join(sorted(archs))} "
                           f"drafter layer) and model_type {layer.get('model_type')!r} disagree")
        layer_type = archs.pop()
    if layer.get("hidden_act", "silu") != "silu":
        _refuse(where, f"hidden_act is {layer.get('hidden_act')!r}; peagle's drafter MLP is silu")
    # vLLM's default: true for speculators EAGLE-3 (update_eagle3), false for P-EAGLE and a native config
    nbr = cfg.get("norm_before_residual", fmt == "eagle3")
    if fmt == "vllm":
        nbr = bool(layer.get("norm_before_residual", False))
    if nbr:
        _refuse(where, f"norm_before_residual is true{' (vLLM reads it so when absent)' if fmt == 'eagle3' else ''}: "
                       "vLLM adds the normed fc output as the residual, peagle's drafter the un-normed one, so "
                       "training would change what the drafter computes")
    for key in ("norm_before_fc", "fc_norm", "norm_output"):
        if cfg.get(key) or layer.get(key) or eagle.get(key):
            _refuse(where, f"{key} is set; peagle's drafter has no such norm")
    if eagle.get("use_aux_hidden_state") is False:
        _refuse(where, "eagle_config.use_aux_hidden_state is false; peagle's drafter reads aux hidden states")
    if float(layer.get("logit_scale", 1.0) or 1.0) != 1.0:
        _refuse(where, f"logit_scale is {layer['logit_scale']}; peagle's drafter does not scale its logits")
    return layer_type


def _mask_token(fmt: str, cfg: dict[str, Any], where: Path) -> int | None:
    """The drafter's mask token: ``mask_token_id`` (speculators; vLLM's ``pard_token``), or in a native
    config the first of ``mask_token_id``, ``pard_token``, ``ptd_token_id`` (vLLM's order); None for EAGLE-3."""
    if fmt == "eagle3":
        return None
    inner = cfg.get("transformer_layer_config") or {}
    if fmt == "peagle" and inner.get("mask_token_id") not in (None, cfg.get("mask_token_id")):
        raise StoreFormatError(f"{where}: transformer_layer_config.mask_token_id {inner['mask_token_id']} differs "
                               f"from mask_token_id {cfg.get('mask_token_id')}; vLLM drafts with the inner one")
    keys = ("mask_token_id",) if fmt == "peagle" else ("mask_token_id", "pard_token", "ptd_token_id")
    for key in keys:
        if cfg.get(key) is not None:
            return int(cfg[key])
    raise StoreFormatError(f"{where}: no mask token ({' / '.join(keys)}); vLLM needs it to draft in parallel")


def _check_method(fmt: str, kind: Any, method: str, where: Path) -> None:
    """Refuse a drafter of another kind than ``method``'s (:data:`FORMAT_METHODS`), naming both kinds."""
    if FORMAT_METHODS[fmt] != method:
        takes = [f for f, m in FORMAT_METHODS.items() if m == method]
        _refuse(where, f"it is a {FORMAT_METHODS[fmt]} drafter ({fmt} layout, speculators_model_type {kind!r}) and "
                       f"this run trains a {method} drafter (--method {method}, which starts from "
                       f"{' / '.join(takes)} drafters); pass --method {FORMAT_METHODS[fmt]} to continue this "
                       f"drafter, or start from a {method} drafter")


def _check_computes_as_dflash(cfg: dict[str, Any], layer: dict[str, Any], where: Path) -> str:
    """``qwen3``; refuse a DFlash drafter whose forward is not peagle's
    :class:`~peagle_train.model.dflash.DFlashDrafter`'s (:func:`dflash_layer_problems`: another layer, activation,
    biases, sliding windows, ``is_causal``, ``logit_scale``; ``sample_from_anchor``). speculators'
    ``sliding_window_non_causal`` false is read: it concerns sliding-window layers only (refused here), and its
    full-attention layers attend non-causally inside the block, as peagle's do."""
    problems = dflash_layer_problems(layer)
    if cfg.get("sample_from_anchor", False):
        problems.append("sample_from_anchor is true: peagle's DFlash drafter drafts from the mask slots only")
    if problems:
        _refuse(where, "; ".join(problems) + "; train a fresh drafter instead")
    return "qwen3"


def _source_config(fmt: str, cfg: dict[str, Any], layer: dict[str, Any], layer_type: str,
                   cfg_path: Path) -> tuple[DrafterConfig, int | None, int | None]:
    """``(the drafter's config, its mask token, its K)`` from a ``config.json`` of layout ``fmt`` (a
    :class:`DFlashConfig` for ``dflash``, its K ``block_size - 1``).

    Raises:
        StoreFormatError: no aux layer ids, no mask token where one is required, a missing or bad field.
    """
    eagle = layer.get("eagle_config") or cfg.get("eagle_config") or {}
    # vLLM's order: the top level (speculators copy it into the layer config), the layer's, then eagle_config's
    keys = ("aux_hidden_state_layer_ids",) if fmt == "dflash" else ("eagle_aux_hidden_state_layer_ids",)
    ids = cfg.get(keys[0]) or layer.get(keys[0]) or eagle.get(keys[0])
    if not ids:
        raise StoreFormatError(f"{cfg_path}: {keys[0]} is missing (at the top or in the layer config): the verifier "
                               "layers the drafter reads are unknown")
    mask = _mask_token("peagle" if fmt == "dflash" else fmt, cfg, cfg_path)
    methods = (cfg.get("speculators_config") or {}).get("proposal_methods") or [{}]
    K = methods[0].get("speculative_tokens") if fmt == "peagle" else None
    rope = rope_from_layer_config(layer)
    saved = (cfg.get("peagle") or {}).get("drafter_config") or {}
    try:
        nh, V = int(layer["num_attention_heads"]), int(layer["vocab_size"])
        fields = dict(
            hidden_size=int(layer["hidden_size"]), intermediate_size=int(layer["intermediate_size"]),
            num_attention_heads=nh, num_key_value_heads=int(layer.get("num_key_value_heads") or nh),
            head_dim=int(layer.get("head_dim") or int(layer["hidden_size"]) // nh), vocab_size=V,
            draft_vocab_size=int(cfg.get("draft_vocab_size") or V), aux_layer_ids=[int(i) for i in ids],
            num_hidden_layers=int(layer.get("num_hidden_layers", 1)),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-5)), rope_theta=float(rope["rope_theta"]),
            rope_parameters=rope, max_position_embeddings=int(layer.get("max_position_embeddings", 8192)),
            mask_token_id=mask or 0, num_depths=int(K or 1), layer_type=layer_type,
            verifier_name_or_path=saved.get("verifier_name_or_path")
            or ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path", ""))
        if fmt == "dflash":
            dc: DrafterConfig = DFlashConfig(**fields, block_size=int(cfg["block_size"]))
            K = dc.num_depths
        else:
            dc = DrafterConfig(**fields)
    except (KeyError, ValueError, TypeError) as e:
        raise StoreFormatError(f"{cfg_path}: {type(e).__name__} {e}") from e
    return dc, mask, K


def _vocab_maps(f, names: dict[str, str], dc: DrafterConfig,
                directory: Path) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(d2t [D] int64, t2d [V] bool)`` of the open safetensors ``f`` (``t2d`` derived from ``d2t`` when absent:
    vLLM never reads it), or ``(None, None)`` with D == V; a reduced vocab without ``d2t`` is refused."""
    V = dc.vocab_size
    if dc.draft_vocab_size >= V:
        return None, None
    d2t = f.get_tensor(names["d2t"]) if "d2t" in names else None
    t2d = f.get_tensor(names["t2d"]) if "t2d" in names else None
    if d2t is None:
        _refuse(directory, f"draft_vocab_size {dc.draft_vocab_size} < vocab_size {V} but d2t is missing: which "
                           "verifier token each draft id is is unknown")
    if t2d is None:
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[(torch.arange(d2t.numel()) + d2t).clamp(0, V - 1)] = True
    check_vocab_maps(d2t, t2d, V, directory / WEIGHTS_FILE)
    return d2t.to(torch.int64), t2d.to(torch.bool)


def read_init_source(path: str | os.PathLike, method: str = "peagle") -> InitSource:
    """Read the drafter ``path`` names (a checkpoint, or a training output: its ``final/``, else its
    newest ``checkpoint-N/``) as the start of a ``method`` run (``--method``): config, tensor names and shapes,
    its ``d2t``/``t2d``; no other weights.

    Raises:
        StoreFormatError: not a drafter checkpoint of :data:`INIT_FORMATS`; no mask token where one is
            required; maps that disagree (:func:`peagle_train.model.checkpoint.check_vocab_maps`).
        InputError: a drafter of another kind than ``method``'s (:data:`FORMAT_METHODS`, naming both); a drafter
            whose forward is not peagle's (a layer type other than llama and qwen3, another activation, biases,
            sliding windows, ``norm_before_residual``, extra norms), or whose tensors are not the ones its config
            implies (naming the tensors and shapes).
    """
    directory, _ = find_drafter(path)
    cfg_path, w_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    raw = cfg_path.read_bytes()
    cfg = json.loads(raw)
    fmt, layer = _layout(cfg, cfg_path)
    _check_method(fmt, cfg.get("speculators_model_type"), method, directory)
    if fmt == "dflash":
        layer_type = _check_computes_as_dflash(cfg, layer, directory)
    else:
        layer_type = _check_computes_as_peagle(fmt, cfg, layer, directory)
    dc, mask, K = _source_config(fmt, cfg, layer, layer_type, cfg_path)
    width = layer.get("num_aux_hidden_states")
    if width is not None and fmt != "dflash" and int(width) != dc.num_aux_layers:
        _refuse(directory, f"num_aux_hidden_states is {width} but eagle_aux_hidden_state_layer_ids "
                           f"{dc.aux_layer_ids} holds {dc.num_aux_layers}: vLLM sizes fc for {width}")
    try:
        with safe_open(str(w_path), framework="pt") as f:
            names = {k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k: k for k in f.keys()}
            shapes = {k: tuple(f.get_slice(names[k]).get_shape()) for k in names}
            d2t, t2d = _vocab_maps(f, names, dc, directory)
    except SafetensorError as e:
        _refuse(directory, f"{WEIGHTS_FILE} cannot be read as safetensors ({e}): truncated or corrupted")
    lacks = _check_tensors(fmt, dc, shapes, directory, d2t)
    return InitSource(path=directory.resolve(), format=fmt, config=dc, mask_token_id=mask,
                      num_depths=int(K) if K is not None else None, names=names, shapes=shapes, d2t=d2t, t2d=t2d,
                      weights_sha256=file_sha256(w_path), config_sha256=hashlib.sha256(raw).hexdigest(),
                      from_verifier=tuple(n for n in lacks if n in FROM_VERIFIER),
                      fresh=tuple(n for n in lacks if n not in FROM_VERIFIER),
                      block_size=getattr(dc, "block_size", None))


def _expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a drafter of ``cfg`` (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = DFlashDrafter(cfg) if isinstance(cfg, DFlashConfig) else PEagleDrafter(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _check_tensors(fmt: str, cfg: DrafterConfig, shapes: dict[str, tuple[int, ...]], where: Path,
                   d2t: torch.Tensor | None) -> list[str]:
    """The file's tensors are the drafter's of ``cfg``: no unknown one, none missing (but
    :data:`FROM_VERIFIER` and :data:`_FRESH`'s of its layout), each of its shape; ``mask_hidden`` of L·H values.
    Returns the drafter tensors the file lacks (sorted).

    A missing ``lm_head`` with a reduced draft vocab (``d2t`` ``[D]``, D < V) is refused unless ``d2t`` is all
    zero: vLLM then scores draft id i with the verifier's lm_head row i (the first D of its V logits) and
    proposes token ``i + d2t[i]``, so each draft token would be scored by another token's row."""
    want = _expected_shapes(cfg)
    extra = sorted(set(shapes) - set(want) - {"d2t", "t2d"})
    lacks = sorted(set(want) - set(shapes) - {"d2t", "t2d"})
    missing = [n for n in lacks if n not in FROM_VERIFIER and n not in _FRESH[fmt]]
    if extra or missing:
        _refuse(where, f"its tensors are not those of its config ({cfg.num_hidden_layers} layers): "
                       f"unknown {extra}, missing {missing}")
    if "lm_head.weight" in lacks and d2t is not None and bool(d2t.any()):
        i = int(torch.nonzero(d2t).flatten()[0])
        _refuse(where, f"it has no lm_head.weight and a reduced draft vocab (draft_vocab_size {cfg.draft_vocab_size} "
                       f"< vocab_size {cfg.vocab_size}): vLLM then shares the verifier's lm_head and keeps its first "
                       f"{cfg.draft_vocab_size} logits, so draft id {i} is scored by verifier token {i}'s row but "
                       f"proposes token {i + int(d2t[i])} (d2t); give the checkpoint its lm_head "
                       f"[{cfg.draft_vocab_size}, {cfg.hidden_size}] or train a fresh drafter")
    for name, shape in shapes.items():
        if name == "mask_hidden":
            if int(torch.Size(shape).numel()) != cfg.num_aux_layers * cfg.hidden_size:
                _refuse(where, f"mask_hidden {list(shape)} must hold {cfg.num_aux_layers} x {cfg.hidden_size} values")
        elif name in want and name not in ("d2t", "t2d") and shape != want[name]:
            _refuse(where, f"{name} is {list(shape)}, its config implies {list(want[name])}")
    return lacks


def load_init_weights(source: InitSource, model: PEagleDrafter) -> list[str]:
    """Copy ``source``'s weights into ``model`` (built with the same shape, its embedding and lm_head
    from the verifier, its draft maps the source's); returns the tensors the file lacks, which keep
    the model's (:attr:`InitSource.from_verifier`, :attr:`InitSource.fresh`).

    Raises:
        InputError: ``model.safetensors`` changed since :func:`read_init_source` (its sha256).
    """
    w_path = source.path / WEIGHTS_FILE
    if file_sha256(w_path) != source.weights_sha256:
        _refuse(source.path, f"{WEIGHTS_FILE} changed since it was checked (sha256 {source.weights_sha256}); "
                             "start again")
    own = model.state_dict()
    with safe_open(str(w_path), framework="pt") as f, torch.no_grad():
        for name, file_name in source.names.items():
            if name in ("d2t", "t2d") or name not in own:
                continue
            tensor = f.get_tensor(file_name)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                _refuse(source.path, f"{WEIGHTS_FILE}'s {file_name} holds NaN or Inf: no run can start from it")
            own[name].copy_(tensor.reshape(own[name].shape).to(own[name].dtype))
    return sorted(k for k in own if k not in source.names and k not in ("d2t", "t2d"))


INIT_LAYERS = ("random", "verifier")
"""How a fresh drafter's decoder layers start (``--init-layers``): ``random`` (normal, std 0.02) or
``verifier``, copies of the verifier's last decoder layers (:func:`copy_verifier_layers`)."""

COPYABLE_LAYERS = {"llama": "llama", "mistral": "llama", "qwen3": "qwen3"}
"""Verifier ``model_type`` -> the drafter layer type whose tensors compute exactly its decoder layer (the same
names, RMSNorm ``w * x / rms``, dense MLP). Other families' layers are refused by ``--init-layers verifier``:
Gemma's norms scale by ``1 + w``, MoE layers have experts, Qwen2's projections biases, gpt-oss sinks."""

_LAYER_CONFIG_FIELDS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
"""The verifier config's fields a drafter layer must share to start as a copy of a verifier layer."""


def check_verifier_layers(verifier_config, drafter: DrafterConfig, verifier_name: str) -> list[int]:
    """The verifier decoder layers a ``--init-layers verifier`` drafter starts from, checked on the
    verifier's (text) config before any weights load: the last ``drafter.num_hidden_layers`` ones, in
    order (drafter layer i from verifier layer ``L - N + i``).

    Raises:
        InputError: a verifier family not in :data:`COPYABLE_LAYERS`, or whose layer is not the drafter's
            ``layer_type``; fewer decoder layers than the drafter, a layer shape the drafter does not share
            (``_LAYER_CONFIG_FIELDS``, head_dim), biases in its attention or MLP, or an activation other
            than the drafter's.
    """
    vc, N = verifier_config, drafter.num_hidden_layers
    L = int(vc.num_hidden_layers)
    why = []
    model_type = getattr(vc, "model_type", None)
    if model_type not in COPYABLE_LAYERS:
        why.append(f"its decoder layers (model_type {model_type!r}) are not a drafter layer exactly "
                   f"(copyable: {', '.join(sorted(COPYABLE_LAYERS))})")
    elif COPYABLE_LAYERS[model_type] != drafter.layer_type:
        why.append(f"its {model_type} layers are the drafter layer {COPYABLE_LAYERS[model_type]!r}, the drafter's is "
                   f"{drafter.layer_type!r} (--drafter-layer {COPYABLE_LAYERS[model_type]})")
    if N > L:
        why.append(f"it has {L} decoder layers and the drafter {N}")
    for name in _LAYER_CONFIG_FIELDS:
        if getattr(vc, name, None) != getattr(drafter, name):
            why.append(f"{name} {getattr(vc, name, None)} (the drafter's {getattr(drafter, name)})")
    head_dim = getattr(vc, "head_dim", None) or vc.hidden_size // vc.num_attention_heads
    if head_dim != drafter.head_dim:
        why.append(f"head_dim {head_dim} (the drafter's {drafter.head_dim})")
    for name in ("attention_bias", "mlp_bias"):
        if getattr(vc, name, False):
            why.append(f"{name} true (the drafter's layers have no biases)")
    if getattr(vc, "hidden_act", drafter.hidden_act) != drafter.hidden_act:
        why.append(f"hidden_act {vc.hidden_act!r} (the drafter's {drafter.hidden_act!r})")
    if why:
        raise InputError(f"--init-layers verifier: the drafter's layers cannot start as copies of verifier "
                         f"{verifier_name!r}'s: {'; '.join(why)}; use --init-layers random", field="--init-layers")
    return list(range(L - N, L))


def copy_verifier_layers(model: PEagleDrafter, layers: list[dict[str, torch.Tensor]]) -> list[str]:
    """Start the drafter's decoder layers as copies of verifier layers (``layers[i]``: the state dict of
    the verifier decoder layer for drafter layer i, transformers names, e.g. ``self_attn.q_proj.weight``).

    Every verifier tensor goes to the drafter tensor of the same name, except in the first layer, whose
    attention reads ``[norm(embed) ‖ hidden_norm(fc(g))]`` (``2H`` wide): there the verifier's
    ``q/k/v_proj [out, H]`` fill the columns that read the hidden half (``[:, H:]``) and its
    ``input_layernorm`` becomes ``hidden_norm``; the columns that read the embedding and the embedding's
    ``input_layernorm`` keep their fresh initialisation. Returns the drafter layer tensors no verifier
    tensor filled (those keep the fresh initialisation).

    Raises:
        InputError: a verifier tensor the drafter layer has no place for, or another shape.
    """
    H = model.config.hidden_size
    filled: set[str] = set()
    own = model.state_dict()
    with torch.no_grad():
        for i, state in enumerate(layers):
            first = i == 0
            for name, tensor in state.items():
                target = "hidden_norm.weight" if first and name == "input_layernorm.weight" else name
                key = f"layers.{i}.{target}"
                if key not in own:
                    raise InputError(f"--init-layers verifier: the verifier layer's {name} {tuple(tensor.shape)} has "
                                     f"no place in drafter layer {i}; use --init-layers random", field="--init-layers")
                dest = own[key]
                if first and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):
                    dest = dest[:, H:]
                if dest.shape != tensor.shape:
                    raise InputError(f"--init-layers verifier: the verifier layer's {name} is {tuple(tensor.shape)}, "
                                     f"drafter layer {i}'s {key} takes {tuple(dest.shape)}", field="--init-layers")
                dest.copy_(tensor.to(dest.dtype))
                filled.add(key)
    return sorted(k for k in own if k.startswith("layers.") and k not in filled)
