"""``pack`` records each window's conversation content key and places the copies of a conversation (a mixture
weight above 1) in repeated blocks, so they link no other blocks (docs/design.md §5, §8)."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from cli.data import main as data_main
from peagle_data.prepare.dedup import rows_key
from peagle_train.data.split import block_groups
from stores.tables.token_rows import TokenizedRow, content_key
from stores.tables.token_tables import TokenTable
from tests.long_conversations import long_conversations


def _pack(root, weight, tokenizer):
    short = [{"id": f"s{i}", "messages": [{"role": "user", "content": f"Say {i}."},
                                          {"role": "assistant", "content": f"{i} " * (1 + i)}]} for i in range(8)]
    (root / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in long_conversations(6) + short))
    (root / f"w{weight}.yaml").write_text(f"sources:\n  - {{name: src, path: c.jsonl, weight: {weight}}}\n")
    out = root / f"packed{weight}"
    result = CliRunner().invoke(data_main, ["pack", str(root / f"w{weight}.yaml"), "--tokenizer", str(tokenizer),
                                            "--output", str(out), "--max-seq-len", "64", "--block-size", "128"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return TokenTable.open(out)


def _keys(rows):
    width = max(len(r["segment_keys"]) for r in rows)
    return np.array([np.pad(r["segment_keys"], (0, width - len(r["segment_keys"])), mode="edge") for r in rows])


def test_copies_fill_repeated_blocks_and_share_their_content_key(tmp_path, tiny_verifier_dir):
    once = list(_pack(tmp_path, 1, tiny_verifier_dir).iter_rows())
    table = _pack(tmp_path, 2, tiny_verifier_dir)
    twice = list(table.iter_rows())
    assert len(once) == 18 and len(twice) == 36  # each block of the weight-1 pack, twice
    for b, row in enumerate(once):
        for copy, other in enumerate(twice[2 * b: 2 * b + 2]):
            assert np.array_equal(other["input_ids"], row["input_ids"]) and np.array_equal(other["cu_seqlens"],
                                                                                           row["cu_seqlens"])
            assert other["segment_ids"] == [s if copy == 0 else s.replace("#", "*2#") for s in row["segment_ids"]]
            assert other["segment_keys"].tolist() == row["segment_keys"].tolist()
    # a window's key is its conversation's content: its rows' token ids and loss masks (stores.tables.token_rows)
    convs = {r["conversation_id"]: TokenizedRow(**r) for r in table.conversations().iter_rows()}
    for row in twice:
        for sid, key in zip(row["segment_ids"], row["segment_keys"].tolist()):
            assert key == content_key(rows_key([convs[sid.rpartition("#")[0]]]))
    # the split's groups: each group of the weight-1 pack, with its copy blocks
    g1 = np.unique(block_groups(_keys(once)), return_counts=True)[1]
    g2 = np.unique(block_groups(_keys(twice)), return_counts=True)[1]
    assert sorted(g1.tolist()) == [1, 8, 9] and sorted(g2.tolist()) == [2, 16, 18]


def test_the_per_turn_rows_of_a_conversation_and_their_copies_share_one_key(tmp_path, smollm2_tokenizer):
    """Under a template that rewrites history, conversation ``q`` gives rows ``q@1`` and ``q@3``: one
    conversation, one key, also for the copy a weight of 2 draws; the copy's rows fill a repeat of the blocks."""
    from peagle_data.prepare.config import PackConfig, PackRun, TokenizeConfig
    from peagle_data.prepare.pack import run_pack
    from tests.peagle_data.prepare.test_runs import QWEN3

    (tmp_path / "qwen3.jinja").write_text(QWEN3)
    q = {"id": "q", "messages": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4.", "reasoning_content": "Add."},
        {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6.", "reasoning_content": "Add."}]}
    other = {"id": "o", "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}
    (tmp_path / "q.jsonl").write_text(json.dumps(q) + "\n" + json.dumps(other) + "\n")
    (tmp_path / "m.yaml").write_text("sources:\n  - {name: q, path: q.jsonl, weight: 2}\n")
    run_pack(PackRun(inputs=[tmp_path / "m.yaml"], tokenizer="smollm2-135m", output=tmp_path / "p",
                     settings=PackConfig(max_seq_len=64, tokenize=TokenizeConfig(chat_template=str(tmp_path / "qwen3.jinja")))),
             tokenizer=smollm2_tokenizer)
    rows = list(TokenTable.open(tmp_path / "p").iter_rows())
    assert [r["segment_ids"] for r in rows] == [["q@3#0"], ["q*2@3#0"], ["q@1#0", "o#0"], ["q*2@1#0", "o*2#0"]]
    q_key, o_key = rows[2]["segment_keys"].tolist()
    assert [r["segment_keys"].tolist() for r in rows] == [[q_key], [q_key], [q_key, o_key], [q_key, o_key]]
    assert q_key != o_key and all(np.array_equal(rows[b]["input_ids"], rows[b + 1]["input_ids"]) for b in (0, 2))
