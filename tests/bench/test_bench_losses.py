"""bench/bench_losses.py: mean ± standard error over seeds, and differences paired by seed (offline) and by
seed and prompt turn (online) against the default, from saved reports."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("bench_losses", REPO / "bench" / "bench_losses.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench
spec.loader.exec_module(bench)


def _write(out: Path, lever: str, seed: int, offline_al: float, turn_als: list[float]) -> None:
    run = out / f"{lever}-s{seed}"
    run.mkdir(parents=True)
    (run / "offline.json").write_text(json.dumps({"simulated_acceptance_length": offline_al,
                                                  "per_depth_accuracy": [0.4, 0.2, None, 0.1]}))
    for t in (0, 1):
        turns = [{"al": a + t, "steps": 10, "accepted": round(10 * (a + t - 1))} for a in turn_als]
        (run / f"online-T{t}.json").write_text(json.dumps({"acceptance_length": sum(turn_als) / len(turn_als) + t,
                                                          "turns": turns}))
    (run / "summary.json").write_text(json.dumps({"train_wall_s": 100.0}))


def test_mean_se():
    m, se = bench.mean_se([1.0, 2.0, 3.0])
    assert m == 2.0 and math.isclose(se, 1.0 / math.sqrt(3))
    assert bench.mean_se([5.0]) == (5.0, 0.0)


def test_table_pairs_each_lever_with_the_default_of_its_seed_and_turn(tmp_path):
    _write(tmp_path, "default", 0, 1.20, [1.1, 1.3])
    _write(tmp_path, "default", 1, 1.30, [1.2, 1.4])
    _write(tmp_path, "tv", 0, 1.25, [1.2, 1.3])
    _write(tmp_path, "tv", 1, 1.31, [1.4, 1.4])
    text = bench.table(tmp_path, ["default", "tv"], [0, 1])
    tv = next(line for line in text.splitlines() if line.startswith("| tv "))
    cells = [c.strip() for c in tv.strip("|").split("|")]
    assert cells[1] == "2" and cells[2] == "1.280 ± 0.030"
    assert cells[3] == "0.400 / 0.200 / 0.000 / 0.100"  # None (no element at the depth) counts 0
    assert cells[6] == "0.030 ± 0.020"  # offline: 0.05 and 0.01 paired by seed
    # online: turn differences 0.1, 0.0, 0.2, 0.0 -> mean 0.075, sd 0.0957, se 0.0479
    assert cells[7] == "0.075 ± 0.048 (n=4)" and cells[8] == cells[7]
