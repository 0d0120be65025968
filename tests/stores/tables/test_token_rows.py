"""The typed token-table rows match the Arrow schemas the tables are written and read with."""

import numpy as np
import pyarrow.parquet as pq
import pytest

from stores.tables.token_rows import PackedRow, TokenizedRow, arrow_schema, optional_columns
from stores.tables.token_tables import OPTIONAL_COLUMNS, PACKED_SCHEMA, SCHEMAS, TOKENIZED_SCHEMA, TableWriter


@pytest.mark.parametrize("row_type,schema", [(TokenizedRow, TOKENIZED_SCHEMA), (PackedRow, PACKED_SCHEMA)])
def test_row_dataclass_equals_the_arrow_schema(row_type, schema):
    assert arrow_schema(row_type) == schema  # names, order and types
    assert optional_columns(row_type) == OPTIONAL_COLUMNS & set(schema.names)


def test_typed_rows_write_as_their_dicts(tmp_path):
    row = PackedRow(block_id=3, input_ids=np.array([5, 6, 7], np.int32), loss_mask=np.array([0, 1, 1], np.uint8),
                    position_ids=np.array([0, 1, 0], np.int32), cu_seqlens=[0, 2, 3], segment_ids=["a#0", "b#0"],
                    n_tokens=3)
    with TableWriter(tmp_path, "packed") as w:
        w.write(row)
        w.write(row.as_dict())
    table = pq.read_table(tmp_path / "part-00000.parquet")
    assert table.schema == SCHEMAS["packed"]
    rows = table.to_pylist()
    assert rows[0] == rows[1] == {"block_id": 3, "input_ids": [5, 6, 7], "loss_mask": [0, 1, 1],
                                  "position_ids": [0, 1, 0], "cu_seqlens": [0, 2, 3], "segment_ids": ["a#0", "b#0"],
                                  "n_tokens": 3, "segment_datasets": None, "segment_loss_tokens": None,
                                  "segment_prefix_lens": None, "segment_starts": None, "segment_keys": None}
