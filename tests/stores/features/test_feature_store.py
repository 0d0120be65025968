"""Feature store round trips: bf16 bits, mmap == zarr API, done flags, verify."""

import uuid

import numpy as np
import pytest
import torch
import zarr

from stores.errors import OutputExistsError, StoreFormatError
from stores.features.feature_repair import repair_blocks, verify_store
from stores.features.feature_store import BlockStore, ContextBlocks, FeatureStore, FullContextStore, open_store


def _make(tmp_path, n_blocks=3, C=8, L=2, H=4):
    return FeatureStore.create(tmp_path / "s.zarr", n_blocks=n_blocks, block_size=C, max_segments=3,
                               layers=list(range(L)), hidden_size=H, vocab_size=16,
                               verifier={"name_or_path": "tiny"})


def _special_bf16(T, L, H):
    x = (torch.arange(T * L * H, dtype=torch.float32).reshape(T, L, H) - 7).to(torch.bfloat16)
    x[0, 0, 0] = 70000.0  # above float16's 65504
    x[0, 0, 1] = -0.0
    x[0, 0, 2] = float("inf")
    x[0, 0, 3] = -1e-40  # subnormal in bf16
    return x


def test_bf16_round_trip_is_bit_exact_on_both_paths(tmp_path):
    store = _make(tmp_path)
    aux, fin = _special_bf16(5, 2, 4), _special_bf16(5, 1, 4)[:, 0]
    store.write_tokens(1, [5, 6, 7, 8, 9], [0, 1, 1, 0, 1], [0, 1, 2, 0, 1], [0, 3, 5])
    store.write_all_n_tokens(np.array([0, 5, 0]))
    store.write_features(1, aux, fin)
    store.mark_done(1)
    reopened = FeatureStore.open(tmp_path / "s.zarr")
    for via in ("mmap", "zarr"):
        b = reopened.read_block(1, via=via)
        assert torch.equal(b.aux_hidden.view(torch.int16), aux.view(torch.int16))
        assert torch.equal(b.final_hidden.view(torch.int16), fin.view(torch.int16))
        assert b.input_ids.tolist() == [5, 6, 7, 8, 9]
        assert b.loss_mask.tolist() == [0, 1, 1, 0, 1]
        assert b.position_ids.tolist() == [0, 1, 2, 0, 1]
        assert b.cu_seqlens.tolist() == [0, 3, 5]
    assert reopened.missing_blocks() == [0, 2]


def test_create_refuses_existing_store_without_force(tmp_path):
    _make(tmp_path)
    with pytest.raises(OutputExistsError):
        _make(tmp_path)


def test_open_refuses_a_non_store(tmp_path):
    with pytest.raises(StoreFormatError):
        FeatureStore.open(tmp_path)


def _three_done_blocks(tmp_path) -> FeatureStore:
    store = _make(tmp_path)
    store.write_all_n_tokens(np.array([4, 4, 4]))
    for i in range(3):
        store.write_tokens(i, [1, 2, 3, 4], [0, 1, 1, 1], [0, 1, 2, 3], [0, 4])
        store.write_features(i, torch.ones(4, 2, 4, dtype=torch.bfloat16), torch.ones(4, 4, dtype=torch.bfloat16))
        store.mark_done(i)
    return store


def test_resume_removes_the_temporary_files_of_a_killed_write_of_its_not_done_blocks_only(tmp_path):
    """A SIGKILL inside zarr's chunk write leaves ``NAME.<uuid4 hex>.partial`` beside the chunk (zarr 3.1
    ``storage/_local.py``, the name made as zarr makes it); --resume's repair removes those of the blocks it
    will write again, never those of a done block (a trainer evicting it writes its flag) nor other files."""
    store = _three_done_blocks(tmp_path)
    store.clear_done(1)  # block 1: killed while being written
    root = tmp_path / "s.zarr"
    leftovers = [(root / "aux_hidden/c/1/0/0/0").with_suffix(f".{uuid.uuid4().hex}.partial"),
                 (root / "done/c/1").with_suffix(f".{uuid.uuid4().hex}.partial")]
    kept = [(root / "done/c/0").with_suffix(f".{uuid.uuid4().hex}.partial"),
            (root / "aux_hidden/c/0/0/0/0").with_suffix(f".{uuid.uuid4().hex}.partial"),
            root / "aux_hidden/c/1/0/0/notes.partial"]
    (root / "aux_hidden/c/1/0/0").mkdir(parents=True, exist_ok=True)
    for path in leftovers + kept:
        path.write_bytes(b"\x00" * 8)
    assert sorted(store.write_leftovers([1])) == sorted(leftovers)
    said = []
    rows = [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1], "position_ids": [0, 1, 2, 3], "cu_seqlens": [0, 4]}] * 3
    assert repair_blocks(store, rows, 0, 1, said.append) == {}
    assert [p.exists() for p in leftovers] == [False, False] and all(p.exists() for p in kept)
    assert said == [f"{store.path}: removed 2 temporary chunk files of writes a killed run left (e.g. {leftovers[0]})"]


