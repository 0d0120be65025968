"""K from measured costs (issue 23): the formula on hand-made costs and acceptances, the timing on the tiny
Llama, and the ``cost_model`` entry of online, offline and CLI reports."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from peagle_train.evaluate.config import EvalConfig
from peagle_train.evaluate.cost_model import (ASSUMPTIONS, StepCosts, acceptance_shares, cost_model_report,
                                              cost_problems, expected_acceptance_length, format_cost_model,
                                              first_prompt_ids, measure_step_costs, measure_trusted_costs,
                                              predict_speedups)
from peagle_train.evaluate.online import evaluate_prompts
from peagle_train.evaluate.prompts import Prompt, render_turn
from peagle_train.evaluate.report import format_report
from peagle_train.evaluate.run import OFFLINE_COSTS_NOT_ASKED
from stores.errors import InputError
from tests.peagle_train.evaluate.test_evaluate import saved_drafter_and_store, write_lines
from tests.peagle_train.generate.test_speculative import tiny_dflash, tiny_drafter


def costs(verify_1_ms: float, verify_ms: list[float], draft_ms: list[float]) -> StepCosts:
    return StepCosts(verify_1_s=verify_1_ms / 1e3, verify_s=[v / 1e3 for v in verify_ms],
                     draft_s=[d / 1e3 for d in draft_ms], context_tokens=100, rounds=1, warmup_rounds=0, threads=1,
                     device="cpu")


# ------------------------------------------------------------------ the formula
def test_expected_al_and_speedup_on_hand_made_values_pick_the_best_k():
    # s = 1/2, 1/4, 1/8, 1/16: E[AL] = 1.5, 1.75, 1.875, 1.9375; steps 64, 64, 84, 124 ms; greedy step 40 ms
    c = costs(40.0, [60.0, 60.0, 80.0, 120.0], [4.0, 4.0, 4.0, 4.0])
    rows = predict_speedups(c, [0.5, 0.25, 0.125, 0.0625])
    assert [r["K"] for r in rows] == [1, 2, 3, 4]
    assert [r["expected_acceptance_length"] for r in rows] == [1.5, 1.75, 1.875, 1.9375]
    assert [r["step_ms"] for r in rows] == pytest.approx([64.0, 64.0, 84.0, 124.0], rel=1e-12)
    assert [r["break_even_acceptance_length"] for r in rows] == pytest.approx([1.6, 1.6, 2.1, 3.1], rel=1e-12)
    expected = [1.5 * 40 / 64, 1.75 * 40 / 64, 1.875 * 40 / 84, 1.9375 * 40 / 124]  # 0.9375, 1.09375, 0.893, 0.625
    assert [r["expected_speedup"] for r in rows] == pytest.approx(expected, rel=1e-12)
    report = cost_model_report(c, {"num_drafts": 16, "per_position_accepted": [8, 4, 2, 1]})
    assert report["best_K"] == 2 and report["best_expected_speedup"] == pytest.approx(1.09375, rel=1e-12)
    assert report["faster_than_greedy"] is True and report["acceptance_source"] == "online"
    assert report["acceptance_shares"] == [0.5, 0.25, 0.125, 0.0625] and report["greedy_step_ms"] == 40.0
    assert report["assumptions"] == ASSUMPTIONS and "note" not in report
    assert report["costs"]["verify_s"] == [0.06, 0.06, 0.08, 0.12]


def test_iid_acceptance_gives_leviathan_et_al_expected_tokens():
    """With s_i = a^(i+1), E[AL](K) is Leviathan et al.'s (1 - a^(K+1)) / (1 - a)."""
    a = 0.6
    shares = [a ** (i + 1) for i in range(6)]
    for K in range(1, 7):
        assert expected_acceptance_length(shares, K) == pytest.approx((1 - a ** (K + 1)) / (1 - a), rel=1e-12)
    with pytest.raises(InputError, match="K = 7 outside the 6 positions"):
        expected_acceptance_length(shares, 7)


def test_no_k_beats_greedy_and_fewer_measured_positions_than_timed():
    c = costs(40.0, [80.0, 80.0, 80.0, 80.0], [5.0, 5.0, 5.0, 5.0])
    report = cost_model_report(c, {"positions_scored": 10, "per_position_accepted": [3, 1]})
    assert report["acceptance_source"] == "offline" and [r["K"] for r in report["rows"]] == [1, 2]
    assert report["best_K"] == 2 and report["best_expected_speedup"] == pytest.approx(1.4 * 40 / 85, rel=1e-12)
    assert report["faster_than_greedy"] is False
    assert report["note"] == ("the acceptance was measured with K = 2 drafts: K = 3..4 are not predicted (run "
                              "with --num-draft-tokens 4)")
    assert "best K 2: expected speedup 0.659 (no K beats greedy decoding here)" in format_report(
        {"simulated_acceptance_length": 1.4, "num_depths": 2, "positions_scored": 10, "per_depth_accuracy": [0.3, 0.1],
         "per_position_acceptance": [0.3, 1 / 3], "cost_model": report})


