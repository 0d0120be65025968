"""Each training lever of issue 36 against peagle's defaults and speculators' trainer: the same store, steps and
seeds, judged offline (simulated AL and per-depth accuracy against the verifier's argmax on each seed's
held-out blocks, T = 0, at every saved checkpoint: the learning curves), online by peagle's own speculative
decoder (stage ``online``) and by vLLM (stage ``vllm``, :mod:`vllm_judge` in the vLLM environment) at T = 0 and
T = 1 under vLLM's default draft scheme (``greedy``), paired by seed and by prompt turn.

Trainers and levers (:data:`LEVERS`, each alone, everything else the defaults):
- ``speculators``: speculators 0.9.0's P-EAGLE model, COD sampling and KL loss
  (:class:`bench_quality_vs_speculators.SpeculatorsTrainer`) on peagle's block sequence of the seed, with
  peagle's optimizer, schedule and draft vocab: its defaults (the bench extra, ``PEAGLE_BENCH=1``);
- ``default``: ``peagle-train`` with :data:`BASE`;
- the losses of ``--loss`` (``tv``, ``lk_hybrid`` (KL + TV), ``nla``, ``ce``); ``lk_hybrid_warm``: the default's
  checkpoint at half the steps (forward KL) trained on with ``lk_hybrid`` for the other half (``--init-from``: a
  new optimizer and schedule), so the same steps in all;
- per-depth loss weights (``--depth-weights 1,2,4,5``: the inverse of the COD keep ratios at r = 0.5, r_min =
  0.2, so every depth carries about the same total weight) and COD feeding the deep depths
  (``--down-sample-ratio-min 0.5``: every depth past 0 keeps half its anchors, 2.5x depth 3's elements).

Online (peagle's engine), every drafter decodes the same contexts: turn 2 of a question follows the verifier's
greedy answer to turn 1 (computed once), at both temperatures, so drafters differ only in their drafts; at T = 1
turn i samples from the generator seeded (seed, i) for every drafter. A turn's acceptance length is its tokens
per verifier step. vLLM: every drafter's turns are the same requests (later turns after vLLM's own reference
answers, greedy at T = 0, seeded samples at T = 1), each request seeded as ``peagle-eval --engine vllm`` seeds it;
a turn's AL is ``1 + accepted / drafts`` from vLLM's per-request counts. At T > 0 on a vLLM CPU build whose
rejection sampler is broken (vLLM issue #55005) the judge applies PR #55006's fix in its own process and says so
in every report (``cpu_expand_fix``).

Usage (repository root, the main venv; the vLLM stage runs ``PEAGLE_VLLM_PYTHON``, default ``.venv-vllm``):
    nice -n 19 python bench/bench_losses.py --store features.zarr --out runs --steps 200 --save-every 50 \
        --seeds 0,1 --levers speculators,default,lk_hybrid_warm,rmin_0.5 --stages train,offline,vllm \
        --prompts ../shared/data/mt_bench_question.jsonl --num-prompts 10 --max-new-tokens 128
    python bench/bench_losses.py --out runs --seeds 0,1 --levers ... --table   # the tables from the saved reports

Writes ``OUT/LEVER-sSEED/`` (the ``peagle-train`` output, or speculators' checkpoints), ``.../offline.json`` (the
last checkpoint's) and ``.../checkpoint-N/offline.json``, ``.../online-T{0,1}.json``, ``.../vllm-T{0,1}.json``;
prints the table (mean ± standard error over seeds, paired differences against ``--baseline``: speculators when it
is among the levers, else the default) and the learning curves, and writes them to ``OUT/table.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bench_quality_vs_speculators as side_by_side  # noqa: E402

from peagle_train.data.loader import BlockLoader  # noqa: E402
from peagle_train.evaluate.inference import PEAGLEInference, load_for_decoding  # noqa: E402
from peagle_train.evaluate.offline import run_offline_eval  # noqa: E402
from peagle_train.evaluate.prompts import answer_text, read_prompts, render_turn  # noqa: E402
from peagle_train.model.checkpoint import load_drafter  # noqa: E402
from peagle_train.train.config import TrainConfig  # noqa: E402
from peagle_train.train.run import build_trainer, run_train  # noqa: E402
from stores.model_cache import load_tokenizer  # noqa: E402

BENCH = Path(__file__).resolve().parent
SPECULATORS = "speculators"
"""The lever that is speculators' trainer, not a ``peagle-train`` setting."""

