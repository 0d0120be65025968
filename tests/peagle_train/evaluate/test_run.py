"""One ``peagle-eval`` run (peagle_train/evaluate/run.py): the plan made before any verifier weights keeps what
it resolved, and the evaluation takes it instead of resolving again."""

from __future__ import annotations

from pathlib import Path

import peagle_train.evaluate.checks as checks
import peagle_train.evaluate.online as online
from peagle_train.evaluate.config import EvalConfig
from peagle_train.evaluate.run import EvalRun, evaluate_plan, plan_eval, run_eval
from stores.features.feature_store import FeatureStore
from tests.peagle_train.evaluate.test_evaluate import saved_drafter_and_store, write_lines


def _counting(monkeypatch, module, name: str, calls: list):
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(a[0]) or original(*a, **k))


def test_the_plan_keeps_what_it_resolved(tiny_verifier, tiny_verifier_dir, tmp_path):
    store = saved_drafter_and_store(tiny_verifier, tiny_verifier_dir, tmp_path)
    prompts = write_lines(tmp_path / "p.jsonl", [{"question_id": 7, "turns": ["Hi", "Again"]}])
    run = EvalRun(drafter=str(tmp_path / "drafter"), prompts=prompts, store=store, output=str(tmp_path / "e.json"),
                  settings=EvalConfig(max_new_tokens=6, measure_costs=False))
    plan = plan_eval(run, log=lambda m: None)
    assert plan.drafter == str(tmp_path / "drafter") and plan.output == Path(tmp_path / "e.json")
    assert plan.online.verifier == str(tiny_verifier_dir) and plan.online.prompts_file == prompts
    assert [(p.prompt_id, p.user_turns) for p in plan.online.prompts] == [("7", ["Hi", "Again"])]
    assert plan.online.sampling == {"top_k": 0, "top_k_from": "off", "top_p": 1.0, "top_p_from": "off"}
    assert plan.online.vllm_sampling_check is None  # peagle's engine
    assert str(plan.offline.store.path) == store and plan.offline.verifier == str(tiny_verifier_dir)
    assert (plan.offline.max_new_tokens, plan.offline.max_new_tokens_from) == (6, "given")
    assert plan.template_mode["mismatches"] == [] and plan.run.settings.chat_template_kwargs == {}


def test_a_run_reads_its_prompts_and_opens_its_store_for_the_checks_alone(tiny_verifier, tiny_verifier_dir, tmp_path,
                                                                         monkeypatch):
    """The prompts file is read once (by the checks, kept in the plan) and the store opened by the checks and
    the template mode only; the evaluation takes both from the plan."""
    store = saved_drafter_and_store(tiny_verifier, tiny_verifier_dir, tmp_path)
    prompts = write_lines(tmp_path / "p.jsonl", [{"question_id": 7, "turns": ["Hi"]}])
    read, opened = [], []
    _counting(monkeypatch, checks, "read_prompts", read)
    _counting(monkeypatch, online, "read_prompts", read)
    original = FeatureStore.open
    monkeypatch.setattr(FeatureStore, "open", lambda *a, **k: opened.append(a[0]) or original(*a, **k))
    report = run_eval(EvalRun(drafter=str(tmp_path / "drafter"), prompts=prompts, store=store,
                              settings=EvalConfig(max_new_tokens=6, measure_costs=False)), log=lambda m: None)
    assert report["identical_to_greedy"] is True and report["offline"]["blocks"] == [0]
    assert read == [prompts]
    assert opened == [store, store]  # check_before_weights, template_mode


def test_the_plan_keeps_the_drafter_kind_k_and_the_verifiers_resolved_once(tiny_verifier, tiny_verifier_dir, tmp_path,
                                                                            monkeypatch):
    """The verifier the online and offline halves share is resolved once (its directory and tokenizer), and the plan
    keeps the drafter's kind, K and each verifier's recurrent layers for the evaluation to take."""
    import peagle_train.train.kinds as kinds

    store = saved_drafter_and_store(tiny_verifier, tiny_verifier_dir, tmp_path)
    prompts = write_lines(tmp_path / "p.jsonl", [{"question_id": 7, "turns": ["Hi"]}])
    resolved, kinds_read = [], []
    _counting(monkeypatch, checks, "model_files", resolved)
    _counting(monkeypatch, kinds, "checkpoint_kind", kinds_read)
    plan = plan_eval(EvalRun(drafter=str(tmp_path / "drafter"), verifier=str(tiny_verifier_dir), prompts=prompts,
                             store=store, settings=EvalConfig(max_new_tokens=6, measure_costs=False)),
                     log=lambda m: None)
    assert resolved == [str(tiny_verifier_dir)]
    assert plan.kind.name == "peagle" and plan.num_draft_tokens == 4  # the drafter's num_depths
    assert plan.online.recurrent_layers == [] and plan.offline.recurrent_layers == []
    kinds_read.clear()
    report = evaluate_plan(plan, log=lambda m: None)  # loads the drafter by the plan's kind: no config.json read again
    assert kinds_read == [] and resolved == [str(tiny_verifier_dir)]
    assert report["num_draft_tokens"] == 4 and report["offline"]["blocks"] == [0]
