"""peagle_data.prepare.counts.Counts: the typed counts of a tokenize or pack run and its manifest form."""

import pytest

from peagle_data.prepare.counts import Counts


def test_to_manifest_keeps_the_counted_fields_in_order_and_leaves_out_the_uncounted():
    c = Counts()
    assert c.to_manifest() == {"read": 0, "used": 0, "rejected": 0, "null_keys_dropped_rows": 0,
                               "tool_arguments_decoded": 0, "tool_schemas_decoded": 0,
                               "conversations_with_dropped_content": 0}
    c.read += 3
    c.bump("duplicates", False)  # counted zero times: written as 0
    c.bump("copies", 2)
    c.drop("tools")
    c.drop("reasoning_content")
    c.drop("tools")
    c.rejected_by_reason = {"bad json": 1}
    c.source("chat")["used"] += 1
    m = c.to_manifest()
    assert list(m)[7:] == ["duplicates", "dropped_tools", "dropped_reasoning_content", "copies", "rejected_by_reason",
                           "sources"]
    assert (m["read"], m["duplicates"], m["copies"], m["dropped_tools"], m["dropped_reasoning_content"]) == (3, 0, 2, 2, 1)
    assert m["sources"] == {"chat": {"read": 0, "used": 1, "rejected": 0, "duplicates": 0, "other_shards": 0}}
    assert "windows" not in m and "n_blocks" not in m  # a tokenize run's counts have no pack keys
    m["sources"]["chat"]["used"] = 9  # a copy: the record is unchanged
    assert c.sources["chat"]["used"] == 1


def test_bump_refuses_an_unknown_counter():
    with pytest.raises(AttributeError, match="Counts has no counter 'raed'"):
        Counts().bump("raed")
    with pytest.raises(AttributeError, match="no counter 'sources'"):
        Counts().bump("sources")


def test_add_sums_a_source_run_except_used():
    run, src = Counts(), Counts()
    run.bump("copies", 1)
    src.read, src.used, src.rejected = 5, 4, 1
    src.bump("copies", 2)
    src.bump("sampled_out", 3)
    src.drop("tools")
    run.add(src)
    m = run.to_manifest()
    assert (m["read"], m["used"], m["rejected"], m["copies"], m["sampled_out"], m["dropped_tools"]) == (5, 0, 1, 3, 3, 1)
    assert "duplicates" not in m
