"""Each training lever of issue 36 against peagle's defaults and speculators' trainer: the same store, steps and
seeds, judged by replay (stage ``replay``: the replayed AL of ``peagle-eval --store`` on a judge set of the
verifier's own answers at T = 0 and T = 1, ``scripts/judge_set.py``; seconds per drafter), offline (the all-anchor
mean, a diagnostic, and per-depth accuracy on each seed's held-out blocks at every saved checkpoint: the learning
curves), online by peagle's own speculative decoder (stage ``online``) and by vLLM (stage ``vllm``,
:mod:`vllm_judge` in the vLLM environment: to confirm the replay's winner on a subset) at T = 0 and T = 1 under
vLLM's default draft scheme (``greedy``).

Statistics: every report gives one figure per training seed (its AL over all its turns or conversations); the
table shows mean ± standard error over seeds and each lever's differences against the baseline paired by seed,
with the paired t-test over seeds (df = seeds - 1, two-sided p; ``*`` at p < 0.05). Prompt turns are never pooled
across seeds as if independent: the training seed is the unit of replication.

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
  (``--down-sample-ratio-min 0.5``: every depth past 0 keeps half its anchors, 2.5x depth 3's elements);
- ``two_layers``: a second drafter decoder layer (``--num-layers 2``) at equal data and steps.

Online (peagle's engine), every drafter decodes the same contexts: turn 2 of a question follows the verifier's
greedy answer to turn 1 (computed once), at both temperatures, so drafters differ only in their drafts; at T = 1
turn i samples from the generator seeded (seed, i) for every drafter. A turn's acceptance length is its tokens
per verifier step. vLLM: every drafter's turns are the same requests (later turns after vLLM's own reference
answers, greedy at T = 0, seeded samples at T = 1), each request seeded as ``peagle-eval --engine vllm`` seeds it;
a turn's AL is ``1 + accepted / drafts`` from vLLM's per-request counts. At T > 0 on a vLLM CPU build whose
rejection sampler is broken (vLLM issue #55005) the judge applies PR #55006's fix in its own process and says so
in every report (``cpu_expand_fix``).

Usage (repository root, the main venv; the vLLM stage runs ``PEAGLE_VLLM_PYTHON``, default ``.venv-vllm``):
    python scripts/judge_set.py --verifier smollm2-135m --out judge --max-new-tokens 256   # once per verifier
    nice -n 19 python bench/bench_losses.py --store features.zarr --out runs --steps 200 --save-every 50 \
        --seeds 0,1 --levers speculators,default,lk_hybrid_warm,rmin_0.5 --stages train,offline,replay --judge judge
    nice -n 19 python bench/bench_losses.py --out runs --seeds 0,1 --levers speculators,WINNER --stages vllm \
        --prompts ../shared/data/mt_bench_question.jsonl --num-prompts 10 --max-new-tokens 128
    python bench/bench_losses.py --out runs --table   # the tables from the saved reports of every run in OUT

Every run writes into the one ``--out`` (``OUT/LEVER-sSEED/``; seeds may run as separate processes into it), and
every stage skips what is done (a run's ``summary.json``, each report file), so the same command resumes run by run
after a stop; ``--table`` alone reads the levers and seeds it finds in OUT.

Writes ``OUT/LEVER-sSEED/`` (the ``peagle-train`` output, or speculators' checkpoints), ``.../offline.json`` (the
last checkpoint's) and ``.../checkpoint-N/offline.json``, ``.../replay-T{0,1}.json``, ``.../online-T{0,1}.json``,
``.../vllm-T{0,1}.json``; prints the table (mean ± standard error over seeds, differences paired by seed against
``--baseline``: speculators when it is among the levers, else the default) and the learning curves, and writes
them to ``OUT/table.md``.
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
import judge_replay  # noqa: E402

from peagle_train.data.loader import BlockLoader  # noqa: E402
from peagle_train.generate.inference import PEAGLEInference, load_for_decoding  # noqa: E402
from peagle_train.evaluate.offline import judge_problems, run_offline_eval  # noqa: E402
from peagle_train.evaluate.prompts import answer_text, read_prompts, render_turn  # noqa: E402
from peagle_train.evaluate.replay import bootstrap_al  # noqa: E402
from peagle_train.model.checkpoint import load_drafter  # noqa: E402
from peagle_train.train.config import TrainConfig  # noqa: E402
from peagle_train.train.run import build_trainer, run_train  # noqa: E402
from runtime.model_cache import load_tokenizer  # noqa: E402

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
    "two_layers": {"num_layers": 2},
    "dflash": {"method": "dflash", "block_size": 5},
}
"""Lever name -> the ``peagle-train`` settings it changes (``speculators``: its own trainer, same settings;
``dflash``: a DFlash drafter of blocks of 5, drafting the same 4 tokens a step as the P-EAGLE runs' 4 depths)."""

WARM_START: dict[str, str] = {"lk_hybrid_warm": "default"}
"""Lever -> the lever whose checkpoint at half the steps it starts from (then trains the other half)."""

BASE = dict(num_depths=4, draft_vocab_size=4096, lr=1e-3, val_fraction=0.1, val_max_blocks=4, loss_chunk_size=2048)
"""What every run shares besides store, output, steps and seed (the demo's settings)."""


def code_commit() -> dict:
    """``{"commit", "dirty"}`` of the checkout the bench runs from (``git``; None outside a git checkout)."""
    def git(*argv: str) -> str | None:
        r = subprocess.run(["git", *argv], cwd=BENCH, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def mean_se(xs: list[float]) -> tuple[float, float]:
    """Mean and standard error (sample sd / sqrt(n); 0 for one value)."""
    m = statistics.fmean(xs)
    return m, (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else 0.0)


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz; Numerical Recipes
    §6.4, ``betacf``)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def t_two_sided_p(t: float, df: int) -> float:
    """Two-sided p-value of Student's t with ``df`` degrees of freedom: ``I_{df/(df+t^2)}(df/2, 1/2)``."""
    if math.isinf(t):
        return 0.0
    if t == 0.0:
        return 1.0
    x, a, b = df / (df + t * t), df / 2.0, 0.5
    if x <= 0.0:
        return 0.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def paired_seed_test(diffs: list[float]) -> dict[str, float | int | None]:
    """The paired t-test over seeds of per-seed differences ``lever - baseline`` (one per seed: the training seed
    is the unit of replication, never a prompt turn): ``mean``, ``se`` (sd / sqrt(n)), ``t``, ``df`` (n - 1) and
    the two-sided ``p``; ``t``/``p`` None below 2 seeds (no test), ``t`` infinite and ``p`` 0 when every seed
    differs by the same nonzero amount."""
    n = len(diffs)
    m, se = mean_se(diffs)
    if n < 2:
        return {"mean": m, "se": None, "t": None, "df": 0, "p": None, "n": n}
    if se == 0.0:
        t = 0.0 if m == 0.0 else math.copysign(math.inf, m)
    else:
        t = m / se
    return {"mean": m, "se": se, "t": t, "df": n - 1, "p": t_two_sided_p(t, n - 1), "n": n}


def fmt(xs: list[float], digits: int = 3) -> str:
    """``mean ± SE`` over seeds; one seed has no SE over seeds: its value alone."""
    m, se = mean_se(xs)
    return f"{m:.{digits}f} ± {se:.{digits}f}" if len(xs) > 1 else f"{m:.{digits}f}"


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
            rep = run_offline_eval(drafter, store, blocks=blocks, all_anchor=True)  # held-out training blocks
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


METRICS: list[tuple[str, str]] = [
    ("replay AL T=0", "replay-T0.json"),
    ("replay AL T=1", "replay-T1.json"),
    ("offline all-anchor AL (T=0, diagnostic)", "offline.json"),
    ("peagle engine AL T=0", "online-T0.json"),
    ("peagle engine AL T=1", "online-T1.json"),
    ("vLLM AL T=0", "vllm-T0.json"),
    ("vLLM AL T=1", "vllm-T1.json"),
]
"""Column name and report file; each report gives one figure per seed (:func:`_value`)."""


def judge_stores(judge: Path) -> dict[str, list[Path]]:
    """The finished stores of a ``scripts/judge_set.py`` output by temperature: ``{"0": [SUITE-T0.zarr, ...],
    "1": [SUITE-T1-seedS.zarr, ...]}`` (a store counts once its ``SUITE-RUN.done.json`` is written)."""
    done = sorted(p.with_name(p.name[:-len(".done.json")] + ".zarr") for p in judge.glob("*.done.json"))
    return {t: [p for p in done if f"-T{t}" in p.name] for t in ("0", "1")}


def suite_figures(per: dict[str, dict]) -> dict[str, dict]:
    """Per suite (a judge store's name before ``-T``): the replayed AL over its stores' turns (``1 + Σ accepted /
    Σ num_drafts``), with its bootstrap SE over prompts where the reports carry their conversations (a prompt's
    T = 1 samples, one per store, resampled together: :func:`judge_replay.pooled`), else ``se`` None."""
    suites: dict[str, list[tuple[str, dict]]] = {}
    for name, rep in per.items():
        suites.setdefault(name.split("-T", 1)[0], []).append((name, rep))
    out = {}
    for suite, reps in sorted(suites.items()):
        accepted = sum(int(r.get("accepted", 0)) for _, r in reps)
        drafts = sum(int(r.get("num_drafts", 0)) for _, r in reps)
        fig = {"acceptance_length": 1.0 + (accepted / drafts if drafts else 0.0), "accepted": accepted,
               "num_drafts": drafts, "stores": len(reps), "se": None}
        if all("per_conversation" in r for _, r in reps):
            p = judge_replay.pooled(reps)
            fig["se"] = bootstrap_al(p["accepted"], p["num_drafts"], clusters=p["prompts"])[1]
            fig["conversations"], fig["prompts"] = int(p["keys"].size), int(len(set(p["prompts"].tolist())))
        out[suite] = fig
    return out


def replay(run: Path, judge: Path, allow_contaminated: bool = False, allow_refused_turns: bool = False) -> None:
    """The replayed AL of ``run``'s last drafter on every judge store (``peagle-eval --store``'s ``replay``), per
    temperature pooled over the suites and samples, and per suite (:func:`suite_figures`):
    ``run/replay-T{0,1}.json`` with each store's report under ``per_store``; each store walked with the
    ``max_new_tokens`` it was generated with (its ``.done.json``).

    ``allow_refused_turns``: judge on the turns the replay walks where a store holds turns it cannot walk as
    decoding would produce them (``walk_turn``'s rules read only the store's tokens, the turn's bounds, its
    ``max_new_tokens`` and the EOS ids, so every drafter is judged on the same turns of a store); each store's
    ``refused_turns`` stay in the report.

    Raises:
        SystemExit: a store that cannot stand as a judge figure (``judge_problems``: turns not walked unless
        ``allow_refused_turns``, or conversations the drafter was trained on unless ``allow_contaminated``);
        StoreMismatchError: an incomplete store."""
    for t, stores in judge_stores(judge).items():
        path = run / f"replay-T{t}.json"
        if path.exists() or not stores:
            continue
        per = {}
        for store in stores:
            made = json.loads(store.with_name(store.name[:-len(".zarr")] + ".done.json").read_text())
            rep = run_offline_eval(final_checkpoint(run), store, max_new_tokens=int(made["max_new_tokens"]))
            problems = judge_problems(rep, allow_contaminated, allow_refused_turns)  # incomplete: refused before
            if problems:
                raise SystemExit(f"replay: {store} judging {final_checkpoint(run)}: {'; '.join(problems)} "
                                 "(--allow-refused-turns judges the turns walked, the same for every drafter; "
                                 "--allow-contaminated judges trained-on conversations anyway)")
            per[store.name] = {**rep["replay"], "all_anchor_acceptance_length": rep.get("simulated_acceptance_length")}
        accepted = sum(r.get("accepted", 0) for r in per.values())
        drafts = sum(r.get("num_drafts", 0) for r in per.values())
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"temperature": float(t), "acceptance_length": 1.0 + (accepted / drafts if drafts
                                   else 0.0), "accepted": accepted, "num_drafts": drafts,
                                   "per_suite": suite_figures(per), "per_store": per}, indent=1))
        tmp.replace(path)


