"""Training while extracting on a bounded store (``peagle-train --extract-from --max-store-bytes``): the final
weights equal an offline run's (extract everything, then train) bit for bit, for 1 and 2 epochs under both
epoch policies and for a DFlash drafter too, and the store never passes its budget; bad input is refused before anything loads.

Tiny packed table (8 blocks of 48 token slots, random ids), the tiny Llama verifier (hidden 64, 4 layers),
hf engine on CPU; the extraction runs as the subprocess the command starts. The same for a full-context store
(``--context full``): 12 synthetic conversations whose windows share context blocks across training blocks."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import load_file

from peagle_data.inspect.verify import verify_output
from peagle_train.data.loader import BlockSequence
from peagle_train.data.multistore import conversation_groups
from peagle_train.data.split import split_store
from peagle_train.data.stream import make_plan, rerun_note
from peagle_train.train.config import TrainConfig
from peagle_train.train import run as train_run
from peagle_train.train.run import run_train
from peagle_train.train.trainer import Trainer
from peagle_train.train.setup import resolve_epoch_order
from peagle_train.train.stream import resolve_stream_context, wait_for_store
from stores.errors import InputError, OutputExistsError, StoreFormatError, StoreMismatchError
from stores.features.feature_store import FeatureStore
from stores.stream.plan import block_feature_bytes
from stores.stream.session import StreamSession
from tests.peagle_data.extract.test_run import write_packed

N_BLOCKS, C = 8, 48
OPTS = dict(num_depths=2, lr=3e-3, warmup_steps=1, val_fraction=0.25, val_max_blocks=2, draft_vocab_size=64,
            loss_chunk_size=64, seed=3)


# packed, offline_store, packed_full, offline_full, offline_full_defaults, offline_run: session fixtures (tests/peagle_train/train/conftest.py)


def _weights(out: Path) -> dict[str, np.ndarray]:
    return load_file(str(out / "final" / "model.safetensors"))


def _budget(offline_store: str, window: int, n_val: int = 2) -> int:
    """The budget of a window of ``window`` blocks: the offline store's bytes less its features, the plan's
    allowance (``fixed_store_bytes``) and the validation blocks."""
    store = FeatureStore.open(offline_store)
    block = block_feature_bytes(C, len(store.layers), store.hidden_size, "bf16")
    total = sum(p.stat().st_size for p in Path(offline_store).rglob("*") if p.is_file())
    fixed = total - N_BLOCKS * block
    return fixed + 8 * 64 + 8192 + (n_val + window) * block


@pytest.mark.parametrize("epochs", [1, 2])
@pytest.mark.parametrize("policy", ["reextract", "keep"])
def test_streaming_weights_equal_offline_weights(tmp_path, packed, offline_store, offline_run, tiny_verifier_dir,
                                                 policy, epochs, one_thread):
    steps = 6 * epochs  # 6 training blocks (2 held out), one per step
    offline, offline_out = offline_run(offline_store, steps, **OPTS)  # one run per step count for both policies
    store = tmp_path / "stream.zarr"
    budget = _budget(offline_store, window=3 if policy == "reextract" else 6)
    summary = run_train(TrainConfig.from_flat(
        store=str(store), output=str(tmp_path / "stream"), verifier=str(tiny_verifier_dir), max_steps=steps,
        extract_from=str(packed), max_store_bytes=str(budget), epoch_policy=policy, device="cpu", context="window",
        **OPTS))

    a, b = _weights(offline_out), _weights(tmp_path / "stream")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name
    assert summary["val_loss"] == offline["val_loss"]

    opened = FeatureStore.open(store)
    plan = StreamSession(opened).read_plan()
    assert plan.policy == policy and plan.n_entries == steps and StreamSession(opened).consumed() == steps
    done = set(np.flatnonzero(opened.done_mask()).tolist())
    if policy == "reextract":  # the training blocks are evicted at the end, the scored validation blocks stay
        assert done == set(plan.val_blocks) and len(plan.val_blocks) == 2
    else:
        assert done == set(plan.order.tolist()) | set(plan.val_blocks)
    log = Path(summary["extraction_log"]).read_text()
    extract_summary = json.loads(log[log.index("{"):])
    stream = extract_summary["stream"]
    assert stream["peak_store_bytes"] <= budget
    # extraction work: keep extracts every block once; reextract each block once per epoch, less those a window
    # of 3 still holds across an epoch's end (at most 2)
    if policy == "keep":
        assert stream["extractions"] == summary["stream"]["planned_extractions"] == 8
    else:
        assert 2 + 6 * epochs - 2 * (epochs - 1) <= stream["extractions"] <= 2 + 6 * epochs


def test_a_budget_too_small_names_the_smallest_that_works(tmp_path, packed, offline_store, tiny_verifier_dir):
    with pytest.raises(InputError, match=r"smallest budget that works is [\d,]+ bytes \(--max-store-bytes") as e:
        run_train(TrainConfig.from_flat(
            store=str(tmp_path / "s.zarr"), output=str(tmp_path / "o"), verifier=str(tiny_verifier_dir),
            extract_from=str(packed), max_store_bytes=str(_budget(offline_store, window=1) - 4000), device="cpu",
            context="window", **OPTS))  # above the estimate checked before the extraction starts, below the exact smallest
    assert not (tmp_path / "o").exists()  # nothing half-made is left
    smallest = int(str(e.value).split("smallest budget that works is ")[1].split(" bytes")[0].replace(",", ""))
    assert smallest == pytest.approx(_budget(offline_store, window=1), abs=1000)


def test_estimated_budget_refused_before_the_extraction_starts(tmp_path, packed, tiny_verifier_dir):
    with pytest.raises(InputError, match="at least [\\d,]+ bytes are needed"):
        run_train(TrainConfig.from_flat(store=str(tmp_path / "s.zarr"), output=str(tmp_path / "o"),
                                        verifier=str(tiny_verifier_dir), extract_from=str(packed),
                                        max_store_bytes="10KiB", context="window", **OPTS))
    assert not (tmp_path / "s.zarr").exists() and not (tmp_path / "s.zarr.extract.log").exists()


def test_free_disk_below_the_budget_is_refused(tmp_path, packed, tiny_verifier_dir):
    with pytest.raises(InputError, match="bytes free"):
        run_train(TrainConfig.from_flat(store=str(tmp_path / "s.zarr"), output=str(tmp_path / "o"),
                                        verifier=str(tiny_verifier_dir), extract_from=str(packed),
                                        max_store_bytes="1PiB", context="window", **OPTS))


def test_refusals_of_the_options(tmp_path):
    base = dict(store=str(tmp_path / "s.zarr"), output=str(tmp_path / "o"))
    with pytest.raises(ValueError, match="--allow-incomplete"):
        TrainConfig.from_flat(**base, max_store_bytes="1GB", allow_incomplete=True)
    with pytest.raises(ValueError, match="--context must be one of window, full"):
        TrainConfig.from_flat(**base, max_store_bytes="1GB", extract_from="p", verifier="m", context="whole")
    assert TrainConfig.from_flat(**base, max_store_bytes="1GB", extract_from="p", verifier="m",
                                 context="full").stream.context == "full"
    with pytest.raises(ValueError, match="--max-store-bytes '12XB' is not a size"):
        TrainConfig.from_flat(**base, max_store_bytes="12XB")
    with pytest.raises(ValueError, match="--extract-from"):
        TrainConfig.from_flat(**base, extract_from="p", verifier="m")
    with pytest.raises(ValueError, match="--device must be left out with --engine vllm"):
        TrainConfig.from_flat(**base, max_store_bytes="1GB", extract_from="p", verifier="m", engine="vllm", device="cpu")
    with pytest.raises(ValueError, match="--layers must be given only with --extract-from"):
        TrainConfig.from_flat(**base, max_store_bytes="1GB", layers=[1, 2])


def test_a_store_streamed_for_another_run_is_refused(tmp_path, packed, offline_store, tiny_verifier_dir, one_thread):
    store = tmp_path / "stream.zarr"
    budget = str(_budget(offline_store, window=3))
    run_train(TrainConfig.from_flat(store=str(store), output=str(tmp_path / "first"), verifier=str(tiny_verifier_dir),
                                    max_steps=2, extract_from=str(packed), max_store_bytes=budget, device="cpu",
                                    context="window", **OPTS))
    # verify: the evicted training blocks are no damage; a damaged kept (validation) block is
    report, failure = verify_output(store)
    assert failure is None and report["state"] == "streaming" and report["ok"]
    assert report["stream"]["consumed"] == 2 and report["stream"]["pending"] == []
    assert report["stream"]["consumed_blocks"] + len(report["stream"]["unused"]) == N_BLOCKS - 2
    val = StreamSession(FeatureStore.open(store)).read_plan().val_blocks[0]
    chunk = FeatureStore.open(store).chunk_path("aux_hidden", val)
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    report, failure = verify_output(store)
    assert report["state"] == "damaged" and str(val) in failure
    with pytest.raises(StoreFormatError, match="being streamed for the run .*first"):
        run_train(TrainConfig.from_flat(store=str(store), output=str(tmp_path / "second"),
                                        verifier=str(tiny_verifier_dir), max_steps=2, extract_from=str(packed),
                                        max_store_bytes=budget, device="cpu", context="window", **OPTS))
    with pytest.raises(OutputExistsError):  # the output of a finished run, without --resume or --force
        run_train(TrainConfig.from_flat(store=str(store), output=str(tmp_path / "first"),
                                        verifier=str(tiny_verifier_dir), max_steps=2, extract_from=str(packed),
                                        max_store_bytes=budget, device="cpu", context="window", **OPTS))


def test_a_store_of_another_packed_table_or_dtype_is_refused_before_anything_starts(tmp_path, packed, offline_store,
                                                                                   tiny_verifier_dir):
    """The extraction would refuse to continue it, but only in its log after the trainer loaded the weights."""
    other = write_packed(tmp_path / "other", n_blocks=N_BLOCKS, block_size=C, seed=1)  # packed again, other rows
    base = dict(store=offline_store, output=str(tmp_path / "o"), verifier=str(tiny_verifier_dir),
                max_store_bytes="10MB", **OPTS)
    with pytest.raises(StoreMismatchError, match=r"was extracted from another packed table than --extract-from "
                                                 rf"{other} \(manifest sha256"):
        run_train(TrainConfig.from_flat(**base, extract_from=str(other)))
    with pytest.raises(StoreMismatchError, match="holds bf16 features, --storage-dtype gives fp8"):
        run_train(TrainConfig.from_flat(**base, extract_from=str(packed), storage_dtype="fp8"))
    assert not Path(f"{offline_store}.extract.log").exists() and not (tmp_path / "o").exists()


def test_store_wait_counts_from_the_extraction_logs_last_change(tmp_path):
    """A verifier that loads for longer than the timeout, writing its progress, is waited for; an extraction
    whose log stays silent for the timeout is given up on, naming its log."""
    log = tmp_path / "store.zarr.extract.log"
    log.write_text("loading\n")
    extraction = SimpleNamespace(log_path=log, stopped=lambda: None, tail=lambda: "")
    speaking = threading.Event()

    def talk():
        for _ in range(12):
            time.sleep(0.1)
            with open(log, "a") as f:
                f.write("Loading weights: shard\n")
        speaking.set()

    threading.Thread(target=talk, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(StoreFormatError, match="after 0.5 s with nothing new in the extraction's log; its log: "):
        wait_for_store(str(tmp_path / "store.zarr"), 0.5, extraction)
    assert speaking.is_set() and time.monotonic() - t0 >= 1.2 + 0.5  # waited while it talked, then 0.5 s


def test_a_slow_trainer_is_not_killed_by_the_extractions_timeout(tmp_path, packed, offline_store, tiny_verifier_dir,
                                                                  one_thread, monkeypatch):
    """The issue's case scaled down: a window of 1 block, so the extraction waits on the cursor at every entry,
    which moves once a step; each step takes 4 s against a --stream-timeout-s of 3 s (passed on to the
    extraction). The trainer's heartbeat keeps the extraction waiting: the run trains every step. (Before, the
    extraction gave up after 3 s without a cursor move and the run stopped.)"""
    train_step = Trainer.train_step

    def slow_step(self, batches):
        row = train_step(self, batches)
        time.sleep(4.0)
        return row

    monkeypatch.setattr(Trainer, "train_step", slow_step)
    # the wait for the store while the extraction starts (imports, the verifier) is not this test's
    monkeypatch.setattr(train_run, "wait_for_store", lambda store, _t, extraction: wait_for_store(store, 300, extraction))
    summary = run_train(TrainConfig.from_flat(
        store=str(tmp_path / "stream.zarr"), output=str(tmp_path / "stream"), verifier=str(tiny_verifier_dir),
        max_steps=3, extract_from=str(packed), max_store_bytes=str(_budget(offline_store, window=1)), device="cpu",
        context="window", stream_timeout_s=3, **OPTS))
    assert summary["steps"] == 3 and summary["stream"]["window"] == 1
    log = Path(summary["extraction_log"]).read_text()
    stream = json.loads(log[log.index("{"):])["stream"]
    assert stream["waits"] >= 2 and stream["wait_s"] > 3  # it waited longer than the timeout, and went on


# ------------------------------------------------------------------ a full-context store (--context full)
# 12 synthetic conversations, 5 of them cut into windows of 16 tokens that land in several of the 17 training
# blocks of 32 slots: context blocks shared by training blocks all over an epoch, evicted and extracted again.
FULL_SHAPES = [(10, 3), (40, 3), (70, 4), (14, 0), (30, 0), (12, 2), (20, 0), (9, 0), (25, 3), (16, 0), (45, 2), (11, 0)]
FULL_OPTS = {**OPTS, "val_fraction": 0.2}


def _full_budget(offline: str, units: int, entries: int) -> int:
    """A full-context store's budget for ``units`` context blocks: the offline store's bytes less its context
    blocks' features, plus the plan's order and allowance."""
    store = FeatureStore.open(offline)
    unit = block_feature_bytes(store.contexts.block_size, len(store.layers), store.hidden_size, "bf16")
    total = sum(p.stat().st_size for p in Path(offline).rglob("*") if p.is_file())
    return total - store.contexts.n_blocks * unit + 8 * entries + 8192 + units * unit


@pytest.mark.parametrize("policy, epochs", [("reextract", 2), ("keep", 1),  # ~30 s each on a busy 2-core box
                                            pytest.param("reextract", 1, marks=pytest.mark.slow),
                                            pytest.param("keep", 2, marks=pytest.mark.slow)])
def test_full_context_streaming_weights_equal_offline_weights(tmp_path, packed_full, offline_full, offline_run,
                                                              tiny_verifier_dir, policy, epochs, one_thread):
    offline_store = FeatureStore.open(offline_full)
    n_units = offline_store.contexts.n_blocks
    steps = 13 * epochs  # 13 training blocks (4 held out), one per step
    # the block order (the conversation order, the default on such a store, extracts each context block once:
    # test_full_context_streaming_by_conversation_extracts_each_...), so that reextract's window re-extracts
    opts = {**FULL_OPTS, "epoch_order": "blocks"}
    offline, offline_out = offline_run(offline_full, steps, **opts)  # one run per step count for both policies
    store = tmp_path / "stream.zarr"
    budget = _full_budget(offline_full, 6 if policy == "reextract" else n_units, steps)
    summary = run_train(TrainConfig.from_flat(
        store=str(store), output=str(tmp_path / "stream"), verifier=str(tiny_verifier_dir), max_steps=steps,
        extract_from=str(packed_full), max_store_bytes=str(budget), epoch_policy=policy, context="full",
        device="cpu", **opts))

    a, b = _weights(offline_out), _weights(tmp_path / "stream")
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name
    assert summary["val_loss"] == offline["val_loss"] and offline["steps"] == steps

    opened = FeatureStore.open(store)
    assert opened.attrs["context"] == offline_store.attrs["context"]  # the same plan, packing training_blocks
    assert opened.attrs["context"]["packing"] == "training_blocks"
    plan = StreamSession(opened).read_plan()
    assert plan.reads is not None and plan.record()["format"] == 2 and StreamSession(opened).consumed() == steps
    assert plan.n_entries == steps and len(plan.val_blocks) == 2
    log = Path(summary["extraction_log"]).read_text()
    stream = json.loads(log[log.index("{"):])["stream"]
    assert stream["peak_store_bytes"] <= budget
    read = {u for blk in plan.order.tolist() for u in plan.units_of(blk)} | set(plan.val_units)
    done = set(np.flatnonzero(opened.contexts.done_mask()).tolist())
    if policy == "keep":  # each context block once, all kept
        assert stream["extractions"] == summary["stream"]["planned_extractions"] == len(read)
        assert done == read and stream["evicted"] == 0
    else:  # a window of a few context blocks: shared ones are evicted and extracted again; at the end only the
        # validation blocks' context blocks stay
        assert plan.window < steps and stream["evicted"] > 0 and stream["extractions"] > len(read)
        # the plan's count assumes the extraction as far ahead as the window lets it: the most it can take
        assert stream["extractions"] <= summary["stream"]["planned_extractions"]
        assert done == set(plan.val_units)
        report, failure = verify_output(store)
        assert failure is None and report["state"] == "streaming" and report["ok"]
        assert report["stream"]["contexts"]["pending"] == []
        assert report["stream"]["contexts"]["consumed_blocks"] == len(read - set(plan.val_units))


def test_a_plan_that_extracts_contexts_again_says_so_and_names_the_order_that_does_not(offline_full):
    store = FeatureStore.open(offline_full)
    train, val = split_store(store, FULL_OPTS["seed"], FULL_OPTS["val_fraction"])
    n_tokens = store.contexts.n_tokens_per_block()
    budget = _full_budget(offline_full, 4, 26)  # 2 validation context blocks, a window of 2
    plans = {}
    for order, groups in (("blocks", None), ("conversations", conversation_groups(store))):
        plans[order] = make_plan(store, BlockSequence(train, train, FULL_OPTS["seed"], block_group=groups), val,
                                 max_steps=26, blocks_per_step=1, val_max_blocks=2, max_store_bytes=budget,
                                 policy="reextract", run={"output": "o"})
    val = set(plans["blocks"].val_units)  # extracted once a run: left out of the per-epoch factor

    def per_epoch(plan):  # the training side's context-block tokens extracted, per epoch (2 epochs of 13 entries)
        counts = {u: k for u, k in plan.extraction_counts().items() if u not in val}
        return sum(k * int(n_tokens[u]) for u, k in counts.items()) / sum(int(n_tokens[u]) for u in counts) / 2

    note = rerun_note(StreamSession(store), plans["blocks"], 13, "blocks")
    assert per_epoch(plans["blocks"]) > 1.1
    assert note.startswith(f"this plan runs the verifier over {per_epoch(plans['blocks']):.2f}x the tokens")
    assert "--epoch-order conversations" in note
    # by conversation: each context block once an epoch (a window across the epochs' boundary may spare one)
    assert 0.9 <= per_epoch(plans["conversations"]) <= 1.1
    assert rerun_note(StreamSession(store), plans["conversations"], 13, "conversations") is None


def test_full_context_streaming_by_conversation_extracts_each_context_once_and_trains_the_offline_weights(
        tmp_path, packed_full, offline_full, tiny_verifier_dir, one_thread):
    """--epoch-order conversations (a conversation's windows trained one after another): at the budget of 5
    context blocks (3 beside the validation blocks'), where the block order extracts contexts again (1.9x), each
    is extracted once an epoch, and the weights equal an offline run's with the same order, bit for bit."""
    opts = {**FULL_OPTS, "epoch_order": "conversations"}
    steps = 13
    offline = run_train(TrainConfig.from_flat(store=offline_full, output=str(tmp_path / "offline"),
                                              verifier=str(tiny_verifier_dir), max_steps=steps, **opts))
    budget = _full_budget(offline_full, 5, steps)  # 2 validation context blocks, 3 more
    summary = run_train(TrainConfig.from_flat(
        store=str(tmp_path / "stream.zarr"), output=str(tmp_path / "stream"), verifier=str(tiny_verifier_dir),
        max_steps=steps, extract_from=str(packed_full), max_store_bytes=str(budget), epoch_policy="reextract",
        context="full", device="cpu", **opts))
    a, b = _weights(tmp_path / "offline"), _weights(tmp_path / "stream")
    assert sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert summary["val_loss"] == offline["val_loss"]
    plan = StreamSession(FeatureStore.open(tmp_path / "stream.zarr")).read_plan()
    read = {u for blk in plan.order.tolist() for u in plan.units_of(blk)} | set(plan.val_units)
    log = Path(summary["extraction_log"]).read_text()
    stream = json.loads(log[log.index("{"):])["stream"]
    assert plan.run["epoch_order"] == "conversations" and stream["peak_store_bytes"] <= budget
    assert stream["extractions"] == summary["stream"]["planned_extractions"] == len(read)  # each context once
    assert json.loads((tmp_path / "stream" / "final" / "config.json").read_text())["peagle_training"][
        "epoch_order"] == "conversations"


def test_streaming_defaults_train_the_weights_of_the_offline_defaults(tmp_path, packed_full, offline_full,
                                                                      offline_full_defaults, tiny_verifier_dir,
                                                                      one_thread):
    """Both commands with their defaults: ``peagle-data extract`` then ``peagle-train``, against ``peagle-train
    --extract-from`` (no --context, no --epoch-order): both full context (the served one) and the conversations
    order, so the same weights, bit for bit; the stream extracts each context block once (a budget of 5 context
    blocks). Before, streaming defaulted to --context window: other features, other weights."""
    steps = 13
    offline = run_train(TrainConfig.from_flat(store=offline_full_defaults, output=str(tmp_path / "offline"),
                                              verifier=str(tiny_verifier_dir), max_steps=steps, **FULL_OPTS))
    summary = run_train(TrainConfig.from_flat(
        store=str(tmp_path / "stream.zarr"), output=str(tmp_path / "stream"), verifier=str(tiny_verifier_dir),
        max_steps=steps, extract_from=str(packed_full), max_store_bytes=str(_full_budget(offline_full, 5, steps)),
        device="cpu", **FULL_OPTS))
    a, b = _weights(tmp_path / "offline"), _weights(tmp_path / "stream")
    assert sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert summary["val_loss"] == offline["val_loss"]
    streamed, extracted = FeatureStore.open(tmp_path / "stream.zarr"), FeatureStore.open(offline_full_defaults)
    assert streamed.layout == extracted.layout == "windows"
    for run in ("offline", "stream"):
        assert json.loads((tmp_path / run / "train_config.json").read_text())["data"]["epoch_order"] == "conversations"
    plan = StreamSession(streamed).read_plan()
    read = {u for blk in plan.order.tolist() for u in plan.units_of(blk)} | set(plan.val_units)
    log = Path(summary["extraction_log"]).read_text()
    stream = json.loads(log[log.index("{"):])["stream"]
    assert stream["extractions"] == len(read) and stream["peak_store_bytes"] <= plan.max_store_bytes


def test_a_resumed_run_keeps_the_context_and_order_it_started_with(tmp_path, packed, offline_store, tiny_verifier_dir):
    """A run started when ``--extract-from`` defaulted to ``--context window`` and ``--epoch-order`` to ``blocks``,
    resumed without them: the store's context and the saved order, not the new defaults; a new run onto that store
    is refused before anything starts, naming --context."""
    base = dict(store=offline_store, output=str(tmp_path / "o"), verifier=str(tiny_verifier_dir),
                extract_from=str(packed), max_store_bytes="10MB", **OPTS)
    assert resolve_stream_context(TrainConfig.from_flat(**base, resume=True)).stream.context == "window"
    assert resolve_stream_context(TrainConfig.from_flat(**base)).stream.context == "full"
    with pytest.raises(StoreMismatchError, match="holds --context window features, this run extracts --context full"):
        run_train(TrainConfig.from_flat(**base))
    out = tmp_path / "saved"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "training_state.pt").write_bytes(b"")
    saved = TrainConfig.from_flat(store=offline_store, output=str(out), **OPTS).to_dict()
    del saved["data"]["epoch_order"]  # a run saved before the option
    (out / "train_config.json").write_text(json.dumps(saved))
    windows = SimpleNamespace(has_views=True, segment_keys=lambda: np.zeros((1, 1)))
    resumed = TrainConfig.from_flat(store=offline_store, output=str(out), resume=True, **OPTS)
    assert resolve_epoch_order(resumed, windows).data.epoch_order == "blocks"
    assert resolve_epoch_order(TrainConfig.from_flat(store=offline_store, output=str(tmp_path / "new"), **OPTS),
                               windows).data.epoch_order == "conversations"
    assert resolve_epoch_order(TrainConfig.from_flat(store=offline_store, output=str(tmp_path / "new"), **OPTS),
                               FeatureStore.open(offline_store)).data.epoch_order == "blocks"


def test_dflash_streaming_trains_the_offline_run(tmp_path, packed, offline_store, offline_run, tiny_verifier_dir,
                                                 one_thread):
    """``--method dflash`` streams as P-EAGLE does: on a store extracted while it trains, within a window of 3
    blocks, its loss rows, validation and final weights are the offline run's (the same store extracted first)."""
    opts = {**OPTS, "num_depths": None, "method": "dflash", "block_size": 4}
    offline, offline_out = offline_run(offline_store, 6, **opts)
    budget = _budget(offline_store, window=3)
    summary = run_train(TrainConfig.from_flat(
        store=str(tmp_path / "stream.zarr"), output=str(tmp_path / "stream"), verifier=str(tiny_verifier_dir),
        max_steps=6, extract_from=str(packed), max_store_bytes=str(budget), epoch_policy="reextract", device="cpu",
        context="window", **opts))

    def train_rows(out):
        rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        return [(r["step"], r["loss"], r["acc"], r["blocks"]) for r in rows if r["split"] == "train"]

    assert train_rows(tmp_path / "stream") == train_rows(offline_out) and len(train_rows(offline_out)) == 6
    assert summary["val_loss"] == offline["val_loss"]
    a, b = _weights(offline_out), _weights(tmp_path / "stream")
    assert sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert json.loads((tmp_path / "stream" / "final" / "config.json").read_text())["speculators_model_type"] == "dflash"
    log = Path(summary["extraction_log"]).read_text()
    assert json.loads(log[log.index("{"):])["stream"]["peak_store_bytes"] <= budget