def test_acceptance_shares_reproduce_the_reports_own_al():
    online = {"num_drafts": 1625, "per_position_accepted": [530, 102, 10, 0], "acceptance_length": 1 + 642 / 1625}
    shares, source = acceptance_shares(online)
    assert source == "online" and shares == [530 / 1625, 102 / 1625, 10 / 1625, 0.0]
    assert expected_acceptance_length(shares, 4) == pytest.approx(online["acceptance_length"], rel=1e-15)
    with pytest.raises(InputError, match="scored no draft"):
        acceptance_shares({"num_drafts": 0, "per_position_accepted": [0]})
    with pytest.raises(InputError, match="neither online"):
        acceptance_shares({"acceptance_length": 1.2})


def test_first_prompt_ids_stop_before_the_first_supervised_token():
    block = SimpleNamespace(input_ids=torch.tensor([5, 6, 7, 8, 9, 10, 11]),
                            loss_mask=torch.tensor([0, 0, 0, 1, 1, 0, 1]),
                            cu_seqlens=torch.tensor([0, 5, 7]))
    assert first_prompt_ids(block).tolist() == [5, 6, 7]
    whole = SimpleNamespace(input_ids=torch.tensor([5, 6, 7]), loss_mask=torch.tensor([1, 1, 1]),
                            cu_seqlens=torch.tensor([0, 3]))
    assert first_prompt_ids(whole).tolist() == [5, 6, 7]  # supervised from its first token: the whole segment


# ------------------------------------------------------------------ the timing on the tiny Llama
def test_timing_on_the_tiny_llama_gives_one_row_per_k(tiny_verifier, smollm2_tokenizer):
    drafter = tiny_drafter(tiny_verifier, num_depths=3)
    ids = render_turn(smollm2_tokenizer, Prompt("a", ["Hello there"]), 0, [])
    c = measure_step_costs(tiny_verifier, drafter, ids, 3, rounds=3, warmup_rounds=1)
    assert len(c.verify_s) == len(c.draft_s) == 3 and c.context_tokens == len(ids) and c.rounds == 3
    assert c.verify_1_s > 0 and all(t > 0 for t in c.verify_s + c.draft_s)
    assert c.threads == 1 and c.device == "cpu"  # the one_thread fixture of tests/peagle_train/conftest.py
    with pytest.raises(InputError, match="empty"):
        measure_step_costs(tiny_verifier, drafter, [], 3)


def test_a_dflash_drafter_is_timed_with_a_block_of_k_plus_1_for_each_k(tiny_verifier, smollm2_tokenizer):
    """``peagle-eval --prompts`` times the cost model by default: a DFlash drafter once crashed there (a P-EAGLE
    session given its blocks)."""
    drafter = tiny_dflash(tiny_verifier, block_size=4)
    ids = render_turn(smollm2_tokenizer, Prompt("a", ["Hello there"]), 0, [])
    c = measure_step_costs(tiny_verifier, drafter, ids, 3, rounds=2, warmup_rounds=0)
    assert len(c.verify_s) == len(c.draft_s) == 3 and all(t > 0 for t in c.verify_s + c.draft_s)


def test_the_timing_shows_its_progress(tiny_verifier, smollm2_tokenizer, capsys):
    """Minutes under load with no line was a new user's finding: each measurement has a progress line on stderr
    (a final ``done:`` line off a terminal), one update per round, warm-up included."""
    drafter = tiny_drafter(tiny_verifier, num_depths=2)
    ids = render_turn(smollm2_tokenizer, Prompt("a", ["Hello there"]), 0, [])
    rounds = []
    measure_step_costs(tiny_verifier, drafter, ids, 2, rounds=3, warmup_rounds=1, on_round=lambda: rounds.append(1))
    assert len(rounds) == 4
    capsys.readouterr()
    costs = measure_trusted_costs(tiny_verifier, drafter, ids, 2, rounds=3, warmup_rounds=1, attempts=1)
    err = capsys.readouterr().err  # captured: not a terminal, so plain lines
    assert re.search(r"^cost model timing: done: 4/4 round in [0-9.]+s ", err, re.M), err
    assert costs.attempts == 1
    measure_trusted_costs(tiny_verifier, drafter, ids, 2, rounds=3, warmup_rounds=1, attempts=1, show_progress=False)
    assert "cost model timing" not in capsys.readouterr().err


