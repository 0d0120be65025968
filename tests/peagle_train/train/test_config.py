"""peagle_train.train.config: the byte budget of a streaming run."""

from __future__ import annotations

import dataclasses

import pytest

import peagle_train.train.config as config


def test_the_byte_budget_is_parsed_once_and_streaming_is_its_own_switch(monkeypatch):
    """``--max-store-bytes`` is parsed once, when the config is made (``StreamConfig.budget_bytes``, an int), and
    whether the run streams is asked by name (``streaming``), adding no option and nothing to train_config.json."""
    calls = []
    parse = config.parse_size
    monkeypatch.setattr(config, "parse_size", lambda text, *a: calls.append(text) or parse(text, *a))
    s = config.StreamConfig(max_store_bytes="1.5GiB")
    assert (s.budget_bytes, s.budget_bytes, s.streaming) == (1610612736, 1610612736, True) and calls == ["1.5GiB"]
    assert config.StreamConfig().budget_bytes is None and not config.StreamConfig().streaming
    assert {"budget_bytes", "streaming"}.isdisjoint(f.name for f in dataclasses.fields(config.StreamConfig))
    with pytest.raises(ValueError, match="--max-store-bytes 'abc' is not a size"):
        config.StreamConfig(max_store_bytes="abc")


@pytest.mark.parametrize("kw, resolved", [
    (dict(), (8, 7)),  # no warm start: speculators' default
    (dict(init_from="x"), (None, None)),  # the --init-from drafter's, once the run reads it
    (dict(init_from="x", block_size=4), (4, 3)),
    (dict(init_from="x", num_depths=5), (6, 5)),
])
def test_a_dflash_block_size_is_left_unset_only_for_a_warm_start_to_take_its_sources(kw, resolved):
    cfg = config.TrainConfig.from_flat(store="s", output="o", method="dflash", **kw)
    assert (cfg.model.block_size, cfg.model.num_depths) == resolved