RESULT_REPORTS = ("summary.json", "offline.json", "replay-T0.json", "replay-T1.json")
"""The reports a run needs before its results file is written (a run without all of them has no result)."""

KEPT_SUMMARY = ("train_wall_s", "steps", "step_offset", "trainer")
"""The keys of a run's ``summary.json`` its results file keeps (the rest is the trainer's log)."""


def result_of(out: Path, lever: str, seed: int, provenance: dict) -> dict | None:
    """A run's results-file content: its figures (``summary``, ``offline``, ``replay-T{0,1}`` with per-suite and
    per-conversation counts, not ``by_context_length``), its learning curve and ``provenance`` (inputs' hashes,
    commit); None while any of :data:`RESULT_REPORTS` is missing."""
    reports = {name: load(out, lever, seed, name) for name in RESULT_REPORTS}
    if any(r is None for r in reports.values()):
        return None
    reports["summary.json"] = {k: v for k, v in reports["summary.json"].items() if k in KEPT_SUMMARY}
    reports["offline.json"] = {k: reports["offline.json"].get(k) for k in ("simulated_acceptance_length",
                                                                          "per_depth_accuracy", "block_ids")}
    for t in ("0", "1"):
        rep = reports[f"replay-T{t}.json"]
        rep["per_store"] = {name: {k: r.get(k) for k in ("acceptance_length", "accepted", "num_drafts", "se",
                                                          "turns", "conversations", "refused_turns",
                                                          "max_new_tokens", "per_conversation")}
                            for name, r in rep["per_store"].items()}
    return {"lever": lever, "seed": seed, **provenance, "reports": reports,
            "curve": {str(k): v for k, v in sorted(curve_points(out, lever, seed).items())}}


