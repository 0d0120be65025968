"""A streaming run with ``--engine vllm`` (the vLLM suite): the store it fills holds, block for block, the hf
engine's features within bf16 rounding, and training ran on them. SmolLM2-135M, a tiny random packed table,
policy keep (every block stays, so the whole store is compared)."""

from __future__ import annotations

from pathlib import Path

import pytest

from peagle_train.train.config import TrainConfig
from peagle_train.train.run import run_train
from peagle_data.extract.config import ExtractConfig
from peagle_data.extract.run import run_extract
from stores.features.feature_store import FeatureStore
from stores.stream.session import StreamSession
from tests.peagle_data.extract.test_vllm import compare_stores, write_packed

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # one vLLM engine start (~1 min on CPU)


def test_vllm_streaming_store_equals_hf_within_rounding(tmp_path, monkeypatch):
    from runtime.model_cache import resolve_model

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    model = str(resolve_model("smollm2-135m"))
    packed = write_packed(tmp_path / "packed", n_blocks=4, vocab=49152, longest=40)
    layers = [2, 15, 27]
    run_extract(ExtractConfig(packed=str(packed), context="window", verifier=model, output=str(tmp_path / "hf.zarr"),
                              layers=layers, device="cpu"), progress=False)
    store = tmp_path / "stream.zarr"
    summary = run_train(TrainConfig.from_flat(
        store=str(store), output=str(tmp_path / "run"), verifier=model, extract_from=str(packed), layers=layers,
        engine="vllm", context="window", max_store_bytes="64MiB", epoch_policy="keep", val_fraction=0.0, num_depths=2,
        draft_vocab_size=256, loss_chunk_size=64))
    assert summary["steps"] == 4 and Path(summary["checkpoint"]).is_dir()
    opened = FeatureStore.open(store)
    assert StreamSession(opened).read_plan().policy == "keep"
    assert opened.attrs["engine"]["name"] == "vllm" and opened.is_complete()
    compare_stores(tmp_path / "hf.zarr", store, 30, "smollm2 streamed")
