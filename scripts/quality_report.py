"""Print the report of ``scripts/quality.sh OUT``: online AL, per-position acceptance and speedup on
held-out MT-Bench questions, the learning curve on the held-out store, and, when the target (AL >= 2.0
and speculative decoding faster than greedy) is missed, the budget the learning curve projects.

Usage: python scripts/quality_report.py OUT
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

TARGET_AL = 2.0


def learning_curve(out: Path) -> list[dict]:
    """One point per checkpoint: step, training tokens and seconds so far, held-out AL and accuracy."""
    rows = [json.loads(line) for line in (out / "drafter" / "metrics.jsonl").read_text().splitlines() if line]
    train = [r for r in rows if r.get("split") == "train"]
    points = []
    for ck in sorted((out / "drafter").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])):
        step = int(ck.name.split("-")[1])
        done = [r for r in train if r["step"] <= step]
        report = json.loads((ck / "held_out.json").read_text())
        report = report.get("offline", report)
        points.append({"step": step, "tokens": sum(r["tokens_per_s"] * r["step_s"] for r in done),
                       "seconds": sum(r["step_s"] for r in done),
                       "al": report["simulated_acceptance_length"], "acc": report["per_depth_accuracy"]})
    return points


def projection(points: list[dict], regen_tokens_per_s: float | None = None) -> str:
    """Training tokens (and hours) for held-out AL 2.0 from a straight line of AL against
    log(training tokens) through the first and last checkpoints: a rough extrapolation, and an
    optimistic one for a small store, whose later passes repeat data (fresh data would be needed)."""
    if len(points) < 2 or points[-1]["tokens"] <= points[0]["tokens"]:
        return "too few checkpoints for a learning curve"
    a, b = points[0], points[-1]
    slope = (b["al"] - a["al"]) / math.log(b["tokens"] / a["tokens"])
    if slope <= 0:
        return "the held-out AL did not rise over the checkpoints: more steps alone will not reach 2.0"
    rise = f"held-out AL rises {slope * math.log(2):.3f} per doubling of training tokens (first to last checkpoint)"
    doublings = (TARGET_AL - b["al"]) / (slope * math.log(2))
    if doublings > 20:
        return f"{rise}; on that line AL {TARGET_AL} is more than 20 doublings (a million times this run's tokens) away"
    tokens = b["tokens"] * 2 ** doublings
    hours = tokens / (b["tokens"] / b["seconds"]) / 3600
    text = (f"{rise}; on that line AL {TARGET_AL} needs about {tokens / 1e6:,.0f}M training tokens, "
            f"{hours:,.1f} hours of training at this run's speed")
    if regen_tokens_per_s:
        text += (f", and as many fresh regenerated tokens to avoid repeating data: {tokens / regen_tokens_per_s / 3600:,.0f} "
                 f"hours of generation at this run's {regen_tokens_per_s:.0f} tok/s (a GPU or a --server fleet)")
    return text


def regen_rate(out: Path, stages: list[list[str]]) -> float | None:
    """New tokens per second of stage 1 (``regenerate``), from its manifest and stage time; None when
    the stage took under a minute (a re-run that found the regeneration done: not its speed)."""
    manifest, secs = out / "regenerated.manifest.json", dict(stages).get("regenerate")
    if not manifest.is_file() or not secs or int(secs) < 60:
        return None
    return json.loads(manifest.read_text())["counts"]["completion_tokens"] / int(secs)


def main(out: Path) -> None:
    online = json.loads((out / "online.json").read_text())
    speedup = online["tokens_per_second"] / online["baseline_tokens_per_second"]
    pos = ", ".join(f"{p:.3f}" for p in online["per_position_acceptance"])
    print(f"held-out MT-Bench, online ({online.get('num_turns', '?')} turns, {online.get('num_draft_tokens', '?')} "
          f"drafts a step, greedy, checked token for token: identical_to_greedy={online['identical_to_greedy']})")
    print(f"  acceptance length {online['acceptance_length']:.3f}   per-position acceptance [{pos}] "
          "(share of verifier steps accepting draft i, vLLM's rate)")
    print(f"  tokens/s: speculative {online['tokens_per_second']:.2f} vs greedy "
          f"{online['baseline_tokens_per_second']:.2f} = {speedup:.2f}x"
          + (" (faster)" if speedup > 1 else " (SLOWER)"))
    points = learning_curve(out)
    print("learning curve (the held-out MT-Bench store, offline simulated AL):")
    for p in points:
        acc = ", ".join(f"{a:.3f}" for a in p["acc"])
        print(f"  step {p['step']:>5}  {p['tokens'] / 1e3:>7.0f}K tokens  {p['seconds'] / 60:>5.1f} min  "
              f"AL {p['al']:.3f}  per-depth accuracy [{acc}]")
    stages = [line.split() for line in (out / "stage_seconds.txt").read_text().splitlines() if line]
    print("wall time by stage end (s): " + ", ".join(f"{name} {secs}" for name, secs in stages))
    if online["acceptance_length"] >= TARGET_AL and speedup > 1:
        print(f"target met: AL >= {TARGET_AL} and speculative decoding faster than greedy")
    else:
        print(f"target missed (AL >= {TARGET_AL} and faster than greedy); " + projection(points, regen_rate(out, stages)))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
