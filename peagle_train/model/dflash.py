"""The DFlash drafter (Chen et al., "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv:2602.06036;
docs/design.md §8b), as speculators 0.9 trains it and vLLM 0.32 serves it (``qwen3_dflash.py``).

Legend: T context rows (a packed row of the store), Q query tokens (N blocks of B), H hidden size, L aux
layers, D draft vocab, nh / nkv attention / key-value heads, hd head dim.

A block of B tokens (the newest accepted token, the *anchor*, then B-1 ``mask_token_id`` tokens, at rope
positions ``pos(anchor) + 0..B-1``) passes once through Qwen3-style decoder layers. Each layer's queries are
the block's tokens; its keys and values are the context's features ``c = hidden_norm(fc(g))`` (``g`` the
verifier's concatenated aux features, ``[L*H]``) of every row before the anchor in its segment, followed by
the block's own tokens, attended without a causal mask inside the block. The context's keys and values skip
``input_layernorm`` (vLLM's ``precompute_and_store_context_kv``); both get ``k_norm`` and RoPE at their own
positions. Slot j >= 1 of the block drafts the token at ``pos(anchor) + j``: B-1 drafts per verifier step.

Tensor names are those vLLM's ``DFlashQwen3ForCausalLM.load_weights`` reads (and speculators'
``DFlashDraftModel`` holds): ``embed_tokens``, ``fc``, ``hidden_norm``, ``layers.N.{input_layernorm,
self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}``,
``norm``, ``lm_head``, and with a reduced draft vocab ``d2t`` / ``t2d``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from peagle_train.model.config import DrafterConfig
from peagle_train.model.drafter import MLP, RMSNorm
from peagle_train.model.rope import rope_cos_sin, rotate_half

__all__ = ["DFlashConfig", "DFlashDrafter", "DFLASH_BLOCK_SIZE"]

DFLASH_BLOCK_SIZE = 8
"""B of a DFlash drafter unless given (``--block-size``): speculators' default ``block_size``."""


