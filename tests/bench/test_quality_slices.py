"""bench/quality_slices.py: the inputs' hashes (chunk bytes only, recorded once, a differing rebuild refused), the
order of the runs, and a results directory that skips what is done."""

from __future__ import annotations

import json
import sys

import pytest

from tests.bench.bench_modules import load_bench

slices = load_bench("quality_slices")


def _store(root, payload: bytes, meta: str):
    (root / "input_ids" / "c" / "0").mkdir(parents=True)
    (root / "input_ids" / "c" / "0" / "0").write_bytes(payload)
    (root / "input_ids" / "zarr.json").write_text(meta)
    (root / "zarr.json").write_text(meta)
    return root


def test_store_hash_reads_chunks_not_metadata(tmp_path):
    a = _store(tmp_path / "a", b"\x01\x02", '{"made": "host-1 at 10:00"}')
    b = _store(tmp_path / "b", b"\x01\x02", '{"made": "host-2 at 11:00"}')
    c = _store(tmp_path / "c", b"\x01\x03", '{"made": "host-1 at 10:00"}')
    assert slices.store_hash(a) == slices.store_hash(b) != slices.store_hash(c)


def test_inputs_are_recorded_once_and_a_differing_rebuild_is_refused(tmp_path):
    made = {"quality": {"features.zarr": "aa"}, "judge": {"mtbench-T0": {"store": "bb"}}}
    slices.check_inputs(tmp_path, made)
    assert json.loads((tmp_path / "inputs.json").read_text()) == made
    slices.check_inputs(tmp_path, made)  # the same bytes: accepted
    with pytest.raises(SystemExit, match=r"differ from those recorded .*\['judge'\]"):
        slices.check_inputs(tmp_path, {**made, "judge": {"mtbench-T0": {"store": "cc"}}})


def test_runs_go_seed_by_seed_so_a_partial_slice_is_paired():
    assert slices.runs_of([1])[:4] == [("speculators", 0), ("default", 0), ("speculators", 1), ("default", 1)]
    assert len(slices.runs_of([1])) == 10 and len(slices.runs_of([1, 2])) == 25


def test_runs_named_go_in_the_order_given_and_only_runs_of_the_slices():
    assert slices.chosen_runs([1], None) == slices.runs_of([1])
    assert slices.chosen_runs([1, 3], "dflash-s2, default-s1,dflash-s2") == [("dflash", 2), ("default", 1)]
    with pytest.raises(ValueError, match=r"\['dflash-s0'\] are not runs of slice\(s\) \[1\]"):
        slices.chosen_runs([1], "default-s0,dflash-s0")
    with pytest.raises(ValueError, match="default-s9"):
        slices.chosen_runs([1], "default-s9")


@pytest.mark.parametrize("lever", [lv for levers in slices.SLICES.values() for lv in levers])
def test_every_run_of_every_slice_passes_the_benchs_argument_checks(lever, monkeypatch, capsys, tmp_path):
    bench = load_bench("bench_losses")
    monkeypatch.setattr(sys, "argv", ["bench", "--out", str(tmp_path), "--levers", slices.bench_levers(lever),
                                      "--table"])
    bench.main()  # a refusal exits 2 (slice 3's lone dflash lever once had no baseline)
    assert "| lever |" in capsys.readouterr().out
