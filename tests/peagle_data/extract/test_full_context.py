"""Full-context extraction (docs/design.md §7, ``extract --context full``).

- Every stored token's features equal a transformers forward of its whole conversation up to that
  token, at every stored layer and the final slot, within bf16 rounding, for every family of the tiny
  matrix (sliding-window, chunked and soft-capped ones included) and for SmolLM2; the windows read back
  from the store are slices of that forward.
- A conversation longer than ``--max-context`` is cut into the pieces the plan says, and its windows
  equal the forward of their piece.
- A killed extraction resumes byte-identical; a resume with another ``--max-context`` and a table
  without conversations are refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from peagle_data.extract.config import ExtractConfig
from peagle_data.extract.run import run_extract
from peagle_data.prepare.packing import make_packed_row, pack_blocks_flexible
from peagle_data.prepare.windows import make_windows, trim_window
from stores.errors import InputError, StoreMismatchError
from stores.features.feature_repair import verify_store
from stores.features.feature_store import CONTEXTS, FeatureStore
from stores.staging import prepare_output_dir
from stores.tables.token_rows import TokenizedRow
from stores.tables.token_tables import CONVERSATIONS, TableWriter, TokenTable, conversations_record, write_manifest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))
from families import FAMILIES, HYBRID, build_family, hidden_states_as_stored, save_family  # noqa: E402
from processes import kill_runs  # noqa: E402

from .test_run import window_ends  # noqa: E402

LAYERS = [0, 1, 2]
SHAPES = [(10, 3), (40, 3), (70, 4), (14, 0), (30, 0)]
"""(tokens, system_len) of the synthetic conversations: one whole window, two split into windows of 16."""


def synthetic_conversations(vocab: int, seed: int = 0, shapes=SHAPES) -> list[TokenizedRow]:
    """Random conversations: ids in ``3..vocab-3``, a loss mask of density 0.7 (0 on the system prefix)."""
    g = np.random.default_rng(seed)
    rows = []
    for c, (T, P) in enumerate(shapes):
        ids = g.integers(3, vocab - 3, T).astype(np.int32)
        mask = (g.random(T) < 0.7).astype(np.uint8)
        mask[:P] = 0
        rows.append(TokenizedRow(f"c{c}", f"synthetic:{c + 1}", ids, mask, P, T, int(mask.sum())))
    return rows


def write_packed_conversations(directory: Path, rows: list[TokenizedRow], max_seq_len: int, block_size: int,
                               tokenizer: str = "none", max_windows: int | None = None) -> Path:
    """A packed table with its conversations sub-table, cut and packed by pack's own functions
    (windows, best-fit with trimming) the way ``peagle-data pack`` writes it; ``max_windows`` keeps
    only the first windows of each conversation (``pack --max-windows``)."""
    prepare_output_dir(directory, force=True)
    (directory / CONVERSATIONS).mkdir()
    windows = []
    with TableWriter(directory / CONVERSATIONS, "tokenized") as w:
        for r in rows:
            w.write(r)
            windows += [(f"{r.conversation_id}#{win.index}", win)
                        for win in make_windows(r.input_ids, r.loss_mask, r.system_len, max_seq_len)[:max_windows]]
    write_manifest(directory / CONVERSATIONS, {"kind": "tokenized"})
    blocks, used = pack_blocks_flexible([w.n_tokens for _, w in windows],
                                        [w.n_tokens - w.trimmable for _, w in windows], block_size)
    with TableWriter(directory, "packed") as w:
        for b, members in enumerate(blocks):
            segments = []
            for i in members:
                sid, win = windows[i]
                ids, mask = trim_window(win.input_ids, win.loss_mask, win.prefix_len, used[i])
                segments.append((sid, ids, mask))
            row = make_packed_row(b, segments)
            row.segment_prefix_lens = [windows[i][1].prefix_len for i in members]
            row.segment_starts = [windows[i][1].prefix_len + windows[i][1].body_start + windows[i][1].n_tokens - used[i]
                                  for i in members]
            w.write(row)
    write_manifest(directory, {"kind": "packed", "inputs": ["synthetic"], "parameters": {"block_size": block_size},
                               "tokenizer": {"name_or_path": tokenizer}, CONVERSATIONS: conversations_record(directory)})
    return directory


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((got.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)).max())


def worst_against_full_forward(store: FeatureStore, packed: Path, model, rows: list[TokenizedRow],
                               layers: list[int] = LAYERS) -> float:
    """Largest per-token relative difference between every training block's stored features and a
    forward of each segment's whole conversation at the segment's conversation positions."""
    by_id = {r.conversation_id: r for r in rows}
    forwards = {}
    worst = 0.0
    for b, prow in enumerate(TokenTable.open(packed).iter_rows()):
        block = store.read_block(b)
        assert torch.equal(block.input_ids, torch.from_numpy(prow["input_ids"].astype(np.int64)))
        cu = prow["cu_seqlens"]
        for k, sid in enumerate(prow["segment_ids"]):
            conv = by_id[sid.rpartition("#")[0]]
            if conv.conversation_id not in forwards:
                ids = torch.from_numpy(conv.input_ids.astype(np.int64))[None]
                forwards[conv.conversation_id] = hidden_states_as_stored(model, input_ids=ids)
            alone, out = forwards[conv.conversation_id]
            p, s, n = prow["segment_prefix_lens"][k], prow["segment_starts"][k], cu[k + 1] - cu[k]
            where = np.r_[0:p, s:s + n - p]  # the segment's tokens in its conversation
            lo, hi = cu[k], cu[k + 1]
            for j, layer in enumerate(layers):
                worst = max(worst, _relative(block.aux_hidden[lo:hi, j], alone[layer][0][where]))
            worst = max(worst, _relative(block.final_hidden[lo:hi], out.hidden_states[-1][0][where]))
    return worst


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family", FAMILIES + HYBRID)  # a hybrid: each context of a context block its own row
def test_every_token_equals_its_whole_conversation_forward(tmp_path, family):
    rows = synthetic_conversations(512)
    packed = write_packed_conversations(tmp_path / "packed", rows, max_seq_len=16, block_size=32)
    verifier = save_family(family, tmp_path / "verifier")
    summary = run_extract(ExtractConfig(packed=str(packed), verifier=str(verifier), output=str(tmp_path / "f.zarr"),
                                        layers=LAYERS, device="cpu", context="full", max_context=128),
                          progress=False, log=lambda m: None)
    assert summary["complete"] and summary["context"]["conversations_split"] == 0
    assert summary["context"]["tokens_extracted"] == sum(len(r.input_ids) for r in rows)  # each token once
    store = FeatureStore.open(tmp_path / "f.zarr")
    # training and context blocks counted apart, each under its own name (issue 34: the JSON mixed them)
    assert (summary["training_blocks"], summary["training_blocks_done"], summary["training_blocks_done_this_run"]) \
        == (store.n_blocks,) * 3
    assert (summary["context_blocks"], summary["context_blocks_done"], summary["context_blocks_done_this_run"]) \
        == (store.contexts.n_blocks,) * 3
    assert summary["verifier_tokens_this_run"] == summary["context"]["tokens_extracted"]
    assert summary["training_tokens"] == store.n_tokens
    assert store.layout == "windows" and store.attrs["format_version"] == 2
    worst = worst_against_full_forward(store, packed, build_family(family), rows)
    assert worst < 4e-3, f"{family}: worst relative difference {worst:.4f} (bf16 rounding is ≤ 2^-8 = 3.9e-3)"
    assert verify_store(tmp_path / "f.zarr")["ok"]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family", ["llama31", "gemma2"])  # gemma2: sliding-window layers, soft-capped logits
def test_tokens_no_window_reads_are_not_run(tmp_path, family):
    """With only each conversation's first window packed (``pack --max-windows 1``) a context ends at its
    window's last token: the verifier runs the tokens the windows read and no others, and they equal a
    forward of the whole conversation (the default --context full)."""
    rows = synthetic_conversations(512)
    packed = write_packed_conversations(tmp_path / "packed", rows, max_seq_len=16, block_size=32, max_windows=1)
    verifier = save_family(family, tmp_path / "verifier")
    summary = run_extract(ExtractConfig(packed=str(packed), verifier=str(verifier), output=str(tmp_path / "f.zarr"),
                                        layers=LAYERS, device="cpu", max_context=128),
                          progress=False, log=lambda m: None)
    assert window_ends(packed) == {"c0": 10, "c1": 16, "c2": 16, "c3": 14, "c4": 16}  # c1, c2, c4 are longer: 40, 70, 30 tokens
    assert summary["complete"] and summary["context"]["tokens_extracted"] == 72 < sum(len(r.input_ids) for r in rows)
    store = FeatureStore.open(str(tmp_path / "f.zarr"))
    assert store.layout == "windows" and store.contexts.n_tokens == 72
    worst = worst_against_full_forward(store, packed, build_family(family), rows)
    assert worst < 4e-3, f"{family}: worst relative difference {worst:.4f} (bf16 rounding is ≤ 2^-8 = 3.9e-3)"
    assert verify_store(tmp_path / "f.zarr")["ok"]


@pytest.mark.usefixtures("one_thread")
def test_a_conversation_past_max_context_reads_its_pieces(tmp_path):
    rows = synthetic_conversations(512)
    packed = write_packed_conversations(tmp_path / "packed", rows, max_seq_len=16, block_size=32)
    verifier = save_family("llama31", tmp_path / "verifier")
    base = dict(packed=str(packed), verifier=str(verifier), layers=LAYERS, device="cpu")
    summary = run_extract(ExtractConfig(**base, output=str(tmp_path / "f.zarr"), context="full", max_context=48),
                          progress=False, log=lambda m: None)
    # c2 (70 tokens, system prefix 4) is cut into pieces of 4 + 44 body tokens at body offsets 0 and 22
    # (window_starts at 48, overlap 0.5); the other four conversations run whole
    assert {k: summary["context"][k] for k in ("conversations", "conversations_split", "contexts", "tokens_extracted")} \
        == {"conversations": 5, "conversations_split": 1, "contexts": 6, "tokens_extracted": 10 + 40 + 48 + 48 + 14 + 30}
    store = FeatureStore.open(tmp_path / "f.zarr")
    grid = store.contexts
    c2 = rows[2].input_ids
    pieces = {tuple(c2[np.r_[0:4, 4:48]]), tuple(c2[np.r_[0:4, 26:70]])}
    contexts = set()
    model = build_family("llama31")
    for m in range(grid.n_blocks):
        block = grid.read_block(m)
        cu = block.cu_seqlens.tolist()
        for lo, hi in zip(cu[:-1], cu[1:]):
            ids = block.input_ids[lo:hi]
            contexts.add(tuple(ids.tolist()))
            alone, out = hidden_states_as_stored(model, input_ids=ids[None])  # each context alone
            for j, layer in enumerate(LAYERS):
                assert _relative(block.aux_hidden[lo:hi, j], alone[layer][0]) < 4e-3
            assert _relative(block.final_hidden[lo:hi], out.hidden_states[-1][0]) < 4e-3
    assert pieces <= contexts
    # every window of c2 reads a piece that holds it whole, with the piece's history before it
    window_store = tmp_path / "w.zarr"
    run_extract(ExtractConfig(**base, output=str(window_store)), progress=False, log=lambda m: None)
    windows = FeatureStore.open(window_store)
    later_differs = False
    for b, prow in enumerate(TokenTable.open(packed).iter_rows()):
        full, alone = store.read_block(b), windows.read_block(b)
        for k, sid in enumerate(prow["segment_ids"]):
            lo, hi = prow["cu_seqlens"][k], prow["cu_seqlens"][k + 1]
            if sid.endswith("#0"):  # a first window: its own context is the conversation's start
                assert _relative(full.final_hidden[lo:hi], alone.final_hidden[lo:hi]) < 8e-3  # two roundings
            elif _relative(full.final_hidden[lo:hi], alone.final_hidden[lo:hi]) > 0.05:
                later_differs = True  # control: the window context is another context
    assert later_differs


def test_full_context_needs_a_table_with_conversations(tmp_path, tiny_verifier_dir):
    packed = write_packed_conversations(tmp_path / "packed", synthetic_conversations(49152), 16, 32, "smollm2-135m")
    for p in (packed / CONVERSATIONS).iterdir():
        p.unlink()
    (packed / CONVERSATIONS).rmdir()
    # the default --context full; refused before the verifier is even read (a path that holds no model)
    with pytest.raises(InputError) as e:
        run_extract(ExtractConfig(packed=str(packed), verifier=str(tmp_path / "no-model"),
                                  output=str(tmp_path / "f.zarr"), layers=[1, 2], device="cpu"),
                    progress=False, log=lambda m: None)
    assert str(e.value) == (f"field '--context': {packed} has no conversations/ sub-table (packed by an older peagle, or written by "
                            "hand), and the default --context full runs the conversations kept there: pack it "
                            "again with `peagle-data pack` (which keeps the conversations and where each window "
                            "comes from), or extract it with --context window (each packed block as it is, a "
                            "format-1 store)")
    assert not (tmp_path / "f.zarr").exists()
    s = run_extract(ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir), output=str(tmp_path / "f.zarr"),
                                  layers=[1, 2], device="cpu", context="window"), progress=False, log=lambda m: None)
    assert s["complete"] and FeatureStore.open(str(tmp_path / "f.zarr")).layout == "blocks"
    with pytest.raises(InputError, match="shorter than the longest window"):
        packed = write_packed_conversations(tmp_path / "p2", synthetic_conversations(49152), 16, 32, "smollm2-135m")
        run_extract(ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir), output=str(tmp_path / "g.zarr"),
                                  layers=[1, 2], device="cpu", context="full", max_context=8), progress=False,
                    log=lambda m: None)


def _gap_conversations() -> list[TokenizedRow]:
    """:func:`synthetic_conversations` plus ``gap``: 70 tokens (system prefix 3) whose tokens 20-49 are
    unsupervised, so the windows of 16 there have no supervised token and are dropped."""
    rows = synthetic_conversations(49152)
    g = np.random.default_rng(5)
    ids, mask = g.integers(3, 49149, 70).astype(np.int32), np.ones(70, dtype=np.uint8)
    mask[:3] = mask[20:50] = 0
    return rows + [TokenizedRow("gap", "synthetic:6", ids, mask, 3, 70, int(mask.sum()))]


def _edit_conversation(packed: Path, cid: str, position: int) -> None:
    """Change token ``position`` of conversation ``cid`` in the packed table's conversations sub-table."""
    rows = [TokenizedRow(**r) for r in TokenTable.open(packed / CONVERSATIONS).iter_rows()]
    for f in (packed / CONVERSATIONS).glob("part-*.parquet"):
        f.unlink()
    with TableWriter(packed / CONVERSATIONS, "tokenized") as w:
        for r in rows:
            if r.conversation_id == cid:
                r.input_ids = r.input_ids.copy()
                r.input_ids[position] += 1
            w.write(r)


