"""``pack`` keeps where every window comes from (docs/design.md §6): the ``conversations`` sub-table
holds the tokenized rows its windows were cut from, and ``segment_prefix_lens``/``segment_starts``
place each window in its row exactly (trimmed windows included); ``merge`` of shards keeps them."""

import json

import numpy as np

from peagle_data.prepare.config import PackConfig, PackRun, TokenizeConfig
from peagle_data.prepare.pack import run_pack
from stores.merge import merge_tables
from stores.tables.token_tables import TokenTable


def long_conversations(n: int = 6) -> list[dict]:
    """Multi-turn conversations of a few hundred tokens (several windows of 128) and short ones."""
    rows = []
    for c in range(n):
        msgs = []
        for t in range(2 + c % 3):
            msgs.append({"role": "user", "content": f"question {c}.{t}: " + " ".join(f"w{c}{t}{k}" for k in range(30))})
            msgs.append({"role": "assistant", "content": " ".join(f"answer{c}{t}{k}" for k in range(25 + 7 * c))})
        rows.append({"id": f"long{c}", "messages": msgs})
    rows += [{"id": f"short{c}", "messages": [{"role": "user", "content": f"hi {c}"},
                                              {"role": "assistant", "content": "yo " * (c + 1)}]} for c in range(4)]
    return rows


def check_windows_against_conversations(packed) -> dict[str, int]:
    """Every window's tokens are its conversation's ``[0, prefix) + [start, start + n - prefix)``;
    returns counts of whole, split and trimmed windows."""
    table = TokenTable.open(packed)
    convs = {r["conversation_id"]: r for r in table.conversations().iter_rows()}
    seen, counts = set(), {"whole": 0, "split": 0, "trimmed": 0}
    W = table.manifest["parameters"]["max_seq_len"]
    for r in table.iter_rows():
        cu = r["cu_seqlens"]
        for k, sid in enumerate(r["segment_ids"]):
            cid = sid.rpartition("#")[0]
            conv, p, s = convs[cid], r["segment_prefix_lens"][k], r["segment_starts"][k]
            n = cu[k + 1] - cu[k]
            ids = r["input_ids"][cu[k]:cu[k + 1]]
            assert np.array_equal(ids, np.concatenate([conv["input_ids"][:p], conv["input_ids"][s:s + n - p]])), sid
            if conv["n_tokens"] <= W:
                assert (p, s, n) == (0, 0, conv["n_tokens"])
                counts["whole"] += 1
            else:
                assert p == conv["system_len"] > 0
                counts["split"] += 1
                counts["trimmed"] += n < W
            seen.add(cid)
    assert seen == set(convs)  # the sub-table holds exactly the rows windows come from
    return counts


def test_windows_are_placed_in_their_conversations(tmp_path, smollm2_tokenizer):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in long_conversations()))
    run_pack(PackRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "p",
                     settings=PackConfig(max_seq_len=128, block_size=256)), tokenizer=smollm2_tokenizer)
    counts = check_windows_against_conversations(tmp_path / "p")
    assert counts["whole"] == 4 and counts["split"] > 12 and counts["trimmed"] >= 1
    sub = TokenTable.open(tmp_path / "p").conversations()
    assert sub.num_rows == 10 and sub.manifest["rows"] == 10


def test_merged_shards_keep_the_conversations(tmp_path, smollm2_tokenizer):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in long_conversations()))
    shards = []
    for i in range(2):
        out = tmp_path / f"s{i}"
        run_pack(PackRun(inputs=[src], tokenizer="smollm2-135m", output=out,
                         settings=PackConfig(max_seq_len=128, tokenize=TokenizeConfig(num_shards=2, shard_index=i))),
                 tokenizer=smollm2_tokenizer)
        shards.append(out)
    merge_tables(shards, tmp_path / "m")
    check_windows_against_conversations(tmp_path / "m")
    ids = sorted(r["conversation_id"] for r in TokenTable.open(tmp_path / "m").conversations().iter_rows())
    assert ids == sorted([f"long{c}" for c in range(6)] + [f"short{c}" for c in range(4)])


def test_an_input_id_equal_to_a_per_turn_id_is_renamed(tmp_path, smollm2_tokenizer):
    """Under a template that rewrites history, conversation ``q`` gives rows ``q@1``, ``q@3``; an input row
    whose own id is ``q@1`` becomes ``q@1~2``, so each window id names one row of the sub-table."""
    from stores.merge import verify_table
    from tests.peagle_data.prepare.test_runs import QWEN3

    template = tmp_path / "qwen3.jinja"
    template.write_text(QWEN3)
    q = {"id": "q", "messages": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4.", "reasoning_content": "Add."},
        {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6.", "reasoning_content": "Add."}]}
    other = {"id": "q@1", "messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]}
    src = tmp_path / "q.jsonl"
    src.write_text(json.dumps(q) + "\n" + json.dumps(other) + "\n")
    p = run_pack(PackRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "p",
                         settings=PackConfig(max_seq_len=64, tokenize=TokenizeConfig(chat_template=str(template)))),
                 tokenizer=smollm2_tokenizer)
    assert p["counts"]["duplicate_ids_renamed"] == 1
    sub = TokenTable.open(tmp_path / "p").conversations().read_all(["conversation_id", "source"]).to_pylist()
    assert [(r["conversation_id"], r["source"].rpartition(":")[2]) for r in sub] == [
        ("q@1", "1"), ("q@3", "1"), ("q@1~2", "2")]
    assert verify_table(tmp_path / "p")["ok"]
    check_windows_against_conversations(tmp_path / "p")
