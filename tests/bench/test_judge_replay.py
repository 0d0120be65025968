"""bench/judge_replay.py: stores grouped by suite and temperature, T = 1 samples pooled, each drafter's AL and its
paired difference against the first, on hand-made replay reports."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
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


def _judge_dir(tmp_path, tiny_verifier, tiny_verifier_dir, conversations, M):
    """A judge set of one store (``mtbench-T0``) of ``conversations`` (prompt, answer), made with limit ``M``."""
    from stores.features.feature_store import FeatureStore
    from tests.peagle_train.evaluate.test_evaluate import make_store

    judge = tmp_path / "judge"
    judge.mkdir()
    path = make_store(str(judge / "mtbench-T0.zarr"), tiny_verifier, tiny_verifier_dir, [p + a for p, a in conversations],
                      loss_mask=[m for p, a in conversations for m in [0] * len(p) + [1] * len(a)])
    FeatureStore.open(path, mode="r+").record_generation(M, 0.0, 0)
    (judge / "mtbench-T0.done.json").write_text(json.dumps({"max_new_tokens": M}))
    return judge


def test_a_judge_set_of_the_training_conversations_is_refused(tiny_verifier, tiny_verifier_dir, tmp_path):
    """A drafter trained on the very conversations of the judge set: every one of them counted (2 of 2) and the
    judge refuses it unless --allow-contaminated."""
    from peagle_train.data.segment_hashes import training_segment_hashes
    from peagle_train.generate.speculative import speculative_generate
    from peagle_train.model.checkpoint import save_drafter
    from stores.features.feature_store import FeatureStore
    from tests.peagle_train.evaluate.test_evaluate import make_store
    from tests.peagle_train.generate.test_speculative import tiny_drafter

    drafter = tiny_drafter(tiny_verifier, num_depths=3)
    drafter.config.verifier_name_or_path = str(tiny_verifier_dir)
    M, prompts = 9, [[1, 504, 3458, 282, 260, 1115, 30], [1, 42, 43, 44, 45]]
    conversations = [(p, speculative_generate(tiny_verifier, drafter, p, M, 3, {2}).tokens) for p in prompts]
    train = make_store(str(tmp_path / "train.zarr"), tiny_verifier, tiny_verifier_dir, [p + a for p, a in conversations])
    trained = training_segment_hashes(FeatureStore.open(train), np.zeros(0, np.int64))
    save_drafter(drafter, tmp_path / "drafter", training_segments=trained)
    groups = judge_replay.judge_groups(_judge_dir(tmp_path, tiny_verifier, tiny_verifier_dir, conversations, M))
    with pytest.raises(SystemExit, match="2 of its 2 conversations are among the segments the drafter was trained on"):
        judge_replay.judge([str(tmp_path / "drafter")], groups, seed=0)
    allowed = judge_replay.judge([str(tmp_path / "drafter")], groups, seed=0, allow_contaminated=True)
    assert allowed["mtbench T=0"][str(tmp_path / "drafter")]["conversations"] == 2


@pytest.mark.parametrize("allow", [False, True])
def test_turns_the_replay_refuses_are_an_error_unless_allowed(tmp_path, monkeypatch, allow):
    (tmp_path / "mtbench-T0.done.json").write_text(json.dumps({"max_new_tokens": 32}))
    report = {"replay": {"per_conversation": {"conversation": [1], "accepted": [3], "num_drafts": [4]},
                         "refused_turns": {"longer than max_new_tokens": 2},
                         "refused_examples": {"longer than max_new_tokens": "block 0 segment 1: turn [5, 50)"}}}
    monkeypatch.setattr(judge_replay, "run_offline_eval", lambda *a, **k: report)
    groups = judge_replay.judge_groups(tmp_path)
    if allow:
        assert judge_replay.judge(["A"], groups, 0, allow_refused_turns=True)["mtbench T=0"]["A"]["conversations"] == 1
    else:
        with pytest.raises(SystemExit, match="2 assistant turn.s. not walked .*--allow-refused-turns"):
            judge_replay.judge(["A"], groups, 0)