def test_verify_detects_corrupt_and_truncated_chunks(tmp_path):
    _three_done_blocks(tmp_path)
    assert verify_store(tmp_path / "s.zarr")["ok"]
    chunk = tmp_path / "s.zarr" / "aux_hidden" / "c" / "1" / "0" / "0" / "0"
    data = bytearray(chunk.read_bytes())
    data[3] ^= 0xFF
    chunk.write_bytes(bytes(data))
    trunc = tmp_path / "s.zarr" / "final_hidden" / "c" / "2" / "0" / "0"
    trunc.write_bytes(trunc.read_bytes()[:-10])
    report = verify_store(tmp_path / "s.zarr")
    assert not report["ok"]
    assert sorted(report["bad_blocks"]) == [1, 2]


def test_fp8_store_halves_bytes_and_bounds_error(tmp_path):
    kw = dict(n_blocks=1, block_size=16, max_segments=1, layers=[0, 1, 2], hidden_size=64, vocab_size=16,
              verifier={"name_or_path": "tiny"})
    bf16 = FeatureStore.create(tmp_path / "b.zarr", **kw)
    fp8 = FeatureStore.create(tmp_path / "f.zarr", storage_dtype="fp8", **kw)
    hidden_b = bf16.bytes_per_token() - 9
    hidden_f = fp8.bytes_per_token() - 9
    assert hidden_f == 4 * 64 + 4 * 4  # 4 vectors of 64 one-byte codes + 4 float32 scales
    assert hidden_b == 4 * 64 * 2
    torch.manual_seed(0)
    aux = (torch.randn(16, 3, 64) * torch.logspace(-2, 2, 16)[:, None, None]).to(torch.bfloat16)
    fin = torch.randn(16, 64).to(torch.bfloat16)
    fp8.write_tokens(0, list(range(16)), [1] * 16, list(range(16)), [0, 16])
    fp8.write_all_n_tokens(np.array([16]))
    fp8.write_features(0, aux, fin)
    fp8.mark_done(0)
    for via in ("mmap", "zarr"):
        b = FeatureStore.open(tmp_path / "f.zarr").read_block(0, via=via)
        assert b.aux_hidden.dtype == torch.bfloat16 and b.aux_hidden.shape == (16, 3, 64)
        rel = (b.aux_hidden.float() - aux.float()).norm(dim=-1) / aux.float().norm(dim=-1)
        assert rel.max() < 0.05  # e4m3 keeps 3 mantissa bits: ~2-3% relative error per vector
        rel_f = (b.final_hidden.float() - fin.float()).norm(dim=-1) / fin.float().norm(dim=-1)
        assert rel_f.max() < 0.05
    assert verify_store(tmp_path / "f.zarr")["ok"]


class StoreContract:
    """What every store backend must do; subclasses say how to make one."""

    def make(self, tmp_path, **kw) -> FeatureStore:
        raise NotImplementedError

    def test_round_trip_and_flags(self, tmp_path):
        self.round_trip(tmp_path)

    def round_trip(self, tmp_path) -> FeatureStore:
        store = self.make(tmp_path, n_blocks=2, block_size=6, max_segments=2, layers=[0, 1], hidden_size=4,
                          vocab_size=16, verifier={"name_or_path": "tiny"})
        aux = _special_bf16(5, 2, 4)
        fin = _special_bf16(5, 1, 4)[:, 0]
        store.write_tokens(0, [1, 2, 3, 4, 5], [0, 0, 1, 1, 1], [0, 1, 2, 0, 1], [0, 3, 5])
        store.write_all_n_tokens(np.array([5, 0]))
        store.write_features(0, aux, fin)
        store.mark_done(0)
        again = FeatureStore.open(store.path)
        assert again.missing_blocks() == [1]
        b = again.read_block(0)
        assert torch.equal(b.aux_hidden.view(torch.int16), aux.view(torch.int16))
        assert torch.equal(b.final_hidden.view(torch.int16), fin.view(torch.int16))
        assert b.cu_seqlens.tolist() == [0, 3, 5] and b.position_ids.tolist() == [0, 1, 2, 0, 1]
        ref = again.read_block(0, via="zarr")  # the zarr API path is the reference for every backend
        assert torch.equal(b.aux_hidden.view(torch.int16), ref.aux_hidden.view(torch.int16))
        return again


