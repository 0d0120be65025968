"""The stream session (stores/stream/session.py): the plan and the cursor written and read back, evictions."""

from __future__ import annotations

from stores.features.feature_store import FeatureStore
from stores.stream.session import StreamSession
from tests.stores.stream.test_plan import _plan


def test_plan_and_cursor_round_trip(tmp_path):
    store = FeatureStore.create(tmp_path / "s.zarr", n_blocks=10, block_size=4, max_segments=1, layers=[1],
                                hidden_size=8, vocab_size=16, verifier={"name_or_path": "v", "hidden_size": 8,
                                                                         "vocab_size": 16})
    session = StreamSession(store)
    assert session.read_plan() is None and session.consumed() == 0 and session.plan is None
    plan = _plan([3, 1, 2, 0], window=2)
    session.write_plan(plan)
    assert session.plan is plan
    back = StreamSession(store).read_plan()
    assert back.same_run(plan) and back.order.tolist() == [3, 1, 2, 0] and back.val_blocks == (9,)
    assert not back.same_run(_plan([3, 1, 0, 2], window=2))
    session.write_consumed(3)
    assert session.consumed() == 3
    assert list(store.group.array_keys())  # the store still opens and lists its arrays
    session.remove_plan()
    assert session.read_plan() is None and session.consumed() == 0


def test_the_cursor_never_goes_back_and_evictions_follow_the_plan(tmp_path):
    store = FeatureStore.create(tmp_path / "s.zarr", n_blocks=10, block_size=4, max_segments=1, layers=[1],
                                hidden_size=8, vocab_size=16, verifier={"name_or_path": "v", "hidden_size": 8,
                                                                         "vocab_size": 16})
    session = StreamSession(store)
    session.write_plan(_plan([3, 1, 2, 0], window=2))  # validation block 9
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"x")
    session.mark_consumed(checkpoint, 2)
    session.mark_consumed(checkpoint, 1)
    assert session.consumed() == 2
    # cursor 2: the window reads blocks 2 and 0; 3 and 1 go, the validation block 9 stays
    assert session.evict([0, 1, 2, 3, 9], 2) == [1, 3]
