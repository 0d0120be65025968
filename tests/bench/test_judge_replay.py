"""bench/judge_replay.py: stores grouped by suite and temperature, T = 1 samples pooled, each drafter's AL and its
paired difference against the first, on hand-made replay reports."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("judge_replay", REPO / "bench" / "judge_replay.py")
judge_replay = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = judge_replay
spec.loader.exec_module(judge_replay)


def test_drafters_side_by_side_are_paired_by_conversation(tmp_path, monkeypatch):
    for name in ("mtbench-T0", "mtbench-T1-seed1", "mtbench-T1-seed2"):
        (tmp_path / f"{name}.done.json").write_text(json.dumps({"max_new_tokens": 32}))
    groups = judge_replay.judge_groups(tmp_path)
    assert {g: [p.name for p in s] for g, s in groups.items()} == {
        "mtbench T=0": ["mtbench-T0.zarr"], "mtbench T=1": ["mtbench-T1-seed1.zarr", "mtbench-T1-seed2.zarr"]}

    def fake(drafter, store, max_new_tokens, seed):
        assert max_new_tokens == 32
        plus = 5 if drafter == "B" else 0  # B accepts 5 more in every conversation (of 10 drafts)
        return {"replay": {"per_conversation": {"conversation": [1, 2], "accepted": [2 + plus, 8 + plus],
                                                "num_drafts": [10, 10]}}}

    monkeypatch.setattr(judge_replay, "run_offline_eval", fake)
    result = judge_replay.judge(["A", "B"], groups, seed=0)
    t1 = result["mtbench T=1"]
    assert t1["A"]["conversations"] == 4 and t1["A"]["acceptance_length"] == pytest.approx(1.5)
    assert t1["B"]["acceptance_length"] == pytest.approx(2.0) and t1["A"]["se"] > 0.1
    assert t1["B"]["vs_first"]["difference"] == pytest.approx(0.5) and t1["B"]["vs_first"]["se"] < 1e-12
    text = judge_replay.table(result, ["A", "B"])
    assert text.splitlines()[0] == ("| drafter | mtbench T=0 AL | mtbench T=1 AL | Δ mtbench T=0 vs first | "
                                    "Δ mtbench T=1 vs first |")
    assert "+0.500 ± 0.000 (n=4)" in text.splitlines()[-1]


def test_t1_samples_of_one_prompt_are_resampled_together(tmp_path, monkeypatch):
    # two seeded samples of the same two prompts, each sample as its prompt's other sample: the SE over the 2 prompts
    # is that of 2 units, larger than the SE of 4 conversations resampled as if independent
    for name in ("mtbench-T1-seed1", "mtbench-T1-seed2"):
        (tmp_path / f"{name}.done.json").write_text(json.dumps({"max_new_tokens": 32}))

    def fake(drafter, store, max_new_tokens, seed):
        return {"replay": {"per_conversation": {"conversation": [1, 2], "prompt": [111, 222], "accepted": [2, 8],
                                                "num_drafts": [10, 10]}}}

    monkeypatch.setattr(judge_replay, "run_offline_eval", fake)
    t1 = judge_replay.judge(["A", "B"], judge_replay.judge_groups(tmp_path), seed=0)["mtbench T=1"]
    assert (t1["A"]["conversations"], t1["A"]["prompts"]) == (4, 2)
    independent = judge_replay.bootstrap_al(judge_replay.np.array([2, 8, 2, 8]), judge_replay.np.array([10] * 4),
                                            seed=0)[1]
    assert t1["A"]["se"] > 1.25 * independent
    assert t1["B"]["vs_first"]["units"] == 2
