"""The feature-store schema table: what create makes, what a token row writes, the block type."""

import numpy as np
import pytest
import torch

from stores.features.feature_schema import (ARRAYS, SEGMENT_KEYS, TOKEN_ARRAYS, Block, block_arrays, bytes_per_token,
                                   store_arrays)
from stores.features.feature_store import FeatureStore


@pytest.mark.parametrize("storage_dtype", ["bf16", "fp8"])
def test_create_makes_exactly_the_arrays_of_the_table(tmp_path, storage_dtype):
    store = FeatureStore.create(tmp_path / "s.zarr", n_blocks=3, block_size=8, max_segments=2, layers=[0, 2],
                                hidden_size=4, vocab_size=16, verifier={"name_or_path": "tiny"},
                                storage_dtype=storage_dtype)
    sizes = {"N": 3, "C": 8, "W": 3, "S": 2, "L": 2, "H": 4, "V": 16}
    specs = (*store_arrays(storage_dtype), SEGMENT_KEYS)  # segment keys: at the root, since peagle recorded them
    assert sorted(name for name, _ in store.group.arrays()) == sorted(s.name for s in specs)
    for spec in specs:
        arr = store.group[spec.name]
        assert (tuple(arr.shape), tuple(arr.chunks), str(arr.dtype)) == \
            (spec.shape(sizes), spec.chunks(sizes), spec.dtype), spec.name
    assert store.group["aux_hidden"].shape == (3, 8, 2, 4) and store.group["aux_hidden"].chunks == (1, 8, 2, 4)
    assert store.group["n_tokens"].chunks == (3,) and store.group["token_freq"].chunks == (16,)
    assert store.group["segment_keys"].chunks == (3, 2) and store.segment_keys() is None  # not written yet
    store.write_segment_keys([[7, -9], [5], [-9, 4]])  # a short row repeats its last key
    assert store.segment_keys().tolist() == [[7, -9], [5, 5], [-9, 4]] and store.attrs["segment_keys"] is True
    assert store.block_arrays() == block_arrays(storage_dtype)


def test_the_table_names_each_array_once_per_storage_dtype():
    assert [s.name for s in TOKEN_ARRAYS] == ["input_ids", "loss_mask", "position_ids"]
    assert block_arrays("bf16") == ["input_ids", "loss_mask", "position_ids", "cu_seqlens", "aux_hidden",
                                    "final_hidden"]
    assert block_arrays("fp8") == ["input_ids", "loss_mask", "position_ids", "cu_seqlens", "aux_hidden",
                                   "aux_scale", "final_hidden", "final_scale"]
    for dtype in ("bf16", "fp8"):
        names = [s.name for s in store_arrays(dtype)]
        assert len(names) == len(set(names))
    assert {s.name for s in ARRAYS if s.storage is None} == {"input_ids", "loss_mask", "position_ids", "n_tokens",
                                                             "cu_seqlens", "done", "token_freq"}


def test_bytes_per_token_counts_hidden_states_and_token_arrays():
    # bf16: L*H*2 + H*2 + input_ids 4 + loss_mask 1 + position_ids 4
    assert bytes_per_token(3, 64, "bf16") == 3 * 64 * 2 + 64 * 2 + 9
    # fp8: codes L*H + scales L*4 + final codes H + final scale 4 + 9
    assert bytes_per_token(3, 64, "fp8") == 3 * 64 + 3 * 4 + 64 + 4 + 9


def test_a_token_row_round_trips_through_the_schema(tmp_path):
    store = FeatureStore.create(tmp_path / "s.zarr", n_blocks=2, block_size=6, max_segments=2, layers=[1],
                                hidden_size=2, vocab_size=8, verifier={"name_or_path": "tiny"})
    row = {"input_ids": np.array([3, 4, 5, 6]), "loss_mask": [0, 1, 0, 1], "position_ids": [0, 1, 0, 1],
           "cu_seqlens": [0, 2, 4], "segment_ids": ["a#0", "b#0"]}  # other packed columns are ignored
    store.write_token_row(1, row)
    store.write_all_n_tokens(np.array([0, 4]))
    assert store.group["input_ids"][1].tolist() == [3, 4, 5, 6, 0, 0]  # padded to C
    assert store.group["cu_seqlens"][1].tolist() == [0, 2, 4]
    tok = FeatureStore.open(tmp_path / "s.zarr").read_tokens(1, via="zarr")
    assert {k: v.tolist() for k, v in tok.items()} == {"input_ids": [3, 4, 5, 6], "loss_mask": [0, 1, 0, 1],
                                                       "position_ids": [0, 1, 0, 1], "cu_seqlens": [0, 2, 4]}
    with pytest.raises(ValueError, match="7 tokens > block_size 6"):
        store.write_token_row(0, {**row, "input_ids": np.arange(7)})


def test_block_flat_layers_and_to():
    T, L, H = 3, 2, 4
    aux = torch.arange(T * L * H, dtype=torch.float32).reshape(T, L, H).bfloat16()
    b = Block(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1]), torch.tensor([0, 1, 2]), torch.tensor([0, 3]),
              aux, torch.zeros(T, H, dtype=torch.bfloat16))
    flat = b.flat_layers(block_id=5)
    assert flat.block_id == 5 and b.block_id == -1 and flat.n_tokens == 3
    assert flat.aux_hidden.shape == (T, L * H) and flat.aux_hidden[1].tolist() == aux[1].reshape(-1).tolist()
    assert sorted(flat.to("cpu").tensors()) == ["aux_hidden", "cu_seqlens", "final_hidden", "input_ids",
                                                "loss_mask", "position_ids"]
