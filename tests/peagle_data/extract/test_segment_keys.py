"""``extract`` keeps each segment's conversation content key (``segment_keys``, docs/design.md §7) for the
validation split by conversation (§8): from the packed table's column, from the ``conversations/`` sub-table
of a table packed before the column existed, and ``--resume`` records them in a store made before."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from cli.data import main as data_main
from peagle_data.extract.config import ExtractConfig
from peagle_data.extract.run import run_extract
from peagle_train.data.split import split_store
from stores.errors import StoreFormatError
from stores.features.feature_repair import verify_store
from stores.features.feature_store import FeatureStore
from stores.tables.token_tables import TokenTable
from tests.long_conversations import long_conversations


@pytest.fixture(scope="module")
def packed(tmp_path_factory, tiny_verifier_dir):
    """A weight-2 mixture of 4 long conversations and 4 short ones at --max-seq-len 64, and the same table
    without its ``segment_keys`` column (as packed before peagle recorded it)."""
    root = tmp_path_factory.mktemp("keys")
    short = [{"id": f"s{i}", "messages": [{"role": "user", "content": f"Say {i}."},
                                          {"role": "assistant", "content": f"{i} " * (1 + i)}]} for i in range(4)]
    (root / "c.jsonl").write_text("".join(json.dumps(c) + "\n" for c in long_conversations(4) + short))
    (root / "m.yaml").write_text("sources:\n  - {name: twice, path: c.jsonl, weight: 2}\n")
    result = CliRunner().invoke(data_main, ["pack", str(root / "m.yaml"), "--tokenizer", str(tiny_verifier_dir),
                                            "--output", str(root / "new"), "--max-seq-len", "64"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    shutil.copytree(root / "new", root / "old")
    for part in sorted((root / "old").glob("part-*.parquet")):
        pq.write_table(pq.read_table(part).drop(["segment_keys"]), part)
    return root / "new", root / "old"


def _extract(packed, out, verifier, **kw):
    return run_extract(ExtractConfig(packed=str(packed), verifier=str(verifier), output=str(out), layers=[1, 2, 4],
                                     device="cpu", context="window", **kw), progress=False)


def test_the_store_keeps_the_tables_keys_and_computes_them_for_an_older_table(packed, tmp_path, tiny_verifier_dir):
    new, old = packed
    assert "segment_keys" not in TokenTable.open(old).columns()
    rows = list(TokenTable.open(new).iter_rows(["segment_keys"]))
    width = max(len(r["segment_keys"]) for r in rows)
    want = [r["segment_keys"].tolist() + [r["segment_keys"][-1]] * (width - len(r["segment_keys"])) for r in rows]
    _extract(new, tmp_path / "new.zarr", tiny_verifier_dir)
    _extract(old, tmp_path / "old.zarr", tiny_verifier_dir)
    for name in ("new.zarr", "old.zarr"):
        store = FeatureStore.open(tmp_path / name)
        assert store.segment_keys().tolist() == want and verify_store(tmp_path / name)["ok"]
    assert len({k for row in want for k in row}) == 8  # one key per conversation, shared by its copy


def test_resume_records_the_keys_of_a_store_made_before(packed, tmp_path, tiny_verifier_dir):
    new, _ = packed
    path = tmp_path / "s.zarr"
    _extract(new, path, tiny_verifier_dir)
    want = FeatureStore.open(path).segment_keys().tolist()
    shutil.rmtree(path / "segment_keys")  # as a store extracted by peagle before the array existed
    store = FeatureStore.open(path, mode="r+")
    attrs = dict(store.attrs)
    attrs.pop("segment_keys")
    store.group.attrs["peagle"] = attrs
    with pytest.raises(StoreFormatError, match="does not record which conversation each segment comes from"):
        split_store(FeatureStore.open(path), 0, 0.1)
    summary = _extract(new, path, tiny_verifier_dir, resume=True)
    assert summary["complete"] and summary["training_blocks_done_this_run"] == 0
    assert FeatureStore.open(path).segment_keys().tolist() == want and verify_store(path)["ok"]
    assert split_store(FeatureStore.open(path), 0, 0.1)[1].size > 0