def test_a_changed_conversations_sub_table_is_refused_before_any_forward(tmp_path, tiny_verifier_dir):
    """Token 30 of ``gap`` is in no window (its windows are dropped), so no check of the windows against
    their conversations can see it change, yet every later window of ``gap`` reads a forward of it: the
    sub-table must be the one ``pack`` recorded."""
    packed = write_packed_conversations(tmp_path / "packed", _gap_conversations(), 16, 32, "smollm2-135m")
    held = {int(x) for r in TokenTable.open(packed).iter_rows() for k, sid in enumerate(r["segment_ids"])
            if sid.startswith("gap#") for x in np.r_[0:r["segment_prefix_lens"][k], r["segment_starts"][k]:
                                                        r["segment_starts"][k] + np.diff(r["cu_seqlens"])[k]
                                                        - r["segment_prefix_lens"][k]]}
    assert 30 not in held and max(held) == 69
    _edit_conversation(packed, "gap", 30)
    cfg = ExtractConfig(packed=str(packed), verifier=str(tiny_verifier_dir), output=str(tmp_path / "f.zarr"),
                        layers=[1, 2], device="cpu", context="full", max_context=128)
    with pytest.raises(StoreMismatchError, match=f"{packed / CONVERSATIONS}: its part files are not those"):
        run_extract(cfg, progress=False, log=lambda m: None)
    assert not (tmp_path / "f.zarr").exists()


