"""peagle-data inspect and verify of full-context stores (``extract --context full``) and their shard stores:
the context part reported, a damaged context block found, its done flag cleared and `extract --resume`
making the store byte-identical to the undamaged one."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner

from cli.data import main
from peagle_data.extract.config import ExtractConfig
from peagle_data.extract.run import run_extract
from stores.features.feature_repair import verify_store
from stores.features.feature_store import FeatureStore
from stores.tables.token_tables import TokenTable

from tests.peagle_data.extract.test_run import chunk_bytes, pack_conversations, window_ends
from tests.peagle_data.extract.test_store_repair import _flip_byte

MAX_CONTEXT = 128


@pytest.fixture(scope="module")
def stores(tmp_path_factory, smollm2_tokenizer, tiny_verifier_dir):
    """(packed table, a full-context store, its two shard stores), extracted once for the module."""
    root = tmp_path_factory.mktemp("verify_full")
    packed = pack_conversations(root, smollm2_tokenizer)
    full = root / "full.zarr"
    run_extract(_cfg(packed, tiny_verifier_dir, full), progress=False, log=lambda m: None)
    shards = [root / f"s{i}.zarr" for i in range(2)]
    for i, out in enumerate(shards):
        run_extract(_cfg(packed, tiny_verifier_dir, out, num_shards=2, shard_index=i), progress=False,
                    log=lambda m: None)
    return packed, full, shards


def _cfg(packed, verifier_dir, out, **extra):
    return ExtractConfig(packed=str(packed), verifier=str(verifier_dir), output=str(out), layers=[1, 3],
                         device="cpu", context="full", max_context=MAX_CONTEXT, **extra)


def _tokens_extracted(packed) -> int:
    """The tokens the verifier runs: every conversation of at most MAX_CONTEXT tokens once, up to the
    last token its windows read (one of 109 tokens ends in a "\\n" no window holds), and the pieces of a
    longer one (this table's: two pieces of MAX_CONTEXT tokens)."""
    lengths = [r["n_tokens"] for r in TokenTable.open(packed).conversations().iter_rows(["n_tokens"])]
    assert sorted(lengths) == [40, 46, 55, 73, 91, 109, 127, 145]
    read = sorted(window_ends(packed).values())
    assert read == [40, 46, 55, 73, 91, 108, 127, 145]
    return sum(n for n in read if n <= MAX_CONTEXT) + 2 * MAX_CONTEXT


def _invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_inspect_reports_the_context_part_of_a_store_and_its_shards(stores):
    packed, full, shards = stores
    r = _invoke("inspect", full)
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert (s["layout"], s["format_version"], s["n_blocks"], s["blocks_done"], s["percent_done"]) == \
        ("windows", 2, 20, 20, 100.0)
    assert s["n_tokens"] == TokenTable.open(packed).manifest["counts"]["tokens"] == 1229
    assert {k: s["contexts"][k] for k in ("block_size", "n_blocks", "n_tokens", "blocks_done")} == \
        {"block_size": MAX_CONTEXT, "n_blocks": 7, "n_tokens": _tokens_extracted(packed), "blocks_done": 7}
    assert (s["context"]["conversations"], s["context"]["conversations_split"], s["context"]["max_context"]) == \
        (8, 1, MAX_CONTEXT)
    per_shard = []
    for i, shard in enumerate(shards):
        s = json.loads(_invoke("inspect", shard).output)
        assert s["shard"]["shard_index"] == i and s["shard"]["context_blocks"] == 7
        assert s["blocks_done"] is None and s["n_blocks"] == 20  # training blocks done once merged
        assert (s["contexts"]["n_blocks"], s["contexts"]["blocks_done"]) == ((4, 3)[i],) * 2
        per_shard.append(s["contexts"]["n_tokens"])
    assert sum(per_shard) == _tokens_extracted(packed)


def test_verify_a_full_context_store_and_its_shards_against_the_packed_table(stores, tmp_path):
    packed, full, shards = stores
    for store in (full, *shards):
        r = _invoke("verify", store, "--packed", packed)
        assert r.exit_code == 0, r.output
        report = json.loads(r.output)
        assert report["ok"] and report["bad_blocks"] == {} and report["n_blocks"] == 20
        assert report["blocks_done"] == (20 if store == full else None)
    # a training block whose tokens are not those its views read in a context block this shard holds
    copy = tmp_path / "s1.zarr"
    shutil.copytree(shards[1], copy)
    store = FeatureStore.open(copy, mode="r+")
    views = store.views()
    block = next(i for i in range(store.n_blocks) if any(m >= 0 and m % 2 == 1 for m in views[i, :, 0]))
    tok = store.read_tokens(block)
    segment = next(k for k in range(len(tok["cu_seqlens"]) - 1) if views[block, k, 0] % 2 == 1)
    tok["input_ids"][tok["cu_seqlens"][segment]] += 1
    store.write_token_row(block, tok)
    report = verify_store(copy)
    assert not report["ok"]
    assert report["bad_blocks"] == {block: f"block {block}: its tokens differ from those its views read in the "
                                           "context blocks"}


def test_damaged_context_chunk_found_by_verify_and_repaired_by_resume(stores, tmp_path, tiny_verifier_dir):
    packed, full, _ = stores
    copy = tmp_path / "f.zarr"
    shutil.copytree(full, copy)
    _flip_byte(copy / "contexts/aux_hidden/c/2/0/0/0")
    views = FeatureStore.open(copy).views()
    readers = [i for i in range(views.shape[0]) if 2 in views[i, :, 0].tolist()]
    assert readers  # some training blocks read context block 2
    r = _invoke("verify", copy, "--packed", packed)
    assert r.exit_code == 1
    report = json.loads(r.output[:r.output.rindex("}") + 1])
    assert list(report["contexts"]["bad_blocks"]) == ["2"]
    assert "checksum does not match" in report["contexts"]["bad_blocks"]["2"]
    assert sorted(int(i) for i in report["bad_blocks"]) == readers
    assert f"training blocks at fault: {readers}; context blocks at fault: [2]" in r.output
    r = _invoke("verify", copy, "--repair")
    assert r.exit_code == 1 and "the done flags of those context blocks are cleared" in r.output
    assert json.loads(r.output[:r.output.rindex("}") + 1])["repaired"] == [2]
    store = FeatureStore.open(copy)
    assert store.contexts.missing_blocks() == [2]
    assert np.flatnonzero(~store.done_mask()).tolist() == readers
    s = run_extract(_cfg(packed, tiny_verifier_dir, copy, resume=True), progress=False, log=lambda m: None)
    assert s["complete"] and s["context_blocks_done_this_run"] == 1 and s["training_blocks_done"] == 20
    assert chunk_bytes(copy) == chunk_bytes(full)
    assert verify_store(copy)["ok"]


def test_resume_alone_repairs_a_damaged_context_chunk_and_view(stores, tmp_path, tiny_verifier_dir):
    """Without verify --repair: --resume finds a missing context chunk and a damaged training-block
    chunk (a view) itself and makes the store byte-identical."""
    packed, full, _ = stores
    copy = tmp_path / "f.zarr"
    shutil.copytree(full, copy)
    (copy / "contexts/final_hidden/c/5/0/0").unlink()
    _flip_byte(copy / "window_views/c/3/0/0")
    report = verify_store(copy)
    assert "block 5: final_hidden chunk" in report["contexts"]["bad_blocks"][5]
    assert report["bad_blocks"][3].startswith("block 3: window_views chunk")
    logs = []
    s = run_extract(_cfg(packed, tiny_verifier_dir, copy, resume=True), progress=False, log=logs.append)
    assert s["complete"] and s["context_blocks_done_this_run"] == 1 and s["repaired_blocks"].keys() == {5}
    assert any("block 3: window_views chunk" in m and "rewriting it" in m for m in logs)
    assert chunk_bytes(copy) == chunk_bytes(full)
    assert verify_store(copy)["ok"]


def test_an_unfinished_undamaged_store_is_reported_unfinished_with_exit_3_and_the_resume_command(
        stores, tmp_path, tiny_verifier_dir):
    """Issue 33, kind 9: an unfinished store is not "failed verification; blocks at fault": it says how many
    blocks are done and the command that extracts the rest, which then completes it."""
    packed, full, _ = stores
    copy = tmp_path / "f.zarr"
    shutil.copytree(full, copy)
    store = FeatureStore.open(copy, mode="r+")
    store.contexts.clear_done(2)  # as a killed extraction leaves it: block 2 never written
    not_done = np.flatnonzero(~store.done_mask()).tolist()
    r = _invoke("verify", copy)
    assert r.exit_code == 3, r.output
    report = json.loads(r.output[:r.output.rindex("}") + 1])
    assert report["state"] == "unfinished" and report["bad_blocks"] == {} and report["not_done"] == not_done
    assert "failed verification" not in r.output and "at fault" not in r.output
    M = store.contexts.n_blocks
    assert (f"store {copy} is unfinished: {20 - len(not_done)} of 20 training blocks done ({M - 1} of {M} context "
            "blocks); "
            "no damage found in the blocks done. `peagle-data extract PACKED --context full --resume --output "
            f"{copy}`") in r.output
    s = run_extract(_cfg(packed, tiny_verifier_dir, copy, resume=True), progress=False, log=lambda m: None)
    assert s["complete"]
    r = _invoke("verify", copy)
    assert r.exit_code == 0 and json.loads(r.output)["state"] == "complete"
    _flip_byte(copy / "contexts/aux_hidden/c/2/0/0/0")
    assert _invoke("verify", copy).exit_code == 1  # damage stays exit 1, "failed verification"


def test_an_unfinished_window_store_names_the_recorded_resume_command(tmp_path):
    import torch

    store = FeatureStore.create(tmp_path / "s.zarr", n_blocks=3, block_size=8, max_segments=2, layers=[0, 1],
                                hidden_size=4, vocab_size=16, verifier={"name_or_path": "tiny"})
    store.write_all_n_tokens(np.array([4, 4, 4]))
    for i in (0, 2):
        store.write_tokens(i, [1, 2, 3, 4], [0, 1, 1, 1], [0, 1, 2, 3], [0, 4])
        store.write_features(i, torch.ones(4, 2, 4, dtype=torch.bfloat16), torch.ones(4, 4, dtype=torch.bfloat16))
        store.mark_done(i)
    store.set_token_freq(np.zeros(16, dtype=np.int64))
    store.update_attrs(config={"packed": "p", "output": str(tmp_path / "s.zarr")}, tokens_written=True)
    r = _invoke("verify", tmp_path / "s.zarr")
    assert r.exit_code == 3, r.output
    assert (f"store {tmp_path / 's.zarr'} is unfinished: 2 of 3 blocks done; no damage found in the blocks done. "
            f"`peagle-data inspect {tmp_path / 's.zarr'} > store.json && peagle-data extract --config store.json "
            "--resume` extracts the rest") in r.output


def test_the_resume_command_verify_names_finishes_the_store(tmp_path, tiny_verifier_dir):
    """The command an unfinished store's message names, run as written (inspect into store.json, then
    extract --config store.json --resume), completes the store."""
    import re

    from tests.peagle_data.extract.test_run import write_packed

    packed = write_packed(tmp_path / "packed", n_blocks=3, block_size=32)
    store = tmp_path / "s.zarr"
    r = _invoke("extract", packed, "--verifier", tiny_verifier_dir, "--output", store, "--device", "cpu",
                "--context", "window", "--layers", "1,2", "--max-blocks", "1")
    assert r.exit_code == 0, r.output
    r = _invoke("verify", store)
    assert r.exit_code == 3 and "1 of 3 blocks done" in r.output, r.output
    command = re.search(r"`(peagle-data inspect .*?)`", r.output).group(1)
    inspect, extract = command.split(" && ")
    assert inspect == f"peagle-data inspect {store} > store.json"
    assert extract == "peagle-data extract --config store.json --resume"
    shown = _invoke("inspect", store)
    assert shown.exit_code == 0
    (tmp_path / "store.json").write_text(shown.stdout)
    r = _invoke("extract", "--config", tmp_path / "store.json", "--resume")
    assert r.exit_code == 0, r.output
    r = _invoke("verify", store)
    assert r.exit_code == 0 and json.loads(r.output)["state"] == "complete"


def test_a_damaged_block_of_a_streamed_store_names_only_it_and_the_streaming_resume(tmp_path):
    """A streamed store (docs/design.md §7): a block still to come (pending) and an evicted one are no damage; the
    line names the damaged done block alone and the run's resume, not the full extraction ``repair_command``
    names (which would write every block, past the budget)."""
    import torch

    from stores.stream.plan import StreamPlan
    from stores.stream.session import StreamSession

    path = tmp_path / "s.zarr"
    store = FeatureStore.create(path, n_blocks=4, block_size=8, max_segments=2, layers=[0, 1], hidden_size=4,
                                vocab_size=16, verifier={"name_or_path": "tiny"})
    store.write_all_n_tokens(np.array([4, 4, 4, 4]))
    for i in range(4):
        store.write_tokens(i, [1, 2, 3, 4], [0, 1, 1, 1], [0, 1, 2, 3], [0, 4])
    for i in (0, 2, 3):
        store.write_features(i, torch.ones(4, 2, 4, dtype=torch.bfloat16), torch.ones(4, 4, dtype=torch.bfloat16))
        store.mark_done(i)
    store.set_token_freq(np.zeros(16, dtype=np.int64))
    store.update_attrs(config={"packed": "p", "output": str(path)}, tokens_written=True)
    store = FeatureStore.open(path, mode="r+")
    store.evict_block(0)  # entry 0, consumed
    StreamSession(store).write_plan(StreamPlan(run={"output": "/o"}, policy="reextract", max_store_bytes=1,
                                               fixed_bytes=0, block_bytes=1, window=3, val_blocks=(3,),
                                               order=np.array([0, 1, 2], dtype=np.int64)))
    StreamSession(store).write_consumed(1)
    _flip_byte(store.chunk_path("final_hidden", 2))
    r = _invoke("verify", path)
    assert r.exit_code == 1
    line = " ".join(r.output.split())
    assert (f"store {path} failed verification; damaged blocks: [2]; stop the streaming run and run `peagle-data "
            f"verify {path} --repair` to clear their done flags; then resume the run") in line
    assert "extract --config" not in line
    report = json.loads(r.stdout[r.stdout.index("{"):])
    assert report["stream"]["pending"] == [1] and report["stream"]["consumed_blocks"] == 1
    r = _invoke("verify", path, "--repair")
    assert "damaged blocks: [2]; their done flags are cleared; then resume the run" in " ".join(r.output.split())
    assert not FeatureStore.open(path).is_done(2) and FeatureStore.open(path).is_done(3)
