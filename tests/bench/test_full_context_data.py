"""bench/full_context_data.py: the held-out split by ShareGPT base id, the cut of a held-out conversation at
its last long-history user turn (SmolLM2's chat template), the tokens check of the JSONL round trip, and
the AL statistics of the table."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("full_context_data", REPO / "bench" / "full_context_data.py")
bench = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = bench
spec.loader.exec_module(bench)


def test_pieces_of_one_sharegpt_conversation_fall_on_one_side_and_an_eighth_is_held_out():
    assert bench.base_id("hRPPgZT_11") == "hRPPgZT"
    assert bench.base_id("hRPPgZT") == "hRPPgZT"
    assert bench.base_id("a_b_x") == "a_b_x"  # no piece number
    assert bench.base_id("data/chats:3") == "data/chats:3"
    bases = [f"conv{i:05d}" for i in range(4096)]
    for b in bases[:200]:
        assert len({bench.is_held_out(f"{b}_{k}") for k in range(5)}) == 1
    share = sum(bench.is_held_out(b) for b in bases) / len(bases)
    assert 0.11 < share < 0.14  # 1/8 = 0.125; binomial SE over 4096 bases 0.005


def _conversation() -> list[dict]:
    long = "The quick brown fox jumps over the lazy dog. " * 30  # about 300 tokens
    return [{"role": "user", "content": "first question"}, {"role": "assistant", "content": long},
            {"role": "user", "content": "second question"}, {"role": "assistant", "content": long + long},
            {"role": "user", "content": "third question"}, {"role": "assistant", "content": "short answer"}]


def _user_starts(tokenizer, messages: list[dict]) -> list[int]:
    """Token index at which each user turn's ``<|im_start|>`` stands in the rendered conversation."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    user = tokenizer.encode("user", add_special_tokens=False)
    return [i for i, t in enumerate(ids) if t == start and ids[i + 1: i + 1 + len(user)] == user]


def test_the_cut_is_the_last_user_turn_whose_history_is_long_enough_and_whose_prompt_fits(smollm2_tokenizer):
    msgs = _conversation()
    starts = _user_starts(smollm2_tokenizer, msgs)  # [system prompt's length, after answer 1, after answer 2]
    assert len(starts) == 3 and 250 < starts[1] < starts[2] - 500
    third = len(smollm2_tokenizer.apply_chat_template(msgs[:5], add_generation_prompt=True, tokenize=True,
                                                      return_dict=False))
    # the history of a turn is every token before its <|im_start|>user
    assert bench.cut(smollm2_tokenizer, msgs, 100, 10_000) == (4, starts[2], third)
    assert bench.cut(smollm2_tokenizer, msgs, starts[2], 10_000) is None  # more than, not as many as
    assert bench.cut(smollm2_tokenizer, msgs, starts[2] - 1, 10_000) == (4, starts[2], third)
    # the third turn's prompt does not fit: the second is the last that qualifies
    i, history, prompt = bench.cut(smollm2_tokenizer, msgs, 100, third - 1)
    assert (i, history) == (2, starts[1]) and prompt < third
    assert bench.cut(smollm2_tokenizer, msgs, 100, starts[1]) is None
    assert bench.plain([{"role": "assistant", "content": None, "tool_calls": [{}]}]) is None
    assert bench.plain([{"role": "user", "content": "x", "weight": 1}]) == [{"role": "user", "content": "x"}]


def _tokenize(rows: list[dict], tmp: Path, name: str) -> Path:
    src = tmp / f"{name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp / name
    subprocess.run([sys.executable, "-m", "cli.data", "tokenize", str(src), "--tokenizer", "smollm2-135m",
                    "--output", str(out)], cwd=REPO, check=True, capture_output=True)
    return out