@dataclass(kw_only=True)
class DFlashConfig(DrafterConfig):
    """Shape of a DFlash drafter: a :class:`DrafterConfig` (the verifier's shapes, RoPE, aux layers, vocab
    maps, mask token) with its block size; its layers are always ``qwen3`` (vLLM's only DFlash layer) and
    ``num_depths`` is the drafts per step, ``block_size - 1``."""

    block_size: int = DFLASH_BLOCK_SIZE
    """B, tokens in a block: the anchor and B-1 mask tokens (B-1 drafts per verifier step)."""

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"a DFlash block holds the anchor and at least one mask token: block_size >= 2, "
                             f"got {self.block_size}")
        self.layer_type = "qwen3"
        self.num_depths = self.block_size - 1
        super().__post_init__()


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys and values are the context's features followed by the block's tokens."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor, rope: tuple[torch.Tensor, ...],
                mask: torch.Tensor) -> torch.Tensor:
        """``x [Q, H]`` (normed block), ``context [T, H]`` (``hidden_norm(fc(g))``), ``rope`` = (block cos,
        block sin ``[Q, hd]``, context cos, context sin ``[T, hd]``), ``mask [Q, T + Q] bool`` -> ``[Q, H]``."""
        Q, T = x.shape[0], context.shape[0]
        qc, qs, cc, cs = rope
        q = self.q_norm(self.q_proj(x).view(Q, self.nh, self.hd))  # [Q, nh, hd]
        kv_in = torch.cat([context, x], dim=0)  # [T+Q, H]
        k = self.k_norm(self.k_proj(kv_in).view(T + Q, self.nkv, self.hd))  # [T+Q, nkv, hd]
        v = self.v_proj(kv_in).view(T + Q, self.nkv, self.hd)
        cos, sin = torch.cat([cc, qc], dim=0)[:, None], torch.cat([cs, qs], dim=0)[:, None]  # [T+Q, 1, hd]
        q = q * qc[:, None] + rotate_half(q) * qs[:, None]
        k = k * cos + rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                             attn_mask=mask[None, None], enable_gqa=self.nh != self.nkv)  # [1, nh, Q, hd]
        return self.o_proj(out[0].transpose(0, 1).reshape(Q, self.nh * self.hd))


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer over the block, reading the context through :class:`DFlashAttention`."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, hidden: torch.Tensor, context: torch.Tensor, rope: tuple[torch.Tensor, ...],
                mask: torch.Tensor) -> torch.Tensor:
        """``[Q, H] -> [Q, H]``."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, rope, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDrafter(nn.Module):
    """DFlash drafter: B-1 drafts per pass from the context's aux features and the newest token.

    Parameters (names as saved): ``embed_tokens [V, H]``, ``fc [H, L*H]``, ``hidden_norm [H]``, ``layers.N.*``,
    ``norm [H]``, ``lm_head [D, H]``; buffers ``d2t [D] int64`` and ``t2d [V] bool``, in the state dict only
    when ``draft_vocab_size < vocab_size`` (as :class:`~peagle_train.model.drafter.PEagleDrafter`).
    """

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.config = cfg
        H, LH = cfg.hidden_size, cfg.num_aux_layers * cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.fc = nn.Linear(LH, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        reduced = cfg.draft_vocab_size != cfg.vocab_size
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long), persistent=reduced)
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool) if reduced
                             else torch.ones(cfg.vocab_size, dtype=torch.bool), persistent=reduced)
        self.gradient_checkpointing = False
        """Recompute each layer's activations in the backward (``--gradient-checkpointing``; not saved)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    @property
    def draft_ids(self) -> torch.Tensor:
        """Verifier token id of every draft id: ``[D] int64``."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def context(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """``[T, L*H] -> [T, H]``: ``hidden_norm(fc(g))``, what every layer's context keys and values read."""
        return self.hidden_norm(self.fc(aux_hidden.to(self.fc.weight.dtype)))

    def forward(self, aux_hidden: torch.Tensor, context_positions: torch.Tensor, block_ids: torch.Tensor,
                block_positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Run the drafter over Q block tokens against T context rows.

        Args:
            aux_hidden: ``[T, L*H]`` float/bf16, the verifier's aux features of the context rows.
            context_positions: ``[T] int64`` rope positions of the context rows.
            block_ids: ``[Q] int64`` the blocks' tokens (anchor, then ``mask_token_id``).
            block_positions: ``[Q] int64`` their rope positions.
            mask: ``[Q, T + Q] bool``, True where a query may attend a key (context rows first, then the
                block tokens); every row must allow at least one key.

        Returns:
            ``[Q, H]`` final-normed hidden states; :meth:`logits` maps them to draft-vocab logits.
        """
        cfg = self.config
        context = self.context(aux_hidden)  # [T, H]
        hidden = self.embed_tokens(block_ids).to(context.dtype)  # [Q, H]
        rope = (*rope_cos_sin(block_positions, cfg, hidden.dtype), *rope_cos_sin(context_positions, cfg, hidden.dtype))
        recompute = self.gradient_checkpointing and torch.is_grad_enabled()
        for layer in self.layers:
            hidden = (torch.utils.checkpoint.checkpoint(layer, hidden, context, rope, mask, use_reentrant=False)
                      if recompute else layer(hidden, context, rope, mask))
        return self.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[Q, H] -> [Q, D]`` draft-vocab logits."""
        return self.lm_head(hidden)

    def init_from_verifier(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                           d2t: torch.Tensor | None = None, freeze_lm_head: bool = True) -> None:
        """Copy the verifier's embeddings ``[V, H]`` and its lm_head rows ``[V, H]`` of the draft vocab
        (``d2t [D] int64`` offsets; None: the verifier's vocab)."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed_weight)
            if d2t is not None:
                self.d2t.copy_(d2t)
                self.t2d.zero_()
                self.t2d[self.draft_ids] = True
            self.lm_head.weight.copy_(lm_head_weight[self.draft_ids])
        self.lm_head.weight.requires_grad_(not freeze_lm_head)
