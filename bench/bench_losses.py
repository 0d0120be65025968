"""Each training lever of issue 36 against peagle's defaults, a reduced bench: the same store, steps and
seeds, judged offline (simulated AL and per-depth accuracy against the verifier's argmax on each run's
held-out blocks, T = 0) and online by peagle's own speculative decoder at T = 0 and T = 1 (greedy draft
scheme, vLLM's default), paired by seed and by prompt turn.

Levers (:data:`LEVERS`, each alone, everything else the defaults): the losses of ``--loss`` (``tv``,
``lk_hybrid`` (KL + TV), ``nla``, ``ce``), per-depth loss weights (``--depth-weights 1,2,4,5``: the inverse of
the COD keep ratios at r = 0.5, r_min = 0.2, so every depth carries about the same total weight) and COD
feeding the deep depths (``--down-sample-ratio-min 0.5``: every depth past 0 keeps half its anchors, 2.5x
depth 3's elements).

Online, every drafter decodes the same contexts: turn 2 of a question follows the verifier's greedy answer
to turn 1 (computed once), at both temperatures, so drafters differ only in their drafts; at T = 1 turn i
samples from the generator seeded (seed, i) for every drafter. A turn's acceptance length is its tokens per
verifier step (``len(tokens) / steps``, the first token from the prefill not counted in either).

Usage (repository root, the main venv):
    nice -n 5 python bench/bench_losses.py --store features.zarr --out runs --steps 300 --seeds 0,1,2 \\
        --prompts ../shared/data/mt_bench_question.jsonl --num-prompts 6 --max-new-tokens 64
    python bench/bench_losses.py --out runs --table        # the table again from the saved reports

Writes ``OUT/LEVER-sSEED/`` (the ``peagle-train`` output), ``.../offline.json``, ``.../online-T0.json``,
``.../online-T1.json``; prints the table (mean ± standard error over seeds, paired differences against the
default by seed and by prompt turn) and writes it to ``OUT/table.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from peagle_train.evaluate.inference import PEAGLEInference, load_for_decoding
from peagle_train.evaluate.offline import run_offline_eval
from peagle_train.evaluate.prompts import answer_text, read_prompts, render_turn
from peagle_train.model.checkpoint import load_drafter
from peagle_train.train.config import TrainConfig
from peagle_train.train.run import run_train
from stores.model_cache import load_tokenizer

LEVERS: dict[str, dict] = {
    "default": {},
    "tv": {"loss": "tv"},
    "lk_hybrid": {"loss": "lk_hybrid"},
    "nla": {"loss": "nla"},
    "ce": {"loss": "ce"},
    "depth_weights": {"depth_weights": "1,2,4,5"},
    "rmin_0.5": {"down_sample_ratio_min": 0.5},
}
"""Lever name -> the ``peagle-train`` settings it changes."""

BASE = dict(num_depths=4, draft_vocab_size=4096, lr=1e-3, val_fraction=0.1, val_max_blocks=4, loss_chunk_size=2048)
"""What every run shares besides store, output, steps and seed (the demo's settings)."""


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error (sample sd / sqrt(n); 0 for one value)."""
    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0)


def fmt(xs: list[float], digits: int = 3) -> str:
    m, se = mean_se(xs)
    return f"{m:.{digits}f} ± {se:.{digits}f}"


def train(store: str, out: Path, lever: str, seed: int, steps: int) -> None:
    run = out / f"{lever}-s{seed}"
    if (run / "final").is_dir():
        return
    t0 = time.perf_counter()
    summary = run_train(TrainConfig.from_flat(store=store, output=str(run), max_steps=steps, seed=seed, force=True,
                                              **BASE, **LEVERS[lever]))
    summary["train_wall_s"] = time.perf_counter() - t0
    (run / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"trained {run.name} in {summary['train_wall_s']:.0f} s", file=sys.stderr)


def offline(store: str, run: Path) -> None:
    if not (run / "offline.json").exists():
        rep = run_offline_eval(run / "final", store)
        (run / "offline.json").write_text(json.dumps({k: v for k, v in rep.items() if k != "blocks"}, indent=1))


def greedy_contexts(verifier_name: str, drafter_dir: Path, prompts_file: str, n: int, max_new: int,
                    out: Path) -> list[list[int]]:
    """Every turn's prompt ids, turn 2 after the verifier's greedy answer to turn 1 (cached in OUT)."""
    path = out / f"contexts-{n}-{max_new}.json"
    if path.exists():
        return json.loads(path.read_text())
    tokenizer = load_tokenizer(verifier_name)
    verifier, drafter = load_for_decoding(load_drafter(drafter_dir), verifier_name)
    engine = PEAGLEInference.from_models(verifier, drafter, tokenizer, None, None)
    contexts = []
    for prompt in read_prompts(prompts_file, n):
        answers: list[str] = []
        for turn in range(len(prompt.user_turns)):
            ids = render_turn(tokenizer, prompt, turn, answers)
            spec, _ = engine.generate_ids(ids, max_new, 0.0)  # T = 0: the verifier's greedy output
            contexts.append(ids)
            answers.append(answer_text(tokenizer, spec.tokens, engine.eos))
    path.write_text(json.dumps(contexts))
    return contexts


def online(verifier_name: str, run: Path, contexts: list[list[int]], max_new: int, temperature: float) -> None:
    path = run / f"online-T{temperature:g}.json"
    if path.exists():
        return
    tokenizer = load_tokenizer(verifier_name)
    verifier, drafter = load_for_decoding(load_drafter(run / "final"), verifier_name)
    engine = PEAGLEInference.from_models(verifier, drafter, tokenizer, None, None)
    turns = []
    for i, ids in enumerate(contexts):
        spec, _ = engine.generate_ids(ids, max_new, temperature, seed=1000 + i, draft_sample_method="greedy")
        steps = len(spec.accepted_per_step)
        turns.append({"tokens": len(spec.tokens), "steps": steps, "accepted": spec.accepted,
                      "drafted": spec.drafted, "al": (sum(a + 1 for a in spec.accepted_per_step) / steps) if steps else None})
    steps = sum(t["steps"] for t in turns)
    report = {"temperature": temperature, "draft_sample_method": "greedy", "turns": turns,
              "acceptance_length": sum(t["steps"] + t["accepted"] for t in turns) / steps}
    path.write_text(json.dumps(report, indent=1))


def table(out: Path, levers: list[str], seeds: list[int]) -> str:
    """The markdown table of every lever with all its reports, and the paired differences."""
    def load(lever, seed, name):
        p = out / f"{lever}-s{seed}" / name
        return json.loads(p.read_text()) if p.exists() else None

    lines = ["| lever | seeds | offline AL (T=0) | offline per-depth accuracy (T=0) | online AL T=0 | online AL T=1 "
             "| Δ offline AL | Δ online T=0 | Δ online T=1 | train wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for lever in levers:
        rows = [(s, load(lever, s, "offline.json"), load(lever, s, "online-T0.json"), load(lever, s, "online-T1.json"),
                 load(lever, s, "summary.json")) for s in seeds]
        rows = [r for r in rows if r[1] is not None]
        if not rows:
            continue
        off = [r[1]["simulated_acceptance_length"] for r in rows]
        depth = [[r[1]["per_depth_accuracy"][d] or 0.0 for r in rows] for d in range(4)]
        cells = [lever, str(len(rows)), fmt(off), " / ".join(f"{statistics.fmean(d):.3f}" for d in depth)]
        for key in ("online-T0.json", "online-T1.json"):
            vals = [load(lever, s, key) for s, *_ in rows]
            cells.append(fmt([v["acceptance_length"] for v in vals]) if all(vals) else "-")
        base_off = {s: load("default", s, "offline.json") for s, *_ in rows}
        diffs = [r[1]["simulated_acceptance_length"] - base_off[r[0]]["simulated_acceptance_length"]
                 for r in rows if base_off[r[0]] is not None]
        cells.append(fmt(diffs) if diffs and lever != "default" else "")
        for key in ("online-T0.json", "online-T1.json"):  # paired by seed and prompt turn: one difference per pair
            d = []
            for s, *_ in rows:
                a, b = load(lever, s, key), load("default", s, key)
                if a and b:
                    d += [x["al"] - y["al"] for x, y in zip(a["turns"], b["turns"]) if x["al"] and y["al"]]
            cells.append(f"{fmt(d)} (n={len(d)})" if d and lever != "default" else "")
        cells.append(f"{statistics.fmean(r[4]['train_wall_s'] for r in rows if r[4]):.0f}" if all(r[4] for r in rows) else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--levers", default=",".join(LEVERS))
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--prompts")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--stages", default="train,offline,online")
    ap.add_argument("--temperatures", default="0,1", help="online: the temperatures judged")
    ap.add_argument("--table", action="store_true", help="only print the table of the saved reports")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    levers = args.levers.split(",")
    unknown = [lv for lv in levers if lv not in LEVERS]
    if unknown:
        ap.error(f"unknown levers {unknown}; known: {', '.join(LEVERS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    stages = set(args.stages.split(",")) if not args.table else set()
    torch.set_num_threads(1)
    for seed in seeds:  # seed-major: a partial run still pairs every lever with the default
        for lever in levers:
            run = args.out / f"{lever}-s{seed}"
            if "train" in stages:
                train(args.store, args.out, lever, seed, args.steps)
            if "offline" in stages:
                offline(args.store, run)
            if "online" in stages:
                contexts = greedy_contexts(args.verifier, run / "final", args.prompts, args.num_prompts,
                                           args.max_new_tokens, args.out)
                for temperature in (float(t) for t in args.temperatures.split(",")):
                    online(args.verifier, run, contexts, args.max_new_tokens, temperature)
            print(f"done {run.name}", file=sys.stderr)
    text = table(args.out, levers, seeds)
    (args.out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