LEVERS: dict[str, dict] = {
    SPECULATORS: {},
    "default": {},
    "tv": {"loss": "tv"},
    "lk_hybrid": {"loss": "lk_hybrid"},
    "lk_hybrid_warm": {"loss": "lk_hybrid"},
    "nla": {"loss": "nla"},
    "ce": {"loss": "ce"},
    "depth_weights": {"depth_weights": "1,2,4,5"},
    "rmin_0.5": {"down_sample_ratio_min": 0.5},
}
"""Lever name -> the ``peagle-train`` settings it changes (``speculators``: its own trainer, same settings)."""

WARM_START: dict[str, str] = {"lk_hybrid_warm": "default"}
"""Lever -> the lever whose checkpoint at half the steps it starts from (then trains the other half)."""

BASE = dict(num_depths=4, draft_vocab_size=4096, lr=1e-3, val_fraction=0.1, val_max_blocks=4, loss_chunk_size=2048)
"""What every run shares besides store, output, steps and seed (the demo's settings)."""


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error (sample sd / sqrt(n); 0 for one value)."""
    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0)


def fmt(xs: list[float], digits: int = 3) -> str:
    m, se = mean_se(xs)
    return f"{m:.{digits}f} ± {se:.{digits}f}"


def checkpoints(run: Path) -> list[tuple[int, Path]]:
    """``(step within this run, directory)`` of every ``checkpoint-N`` of ``run``, by step."""
    found = [(int(d.name.split("-")[1]), d) for d in run.glob("checkpoint-*") if d.name.split("-")[1].isdigit()]
    return sorted(found)


def final_checkpoint(run: Path) -> Path | None:
    """The drafter a run ends with: ``final/`` (``peagle-train``), else its last ``checkpoint-N`` (speculators)."""
    if (run / "final").is_dir():
        return run / "final"
    found = checkpoints(run)
    return found[-1][1] if found else None


def train_config(store: str, run: Path, lever: str, seed: int, steps: int, save_every: int | None,
                 init_from: str | None = None) -> TrainConfig:
    """The ``peagle-train`` settings of ``lever`` (for ``speculators``: the run whose split, block order, draft
    vocab and schedule its trainer takes)."""
    return TrainConfig.from_flat(store=store, output=str(run), max_steps=steps, seed=seed, force=True,
                                 save_every=save_every, init_from=init_from, **BASE, **LEVERS[lever])


def train_speculators(cfg: TrainConfig, run: Path, steps: int, save_every: int | None) -> dict:
    """speculators' trainer on the blocks ``peagle-train`` would take with ``cfg`` (its output, ``run/peagle_split``,
    holds only that run's ``train_config.json``); checkpoints ``run/checkpoint-N`` (its ``save_pretrained``)."""
    trainer = build_trainer(cfg)
    spec = side_by_side.speculators_trainer_for(trainer, cfg)
    loader = BlockLoader(trainer.run.store, trainer.run.sequence, cursor=0, grad_accum=1)
    rows = []
    try:
        for step, (_, block) in zip(range(1, steps + 1), loader):
            row = spec.train_step(block)
            rows.append({"step": step, "loss": row["loss"], "acc": row["acc"]})
            if (save_every and step % save_every == 0) or step == steps:
                spec.save(run / f"checkpoint-{step}")
    finally:
        loader.close()
        trainer.close()
    return {"trainer": SPECULATORS, "steps": steps, "held_out_blocks": [int(b) for b in trainer.run.val_ids],
            "rows": rows}