def test_online_report_has_the_table(tiny_verifier, smollm2_tokenizer):
    drafter = tiny_drafter(tiny_verifier, num_depths=4)
    prompts = [Prompt("a", ["Hello there"])]
    report = evaluate_prompts(tiny_verifier, drafter, smollm2_tokenizer, prompts,
                              EvalConfig(max_new_tokens=9, num_draft_tokens=3, cost_rounds=2), recurrent_layers=[])
    cm = report["cost_model"]
    assert cm["acceptance_source"] == "online" and [r["K"] for r in cm["rows"]] == [1, 2, 3]
    assert len(cm["costs"]["verify_s"]) == 4  # timed up to num_depths; the acceptance of 3 positions limits the rows
    assert cm["note"].startswith("the acceptance was measured with K = 3 drafts")
    assert cm["rows"][-1]["expected_acceptance_length"] == pytest.approx(report["acceptance_length"], rel=1e-12)
    assert cm["costs"]["context_tokens"] == len(render_turn(smollm2_tokenizer, prompts[0], 0, []))
    best = max(cm["rows"], key=lambda r: r["expected_speedup"])
    text = format_report(report)
    assert "K  expected AL  t_draft ms (spread)  t_verify(K+1) ms (spread)  break-even AL  expected speedup" in text
    if cm.get("not_recommended"):  # timings on a loaded machine (this one) are noise: no K, and the reason
        assert cm["best_K"] is cm["recommended_K"] is None and "no K recommended: the step timings are noise" in text
    else:
        assert cm["best_K"] == cm["recommended_K"] == best["K"] and f"best K {best['K']}" in text
    assert "load average" in text and len(cm["load_average"]) == 2
    sampled = evaluate_prompts(tiny_verifier, drafter, smollm2_tokenizer, prompts,
                               EvalConfig(max_new_tokens=4, temperature=1.0, cost_rounds=1), recurrent_layers=[])
    assert sampled["cost_model"]["skipped"].startswith("temperature 1.0: the cost model predicts greedy decoding")
    off = evaluate_prompts(tiny_verifier, drafter, smollm2_tokenizer, prompts,
                           EvalConfig(max_new_tokens=4, measure_costs=False), recurrent_layers=[])
    assert "cost_model" not in off


def test_cli_offline_times_nothing_unless_asked(tiny_verifier, tiny_verifier_dir, tmp_path):
    """Issue 44 item 6: an offline-only run finished scoring, then timed 17 rounds of decoding steps (12 minutes
    under load, nothing said). Offline judging times no decoding unless --measure-costs asks; then a line says
    what is timed and how to skip it; --no-measure-costs leaves the entry out."""
    from click.testing import CliRunner

    from cli.eval import main

    store = saved_drafter_and_store(tiny_verifier, tiny_verifier_dir, tmp_path)
    args = ["--drafter", str(tmp_path / "drafter"), "--store", store]
    plain = CliRunner().invoke(main, args)
    assert plain.exit_code == 0, plain.output
    report = json.loads(plain.stdout)
    assert report["cost_model"] == {"skipped": OFFLINE_COSTS_NOT_ASKED} and report["config"]["measure_costs"] is None
    assert "cost model" not in plain.stderr and "--measure-costs times" in plain.stderr
    result = CliRunner().invoke(main, args + ["--measure-costs", "--all-anchor", "--output", str(tmp_path / "eval.json")])
    assert result.exit_code == 0, result.output
    assert re.search(r"^cost model: timing a greedy step and, for K = 1\.\.4, .* 2 \+ 15 rounds, .*"
                     r"--no-measure-costs skips it$", result.stderr, re.M), result.stderr
    report = json.loads(result.stdout)
    cm = report["cost_model"]
    assert cm["acceptance_source"] == "offline" and [r["K"] for r in cm["rows"]] == [1, 2, 3, 4]
    assert cm["costs"]["context_tokens"] == 2  # the first segment's tokens before its first loss token
    assert cm["acceptance_shares"] == [a / report["positions_scored"] for a in report["per_position_accepted"]]
    assert cm["rows"][-1]["expected_acceptance_length"] == pytest.approx(report["simulated_acceptance_length"],
                                                                         rel=1e-12)
    assert json.loads((tmp_path / "eval.json").read_text())["cost_model"] == cm
    assert report["config"]["measure_costs"] is True
    assert ("best K" in result.stderr) != ("no K recommended" in result.stderr)
    off = CliRunner().invoke(main, args + ["--no-measure-costs"])
    assert off.exit_code == 0, off.output
    assert "cost_model" not in json.loads(off.stdout) and "best K" not in off.stderr and "no K" not in off.stderr
    prompts = write_lines(tmp_path / "p.jsonl", [{"question_id": 7, "turns": ["Hi"]}])
    both = CliRunner().invoke(main, args + ["--prompts", prompts, "--max-new-tokens", "6"])
    assert both.exit_code == 0, both.output
    both = json.loads(both.stdout)  # peagle's own decoder ran: the table is the online acceptance's
    assert both["cost_model"]["acceptance_source"] == "online" and "cost_model" not in both["offline"]