def export_result(out: Path, lever: str, seed: int, results: Path, provenance: dict) -> Path | None:
    """Write ``results/LEVER-sSEED.json`` (:func:`result_of`) atomically once the run is complete; an existing
    results file is kept (a finished run's figures never change). Returns the path, or None (not complete)."""
    path = results / f"{lever}-s{seed}.json"
    if path.exists():
        return path
    result = result_of(out, lever, seed, provenance)
    if result is None:
        return None
    results.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(path)
    return path


def _value(report: dict) -> float:
    """A report's one figure: its AL over all its turns (``acceptance_length``), or offline the all-anchor mean."""
    return report.get("simulated_acceptance_length", report.get("acceptance_length"))


def paired(out: Path, lever: str, base: str, seeds: list[int], name: str) -> list[float]:
    """Per-seed differences ``lever - base`` of the seed's figure in report ``name`` (each seed's own mean over its
    prompt turns or conversations: the training seed is the unit of replication), for the seeds both have."""
    diffs = []
    for s in seeds:
        a, b = load(out, lever, s, name), load(out, base, s, name)
        if a is not None and b is not None:
            diffs.append(_value(a) - _value(b))
    return diffs


def load(out: Path, lever: str, seed: int, name: str) -> dict | None:
    """Report ``name`` of run ``LEVER-sSEED``: from its results file ``OUT/LEVER-sSEED.json`` (:func:`export_result`)
    if there is one, else from the run directory ``OUT/LEVER-sSEED/NAME``; ``NAME#SUITE`` is that report's figure
    for one suite (``per_suite``). None where absent."""
    name, _, suite = name.partition("#")
    result = out / f"{lever}-s{seed}.json"
    if result.is_file():
        rep = json.loads(result.read_text())["reports"].get(name)
    else:
        p = out / f"{lever}-s{seed}" / name
        rep = json.loads(p.read_text()) if p.exists() else None
    if rep is not None and suite:
        return rep.get("per_suite", {}).get(suite)
    return rep


