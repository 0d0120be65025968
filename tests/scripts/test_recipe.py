"""scripts/recipe.py: inputs and sizes checked before any stage runs; a tiny non-Llama verifier end to end
(regenerate -> pack -> extract -> train -> peagle-eval), its JSON report, and a re-run that resumes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "recipe.py"
spec = importlib.util.spec_from_file_location("recipe", SCRIPT)
recipe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recipe)
PROMPTS = REPO / "examples" / "prompts.jsonl"


@pytest.fixture
def inputs(tmp_path):
    """A verifier (SmolLM2's config and tokenizer: the checks before any stage read no weights), conversations,
    the recipe's arguments."""
    (tmp_path / "convs.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                   {"role": "assistant", "content": "hello"}]}) + "\n")
    return ["--verifier", "smollm2-135m", "--data", str(tmp_path / "convs.jsonl"),
            "--eval-prompts", str(PROMPTS), "--out", str(tmp_path / "run"), "--no-vllm"]


def replace(args: list[str], flag: str, value: str) -> list[str]:
    i = args.index(flag)
    return [*args[:i + 1], value, *args[i + 2:]]


@pytest.mark.parametrize("extra, message", [
    (["--steps", "0"], "argument --steps: '0': expected a positive integer"),
    (["--num-prompts", "2.5"], "argument --num-prompts: '2.5': expected a positive integer"),
    (["--lr", "0.0"], "argument --lr: '0.0': expected a positive number such as 1e-3"),
    (["--lr", "fast"], "argument --lr: 'fast': expected a positive number such as 1e-3"),
    (["--regen-turns", "some"], "argument --regen-turns: invalid choice: 'some'"),
])
def test_a_bad_size_stops_before_any_stage_naming_it(inputs, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        recipe.main([*inputs, *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda a, t: replace(a, "--data", str(t / "none.jsonl")), "--data {t}/none.jsonl: no such file"),
    (lambda a, t: replace(a, "--eval-prompts", str(t / "p.jsonl")), "--eval-prompts {t}/p.jsonl: no such file"),
    (lambda a, t: replace(a, "--verifier", str(t / "convs.jsonl")), "--verifier {t}/convs.jsonl: model "),
    (lambda a, t: [*a, "--regen-max-new-tokens", "8"], "--regen-max-new-tokens needs --regenerate"),
    (lambda a, t: replace(a, "--out", str(t / "convs.jsonl")), "--out {t}/convs.jsonl: exists and is not a directory"),
    (lambda a, t: replace(a, "--out", str(t / "convs.jsonl" / "run")),
     "--out {t}/convs.jsonl/run: {t}/convs.jsonl is not a directory"),
    (lambda a, t: replace(a, "--out", str(t)), "--out {t}: a non-empty directory that no recipe run made"),
    (lambda a, t: [*a[:-1], "--vllm-python", str(t / "nopython")], "--vllm-python {t}/nopython: no such executable"),
    (lambda a, t: replace(a, "--verifier", str(t)), "--verifier {t}: "),
])
def test_a_bad_input_stops_before_any_stage_naming_it(inputs, tmp_path, capsys, edit, message):
    assert recipe.main(edit(inputs, tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.startswith("recipe.py: " + message.format(t=tmp_path)) and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_an_eval_prompt_file_peagle_eval_would_refuse_stops_before_any_stage(inputs, tmp_path, capsys):
    bad = tmp_path / "p.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}) + "\n")
    assert recipe.main(replace(inputs, "--eval-prompts", str(bad))) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"recipe.py: --eval-prompts {bad}: ") and "content" in err
    assert not (tmp_path / "run").exists()


def test_a_rerun_with_other_settings_or_inputs_is_refused_naming_them(inputs, tmp_path, capsys):
    args = recipe.parser().parse_args([*inputs, "--steps", "4"])
    (tmp_path / "run").mkdir()
    state = {"settings": recipe.check_inputs(args), "done": {"pack": 1.0}}
    (tmp_path / "run" / "recipe_state.json").write_text(json.dumps(state))
    assert recipe.main([*inputs, "--steps", "8"]) == 2
    err = capsys.readouterr().err
    assert "holds a run of other settings or inputs (steps: 4 there, 8 now)" in err and "--force" in err
    (tmp_path / "convs.jsonl").write_text((tmp_path / "convs.jsonl").read_text() * 2)  # the data changed
    assert recipe.main([*inputs, "--steps", "4"]) == 2
    assert "(data: " in capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "recipe_state.json").read_text()) == state  # untouched


def test_each_stage_resumes_or_starts_over_as_its_command_allows(inputs, tmp_path):
    args = recipe.parser().parse_args([*inputs, "--regenerate", "--limit", "5"])
    out = tmp_path / "run"
    fresh = recipe.stage_commands(args, out, {"extract": False, "train": False}, None)
    assert list(fresh) == ["regenerate", "pack", "extract", "train", "eval"]
    assert fresh["regenerate"][-1] == "--resume" and fresh["regenerate"][-3:-1] == ["--limit", "5"]
    assert fresh["pack"][fresh["pack"].index("pack") + 1] == str(out / "regenerated.jsonl")
    assert "--limit" not in fresh["pack"] and fresh["pack"][-1] == "--force"
    assert "--resume" not in fresh["extract"] + fresh["train"] and "--force" not in fresh["extract"] + fresh["train"]
    again = recipe.stage_commands(args, out, {"extract": True, "train": True}, "/opt/vllm/bin/python")
    assert again["extract"][-1] == again["train"][-1] == "--resume"
    assert again["eval_vllm"][:3] == ["/opt/vllm/bin/python", "-m", "cli.eval"] and "vllm" in again["eval_vllm"]
    forced = recipe.stage_commands(recipe.parser().parse_args([*inputs, "--regenerate", "--force"]), out,
                                   {"extract": True, "train": True}, None)
    assert all(argv.count("--force") == 1 and "--resume" not in argv for argv in forced.values())
    assert "--no-measure-costs" not in fresh["eval"]  # peagle-eval's default: the costs are measured
    quick = recipe.stage_commands(recipe.parser().parse_args([*inputs, "--no-measure-costs"]), out,
                                  {"extract": False, "train": False}, "/opt/vllm/bin/python")
    assert [stage for stage, argv in quick.items() if "--no-measure-costs" in argv] == ["eval", "eval_vllm"]


def test_a_failed_stage_says_how_to_continue_and_when_force_is_needed(tmp_path):
    (tmp_path / "run").mkdir()
    cmds = {"pack": [sys.executable, "-c", "raise SystemExit(3)"], "train": [sys.executable, "-c", "pass"]}
    state = {"settings": {}, "done": {}}
    with pytest.raises(SystemExit) as e:
        recipe.run_stages(cmds, tmp_path / "run", state)
    assert str(e.value) == (
        "recipe.py: stage pack failed (exit status 3; its output above). Fix the cause, then run the same command "
        "again to continue from this stage; if the fix changed an input file or a setting, add --force (it starts "
        "over: every stage runs again)")
    assert state["done"] == {} and not (tmp_path / "run" / "recipe_state.json").exists()


@pytest.mark.slow
def test_own_qwen3_verifier_end_to_end_then_a_rerun_skips_the_stages_done(tmp_path, smollm2_tokenizer_dir):
    sys.path.insert(0, str(REPO / "tests"))
    from families import save_family

    verifier = save_family("qwen3", tmp_path / "qwen3", tokenizer_dir=smollm2_tokenizer_dir, vocab_size=49152)
    convs = tmp_path / "convs.jsonl"
    convs.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"Tell me about the number {i}."},
        {"role": "assistant", "content": f"The number {i} is small. " * 5}]}) + "\n" for i in range(8)))
    out = tmp_path / "runs" / "x"  # its parent is created too
    cmd = [sys.executable, str(SCRIPT), "--verifier", str(verifier), "--data", str(convs), "--eval-prompts",
           str(PROMPTS), "--out", str(out), "--regenerate", "--regen-max-new-tokens", "12", "--max-seq-len", "64",
           "--steps", "4", "--num-depths", "2", "--draft-vocab-size", "64", "--num-prompts", "1",
           "--max-new-tokens", "8", "--no-vllm"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    report = json.loads(first.stdout)
    assert report == json.loads((out / "report.json").read_text())
    assert list(report["stage_seconds"]) == ["regenerate", "pack", "extract", "train", "eval"]
    assert report["skipped_stages_done_earlier"] == [] and report["vllm"] == "skipped: --no-vllm"
    ev = json.loads((out / "eval.json").read_text())
    assert report["acceptance_length"] == {"online": ev["acceptance_length"], "vllm": None,
                                           "offline": ev["offline"]["simulated_acceptance_length"]}
    assert report["acceptance_length"]["online"] >= 1.0 and report["offline_split"] == "validation"
    assert report["identical_to_greedy"] == {"online": True, "vllm": None} and report["num_draft_tokens"] == 2
    assert report["speedup"]["online"] == ev["speedup"] > 0
    for name, path in report["artifacts"].items():
        assert name == "stage_outputs" or Path(path).exists(), name
    rows = [json.loads(line) for line in (out / "regenerated.jsonl").read_text().splitlines()]
    assert len(rows) == 8 and all(r["messages"][1]["content"] != "The number 0 is small. " * 5 for r in rows)
    assert json.loads((out / "train.json").read_text())["steps"] == 4
    assert "acceptance length: offline" in first.stderr and f"  drafter           {out}/drafter/final" in first.stderr

    # killed in training (after its last checkpoint): the same command continues it with --resume
    state = json.loads((out / "recipe_state.json").read_text())
    del state["done"]["train"], state["done"]["eval"]
    (out / "recipe_state.json").write_text(json.dumps(state))
    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads(resumed.stdout)["skipped_stages_done_earlier"] == ["regenerate", "pack", "extract"]
    assert f"--output {out}/drafter --max-steps 4 --num-depths 2 --draft-vocab-size 64 --resume\n" in resumed.stderr
    assert json.loads(resumed.stdout)["acceptance_length"]["offline"] == report["acceptance_length"]["offline"]

    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    done = json.loads(again.stdout)
    assert done["skipped_stages_done_earlier"] == list(report["stage_seconds"]) == list(done["stage_seconds"])
    assert again.stderr.count("done by an earlier run, skipped") == 5


def test_the_vllm_environment_is_found_or_the_report_says_why_not(inputs, tmp_path, monkeypatch):
    parse = recipe.parser().parse_args
    assert recipe.vllm_python(parse(inputs)) == (None, "skipped: --no-vllm")
    assert recipe.vllm_python(parse([*inputs[:-1], "--vllm-python", sys.executable])) == (sys.executable, "ran")
    monkeypatch.setattr(recipe, "REPO", tmp_path)  # a checkout with .venv-vllm
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-vllm" / "bin" / "python").write_text("")
    assert recipe.vllm_python(parse(inputs[:-1])) == (str(tmp_path / ".venv-vllm" / "bin" / "python"), "ran")
    (tmp_path / ".venv-vllm" / "bin" / "python").unlink()  # none, and no vllm in this interpreter
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    py, why = recipe.vllm_python(parse(inputs[:-1]))
    assert py is None and why.startswith("skipped: no vLLM environment (PEAGLE_VLLM=1 bash scripts/setup_env.sh")


def test_the_report_takes_each_figure_from_its_evaluation(inputs, tmp_path):
    """eval.json (peagle's engine, offline under ``offline``) and eval_vllm.json (peagle-eval --engine vllm)
    as those commands write them (the keys the report reads), into the report's fields."""
    (tmp_path / "eval.json").write_text(json.dumps({
        "acceptance_length": 1.25, "speedup": 0.8, "tokens_per_second": 8.0, "baseline_tokens_per_second": 10.0,
        "identical_to_greedy": True, "num_draft_tokens": 3,
        "offline": {"simulated_acceptance_length": 1.5, "split": "validation"}}))
    (tmp_path / "eval_vllm.json").write_text(json.dumps({
        "acceptance_length": 1.75, "speedup": 1.1, "tokens_per_second": 22.0, "baseline_tokens_per_second": 20.0,
        "identical_to_greedy": True, "throughput": {"1": {"plain": 20.0, "speculative": 22.0, "speedup": 1.1},
                                                    "8": {"plain": 80.0, "speculative": 60.0, "speedup": 0.75}}}))
    args = recipe.parser().parse_args(inputs)
    state = {"done": {"pack": 1.0, "extract": 2.0, "train": 3.0, "eval": 4.0, "eval_vllm": 5.0}}
    r = recipe.report(tmp_path, args, state, ["pack"], "skipped: no vLLM environment")
    assert r["acceptance_length"] == {"offline": 1.5, "online": 1.25, "vllm": 1.75}
    assert r["speedup"] == {"online": 0.8, "vllm": 1.1, "vllm_by_concurrency": {"1": 1.1, "8": 0.75}}
    assert r["tokens_per_second"] == {"online": {"speculative": 8.0, "plain": 10.0},
                                      "vllm": {"speculative": 22.0, "plain": 20.0}}
    assert r["identical_to_greedy"] == {"online": True, "vllm": True} and r["num_draft_tokens"] == 3
    assert r["vllm"] == "ran" and r["offline_split"] == "validation" and r["skipped_stages_done_earlier"] == ["pack"]
    assert r["artifacts"]["eval_vllm"] == str(tmp_path / "eval_vllm.json") and "regenerated" not in r["artifacts"]
    text = recipe.summary(r)
    assert "acceptance length: offline 1.500 (held-out blocks, simulated), online 1.250 (peagle), vLLM 1.750" in text
    assert "speedup over plain decoding: peagle 0.80x (8.0 vs 10.0 tok/s), vLLM 1.10x at concurrency 1" in text
    del state["done"]["eval_vllm"]  # an eval_vllm.json of an earlier run is not this run's
    r = recipe.report(tmp_path, args, state, [], "skipped: --no-vllm")
    assert r["acceptance_length"]["vllm"] is None and r["vllm"] == "skipped: --no-vllm"
    assert "eval_vllm" not in r["artifacts"]


def test_recipe_sh_names_itself_in_usage_and_errors(tmp_path):
    """``bash scripts/recipe.sh --help`` (and its errors) name the script the user ran, not ``recipe.py``: the
    checkout's recipe.sh run beside a no-op set-up and a ``.venv/bin/python`` that is this interpreter."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "recipe.sh").write_text((REPO / "scripts" / "recipe.sh").read_text())
    (scripts / "setup_env.sh").write_text("true\n")
    (scripts / "recipe.py").symlink_to(SCRIPT)  # resolves to the checkout: its packages import
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").symlink_to(sys.executable)
    help_ = subprocess.run(["bash", "scripts/recipe.sh", "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert help_.returncode == 0, help_.stderr
    assert help_.stdout.startswith("usage: scripts/recipe.sh [-h] --verifier MODEL") and "recipe.py" not in help_.stdout
    bad = subprocess.run(["bash", "scripts/recipe.sh", "--verifier", "smollm2-135m"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.splitlines()[-1].startswith("scripts/recipe.sh: error: the following "
                                                                          "arguments are required")


@pytest.mark.parametrize("version", ["0.34.0", "0.35.0+cpu", "dev"])
def test_a_vllm_that_dropped_p_eagle_stops_before_any_stage(inputs, tmp_path, capsys, monkeypatch, version):
    """The vLLM environment's version is read (its distribution, in that python) before any stage runs."""
    asked = []
    monkeypatch.setattr(recipe, "vllm_version_of", lambda python: asked.append(python) or version)
    monkeypatch.setattr(recipe, "run_stages", lambda *a: pytest.fail("a stage ran"))
    assert recipe.main([*inputs[:-1], "--vllm-python", sys.executable]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(f"recipe.py: the vLLM evaluation ({sys.executable}): "), err
    assert "vLLM 0.33 is the last release that serves P-EAGLE drafters" in err and "peagle-train --method dflash" in err
    assert err.endswith("; or pass --no-vllm to run the recipe without it") and asked == [sys.executable]
    assert not (tmp_path / "run").exists()


def test_the_vllm_version_is_read_in_the_vllm_python():
    """This python's vLLM, read by a child of it (None where none is installed), as the check reads it."""
    from runtime.vllm_runtime import installed_vllm_version

    assert recipe.vllm_version_of(sys.executable) == installed_vllm_version()
    assert recipe.peagle_vllm_refusal("0.33.2") is None