def test_a_table_without_the_digest_or_with_a_repeated_id_is_refused(tmp_path, tiny_verifier_dir):
    rows = synthetic_conversations(49152)
    packed = write_packed_conversations(tmp_path / "p", rows, 16, 32, "smollm2-135m")
    manifest = json.loads((packed / "manifest.json").read_text())
    write_manifest(packed, {k: v for k, v in manifest.items() if k not in (CONVERSATIONS, "created_at", "library_versions")})
    cfg = dict(verifier=str(tiny_verifier_dir), output=str(tmp_path / "f.zarr"), layers=[1, 2], device="cpu",
               context="full", max_context=128)
    with pytest.raises(InputError, match="records no digest of its conversations sub-table .* pack it again"):
        run_extract(ExtractConfig(packed=str(packed), **cfg), progress=False, log=lambda m: None)
    # c0 twice, with other tokens after its first 8: which one its windows come from is unknown
    other = TokenizedRow("c0", "synthetic:9", np.r_[rows[0].input_ids[:8], [5, 6]].astype(np.int32),
                         rows[0].loss_mask.copy(), 3, 10, int(rows[0].loss_mask.sum()))
    packed = write_packed_conversations(tmp_path / "q", [*rows, other], 16, 32, "smollm2-135m")
    with pytest.raises(StoreMismatchError, match=r"conversation id 'c0' is in two rows \(sources synthetic:1, "
                                                 r"synthetic:9\), so its windows. conversation is unknown"):
        run_extract(ExtractConfig(packed=str(packed), **cfg), progress=False, log=lambda m: None)


