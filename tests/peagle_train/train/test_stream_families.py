"""Streaming exactness on the verifier family matrix (tests/families.py) beside Llama (test_stream.py): a store
trained while ``extract --stream`` (hf engine) fills it within a budget of 3 training blocks gives, bit for bit,
the weights of the offline run (extract everything, then train), 2 epochs, policy ``reextract``.

The two roles run in one process, as library calls (``run_extract`` with ``stream`` on a thread, ``run_train``
with ``max_store_bytes`` and no ``extract_from``: the split roles of docs/guide-streaming.md), so that a family
costs seconds instead of two more interpreter starts; the subprocess that ``--extract-from`` starts is covered by
test_stream.py. Tiny packed table of test_stream.py (8 blocks of 48 slots, random SmolLM2 ids), each family with
the SmolLM2 vocabulary."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from peagle_data.extract.config import ExtractConfig
from peagle_data.extract.run import run_extract
from peagle_train.train.config import TrainConfig
from peagle_train.train.run import run_train
from stores.features.feature_store import FeatureStore
from stores.stream.plan import block_feature_bytes
from stores.stream.session import StreamSession
from tests.peagle_train.train.test_stream import C, N_BLOCKS, OPTS, _weights

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from families import FAMILIES, HYBRID, SLIDING, save_family  # noqa: E402

STEPS = 12  # two epochs of 6 training blocks (2 held out), one per step
FAST = ["qwen3_moe", "gpt_oss"]
"""In the main suite (about 5 s of CPU each): MoE; alternating sliding/full layers with sinks and MoE (gpt-oss)."""
SLOW = ["gemma2", "qwen3", "mistral", "qwen2", "gemma3_text", "phi3", "gemma3_mm", "qwen2_5_vl", "llama4", "deepseek_v3",
        "glm4_moe", "minimax_m2"]
"""Every other family of the matrix but Llama, slow-marked."""
assert sorted(FAST + SLOW + ["llama31"]) == sorted(FAMILIES) and {"gpt_oss", "gemma2"} <= SLIDING


def _extract(packed_dir: Path, verifier: Path, out: Path, **extra) -> dict:
    cfg = ExtractConfig(packed=str(packed_dir), output=str(out), verifier=str(verifier), context="window",
                        device="cpu", **extra)
    return run_extract(cfg, progress=False, log=lambda _: None)


def _budget(store: str, window: int, n_val: int = 2) -> int:
    """A budget of ``window`` training blocks: the offline store's bytes less its features, plus the plan's
    allowance (``fixed_store_bytes``: 8 bytes an entry, 8192), the validation blocks and the window."""
    opened = FeatureStore.open(store)
    block = block_feature_bytes(C, len(opened.layers), opened.hidden_size, "bf16")
    total = sum(p.stat().st_size for p in Path(store).rglob("*") if p.is_file())
    return total - N_BLOCKS * block + 8 * STEPS + 8192 + (n_val + window) * block


HYBRID_FAST = ["qwen3_next"]
"""A hybrid in the main suite (gated DeltaNet and MoE: each window its own row, its state from zero); the other
hybrids slow-marked."""


@pytest.mark.parametrize("family", FAST + HYBRID_FAST + [pytest.param(f, marks=pytest.mark.slow) for f in
                                                         SLOW + [h for h in HYBRID if h not in HYBRID_FAST]])
def test_streaming_weights_equal_offline_weights_per_family(tmp_path, packed, smollm2_tokenizer_dir, family,
                                                            one_thread):
    verifier = save_family(family, tmp_path / "verifier", smollm2_tokenizer_dir, vocab_size=49152)
    offline_store = str(tmp_path / "offline.zarr")
    assert _extract(packed, verifier, Path(offline_store))["complete"]
    opts = dict(verifier=str(verifier), max_steps=STEPS, **OPTS)
    offline = run_train(TrainConfig.from_flat(store=offline_store, output=str(tmp_path / "offline"), **opts))

    store = tmp_path / "stream.zarr"
    budget = _budget(offline_store, window=3)
    result: dict = {}

    def extract() -> None:
        try:
            result["summary"] = _extract(packed, verifier, store, stream=True, stream_timeout_s=60.0)
        except BaseException as e:  # re-raised by the test
            result["error"] = e

    thread = threading.Thread(target=extract, daemon=True)
    thread.start()
    try:
        summary = run_train(TrainConfig.from_flat(store=str(store), output=str(tmp_path / "stream"),
                                                  max_store_bytes=str(budget), stream_timeout_s=60.0, **opts))
    finally:
        thread.join(timeout=120)
    if "error" in result:
        raise result["error"]

    a, b = _weights(tmp_path / "offline"), _weights(tmp_path / "stream")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), (family, name)
    assert summary["val_loss"] == offline["val_loss"]
    opened = FeatureStore.open(store)
    consumed = StreamSession(opened).consumed()
    assert consumed == STEPS and int(opened.done_mask().sum()) == 2  # the validation blocks stay
    stream = result["summary"]["stream"]
    assert stream["peak_store_bytes"] <= budget
    assert 2 + 6 * 2 - 2 <= stream["extractions"] <= 2 + 6 * 2  # each block once per epoch, less the window's
