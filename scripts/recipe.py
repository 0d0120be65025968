"""The recipe for one's own verifier: one command from conversations to an evaluated drafter.

    bash scripts/recipe.sh --verifier MODEL --data convs.jsonl --eval-prompts prompts.jsonl --out runs/x \\
        [--regenerate] [--steps N] ...

(``scripts/recipe.sh`` sets up ``.venv`` and runs this file with it; ``python scripts/recipe.py ...`` in an
environment with peagle installed does the same without the set-up)

runs, with the peagle commands (it calls them; ``--help`` of each says what they do):

  1. ``peagle-data regenerate``  (``--regenerate`` only) the verifier's own answers, in this process
  2. ``peagle-data pack``        the conversations (regenerated or as given) into packed blocks
  3. ``peagle-data extract``     the verifier's hidden states into ``OUT/features.zarr``
  4. ``peagle-train``            the P-EAGLE drafter, ``OUT/drafter/final``
  5. ``peagle-eval``             offline on the training run's held-out blocks of the store, and online
                                 (peagle's speculative decoder, checked token for token against greedy)
                                 on the evaluation prompts
  6. ``peagle-eval --engine vllm``  the same prompts through vLLM, when a vLLM environment is found
                                 (``--vllm-python``, default ``.venv-vllm/bin/python`` of this checkout,
                                 else this interpreter when it imports vllm); vLLM 0.32-0.33 only: a newer
                                 one no longer serves P-EAGLE and is refused before any stage runs

and prints one JSON report on stdout (acceptance lengths offline / online / vLLM, speedups, tokens/s,
identity with greedy decoding, stage seconds, every artifact's path; also written to
``OUT/report.json``) and a readable summary on stderr. Each stage's own JSON goes to ``OUT/<stage>.json``,
its progress to stderr.

Inputs and sizes are checked before anything runs (exit status 2, naming the option): files that do
not exist, sizes that are not positive, a verifier that is not a model directory or known name, an
evaluation prompt file that ``peagle-eval`` would refuse.

Re-running: ``OUT/recipe_state.json`` records the settings and the stages done. The same command again
skips the stages done and continues the interrupted one (``regenerate --resume``, ``extract --resume``,
``peagle-train --resume`` from its newest checkpoint; pack and evaluation start over); a re-run with
other settings, or changed input files (size or modification time), is refused naming them: pass
``--force`` to start over in OUT (every stage runs again with ``--force``), or use another ``--out``.
So after a failed stage: fix the cause and run the same command again; if the fix changed an input file
or a setting, add ``--force``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout: the peagle packages beside this script

from peagle_train.evaluate.prompts import read_prompts  # noqa: E402 (after the path above
from runtime.model_cache import load_tokenizer, resolve_model  # noqa: E402
from runtime.vllm_runtime import peagle_vllm_refusal  # noqa: E402

STATE = "recipe_state.json"
STAGES = ("regenerate", "pack", "extract", "train", "eval", "eval_vllm")
NOT_COMPARED = ("device", "vllm_python", "no_vllm", "force")
"""Options that may change on a re-run: where things run, not what they compute."""


PROG = os.environ.get("PEAGLE_RECIPE_PROG") or "recipe.py"
"""The command the user ran, in usage and messages: ``scripts/recipe.sh`` sets it to itself as invoked."""


class RecipeError(Exception):
    """A bad input or setting, found before any stage runs (exit status 2)."""


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive integer")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0 (such as 1e-3)."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number such as 1e-3")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train and evaluate a P-EAGLE drafter for your own verifier in one command: "
                    "[regenerate] -> pack -> extract -> train -> evaluate (peagle, and vLLM when present).",
        epilog="Unset sizes take the peagle command's default (see its --help). A re-run of the same command "
               "resumes (the stages done are skipped); --force starts over. JSON report on stdout and in "
               "OUT/report.json, summary on stderr.")
    p.add_argument("--verifier", required=True, metavar="MODEL",
                   help="the verifier: a local model directory, a Hugging Face id, or smollm2-135m")
    p.add_argument("--data", required=True, metavar="FILE",
                   help="conversations (.jsonl/.json/.parquet of OpenAI messages or ShareGPT rows) or 'sharegpt'; "
                        "with --regenerate, prompts whose assistant turns the verifier answers")
    p.add_argument("--eval-prompts", required=True, metavar="FILE",
                   help="evaluation prompts JSONL (MT-Bench turns or OpenAI messages), never trained on")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory of every artifact")
    p.add_argument("--regenerate", action="store_true",
                   help="first replace the assistant turns with the verifier's own greedy answers (in this process)")
    p.add_argument("--regen-turns", choices=("all", "last", "first"), help="regenerate --turns")
    p.add_argument("--regen-max-new-tokens", type=positive_int, metavar="N", help="regenerate --max-new-tokens")
    p.add_argument("--regen-batch-size", type=positive_int, metavar="N", help="regenerate --batch-size")
    p.add_argument("--limit", type=positive_int, metavar="N", help="conversations read from --data; unset: all")
    p.add_argument("--max-seq-len", type=positive_int, metavar="N", help="pack --max-seq-len (tokens a window)")
    p.add_argument("--max-windows", type=positive_int, metavar="N", help="pack --max-windows per conversation")
    p.add_argument("--steps", type=positive_int, metavar="N", help="peagle-train --max-steps")
    p.add_argument("--lr", type=positive_float, metavar="X", help="peagle-train --lr")
    p.add_argument("--num-depths", type=positive_int, metavar="K", help="peagle-train --num-depths")
    p.add_argument("--draft-vocab-size", type=positive_int, metavar="N", help="peagle-train --draft-vocab-size")
    p.add_argument("--num-prompts", type=positive_int, metavar="N",
                   help="evaluation prompts used, from the top; unset: all")
    p.add_argument("--max-new-tokens", type=positive_int, metavar="N", help="peagle-eval --max-new-tokens")
    p.add_argument("--no-measure-costs", action="store_true",
                   help="peagle-eval --no-measure-costs: skip timing the drafter and verifier steps (the expected "
                        "speedup per K); at tiny sizes that timing is most of the evaluation and its figures noise")
    p.add_argument("--device", metavar="DEVICE", help="regenerate/extract --device (cpu, cuda, cuda:1)")
    p.add_argument("--vllm-python", metavar="PYTHON",
                   help="python of a vLLM environment with peagle installed for the vLLM evaluation; unset: "
                        ".venv-vllm/bin/python of this checkout, else this python if it imports vllm")
    p.add_argument("--no-vllm", action="store_true", help="skip the vLLM evaluation")
    p.add_argument("--force", action="store_true", help="start over in OUT (every stage with --force)")
    return p


def file_identity(path: str) -> dict | str:
    """What a re-run compares of an input file: its absolute path, size and modification time."""
    if path == "sharegpt":
        return path
    st = os.stat(path)
    return {"path": str(Path(path).resolve()), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def check_inputs(args: argparse.Namespace) -> dict:
    """Every check that needs no stage: returns the settings a re-run compares. Raises RecipeError."""
    from transformers import AutoConfig  # heavy: imported when the checks run, not for --help

    if args.data != "sharegpt" and not Path(args.data).is_file():
        raise RecipeError(f"--data {args.data}: no such file")
    if not Path(args.eval_prompts).is_file():
        raise RecipeError(f"--eval-prompts {args.eval_prompts}: no such file")
    try:
        read_prompts(args.eval_prompts, args.num_prompts)
    except Exception as e:  # the reason peagle-eval would give, hours later
        raise RecipeError(f"--eval-prompts {args.eval_prompts}: {e}") from None
    try:  # the files every stage reads first: a model directory (or name) with a config and a chat template
        AutoConfig.from_pretrained(resolve_model(args.verifier, need_weights=False))
        template = load_tokenizer(args.verifier).chat_template
    except Exception as e:
        raise RecipeError(f"--verifier {args.verifier}: {' '.join(str(e).split())}") from None
    if not template:
        raise RecipeError(f"--verifier {args.verifier}: its tokenizer has no chat template; pack renders "
                          "conversations with the verifier's template (pack --chat-template FILE is not "
                          "passed by this recipe)")
    regen_opts = [o for o in ("regen_turns", "regen_max_new_tokens", "regen_batch_size") if getattr(args, o)]
    if regen_opts and not args.regenerate:
        raise RecipeError(f"--{regen_opts[0].replace('_', '-')} needs --regenerate")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise RecipeError(f"--out {out}: exists and is not a directory")
    above = next((p for p in out.absolute().parents if p.exists()), None)
    if above is not None and not above.is_dir():
        raise RecipeError(f"--out {out}: {above} is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / STATE).is_file() and not args.force:
        raise RecipeError(f"--out {out}: a non-empty directory that no recipe run made (no {STATE}); "
                          "choose another --out, or pass --force to write the recipe's outputs into it")
    if args.vllm_python and not args.no_vllm and not shutil.which(args.vllm_python):
        raise RecipeError(f"--vllm-python {args.vllm_python}: no such executable")
    verifier = args.verifier if not Path(args.verifier).expanduser().is_dir() \
        else str(Path(args.verifier).expanduser().resolve())
    settings = {k: v for k, v in vars(args).items() if k not in NOT_COMPARED}
    return {**settings, "verifier": verifier, "data": file_identity(args.data),
            "eval_prompts": file_identity(args.eval_prompts), "out": str(out.resolve())}


def load_state(out: Path, settings: dict, force: bool) -> dict:
    """The stages already done in ``out`` by a run of the same ``settings`` (RecipeError if they differ)."""
    path = out / STATE
    if force or not path.is_file():
        return {"settings": settings, "done": {}}
    state = json.loads(path.read_text())
    old = state.get("settings", {})
    diff = [k for k in sorted(set(old) | set(settings)) if old.get(k) != settings.get(k)]
    if diff:
        what = "; ".join(f"{k}: {json.dumps(old.get(k))} there, {json.dumps(settings.get(k))} now" for k in diff)
        raise RecipeError(f"--out {out} holds a run of other settings or inputs ({what}); re-run with the same "
                          "ones to resume, pass --force to start over there, or choose another --out")
    return state


def vllm_python(args: argparse.Namespace) -> tuple[str | None, str]:
    """The python that runs ``peagle-eval --engine vllm``, or None and why not."""
    if args.no_vllm:
        return None, "skipped: --no-vllm"
    if args.vllm_python:
        return shutil.which(args.vllm_python), "ran"
    venv = REPO / ".venv-vllm" / "bin" / "python"
    if venv.is_file():
        return str(venv), "ran"
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable, "ran"
    return None, ("skipped: no vLLM environment (PEAGLE_VLLM=1 bash scripts/setup_env.sh makes .venv-vllm; "
                  "or pass --vllm-python)")


_VERSION_OF = ("import sys; sys.path.insert(0, sys.argv[1]); "
               "from runtime.vllm_runtime import installed_vllm_version as v; print(v() or '')")


def vllm_version_of(python: str) -> str | None:
    """The vLLM version installed for ``python`` (its distribution's record; vLLM is not imported), or None.

    Raises:
        RecipeError: ``python`` cannot tell (it does not run, or peagle's ``stores`` does not import there).
    """
    try:
        done = subprocess.run([python, "-c", _VERSION_OF, str(REPO)], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RecipeError(f"--vllm-python {python}: could not ask it for its vLLM version ({e})") from None
    if done.returncode != 0:
        raise RecipeError(f"--vllm-python {python}: could not ask it for its vLLM version "
                          f"({(done.stderr.strip().splitlines() or ['no output'])[-1]})")
    return done.stdout.strip() or None


def check_vllm_python(python: str | None) -> None:
    """Refuse, before any stage runs, a vLLM environment whose vLLM no longer serves P-EAGLE (from 0.34:
    :func:`runtime.vllm_runtime.peagle_vllm_refusal`); the reason names ``--no-vllm`` too."""
    version = vllm_version_of(python) if python is not None else None
    why = peagle_vllm_refusal(version) if version is not None else None
    if why is not None:
        raise RecipeError(f"the vLLM evaluation ({python}): {why}; or pass --no-vllm to run the recipe without it")


def stage_commands(args: argparse.Namespace, out: Path, resume: dict[str, bool], vllm_py: str | None) -> dict:
    """Each stage's argv (peagle's commands run as ``python -m cli.*``)."""
    py = [sys.executable, "-m"]
    force = ["--force"] if args.force else []

    def opt(flag: str, value) -> list[str]:
        return [] if value is None else [flag, str(value)]

    device = opt("--device", args.device)
    packed_input = str(out / "regenerated.jsonl") if args.regenerate else args.data
    prompts = [*opt("--num-prompts", args.num_prompts), *opt("--max-new-tokens", args.max_new_tokens)]
    eval_args = ["--drafter", str(out / "drafter" / "final"), "--verifier", args.verifier,
                 "--prompts", args.eval_prompts, *prompts, *(["--no-measure-costs"] if args.no_measure_costs else []),
                 "--force"]
    cmds = {
        "regenerate": [*py, "cli.data", "regenerate", args.data, "--verifier", args.verifier,
                       "--output", str(out / "regenerated.jsonl"), *opt("--limit", args.limit),
                       *opt("--turns", args.regen_turns), *opt("--max-new-tokens", args.regen_max_new_tokens),
                       *opt("--batch-size", args.regen_batch_size), *device, *(force or ["--resume"])],
        "pack": [*py, "cli.data", "pack", packed_input, "--tokenizer", args.verifier, "--output", str(out / "packed"),
                 *opt("--limit", None if args.regenerate else args.limit), *opt("--max-seq-len", args.max_seq_len),
                 *opt("--max-windows", args.max_windows), "--force"],
        "extract": [*py, "cli.data", "extract", str(out / "packed"), "--verifier", args.verifier,
                    "--output", str(out / "features.zarr"), *device,
                    *(force or (["--resume"] if resume["extract"] else []))],
        "train": [*py, "cli.train", "--store", str(out / "features.zarr"), "--output", str(out / "drafter"),
                  *opt("--max-steps", args.steps), *opt("--lr", args.lr), *opt("--num-depths", args.num_depths),
                  *opt("--draft-vocab-size", args.draft_vocab_size),
                  *(force or (["--resume"] if resume["train"] else []))],
        "eval": [*py, "cli.eval", *eval_args, "--store", str(out / "features.zarr"), "--all-anchor",
                 "--output", str(out / "eval.json")],
    }
    if vllm_py is not None:
        cmds["eval_vllm"] = [vllm_py, "-m", "cli.eval", *eval_args, "--engine", "vllm",
                             "--output", str(out / "eval_vllm.json")]
    if not args.regenerate:
        del cmds["regenerate"]
    return cmds


def run_stages(cmds: dict, out: Path, state: dict) -> list[str]:
    """Run the stages not done yet, recording each in ``OUT/recipe_state.json``; returns the skipped ones."""
    skipped = []
    # the commands of this checkout, whichever peagle the environment has installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for i, (stage, argv) in enumerate(cmds.items(), 1):
        if stage in state["done"]:
            print(f"== {i}/{len(cmds)} {stage}: done by an earlier run, skipped", file=sys.stderr)
            skipped.append(stage)
            continue
        print(f"== {i}/{len(cmds)} {stage}: {' '.join(argv)}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        # a stage that writes its report as STAGE.json itself (eval, eval_vllm: --output, the JSON it also prints)
        # keeps it: capturing its stdout there would put an empty file, no report of peagle-eval's, in --output's
        # place, which peagle-eval --force refuses to replace
        own = "--output" in argv and argv[argv.index("--output") + 1] == str(out / f"{stage}.json")
        with open(os.devnull if own else out / f"{stage}.json", "w") as stdout:
            try:
                rc = subprocess.call(argv, stdout=stdout, env=env)
            except KeyboardInterrupt:  # the stage said what it kept; the recipe continues from it
                print(f"{PROG}: interrupted in stage {stage}; run the same command again to continue "
                      "from this stage", file=sys.stderr)
                raise SystemExit(130) from None
        if rc != 0:
            raise SystemExit(f"{PROG}: stage {stage} failed (exit status {rc}; its output above). Fix the cause, "
                             "then run the same command again to continue from this stage; if the fix changed "
                             "an input file or a setting, add --force (it starts over: every stage runs again)")
        state["done"][stage] = round(time.monotonic() - t0, 1)
        (out / STATE).write_text(json.dumps(state, indent=1) + "\n")
    return skipped


def report(out: Path, args: argparse.Namespace, state: dict, skipped: list[str], vllm_status: str) -> dict:
    """The run's JSON report from the stages' outputs."""
    ev = json.loads((out / "eval.json").read_text())
    vl = json.loads((out / "eval_vllm.json").read_text()) if "eval_vllm" in state["done"] else None
    if vl is not None:
        vllm_status = "ran"
    offline = ev.get("offline", {})
    return {
        "verifier": args.verifier,
        "out": str(out),
        "acceptance_length": {"offline": offline.get("simulated_acceptance_length"),
                              "online": ev.get("acceptance_length"),
                              "vllm": vl and vl.get("acceptance_length")},
        "speedup": {"online": ev.get("speedup"), "vllm": vl and vl.get("speedup"),
                    "vllm_by_concurrency": vl and {n: t["speedup"] for n, t in vl["throughput"].items()}},
        "tokens_per_second": {"online": {"speculative": ev.get("tokens_per_second"),
                                         "plain": ev.get("baseline_tokens_per_second")},
                              "vllm": vl and {"speculative": vl.get("tokens_per_second"),
                                              "plain": vl.get("baseline_tokens_per_second")}},
        "identical_to_greedy": {"online": ev.get("identical_to_greedy"), "vllm": vl and vl.get("identical_to_greedy")},
        "num_draft_tokens": ev.get("num_draft_tokens"),
        "offline_split": offline.get("split"),
        "vllm": vllm_status,
        "stage_seconds": state["done"],
        "skipped_stages_done_earlier": skipped,
        "artifacts": {name: str(out / rel) for name, rel in [
            *([("regenerated", "regenerated.jsonl")] if args.regenerate else []),
            ("packed", "packed"), ("features", "features.zarr"), ("drafter", "drafter/final"),
            ("training_metrics", "drafter/metrics.jsonl"), ("training_plot", "drafter/training.png"),
            ("eval", "eval.json"), ("eval_plot", "eval.png"),
            *([("eval_vllm", "eval_vllm.json")] if vl is not None else []),
            ("stage_outputs", "<stage>.json"), ("report", "report.json")]},
    }


def summary(r: dict) -> str:
    """The report in a few lines for a person."""
    def f(x, spec=".3f"):
        return "-" if x is None else format(x, spec)

    al, sp, ts = r["acceptance_length"], r["speedup"], r["tokens_per_second"]
    lines = [f"acceptance length: offline {f(al['offline'])} (held-out blocks, simulated), "
             f"online {f(al['online'])} (peagle), vLLM {f(al['vllm'])}",
             f"speedup over plain decoding: peagle {f(sp['online'], '.2f')}x "
             f"({f(ts['online']['speculative'], '.1f')} vs {f(ts['online']['plain'], '.1f')} tok/s)"
             + (f", vLLM {f(sp['vllm'], '.2f')}x at concurrency 1" if sp["vllm"] is not None else ""),
             f"identical to greedy decoding: peagle {r['identical_to_greedy']['online']}"
             + (f", vLLM {r['identical_to_greedy']['vllm']}" if r["identical_to_greedy"]["vllm"] is not None else ""),
             f"vLLM evaluation: {r['vllm']}",
             "stage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in r["stage_seconds"].items()),
             "artifacts:", *(f"  {k:<17} {v}" for k, v in r["artifacts"].items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = check_inputs(args)
        out = Path(args.out)
        state = load_state(out, settings, args.force)
        vllm_py, vllm_status = vllm_python(args)
        check_vllm_python(vllm_py)
    except RecipeError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()
    (out / STATE).write_text(json.dumps(state, indent=1) + "\n")
    resume = {"extract": (out / "features.zarr").exists(), "train": (out / "drafter").exists()}
    cmds = stage_commands(args, out, resume, vllm_py)
    skipped = run_stages(cmds, out, state)
    r = report(out, args, state, skipped, vllm_status)
    (out / "report.json").write_text(json.dumps(r, indent=1) + "\n")
    print(summary(r), file=sys.stderr)
    print(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
