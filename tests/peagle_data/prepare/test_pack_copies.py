"""``pack`` records each window's conversation content key and places the copies of a conversation (a mixture
weight above 1) in repeated blocks, so they link no other blocks (docs/design.md §5, §8)."""

from __future__ import annotations

import json

import numpy as np
from click.testing import CliRunner

from cli.data import main as data_main
from peagle_data.prepare.dedup import rows_key
from peagle_train.data.split import block_groups
from stores.token_rows import TokenizedRow, content_key
from stores.token_tables import TokenTable
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
    # a window's key is its conversation's content: its rows' token ids and loss masks (stores.token_rows)
    convs = {r["conversation_id"]: TokenizedRow(**r) for r in table.conversations().iter_rows()}
    for row in twice:
        for sid, key in zip(row["segment_ids"], row["segment_keys"].tolist()):
            assert key == content_key(rows_key([convs[sid.rpartition("#")[0]]]))
    # the split's groups: each group of the weight-1 pack, with its copy blocks
    g1 = np.unique(block_groups(_keys(once)), return_counts=True)[1]
    g2 = np.unique(block_groups(_keys(twice)), return_counts=True)[1]
    assert sorted(g1.tolist()) == [1, 8, 9] and sorted(g2.tolist()) == [2, 16, 18]
