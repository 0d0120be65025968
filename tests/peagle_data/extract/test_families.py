"""The family matrix on extraction: packed segments equal each segment run alone, in every family.

Every stored layer (0 = embeddings as the first decoder layer sees them, 1..L, L being the last
decoder layer's output before the final norm) of every segment of a packed block must equal the
model's own ``output_hidden_states`` of that segment run alone (entry L taken by a hook on the last
decoder layer, :func:`families.hidden_states_as_stored`), and the final slot its normed state, with windows (4 tokens) shorter than the segments, attention sinks and
soft-capping; a block-diagonal mask without the window would fail (checked as a control).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from peagle_data.extract.config import ExtractConfig
from peagle_data.extract.hf_forward import check_packable, language_model, segments_alone, verifier_features
from peagle_data.extract.run import run_extract
from stores.errors import InputError
from stores.features.feature_store import FeatureStore
from stores.staging import prepare_output_dir
from stores.tables.token_tables import TableWriter, write_manifest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from families import (FAMILIES, HYBRID, SLIDING, build_family, family_config, hidden_states_as_stored,  # noqa: E402
                      save_family)

LENGTHS = [9, 3, 12]  # two segments longer than the window, one shorter


pytestmark = pytest.mark.usefixtures("one_thread")


def _block(seed: int = 1, vocab: int = 512):
    g = torch.Generator().manual_seed(seed)
    segs = [torch.randint(3, vocab - 3, (n,), generator=g) for n in LENGTHS]
    cu = torch.tensor([0] + LENGTHS).cumsum(0)
    return segs, torch.cat(segs), torch.cat([torch.arange(n) for n in LENGTHS]), cu


def worst_relative_difference(model, layers: list[int]) -> float:
    """Largest per-token ``|stored - alone| / |alone|`` over segments, layers and tokens (alone in fp32)."""
    segs, ids, pos, cu = _block()
    aux, final = verifier_features(language_model(model), ids, pos, cu, layers)
    worst = 0.0
    for k, seg in enumerate(segs):
        alone, out = hidden_states_as_stored(model, input_ids=seg[None])
        lo, hi = int(cu[k]), int(cu[k + 1])
        for j, layer in enumerate(layers):
            ref = alone[layer][0].float()
            rel = (aux[lo:hi, j].float() - ref).norm(dim=-1) / ref.norm(dim=-1)
            worst = max(worst, float(rel.max()))
        ref = out.hidden_states[-1][0].float()  # after the final norm
        worst = max(worst, float(((final[lo:hi].float() - ref).norm(dim=-1) / ref.norm(dim=-1)).max()))
    return worst


@pytest.mark.parametrize("impl", [None, "eager"], ids=["default", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_packed_features_equal_segments_alone(family, impl):
    model = build_family(family, attn_implementation=impl)
    L = len(language_model(model).layers)
    worst = worst_relative_difference(model, list(range(L + 1)))
    assert worst < 4e-3, f"{family}: worst relative difference {worst:.4f} (bf16 rounding is ≤ 2^-8 = 3.9e-3)"


@pytest.mark.parametrize("family", sorted(SLIDING))
def test_window_matters_in_the_matrix(family):
    """Control: a block-diagonal causal mask without the window gives other features at the last layer."""
    model = build_family(family)
    decoder = language_model(model)
    segs, ids, pos, cu = _block()
    T = ids.numel()
    seg = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    mask = torch.zeros(T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    hooks = [layer.register_forward_pre_hook(lambda m, a, kw: (a, {**kw, "attention_mask": mask}), with_kwargs=True)
             for layer in decoder.layers]
    try:
        with torch.no_grad():
            no_window = decoder(input_ids=ids[None], position_ids=pos[None]).last_hidden_state[0]
    finally:
        for h in hooks:
            h.remove()
    _, final = verifier_features(decoder, ids, pos, cu, [len(decoder.layers)])
    lo, hi = 0, LENGTHS[0]
    rel = (no_window[lo:hi] - final[lo:hi].float()).norm(dim=-1) / final[lo:hi].float().norm(dim=-1)
    assert float(rel[:4].max()) < 8e-3  # inside the window both agree
    assert float(rel[4:].max()) > 0.05  # past it only the windowed features are the model's


def test_positions_without_segment_jumps_run_segments_alone():
    model = build_family("mistral")
    decoder = language_model(model)
    segs, ids, _, cu = _block()
    pos = torch.arange(ids.numel())  # contiguous positions: transformers would read one sequence
    aux, final = verifier_features(decoder, ids, pos, cu, [1, 2])
    ref_aux, ref_final = segments_alone(decoder, ids, pos, cu, [1, 2])
    assert torch.equal(aux, ref_aux) and torch.equal(final, ref_final)


def _write_packed(directory: Path, n_blocks: int, vocab: int) -> Path:
    """A packed table of :func:`_block`'s blocks without a conversations sub-table: extract it with
    ``--context window`` (the default, full, refuses it)."""
    prepare_output_dir(directory, force=True)
    with TableWriter(directory, "packed") as w:
        for b in range(n_blocks):
            segs, ids, pos, cu = _block(seed=b, vocab=vocab)
            w.write({"block_id": b, "input_ids": ids.numpy().astype(np.int32),
                     "loss_mask": np.ones(ids.numel(), np.uint8), "position_ids": pos.numpy().astype(np.int32),
                     "cu_seqlens": cu.numpy().astype(np.int32), "segment_ids": [f"c{b}#{k}" for k in range(len(segs))],
                     "n_tokens": ids.numel()})
    write_manifest(directory, {"kind": "packed", "inputs": ["random"], "parameters": {"block_size": 32},
                               "tokenizer": {"name_or_path": "none"}})
    return directory


@pytest.mark.parametrize("family", ["gemma3_mm", "gpt_oss"])
def test_run_extract_records_the_language_model(tmp_path, family):
    """A multimodal wrapper extracts from its language model; gpt-oss (no SDPA) falls back to eager."""
    verifier = save_family(family, tmp_path / "verifier")
    packed = _write_packed(tmp_path / "packed", 2, 512)
    run_extract(ExtractConfig(packed=str(packed), verifier=str(verifier), output=str(tmp_path / "f.zarr"),
                              layers=[0, 1, 2], device="cpu", context="window"), progress=False, log=lambda m: None)
    store = FeatureStore.open(tmp_path / "f.zarr")
    desc = store.attrs["verifier"]
    text = family_config(family).get_text_config()
    assert desc["num_hidden_layers"] == text.num_hidden_layers and desc["hidden_size"] == 64
    assert desc["layer_types"] == text.layer_types and desc["final_norm"].endswith("RMSNorm")
    assert desc["language_model"] == {"gemma3_mm": "Gemma3TextModel", "gpt_oss": "GptOssModel"}[family]
    assert desc["attn_implementation"] == {"gemma3_mm": "sdpa", "gpt_oss": "eager"}[family]
    model = build_family(family)
    b = store.read_block(1)
    segs, ids, pos, cu = _block(seed=1)
    want, _ = verifier_features(language_model(model), ids, pos, cu, [0, 1, 2])
    assert torch.equal(b.aux_hidden[: ids.numel()], want)


def test_explicit_sdpa_on_a_model_without_it_is_a_clear_error(tmp_path):
    verifier = save_family("gpt_oss", tmp_path / "verifier")
    packed = _write_packed(tmp_path / "packed", 1, 512)
    with pytest.raises(InputError, match="--attn-implementation.*eager"):
        run_extract(ExtractConfig(packed=str(packed), verifier=str(verifier), output=str(tmp_path / "f.zarr"),
                                  device="cpu", attn_implementation="sdpa", context="window"), progress=False,
                    log=lambda m: None)


def _cosine_and_abs(model, aux, final, layers):
    """Worst per-token cosine and largest absolute difference (float32) of ``aux``/``final`` against each
    segment of :func:`_block` run alone (the model's own forward of that segment, no cache)."""
    segs, _, _, cu = _block()
    cos, diff = 1.0, 0.0
    for k, seg in enumerate(segs):
        alone, out = hidden_states_as_stored(model, input_ids=seg[None])
        lo, hi = int(cu[k]), int(cu[k + 1])
        pairs = [(aux[lo:hi, j].float(), alone[layer][0].float()) for j, layer in enumerate(layers)]
        pairs.append((final[lo:hi].float(), out.hidden_states[-1][0].float()))
        for got, ref in pairs:
            cos = min(cos, float(torch.nn.functional.cosine_similarity(got, ref, dim=-1).min()))
            diff = max(diff, float((got - ref).abs().max()))
    return cos, diff


def qwen3_5_moe():
    """A tiny random Qwen3.5-MoE (Qwen3.6's architecture: the multimodal wrapper around gated DeltaNet and gated
    attention layers with an MoE of 4 experts, top 2, and a shared expert), float32, eval; not in
    tests/families.py's matrix, so built here as ``build_family`` builds ``qwen3_5``."""
    import transformers as tf

    v = 512
    text = dict(vocab_size=v, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                linear_num_value_heads=4, num_hidden_layers=4,
                layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    cfg = tf.Qwen3_5MoeConfig(text_config=text, vision_config=vision, image_token_id=v - 1, video_token_id=v - 2,
                              vision_start_token_id=v - 3, vision_end_token_id=v - 4, pad_token_id=0, bos_token_id=1,
                              eos_token_id=2)
    torch.manual_seed(0)
    model = tf.AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim >= 2 and "norm" not in n:
                p.normal_(0.0, 0.08)
    return model.eval()


@pytest.fixture(scope="module", params=HYBRID + ["qwen3_5_moe"])
def hybrid(request):
    model = qwen3_5_moe() if request.param == "qwen3_5_moe" else build_family(request.param)
    check_packable(model.config)  # a verified hybrid: never packed, not refused
    return request.param, model


def test_hybrid_features_equal_each_conversation_alone(hybrid):
    """A hybrid's segments (9, 3 and 12 tokens; Mamba-2 chunks of 8) run as rows of a right-padded batch: every
    stored layer of each equals the segment run alone, its recurrent state started from zero."""
    family, model = hybrid
    decoder = language_model(model)
    layers = list(range(len(decoder.layers) + 1))
    _, ids, pos, cu = _block()
    aux, final = verifier_features(decoder, ids, pos, cu, layers)
    cos, diff = _cosine_and_abs(model, aux, final, layers)
    assert cos >= 0.999, f"{family}: worst cosine {cos:.6f}"
    scale = max(float(final.float().abs().max()), float(aux.float().abs().max()))
    assert diff <= scale * 2 ** -7, f"{family}: max abs diff {diff:.3g} over bf16 rounding of {scale:.3g}"
    assert worst_relative_difference(model, layers) < 4e-3


def test_hybrid_state_would_leak_if_packed(hybrid):
    """Control: the block run as one packed sequence (positions restarting) carries the recurrent state of segment
    0 into segment 1, so its features differ from segment 1 alone: the padded batch is what makes them equal."""
    family, model = hybrid
    decoder = language_model(model)
    L = len(decoder.layers)
    segs, ids, pos, cu = _block()
    with torch.no_grad():
        packed = decoder(input_ids=ids[None], position_ids=pos[None], use_cache=False).last_hidden_state[0]
    _, out = hidden_states_as_stored(model, input_ids=segs[1][None])
    lo, hi = int(cu[1]), int(cu[2])
    ref = out.hidden_states[L][0]
    rel = (packed[lo:hi] - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert float(rel.max()) > 0.05, f"{family}: packing did not change segment 1 ({float(rel.max()):.4f})"


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_run_extract_of_a_hybrid_stores_each_window_alone(tmp_path, family):
    """`--context window` on a hybrid (Qwen3.5 wrapper: its language model; Nemotron-H): the store holds each window's
    features as run alone."""
    verifier = save_family(family, tmp_path / "verifier")
    packed = _write_packed(tmp_path / "packed", 2, 512)
    run_extract(ExtractConfig(packed=str(packed), verifier=str(verifier), output=str(tmp_path / "f.zarr"),
                              layers=[0, 1, 4], device="cpu", context="window"), progress=False, log=lambda m: None)
    store = FeatureStore.open(tmp_path / "f.zarr")
    desc = store.attrs["verifier"]
    assert desc["language_model"] == {"qwen3_5": "Qwen3_5TextModel", "nemotron_h": "NemotronHModel"}[family]
    assert desc["num_hidden_layers"] == 4 and desc["final_norm"].endswith("RMSNorm")  # Nemotron-H's is .norm_f
    model = build_family(family)
    b = store.read_block(1)
    segs, ids, pos, cu = _block(seed=1)
    aux, final = b.aux_hidden[: ids.numel()], b.final_hidden[: ids.numel()]
    for k, seg in enumerate(segs):
        alone, out = hidden_states_as_stored(model, input_ids=seg[None])
        lo, hi = int(cu[k]), int(cu[k + 1])
        for j, layer in enumerate([0, 1, 4]):
            cos = torch.nn.functional.cosine_similarity(aux[lo:hi, j].float(), alone[layer][0], dim=-1)
            assert float(cos.min()) >= 0.999, (family, k, layer)


def _recurrent_configs():
    import transformers as tf

    return {
        "bamba": (tf.BambaConfig(num_hidden_layers=4), "mamba2"),
        "jamba": (tf.JambaConfig(num_hidden_layers=4), "mamba"),
        "falcon_h1": (tf.FalconH1Config(num_hidden_layers=2), "mamba"),
        "mamba": (tf.MambaConfig(num_hidden_layers=2), "mamba"),
    }


@pytest.mark.parametrize("name", ["bamba", "jamba", "falcon_h1", "mamba"])
def test_recurrent_layers_are_refused_naming_the_layer_type(name):
    config, kind = _recurrent_configs()[name]
    with pytest.raises(InputError, match=kind):
        check_packable(config)


@pytest.mark.parametrize("family", FAMILIES + HYBRID)
def test_every_family_of_the_matrix_is_packable(family):
    check_packable(family_config(family))  # raises for none of them


def test_refused_before_any_weights_load(tmp_path):
    verifier = tmp_path / "next"
    verifier.mkdir()
    (verifier / "config.json").write_text(json.dumps(_recurrent_configs()["jamba"][0].to_dict()))
    packed = _write_packed(tmp_path / "packed", 1, 512)
    with pytest.raises(InputError, match="mamba"):  # no weights in the directory at all
        run_extract(ExtractConfig(packed=str(packed), verifier=str(verifier), output=str(tmp_path / "f.zarr"),
                                  device="cpu", context="window"), progress=False, log=lambda m: None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attn", ["sdpa", "eager", "flash_attention_2"])
@pytest.mark.parametrize("family", sorted(SLIDING))
def test_cuda_packed_features_equal_segments_alone(family, attn):
    """bf16 on the GPU; the FlashAttention varlen path gets each layer's window from the model."""
    import importlib.util

    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    try:
        model = build_family(family, attn_implementation=attn).to("cuda", torch.bfloat16)
    except ValueError as e:  # the family does not support this backend
        pytest.skip(str(e))
    decoder = language_model(model)
    segs, ids, pos, cu = _block()
    layers = list(range(len(decoder.layers) + 1))
    aux, _ = verifier_features(decoder, ids, pos, cu, layers)
    for k, seg in enumerate(segs):
        alone, _ = hidden_states_as_stored(model, input_ids=seg[None].cuda())
        lo, hi = int(cu[k]), int(cu[k + 1])
        for j, layer in enumerate(layers):
            ref = alone[layer][0].float().cpu()
            rel = (aux[lo:hi, j].float() - ref).norm(dim=-1) / ref.norm(dim=-1)
            assert float(rel.max()) < 3e-2, (family, attn, k, layer)  # bf16 compute on both sides


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
@pytest.mark.parametrize("family", HYBRID)
def test_cuda_hybrid_features_equal_each_conversation_alone(family, attn):
    """bf16 on the GPU with the model's CUDA kernels (flash-linear-attention, mamba_ssm, causal-conv1d where
    installed): the padded rows against each segment alone, both in bf16."""
    import importlib.util

    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    try:
        model = build_family(family, attn_implementation=attn).to("cuda", torch.bfloat16)
    except ValueError as e:  # the family does not support this backend
        pytest.skip(str(e))
    decoder = language_model(model)
    segs, ids, pos, cu = _block()
    layers = list(range(len(decoder.layers) + 1))
    aux, _ = verifier_features(decoder, ids, pos, cu, layers)
    for k, seg in enumerate(segs):
        alone, _ = hidden_states_as_stored(model, input_ids=seg[None].cuda())
        lo, hi = int(cu[k]), int(cu[k + 1])
        for j, layer in enumerate(layers):
            cos = torch.nn.functional.cosine_similarity(aux[lo:hi, j].float(), alone[layer][0].float().cpu(), dim=-1)
            assert float(cos.min()) >= 0.99, (family, attn, k, layer)  # bf16 compute on both sides
