"""The verifier family matrix: tiny random models of every family peagle supports, built in code.

Each entry builds a transformers config (hidden 64, 2-4 layers, head dim 16) whose sliding windows
(``WINDOW`` = 4 tokens) are shorter than the test segments, so a packed segment that leaked
attention past its window, or across segments, would differ from the segment run alone.

- ``llama31``: Llama-3.1 with ``llama3`` RoPE scaling (factor 8, theta 500000);
- ``qwen3``, ``qwen3_moe`` (4 experts, top 2), ``phi3``: full attention (Phi-3 with a window too);
- ``mistral`` (every layer sliding), ``qwen2`` (sliding from layer 1 on), ``gemma2`` (alternating
  sliding/full, attention and final logit soft-capping), ``gemma3_text`` (sliding, full, sliding;
  a RoPE per layer type), ``gpt_oss`` (alternating sliding/full, attention sinks, MoE, YaRN RoPE);
- ``gemma3_mm``: a multimodal wrapper (``Gemma3ForConditionalGeneration`` with a 1-layer SigLIP
  tower) around the ``gemma3_text`` language model;
- ``qwen2_5_vl``: ``Qwen2_5_VLForConditionalGeneration`` (a 1-block vision tower; its language
  model is a Qwen2 with M-RoPE, sliding from layer 1 on);
- ``llama4``: Llama-4 text (chunked attention in chunks of ``WINDOW`` tokens, then a full layer
  without RoPE; MoE).

Hybrid verifiers (:data:`HYBRID`), whose non-attention layers carry a recurrent state from token to token:

- ``qwen3_5``: ``Qwen3_5ForConditionalGeneration`` (a 1-block vision tower) around a language model of gated
  DeltaNet (``linear_attention``) and gated full-attention layers, partial M-RoPE;
- ``qwen3_next``: gated DeltaNet and full attention, MoE (4 experts, top 2, a shared expert);
- ``nemotron_h``: Nemotron-H (Mamba-2, attention, MoE and MLP blocks, one each);
- ``granitemoehybrid``: Granite-4 hybrid (Mamba-2 and attention layers, MoE);
- ``olmo_hybrid``: OLMo hybrid (gated DeltaNet and attention layers).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

WINDOW = 4
"""Sliding window (tokens) of every sliding layer in the matrix."""

FAMILIES = ["llama31", "qwen3", "qwen3_moe", "mistral", "qwen2", "gemma2", "gemma3_text", "gpt_oss", "phi3",
            "gemma3_mm", "qwen2_5_vl", "llama4", "deepseek_v3", "glm4_moe", "minimax_m2"]
"""Every attention-only family of the matrix, in the order the tests run them."""

HYBRID = ["qwen3_5", "qwen3_next", "nemotron_h", "granitemoehybrid", "olmo_hybrid"]
"""The hybrid families: linear-attention (gated DeltaNet) or state-space (Mamba-2) layers between attention
layers, 4 decoder layers each; their state starts from zero at each sequence."""

MULTIMODAL = {"gemma3_mm", "qwen2_5_vl", "qwen3_5"}
"""Families built as a multimodal wrapper (``AutoModelForImageTextToText``) around their language model."""

_LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
               linear_num_value_heads=4)
_HYBRID_LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]

SLIDING = {"mistral", "qwen2", "gemma2", "gemma3_text", "gpt_oss", "phi3", "gemma3_mm", "qwen2_5_vl", "llama4"}
"""Families with sliding-window (or chunked: llama4) layers."""


def _shape(vocab_size: int) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _gemma3_text(vocab_size: int):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**_shape(vocab_size), num_hidden_layers=3, sliding_window=WINDOW,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            query_pre_attn_scalar=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                "rope_theta": 1_000_000.0},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})


def family_config(name: str, vocab_size: int = 512):
    """The transformers config of family ``name`` with ``vocab_size`` tokens (ids 0, 1, 2: pad, bos, eos)."""
    import transformers as tf

    s = _shape(vocab_size)
    if name == "llama31":
        return tf.LlamaConfig(**{**s, "max_position_embeddings": 131072}, num_hidden_layers=2, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    if name == "qwen3":
        return tf.Qwen3Config(**s, num_hidden_layers=2)
    if name == "qwen3_moe":
        return tf.Qwen3MoeConfig(**s, num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, decoder_sparse_step=1)
    if name == "mistral":
        return tf.MistralConfig(**s, num_hidden_layers=2, sliding_window=WINDOW)
    if name == "qwen2":
        return tf.Qwen2Config(**s, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW,
                              max_window_layers=1)
    if name == "gemma2":
        return tf.Gemma2Config(**s, num_hidden_layers=2, sliding_window=WINDOW, query_pre_attn_scalar=16,
                               attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    if name == "gemma3_text":
        return _gemma3_text(vocab_size)
    if name == "gpt_oss":
        s = {**s, "intermediate_size": 64}
        return tf.GptOssConfig(**s, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                               sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
    if name == "phi3":
        return tf.Phi3Config(**s, num_hidden_layers=2, sliding_window=WINDOW)
    if name == "gemma3_mm":
        vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=28, patch_size=14)
        return tf.Gemma3Config(text_config=_gemma3_text(vocab_size), vision_config=vision, mm_tokens_per_image=4,
                               image_token_id=vocab_size - 1, boi_token_id=vocab_size - 2,
                               eoi_token_id=vocab_size - 3, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if name == "qwen2_5_vl":
        text = {**s, "num_hidden_layers": 2, "use_sliding_window": True, "sliding_window": WINDOW,
                "max_window_layers": 1, "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}
        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
        return tf.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=vocab_size - 1,
                                   video_token_id=vocab_size - 2, vision_start_token_id=vocab_size - 3,
                                   vision_end_token_id=vocab_size - 4, pad_token_id=0, bos_token_id=1,
                                   eos_token_id=2)
    if name == "deepseek_v3":  # multi-head latent attention (low-rank q and kv, a decoupled rope part) and MoE
        # its rope head dim is qk_rope_head_dim; MLA's keys and values are per head (no grouped-query sharing)
        s = {**{k: v for k, v in s.items() if k != "head_dim"}, "num_key_value_heads": s["num_attention_heads"]}
        return tf.DeepseekV3Config(**s, num_hidden_layers=2, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                                   qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                   moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                                   topk_group=1)
    if name == "glm4_moe":  # GLM-4.5: partial rotary, q/k norms, a dense first layer, then sigmoid-routed MoE
        return tf.Glm4MoeConfig(**s, num_hidden_layers=2, partial_rotary_factor=0.5, use_qk_norm=True,
                                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
    if name == "minimax_m2":  # MiniMax-M2: full attention with q/k norms, partial rotary, MoE in every layer
        return tf.MiniMaxM2Config(**s, num_hidden_layers=2, rotary_dim=8, use_qk_norm=True, num_local_experts=4,
                                  num_experts_per_tok=2)
    if name == "llama4":
        return tf.Llama4TextConfig(**s, num_hidden_layers=2, attention_chunk_size=WINDOW, intermediate_size_mlp=128,
                                   num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=1,
                                   no_rope_layers=[1, 0])
    if name in HYBRID:
        return _hybrid_config(name, s)
    raise KeyError(f"unknown family {name!r}; known: {FAMILIES + HYBRID}")


def _hybrid_config(name: str, s: dict):
    import transformers as tf

    v = s["vocab_size"]
    if name == "qwen3_5":
        text = {**s, **_LINEAR, "num_hidden_layers": 4, "layer_types": _HYBRID_LAYERS,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                                    "mrope_section": [1, 1, 0], "mrope_interleaved": True}}
        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
        return tf.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=v - 1, video_token_id=v - 2,
                                vision_start_token_id=v - 3, vision_end_token_id=v - 4, pad_token_id=0,
                                bos_token_id=1, eos_token_id=2)
    if name == "qwen3_next":
        return tf.Qwen3NextConfig(**s, **_LINEAR, num_hidden_layers=4, layer_types=_HYBRID_LAYERS, num_experts=4,
                                  num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if name == "nemotron_h":
        return tf.NemotronHConfig(**s, layers_block_type=["linear_attention", "full_attention", "moe", "mlp"],
                                  ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, conv_kernel=4,
                                  expand=1, chunk_size=8, n_routed_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=32, moe_shared_expert_intermediate_size=32)
    if name == "granitemoehybrid":
        return tf.GraniteMoeHybridConfig(**s, num_hidden_layers=4, layer_types=["mamba", "attention"] * 2,
                                         num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32,
                                         mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=16, mamba_d_head=16,
                                         mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=8)
    return tf.OlmoHybridConfig(**s, **_LINEAR, num_hidden_layers=4, layer_types=_HYBRID_LAYERS)


VLLM_CPU_SHAPE = {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32}
"""Overrides that make a family runnable by vLLM's CPU attention (head sizes 32, 64, ...; not 16), with
head counts that split over 2 tensor-parallel ranks."""

VLLM_CPU_DENSE = {"nemotron_h": {"layers_block_type": ["linear_attention", "full_attention", "mlp",
                                                       "linear_attention"]}}
"""Per-family overrides for vLLM's CPU build: Nemotron-H without its MoE block (vLLM's CPU build has no non-gated
MoE: relu-squared experts raise ``is_act_and_mul=False is supported only for CUDA, XPU and ROCm``), i.e. the dense
Nemotron-H (Mamba-2, attention and MLP blocks: Nemotron-H 8B/47B/56B); the MoE one (Nemotron-3 Nano) on a GPU."""


def build_family(name: str, vocab_size: int = 512, seed: int = 0, attn_implementation: str | None = None,
                 overrides: dict | None = None, answer_tokens: list[int] | None = None):
    """A random float32 model of family ``name`` in eval mode (``AutoModelForCausalLM`` or, for the
    multimodal wrapper, ``AutoModelForImageTextToText``), with weights drawn from ``seed``;
    ``overrides`` are set on its text config (e.g. :data:`VLLM_CPU_SHAPE`). ``answer_tokens``: the output
    head's other rows are zero, so the model's greedy answers use these tokens only (whole words: its text
    round-trips, and a drafter trained on its own answers learns to predict them); untied embeddings only."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    cfg = family_config(name, vocab_size)
    text = cfg.get_text_config()
    for key, value in (overrides or {}).items():
        setattr(text, key, value)
    rope = getattr(text, "rope_parameters", None) or {}
    if "mrope_section" in rope:  # Qwen3.5's M-RoPE sections add up to half the rotary dims (vLLM asserts it)
        half = int(text.head_dim * rope.get("partial_rotary_factor", 1.0)) // 2
        rope["mrope_section"] = [half // 3 + (k < half % 3) for k in range(3)]
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if name in MULTIMODAL else AutoModelForCausalLM
    model = auto.from_config(cfg, dtype=torch.float32,
                             **({"attn_implementation": attn_implementation} if attn_implementation else {}))
    with torch.no_grad():  # random weights large enough that layers and windows matter
        for n, p in model.named_parameters():
            if p.ndim >= 2 and "norm" not in n:
                p.normal_(0.0, 0.08)
        if answer_tokens is not None:
            head = model.get_output_embeddings().weight
            assert head.data_ptr() != model.get_input_embeddings().weight.data_ptr(), "tied embeddings"
            keep = torch.zeros(head.shape[0], 1)
            keep[answer_tokens] = 1.0
            head.mul_(keep)
    return model.eval()


def save_family(name: str, path: Path, tokenizer_dir: Path | None = None, vocab_size: int = 512,
                overrides: dict | None = None, answer_tokens: list[int] | None = None) -> Path:
    """Save a random model of family ``name`` to ``path`` (with the tokenizer files of ``tokenizer_dir``,
    whose vocabulary must then be ``vocab_size``; ``overrides`` and ``answer_tokens`` as :func:`build_family`);
    returns ``path``."""
    path = Path(path)
    build_family(name, vocab_size, overrides=overrides, answer_tokens=answer_tokens).save_pretrained(path)
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.is_file() and not f.name.startswith(".") and f.suffix != ".safetensors" \
                    and f.name not in ("config.json", "generation_config.json"):
                shutil.copy(f, path / f.name)
    return path


def hidden_states_as_stored(model, **inputs) -> tuple:
    """``model(**inputs, output_hidden_states=True).hidden_states`` with entry L (the number of decoder
    layers) replaced by the last decoder layer's own output, caught by a forward hook: the value before
    the final norm, which vLLM feeds a drafter as aux layer L and extraction stores (transformers' own
    entry L is after the final norm). Returns ``(hidden_states, output)``."""
    from peagle_data.extract.hf_forward import language_model

    last = {}
    hook = language_model(model).layers[-1].register_forward_hook(
        lambda m, i, o: last.__setitem__("out", o[0] if isinstance(o, tuple) else o))
    try:
        with torch.no_grad():
            out = model(**inputs, output_hidden_states=True)
    finally:
        hook.remove()
    return tuple(out.hidden_states[:-1]) + (last["out"],), out