class TestLocalMemoryMapped(StoreContract):
    def make(self, tmp_path, **kw):
        return FeatureStore.create(tmp_path / "s.zarr", **kw)

    def test_uses_mmap(self, tmp_path):
        assert self.round_trip(tmp_path).raw_chunks


class TestLocalCompressed(StoreContract):
    def make(self, tmp_path, **kw):
        return FeatureStore.create(tmp_path / "s.zarr", compressor="zstd", **kw)

    def test_reads_through_zarr(self, tmp_path):
        store = self.round_trip(tmp_path)
        assert not store.raw_chunks
        with pytest.raises(StoreFormatError):
            store.read_block(0, via="mmap")


class TestFsspecUrl(StoreContract):
    def make(self, tmp_path, **kw):
        return FeatureStore.create(f"memory://peagle-test/{tmp_path.name}", **kw)

    def test_refuses_existing_url_without_force(self, tmp_path):
        self.round_trip(tmp_path)
        with pytest.raises(OutputExistsError):
            self.make(tmp_path, n_blocks=1, block_size=2, max_segments=1, layers=[0], hidden_size=4,
                      vocab_size=16, verifier={"name_or_path": "tiny"})


def test_missing_chunk_of_a_done_block_is_damage_not_zeros(tmp_path):
    _three_done_blocks(tmp_path)
    import shutil
    shutil.rmtree(tmp_path / "s.zarr" / "aux_hidden" / "c" / "1")
    (tmp_path / "s.zarr" / "input_ids" / "c" / "2" / "0").unlink()
    reopened = FeatureStore.open(tmp_path / "s.zarr")
    for via in ("mmap", "zarr"):
        with pytest.raises(StoreFormatError, match="missing"):
            reopened.read_block(1, via=via)
    report = verify_store(tmp_path / "s.zarr")
    assert not report["ok"] and sorted(report["bad_blocks"]) == [1, 2]


@pytest.mark.parametrize("storage_dtype", ["bf16", "fp8"])
def test_file_path_equals_zarr_path_on_partial_and_full_blocks(tmp_path, storage_dtype):
    """The direct chunk-file reader returns exactly the zarr API's tensors, block by block and in
    ``read_blocks`` order, for blocks shorter than block_size, full ones and several segments."""
    C, L, H = 8, 2, 4
    store = FeatureStore.create(tmp_path / "s.zarr", n_blocks=4, block_size=C, max_segments=3,
                                layers=list(range(L)), hidden_size=H, vocab_size=64,
                                verifier={"name_or_path": "tiny"}, storage_dtype=storage_dtype)
    g = torch.Generator().manual_seed(0)
    lengths = [5, 8, 1, 7]
    cus = [[0, 3, 5], [0, 8], [0, 1], [0, 2, 4, 7]]
    store.write_all_n_tokens(np.array(lengths))
    for i, (T, cu) in enumerate(zip(lengths, cus)):
        store.write_tokens(i, torch.randint(0, 64, (T,), generator=g).tolist(),
                           torch.randint(0, 2, (T,), generator=g).tolist(), list(range(T)), cu)
        store.write_features(i, torch.randn(T, L, H, generator=g).to(torch.bfloat16),
                             torch.randn(T, H, generator=g).to(torch.bfloat16))
        store.mark_done(i)
    reopened = FeatureStore.open(tmp_path / "s.zarr")
    got = reopened.read_blocks([3, 0, 2, 1], via="file")
    for i, b in zip([3, 0, 2, 1], got):
        ref = reopened.read_block(i, via="zarr")
        assert b.cu_seqlens.tolist() == cus[i] and b.n_tokens == lengths[i]
        for f in ("input_ids", "loss_mask", "position_ids", "cu_seqlens"):
            assert getattr(b, f).dtype == torch.int64 and torch.equal(getattr(b, f), getattr(ref, f)), f
        for f in ("aux_hidden", "final_hidden"):
            assert getattr(b, f).dtype == torch.bfloat16
            assert torch.equal(getattr(b, f).view(torch.int16), getattr(ref, f).view(torch.int16)), f
        assert {k: v.tolist() for k, v in reopened.read_tokens(i, via="file").items()} == \
            {k: v.tolist() for k, v in reopened.read_tokens(i, via="zarr").items()}
    reopened.close()


