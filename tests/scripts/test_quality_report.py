"""scripts/quality_report.py: the learning curve from metrics.jsonl and the checkpoints' held-out
reports, the projection, and the verdict against the target (AL >= 2.0 and faster than greedy)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("quality_report", REPO / "scripts" / "quality_report.py")
quality_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quality_report)


def fake_run(out: Path, als: list[float], online_al: float, tok_s: float) -> None:
    """4 steps of 512 tokens, 2 s each; checkpoints at steps 2 and 4 with held-out ALs ``als``."""
    (out / "drafter").mkdir(parents=True)
    rows = [{"split": "train", "step": s, "tokens_per_s": 256.0, "step_s": 2.0} for s in range(1, 5)]
    rows.insert(2, {"split": "val", "step": 2, "val_loss": 1.0})
    (out / "drafter" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for step, al in zip((2, 4), als):
        (out / "drafter" / f"checkpoint-{step}").mkdir()
        (out / "drafter" / f"checkpoint-{step}" / "held_out.json").write_text(json.dumps(
            {"offline": {"simulated_acceptance_length": al, "per_depth_accuracy": [0.5, 0.25]}}))
    (out / "online.json").write_text(json.dumps({
        "acceptance_length": online_al, "per_position_acceptance": [0.6, 0.3], "identical_to_greedy": True,
        "tokens_per_second": tok_s, "baseline_tokens_per_second": 10.0, "num_turns": 4, "num_draft_tokens": 2}))
    (out / "stage_seconds.txt").write_text("regenerate 5\ntrain 20\n")


def test_learning_curve_and_projection(tmp_path):
    fake_run(tmp_path, [1.2, 1.6], 1.5, 8.0)
    points = quality_report.learning_curve(tmp_path)
    assert [(p["step"], p["tokens"], p["seconds"], p["al"]) for p in points] == [(2, 1024, 4.0, 1.2), (4, 2048, 8.0, 1.6)]
    # AL rises 0.4 per doubling of tokens: 2.0 is one more doubling, 4096 tokens, 16 s at 256 tokens/s,
    # and 4096 s of generation at 1 regenerated token/s
    text = quality_report.projection(points, regen_tokens_per_s=1.0)
    assert text == ("held-out AL rises 0.400 per doubling of training tokens (first to last checkpoint); on that line "
                    "AL 2.0 needs about 0M training tokens, 0.0 hours of training at this run's speed, and as many "
                    "fresh regenerated tokens to avoid repeating data: 1 hours of generation at this run's 1 tok/s "
                    "(a GPU or a --server fleet)")
    fake = [dict(points[0], al=1.6), points[1]]
    assert "did not rise" in quality_report.projection(fake)
    slow = [dict(points[0], al=1.599), points[1]]  # 0.001 per doubling: 400 doublings away
    assert quality_report.projection(slow).endswith("more than 20 doublings (a million times this run's tokens) away")
    assert quality_report.projection(points[:1]) == "too few checkpoints for a learning curve"


@pytest.mark.parametrize("online_al, tok_s, verdict", [(2.1, 12.0, "target met"), (2.1, 9.0, "target missed"),
                                                       (1.5, 12.0, "target missed")])
def test_verdict_needs_both_al_and_speed(tmp_path, capsys, online_al, tok_s, verdict):
    fake_run(tmp_path, [1.2, 1.6], online_al, tok_s)
    quality_report.main(tmp_path)
    text = capsys.readouterr().out
    assert verdict in text and f"= {tok_s / 10:.2f}x" in text
    assert "step     4        2K tokens    0.1 min  AL 1.600" in text
