"""The P-EAGLE drafter (docs/design.md §8).

Legend: E drafter elements in one packed row, H hidden size, L aux layers, V verifier vocab,
D draft vocab, nh / nkv attention / key-value heads, hd head dim.

An element ``(a, d)`` (see ``peagle_train.data.cod``) enters the drafter as
- depth 0: token ``x_{a+1}`` and the verifier's aux feature ``g_a`` (``[L*H]``);
- depth > 0: ``mask_token_id`` and the learned ``mask_hidden`` (``[L*H]``),
at rope position ``position_ids[a] + 1 + d``. The first decoder layer attends over
``[input_layernorm(embed) ‖ hidden_norm(fc(g))]`` (2H wide) with ``fc(g)`` as the residual, as in
EAGLE-3 (Li et al., 2025, arXiv:2503.01840) and P-EAGLE; later layers are plain Llama layers. With
``layer_type`` qwen3 every layer's attention also normalises q and k per head (``q_norm``, ``k_norm``)
before RoPE, as vLLM's ``Qwen3Eagle3DecoderLayer``.
Tensor names follow the ``speculators`` 0.9 P-EAGLE model so vLLM loads the checkpoint.

Attention runs the §8 rule through an attention backend (:mod:`peagle_train.model.attention`): the
forward takes an :class:`~peagle_train.model.attention.ElementAttention` built for its elements (or a
dense ``[E, E] bool`` mask, run as the ``sdpa`` backend) and every layer calls its ``attend``.
"""

from __future__ import annotations

import math
from typing import Union

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from peagle_train.model.attention import ElementAttention, as_element_attention
from peagle_train.model.config import DrafterConfig
from peagle_train.model.rope import rope_cos_sin, rotate_half

__all__ = ["PEagleDrafter", "copy_verifier_rows", "register_vocab_maps", "DrafterCache", "KVCache", "RMSNorm", "AttentionMask"]

AttentionMask = Union[ElementAttention, torch.Tensor]
"""The §8 rule as the drafter takes it: an attention backend built for the elements, or a dense
``[E, E] bool`` mask (run as the ``sdpa`` backend)."""


class RMSNorm(nn.Module):
    """Llama RMSNorm; computes in float32."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    """The layer's attention: Llama's, or (``layer_type`` qwen3) Qwen3's, which RMS-normalises each
    head of q and k over head_dim (``q_norm``, ``k_norm``: weights ``[hd]``, eps ``rms_norm_eps``)
    before RoPE, as vLLM's ``Qwen3Attention`` (no biases: peagle trains none)."""

    def __init__(self, cfg: DrafterConfig, in_width: int):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_width, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(in_width, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(in_width, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        if cfg.layer_type == "qwen3":
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        self.qk_norm = cfg.layer_type == "qwen3"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: ElementAttention, rows: torch.Tensor | None = None,
                kv: KVCache | None = None) -> torch.Tensor:
        """``x [E, in]`` -> ``[E, H]``, or ``[R, H]`` for the query ``rows [R]`` only (keys: all E).

        ``attention``: the backend of these elements. With ``kv`` the N cached keys come first
        (a :class:`~peagle_train.model.attention.DenseAttention` of an ``[E, N + E]`` mask).
        """
        E = x.shape[0]
        xq, cq, sq = (x, cos, sin) if rows is None else (x[rows], cos[rows], sin[rows])
        R = xq.shape[0]
        q = self.q_proj(xq).view(R, self.nh, self.hd).transpose(0, 1)  # [nh, R, hd]
        k = self.k_proj(x).view(E, self.nkv, self.hd).transpose(0, 1)  # [nkv, E, hd]
        v = self.v_proj(x).view(E, self.nkv, self.hd).transpose(0, 1)  # [nkv, E, hd]
        if self.qk_norm:  # per head, over hd, before RoPE (qwen3)
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cq + rotate_half(q) * sq
        k = k * cos + rotate_half(k) * sin
        if kv is not None:
            k, v = kv.extend(k, v)  # [nkv, N+E, hd]
        out = attention.attend(q, k, v, rows)  # [nh, R, hd]
        return self.o_proj(out.transpose(0, 1).reshape(R, self.nh * self.hd))  # [R, H]


class KVCache:
    """One attention layer's cached keys and values, ``[nkv, N, hd]`` each (after RoPE).

    :meth:`extend` puts the cached ones before a forward's new ones and keeps the first ``keep``
    new ones (set by :meth:`DrafterCache.start`) for the next forward.
    """

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.keep = 0

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v [nkv, E, hd]`` -> ``[nkv, N + E, hd]`` (cached first); caches ``N + keep`` of them."""
        if self.keys is not None:
            k, v = torch.cat([self.keys, k], dim=1), torch.cat([self.values, v], dim=1)
        n = (0 if self.keys is None else self.keys.shape[1]) + self.keep
        self.keys, self.values = k[:, :n], v[:, :n]
        return k, v


class DrafterCache:
    """The drafter's keys and values of the depth-0 elements seen so far, every layer (litgpt's KV
    cache for :meth:`PEagleDrafter.forward`).

    Attributes:
        layers: one :class:`KVCache` per decoder layer.
        length: N, the elements cached.
    """

    def __init__(self) -> None:
        self.layers: list[KVCache] = []
        self.length = 0

    def start(self, is_mask: torch.Tensor, num_layers: int) -> None:
        """Before a forward over elements ``is_mask [E] bool``: its depth-0 elements will be cached.

        Raises:
            ValueError: a depth-0 element after a depth > 0 one (only a prefix can be kept).
        """
        keep = int((~is_mask).sum())
        if bool(is_mask[:keep].any()):
            raise ValueError("a drafter cache keeps the depth-0 elements, which must come first")
        while len(self.layers) < num_layers:
            self.layers.append(KVCache())
        for layer in self.layers:
            layer.keep = keep
        self.length += keep


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = F.silu if cfg.hidden_act == "silu" else _activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _activation(name: str):
    """transformers' activation ``name`` (what a Llama layer with ``hidden_act = name`` computes)."""
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class DecoderLayer(nn.Module):
    """A Llama (or qwen3: :class:`Attention`) decoder layer; the first one (``first=True``) reads
    ``[embed ‖ hidden]``."""

    def __init__(self, cfg: DrafterConfig, first: bool):
        super().__init__()
        H = cfg.hidden_size
        self.first = first
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * H if first else H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: ElementAttention, embeds: torch.Tensor | None = None,
                rows: torch.Tensor | None = None, kv: KVCache | None = None) -> torch.Tensor:
        """``[E, H]`` -> ``[E, H]``, or ``[R, H]`` for ``rows [R]`` only (the others serve as keys);
        ``kv``: this layer's cache (see :meth:`PEagleDrafter.forward`)."""
        residual = hidden if rows is None else hidden[rows]
        if self.first:
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [E, 2H]
        else:
            x = self.input_layernorm(hidden)
        hidden = residual + self.self_attn(x, cos, sin, attention, rows, kv)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def register_vocab_maps(model: nn.Module, vocab_size: int, draft_vocab_size: int) -> None:
    """Register ``d2t [D] int64`` (zeros) and ``t2d [V] bool`` on ``model`` (any drafter kind): saved
    (persistent) only for a reduced draft vocab, as speculators 0.9's DraftVocabMixin, which has no d2t/t2d at all
    when D == V; kept as identity maps either way (``t2d`` all True)."""
    reduced = draft_vocab_size != vocab_size
    model.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long), persistent=reduced)
    model.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool) if reduced
                          else torch.ones(vocab_size, dtype=torch.bool), persistent=reduced)