def train(store: str, out: Path, lever: str, seed: int, steps: int, save_every: int | None = None) -> None:
    """Train ``lever`` at ``seed`` into ``OUT/LEVER-sSEED`` unless its ``summary.json`` is there.

    Raises:
        SystemExit: a warm-started lever whose start (the other lever's checkpoint at half the steps) is missing.
    """
    run = out / f"{lever}-s{seed}"
    if (run / "summary.json").exists():
        return
    t0 = time.perf_counter()
    if lever == SPECULATORS:
        summary = train_speculators(train_config(store, run / "peagle_split", "default", seed, steps, None), run,
                                    steps, save_every)
    elif lever in WARM_START:
        half = steps // 2
        start = out / f"{WARM_START[lever]}-s{seed}" / f"checkpoint-{half}"
        if not start.is_dir():
            raise SystemExit(f"{lever} starts from {start}, which is missing: train {WARM_START[lever]} first with "
                             f"--save-every dividing {half}")
        summary = run_train(train_config(store, run, lever, seed, steps - half, save_every, init_from=str(start)))
        summary["step_offset"] = half
    else:
        summary = run_train(train_config(store, run, lever, seed, steps, save_every))
    summary["train_wall_s"] = time.perf_counter() - t0
    (run / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"trained {run.name} in {summary['train_wall_s']:.0f} s", file=sys.stderr)


def offline(store: str, run: Path) -> None:
    """Offline reports of every checkpoint of ``run`` (``checkpoint-N/offline.json``) and of its last drafter
    (``run/offline.json``), on the seed's held-out blocks: those ``peagle-train`` recorded, or for speculators'
    drafters the split its trainer took (``summary.json``'s ``held_out_blocks``)."""
    summary = json.loads((run / "summary.json").read_text())
    blocks = summary.get("held_out_blocks")
    targets = [(d / "offline.json", d) for _, d in checkpoints(run)] + [(run / "offline.json", final_checkpoint(run))]
    for path, drafter in targets:
        if not path.exists():
            rep = run_offline_eval(drafter, store, blocks=blocks)
            rep["block_ids"] = rep.pop("blocks", None)
            path.write_text(json.dumps(rep, indent=1))


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
    verifier, drafter = load_for_decoding(load_drafter(final_checkpoint(run)), verifier_name)
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


def judge_vllm(runs: list[Path], temperature: float, prompts: str, n: int, max_new: int, verifier: str,
               python: str) -> None:
    """vLLM's acceptance of every run's last drafter at ``temperature`` (``RUN/vllm-T{t}.json``), by
    :mod:`vllm_judge` in ``python`` (the vLLM environment): one process, vLLM's reference once, then each drafter.

    Raises:
        SystemExit: a run without a drafter yet. subprocess.CalledProcessError: the judge failed (its output is on
        stderr).
    """
    name = f"vllm-T{temperature:g}.json"
    pending = [r for r in runs if not (r / name).exists()]
    untrained = [r.name for r in pending if final_checkpoint(r) is None]
    if untrained:
        raise SystemExit(f"the vllm stage judges trained drafters; {', '.join(untrained)} have none yet (run the "
                         "train stage first)")
    if not pending:
        return
    cmd = [python, str(BENCH / "vllm_judge.py"), "--temperature", f"{temperature:g}", "--prompts", prompts,
           "--num-prompts", str(n), "--max-new-tokens", str(max_new), "--verifier", verifier,
           "--drafters", *[str(final_checkpoint(r)) for r in pending], "--reports", *[str(r / name) for r in pending]]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
           "PYTHONPATH": str(BENCH.parent)}
    subprocess.run(cmd, check=True, env=env)


def turn_als(report: dict) -> dict[tuple, float]:
    """Per prompt turn, its acceptance length, keyed for pairing: peagle's engine (``turns``: key = index, AL =
    tokens per verifier step) or vLLM (``per_prompt``: key = (prompt id, turn), AL = 1 + accepted / drafts).
    Turns without a verifier step are left out."""
    if "per_prompt" in report:
        return {(p["prompt_id"], p["turn"]): 1.0 + p["accepted"] / p["verifier_steps"]
                for p in report["per_prompt"] if p["verifier_steps"]}
    return {(i,): t["al"] for i, t in enumerate(report["turns"]) if t["al"]}


METRICS: list[tuple[str, str, bool]] = [
    ("offline AL (T=0)", "offline.json", False),
    ("peagle engine AL T=0", "online-T0.json", True),
    ("peagle engine AL T=1", "online-T1.json", True),
    ("vLLM AL T=0", "vllm-T0.json", True),
    ("vLLM AL T=1", "vllm-T1.json", True),
]
"""Column name, report file, paired by prompt turn (else by seed only)."""


def _value(report: dict) -> float:
    return report.get("simulated_acceptance_length", report.get("acceptance_length"))