# ------------------------------------------------------------------ trust (issue 34 item 5)
def test_a_verifier_cost_falling_with_k_is_noise_and_no_k_is_recommended():
    # the numbers: verifying 2 tokens 588 ms, 5 tokens 225 ms, under load; measured speedup 0.482
    c = StepCosts(verify_1_s=0.200, verify_s=[0.588, 0.300, 0.250, 0.225], draft_s=[0.01] * 4, context_tokens=100,
                  rounds=15, warmup_rounds=2, threads=2, device="cpu", load_average=[7.9, 8.4], cpus=2, attempts=2)
    report = cost_model_report(c, {"num_drafts": 16, "per_position_accepted": [8, 4, 2, 1], "speedup": 0.482})
    assert report["recommended_K"] is None and report["best_K"] is None and report["best_expected_speedup"] is None
    assert report["faster_than_greedy"] is None
    assert report["not_recommended"].startswith(
        "the step timings are noise (verifying 3 tokens measured 300.00 ms, cheaper than verifying 2 (588.00 ms); "
        "verifying 4 tokens measured 250.00 ms")
    assert "verifying 5 tokens measured 225.00 ms, cheaper than verifying 2 (588.00 ms); measured 2 times" in \
        report["not_recommended"]
    assert report["load_average"] == [7.9, 8.4] and report["cpus"] == 2
    assert report["warnings"][0] == ("the load average (7.90 -> 8.40) exceeds the 2 CPUs: the timings are of a "
                                     "shared machine, not of decoding alone")
    # at K = 4 the table predicts 1.9375 * 200 / 235 = 1.649 against the measured 0.482
    assert report["warnings"][1].startswith("at the run's K = 4 the table predicts a speedup of 1.649, the run "
                                            "measured 0.482")
    text = "\n".join(format_cost_model(report))
    assert "load average 7.90 -> 8.40 on 2 CPUs" in text and "best K" not in text
    assert "  no K recommended: the step timings are noise" in text and "  warning: the load average" in text


def test_a_wide_spread_is_noise_and_a_small_dip_is_not():
    clean = dict(verify_1_s=0.040, verify_s=[0.060, 0.057, 0.080], draft_s=[0.004] * 3, context_tokens=100, rounds=15,
                 warmup_rounds=2, threads=1, device="cpu", verify_1_spread=0.05, verify_spread=[0.05, 0.04, 0.1],
                 draft_spread=[0.1, 0.1, 0.2], load_average=[0.5, 0.6], cpus=4)
    assert cost_problems(StepCosts(**clean)) == []  # 60 -> 57 ms is within the 10% tolerance
    report = cost_model_report(StepCosts(**clean), {"positions_scored": 10, "per_position_accepted": [5, 2, 1]})
    assert report["recommended_K"] == report["best_K"] == 2 and report["warnings"] == []
    noisy = StepCosts(**{**clean, "draft_spread": [0.1, 0.6, 0.2], "verify_1_spread": 0.3})
    assert cost_problems(noisy) == ["timings spread more than 25% of their median over 15 rounds (interquartile "
                                    "range): t_v(1) 30%, t_d(2) 60%"]


def test_noisy_timings_are_measured_again(monkeypatch):
    import peagle_train.evaluate.cost_model as cost_model

    good = StepCosts(verify_1_s=0.04, verify_s=[0.06, 0.07], draft_s=[0.004] * 2, context_tokens=3, rounds=15,
                     warmup_rounds=2, threads=1, device="cpu")
    bad = StepCosts(**{**good.__dict__, "verify_s": [0.06, 0.03]})
    measured = iter([bad, good])
    monkeypatch.setattr(cost_model, "measure_step_costs", lambda *a, **kw: next(measured))
    again = cost_model.measure_trusted_costs(None, None, [1, 2, 3], 2)
    assert again.verify_s == [0.06, 0.07] and again.attempts == 2
    monkeypatch.setattr(cost_model, "measure_step_costs", lambda *a, **kw: bad)
    assert cost_model.measure_trusted_costs(None, None, [1, 2, 3], 2, attempts=3).attempts == 3


def test_a_hybrid_verifier_is_not_timed():
    """A hybrid verifier's rejecting steps also feed the kept tokens again, which the model does not time: refused
    with the reason, before any pass."""
    import peagle_train.evaluate.cost_model as cost_model
    from peagle_train.generate.verifier import config_recurrent_layers
    from tests.families import family_config

    config = family_config("qwen3_next")
    assert config_recurrent_layers(config) == [0, 2]
    with pytest.raises(InputError, match="hybrid verifier.*--no-measure-costs"):
        cost_model.measure_step_costs(SimpleNamespace(config=config), None, [1, 2, 3], 2)
