"""--max-windows keeps the first N windows of each conversation and counts the rest."""

import json

from peagle_data.prepare.config import PackConfig, PackRun
from peagle_data.prepare.pack import run_pack
from stores.tables.token_tables import TokenTable


def test_max_windows_caps_and_counts(tmp_path, smollm2_tokenizer):
    long = {"id": "long", "messages": [{"role": "user", "content": "go"},
                                       {"role": "assistant", "content": " ".join(["word"] * 400)}]}
    short = {"id": "short", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    src = tmp_path / "c.jsonl"
    src.write_text(json.dumps(long) + "\n" + json.dumps(short) + "\n")
    full = run_pack(PackRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "full",
                            settings=PackConfig(max_seq_len=128)), tokenizer=smollm2_tokenizer)["counts"]
    capped = run_pack(PackRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / "cap",
                              settings=PackConfig(max_seq_len=128, max_windows=2)), tokenizer=smollm2_tokenizer)["counts"]
    assert full["windows"] > 3 and full["windows_capped"] == 0
    assert capped["windows"] == 3  # two of the long conversation, one of the short
    assert capped["windows_capped"] == full["windows"] - 3
    segs = [s for row in TokenTable.open(tmp_path / "cap").iter_rows(["segment_ids"]) for s in row["segment_ids"]]
    assert sorted(segs) == ["long#0", "long#1", "short#0"]
    assert TokenTable.open(tmp_path / "cap").manifest["parameters"]["max_windows"] == 2