def paired(out: Path, lever: str, base: str, seeds: list[int], name: str, by_turn: bool) -> list[float]:
    """Differences ``lever - base``: one per seed (``by_turn`` False) or one per seed and prompt turn that both
    reports have."""
    diffs = []
    for s in seeds:
        a, b = load(out, lever, s, name), load(out, base, s, name)
        if a is None or b is None:
            continue
        if by_turn:
            ta, tb = turn_als(a), turn_als(b)
            diffs += [ta[k] - tb[k] for k in ta if k in tb]
        else:
            diffs.append(_value(a) - _value(b))
    return diffs


def load(out: Path, lever: str, seed: int, name: str) -> dict | None:
    p = out / f"{lever}-s{seed}" / name
    return json.loads(p.read_text()) if p.exists() else None


def delta_cell(diffs: list[float], base_mean: float | None, by_turn: bool) -> str:
    """``Δ ± SE (+x.x%, n=N)``, with ``*`` when |Δ| exceeds two standard errors."""
    if not diffs:
        return ""
    m, se = mean_se(diffs)
    pct = f"{100 * m / base_mean:+.1f}%, " if base_mean else ""
    star = " *" if len(diffs) > 1 and abs(m) > 2 * se else ""
    return f"{m:+.3f} ± {se:.3f} ({pct}n={len(diffs)}){star}"


