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

from peagle_train.data.anchors import AnchorBlocks, block_inputs
from peagle_train.model.config import DrafterConfig
from peagle_train.model.drafter import MLP, RMSNorm, copy_verifier_rows, register_vocab_maps
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
        register_vocab_maps(self, cfg.vocab_size, cfg.draft_vocab_size)
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

    @torch.no_grad()
    def draft(self, context_aux: torch.Tensor, anchor_id: int, k: int, num_drafts: int | None = None) -> torch.Tensor:
        """One decoding step's drafts: the block anchored at the newest token ``anchor_id`` (position T) against
        the context features ``context_aux [T, L*H]`` of rows ``0..T-1`` (positions ``0..T-1``, T >= 1).

        The block holds the anchor and ``num_drafts`` mask tokens (default ``block_size - 1``), as vLLM's DFlash
        proposer runs one of ``num_speculative_tokens + 1`` tokens; the first ``k <= num_drafts`` slots are
        returned (a step near ``max_new_tokens`` keeps fewer drafts of the same block).

        Returns:
            ``[k, D]`` draft-vocab logits of slots ``1..k``.
        """
        n_drafts = self.config.block_size - 1 if num_drafts is None else int(num_drafts)
        B, T = n_drafts + 1, context_aux.shape[0]
        assert 1 <= k <= n_drafts <= self.config.block_size - 1 and T >= 1, (k, n_drafts, T)
        device = self.d2t.device
        ids = torch.full((B,), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[0] = int(anchor_id)
        mask = torch.ones(B, T + B, dtype=torch.bool, device=device)  # every context row, the whole block
        hidden = self(context_aux.to(device), torch.arange(T, device=device), ids,
                      torch.arange(T, T + B, device=device), mask)  # [B, H]
        return self.logits(hidden[1:k + 1])

    @torch.no_grad()
    def block_predictions(self, block, start: int, n: int, num_depths: int, chunk_anchors: int = 256) -> torch.Tensor:
        """The argmax drafts of the block anchored at every row of one stored segment ``[start, start+n)``, in
        the layout of :func:`peagle_train.evaluate.offline.segment_predictions`: ``pred[t-1, d]`` is slot
        ``d + 1`` of the block anchored at local row ``t`` (newest token ``x_t``, context the rows before it),
        the draft of ``x_{t+d+1}`` at the decoding step whose newest token is ``x_t``. A block holds the anchor
        and K mask tokens (:meth:`draft` with ``num_drafts = K``: vLLM's block at ``num_speculative_tokens`` K).

        Args:
            block: ``input_ids, position_ids [T] int64``, ``aux_hidden [T, L, H]`` or ``[T, L*H]``.
            start, n: the segment's first row and length.
            num_depths: K <= block_size - 1 drafts per step (blocks of K + 1).
            chunk_anchors: anchors per drafter pass (a pass holds ``chunk * (K + 1)`` queries against the n rows).

        Returns:
            ``[max(n - 2, 0), K] int64`` draft-vocab ids; -1 where the draft's target is past the segment.
        """
        K, B = num_depths, num_depths + 1
        assert 1 <= K <= self.config.block_size - 1, (K, self.config.block_size)
        A = max(n - 2, 0)
        pred = torch.full((A, K), -1, dtype=torch.long)
        exists = (torch.arange(A)[:, None] + torch.arange(K)[None, :] + 2) <= n - 1  # [A, K]
        device, dtype = self.d2t.device, self.fc.weight.dtype
        aux = block.aux_hidden.reshape(block.aux_hidden.shape[0], -1)[start:start + n].to(device, dtype)  # [n, L*H]
        ids = block.input_ids[start:start + n].to(device)
        pos = block.position_ids[start:start + n].to(device)
        cu, ones = torch.tensor([0, n], device=device), torch.ones(n, device=device)
        for c0 in range(0, A, chunk_anchors):
            anchors = torch.arange(c0, min(c0 + chunk_anchors, A)) + 1  # [N] local rows t = a + 1
            inp = block_inputs(AnchorBlocks(anchors, B), ids, pos, cu, ones, self.config.mask_token_id)
            hidden = self(aux, pos, inp.input_ids, inp.position_ids, inp.mask).unflatten(0, (-1, B))  # [N, B, H]
            pred[anchors - 1] = self.logits(hidden[:, 1:].flatten(0, 1)).argmax(-1).view(-1, K).cpu()  # [N, K]
        return torch.where(exists, pred, torch.full_like(pred, -1))

    def init_from_verifier(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                           d2t: torch.Tensor | None = None, freeze_lm_head: bool = True) -> None:
        """Copy the verifier's embeddings ``[V, H]`` and its lm_head rows ``[V, H]`` of the draft vocab
        (``d2t [D] int64`` offsets; None: the verifier's vocab)."""
        copy_verifier_rows(self, embed_weight, lm_head_weight, d2t, freeze_lm_head)
