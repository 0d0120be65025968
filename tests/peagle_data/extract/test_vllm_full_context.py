"""``extract --engine vllm --context full``: every context (a whole conversation, or a piece of one longer than
``--max-context``) is one vLLM request, and the store equals the ``hf`` engine's full-context store within
bf16 rounding; the engine is sized for the contexts, which are longer than any window; ``--max-context``
leaves vLLM room for the token it generates."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from peagle_data.extract.config import ExtractConfig
from peagle_data.extract.run import run_extract
from stores.errors import InputError
from stores.features.feature_store import FeatureStore
from tests.long_conversations import pack_long
from tests.peagle_data.extract.test_vllm import assert_within_rounding, compare_stores, extract_cli

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from families import VLLM_CPU_SHAPE, save_family  # noqa: E402

LAYERS = [0, 1, 2]  # every id of the 2-layer family: the embeddings, layer 1, the pre-norm last (2)
MAX_CONTEXT = 256


def gathered(store: FeatureStore, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training block ``i``'s features gathered by hand from its views: per segment, the prefix slots then
    the body slots of the context block (read as a block of the ``contexts`` sub-store)."""
    cu = store.read_tokens(i)["cu_seqlens"].tolist()
    aux, final = [], []
    for k, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        m, prefix_slot, prefix_len, body_slot = store.views()[i, k].tolist()
        ctx = store.contexts.read_block(m, via="zarr")
        slots = np.r_[prefix_slot:prefix_slot + prefix_len, body_slot:body_slot + (hi - lo) - prefix_len]
        aux.append(ctx.aux_hidden[slots])
        final.append(ctx.final_hidden[slots])
    return torch.cat(aux), torch.cat(final)


@pytest.mark.vllm
@pytest.mark.slow  # one vLLM engine start (~60 s)
def test_full_context_vllm_equals_hf(tmp_path, copy_smollm2_tokenizer):
    model = copy_smollm2_tokenizer(save_family("llama31", tmp_path / "model", vocab_size=49152,
                                               overrides=VLLM_CPU_SHAPE))
    packed = pack_long(tmp_path / "packed", model)
    options = dict(packed=str(packed), verifier=str(model), layers=LAYERS, context="full", max_context=MAX_CONTEXT)
    run_extract(ExtractConfig(output=str(tmp_path / "hf.zarr"), device="cpu", **options), progress=False)
    res = extract_cli(packed, model, tmp_path / "vllm.zarr", LAYERS, "--max-context", str(MAX_CONTEXT))  # default: full
    hf, vllm = FeatureStore.open(tmp_path / "hf.zarr"), FeatureStore.open(tmp_path / "vllm.zarr")
    assert vllm.layout == "windows" and vllm.attrs["context"] == hf.attrs["context"] == {
        "max_context": 256, "conversations": 6, "conversations_split": 1, "contexts": 7, "tokens_extracted": 1206,
        "context_blocks": 5, "context_packing_efficiency": 0.942187}
    assert np.array_equal(vllm.views(), hf.views())

    # the engine ran the contexts (the longest 256 tokens: a piece of the 290-token conversation), not the
    # windows (64): vLLM was sized for them, one request per context
    longest_window = max(int(np.diff(hf.read_tokens(i)["cu_seqlens"]).max()) for i in range(hf.n_blocks))
    contexts = [np.diff(hf.contexts.read_tokens(m)["cu_seqlens"]) for m in range(hf.contexts.n_blocks)]
    longest_context = max(int(c.max()) for c in contexts)
    assert (longest_window, longest_context, sum(len(c) for c in contexts)) == (64, 256, 7)
    assert re.findall(r"'max_model_len': (\d+)", res.stdout + res.stderr) == [str(longest_context + 1)]

    # the context blocks the verifier ran: vLLM's within rounding of transformers'
    for m in range(hf.contexts.n_blocks):
        x, y = hf.contexts.read_block(m), vllm.contexts.read_block(m)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.cu_seqlens, y.cu_seqlens)
        for k, layer in enumerate(LAYERS[:-1]):
            assert_within_rounding(x.aux_hidden[:, k], y.aux_hidden[:, k], f"context block {m} layer {layer}")
        assert_within_rounding(x.final_hidden, y.final_hidden, f"context block {m} final")
    # the training blocks: the same tokens and attributes as hf's, features within rounding (and verify ok) ...
    compare_stores(tmp_path / "hf.zarr", tmp_path / "vllm.zarr", 2, "llama31 full context")
    # ... and each exactly the slices of the vLLM store's context blocks its views name
    for i in range(vllm.n_blocks):
        block, (aux, final) = vllm.read_block(i), gathered(vllm, i)
        assert torch.equal(block.aux_hidden, aux) and torch.equal(block.final_hidden, final), f"block {i}"


def test_max_context_leaves_vllm_the_token_it_generates(tmp_path, tiny_verifier_dir):
    """The tiny verifier has max_position_embeddings 4096: vLLM runs a request of at most 4095 tokens (its
    max_model_len holds the generated token too and may not pass 4096), transformers 4096; both refused
    before any engine starts."""
    packed = pack_long(tmp_path / "packed", tiny_verifier_dir)
    cfg = dict(packed=str(packed), verifier=str(tiny_verifier_dir), output=str(tmp_path / "x.zarr"), layers=[1],
               context="full")
    with pytest.raises(InputError, match="max_position_embeddings is 4096, and --engine vllm generates 1 token"
                                         r"\(s\) after each context within them: give at most 4095"):
        run_extract(ExtractConfig(engine="vllm", max_context=4096, **cfg), progress=False)
    with pytest.raises(InputError, match="max_position_embeddings is 4096, and it computes no positions beyond"):
        run_extract(ExtractConfig(engine="hf", device="cpu", max_context=4097, **cfg), progress=False)
    assert not (tmp_path / "x.zarr").exists()
    summary = run_extract(ExtractConfig(engine="hf", device="cpu", **cfg), progress=False)  # default: 4096
    assert summary["context"]["max_context"] == 4096 and summary["complete"]