def delta_cell(diffs: list[float], base_mean: float | None) -> str:
    """``Δ ± SE (+x.x%, n=N seeds, t(df)=T, p=P)`` of per-seed differences (:func:`paired_seed_test`), with ``*``
    when the paired t over seeds gives p < 0.05 (two-sided); one seed: no SE, no test."""
    if not diffs:
        return ""
    r = paired_seed_test(diffs)
    pct = f"{100 * r['mean'] / base_mean:+.1f}%, " if base_mean else ""
    if r["se"] is None:
        return f"{r['mean']:+.3f} ({pct}n=1 seed, no test)"
    star = " *" if r["p"] < 0.05 else ""
    return f"{r['mean']:+.3f} ± {r['se']:.3f} ({pct}n={r['n']} seeds, t({r['df']})={r['t']:.2f}, p={r['p']:.3f}){star}"


def metrics(out: Path, levers: list[str], seeds: list[int]) -> list[tuple[str, str]]:
    """:data:`METRICS` with, after the pooled replay columns, one per judge suite and temperature
    (``replay-T{t}.json#SUITE``) for the suites the reports hold."""
    suites = sorted({suite for lv in levers for s in seeds for t in ("0", "1")
                     for suite in (load(out, lv, s, f"replay-T{t}.json") or {}).get("per_suite", {})})
    per_suite = [(f"replay AL {suite} T={t}", f"replay-T{t}.json#{suite}") for suite in suites for t in ("0", "1")]
    return METRICS[:2] + per_suite + METRICS[2:]


