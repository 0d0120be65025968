"""bench/bench_losses.py: mean ± standard error over seeds; differences paired against the baseline by seed
(offline) and by seed and prompt turn (peagle's engine, vLLM); the learning curves, a warm start's steps counted
from its start's; the wall-time columns; the refusals of its command line."""

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


def test_table_pairs_each_lever_with_the_baseline_of_its_seed_and_turn(tmp_path):
    _write(tmp_path, "default", 0, 1.20, [1.1, 1.3])
    _write(tmp_path, "default", 1, 1.30, [1.2, 1.4])
    _write(tmp_path, "tv", 0, 1.25, [1.2, 1.3], wall=200.0)
    _write(tmp_path, "tv", 1, 1.31, [1.4, 1.4], wall=300.0)
    text = bench.table(tmp_path, ["default", "tv"], [0, 1], "default")
    head = [c.strip() for c in text.splitlines()[0].strip("|").split("|")]
    assert head[:5] == ["lever", "seeds", "offline AL (T=0)", "peagle engine AL T=0", "peagle engine AL T=1"]
    cells = _row(text, "tv")
    assert cells[1] == "2" and cells[2] == "1.280 ± 0.030"
    assert cells[5] == "0.400 / 0.200 / 0.000 / 0.100"  # None (no element at the depth) counts 0
    # offline: 0.05 and 0.01 paired by seed; 2.4 % of the default's mean 1.25; within 2 SE: no star
    assert cells[6] == "+0.030 ± 0.020 (+2.4%, n=2)"
    # online: turn differences 0.1, 0.0, 0.2, 0.0 -> mean 0.075, sd 0.0957, se 0.0479 (not beyond 2 SE)
    assert cells[7] == "+0.075 ± 0.048 (+6.0%, n=4)"  # the default's T=0 mean AL is 1.25
    assert cells[8] == "+0.075 ± 0.048 (+3.3%, n=4)"  # T=1: 2.25
    assert cells[9] == "250" and cells[10] == "- / -"
    assert _row(text, "default")[6:9] == ["", "", ""]


def test_vllm_turns_are_paired_by_prompt_and_turn_and_the_judge_time_shown(tmp_path):
    _write(tmp_path, "speculators", 0, 1.2, [1.2], vllm_als=[1.2, 1.4, 1.3, 1.1])
    _write(tmp_path, "default", 0, 1.2, [1.2], vllm_als=[1.3, 1.4, 1.5, 1.1], judge_s=(50.0, 70.0))
    text = bench.table(tmp_path, ["speculators", "default"], [0], "speculators")
    head = [c.strip() for c in text.splitlines()[0].strip("|").split("|")]
    i = head.index("Δ vLLM AL T=0 vs speculators")
    cells = _row(text, "default")
    assert cells[head.index("vLLM AL T=0")] == "1.325 ± 0.000"
    # turn differences 0.1, 0, 0.2, 0 -> +0.075 ± 0.048; the baseline's AL 1.25
    assert cells[i] == "+0.075 ± 0.048 (+6.0%, n=4)"
    assert cells[-1] == "50 / 70"


def test_a_difference_beyond_two_standard_errors_is_starred():
    assert bench.delta_cell([0.10, 0.12, 0.11], 1.0, True) == "+0.110 ± 0.006 (+11.0%, n=3) *"
    assert bench.delta_cell([0.1, -0.1], 1.0, True) == "+0.000 ± 0.100 (+0.0%, n=2)"
    assert bench.delta_cell([], 1.0, True) == ""


def test_turn_als_of_both_engines():
    vllm = {"per_prompt": [{"prompt_id": "81", "turn": 0, "verifier_steps": 4, "accepted": 3},
                           {"prompt_id": "81", "turn": 1, "verifier_steps": 0, "accepted": 0}]}
    assert bench.turn_als(vllm) == {("81", 0): 1.75}  # a turn with no drafting step is left out
    own = {"turns": [{"al": 1.5}, {"al": None}, {"al": 1.25}]}
    assert bench.turn_als(own) == {(0,): 1.5, (2,): 1.25}


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
    assert cells[1] == "2" and cells[2] == "1.250 ± 0.050" and "1.350 ± 0.000 (1 seed)" in cells
