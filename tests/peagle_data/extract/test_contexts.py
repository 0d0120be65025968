"""The full-context plan's packing of contexts into context blocks (peagle_data/extract/contexts.py): grouped by
the training block that reads them first (stores made now), or all at once by best fit (stores made before)."""

from __future__ import annotations

import numpy as np
import pytest

from peagle_data.extract.contexts import plan_contexts
from stores.tables.token_tables import TokenTable
from tests.peagle_data.extract.test_full_context import synthetic_conversations, write_packed_conversations

SHAPES = [(10, 3), (40, 3), (14, 0), (30, 0), (12, 2), (9, 0), (11, 0)]
"""(tokens, system_len): two conversations cut into windows of 16 that land in several training blocks."""


@pytest.fixture
def table(tmp_path):
    rows = synthetic_conversations(512, shapes=SHAPES)
    packed = write_packed_conversations(tmp_path / "packed", rows, max_seq_len=16, block_size=32)
    return list(TokenTable.open(packed).iter_rows()), {r.conversation_id: r.as_dict() for r in rows}


def _context_blocks_of(plan) -> list[set[str]]:
    """Per context block, the conversations it holds (read back through the views)."""
    held: dict[int, set[str]] = {}
    for r, views in zip(plan.training_rows, plan.views):
        for sid, (m, *_rest) in zip(r["segment_ids"], views.tolist()):
            held.setdefault(m, set()).add(sid.rpartition("#")[0])
    return [held[m] for m in sorted(held)]


def test_contexts_are_grouped_by_the_training_block_that_reads_them_first(table):
    training, by_id = table
    plan = plan_contexts(training, by_id, 48, 32, packing="training_blocks")
    assert plan.counts["packing"] == "training_blocks"
    first = {}  # conversation -> the first training block reading it
    for b, r in enumerate(training):
        for sid in r["segment_ids"]:
            first.setdefault(sid.rpartition("#")[0], b)
    # every context block holds conversations first read by one training block, in training-block order
    owners = [{first[c] for c in convs} for convs in _context_blocks_of(plan)]
    assert all(len(o) == 1 for o in owners)
    order = [o.pop() for o in owners]
    assert order == sorted(order) and set(order) == set(first.values())
    assert len(set(first.values())) < len(first)  # some training block reads several conversations first
    # the same tokens are run whatever the packing; best fit (the default) packs them fuller
    old = plan_contexts(training, by_id, 48, 32)
    assert "packing" not in old.counts and old.counts["tokens_extracted"] == plan.counts["tokens_extracted"]
    assert old.counts["context_blocks"] <= plan.counts["context_blocks"]
    for r, v_new, v_old in zip(training, plan.views, old.views):  # every window reads its own tokens in both
        cu = np.asarray(r["cu_seqlens"])
        for k in range(len(r["segment_ids"])):
            window = np.asarray(r["input_ids"])[cu[k]:cu[k + 1]]
            for p, views in ((plan, v_new), (old, v_old)):
                m, prefix_slot, prefix_len, body_slot = views[k].tolist()
                ids = p.rows[m]["input_ids"]
                read = np.r_[ids[prefix_slot:prefix_slot + prefix_len],
                             ids[body_slot:body_slot + len(window) - prefix_len]]
                assert np.array_equal(read, window)
    with pytest.raises(ValueError, match="packing 'bogus'"):
        plan_contexts(training, by_id, 48, 32, packing="bogus")
