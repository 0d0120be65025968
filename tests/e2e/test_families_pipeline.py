"""A new user's own tiny verifier of each kind through the CLI: pack -> extract -> train -> eval.

Families with sliding windows shorter than the prompts (gpt-oss: eager attention with sinks, YaRN;
Gemma-3 multimodal wrapper: per-layer-type RoPE, extraction from its language model) and Llama-3.1
with llama3 RoPE scaling; the real SmolLM2 tokenizer. Stored features equal each segment run alone,
evaluation is identical to greedy decoding, and the drafter checkpoint carries the verifier's RoPE.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from cli.data import main as data_main
from cli.eval import main as eval_main
from cli.train import main as train_main
from peagle_train.train.setup import verifier_rope
from stores.feature_store import FeatureStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from e2e.test_pipeline import CONVERSATIONS, PROMPTS, _run  # noqa: E402
from families import family_config, hidden_states_as_stored, save_family  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_oss", "gemma3_mm", "llama31", "gemma2"])
def test_family_through_the_cli(tmp_path, smollm2_tokenizer_dir, family):
    model = str(save_family(family, tmp_path / "verifier", smollm2_tokenizer_dir, vocab_size=49152))
    data = tmp_path / "convs.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))

    _run(data_main, ["pack", data, "--tokenizer", model, "--output", tmp_path / "packed", "--max-seq-len", 128])
    _run(data_main, ["extract", tmp_path / "packed", "--verifier", model, "--output", tmp_path / "f.zarr",
                     "--layers", "0,1,2", "--device", "cpu"])
    store = FeatureStore.open(tmp_path / "f.zarr")
    text = family_config(family, 49152).get_text_config()
    assert store.attrs["verifier"]["num_hidden_layers"] == text.num_hidden_layers
    from stores.model_cache import load_verifier

    verifier = load_verifier(model, device="cpu")
    b = store.read_block(0)
    for k in range(len(b.cu_seqlens) - 1):  # every segment of the first block, alone through the verifier
        lo, hi = int(b.cu_seqlens[k]), int(b.cu_seqlens[k + 1])
        alone, _ = hidden_states_as_stored(verifier, input_ids=b.input_ids[lo:hi][None])  # [L]: before the norm
        for j, layer in enumerate([0, 1, 2]):
            ref = alone[layer][0]
            rel = (b.aux_hidden[lo:hi, j].float() - ref).norm(dim=-1) / ref.norm(dim=-1)
            assert float(rel.max()) < 8e-3, (family, k, layer)

    _run(train_main, ["--store", tmp_path / "f.zarr", "--output", tmp_path / "drafter", "--max-steps", 4,
                      "--num-depths", 3, "--draft-vocab-size", 64])
    final = tmp_path / "drafter" / "final"
    layer_config = json.loads((final / "config.json").read_text())["transformer_layer_config"]
    assert layer_config["rope_parameters"] == verifier_rope(text)
    assert layer_config["rope_theta"] == verifier_rope(text)["rope_theta"]
    # the KL targets are the verifier's real distribution: Gemma-2's logits are soft-capped
    recorded = json.loads((final / "config.json").read_text())["peagle_training"]["verifier_logit_transform"]
    assert recorded == {"scale": 1.0, "softcap": getattr(text, "final_logit_softcapping", None)}

    report = json.loads(_run(eval_main, ["--drafter", final, "--verifier", model, "--prompts", prompts,
                                         "--max-new-tokens", 12, "--output", tmp_path / "eval.json"]))
    assert report["identical_to_greedy"] is True
