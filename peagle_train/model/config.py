"""The drafter's shape (:class:`DrafterConfig`), its decoder-layer types (:data:`LAYER_TYPES`) and the RoPE
types it computes (:data:`ROPE_TYPES`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["DrafterConfig", "LAYER_TYPES", "ROPE_TYPES", "DRAFTER_METHODS"]

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE types whose frequencies are fixed (transformers' ``rope_type``); ``dynamic`` and ``longrope``
change with the sequence length and are refused."""

LAYER_TYPES = ("llama", "qwen3")
"""Decoder-layer types of the drafter, as ``transformer_layer_config.model_type`` names them (the two
vLLM 0.32 maps a P-EAGLE checkpoint to: ``PeagleLlamaForCausalLM``, ``PeagleQwen3ForCausalLM``).
``qwen3`` is ``llama`` plus a per-head RMSNorm over head_dim on q (``q_norm``) and k (``k_norm``)
before RoPE, as vLLM's ``Qwen3Attention`` computes it."""

DRAFTER_METHODS = ("peagle", "dflash")
"""The drafter kinds peagle trains (``--method``), by speculators' algorithm names: ``peagle`` (P-EAGLE, one
feature, K parallel depths) and ``dflash`` (DFlash, a block attending to the context's features); each is
one entry of :data:`peagle_train.train.kinds.DRAFTER_KINDS`."""


@dataclass(kw_only=True)
class DrafterConfig:
    """Shape of a P-EAGLE drafter; mirrors the verifier's Llama config where it can."""

    hidden_size: int
    """H, width of the drafter's residual stream (the verifier's hidden size)."""
    intermediate_size: int
    """Width of the MLP."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (GQA)."""
    head_dim: int
    """Per-head width."""
    vocab_size: int
    """V, the verifier's vocabulary (rows of embed_tokens, length of t2d)."""
    draft_vocab_size: int
    """D, the drafter's output vocabulary (rows of lm_head, length of d2t)."""
    aux_layer_ids: list[int]
    """Verifier layers concatenated into g, as vLLM aux layer ids: k < L is transformers
    ``hidden_states[k]``; k = L (the verifier's num_hidden_layers) is the last decoder layer's output
    before the final norm (transformers' ``hidden_states[L]`` is after it)."""
    num_hidden_layers: int = 1
    """Drafter decoder layers."""
    rms_norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    rope_theta: float = 10000.0
    """RoPE base (equals ``rope_parameters["rope_theta"]``)."""
    rope_parameters: dict[str, Any] | None = None
    """The verifier's RoPE in transformers' ``rope_parameters`` form (``rope_type``, ``rope_theta`` and
    the type's scaling keys, e.g. llama3's ``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``); None means ``default`` with ``rope_theta``. Types:
    :data:`ROPE_TYPES`; others are refused."""
    max_position_embeddings: int = 8192
    """Longest position the drafter is meant for."""
    mask_token_id: int = 0
    """Token id fed at depth > 0."""
    num_depths: int = 8
    """K, drafted tokens per verifier step."""
    layer_type: str = "llama"
    """The decoder layer, one of :data:`LAYER_TYPES` (a checkpoint written before the field existed is llama)."""
    hidden_act: str = "silu"
    """MLP activation, a transformers ``ACT2FN`` name (Llama: silu; the verifier's, as speculators does)."""
    verifier_name_or_path: str = ""
    """The verifier this drafter was trained for."""
    verifier_architectures: list[str] = field(default_factory=lambda: ["LlamaForCausalLM"])
    """The verifier's architectures (config.json)."""

    def __post_init__(self) -> None:
        if self.layer_type not in LAYER_TYPES:
            raise ValueError(f"drafter layer type {self.layer_type!r} is not supported; supported: {LAYER_TYPES}")
        rope = dict(self.rope_parameters or {"rope_type": "default", "rope_theta": self.rope_theta})
        rope.setdefault("rope_type", rope.pop("type", "default"))
        rope.setdefault("rope_theta", self.rope_theta)
        if rope["rope_type"] not in ROPE_TYPES:
            raise ValueError(f"RoPE type {rope['rope_type']!r} is not supported by the drafter (its frequencies "
                             f"depend on the sequence length or need other positions); supported: {ROPE_TYPES}")
        if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"partial_rotary_factor {rope['partial_rotary_factor']} is not supported by the drafter")
        self.rope_parameters = rope
        self.rope_theta = float(rope["rope_theta"])

    @property
    def num_aux_layers(self) -> int:
        return len(self.aux_layer_ids)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
