"""bench/bench_losses.py: mean ± standard error over seeds of each seed's figure; differences paired against the
baseline by seed with the paired t over seeds (never pooled over prompt turns); Student's t p-values; the table
rebuilt from one OUT; the replay stage's pooling; the learning curves, a warm start's steps counted from its
start's; the wall-time columns; the refusals of its command line."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_losses", REPO / "bench" / "bench_losses.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench
spec.loader.exec_module(bench)


def _write(out: Path, lever: str, seed: int, offline_al: float, turn_als: list[float], vllm_als=None,
           wall=100.0, judge_s=(30.0, 40.0)) -> Path:
    run = out / f"{lever}-s{seed}"
    run.mkdir(parents=True)
    (run / "offline.json").write_text(json.dumps({"simulated_acceptance_length": offline_al,
                                                  "per_depth_accuracy": [0.4, 0.2, None, 0.1]}))
    for t in (0, 1):
        turns = [{"al": a + t, "steps": 10, "accepted": round(10 * (a + t - 1))} for a in turn_als]
        (run / f"online-T{t}.json").write_text(json.dumps({"acceptance_length": sum(turn_als) / len(turn_als) + t,
                                                          "turns": turns}))
    if vllm_als is not None:
        for t in (0, 1):  # per_prompt as peagle-eval --engine vllm writes it: 10 drafts per turn
            per = [{"prompt_id": f"q{i // 2}", "turn": i % 2, "verifier_steps": 10, "accepted": round(10 * (a - 1))}
                   for i, a in enumerate(vllm_als)]
            acc = sum(p["accepted"] for p in per)
            (run / f"vllm-T{t}.json").write_text(json.dumps({
                "acceptance_length": 1 + acc / (10 * len(per)), "per_prompt": per, "judge_wall_s": judge_s[t]}))
    (run / "summary.json").write_text(json.dumps({"train_wall_s": wall}))
    return run


def _row(text: str, lever: str) -> list[str]:
    line = next(x for x in text.splitlines() if x.startswith(f"| {lever} "))
    return [c.strip() for c in line.strip("|").split("|")]


def test_mean_se():
    m, se = bench.mean_se([1.0, 2.0, 3.0])
    assert m == 2.0 and math.isclose(se, 1.0 / math.sqrt(3))
    assert bench.mean_se([5.0]) == (5.0, 0.0)


def test_table_pairs_each_lever_with_the_baseline_by_seed_with_the_t_test(tmp_path):
    _write(tmp_path, "default", 0, 1.20, [1.1, 1.3])
    _write(tmp_path, "default", 1, 1.30, [1.2, 1.4])
    _write(tmp_path, "tv", 0, 1.25, [1.2, 1.3], wall=200.0)
    _write(tmp_path, "tv", 1, 1.31, [1.4, 1.4], wall=300.0)
    text = bench.table(tmp_path, ["default", "tv"], [0, 1], "default")
    head = [c.strip() for c in text.splitlines()[0].strip("|").split("|")]
    assert head[:5] == ["lever", "seeds", "offline all-anchor AL (T=0, diagnostic)", "peagle engine AL T=0",
                        "peagle engine AL T=1"]
    cells = _row(text, "tv")
    assert cells[1] == "2" and cells[2] == "1.280 ± 0.030"
    assert cells[5] == "0.400 / 0.200 / 0.000 / 0.100"  # None (no element at the depth) counts 0
    # offline: 0.05 and 0.01, one per seed: mean 0.03, se 0.02, t(1) = 1.5, p = 1 - 2 atan(1.5) / pi = 0.374
    assert cells[6] == "+0.030 ± 0.020 (+2.4%, n=2 seeds, t(1)=1.50, p=0.374)"
    # online: each seed's AL over its turns: 1.25 - 1.2 and 1.4 - 1.3 -> 0.075 ± 0.025, t(1) = 3, p = 0.205; the
    # four turn differences (0.1, 0, 0.2, 0) are not pooled as if independent
    assert cells[7] == "+0.075 ± 0.025 (+6.0%, n=2 seeds, t(1)=3.00, p=0.205)"
    assert cells[8] == "+0.075 ± 0.025 (+3.3%, n=2 seeds, t(1)=3.00, p=0.205)"  # T=1: the default's mean 2.25
    assert cells[9] == "250" and cells[10] == "- / -"
    assert _row(text, "default")[6:9] == ["", "", ""]


def test_vllm_figures_are_each_seeds_al_and_one_seed_has_no_test(tmp_path):
    _write(tmp_path, "speculators", 0, 1.2, [1.2], vllm_als=[1.2, 1.4, 1.3, 1.1])
    _write(tmp_path, "default", 0, 1.2, [1.2], vllm_als=[1.3, 1.4, 1.5, 1.1], judge_s=(50.0, 70.0))
    text = bench.table(tmp_path, ["speculators", "default"], [0], "speculators")
    head = [c.strip() for c in text.splitlines()[0].strip("|").split("|")]
    i = head.index("Δ vLLM AL T=0 vs speculators")
    cells = _row(text, "default")
    assert cells[head.index("vLLM AL T=0")] == "1.325"  # one seed: no SE over seeds (not ± 0.000)
    assert cells[i] == "+0.075 (+6.0%, n=1 seed, no test)"  # 1.325 - 1.25 of the one seed
    assert cells[-1] == "50 / 70"


def test_student_t_p_values_are_the_tables():
    for t, df in ((12.7062, 1), (4.3027, 2), (2.7764, 4), (2.2281, 10), (2.0423, 30)):  # two-sided 5 % points
        assert bench.t_two_sided_p(t, df) == pytest.approx(0.05, abs=2e-5), df
    assert bench.t_two_sided_p(1.5, 1) == pytest.approx(1 - 2 * math.atan(1.5) / math.pi, abs=1e-12)  # Cauchy
    assert bench.t_two_sided_p(0.0, 3) == pytest.approx(1.0) and bench.t_two_sided_p(math.inf, 3) == 0.0


def test_paired_seed_test_and_the_star():
    r = bench.paired_seed_test([0.10, 0.12, 0.11])
    assert (r["n"], r["df"]) == (3, 2) and r["mean"] == pytest.approx(0.11) and r["se"] == pytest.approx(0.01 / 3 ** 0.5)
    assert r["t"] == pytest.approx(0.11 / (0.01 / 3 ** 0.5)) and r["p"] < 0.01
    assert bench.delta_cell([0.10, 0.12, 0.11], 1.0).endswith(" *")
    assert bench.delta_cell([0.1, -0.1], 1.0) == "+0.000 ± 0.100 (+0.0%, n=2 seeds, t(1)=0.00, p=1.000)"
    assert bench.paired_seed_test([0.2])["p"] is None and bench.delta_cell([], 1.0) == ""
    assert bench.paired_seed_test([0.1, 0.1])["p"] == 0.0  # the same nonzero difference at every seed


def test_table_alone_reads_every_run_in_one_out(tmp_path, monkeypatch, capsys):
    _write(tmp_path, "default", 0, 1.2, [1.2])
    _write(tmp_path, "default", 3, 1.3, [1.2])
    _write(tmp_path, "tv", 3, 1.1, [1.2])
    (tmp_path / "contexts-2-48.json").write_text("[]")  # not a run
    assert bench.found_runs(tmp_path) == (["default", "tv"], [0, 3])
    monkeypatch.setattr(sys, "argv", ["bench", "--out", str(tmp_path), "--table"])
    bench.main()
    printed = capsys.readouterr().out
    assert printed == (tmp_path / "table.md").read_text()  # printed and written, the same table
    assert _row(printed, "default")[1] == "2" and _row(printed, "tv")[6].startswith("-0.200 (")


def test_replay_reports_pool_each_temperatures_stores(tmp_path, monkeypatch):
    judge = tmp_path / "judge"
    for name in ("mtbench-T0", "humaneval-T0", "mtbench-T1-seed1", "mtbench-T1-seed2", "humaneval-T1-seed1"):
        (judge / f"{name}.zarr").mkdir(parents=True)
        (judge / f"{name}.done.json").write_text(json.dumps({"max_new_tokens": 64}))
    (judge / "late-T0.zarr").mkdir()  # not finished: not judged
    stores = bench.judge_stores(judge)
    assert [p.name for p in stores["0"]] == ["humaneval-T0.zarr", "mtbench-T0.zarr"] and len(stores["1"]) == 3
    calls = []

    def fake(drafter, store, max_new_tokens):
        calls.append((Path(store).name, max_new_tokens))
        n = 10 if "T0" in Path(store).name else 5
        return {"replay": {"accepted": n, "num_drafts": 10}, "simulated_acceptance_length": 1.5}

    monkeypatch.setattr(bench, "run_offline_eval", fake)
    run = tmp_path / "default-s0"
    (run / "final").mkdir(parents=True)
    bench.replay(run, judge)
    t0, t1 = (json.loads((run / f"replay-T{t}.json").read_text()) for t in (0, 1))
    assert (t0["acceptance_length"], t0["num_drafts"]) == (2.0, 20) and t1["acceptance_length"] == 1.5
    assert set(t1["per_store"]) == {"mtbench-T1-seed1.zarr", "mtbench-T1-seed2.zarr", "humaneval-T1-seed1.zarr"}
    assert all(m == 64 for _, m in calls) and len(calls) == 5
    assert t1["per_suite"]["mtbench"]["acceptance_length"] == 1.5 and t1["per_suite"]["mtbench"]["stores"] == 2
    assert t0["per_suite"]["humaneval"]["num_drafts"] == 10 and t0["per_suite"]["humaneval"]["se"] is None
    bench.replay(run, judge)  # done: nothing judged again
    assert len(calls) == 5


def _replay_report(t: int, per_prompt: dict[int, list[int]]) -> dict:
    """A replay-T{t}.json of one suite ``mtbench``: one store per sample, prompt -> accepted of 10 drafts each."""
    per = {}
    for k in range(len(next(iter(per_prompt.values())))):
        accepted = [v[k] for v in per_prompt.values()]
        per[f"mtbench-T{t}-seed{k}.zarr" if t else "mtbench-T0.zarr"] = {
            "accepted": sum(accepted), "num_drafts": 10 * len(accepted),
            "per_conversation": {"conversation": list(range(len(accepted))), "prompt": list(per_prompt),
                                 "accepted": accepted, "num_drafts": [10] * len(accepted)}}
    return {"temperature": float(t), "acceptance_length": 0.0, "per_suite": bench.suite_figures(per), "per_store": per}


def test_results_files_rebuild_the_table_without_any_run(tmp_path):
    out, results = tmp_path / "runs", tmp_path / "results"
    for lever, seed, plus in (("speculators", 0, 0), ("default", 0, 2), ("speculators", 1, 1), ("default", 1, 2)):
        run = _write(out, lever, seed, 1.2, [1.1])
        _ckpt(run, 100, 1.1 + plus / 10)
        for t in (0, 1):
            prompts = {11: [3 + plus, 5 + plus], 22: [1 + plus, 1 + plus]} if t else {11: [4 + plus], 22: [2]}
            (run / f"replay-T{t}.json").write_text(json.dumps(_replay_report(t, prompts)))
        assert bench.export_result(out, lever, seed, results, {"commit": {"commit": "abc"}}) is not None
    assert bench.export_result(out, "tv", 0, results, {}) is None  # no run: no result, no file
    assert sorted(p.name for p in results.iterdir()) == ["default-s0.json", "default-s1.json",
                                                        "speculators-s0.json", "speculators-s1.json"]
    t1 = json.loads((results / "default-s0.json").read_text())["reports"]["replay-T1.json"]["per_suite"]["mtbench"]
    # 2 prompts x 2 samples: AL 1 + (5 + 7 + 3 + 3) / 40; the SE resamples the 2 prompts, not 4 conversations
    assert t1["acceptance_length"] == pytest.approx(1.45) and (t1["conversations"], t1["prompts"]) == (4, 2)
    from_runs = bench.table(out, ["speculators", "default"], [0, 1], "speculators")
    for run in out.iterdir():
        for f in sorted(run.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        run.rmdir()
    assert bench.found_runs(results) == (["speculators", "default"], [0, 1])
    from_results = bench.table(results, ["speculators", "default"], [0, 1], "speculators")
    assert "replay AL mtbench T=1" in from_results.splitlines()[0]
    assert _row(from_results, "default")[:4] == [c for c in _row(from_runs, "default")[:4]]
    assert "| default | 1 |" in from_results and "| 100 |" in from_results  # per-seed rows, the learning curve
    # Δ replay mtbench T=0 of default vs speculators, paired by seed: +0.1 and +0.05 AL (2 and 1 more of 20)
    delta = _row(from_results, "default")[from_results.splitlines()[0].strip("|").split("|").index(
        " Δ replay AL mtbench T=0 vs speculators ")]
    assert delta.startswith("+0.075 ± 0.025") and "t(1)=3.00" in delta


@pytest.mark.parametrize("report, message", [
    ({"contamination": {"segments": 4, "in_training": 4, "training_segments": 9}}, "4 of its 4 conversations"),
    ({"replay": {"accepted": 1, "num_drafts": 2, "refused_turns": {"an EOS before its end": 1}}}, "1 assistant turn"),
])
def test_replay_refuses_a_store_that_cannot_stand_as_a_judge_figure(tmp_path, monkeypatch, report, message):
    judge = tmp_path / "judge"
    (judge / "mtbench-T0.zarr").mkdir(parents=True)
    (judge / "mtbench-T0.done.json").write_text(json.dumps({"max_new_tokens": 64}))
    full = {"replay": {"accepted": 1, "num_drafts": 2}, "simulated_acceptance_length": 1.5, **report}
    monkeypatch.setattr(bench, "run_offline_eval", lambda drafter, store, max_new_tokens: full)
    run = tmp_path / "default-s0"
    (run / "final").mkdir(parents=True)
    with pytest.raises(SystemExit, match=message):
        bench.replay(run, judge)
    assert not (run / "replay-T0.json").exists()


def test_refused_turns_are_judged_on_the_turns_walked_only_when_allowed_and_stay_in_the_report(tmp_path, monkeypatch):
    judge = tmp_path / "judge"
    (judge / "mtbench-T1-seed1.zarr").mkdir(parents=True)
    (judge / "mtbench-T1-seed1.done.json").write_text(json.dumps({"max_new_tokens": 64}))
    refused = {"cut before max_new_tokens without an EOS": 1}
    full = {"replay": {"accepted": 3, "num_drafts": 4, "refused_turns": refused}, "simulated_acceptance_length": 1.5}
    monkeypatch.setattr(bench, "run_offline_eval", lambda drafter, store, max_new_tokens: full)
    run = tmp_path / "default-s0"
    (run / "final").mkdir(parents=True)
    with pytest.raises(SystemExit, match="--allow-refused-turns judges the turns walked"):
        bench.replay(run, judge)
    bench.replay(run, judge, allow_refused_turns=True)
    rep = json.loads((run / "replay-T1.json").read_text())
    assert rep["acceptance_length"] == 1.75 and rep["per_store"]["mtbench-T1-seed1.zarr"]["refused_turns"] == refused


def _ckpt(run: Path, step: int, al: float) -> None:
    (run / f"checkpoint-{step}").mkdir(parents=True)
    (run / f"checkpoint-{step}" / "offline.json").write_text(json.dumps({"simulated_acceptance_length": al}))


def test_learning_curves_count_a_warm_start_from_its_start(tmp_path):
    d = _write(tmp_path, "default", 0, 1.3, [1.2])
    for step, al in ((50, 1.1), (100, 1.2), (150, 1.25), (200, 1.3)):
        _ckpt(d, step, al)
    w = _write(tmp_path, "lk_hybrid_warm", 0, 1.31, [1.2])
    (w / "summary.json").write_text(json.dumps({"train_wall_s": 50.0, "step_offset": 100}))
    _ckpt(w, 50, 1.27)
    _ckpt(w, 100, 1.31)
    assert bench.curve_points(tmp_path, "lk_hybrid_warm", 0) == {50: 1.1, 100: 1.2, 150: 1.27, 200: 1.31}
    text = bench.curves(tmp_path, ["default", "lk_hybrid_warm"], [0, 1])
    assert "| 150 | 1.250 (1) | 1.270 (1) |" in text.splitlines()  # one seed of two: its count shown


def test_the_last_drafter_is_final_else_the_last_checkpoint(tmp_path):
    run = tmp_path / "r"
    for step in (100, 50, 200):
        (run / f"checkpoint-{step}").mkdir(parents=True)
    assert [s for s, _ in bench.checkpoints(run)] == [50, 100, 200]
    assert bench.final_checkpoint(run) == run / "checkpoint-200"
    (run / "final").mkdir()
    assert bench.final_checkpoint(run) == run / "final"
    assert bench.final_checkpoint(tmp_path / "none") is None


@pytest.mark.parametrize("flags, message", [
    (["--levers", "lk_hybrid_warm,default", "--stages", "train"], "list default before it"),
    (["--levers", "default,tv", "--baseline", "speculators"], "--baseline speculators is not among"),
    (["--levers", "default", "--stages", "vllm"], "need --prompts"),
    (["--levers", "nope"], "unknown levers ['nope']"),
    (["--levers", "default", "--stages", "replay"], "the replay stage needs --judge DIR"),
])
def test_a_bench_that_cannot_run_as_asked_is_refused(flags, message, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["bench", "--store", "S", "--out", str(tmp_path / "o"), *flags])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_vllm_stage_refuses_a_missing_vllm_python_and_an_untrained_run(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sys, "argv", ["bench", "--out", str(tmp_path / "o"), "--levers", "default", "--stages",
                                      "vllm", "--prompts", "p.jsonl", "--vllm-python", str(tmp_path / "nope")])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2 and "--vllm-python" in capsys.readouterr().err
    (tmp_path / "default-s0").mkdir()
    with pytest.raises(SystemExit, match="default-s0 have none yet"):
        bench.judge_vllm([tmp_path / "default-s0"], 0.0, "p.jsonl", 1, 8, "smollm2-135m", sys.executable)


def test_a_column_with_fewer_seeds_than_its_row_says_how_many(tmp_path):
    _write(tmp_path, "default", 0, 1.2, [1.2], vllm_als=[1.3, 1.4])
    _write(tmp_path, "default", 1, 1.3, [1.2])
    cells = _row(bench.table(tmp_path, ["default"], [0, 1], "default"), "default")
    assert cells[1] == "2" and cells[2] == "1.250 ± 0.050" and "1.350 (1 seed)" in cells