def test_file_path_rejects_a_truncated_chunk_with_its_path(tmp_path):
    _three_done_blocks(tmp_path)
    chunk = tmp_path / "s.zarr" / "final_hidden" / "c" / "2" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-6])
    store = FeatureStore.open(tmp_path / "s.zarr")
    store.read_block(1, via="file")  # the others still read
    with pytest.raises(StoreFormatError, match=r"final_hidden/c/2/0/0: \d+ bytes, expected"):
        store.read_block(2, via="file")
    with pytest.raises(ValueError, match="via"):
        store.read_block(1, via="mmapp")


def _tiny_full_context_store(tmp_path):
    """A full-context store: 2 context blocks of 10 slots; one training block of 2 segments, (5
    tokens: a 2-token prefix at context block 0 slot 0, its body at slot 4) and (3 tokens, no prefix,
    context block 1 slot 2)."""
    L, H = 2, 4
    store = FeatureStore.create_windows(tmp_path / "w.zarr", n_blocks=1, block_size=8, max_segments=2,
                                        n_context_blocks=2, context_size=10, context_segments=1,
                                        layers=list(range(L)), hidden_size=H, vocab_size=16,
                                        verifier={"name_or_path": "tiny"})
    g = torch.Generator().manual_seed(0)
    store.write_all_n_tokens(np.array([8]))
    store.write_tokens(0, list(range(8)), [1] * 8, [0, 1, 2, 3, 4, 0, 1, 2], [0, 5, 8])
    store.write_views(0, [[0, 0, 2, 4], [1, 0, 0, 2]])
    ctx = store.contexts
    ctx.write_all_n_tokens(np.array([10, 10]))
    feats = []
    for m in range(2):
        aux, fin = torch.randn(10, L, H, generator=g).to(torch.bfloat16), torch.randn(10, H, generator=g).to(torch.bfloat16)
        ctx.write_tokens(m, list(range(10)), [1] * 10, list(range(10)), [0, 10])
        ctx.write_features(m, aux, fin)
        ctx.mark_done(m)
        feats.append((aux, fin))
    store.update_attrs(tokens_written=True)
    rows = [(0, 0, 2), (0, 4, 3), (1, 2, 3)]  # (context block, first slot, tokens) in token order
    expected = tuple(torch.cat([feats[m][k][s:s + n] for m, s, n in rows]) for k in range(2))
    return FeatureStore.open(tmp_path / "w.zarr"), rows, expected


def test_full_context_store_reads_its_views_on_both_paths(tmp_path):
    store, rows, (aux, fin) = _tiny_full_context_store(tmp_path)
    assert store.runs(0, [0, 5, 8]) == rows
    for via in ("file", "zarr"):
        b = store.read_block(0, via=via)
        assert b.input_ids.tolist() == list(range(8)) and b.cu_seqlens.tolist() == [0, 5, 8]
        assert torch.equal(b.aux_hidden.view(torch.int16), aux.view(torch.int16))
        assert torch.equal(b.final_hidden.view(torch.int16), fin.view(torch.int16))


def test_full_context_file_path_rejects_a_truncated_or_missing_context_chunk_with_its_path(tmp_path):
    store, _, _ = _tiny_full_context_store(tmp_path)
    chunk = tmp_path / "w.zarr" / "contexts" / "aux_hidden" / "c" / "1" / "0" / "0" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-6])
    with pytest.raises(StoreFormatError, match=r"contexts/aux_hidden/c/1/0/0/0: \d+ bytes, expected"):
        store.read_block(0, via="file")
    chunk.unlink()
    with pytest.raises(StoreFormatError, match=r"contexts/aux_hidden/c/1/0/0/0: chunk file is missing"):
        store.read_block(0, via="file")