def per_seed_table(out: Path, levers: list[str], seeds: list[int]) -> str:
    """Markdown: every run's replayed AL per suite and temperature (± its bootstrap SE over prompts), one row per
    lever and seed: the figures the means and paired differences of :func:`table` are made of."""
    cols = [(c, n) for c, n in metrics(out, levers, seeds) if "#" in n]
    if not cols:
        return ""
    lines = ["| lever | seed | " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * (len(cols) + 2)]
    for lever in levers:
        for s in seeds:
            cells = []
            for _, name in cols:
                r = load(out, lever, s, name)
                cells.append("-" if r is None else f"{r['acceptance_length']:.3f}" + (
                    f" ± {r['se']:.3f}" if r.get("se") is not None else ""))
            if any(c != "-" for c in cells):
                lines.append(f"| {lever} | {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(out: Path, levers: list[str], seeds: list[int], baseline: str) -> str:
    """The markdown table of every lever with reports (mean ± SE over seeds of each seed's figure; Δ paired against
    ``baseline`` by seed, with the paired t over seeds: :func:`delta_cell`), the per-depth accuracy, the wall times, then the learning
    curves (offline AL of every checkpoint, mean over the seeds, by the step counted from the run's start)."""
    shown = [(col, name) for col, name in metrics(out, levers, seeds)
             if any(load(out, lv, s, name) for lv in levers for s in seeds)]
    head = ["lever", "seeds", *[c for c, _ in shown], "offline per-depth accuracy (T=0)",
            *[f"Δ {c} vs {baseline}" for c, _ in shown], "train wall s", "vLLM judge wall s (T=0 / T=1)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lever in levers:
        got = [s for s in seeds if load(out, lever, s, "summary.json")]
        if not got:
            continue
        cells = [lever, str(len(got))]
        for _, name in shown:
            vals = [_value(r) for r in (load(out, lever, s, name) for s in got) if r]
            cells.append((fmt(vals) + (f" ({len(vals)} seed{'s' if len(vals) > 1 else ''})" if len(vals) < len(got)
                                       else "")) if vals else "-")
        offs = [r for r in (load(out, lever, s, "offline.json") for s in got) if r]
        K = len(offs[0]["per_depth_accuracy"]) if offs else 0
        cells.append(" / ".join(f"{statistics.fmean(r['per_depth_accuracy'][d] or 0.0 for r in offs):.3f}"
                                for d in range(K)) or "-")
        for _, name in shown:
            base_vals = [_value(r) for r in (load(out, baseline, s, name) for s in got) if r]
            cells.append("" if lever == baseline else delta_cell(
                paired(out, lever, baseline, got, name), statistics.fmean(base_vals) if base_vals else None))
        walls = [load(out, lever, s, "summary.json").get("train_wall_s") for s in got]
        cells.append(f"{statistics.fmean(walls):.0f}" if all(w is not None for w in walls) else "-")
        judge = []
        for t in ("0", "1"):
            w = [r.get("judge_wall_s") for r in (load(out, lever, s, f"vllm-T{t}.json") for s in got) if r]
            judge.append(f"{statistics.fmean(w):.0f}" if w and all(x is not None for x in w) else "-")
        cells.append(" / ".join(judge))
        lines.append("| " + " | ".join(cells) + " |")
    seed_rows = per_seed_table(out, levers, seeds)
    return "\n".join(lines) + "\n\n" + (seed_rows + "\n\n" if seed_rows else "") + curves(out, levers, seeds)


def curve_points(out: Path, lever: str, seed: int) -> dict[int, float]:
    """Step (from the run's start; a warm start's own steps plus its start's) -> offline AL of that checkpoint."""
    run = out / f"{lever}-s{seed}"
    if (out / f"{lever}-s{seed}.json").is_file():
        return {int(k): v for k, v in json.loads((out / f"{lever}-s{seed}.json").read_text())["curve"].items()}
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


def found_runs(out: Path) -> tuple[list[str], list[int]]:
    """The levers (in :data:`LEVERS` order) and seeds that have a run directory ``OUT/LEVER-sSEED`` or a results
    file ``OUT/LEVER-sSEED.json``."""
    pairs = [d.name.removesuffix(".json").rsplit("-s", 1) for d in out.glob("*-s*")
             if d.is_dir() or d.name.endswith(".json")]
    pairs = [(lv, int(s)) for lv, s in pairs if lv in LEVERS and s.isdigit()]
    return [lv for lv in LEVERS if any(p[0] == lv for p in pairs)], sorted({s for _, s in pairs})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--save-every", type=int, default=None, help="checkpoint every N steps (the learning curves)")
    ap.add_argument("--seeds", default=None, help="default 0,1,2; with --table those found in OUT")
    ap.add_argument("--levers", default=None, help="default all; with --table those found in OUT")
    ap.add_argument("--judge", type=Path, default=None, help="the replay stage: a scripts/judge_set.py output")
    ap.add_argument("--allow-contaminated", action="store_true",
                    help="the replay stage: judge on conversations the drafter was trained on")
    ap.add_argument("--allow-refused-turns", action="store_true",
                    help="the replay stage: judge on the turns walked where a store holds turns no decoding produces "
                    "as stored (the same turns for every drafter; each store's refused_turns are reported)")
    ap.add_argument("--baseline", default=None, help="the lever differences are paired against (default: "
                    "speculators when among --levers, else default, else the first lever)")
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--prompts")
    ap.add_argument("--num-prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--stages", default="train,offline,online", help="any of train,offline,replay,online,vllm")
    ap.add_argument("--temperatures", default="0,1", help="online and vllm: the temperatures judged")
    ap.add_argument("--vllm-python", default=os.environ.get("PEAGLE_VLLM_PYTHON", str(BENCH.parent / ".venv-vllm"
                                                                                         / "bin" / "python")))
    ap.add_argument("--table", action="store_true", help="only print the tables of the saved reports (OUT: a run "
                    "directory or a --results directory)")
    ap.add_argument("--results", type=Path, default=None, help="write each complete run's figures to "
                    "RESULTS/LEVER-sSEED.json (export_result), from which --table --out RESULTS rebuilds the table")
    ap.add_argument("--provenance", type=Path, default=None, help="a JSON object stored in every results file (the "
                    "inputs' hashes: bench/quality_slices.py writes it)")
    args = ap.parse_args()
    found_levers, found_seeds = found_runs(args.out) if args.table else ([], [])
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else (found_seeds or [0, 1, 2])
    levers = args.levers.split(",") if args.levers else (found_levers or list(LEVERS))
    unknown = [lv for lv in levers if lv not in LEVERS]
    if unknown:
        ap.error(f"unknown levers {unknown}; known: {', '.join(LEVERS)}")
    baseline = args.baseline or next((b for b in (SPECULATORS, "default") if b in levers), levers[0])
    if baseline not in levers:
        ap.error(f"--baseline {baseline} is not among --levers {args.levers}")
    stages = set(args.stages.split(",")) if not args.table else set()
    bad = stages - {"train", "offline", "replay", "online", "vllm"}
    if bad:
        ap.error(f"unknown stages {sorted(bad)}")
    if "replay" in stages and (args.judge is None or not any(judge_stores(args.judge).values())):
        ap.error("the replay stage needs --judge DIR with finished judge stores (scripts/judge_set.py)")
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
    provenance = {"steps": args.steps, "commit": code_commit(),
                  "inputs": json.loads(args.provenance.read_text()) if args.provenance else None}
    torch.set_num_threads(1)
    for seed in seeds:  # seed-major: a partial run still pairs every lever with the baseline
        for lever in levers:
            run = args.out / f"{lever}-s{seed}"
            if "train" in stages:
                train(args.store, args.out, lever, seed, args.steps, args.save_every)
            if "offline" in stages:
                offline(args.store, run)
            if "replay" in stages:
                replay(run, args.judge, args.allow_contaminated, args.allow_refused_turns)
            if "online" in stages:
                contexts = greedy_contexts(args.verifier, final_checkpoint(run), args.prompts, args.num_prompts,
                                           args.max_new_tokens, args.out)
                for temperature in temperatures:
                    online(args.verifier, run, contexts, args.max_new_tokens, temperature)
            if args.results and export_result(args.out, lever, seed, args.results, provenance):
                print(f"results: {args.results / f'{lever}-s{seed}.json'}", file=sys.stderr)
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