def test_check_finds_a_conversation_whose_tokens_changed(tmp_path):
    rows = [{"id": f"c{i}_0", "messages": m[: 2 * (i + 1)]} for i, m in enumerate([_conversation()] * 2)]
    original = _tokenize(rows, tmp_path, "original")
    same = _tokenize(rows, tmp_path, "same")
    changed = _tokenize([rows[0], {"id": "c1_0", "messages": _conversation()}], tmp_path, "changed")
    # c1_0 with c0_0's messages: tokenize rejects it as a duplicate, so the round trip lost it
    lost = _tokenize([rows[0], {"id": "c1_0", "messages": rows[0]["messages"]}], tmp_path, "lost")

    def check(train: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "bench" / "full_context_data.py"), "check", "--tokenized",
                               str(original), "--train-tokenized", str(train), "--train-jsonl",
                               str(tmp_path / "same.jsonl")], cwd=REPO, capture_output=True, text=True)

    ok = check(same)
    assert ok.returncode == 0 and ok.stdout.startswith("check: 2 conversations, same n_tokens")
    bad = check(changed)
    assert bad.returncode == 1 and "1 of 2 conversations differ" in bad.stderr and "'c1_0'" in bad.stderr
    gone = check(lost)
    assert gone.returncode == 1 and "1 conversations of" in gone.stderr and gone.stderr.strip().endswith("c1_0")


def _report(accepted: list[int], prompt: str = "p", K: int = 4) -> dict:
    a = np.asarray(accepted)
    return {"num_drafts": len(a), "per_position_accepted": [int((a > i).sum()) for i in range(K)],
            "identical_to_greedy": True,
            "per_prompt": [{"prompt_id": prompt, "turn": 0, "accepted": int(a.sum()), "verifier_steps": len(a)}]}


def test_al_and_its_standard_error_from_the_chained_counts():
    steps = [0, 1, 0, 2, 4, 0, 0, 1, 3, 0, 1]
    al, se, n = bench.al_and_se(_report(steps))
    assert n == 11 and al == pytest.approx(1 + np.mean(steps), abs=1e-12)
    assert se == pytest.approx(np.std(steps) / np.sqrt(11), abs=1e-12)
    offline = {"positions_scored": 4, "per_position_accepted": [3, 1, 0, 0]}  # chains of 1, 2, 0, 1 kept
    assert bench.al_and_se(offline)[:2] == pytest.approx((2.0, np.std([1, 2, 0, 1]) / 2))


def test_table_pairs_the_two_drafters_prompt_by_prompt(tmp_path, capsys):
    per_side = {"window": {"a": [0, 1, 0, 1], "b": [0, 0]}, "full": {"a": [1, 1, 2], "b": [0, 0, 1]}}
    for side, prompts in per_side.items():
        d = tmp_path / f"drafter_{side}"
        d.mkdir()
        reports = [_report(v, p) for p, v in prompts.items()]
        merged = {"num_drafts": sum(r["num_drafts"] for r in reports), "identical_to_greedy": True,
                  "per_position_accepted": list(np.sum([r["per_position_accepted"] for r in reports], 0).tolist()),
                  "per_prompt": [r["per_prompt"][0] for r in reports]}
        (d / "online.json").write_text(json.dumps(merged))
        (d / "train_config.json").write_text(json.dumps({"optim": {"max_steps": 100}}))
        (tmp_path / f"train_{side}.log").write_text("+ peagle-train ...\nwall 250.00 s, peak RSS 1 KiB\n")
    bench.table(bench.argparse.Namespace(out=str(tmp_path)))
    out = capsys.readouterr().out
    assert "| window context | - | 1.333 (0.192, 6) | - | online yes | 2.50 |" in out
    assert "| full context | - | 1.833 (0.281, 6) | - | online yes | 2.50 |" in out
    # per prompt: a 1.5 -> 2.333, b 1.0 -> 1.333: differences 0.833 and 0.333, mean 0.583, SE 0.25
    assert "online: per-prompt AL, full - window: mean +0.583, SE over 2 prompts 0.250; full higher on 2" in out