def _flip(chunk, at=3):
    """Overwrite byte ``at`` of a chunk file in place (same size: only its crc32c can tell)."""
    data = bytearray(chunk.read_bytes())
    data[at] ^= 0xFF
    chunk.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["aux_hidden", "final_hidden", "input_ids", "loss_mask", "position_ids", "cu_seqlens"])
def test_a_chunk_altered_in_place_is_refused_on_both_paths_naming_block_and_repair(tmp_path, name):
    """A same-size overwrite of a done block's chunk (bytes past its n_tokens too: the crc32c covers the
    whole chunk) is refused by every read, naming the block, the chunk file and the repair command."""
    _three_done_blocks(tmp_path)
    parts = {"aux_hidden": 3, "final_hidden": 2}.get(name, 1)
    chunk = tmp_path / "s.zarr" / name / "c" / "1" / "/".join(["0"] * parts)
    size = chunk.stat().st_size
    _flip(chunk, at=size - 6)  # a padding slot (block_size 8, n_tokens 4) or the last data byte
    store = FeatureStore.open(tmp_path / "s.zarr")
    assert torch.equal(store.read_block(0).aux_hidden, torch.ones(4, 2, 4, dtype=torch.bfloat16))
    for via in ("file", "zarr"):
        with pytest.raises(StoreFormatError) as e:
            store.read_block(1, via=via)
        msg = str(e.value)
        assert msg.startswith(f"{tmp_path / 's.zarr'}: block 1 cannot be trusted: ")
        assert f"{name}/c/1/" in msg  # the chunk file, on both paths
        assert ("crc32c checksum does not match" if via == "file" else "checksum do not match") in msg
        assert "peagle-data extract PACKED --context window --resume --output" in msg
        assert f"peagle-data verify {tmp_path / 's.zarr'}" in msg
    assert sorted(verify_store(tmp_path / "s.zarr")["bad_blocks"]) == [1]


def test_repair_command_uses_the_recorded_extract_options(tmp_path):
    store = _three_done_blocks(tmp_path)
    store.update_attrs(config={"packed": "p", "output": str(tmp_path / "s.zarr")})
    _flip(tmp_path / "s.zarr" / "aux_hidden" / "c" / "2" / "0" / "0" / "0")
    with pytest.raises(StoreFormatError, match=r"block 2 cannot be trusted: .*`peagle-data inspect .*s\.zarr > "
                                               r"store\.json && peagle-data extract --config store\.json --resume`"):
        FeatureStore.open(tmp_path / "s.zarr").read_block(2)


@pytest.mark.parametrize("name", ["aux_hidden", "final_hidden"])
def test_full_context_store_refuses_an_altered_context_chunk_also_after_a_first_read(tmp_path, name):
    """A training block reads runs of slots of a context chunk; the chunk's crc32c is checked whole
    (once per file state), so an overwrite of bytes no view reads, made after a first good read,
    is still refused, naming the training block, the context block and its chunk file."""
    store, rows, (aux, fin) = _tiny_full_context_store(tmp_path)
    assert torch.equal(store.read_block(0, via="file").aux_hidden.view(torch.int16), aux.view(torch.int16))
    parts = 3 if name == "aux_hidden" else 2
    chunk = tmp_path / "w.zarr" / "contexts" / name / "c" / "1" / "/".join(["0"] * parts)
    _flip(chunk, at=1)  # slot 0 of context block 1: outside every view (block 1 is read from slot 2)
    for via in ("file", "zarr"):
        with pytest.raises(StoreFormatError) as e:
            store.read_block(0, via=via)
        msg = str(e.value)
        assert msg.startswith(f"{tmp_path / 'w.zarr'}: training block 0 cannot be trusted: ")
        assert (f"context block 1: {chunk}: its crc32c checksum does not match its data" if via == "file" else
                f"context block 1: {name} chunk {chunk} is unreadable (ValueError: Stored and computed checksum") in msg
        assert "peagle-data extract PACKED --context full --resume --output" in msg
    _flip(chunk, at=1)  # restored: the file changed again, so it is checked again and reads
    assert torch.equal(store.read_block(0, via="file").final_hidden.view(torch.int16), fin.view(torch.int16))


