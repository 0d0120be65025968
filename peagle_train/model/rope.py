"""The drafter's rotary position embedding: the verifier's RoPE type, scaling and theta.

Legend: E elements, hd head dim.
"""

from __future__ import annotations

import json

import torch

from peagle_train.model.config import DrafterConfig

__all__ = ["rotary_cos_sin", "rope_frequencies", "rope_cos_sin", "rotate_half"]


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama ``default`` RoPE tables for ``position_ids [E]`` -> cos, sin ``[E, head_dim]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device,
                                             dtype=torch.float32) / head_dim))
    freqs = position_ids.float()[:, None] * inv_freq[None, :]  # [E, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [E, hd]
    return emb.cos().to(dtype), emb.sin().to(dtype)


_ROPE_CACHE: dict[str, tuple[torch.Tensor, float]] = {}


def rope_frequencies(cfg: DrafterConfig) -> tuple[torch.Tensor, float]:
    """``inv_freq [head_dim/2] float32`` and the cos/sin scale of ``cfg.rope_parameters``.

    Computed by transformers' own RoPE functions (``modeling_rope_utils.ROPE_INIT_FUNCTIONS``) for a
    Llama config of the drafter's head dim, so the drafter rotates exactly as a transformers Llama
    (and vLLM's Llama drafter) with these parameters; cached per parameter set.
    """
    key = json.dumps([cfg.head_dim, cfg.max_position_embeddings, cfg.rope_parameters], sort_keys=True)
    if key not in _ROPE_CACHE:
        rope = cfg.rope_parameters
        if rope["rope_type"] == "default":
            hd = cfg.head_dim
            inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
            _ROPE_CACHE[key] = (inv, 1.0)
        else:
            from transformers import LlamaConfig
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            lc = LlamaConfig(hidden_size=cfg.head_dim * cfg.num_attention_heads, head_dim=cfg.head_dim,
                             num_attention_heads=cfg.num_attention_heads,
                             max_position_embeddings=cfg.max_position_embeddings, rope_parameters=dict(rope))
            inv, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](lc, torch.device("cpu"))
            _ROPE_CACHE[key] = (inv.float(), float(scale))
    return _ROPE_CACHE[key]


def rope_cos_sin(position_ids: torch.Tensor, cfg: DrafterConfig,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's RoPE tables for ``position_ids [E]`` -> cos, sin ``[E, head_dim]`` of ``dtype``
    (the verifier's RoPE type, scaling and theta: :func:`rope_frequencies`)."""
    inv_freq, scale = rope_frequencies(cfg)
    freqs = position_ids.float()[:, None] * inv_freq.to(position_ids.device)[None, :]  # [E, hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [E, hd]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[..., hd] -> [..., hd]``: ``(x1, x2) -> (-x2, x1)`` over the two halves (Llama's RoPE layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)