def test_resume_refuses_another_plan(tmp_path, tiny_verifier_dir, monkeypatch):
    """A store resumed by a peagle that plans the same table otherwise (here: pieces of another overlap)
    would extract the remaining context blocks of the new plan under the views of the old one."""
    from peagle_data.extract import contexts

    packed = write_packed_conversations(tmp_path / "packed", synthetic_conversations(49152), 16, 32, "smollm2-135m")
    base = dict(packed=str(packed), verifier=str(tiny_verifier_dir), output=str(tmp_path / "f.zarr"), layers=[1, 2],
                device="cpu", context="full", max_context=24)
    run_extract(ExtractConfig(**base, max_blocks=1), progress=False, log=lambda m: None)
    monkeypatch.setattr(contexts, "CONTEXT_OVERLAP", 0.9)
    with pytest.raises(InputError, match=rf"{tmp_path / 'f.zarr'} was made with another full-context plan than "
                                         rf"{packed} gives now \(counts contexts .* start over with --force"):
        run_extract(ExtractConfig(**base, resume=True), progress=False, log=lambda m: None)
    monkeypatch.setattr(contexts, "CONTEXT_OVERLAP", 0.5)
    s = run_extract(ExtractConfig(**base, resume=True), progress=False, log=lambda m: None)
    assert s["complete"] and verify_store(tmp_path / "f.zarr")["ok"]