def copy_verifier_rows(model: nn.Module, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                       d2t: torch.Tensor | None = None, freeze_lm_head: bool = True) -> None:
    """Copy the verifier's embeddings ``[V, H]`` into ``model.embed_tokens`` and its lm_head rows of the draft vocab
    into ``model.lm_head`` (any drafter kind with ``d2t`` / ``t2d`` buffers and ``draft_ids``); ``d2t [D] int64``
    offsets, None: the draft vocab is the verifier's."""
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embed_weight)
        if d2t is not None:
            model.d2t.copy_(d2t)
            model.t2d.zero_()
            model.t2d[model.draft_ids] = True
        model.lm_head.weight.copy_(lm_head_weight[model.draft_ids])
    model.lm_head.weight.requires_grad_(not freeze_lm_head)


class PEagleDrafter(nn.Module):
    """P-EAGLE drafter: parallel drafting of K tokens from one verifier feature.

    Parameters (names as saved in ``model.safetensors``): ``embed_tokens [V, H]``,
    ``fc [H, L*H]``, ``mask_hidden [1, 1, L*H]``, ``layers.N.*`` (qwen3 also
    ``layers.N.self_attn.q_norm.weight``, ``k_norm.weight [hd]``), ``norm [H]``, ``lm_head [D, H]``,
    buffers ``d2t [D] int64`` (``target_id = draft_id + d2t[draft_id]``) and ``t2d [V] bool``, in the
    state dict only when ``draft_vocab_size < vocab_size`` (with the full vocab both are identities).
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        H, LH = cfg.hidden_size, cfg.num_aux_layers * cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.fc = nn.Linear(LH, H, bias=False)
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, LH))
        self.layers = nn.ModuleList([DecoderLayer(cfg, first=(i == 0)) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        register_vocab_maps(self, cfg.vocab_size, cfg.draft_vocab_size)
        self.gradient_checkpointing = False
        """Recompute each decoder layer's activations in the backward instead of keeping them
        (``--gradient-checkpointing``, set by the trainer; not saved with the weights): see :meth:`forward`."""
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Normal(0, std) init for linear layers; mask_hidden small random."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)
        nn.init.normal_(self.mask_hidden, std=std)

    @property
    def draft_ids(self) -> torch.Tensor:
        """Verifier token id of every draft id: ``[D] int64``."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, is_mask: torch.Tensor,
                position_ids: torch.Tensor, attn_mask: AttentionMask,
                output_rows: torch.Tensor | None = None, cache: DrafterCache | None = None) -> torch.Tensor:
        """Run the drafter over E elements of one row, after the N elements of ``cache`` if given.

        Args:
            input_ids: ``[E] int64``; the token ``x_{a+1}`` at depth 0 (ignored where ``is_mask``).
            aux_hidden: ``[E, L*H]`` float/bf16; ``g_a`` at depth 0 (ignored where ``is_mask``); or
                ``[E0, L*H]``, the rows of the E0 < E depth-0 elements only, in order.
            is_mask: ``[E] bool``; True for depth > 0 elements.
            position_ids: ``[E] int64``; rope position of each element (``pos[a] + 1 + d``).
            attn_mask: the attention backend of these elements
                (:func:`peagle_train.model.attention.element_attention`), or an ``[E, E] bool`` mask, True
                where query row may attend key column (the ``sdpa`` backend). Every row must allow
                at least itself.
            output_rows: ``[R] int64`` or None; the elements whose output is wanted (training asks
                for the weighted ones). The last layer then runs its queries, MLP and norm on
                these rows only; every element still serves as a key.
            cache: the keys and values of N earlier depth-0 elements (speculative decoding): the E
                new elements attend to them as the first N keys (``attn_mask`` is then ``[E, N + E]
                bool``), and the new depth-0 elements, which must come first, join the cache.
                Their keys never change once computed: a depth-0 element sees only depth-0
                elements of anchors up to its own (§8). None: no cache (training, evaluation).

        Returns:
            ``[E, H]`` (``[R, H]`` with ``output_rows``) final-normed hidden states; :meth:`logits`
            maps them to draft-vocab logits.

        With :attr:`gradient_checkpointing` (and autograd recording, no ``cache``) each decoder layer runs
        under non-reentrant ``torch.utils.checkpoint``: only its inputs (``[E, H]`` hidden, the first
        layer's ``[E, H]`` embeddings, the ``[E, hd]`` RoPE tables) are kept, and its activations are
        recomputed in the backward, one layer at a time (one more forward of every layer per step).
        """
        cfg = self.config
        ids = torch.where(is_mask, torch.full_like(input_ids, cfg.mask_token_id), input_ids)
        embeds = self.embed_tokens(ids)  # [E, H]
        hidden = self._fc_inputs(aux_hidden, is_mask)  # [E, H]
        cos, sin = rope_cos_sin(position_ids, cfg, hidden.dtype)
        attention = as_element_attention(attn_mask)
        if cache is not None:
            if not attention.takes_cached_keys:
                raise ValueError(f"a drafter cache needs a backend that takes cached keys (a dense [E, N + E] "
                                 f"mask), not {type(attention).__name__}")
            cache.start(is_mask, len(self.layers))
        last = len(self.layers) - 1
        recompute = self.gradient_checkpointing and cache is None and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            args = (hidden, cos, sin, attention, embeds if i == 0 else None, output_rows if i == last else None,
                    cache.layers[i] if cache is not None else None)
            hidden = (torch.utils.checkpoint.checkpoint(layer, *args, use_reentrant=False) if recompute
                      else layer(*args))
        return self.norm(hidden)

    def _fc_inputs(self, aux_hidden: torch.Tensor, is_mask: torch.Tensor) -> torch.Tensor:
        """``fc(g_a)`` at depth 0 and ``fc(mask_hidden)`` elsewhere: ``[E, L*H] -> [E, H]``.

        ``fc`` has no bias, so it runs on the depth-0 rows and on ``mask_hidden`` once instead of on
        all E rows (most elements are at depth > 0 when K is large).
        """
        dtype = self.fc.weight.dtype
        real = torch.nonzero(~is_mask).squeeze(1)  # [E0]
        masked = self.fc(self.mask_hidden.view(1, -1).to(dtype))  # [1, H]
        out = masked.expand(is_mask.shape[0], -1)  # [E, H]
        if real.numel() == 0:
            return out.contiguous()
        g = aux_hidden if aux_hidden.shape[0] == real.numel() != is_mask.shape[0] else aux_hidden[real]  # [E0, L*H]
        return out.index_copy(0, real, self.fc(g.to(dtype)))  # [E, H]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[E, H] -> [E, D]`` draft-vocab logits (materialise in chunks for large E)."""
        return self.lm_head(hidden)

    def init_from_verifier(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                           d2t: torch.Tensor | None = None, freeze_lm_head: bool = True) -> None:
        """Copy the verifier's embeddings ``[V, H]`` and its lm_head rows ``[V, H]`` of the draft vocab.

        Args:
            d2t: ``[D] int64`` offsets; None means the draft vocab is the verifier's.
        """
        copy_verifier_rows(self, embed_weight, lm_head_weight, d2t, freeze_lm_head)

    def num_parameters(self, trainable_only: bool = False) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    @staticmethod
    def init_std(hidden_size: int) -> float:
        return 1.0 / math.sqrt(hidden_size)
