"""The verifier's transformers forward over packed blocks (docs/design.md §4): hidden states of chosen layers.

Also the facts of a transformers verifier every engine reads: its language model
(:func:`language_model`), its layers' attention types (:func:`layer_types`), whether it packs
(:func:`check_packable`) and the default aux layers (:func:`default_layers`).

Legend: T tokens in a block, L aux layers, H hidden size, S segments.

- Attention stays inside each segment, with every layer's own attention rule (full, sliding window,
  chunked, sinks, soft-capping): position ids restart in every segment and the model builds its
  per-layer-type masks from them (transformers' packed sequences), or FlashAttention's varlen kernel
  gets ``cu_seqlens``; so a segment's hidden states equal those of the segment run alone.
- Hybrid verifiers (:data:`HYBRID_MODEL_TYPES`: gated DeltaNet or Mamba-2 layers between attention
  layers), whose state would flow from one packed segment into the next, never pack: each segment
  is its own row of a right-padded batch (:func:`segments_padded`), so its state starts from zero and
  the padding after its last token cannot change it (causal). Other models with recurrent,
  state-space or linear-attention layers are refused before their weights load (:func:`check_packable`).
- A multimodal wrapper runs its language model (:func:`language_model`).
- Only the decoder stack runs (no lm_head): full-vocabulary logits are never computed, and
  forward hooks keep only the chosen layers instead of all ``output_hidden_states``.
- Layer ``l`` is what vLLM's EAGLE-3 capture feeds a drafter (``hidden_states + residual`` after
  decoder layer ``l-1``): 0 is the embedding output, ``l`` in 1..L the output of decoder layer ``l-1``,
  so ``L`` is the last decoder layer's output **before** the final norm (Hugging Face's
  ``output_hidden_states[l]`` for ``l < L``; its ``[L]`` is normed and is not used). The final,
  post-norm state is returned separately (the KL target source). Store attribute
  ``layer_convention: "vllm_aux"`` (:data:`stores.features.feature_store.LAYER_CONVENTION`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from stores.errors import InputError

__all__ = ["default_layers", "final_norm", "language_model", "layer_types", "packs_like_transformers", "check_packable",
           "hybrid_kind", "HYBRID_MODEL_TYPES", "padded_batches", "segment_masks", "verifier_features",
           "segments_alone", "segments_padded"]


def default_layers(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's default aux layers ``[2, L//2, L-3]`` (Qwen3-8B, L=36: ``[2, 18, 33]``)."""
    L = num_hidden_layers
    return sorted({min(2, L), L // 2, max(L - 3, 0)})


def language_model(verifier: torch.nn.Module) -> torch.nn.Module:
    """The text decoder stack of ``verifier`` (``embed_tokens``, ``layers``, ``norm``).

    For a causal LM its ``.model``; for a multimodal wrapper (``Gemma3ForConditionalGeneration``,
    ``Mistral3ForConditionalGeneration``, ...) its language model, which text-only data runs through.
    """
    getter = getattr(verifier, "get_decoder", None)
    candidates = [getter() if callable(getter) else None, getattr(verifier, verifier.base_model_prefix, None),
                  getattr(verifier, "model", None)]
    for decoder in candidates:
        inner = getattr(decoder, "language_model", None)  # a multimodal model's text stack
        for module in (inner, decoder):
            if module is not None and module is not verifier and hasattr(module, "layers"):
                return module
    raise InputError(f"{type(verifier).__name__}: no decoder stack with .layers found; peagle extracts "
                     "from transformers decoder models", field="--verifier")




FINAL_NORM_NAMES = ("norm", "norm_f")
"""Attribute names of a decoder stack's final norm: ``norm`` (most models), ``norm_f`` (Nemotron-H)."""


def final_norm(decoder: torch.nn.Module) -> torch.nn.Module | None:
    """The final norm module of a decoder stack (:data:`FINAL_NORM_NAMES`), None if it has none."""
    for name in FINAL_NORM_NAMES:
        module = getattr(decoder, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    return None


@contextmanager
def _capture_layers(decoder: torch.nn.Module, layers: list[int]) -> Iterator[dict[int, torch.Tensor]]:
    """Hooks that keep aux layer ``l`` of ``layers``, each ``[1, T, H]`` in the verifier's dtype.

    Layer 0 is the input of the first decoder layer (the embeddings after any model-specific
    scaling, e.g. Gemma's ``sqrt(H)``), ``l ≥ 1`` the output of decoder layer ``l - 1``, for
    ``l = L`` too: the last layer's output before the final norm, as vLLM captures it
    (``hidden_states + residual``), not Hugging Face's normed ``output_hidden_states[L]``.
    """
    captured: dict[int, torch.Tensor] = {}
    blocks = decoder.layers
    hooks = []

    def first_input(module, args, kwargs):
        captured[0] = args[0] if args else kwargs["hidden_states"]

    for l in layers:
        if l == 0:
            hooks.append(blocks[0].register_forward_pre_hook(first_input, with_kwargs=True))
        elif l <= len(blocks):
            hooks.append(blocks[l - 1].register_forward_hook(
                lambda m, i, o, l=l: captured.__setitem__(l, o[0] if isinstance(o, tuple) else o)))
    try:
        yield captured
    finally:
        for h in hooks:
            h.remove()


def packs_like_transformers(position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> bool:
    """Whether transformers' packed-sequence detection finds exactly the segments of ``cu_seqlens``.

    transformers (``masking_utils.find_packed_sequence_indices``) starts a new sequence wherever the
    position id does not grow by 1; the block's segments must be those: positions ``+1`` inside every
    segment, a jump at every boundary (``pack`` writes ``0..n-1`` per segment, which always holds).
    """
    pos = position_ids.reshape(-1).cpu()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).cpu()
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # [T]
    diff = torch.diff(pos, prepend=pos[:1] - 1)
    return torch.equal((diff != 1).cumsum(0), seg)


#: layer types extraction packs exactly (transformers ``config.layer_types`` names)
PACKABLE_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")

#: model types with recurrent, state-space or linear-attention layers: their state would flow from
#: one packed segment into the next (docs/design.md §7); refused unless in :data:`HYBRID_MODEL_TYPES`
RECURRENT_MODEL_TYPES = {
    "mamba": "mamba", "mamba2": "mamba2", "falcon_mamba": "mamba", "falcon_h1": "mamba (hybrid)",
    "jamba": "mamba (hybrid)", "bamba": "mamba2 (hybrid)", "zamba": "mamba (hybrid)",
    "zamba2": "mamba2 (hybrid)", "rwkv": "rwkv recurrence", "recurrent_gemma": "recurrent (RG-LRU)",
    "xlstm": "xLSTM recurrence", "lfm2": "short convolution", "lfm2_moe": "short convolution",
    "minimax": "linear_attention (lightning)", "plamo2": "mamba (hybrid)",
}

#: hybrid model types (of the text config) that extraction runs one segment per batch row, the state of
#: every recurrent layer from zero (:func:`segments_padded`): each is checked against the segment run alone
#: on a tiny model (tests/families.py ``HYBRID``, tests/peagle_data/extract/test_families.py)
HYBRID_MODEL_TYPES = {
    "qwen3_5_text": "linear_attention (gated DeltaNet)", "qwen3_5_moe_text": "linear_attention (gated DeltaNet)",
    "qwen3_next": "linear_attention (gated DeltaNet)",
    "olmo_hybrid": "linear_attention (gated DeltaNet)", "nemotron_h": "mamba2 (hybrid)",
    "granitemoehybrid": "mamba2 (hybrid)",
}


def hybrid_kind(config) -> str | None:
    """The recurrent layer kind of a verified hybrid verifier (:data:`HYBRID_MODEL_TYPES`), else None.

    ``config`` may be a multimodal wrapper's (``Qwen3_5Config``): its text config is read.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return HYBRID_MODEL_TYPES.get(getattr(text, "model_type", ""))


def check_packable(config) -> None:
    """Refuse verifiers whose layers carry state across tokens other than attention, unless a verified hybrid.

    Reads only the config (call it before the weights load). ``config`` may be a multimodal
    wrapper's; its text config is checked. A hybrid of :data:`HYBRID_MODEL_TYPES` passes: it is
    extracted one segment per sequence (:func:`segments_padded`), never packed.

    Raises:
        InputError: naming the model type and layer type (a recurrent, state-space, linear-attention
            or convolution layer, or a ``layer_types`` entry that is not full, sliding or chunked
            attention) of a model that is not a verified hybrid.
    """
    if hybrid_kind(config) is not None:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for c in {id(config): config, id(text): text}.values():
        kind = RECURRENT_MODEL_TYPES.get(getattr(c, "model_type", ""))
        kinds = [t for t in (getattr(c, "layer_types", None) or []) if t not in PACKABLE_LAYER_TYPES]
        kinds += [t for t in (getattr(c, "layers_block_type", None) or []) if t not in ("attention",)]
        if kind or kinds:
            raise InputError(
                f"verifier model type {c.model_type!r} has {kind or sorted(set(kinds))[0]!r} layers, whose state "
                "would flow from one packed segment into the next: peagle cannot extract exact features for "
                "it (supported: models whose layers are all full, sliding-window or chunked attention, and the "
                f"hybrids it runs one segment per sequence and has verified: {', '.join(sorted(HYBRID_MODEL_TYPES))})",
                field="--verifier")


def layer_types(decoder) -> list[str]:
    """The attention type of each decoder layer, as the model itself chooses its masks.

    ``config.layer_types`` when the config has it; otherwise every layer is sliding when the config
    sets ``sliding_window`` (Mistral, Phi-3, Qwen3-MoE build one sliding mask for all layers), else full.
    """
    cfg, n = decoder.config, len(decoder.layers)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if getattr(cfg, "sliding_window", None) else "full_attention"] * n
    if len(types) < n:
        raise InputError(f"config.layer_types has {len(types)} entries for {n} decoder layers", field="--verifier")
    for i, t in enumerate(types[:n]):
        attn = getattr(decoder.layers[i], "self_attn", None)
        window = getattr(attn, "sliding_window", "absent")
        expect = getattr(cfg, "sliding_window", None) if t == "sliding_attention" else None
        if window != "absent" and window != expect:
            raise InputError(f"decoder layer {i} is {t!r} by the config but its attention has sliding_window "
                             f"{window}: peagle cannot tell which mask it uses", field="--verifier")
    return list(types[:n])


def segment_masks(decoder, position_ids: torch.Tensor, types: set[str]) -> dict[str, Any]:
    """The model's own attention mask of each layer type for one packed block.

    transformers' mask functions (``create_causal_mask``, ``create_sliding_window_causal_mask``,
    ``create_chunked_causal_mask``) with the block's ``position_ids [T]``, from which they take the
    packed segments (block-diagonal ∧ causal ∧ window/chunk, in the model's attention backend's form:
    bool for SDPA, additive float for eager). Check :func:`packs_like_transformers` first.
    """
    from transformers import masking_utils as mu

    param = next(decoder.parameters())
    pos = position_ids.reshape(1, -1).to(param.device)
    dummy = torch.empty(1, pos.shape[1], 0, dtype=param.dtype, device=param.device)  # shape, dtype, device only
    makers = {"full_attention": mu.create_causal_mask, "sliding_attention": mu.create_sliding_window_causal_mask,
              "chunked_attention": mu.create_chunked_causal_mask}
    # (config, inputs_embeds, attention_mask, cache) by position: transformers 5.19 names the cache
    # argument past_key_values, later releases cache
    return {t: makers[t](decoder.config, dummy, None, None, position_ids=pos) for t in types}


@contextmanager
def _layer_masks(decoder, masks: dict[str, Any], types: list[str]) -> Iterator[None]:
    """Give decoder layer ``i`` the mask of its type ``types[i]`` whatever mask the model built."""
    def hook(i):
        def set_mask(module, args, kwargs):
            if "attention_mask" not in kwargs:
                raise InputError(f"{type(module).__name__} does not take attention_mask as a keyword: peagle cannot "
                                 "give each layer its packed-segment mask", field="--verifier")
            kwargs["attention_mask"] = masks[types[i]]
            return args, kwargs
        return set_mask

    hooks = [layer.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(decoder.layers)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def verifier_features(base_model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      cu_seqlens: torch.Tensor, layers: list[int],
                      to_host: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One block through the verifier's decoder stack (no lm_head), each segment as if run alone.

    Args:
        base_model: the text decoder stack (:func:`language_model`) with ``layers``.
        input_ids: ``[T] int64``; position_ids: ``[T] int64`` (restart per segment, any start);
        cu_seqlens: ``[S+1] int64``; layers: aux layer ids in ``0..L`` (module doc);
        to_host: return CPU tensors (else tensors on the verifier's device).

    Every layer keeps its own attention rule (docs/design.md §7). With ``flash_attention_2`` the
    segments go to FlashAttention's varlen kernel as ``cu_seq_lens`` (each layer passes its own
    window and soft-cap). With SDPA/eager each layer gets the model's own mask of its layer type
    built for the packed segments (:func:`segment_masks`: block-diagonal ∧ causal ∧ window). When the
    positions would not tell the segments apart (:func:`packs_like_transformers`), each segment runs
    alone (:func:`segments_alone`). A hybrid verifier (:func:`hybrid_kind`) runs its segments as the rows of
    right-padded batches (:func:`segments_padded`), whatever its attention backend.

    Returns:
        ``aux_hidden [T, L, H] bf16`` (layer ``L`` before the final norm) and ``final_hidden [T, H]
        bf16`` (after it).
    """
    param = next(base_model.parameters())
    if hybrid_kind(base_model.config) is not None:  # never packed: one segment per row of a padded batch
        aux, final = segments_padded(base_model, input_ids, position_ids, cu_seqlens, layers)
    elif getattr(base_model.config, "_attn_implementation", None) == "flash_attention_2":
        cu = cu_seqlens.to(param.device, torch.int32)
        longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        attn = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        aux, final = _run(base_model, input_ids, position_ids, layers, attn)
    elif len(cu_seqlens) <= 2:  # one segment: the model's own forward
        aux, final = _run(base_model, input_ids, position_ids, layers, {})
    elif packs_like_transformers(position_ids, cu_seqlens):
        types = layer_types(base_model)
        masks = segment_masks(base_model, position_ids, set(types))
        with _layer_masks(base_model, masks, types):  # a 4-D mask also spares the model building its own
            aux, final = _run(base_model, input_ids, position_ids, layers,
                              {"attention_mask": masks[types[0]]})
    else:
        aux, final = segments_alone(base_model, input_ids, position_ids, cu_seqlens, layers)
    if to_host:
        return aux.cpu(), final.cpu()
    return aux, final


def _run(decoder, input_ids, position_ids, layers, attn: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder forward without a cache: ``aux [T, L, H] bf16``, ``final [T, H] bf16`` on its device."""
    device = next(decoder.parameters()).device
    with _capture_layers(decoder, layers) as captured:
        out = decoder(input_ids=input_ids[None].to(device), position_ids=position_ids[None].to(device),
                      use_cache=False, **attn)
    final = out.last_hidden_state[0]  # [T, H]
    aux = torch.stack([captured[l][0] for l in layers], dim=1)  # [T, L, H]
    return aux.to(torch.bfloat16), final.to(torch.bfloat16)


@torch.no_grad()
def segments_alone(decoder: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                   cu_seqlens: torch.Tensor, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every segment through ``decoder`` on its own (the reference packing must equal; slower).

    Same arguments and results as :func:`verifier_features` (tensors on the verifier's device).
    """
    outs = [_run(decoder, input_ids[lo:hi], position_ids[lo:hi], layers, {})
            for lo, hi in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()) if hi > lo]
    return torch.cat([a for a, _ in outs]), torch.cat([f for _, f in outs])


def padded_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Segments (indices into ``lengths``) in batches of at most ``budget`` padded slots each (a longer
    segment alone): longest first, each batch padded to its first segment's length, so that segments
    of like length share a batch. Every index is in exactly one batch.

    The padding waste of a block is ``sum(len(b) * lengths[b[0]]) - sum(lengths)`` slots.
    """
    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    batches: list[list[int]] = []
    for k in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(k)
        else:
            batches.append([k])
    return batches


@torch.no_grad()
def segments_padded(decoder: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    cu_seqlens: torch.Tensor, layers: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every segment as one row of a right-padded batch (:func:`padded_batches`, at most ``T`` slots a batch),
    for models whose layers carry a state from token to token (hybrids, :data:`HYBRID_MODEL_TYPES`).

    Each row's recurrent, convolution and linear-attention state starts from zero, as when the segment
    runs alone; the padding comes after a row's last token, so a causal layer's outputs at the row's
    tokens cannot depend on it (attention is causal, a scan and a causal convolution read only earlier
    tokens, an MoE routes each token alone), and no attention mask is passed. A padded slot gets token 0
    and the row's positions continued; its outputs are dropped.

    Same arguments and results as :func:`verifier_features` (tensors on the verifier's device).
    """
    cu = cu_seqlens.tolist()
    lengths = [hi - lo for lo, hi in zip(cu[:-1], cu[1:])]
    T = cu[-1]
    param = next(decoder.parameters())
    H = decoder.config.hidden_size
    aux = torch.zeros(T, len(layers), H, dtype=torch.bfloat16, device=param.device)
    final = torch.zeros(T, H, dtype=torch.bfloat16, device=param.device)
    nonempty = [k for k, n in enumerate(lengths) if n]
    for group in padded_batches([lengths[k] for k in nonempty], max(T, 1)):
        batch = [nonempty[g] for g in group]
        width = lengths[batch[0]]
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        pos = torch.zeros(len(batch), width, dtype=torch.long)
        for row, k in enumerate(batch):
            lo, n = cu[k], lengths[k]
            ids[row, :n] = input_ids[lo:lo + n]
            pos[row, :n] = position_ids[lo:lo + n]
            pos[row, n:] = torch.arange(1, width - n + 1) + pos[row, n - 1]
        with _capture_layers(decoder, layers) as captured:
            out = decoder(input_ids=ids.to(param.device), position_ids=pos.to(param.device), use_cache=False)
        for row, k in enumerate(batch):
            lo, n = cu[k], lengths[k]
            final[lo:lo + n] = out.last_hidden_state[row, :n]
            for j, l in enumerate(layers):
                aux[lo:lo + n, j] = captured[l][row, :n]
    return aux, final