def test_full_context_store_refuses_an_altered_training_token_chunk(tmp_path):
    store, _, _ = _tiny_full_context_store(tmp_path)
    _flip(tmp_path / "w.zarr" / "loss_mask" / "c" / "0" / "0", at=0)
    for via in ("file", "zarr"):
        with pytest.raises(StoreFormatError, match="training block 0 cannot be trusted"):
            store.read_block(0, via=via)


def test_whole_conversations_tells_a_whole_conversation_from_a_window(tmp_path):
    """Segment 0 has a prefix (a later window of a long conversation); segment 1 is context block 1's second
    conversation, slots 2..4, whole; the same 3 tokens from slot 3 would be a window; a blocks store: unknown."""
    store = FeatureStore.create_windows(tmp_path / "w.zarr", n_blocks=1, block_size=8, max_segments=2,
                                        n_context_blocks=2, context_size=10, context_segments=3,
                                        layers=[0, 1], hidden_size=4, vocab_size=16, verifier={"name_or_path": "tiny"})
    store.write_all_n_tokens(np.array([8]))
    store.write_tokens(0, list(range(8)), [1] * 8, [0, 1, 2, 3, 4, 0, 1, 2], [0, 5, 8])
    store.write_views(0, [[0, 0, 2, 4], [1, 0, 0, 2]])
    ctx = store.contexts
    ctx.write_all_n_tokens(np.array([10, 10]))
    for m in range(2):
        ctx.write_tokens(m, list(range(10)), [1] * 10, list(range(10)), [0, 10] if m == 0 else [0, 2, 5, 10])
    assert store.whole_conversations(0, [0, 5, 8]).tolist() == [False, True]
    store.write_views(0, [[0, 0, 2, 4], [1, 0, 0, 3]])
    assert store.whole_conversations(0, [0, 5, 8]).tolist() == [False, False]
    assert _make(tmp_path / "b").whole_conversations(0, [0, 8]) is None


def test_open_returns_the_type_of_each_layout_which_answers_what_callers_ask(tmp_path):
    """Each layout opens as its type, which answers the CLI's ``--context``, whether its blocks are views and
    which blocks the verifier runs; the attributes on disk stay those of formats 1 and 2; a store of another
    layout than the type asked for, a sub-store alone and an unknown layout are refused."""
    _make(tmp_path)
    FeatureStore.create_windows(tmp_path / "w.zarr", n_blocks=1, block_size=8, max_segments=2, n_context_blocks=2,
                                context_size=10, context_segments=1, layers=[0, 1], hidden_size=4, vocab_size=16,
                                verifier={"name_or_path": "tiny"})
    b, w = open_store(tmp_path / "s.zarr"), FeatureStore.open(tmp_path / "w.zarr")
    assert (type(b), type(w), type(w.contexts)) == (BlockStore, FullContextStore, ContextBlocks)
    assert [(s.context, s.has_views, s.holds_segments) for s in (b, w, w.contexts)] == [
        ("window", False, True), ("full", True, True), ("full", False, False)]
    assert b.verifier_blocks is b and w.verifier_blocks is w.contexts and b.contexts is None
    assert "layout" not in b.attrs and b.attrs["format_version"] == 1
    assert (w.attrs["format_version"], w.attrs["layout"], w.contexts.attrs["layout"]) == (2, "windows", "contexts")
    assert b.whole_conversations(0, [0, 8]) is None
    FeatureStore.open(tmp_path / "w.zarr", mode="r+").update_attrs(tokens_written=True)  # the sub-store's too
    assert FeatureStore.open(tmp_path / "w.zarr").contexts.attrs["tokens_written"] is True
    with pytest.raises(StoreFormatError, match="has no segment views"):
        b.views()
    assert isinstance(BlockStore.open(tmp_path / "s.zarr"), BlockStore)
    with pytest.raises(StoreFormatError, match=r"a --context window store \(BlockStore\), not a FullContextStore"):
        FullContextStore.open(tmp_path / "s.zarr")
    with pytest.raises(StoreFormatError, match="is the context sub-store of the full-context store"):
        FeatureStore.open(tmp_path / "w.zarr" / "contexts")
    group = zarr.open_group(str(tmp_path / "s.zarr"), mode="r+")
    group.attrs["peagle"] = {**group.attrs["peagle"], "layout": "rows"}
    with pytest.raises(StoreFormatError, match="layout 'rows'.*made by a newer peagle"):
        FeatureStore.open(tmp_path / "s.zarr")