def test_resume_keeps_context_and_max_context(tmp_path, tiny_verifier_dir):
    packed = write_packed_conversations(tmp_path / "packed", synthetic_conversations(49152), 16, 32, "smollm2-135m")
    base = dict(packed=str(packed), verifier=str(tiny_verifier_dir), output=str(tmp_path / "f.zarr"), layers=[1, 2],
                device="cpu")
    run_extract(ExtractConfig(**base, context="full", max_context=48, max_blocks=1), progress=False, log=lambda m: None)
    with pytest.raises(InputError, match="--max-context: the store's 48, given 64"):
        run_extract(ExtractConfig(**base, context="full", max_context=64, resume=True), progress=False,
                    log=lambda m: None)
    with pytest.raises(InputError, match="--context: the store's full, given window"):
        run_extract(ExtractConfig(**base, context="window", resume=True), progress=False, log=lambda m: None)
    s = run_extract(ExtractConfig(**base, context="full", max_context=48, resume=True), progress=False,
                    log=lambda m: None)
    assert s["complete"] and s["training_blocks_done"] == s["training_blocks"]


def test_resume_keeps_the_stores_context_packing(tmp_path, tiny_verifier_dir):
    packed = write_packed_conversations(tmp_path / "packed", synthetic_conversations(49152), 16, 32, "smollm2-135m")
    base = dict(packed=str(packed), verifier=str(tiny_verifier_dir), output=str(tmp_path / "f.zarr"), layers=[1, 2],
                device="cpu", context="full", max_context=48)
    run_extract(ExtractConfig(**base, context_packing="training_blocks", max_blocks=1), progress=False,
                log=lambda m: None)
    with pytest.raises(InputError, match="--context-packing: the store's training_blocks, given best_fit"):
        run_extract(ExtractConfig(**base, context_packing="best_fit", resume=True), progress=False, log=lambda m: None)
    s = run_extract(ExtractConfig(**base, resume=True), progress=False, log=lambda m: None)  # keeps training_blocks
    assert s["complete"] and s["context"]["packing"] == "training_blocks"
    with pytest.raises(ValueError, match="--context-packing is an option of --context full"):
        ExtractConfig(**{**base, "context": "window", "max_context": None}, context_packing="best_fit")


