"""A damaged store is named block by block and `extract --resume` repairs exactly the damaged blocks.

Each kind of damage is applied to a copy of a finished store; the repaired copy must be byte-identical
to the undamaged store, and the extraction summary's ``complete`` must agree with ``verify_store``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from peagle_data.extract.config import ExtractConfig
from peagle_data.extract.run import run_extract
from stores.features.feature_repair import verify_store

from .test_run import chunk_bytes, write_packed

N_BLOCKS = 4


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_verifier_dir):
    """(packed table, an undamaged finished store) shared by the tests of this module."""
    root = tmp_path_factory.mktemp("repair")
    packed = write_packed(root / "packed", n_blocks=N_BLOCKS, block_size=48)
    ref = root / "ref.zarr"
    run_extract(_cfg(packed, tiny_verifier_dir, ref, resume=False), progress=False)
    return packed, ref


def _cfg(packed, verifier_dir, out, resume=True, max_blocks=None):
    """A format-1 extraction (``--context window``: the damage below is of format-1 block chunks; a
    full-context store's repair is tests/peagle_data/inspect/test_verify.py's)."""
    return ExtractConfig(packed=str(packed), verifier=str(verifier_dir), output=str(out), layers=[1, 2, 3],
                         device="cpu", resume=resume, max_blocks=max_blocks, context="window")


def _flip_byte(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x5A
    p.write_bytes(bytes(data))


def _to_directory(p: Path) -> None:
    p.unlink()
    p.mkdir()


# (name, chunk of block 2 relative to the store, damage, words the reason must contain)
DAMAGE = [
    ("deleted hidden chunk", "aux_hidden/c/2/0/0/0", Path.unlink, "is missing"),
    ("truncated hidden chunk", "final_hidden/c/2/0/0", lambda p: p.write_bytes(p.read_bytes()[:-7]), "truncated"),
    ("empty hidden chunk", "aux_hidden/c/2/0/0/0", lambda p: p.write_bytes(b""), "0 bytes"),
    ("altered hidden chunk", "aux_hidden/c/2/0/0/0", _flip_byte, "checksum"),
    ("unreadable hidden chunk", "final_hidden/c/2/0/0", _to_directory, "not a regular file"),
    ("empty token chunk", "input_ids/c/2/0", lambda p: p.write_bytes(b""), "0 bytes"),
    ("deleted cu_seqlens chunk", "cu_seqlens/c/2/0", Path.unlink, "is missing"),
    ("altered loss_mask chunk", "loss_mask/c/2/0", _flip_byte, "checksum"),
    ("empty done flag chunk", "done/c/2", lambda p: p.write_bytes(b""), "done flag"),
    ("deleted done flag chunk", "done/c/2", Path.unlink, None),  # reads as not done: plain resume work
]


@pytest.mark.parametrize("name,chunk,damage,words", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_resume_repairs_exactly_the_damaged_block(tmp_path, finished, tiny_verifier_dir, name, chunk, damage, words):
    packed, ref = finished
    out = tmp_path / "s.zarr"
    shutil.copytree(ref, out)
    damage(out / chunk)
    report = verify_store(out)
    assert not report["ok"]
    assert sorted(set(report["bad_blocks"]) | set(report["not_done"])) == [2]
    if words is not None:
        assert words in report["bad_blocks"][2] and "block 2" in report["bad_blocks"][2]
    summary = run_extract(_cfg(packed, tiny_verifier_dir, out), progress=False)
    assert summary["training_blocks_done_this_run"] == 1  # exactly the damaged block
    assert list(summary["repaired_blocks"]) == ([2] if words is not None else [])
    assert summary["complete"] and verify_store(out)["ok"]
    assert chunk_bytes(out) == chunk_bytes(ref)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == sorted(p.relative_to(ref) for p in ref.rglob("*"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_resume_repairs_a_chunk_without_read_permission(tmp_path, finished, tiny_verifier_dir):
    packed, ref = finished
    out = tmp_path / "s.zarr"
    shutil.copytree(ref, out)
    (out / "aux_hidden/c/1/0/0/0").chmod(0)
    assert "PermissionError" in verify_store(out)["bad_blocks"][1]
    summary = run_extract(_cfg(packed, tiny_verifier_dir, out), progress=False)
    assert list(summary["repaired_blocks"]) == [1] and summary["complete"]
    assert chunk_bytes(out) == chunk_bytes(ref)


@pytest.mark.parametrize("array", ["n_tokens", "token_freq"])
def test_resume_rewrites_damaged_store_wide_arrays(tmp_path, finished, tiny_verifier_dir, array):
    packed, ref = finished
    out = tmp_path / "s.zarr"
    shutil.copytree(ref, out)
    (out / array / "c" / "0").write_bytes(b"")
    report = verify_store(out)
    assert not report["ok"] and "0 bytes" in report["damaged_arrays"][array]
    summary = run_extract(_cfg(packed, tiny_verifier_dir, out), progress=False)
    assert summary["training_blocks_done_this_run"] == 0 and summary["complete"] and verify_store(out)["ok"]
    assert chunk_bytes(out) == chunk_bytes(ref)


def test_verify_repair_then_resume_and_partial_resume_is_not_complete(tmp_path, finished, tiny_verifier_dir):
    """verify --repair clears the flags of the bad blocks; a resume that stops early never says complete."""
    from cli.data_extract import verify

    packed, ref = finished
    out = tmp_path / "s.zarr"
    shutil.copytree(ref, out)
    (out / "aux_hidden/c/0/0/0/0").write_bytes(b"")
    _flip_byte(out / "final_hidden/c/3/0/0")
    res = CliRunner().invoke(verify, [str(out), "--repair"])
    assert res.exit_code == 1
    assert "blocks at fault: [0, 3]" in res.output and "done flags are cleared" in res.output
    assert (f"`peagle-data extract PACKED --context window --resume --output {out}` (with the packed table, --verifier "
            "and --layers it was extracted with) extracts them again") in " ".join(res.output.split())
    report = verify_store(out)
    assert report["not_done"] == [0, 3] and report["bad_blocks"] == {}
    summary = run_extract(_cfg(packed, tiny_verifier_dir, out, max_blocks=1), progress=False)
    assert summary["training_blocks_done_this_run"] == 1 and not summary["complete"]
    assert summary["complete"] == verify_store(out)["ok"]
    summary = run_extract(_cfg(packed, tiny_verifier_dir, out), progress=False)
    assert summary["training_blocks_done_this_run"] == 1 and summary["complete"] and summary["repaired_blocks"] == {}
    assert chunk_bytes(out) == chunk_bytes(ref)


@pytest.mark.parametrize("storage_dtype,compressor", [("bf16", "zstd"), ("fp8", None)])
def test_repair_of_compressed_and_fp8_stores(tmp_path, tiny_verifier_dir, storage_dtype, compressor):
    """A compressed store has no fixed chunk size: damage shows as a failed checksum or decode; fp8 has scale arrays."""
    import dataclasses

    packed = write_packed(tmp_path / "packed", n_blocks=3, block_size=40, seed=2)
    ref, out = tmp_path / "ref.zarr", tmp_path / "s.zarr"
    cfg = dataclasses.replace(_cfg(packed, tiny_verifier_dir, ref, resume=False), storage_dtype=storage_dtype,
                              compressor=compressor)
    run_extract(cfg, progress=False)
    shutil.copytree(ref, out)
    damaged = "aux_hidden/c/1/0/0/0" if storage_dtype == "bf16" else "final_scale/c/1/0"
    (out / damaged).write_bytes((out / damaged).read_bytes()[:-5])
    (out / "position_ids/c/0/0").unlink()
    report = verify_store(out)
    assert sorted(report["bad_blocks"]) == [0, 1]
    assert damaged.split("/")[0] in report["bad_blocks"][1] and "position_ids" in report["bad_blocks"][0]
    summary = run_extract(dataclasses.replace(cfg, output=str(out), resume=True), progress=False)
    assert sorted(summary["repaired_blocks"]) == [0, 1] and summary["training_blocks_done_this_run"] == 2
    assert summary["complete"] and verify_store(out)["ok"]
    assert chunk_bytes(out) == chunk_bytes(ref)
