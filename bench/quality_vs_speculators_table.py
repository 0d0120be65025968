"""The side-by-side table of bench/bench_quality_vs_speculators.py's drafters, from the reports
bench/eval_quality_vs_speculators.sh wrote (peagle-eval JSON) and the bench's ``summary.json`` files.

Usage: python bench/quality_vs_speculators_table.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _fmt(x, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    out = Path(sys.argv[1])
    curve, table = [], []
    for d in sorted(p for p in out.iterdir() if (p / "summary.json").is_file()):
        s = _read(d / "summary.json")
        steps = sorted(int(c.name.split("-")[1]) for c in d.glob("checkpoint-*"))
        for step in steps:
            h = _read(d / f"checkpoint-{step}" / "held_out.json")
            if h is not None:
                acc = " / ".join(_fmt(a) for a in h["per_depth_accuracy"])
                curve.append(f"| {d.name} | {step} | {_fmt(h['simulated_acceptance_length'])} | {acc} |")
        last = steps[-1] if steps else None
        h = _read(d / f"checkpoint-{last}" / "held_out.json") if last else None
        on, vl = _read(d / "online.json"), _read(d / "vllm.json")
        same = lambda r: "-" if r is None else ("yes" if r["identical_to_greedy"] else "NO")  # noqa: E731
        table.append(
            f"| {d.name} | {s['steps']} | {_fmt(h and h['simulated_acceptance_length'])} "
            f"| {' / '.join(_fmt(a) for a in h['per_depth_accuracy']) if h else '-'} "
            f"| {_fmt(on and on['acceptance_length'])} ({same(on)}) | {_fmt(vl and vl['acceptance_length'])} ({same(vl)}) "
            f"| {s['median_step_s']:.3f} | {_fmt(s.get('peak_mib_above_setup'), '.0f')} |")
    print("| drafter | steps | held-out AL offline | per-depth accuracy | online AL (identical) | vLLM AL (identical) "
          "| s / step (median) | peak MiB above set-up |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(table))
    print()
    print("| drafter | step | held-out AL offline | per-depth accuracy |")
    print("|---|---|---|---|")
    print("\n".join(curve))


if __name__ == "__main__":
    main()