def test_resume_after_the_packed_manifest_changed_is_refused(tmp_path, tiny_verifier_dir):
    packed = write_packed_conversations(tmp_path / "packed", synthetic_conversations(49152), 16, 32, "smollm2-135m")
    base = dict(packed=str(packed), verifier=str(tiny_verifier_dir), output=str(tmp_path / "f.zarr"), layers=[1, 2],
                device="cpu", context="full", max_context=48)
    run_extract(ExtractConfig(**base, max_blocks=1), progress=False, log=lambda m: None)
    manifest = json.loads((packed / "manifest.json").read_text())
    (packed / "manifest.json").write_text(json.dumps({**manifest, "inputs": ["other"]}))
    with pytest.raises(StoreMismatchError, match="made from another packed table .* resume with the table it was "
                                                 "made from, or start over with --force"):
        run_extract(ExtractConfig(**base, resume=True), progress=False, log=lambda m: None)


def _chunk_bytes(store: Path) -> dict[str, bytes]:
    """Every file of the store, byte for byte, without the recorded command line (``config``)."""
    files = {str(p.relative_to(store)): p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file()}
    for name in ("zarr.json", f"{CONTEXTS}/zarr.json"):
        meta = json.loads(files[name])
        meta["attributes"]["peagle"].pop("config", None)
        files[name] = json.dumps(meta, sort_keys=True).encode()
    return files


