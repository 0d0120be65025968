"""The packed table's record of its conversations sub-table (``conversations`` in its manifest,
:func:`stores.tables.token_tables.conversations_record`): a sub-table that is not the one ``pack`` wrote with
the windows is refused, whatever its rows hold."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from peagle_data.prepare.config import PackConfig, PackRun
from peagle_data.prepare.pack import run_pack
from stores.errors import StoreFormatError, StoreMismatchError
from stores.tables.token_tables import (
    CONVERSATIONS,
    RejectsWriter,
    TableWriter,
    TokenTable,
    conversations_record,
    read_first_reject,
    write_manifest,
)
from tests.long_conversations import long_conversations


def _pack(tmp_path, tokenizer, name: str, n: int = 4):
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps(c) + "\n" for c in long_conversations(n)))
    run_pack(PackRun(inputs=[src], tokenizer="smollm2-135m", output=tmp_path / name,
                     settings=PackConfig(max_seq_len=64, block_size=128)), tokenizer=tokenizer)
    return tmp_path / name


def _rewrite(packed, edit) -> None:
    """Write the sub-table again (same writer, same manifest) with ``edit(rows)``'s rows."""
    sub = TokenTable.open(packed / CONVERSATIONS)
    manifest, rows = dict(sub.manifest), edit([dict(r) for r in sub.iter_rows()])
    for f in sub.directory.glob("part-*.parquet"):
        f.unlink()
    with TableWriter(packed / CONVERSATIONS, "tokenized") as w:
        for r in rows:
            w.write(r)
    write_manifest(packed / CONVERSATIONS, {k: manifest[k] for k in ("kind", "of", "rows")})


def test_pack_records_its_conversations_and_a_changed_sub_table_is_refused(tmp_path, smollm2_tokenizer):
    packed = _pack(tmp_path, smollm2_tokenizer, "p")
    table = TokenTable.open(packed)
    record = table.manifest[CONVERSATIONS]
    assert record == conversations_record(packed) and record["rows"] == 4 and len(record["sha256"]) == 64
    assert table.conversations().num_rows == 4
    _rewrite(packed, lambda rows: rows)  # rewritten unchanged: the same bytes, accepted
    assert TokenTable.open(packed).conversations().num_rows == 4

    def edit(rows):  # one token of long3, the same length: no window check could see it if no window holds it
        ids = np.array(rows[3]["input_ids"])
        ids[20] = ids[20] + 1
        rows[3]["input_ids"] = ids
        return rows

    _rewrite(packed, edit)
    with pytest.raises(StoreMismatchError, match=rf"{packed / CONVERSATIONS}: its part files are not those "
                                                 rf"{packed / 'manifest.json'} records .* pack the table again"):
        TokenTable.open(packed).conversations()


def test_a_sub_table_of_another_pack_run_is_refused(tmp_path, smollm2_tokenizer):
    packed, other = _pack(tmp_path, smollm2_tokenizer, "p"), _pack(tmp_path, smollm2_tokenizer, "q", n=5)
    shutil.rmtree(packed / CONVERSATIONS)
    shutil.copytree(other / CONVERSATIONS, packed / CONVERSATIONS)
    with pytest.raises(StoreMismatchError, match="edited or copied from another pack run"):
        TokenTable.open(packed).conversations()


def test_read_first_reject(tmp_path):
    assert read_first_reject(tmp_path) is None  # no rejects.jsonl
    with RejectsWriter(tmp_path):
        pass
    assert read_first_reject(tmp_path) is None  # empty
    with RejectsWriter(tmp_path) as rejects:
        rejects.write("a.jsonl:3", "unknown format: the row has neither", field="messages")
        rejects.write("a.jsonl:4", "too long: 9 tokens")
    assert read_first_reject(tmp_path) == {"source": "a.jsonl:3", "reason": "unknown format: the row has neither",
                                           "field": "messages"}
    (tmp_path / "rejects.jsonl").write_text("[1]\n")
    with pytest.raises(StoreFormatError, match="line 1 is not a JSON object"):
        read_first_reject(tmp_path)