def table(out: Path, levers: list[str], seeds: list[int], baseline: str) -> str:
    """The markdown table of every lever with reports (mean ± SE over seeds; Δ paired against ``baseline``: by
    seed offline, by seed and prompt turn online), the per-depth accuracy, the wall times, then the learning
    curves (offline AL of every checkpoint, mean over the seeds, by the step counted from the run's start)."""
    shown = [(col, name, by_turn) for col, name, by_turn in METRICS
             if any(load(out, lv, s, name) for lv in levers for s in seeds)]
    head = ["lever", "seeds", *[c for c, _, _ in shown], "offline per-depth accuracy (T=0)",
            *[f"Δ {c} vs {baseline}" for c, _, _ in shown], "train wall s", "vLLM judge wall s (T=0 / T=1)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lever in levers:
        got = [s for s in seeds if load(out, lever, s, "summary.json")]
        if not got:
            continue
        cells = [lever, str(len(got))]
        for _, name, _ in shown:
            vals = [_value(r) for r in (load(out, lever, s, name) for s in got) if r]
            cells.append((fmt(vals) + (f" ({len(vals)} seed{'s' if len(vals) > 1 else ''})" if len(vals) < len(got)
                                       else "")) if vals else "-")
        offs = [r for r in (load(out, lever, s, "offline.json") for s in got) if r]
        K = len(offs[0]["per_depth_accuracy"]) if offs else 0
        cells.append(" / ".join(f"{statistics.fmean(r['per_depth_accuracy'][d] or 0.0 for r in offs):.3f}"
                                for d in range(K)) or "-")
        for _, name, by_turn in shown:
            base_vals = [_value(r) for r in (load(out, baseline, s, name) for s in got) if r]
            cells.append("" if lever == baseline else delta_cell(
                paired(out, lever, baseline, got, name, by_turn), statistics.fmean(base_vals) if base_vals else None,
                by_turn))
        walls = [load(out, lever, s, "summary.json").get("train_wall_s") for s in got]
        cells.append(f"{statistics.fmean(walls):.0f}" if all(w is not None for w in walls) else "-")
        judge = []
        for t in ("0", "1"):
            w = [r.get("judge_wall_s") for r in (load(out, lever, s, f"vllm-T{t}.json") for s in got) if r]
            judge.append(f"{statistics.fmean(w):.0f}" if w and all(x is not None for x in w) else "-")
        cells.append(" / ".join(judge))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + curves(out, levers, seeds)


def curve_points(out: Path, lever: str, seed: int) -> dict[int, float]:
    """Step (from the run's start; a warm start's own steps plus its start's) -> offline AL of that checkpoint."""
    run = out / f"{lever}-s{seed}"
    summary = load(out, lever, seed, "summary.json") or {}
    offset = int(summary.get("step_offset") or 0)
    points = {}
    if offset and lever in WARM_START:  # the steps before: the start's own curve
        points.update({k: v for k, v in curve_points(out, WARM_START[lever], seed).items() if k <= offset})
    for step, d in checkpoints(run):
        p = d / "offline.json"
        if p.exists():
            points[offset + step] = json.loads(p.read_text())["simulated_acceptance_length"]
    return points


def curves(out: Path, levers: list[str], seeds: list[int]) -> str:
    """Learning curves: one row per checkpoint step, the mean offline AL over the seeds that have it (their count
    in brackets when fewer than all)."""
    per = {lv: [curve_points(out, lv, s) for s in seeds] for lv in levers}
    steps = sorted({k for pts in per.values() for p in pts for k in p})
    if not steps:
        return ""
    used = [lv for lv in levers if any(per[lv])]
    lines = ["| step | " + " | ".join(f"{lv} offline AL" for lv in used) + " |", "|" + "---|" * (len(used) + 1)]
    for k in steps:
        cells = []
        for lv in used:
            vals = [p[k] for p in per[lv] if k in p]
            cells.append("-" if not vals else f"{statistics.fmean(vals):.3f}" + (
                f" ({len(vals)})" if len(vals) < len(seeds) else ""))
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--save-every", type=int, default=None, help="checkpoint every N steps (the learning curves)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--levers", default=",".join(LEVERS))
    ap.add_argument("--baseline", default=None, help="the lever differences are paired against (default: "
                    "speculators when among --levers, else default)")
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--prompts")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--stages", default="train,offline,online", help="any of train,offline,online,vllm")
    ap.add_argument("--temperatures", default="0,1", help="online and vllm: the temperatures judged")
    ap.add_argument("--vllm-python", default=os.environ.get("PEAGLE_VLLM_PYTHON", str(BENCH.parent / ".venv-vllm"
                                                                                         / "bin" / "python")))
    ap.add_argument("--table", action="store_true", help="only print the tables of the saved reports")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    levers = args.levers.split(",")
    unknown = [lv for lv in levers if lv not in LEVERS]
    if unknown:
        ap.error(f"unknown levers {unknown}; known: {', '.join(LEVERS)}")
    baseline = args.baseline or (SPECULATORS if SPECULATORS in levers else "default")
    if baseline not in levers:
        ap.error(f"--baseline {baseline} is not among --levers {args.levers}")
    stages = set(args.stages.split(",")) if not args.table else set()
    bad = stages - {"train", "offline", "online", "vllm"}
    if bad:
        ap.error(f"unknown stages {sorted(bad)}")
    if {"online", "vllm"} & stages and not args.prompts:
        ap.error("the online and vllm stages need --prompts")
    if "vllm" in stages and not Path(args.vllm_python).is_file():
        ap.error(f"the vllm stage runs {args.vllm_python}, which is missing: give --vllm-python (or "
                 "PEAGLE_VLLM_PYTHON), the Python of the vLLM environment (PEAGLE_VLLM=1 bash scripts/setup_env.sh)")
    for lv in levers:
        if lv in WARM_START and "train" in stages and levers.index(WARM_START[lv]) > levers.index(lv):
            ap.error(f"{lv} starts from {WARM_START[lv]}'s checkpoint: list {WARM_START[lv]} before it")
    args.out.mkdir(parents=True, exist_ok=True)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    torch.set_num_threads(1)
    for seed in seeds:  # seed-major: a partial run still pairs every lever with the baseline
        for lever in levers:
            run = args.out / f"{lever}-s{seed}"
            if "train" in stages:
                train(args.store, args.out, lever, seed, args.steps, args.save_every)
            if "offline" in stages:
                offline(args.store, run)
            if "online" in stages:
                contexts = greedy_contexts(args.verifier, final_checkpoint(run), args.prompts, args.num_prompts,
                                           args.max_new_tokens, args.out)
                for temperature in temperatures:
                    online(args.verifier, run, contexts, args.max_new_tokens, temperature)
            print(f"done {run.name}", file=sys.stderr)
    if "vllm" in stages:  # after every run is trained: one judge process per temperature
        runs = [args.out / f"{lv}-s{s}" for s in seeds for lv in levers]
        for temperature in temperatures:
            judge_vllm(runs, temperature, args.prompts, args.num_prompts, args.max_new_tokens, args.verifier,
                       args.vllm_python)
    text = table(args.out, levers, seeds, baseline)
    (args.out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