@pytest.mark.slow  # several subprocesses, each importing torch and transformers
def test_sigkill_then_resume_is_byte_identical(tmp_path, tiny_verifier_dir):
    shapes = [(int(n), 8) for n in np.random.default_rng(1).integers(40, 400, size=60)]
    rows = synthetic_conversations(49152, seed=1, shapes=shapes)
    packed = write_packed_conversations(tmp_path / "packed", rows, 128, 128, "smollm2-135m")
    cmd = [sys.executable, "-m", "cli.data_extract", str(packed), "--verifier", str(tiny_verifier_dir), "--layers",
           "1,2,3", "--device", "cpu", "--context", "full", "--max-context", "256"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    ref = tmp_path / "ref.zarr"
    subprocess.run([*cmd, "--output", str(ref)], check=True, env=env, capture_output=True)
    n_contexts = FeatureStore.open(ref).contexts.n_blocks
    out = tmp_path / "out.zarr"
    kills = kill_runs(lambda resume: [*cmd, "--output", str(out), *(["--resume"] if resume else [])], env,
                      out / CONTEXTS / "done", out)
    assert kills >= 2
    done_before = int(FeatureStore.open(out).contexts.done_mask().sum()) if (out / "zarr.json").exists() else 0
    assert done_before < n_contexts
    res = subprocess.run([*cmd, "--output", str(out), "--resume"], check=True, env=env, capture_output=True, text=True)
    assert f'"context_blocks_done_this_run": {n_contexts - done_before}' in res.stdout
    assert _chunk_bytes(out) == _chunk_bytes(ref)
    assert verify_store(out)["ok"]


@pytest.mark.slow  # SmolLM2-135M's weights, a few thousand tokens through it twice
def test_smollm2_every_token_equals_its_whole_conversation_forward(tmp_path, smollm2_tokenizer_dir):
    """The embedded verifier on a table made by ``pack`` itself (windows of 64, trimmed ones included)."""
    from transformers import AutoModelForCausalLM

    from long_conversations import pack_long
    from runtime.model_cache import resolve_model

    packed = pack_long(tmp_path / "p", smollm2_tokenizer_dir)
    layers = [2, 15, 30]  # 30: the last decoder layer's output before the final norm
    summary = run_extract(ExtractConfig(packed=str(packed), verifier="smollm2-135m", layers=layers,
                                        output=str(tmp_path / "f.zarr"), device="cpu", context="full"),
                          progress=False, log=lambda m: None)
    assert summary["complete"] and summary["context"]["max_context"] == 8192  # SmolLM2's max_position_embeddings
    assert summary["context"]["conversations_split"] == 0 and summary["context"]["conversations"] == 6
    model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m"), dtype=torch.float32).eval()
    rows = [TokenizedRow(**r) for r in TokenTable.open(packed).conversations().iter_rows()]
    worst = worst_against_full_forward(FeatureStore.open(tmp_path / "f.zarr"), packed, model, rows, layers)
    assert worst < 4e-3, f"worst relative difference {worst:.4f}"


def test_a_window_whose_prefix_is_not_its_conversations_is_refused(tmp_path):
    """A split conversation's window must start with its whole system prefix, else its piece slots are unknown."""
    from peagle_data.extract.contexts import plan_contexts
    from stores.errors import StoreMismatchError

    rows = synthetic_conversations(512)
    packed = write_packed_conversations(tmp_path / "packed", rows, max_seq_len=16, block_size=32)
    training = list(TokenTable.open(packed).iter_rows())
    by_id = {r.conversation_id: r.as_dict() for r in rows}
    assert plan_contexts(training, by_id, 48, 32).counts["conversations_split"] == 1
    b, k = next((b, k) for b, r in enumerate(training) for k, sid in enumerate(r["segment_ids"])
                if sid == "c2#0")  # its body starts right after the prefix
    row = dict(training[b])
    row["segment_prefix_lens"] = list(row["segment_prefix_lens"])
    row["segment_prefix_lens"][k] -= 1  # one prefix token moved into the body: the tokens still match
    row["segment_starts"] = list(row["segment_starts"])
    row["segment_starts"][k] = 3  # conversation token 3 (the last prefix token) continues the window
    training[b] = row
    with pytest.raises(StoreMismatchError, match="prefix tokens, but the conversation's system prefix has 4"):
        plan_contexts(training, by_id, 48, 32)
