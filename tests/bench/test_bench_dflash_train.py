"""bench/bench_dflash_train.py: a store block as speculators' DFlash forward takes it (rows unshifted, segment
index as document id), speculators' real-anchor count, the ratios; and the bench itself for 2 steps of each
trainer on a tiny store (vocab 256, hidden 64) when the bench extra (speculators) is installed."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from stores.features.feature_schema import Block
from stores.features.feature_store import FeatureStore
from tests.bench.bench_modules import load_bench

bench = load_bench("bench_dflash_train")

H, V, L = 2, 256, 3


def _block() -> Block:
    """Two segments of 4 and 3 tokens, and a 1-token one."""
    T = 8
    aux = torch.arange(T * L * H, dtype=torch.float32).reshape(T, L, H)
    final = 1000 + torch.arange(T * H, dtype=torch.float32).reshape(T, H)
    return Block(input_ids=torch.tensor([10, 11, 12, 13, 20, 21, 22, 30]), loss_mask=torch.tensor([0, 0, 1, 1, 0, 1, 1, 1]),
                 position_ids=torch.tensor([0, 1, 2, 3, 0, 1, 2, 0]), cu_seqlens=torch.tensor([0, 4, 7, 8]),
                 aux_hidden=aux.to(torch.bfloat16), final_hidden=final.to(torch.bfloat16))


def test_the_block_goes_in_unshifted_with_its_segments_as_document_ids():
    b = _block()
    out = bench.speculators_inputs(b, torch.float32)
    assert out["input_ids"].tolist() == [[10, 11, 12, 13, 20, 21, 22, 30]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]
    assert out["document_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 2]]
    assert out["loss_mask"].tolist() == [[0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]]
    assert out["hidden_states"].shape == (1, 8, L * H) and out["hidden_states"].dtype == torch.float32
    assert out["hidden_states"][0, 1].tolist() == [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]  # row 1's L aux features
    assert torch.equal(out["verifier_last_hidden_states"][0], b.final_hidden.float())


def test_speculators_real_anchors_are_supervised_rows_outside_the_last_block():
    m = torch.tensor([0, 0, 1, 1, 0, 1, 1, 1])
    assert bench.speculators_anchor_count(m, block_size=3, max_anchors=8) == 2  # rows 2, 3 (5, 6, 7: last 3)
    assert bench.speculators_anchor_count(m, block_size=2, max_anchors=8) == 3  # rows 2, 3, 5
    assert bench.speculators_anchor_count(m, block_size=2, max_anchors=1) == 1


def test_ratios_are_peagle_over_speculators_after_the_warm_up():
    steps = {"peagle": [{"s": 9.0, "loss": 1.0, "anchors": 4}, {"s": 1.0, "loss": 1.0, "anchors": 4},
                        {"s": 3.0, "loss": 1.0, "anchors": 4}],
             "speculators": [{"s": 9.0, "loss": 1.0, "anchors": 4}, {"s": 4.0, "loss": 1.0, "anchors": 4},
                             {"s": 4.0, "loss": 1.0, "anchors": 4}]}
    peaks = {"peagle": {"peak_above_setup_mib": 10.0}, "speculators": {"peak_above_setup_mib": 40.0}}
    out = bench.summarise(steps, peaks, warmup=1)
    assert out["peagle"]["median_step_s"] == 2.0 and out["speculators"]["median_step_s"] == 4.0
    assert out["ratio"] == {"step_time": 0.5, "peak_memory": 0.25}
    peaks["speculators"]["peak_above_setup_mib"] = 0.0
    assert bench.summarise(steps, peaks, warmup=1)["ratio"]["peak_memory"] is None


def _tiny_store(tmp_path):
    """A random 3-layer Llama verifier and a 2-block store of it (segments of 20 + 28 and 48 tokens)."""
    verifier = tmp_path / "verifier"
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, pad_token_id=3, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(verifier)
    store = FeatureStore.create(
        tmp_path / "s.zarr", n_blocks=2, block_size=48, max_segments=3, layers=[1, 2], hidden_size=64, vocab_size=V,
        verifier={"name_or_path": str(verifier), "architecture": "LlamaForCausalLM", "num_hidden_layers": 3,
                  "hidden_size": 64, "vocab_size": V, "dtype": "bfloat16"},
        tokenizer={"name_or_path": str(verifier)}, source="sha-bench-dflash")
    g = torch.Generator().manual_seed(0)
    for b, seg in enumerate([[20, 28], [48]]):
        T = sum(seg)
        mask = torch.cat([torch.cat([torch.zeros(3), torch.ones(n - 3)]) for n in seg]).long()
        store.write_tokens(b, torch.randint(0, V, (T,), generator=g).numpy(), mask.numpy(),
                           torch.cat([torch.arange(n) for n in seg]).numpy(), np.cumsum([0, *seg]))
        store.write_features(b, torch.randn(T, 2, 64, generator=g).to(torch.bfloat16),
                             (3 * torch.randn(T, 64, generator=g)).to(torch.bfloat16))
        store.mark_done(b)
    store.write_all_n_tokens(np.array([48, 48]))
    store.write_segment_keys([[1, 2], [3]])
    freq = np.arange(V)[::-1].copy()
    freq[3] = 0  # the tiny verifier's pad token (it has no tokenizer): never supervised, the mask token
    store.set_token_freq(freq)
    return tmp_path / "s.zarr"


def test_two_steps_of_each_trainer_on_a_tiny_store(tmp_path, capsys):
    if importlib.util.find_spec("speculators") is None:
        pytest.skip("speculators is not installed (the bench extra: PEAGLE_BENCH=1 bash scripts/setup_env.sh)")
    store = _tiny_store(tmp_path)
    out = bench.main(["--store", str(store), "--steps", "2", "--warmup", "0", "--block-size", "4",
                      "--max-anchors", "4", "--draft-vocab-size", "100", "--threads", "1"])
    assert out["settings"]["block_size"] == 4 and len(out["blocks"]) == 2
    for name in ("peagle", "speculators"):
        row = out[name]
        assert row["timed_steps"] == 2 and row["anchors"] == [4, 4]  # the cap, below every block's candidates
        assert all(np.isfinite(row["loss"])) and row["median_step_s"] > 0 and row["peak_above_setup_mib"] >= 0
        assert out["setup"][name]["block_size"] == 4 and out["setup"][name]["draft_vocab_size"] == 100
        assert out["setup"][name]["mask_token_id"] == 3 and out["setup"][name]["threads"] == 1
    # the same trained parameters: fc, hidden_norm, the layer, the final norm (embedding and lm_head frozen)
    assert out["setup"]["peagle"]["trained_parameters"] == out["setup"]["speculators"]["trained_parameters"]
    assert out["ratio"]["step_time"] > 0 and any("anchors" in d for d in out["differences"])
    assert '"ratio"' in capsys.readouterr().out
