"""The training loop on a tiny synthetic store and a tiny random verifier (vocab 256, hidden 64)."""

import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from peagle_train.data.loader import epoch_order, split_blocks
from peagle_train.model.checkpoint import load_drafter
from peagle_train.train.config import TrainConfig, depth_weight_values, flat_settings
from peagle_train.train.run import run_train
from peagle_train.train.setup import build_draft_vocab
from stores.errors import InputError, StoreFormatError, StoreMismatchError

H, V, LAYERS, C = 64, 256, [1, 2], 48


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory, make_tiny_llama):
    return make_tiny_llama(tmp_path_factory.mktemp("verifier"), hidden=H, vocab=V)


def _store(path, verifier_dir, n_blocks=1, done=None, seed=0, keys=None):
    """A store of random blocks; block b is arithmetic in b so every block differs. ``keys[b]``: block b's
    segment content keys (default: every segment its own conversation, unique over stores)."""
    from stores.features.feature_store import FeatureStore

    store = FeatureStore.create(
        path, n_blocks=n_blocks, block_size=C, max_segments=3, layers=LAYERS, hidden_size=H, vocab_size=V,
        verifier={"name_or_path": str(verifier_dir), "architecture": "LlamaForCausalLM", "num_hidden_layers": 3,
                  "hidden_size": H, "vocab_size": V, "dtype": "bfloat16"},
        tokenizer={"name_or_path": str(verifier_dir)}, source=f"sha-{os.path.basename(str(path))}")
    g = torch.Generator().manual_seed(seed)
    lens = [[20, 28], [48], [10, 30, 8]]
    n_tokens = []
    for b in range(n_blocks):
        seg = lens[b % 3]
        T = sum(seg)
        ids = torch.randint(0, V, (T,), generator=g)
        mask = torch.cat([torch.cat([torch.zeros(3), torch.ones(n - 3)]) for n in seg]).long()
        pos = torch.cat([torch.arange(n) for n in seg])
        cu = np.cumsum([0, *seg])
        store.write_tokens(b, ids.numpy(), mask.numpy(), pos.numpy(), cu)
        store.write_features(b, torch.randn(T, len(LAYERS), H, generator=g).to(torch.bfloat16),
                             (3 * torch.randn(T, H, generator=g)).to(torch.bfloat16))
        n_tokens.append(T)
        if done is None or b in done:
            store.mark_done(b)
    store.write_all_n_tokens(np.array(n_tokens))
    base = int.from_bytes(os.path.basename(str(path)).encode()[:4].ljust(4, b"\0"), "little") << 20
    store.write_segment_keys(keys if keys is not None else
                             [[base + 4 * b + k for k in range(len(lens[b % 3]))] for b in range(n_blocks)])
    freq = np.arange(V)[::-1].copy()
    freq[3] = 0  # the tiny verifier's pad token (it has no tokenizer): never supervised, the mask token
    store.set_token_freq(freq)
    return str(path)


def _cfg(store, out, **kw):
    base = dict(store=store, output=str(out), num_depths=4, lr=3e-3, warmup_steps=0, val_fraction=0.0,
                max_steps=8, loss_chunk_size=64)
    base.update(kw)
    return TrainConfig.from_flat(**base)


def _rows(out, split="train"):
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["split"] == split]


def test_loss_decreases_on_a_repeated_block(tmp_path, verifier_dir, capsys):
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=1)
    summary = run_train(_cfg(store, tmp_path / "out", max_steps=12, draft_vocab_size=100))
    # stderr is no terminal here, as in a log file: no line per step, one final line (issue 34 item 6)
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("peagle-train")]
    assert len(progress) == 1 and progress[0].startswith("peagle-train: done: 12/12 step in "), progress
    rows = _rows(tmp_path / "out")
    losses = [r["loss"] for r in rows]
    assert len(rows) == 12 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3])
    assert len(rows[0]["acc"]) == 4
    fed = [r["depth_elements"] for r in rows]  # COD feeds each depth fewer elements: r = 0.5, r_min = 0.2
    assert all(len(f) == 4 and f[0] > f[1] > f[2] >= f[3] > 0 for f in fed), fed
    assert summary["last_step_loss"] == losses[-1] and summary["draft_vocab_size"] == 100
    assert summary["last_step"] == 12 and summary["per_depth_accuracy_steps"] == [3, 12]  # the window pooled
    assert "final_loss" not in summary and "per_depth_accuracy" not in summary
    drafter = load_drafter(summary["checkpoint"])
    assert drafter.config.draft_vocab_size == 100 and drafter.config.mask_token_id == 3
    assert (tmp_path / "out" / "training.png").stat().st_size > 0
    assert (tmp_path / "out" / "checkpoint-12" / "training_state.pt").is_file()
    assert not (tmp_path / "out" / "trackers").exists()  # no --report-to: no tracker


def test_freeze_embedding_keeps_the_verifiers_embedding_and_says_so(tmp_path, verifier_dir):
    from transformers import AutoModelForCausalLM

    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    embed = AutoModelForCausalLM.from_pretrained(verifier_dir).get_input_embeddings().weight.detach()
    for flag, out in ((False, tmp_path / "frozen"), (True, tmp_path / "trained")):
        summary = run_train(_cfg(store, out, max_steps=4, train_embedding=flag))
        drafter = load_drafter(summary["checkpoint"])
        changed = (drafter.embed_tokens.weight.float() - embed.float()).abs().max().item()
        assert (changed == 0) is (not flag)
        assert json.loads((out / "final" / "config.json").read_text())["embed_requires_grad"] is flag
    with pytest.raises(InputError, match="--train-embedding: saved False, given True"):  # a resume keeps it
        run_train(_cfg(store, tmp_path / "frozen", max_steps=4, train_embedding=True, resume=True))


def test_resume_of_a_run_saved_before_a_setting_existed(tmp_path, verifier_dir):
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    out = tmp_path / "out"
    run_train(_cfg(store, out, max_steps=4, save_every=2))
    saved = json.loads((out / "train_config.json").read_text())
    del saved["optim"]["train_embedding"]  # as written before --freeze-embedding existed: the default (trained)
    (out / "train_config.json").write_text(json.dumps(saved))
    import shutil

    shutil.rmtree(out / "checkpoint-4")
    shutil.rmtree(out / "final")
    assert run_train(_cfg(store, out, max_steps=4, save_every=2, resume=True))["resumed_from"].endswith("checkpoint-2")


def test_resume_of_a_run_saved_with_a_flat_train_config(tmp_path, verifier_dir):
    """A run saved before TrainConfig was grouped wrote train_config.json (and training_state.pt's
    ``train_config``) flat: it resumes, and a changed setting is still refused by its flag."""
    import shutil

    from cli.train import main

    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    out = tmp_path / "out"
    run_train(_cfg(store, out, max_steps=4, save_every=2))
    flat = {k: v for k, v in _cfg(store, out, max_steps=4, save_every=2).flat().items() if k not in ("resume", "force")}
    flat["drafter_layer"] = "llama"  # the run records the layer it chose (a Llama verifier's default)
    flat["epoch_order"] = "blocks"  # and the order it chose (a window store's default)
    saved = json.loads((out / "train_config.json").read_text())
    assert set(saved) == {"data", "model", "optim", "run", "stream"} and flat_settings(saved) == flat
    (out / "train_config.json").write_text(json.dumps(flat))  # as written before the grouping
    shutil.rmtree(out / "checkpoint-4")
    shutil.rmtree(out / "final")
    with pytest.raises(InputError, match="--lr: saved 0.003, given 0.01"):
        run_train(_cfg(store, out, max_steps=4, save_every=2, lr=1e-2, resume=True))
    res = CliRunner().invoke(main, ["--config", str(out / "train_config.json"), "--resume"])  # the flat file
    assert res.exit_code == 0, res.output
    assert json.loads(res.output[res.output.index("{\n"):])["resumed_from"].endswith("checkpoint-2")
    (out / "train_config.json").unlink()  # the settings training_state.pt holds, flat as well
    state_path = out / "checkpoint-2" / "training_state.pt"
    state = torch.load(state_path, weights_only=False)
    torch.save({**state, "train_config": flat}, state_path)
    shutil.rmtree(out / "checkpoint-4")
    shutil.rmtree(out / "final")
    with pytest.raises(InputError, match="--num-depths: saved 4, given 3"):
        run_train(_cfg(store, out, max_steps=4, save_every=2, num_depths=3, resume=True))
    assert run_train(_cfg(store, out, max_steps=4, save_every=2, resume=True))["resumed_from"].endswith("checkpoint-2")


def test_resume_says_where_it_resumed_and_keeps_one_metrics_row_a_step(tmp_path, verifier_dir, capsys):
    """A killed run logged steps 4 and 5 after its checkpoint-3: the resume names the checkpoint and step on stderr
    and in its summary, removes those rows (it computes the steps again) and the file ends with one row a step."""
    import shutil

    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=5)
    out = tmp_path / "out"
    run_train(_cfg(store, out, max_steps=6, save_every=3, val_fraction=0.2, val_every=2))
    shutil.rmtree(out / "checkpoint-6")
    shutil.rmtree(out / "final")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 5))  # killed at 5
    later = sum(1 for r in rows if 3 < r["step"] <= 5)  # train rows 4, 5 and the validation of step 4
    assert later == 3
    capsys.readouterr()
    summary = run_train(_cfg(store, out, max_steps=6, save_every=3, val_fraction=0.2, val_every=2, resume=True))
    err = capsys.readouterr().err
    assert f"peagle-train: resumed from {out / 'checkpoint-3'} at step 3 of 6; metrics.jsonl: 3 rows after step 3 " \
           "removed (those steps run again)" in err
    assert summary["resumed_from"] == str(out / "checkpoint-3") and summary["resumed_step"] == 3
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in _rows(out, "val")] == [2, 4, 6]
    assert not (out / "metrics.jsonl.tmp").exists()
    fresh = run_train(_cfg(store, tmp_path / "new", max_steps=1, val_fraction=0.2, resume=True))  # nothing saved yet
    assert fresh["resumed_from"] is None and fresh["resumed_step"] is None
    assert f"--resume: no checkpoint in {tmp_path / 'new'} yet; starting at step 0" in capsys.readouterr().err


@pytest.mark.parametrize("checkpointing", [False, True], ids=["same", "resumed-with-gradient-checkpointing"])
def test_resume_continues_exactly(tmp_path, verifier_dir, checkpointing):
    """Also when the resume adds ``--gradient-checkpointing`` (an option that may change on resume: the
    same loss and gradients), which the resumed run records in train_config.json."""
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=5)
    full = tmp_path / "full"
    run_train(_cfg(store, full, max_steps=6, save_every=3, val_fraction=0.2))
    assert json.loads((full / "train_config.json").read_text())["optim"]["gradient_checkpointing"] is False
    part = tmp_path / "part"
    import shutil

    shutil.copytree(full, part)
    shutil.rmtree(part / "checkpoint-6")
    shutil.rmtree(part / "final")
    summary = run_train(_cfg(store, part, max_steps=6, save_every=3, val_fraction=0.2, resume=True,
                             gradient_checkpointing=checkpointing))
    assert summary["resumed_from"].endswith("checkpoint-3")
    saved = json.loads((part / "train_config.json").read_text())
    assert saved["optim"]["gradient_checkpointing"] is checkpointing
    state = torch.load(part / "checkpoint-6" / "training_state.pt", weights_only=False)
    assert flat_settings(state["train_config"])["gradient_checkpointing"] is checkpointing
    a, b = _rows(full), _rows(part)
    assert [r["step"] for r in b] == list(range(1, 7))
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6, abs=1e-7)
        assert x["n_elements"] == y["n_elements"]
    sa, sb = load_drafter(full / "final").state_dict(), load_drafter(part / "final").state_dict()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k])


class _Stopped(Exception):
    """Raised right after a step's checkpoint is saved, as if the run were killed there."""


def _train_until(cfg, stop_step, monkeypatch):
    """``run_train(cfg)`` stopped right after step ``stop_step`` (its checkpoint saved when ``save_every`` says)."""
    from peagle_train.train.trainer import Trainer

    after_step = Trainer._after_step

    def stop(self, row, bar):
        after_step(self, row, bar)
        if self.step == stop_step:
            raise _Stopped

    with monkeypatch.context() as m:
        m.setattr(Trainer, "_after_step", stop)
        with pytest.raises(_Stopped):
            run_train(cfg)


def _documented_sequence(train_side, usable, seed, cursor):
    """docs/design.md §8 restated: entry i of epoch e is ``epoch_order(train side, seed, e)[i]``, at cursor
    ``e * n + i``; entries whose block is not usable are skipped. Yields (cursor, block id)."""
    n = len(train_side)
    while True:
        e, i = divmod(cursor, n)
        b = int(epoch_order(np.asarray(train_side), seed, e)[i])
        if b in set(usable):
            yield cursor, b
        cursor += 1


def grown_run(tmp_path, verifier_dir, monkeypatch, sizes, done):
    """The issue's scenario on stores of ``sizes`` blocks (``done``: the blocks extracted at first): 6 steps
    with --allow-incomplete --val-fraction 0.25 (checkpoint-6), every block extracted, --resume to step 16.
    Checks everything that must hold for one store or several and returns what the caller pins."""
    from itertools import islice

    from peagle_train.evaluate.offline import select_eval_blocks
    from stores.features.feature_store import FeatureStore

    paths = [_store(tmp_path / f"s{j}.zarr", verifier_dir, n_blocks=n, done=set(d), seed=j)
             for j, (n, d) in enumerate(zip(sizes, done))]
    store, out = (paths[0] if len(paths) == 1 else paths), tmp_path / "out"
    kw = dict(max_steps=16, save_every=6, val_fraction=0.25, allow_incomplete=True, num_depths=3)
    _train_until(_cfg(store, out, **kw), 6, monkeypatch)
    before = json.loads((out / "checkpoint-6" / "config.json").read_text())
    for path, n in zip(paths, sizes):  # the extraction finishes
        fs = FeatureStore.open(path, mode="r+")
        for b in range(n):
            fs.mark_done(b)
    summary = run_train(_cfg(store, out, resume=True, **kw))
    assert summary["resumed_from"].endswith("checkpoint-6") and summary["steps"] == 16
    after = json.loads((out / "final" / "config.json").read_text())

    offsets = np.cumsum([0, *sizes])
    sides = [split_blocks(np.arange(n), 0, 0.25) for n in sizes]  # every block id of each store
    train_side = np.concatenate([t + o for (t, _), o in zip(sides, offsets)])
    val_side = np.concatenate([v + o for (_, v), o in zip(sides, offsets)]).tolist()
    done_before = {int(b + o) for d, o in zip(done, offsets) for b in d}
    usable_before = [b for b in train_side.tolist() if b in done_before]
    first = list(islice(_documented_sequence(train_side, usable_before, 0, 0), 6))
    rest = list(islice(_documented_sequence(train_side, train_side.tolist(), 0, first[-1][0] + 1), 10))
    trained = [r["blocks"] for r in _rows(out)]
    assert trained == [[b] for _, b in first + rest]
    assert before["peagle_training"]["val_blocks"] == after["peagle_training"]["val_blocks"] == val_side
    assert not {b for (b,) in trained} & set(val_side)  # no held-out block is ever trained
    n = len(train_side)
    for epoch in range(3):  # never twice in an epoch
        ids = [b for c, b in first + rest if c // n == epoch]
        assert len(ids) == len(set(ids))
    assert rest[-1][0] >= n and set(usable_before) <= {b for c, b in first + rest if c < n}  # each in epoch 0
    val_rows = _rows(out, "val")
    assert [r["step"] for r in val_rows] == [6, 12, 16]  # every --save-every and at the end
    assert [r["blocks"] for r in val_rows] == [[b for b in val_side if b in done_before], val_side, val_side]
    for cfg in (before, after):  # peagle-eval holds out exactly training's validation side, any checkpoint
        for path, o, (_, v) in zip(paths, offsets, sides):
            chosen = select_eval_blocks(FeatureStore.open(path), cfg)
            assert (chosen.ids, chosen.split) == (v.tolist(), "validation")
    return val_side, trained, val_rows


def test_allow_incomplete_then_the_extraction_finishes_then_resume_keeps_split_and_order(tmp_path, verifier_dir,
                                                                                         monkeypatch):
    """Issue 22 item 7: 8 of 16 blocks extracted; the old split moved val [0, 3] to [0, 2, 5, 9]."""
    val_side, trained, val_rows = grown_run(tmp_path, verifier_dir, monkeypatch, (16,), (range(8),))
    assert val_side == [0, 2, 5, 9]  # decided over all 16 ids before any was extracted past 7
    assert [b for (b,) in trained] == [1, 7, 3, 6, 4,  # epoch 0: the 5 extracted train-side blocks
                                       4, 12, 1, 8, 15, 10, 7, 6, 3, 13,  # epoch 1 (11, 14 came after its place)
                                       7]  # epoch 2
    assert [r["blocks"] for r in val_rows] == [[0, 2, 5], [0, 2, 5, 9], [0, 2, 5, 9]]


def test_split_and_shuffle_are_pure_functions_of_the_seed():
    ids = np.arange(10)
    tr, va = split_blocks(ids, 3, 0.2)
    assert len(va) == 2 and sorted([*tr, *va]) == list(range(10))
    assert np.array_equal(split_blocks(ids, 3, 0.2)[1], va)
    assert len(split_blocks(np.arange(2), 0, 0.01)[1]) == 1
    assert np.array_equal(epoch_order(tr, 0, 1), epoch_order(tr, 0, 1))
    assert not np.array_equal(epoch_order(tr, 0, 1), epoch_order(tr, 0, 2))


def test_draft_vocab_takes_most_frequent_ties_by_id():
    freq = np.array([5, 9, 0, 9, 1, 5])
    d2t = build_draft_vocab(freq, 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 3]  # 1 and 3 (9), then 0 over 5 (tie by id)
    assert build_draft_vocab(freq, None) is None


@pytest.mark.parametrize("kw, option", [
    (dict(num_depths=0), "--num-depths"), (dict(down_sample_ratio=0.0), "--down-sample-ratio"),
    (dict(down_sample_ratio_min=1.5), "--down-sample-ratio-min"), (dict(max_anchors=0), "--max-anchors"),
    (dict(max_steps=0), "--max-steps"), (dict(val_fraction=1.0), "--val-fraction"),
    (dict(init_from_sha256="00ff"), "--init-from-sha256 must be given with --init-from"),
    (dict(loss="kl"), "--loss must be one of kl_div, tv, nla, lk_hybrid, ce"),
    (dict(depth_weights="1,1"), "--depth-weights must be 4 numbers, one per depth"),
    (dict(depth_weights="1,-1,1,1"), "--depth-weights must be finite numbers >= 0"),
    (dict(depth_weights="0,0,0,0"), "--depth-weights must be not all zero"),
    (dict(depth_weights="exp:0"), "--depth-weights exp:G must be a rule with G > 0"),
    (dict(depth_weights="one,two"), "--depth-weights must be 4 comma-separated numbers"),
])
def test_bad_config_names_the_option(kw, option):
    with pytest.raises(ValueError, match=option):
        TrainConfig.from_flat(store="s", output="o", **kw)


def test_depth_weights_lists_and_the_exponential_rule():
    assert depth_weight_values(None, 4) is None
    assert depth_weight_values("1, 1, 1.5,2", 4) == (1.0, 1.0, 1.5, 2.0)
    assert depth_weight_values("exp:0.5", 3) == (1.0, 0.5, 0.25)
    assert TrainConfig.from_flat(store="s", output="o", num_depths=2, depth_weights="exp:2").depth_weights == (1.0, 2.0)


def test_loss_and_depth_weights_are_recorded_and_kept_on_resume(tmp_path, verifier_dir):
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    out = tmp_path / "out"
    summary = run_train(_cfg(store, out, max_steps=2, loss="lk_hybrid", depth_weights="exp:0.5"))
    info = json.loads((out / "final" / "config.json").read_text())["peagle_training"]
    assert info["loss"] == "lk_hybrid" and info["depth_weights"] == [1.0, 0.5, 0.25, 0.125]
    assert (info["down_sample_ratio"], info["down_sample_ratio_min"]) == (0.5, 0.2)
    saved = json.loads((out / "train_config.json").read_text())["optim"]
    assert (saved["loss"], saved["depth_weights"]) == ("lk_hybrid", "exp:0.5")
    assert np.isfinite(summary["last_step_loss"])
    with pytest.raises(InputError, match="--loss: saved 'lk_hybrid', given 'kl_div'"):
        run_train(_cfg(store, out, max_steps=2, depth_weights="exp:0.5", resume=True))


def test_bad_stores_fail_before_training(tmp_path, verifier_dir, make_tiny_llama):
    with pytest.raises(StoreFormatError):
        run_train(_cfg(str(tmp_path / "missing.zarr"), tmp_path / "o1"))
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=3, done={0, 2})
    with pytest.raises(StoreFormatError, match="--allow-incomplete"):
        run_train(_cfg(store, tmp_path / "o2"))
    other = make_tiny_llama(tmp_path / "other", vocab=300)
    with pytest.raises(StoreMismatchError, match="vocab_size"):
        run_train(_cfg(store, tmp_path / "o3", verifier=str(other), allow_incomplete=True))
    assert not (tmp_path / "o3").exists()


def test_cli_trains_and_refuses_existing_output(tmp_path, verifier_dir):
    from cli.train import main

    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    args = ["--store", store, "--output", str(tmp_path / "out"), "--max-steps", "2", "--num-depths", "3",
            "--seed", "1"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output[res.output.index("{"):])
    assert summary["steps"] == 2 and len(summary["per_depth_accuracy_last_steps"]) == 3
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2 and "--resume" in res.output
    res = CliRunner().invoke(main, [*args, "--max-anchors", "0"])
    assert res.exit_code == 2 and "--max-anchors" in res.output


def test_same_shape_but_other_verifier_is_refused(tmp_path, verifier_dir):
    from stores.features.feature_store import FeatureStore
    from runtime.model_identity import model_fingerprint, model_identity

    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    fs = FeatureStore.open(store, mode="r+")
    fs.update_attrs(verifier={**fs.attrs["verifier"], "fingerprint": model_fingerprint(verifier_dir),
                              "identity": model_identity(verifier_dir)})
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(verifier_dir)
    torch.manual_seed(123)  # same shape, other weights
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "twin")
    with pytest.raises(StoreMismatchError, match=r"differs in weights \(model.safetensors\)"):
        run_train(_cfg(store, tmp_path / "o", verifier=str(tmp_path / "twin")))
    run_train(_cfg(store, tmp_path / "o2", verifier=str(verifier_dir)))  # the right one trains


# --- --report-to: accelerate trackers fed the metrics.jsonl rows ---------------------------------------


def _hide_modules(monkeypatch, *names):
    """Make ``importlib.util.find_spec`` report ``names`` as not installed (what resolve_trackers asks)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name in names else real(name, *a, **k))


def _scalars(logdir):
    """``{tag: [(step, value), ...]}`` of the TensorBoard event files directly in ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tracker_values_flatten_a_metrics_row():
    from peagle_train.train.metrics import tracker_values

    train = {"split": "train", "step": 3, "loss": 1.5, "acc": [0.5, None, 0.25], "lr": 1e-3, "blocks": [4, 2]}
    assert tracker_values(train) == {"train/loss": 1.5, "train/acc_d0": 0.5, "train/acc_d2": 0.25, "train/lr": 1e-3}
    val = {"split": "val", "step": 3, "val_loss": 2.0, "val_acc": [0.75]}
    assert tracker_values(val) == {"val/loss": 2.0, "val/acc_d0": 0.75}


def test_report_to_tensorboard_logs_the_metrics_jsonl_values(tmp_path, verifier_dir):
    pytest.importorskip("tensorboard", reason="the test extra installs tensorboard: pip install -e '.[test]'")
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=5)
    out = tmp_path / "out"
    run_train(_cfg(store, out, max_steps=4, save_every=2, val_fraction=0.2, report_to="tensorboard"))
    train, val = _rows(out), _rows(out, "val")
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in val] == [2, 4]

    logged = _scalars(out / "trackers" / "peagle")
    f32 = lambda x: float(np.float32(x))  # noqa: E731  TensorBoard stores scalars as float32
    assert logged["train/loss"] == [(r["step"], f32(r["loss"])) for r in train]
    assert logged["train/lr"] == [(r["step"], f32(r["lr"])) for r in train]
    assert logged["train/tokens_per_s"] == [(r["step"], f32(r["tokens_per_s"])) for r in train]
    assert logged["train/grad_norm"] == [(r["step"], f32(r["grad_norm"])) for r in train]
    for d in range(4):
        assert logged[f"train/acc_d{d}"] == [(r["step"], f32(r["acc"][d])) for r in train
                                              if r["acc"][d] is not None]
        assert logged[f"val/acc_d{d}"] == [(r["step"], f32(r["val_acc"][d])) for r in val
                                            if r["val_acc"][d] is not None]
    assert logged["val/loss"] == [(r["step"], f32(r["val_loss"])) for r in val]
    assert not any("blocks" in tag or tag.endswith("/step") for tag in logged)
    hparams = list((out / "trackers" / "peagle").glob("*/hparams.yml"))
    assert len(hparams) == 1 and "report_to: tensorboard" in hparams[0].read_text()
    assert "max_steps: 4" in hparams[0].read_text()


def test_report_to_tensorboard_after_resume_holds_each_step_once(tmp_path, verifier_dir):
    pytest.importorskip("tensorboard", reason="the test extra installs tensorboard: pip install -e '.[test]'")
    import shutil

    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=4)
    full, part = tmp_path / "full", tmp_path / "part"
    kw = dict(max_steps=4, save_every=2, report_to="tensorboard", val_fraction=0.25)
    run_train(_cfg(store, full, **kw))
    shutil.copytree(full, part)  # as if killed after step 4 was logged but before its checkpoint
    shutil.rmtree(part / "checkpoint-4")
    shutil.rmtree(part / "final")
    run_train(_cfg(store, part, **kw, resume=True))
    rows = _rows(part)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # the resumed writer's purge_step hides the killed run's steps 3-4; each step is there once
    assert _scalars(part / "trackers" / "peagle")["train/loss"] == [
        (r["step"], float(np.float32(r["loss"]))) for r in rows]

    # killed before its first checkpoint: --resume starts again at step 1, and hides all old events
    early = tmp_path / "early"
    shutil.copytree(full, early)
    for d in [*early.glob("checkpoint-*"), early / "final"]:
        shutil.rmtree(d)
    run_train(_cfg(store, early, **kw, resume=True))
    assert [s for s, _ in _scalars(early / "trackers" / "peagle")["train/loss"]] == [1, 2, 3, 4]

    # resuming a finished run redoes nothing: one validation row at the last step, the summary's loss
    again = run_train(_cfg(store, full, **kw, resume=True))
    assert again["steps"] == 4 and again["last_step_loss"] == _rows(full)[-1]["loss"]
    assert [r["step"] for r in _rows(full, "val")] == [2, 4]
    assert [s for s, _ in _scalars(full / "trackers" / "peagle")["val/loss"]] == [2, 4]


@pytest.mark.parametrize("value, message", [
    ("tensorbored", "unknown tracker 'tensorbored'"), ("tensorboard,,wandb", "comma-separated"),
    ("", "comma-separated"),
])
def test_report_to_unknown_tracker_is_an_input_error(value, message):
    from stores.errors import InputError

    with pytest.raises(InputError, match=message) as e:
        TrainConfig.from_flat(store="s", output="o", report_to=value)
    assert e.value.field == "--report-to" and "tensorboard, wandb, all" in str(e.value)


def test_report_to_missing_package_fails_before_training(tmp_path, verifier_dir, monkeypatch):
    from peagle_train.train.metrics import resolve_trackers
    from stores.errors import MissingDependencyError

    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    _hide_modules(monkeypatch, "tensorboard")
    with pytest.raises(MissingDependencyError,
                       match=r"needs the 'tensorboard' package: pip install 'tensorboard>=2.14'"):
        run_train(_cfg(store, tmp_path / "o", report_to="tensorboard"))
    assert not (tmp_path / "o").exists()
    _hide_modules(monkeypatch, "tensorboard", "wandb")
    with pytest.raises(MissingDependencyError, match=r"pip install 'tensorboard>=2.14' or pip install 'wandb'"):
        resolve_trackers("all")
    with pytest.raises(MissingDependencyError,
                       match=r"--report-to wandb needs the 'wandb' package: pip install 'wandb'"):
        resolve_trackers("wandb")


def test_report_to_all_means_the_installed_trackers(monkeypatch):
    from peagle_train.train.metrics import resolve_trackers

    _hide_modules(monkeypatch, "wandb")
    assert resolve_trackers("all") == resolve_trackers("tensorboard, all") == ["tensorboard"]
    assert resolve_trackers(None) == []
    from stores.errors import MissingDependencyError

    with pytest.raises(MissingDependencyError, match="--report-to wandb needs"):  # named: not absorbed by all
        resolve_trackers("all,wandb")


def test_cli_report_to(tmp_path, verifier_dir, monkeypatch):
    pytest.importorskip("tensorboard", reason="the test extra installs tensorboard: pip install -e '.[test]'")
    from cli.train import main

    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    args = ["--store", store, "--max-steps", "2", "--num-depths", "2", "--val-fraction", "0"]
    res = CliRunner().invoke(main, [*args, "--output", str(tmp_path / "out"), "--report-to", "tensorboard"])
    assert res.exit_code == 0, res.output
    losses = [(r["step"], float(np.float32(r["loss"]))) for r in _rows(tmp_path / "out")]
    assert _scalars(tmp_path / "out" / "trackers" / "peagle")["train/loss"] == losses and len(losses) == 2

    res = CliRunner().invoke(main, [*args, "--output", str(tmp_path / "o2"), "--report-to", "mlflowx"])
    assert res.exit_code == 2 and "--report-to" in res.output and "mlflowx" in res.output, res.output
    _hide_modules(monkeypatch, "tensorboard")
    res = CliRunner().invoke(main, [*args, "--output", str(tmp_path / "o3"), "--report-to", "tensorboard"])
    assert res.exit_code == 2 and "pip install 'tensorboard>=2.14'" in res.output, res.output
    assert not (tmp_path / "o2").exists() and not (tmp_path / "o3").exists()


def test_report_to_wandb_offline(tmp_path, verifier_dir, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (no extra pulls it in; pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    run_train(_cfg(store, tmp_path / "out", max_steps=2, report_to="wandb"))
    assert len(_rows(tmp_path / "out")) == 2
    runs = list((tmp_path / "out" / "trackers" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_mask_token_is_recorded_and_a_supervised_override_is_refused_before_the_weights(tmp_path, verifier_dir,
                                                                                        monkeypatch):
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=1)
    run_train(_cfg(store, tmp_path / "out", max_steps=1, mask_token_id=255))  # freq[255] == 0
    cfg = json.loads((tmp_path / "out" / "final" / "config.json").read_text())
    assert cfg["mask_token_id"] == 255
    assert cfg["peagle_training"]["mask_token"] == {"id": 255, "token": None, "source": "--mask-token-id"}
    assert load_drafter(tmp_path / "out" / "final").config.mask_token_id == 255

    import runtime.model_cache

    def no_weights(*a, **k):
        raise AssertionError("the verifier weights were loaded before the mask token was checked")

    monkeypatch.setattr(runtime.model_cache, "load_verifier", no_weights)
    from stores.errors import InputError

    with pytest.raises(InputError, match=r"--mask-token-id.*token 5 \(None\) occurs 250 times as a supervised"):
        run_train(_cfg(store, tmp_path / "out2", max_steps=1, mask_token_id=5))  # freq[5] == 250


def test_save_total_limit_keeps_the_newest_checkpoints_and_final_and_resumes(tmp_path, verifier_dir):
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=3)
    out = tmp_path / "out"
    run_train(_cfg(store, out, max_steps=7, save_every=2, save_total_limit=2))
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-6", "checkpoint-7", "final"]
    full = _rows(out)
    import shutil

    shutil.rmtree(out / "checkpoint-7")
    shutil.rmtree(out / "final")
    summary = run_train(_cfg(store, out, max_steps=7, save_every=2, save_total_limit=2, resume=True))
    assert summary["resumed_from"].endswith("checkpoint-6")
    assert [r["loss"] for r in _rows(out)] == pytest.approx([r["loss"] for r in full], rel=1e-6)
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-6", "checkpoint-7", "final"]


@pytest.mark.parametrize("n_blocks, n_val, fraction, warned", [
    (2, 1, 0.05, "holding out 1 of 2 blocks (50%) for validation, more than --val-fraction 0.05 asks"),
    (9, 1, 0.05, "holding out 1 of 9 blocks (11%)"),
    (10, 1, 0.05, None),  # 10% == twice 5%: as asked, within rounding
    (20, 1, 0.05, None),
    (2, 0, 0.0, None),
    (1, 0, 0.05, "no block held out for validation: --val-fraction 0.05 needs a store of two or more blocks, this "
                 "one has 1"),
    (1, 0, 0.0, None),
    (36, 8, 0.25, "holding out 8 of 36 blocks (22.2%) for validation, fewer than the 9 --val-fraction 0.25 asks: "
                  "validation takes whole groups of blocks that share a conversation"),
])
def test_val_split_warning(n_blocks, n_val, fraction, warned):
    from peagle_train.train.setup import val_split_warning

    asked = split_blocks(np.arange(n_blocks), 0, fraction)[1].size
    assert asked == n_val or n_val < asked  # whole groups may hold out fewer
    note = val_split_warning(n_blocks, n_val, fraction, asked)
    assert note is None if warned is None else note.startswith(warned)


def test_two_block_store_says_it_holds_one_out(tmp_path, verifier_dir, capsys):
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    summary = run_train(_cfg(store, tmp_path / "out", max_steps=1, val_fraction=0.05))
    assert summary["train_blocks"] == 1 and summary["val_blocks"] == 1
    assert ("warning: holding out 1 of 2 blocks (50%) for validation, more than --val-fraction 0.05 asks, because "
            "at least one block is held out; train on 1, or pass --val-fraction 0 to train on all 2 (no validation)"
            ) in capsys.readouterr().err


def test_summary_accuracy_pools_elements_over_steps():
    from peagle_train.train.metrics import pooled_accuracy as _pooled_acc

    steps = [{"correct": torch.tensor([9.0, 0.0, 0.0]), "counts": torch.tensor([10.0, 0.0, 0.0])},
             {"correct": torch.tensor([0.0, 1.0, 0.0]), "counts": torch.tensor([1.0, 2.0, 0.0])}]
    assert _pooled_acc(steps) == [9 / 11, 0.5, None]  # a mean of step means would say 0.45 at depth 0
    assert _pooled_acc([]) == []


def test_training_plot_integer_steps_and_readable_small_accuracy(tmp_path, monkeypatch):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from peagle_train.train.metrics import plot_metrics

    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    rows = [{"split": "train", "step": s, "loss": 3 - 0.2 * s, "acc": [0.01 * s, 0.004 * s, None]} for s in (1, 2, 3)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_metrics(tmp_path / "m.jsonl", tmp_path / "t.png")
    loss_ax, acc_ax = figs[0].axes
    for ax in (loss_ax, acc_ax):
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks)
    assert acc_ax.get_ylim() == (0.0, pytest.approx(0.0345))  # 1.15 x the largest accuracy, not 0..1


def test_training_plot_smooths_the_steps_and_shows_validation_along_the_way(tmp_path, monkeypatch):
    # issue 34 item 4: training.png was raw per-step noise with one validation point at the end
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from peagle_train.train.metrics import plot_metrics, rolling_mean

    assert rolling_mean([1.0, 3.0, None, 5.0, float("nan")], 2) == [1.0, 2.0, 3.0, 5.0, 5.0]
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    rows = [{"split": "train", "step": s, "loss": 2.0 + 0.25 * (s % 5), "acc": [0.5, 0.1 * (s % 2)]}
            for s in range(1, 101)]
    rows += [{"split": "val", "step": s, "val_loss": 2.4, "val_acc": [0.4, 0.05]} for s in (50, 100)]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_metrics(tmp_path / "m.jsonl", tmp_path / "t.png")
    loss_ax, acc_ax = figs[0].axes
    raw, mean, val = loss_ax.get_lines()
    assert raw.get_alpha() == 0.25 and mean.get_alpha() is None
    # a period of 5 steps (2, 2.25, ..., 3) averaged over 5 logged steps: flat once the window is full
    assert list(mean.get_ydata())[4:] == pytest.approx([2.5] * 96)
    assert list(val.get_xdata()) == [50, 100] and val.get_label() == "validation (2 points)"
    assert [t.get_text() for t in loss_ax.get_legend().get_texts()] == [
        "train, each step", "train, mean of 5 logged steps", "validation (2 points)"]
    # the accuracy panel says what every line is: colour = depth, style = train (raw, smoothed) or validation
    # (it had one "validation" entry in depth 0's colour for the validation points of every depth)
    legends = [a for a in acc_ax.get_children() if isinstance(a, matplotlib.legend.Legend)]
    assert {lg.get_title().get_text(): [t.get_text() for t in lg.get_texts()] for lg in legends} == {
        "colour": ["depth 0", "depth 1"],
        "line (every depth)": ["train, each step", "train, mean of 5 logged steps", "validation (2 points)"]}
    val_lines = [ln for ln in acc_ax.get_lines() if ln.get_marker() == "o"]
    assert [ln.get_color() for ln in val_lines] == ["C0", "C1"] and not any(
        ln.get_label().startswith("validation") for ln in val_lines)
    assert acc_ax.get_title() == "per-depth accuracy (train: mean of 5 logged steps)"


def test_val_every_validates_along_the_way(tmp_path, verifier_dir):
    from peagle_train.train.config import RunConfig

    assert RunConfig(output="o").val_interval(300) == 50 and RunConfig(output="o").val_interval(2000) == 200
    assert RunConfig(output="o", save_every=6).val_interval(300) == 6
    assert RunConfig(output="o", save_every=6, val_every=4).val_interval(300) == 4
    with pytest.raises(ValueError, match="--val-every"):
        RunConfig(output="o", val_every=0)
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=5)
    run_train(_cfg(store, tmp_path / "out", max_steps=7, val_every=3, val_fraction=0.2))
    assert [r["step"] for r in _rows(tmp_path / "out", "val")] == [3, 6, 7]
    assert not list((tmp_path / "out").glob("checkpoint-[36]"))  # validation does not save


def test_every_saved_drafter_records_the_hashes_of_its_training_segments(tmp_path, verifier_dir):
    """``training_segments.npy`` in each checkpoint and final/: the segments of every block outside the validation
    side (what peagle-eval --store counts a judge set's conversations against)."""
    from peagle_train.data.segment_hashes import store_segment_hashes
    from peagle_train.model.checkpoint import read_training_segments
    from stores.features.feature_store import FeatureStore

    a = _store(tmp_path / "a.zarr", verifier_dir, n_blocks=3)
    b = _store(tmp_path / "b.zarr", verifier_dir, n_blocks=3, seed=1)
    run_train(_cfg([a, b], tmp_path / "out", max_steps=2, val_fraction=0.3, save_every=1))
    val = json.loads((tmp_path / "out" / "final" / "config.json").read_text())["peagle_training"]["val_blocks"]
    want = np.unique(np.concatenate([store_segment_hashes(FeatureStore.open(s), [k for k in range(3) if k + first
                                                                                 not in val])
                                     for s, first in ((a, 0), (b, 3))]))
    held = sum((2, 1, 3)[v % 3] for v in val)  # segments of the held-out blocks (blocks of 2, 1 and 3 segments)
    assert len(val) == 2 and want.size == 12 - held
    for saved in ("final", "checkpoint-1", "checkpoint-2"):
        assert read_training_segments(tmp_path / "out" / saved).tolist() == want.tolist(), saved


def test_offline_eval_finds_the_held_out_blocks_of_each_training_store_and_names_other_stores(tmp_path,
                                                                                               verifier_dir):
    """config.json records each training store's identity; evaluation labels "validation" only the held-out
    blocks of that very store (global ids mapped back), and scores any other store whole as "other_store"."""
    from peagle_train.evaluate.offline import select_eval_blocks
    from peagle_train.data.multistore import store_identity
    from stores.features.feature_store import FeatureStore

    a, b = _store(tmp_path / "a.zarr", verifier_dir, n_blocks=3), _store(tmp_path / "b.zarr", verifier_dir, n_blocks=3)
    run_train(_cfg([a, b], tmp_path / "out", max_steps=1, val_fraction=0.3))
    cfg = json.loads((tmp_path / "out" / "final" / "config.json").read_text())
    rec = cfg["peagle_training"]
    assert [s["path"] for s in rec["stores"]] == [str((tmp_path / "a.zarr").resolve()), str((tmp_path / "b.zarr").resolve())]
    assert [s["first_block"] for s in rec["stores"]] == [0, 3]
    assert rec["stores"][1] == {"path": str((tmp_path / "b.zarr").resolve()), "source": "sha-b.zarr", "shard": [0, 1],
                                "n_blocks": 3, "layers": LAYERS, "verifier_fingerprint": None, "context": "window",
                                "first_block": 3}
    val = rec["val_blocks"]
    assert len(val) == 2 and sum(v < 3 for v in val) == 1  # one held out per store
    fb = FeatureStore.open(b)
    assert {k: rec["stores"][1][k] for k in store_identity(fb)} == store_identity(fb)
    chosen = select_eval_blocks(fb, cfg)
    assert (chosen.ids, chosen.split, chosen.warnings) == ([v - 3 for v in val if v >= 3], "validation", [])

    other = FeatureStore.open(_store(tmp_path / "fmix.zarr", verifier_dir, n_blocks=7, done={0, 2, 5}))
    chosen = select_eval_blocks(other, cfg)
    assert (chosen.ids, chosen.split, chosen.blocks_done, chosen.blocks_total) == ([0, 2, 5], "other_store", 3, 7)
    assert chosen.warnings == [
        f"{other.path} is an incomplete store: 3 of 7 blocks extracted; only those are scored",
        f"{other.path} is not a store this drafter was trained on (it was trained on {rec['stores'][0]['path']}, "
        f"{rec['stores'][1]['path']}; another packed table, shard, verifier or layer set): every done block is "
        "scored as split 'other_store', none of them is held-out validation data"]


def test_cli_resume_with_other_settings_says_the_working_command_and_why_max_steps_is_fixed(tmp_path, verifier_dir):
    from cli.train import main

    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=2)
    out = tmp_path / "drafter"
    args = ["--store", store, "--output", str(out), "--num-depths", "3", "--lr", "0.003", "--val-fraction", "0",
            "--loss-chunk-size", "64"]
    assert CliRunner().invoke(main, [*args, "--max-steps", "5", "--save-every", "2"]).exit_code == 0
    res = CliRunner().invoke(main, [*args, "--max-steps", "8", "--resume"])
    saved = out / "train_config.json"
    assert res.exit_code == 2
    assert " ".join(res.stderr.split()) == " ".join((
        f"Error: field '--resume': --resume continues the run saved in {out} with its own settings, and these "
        f"differ from it: --max-steps: saved 5, given 8. Resume it with: peagle-train --config {saved} --resume "
        "(adding only options that may change on resume: --val-max-blocks, --allow-incomplete, --attention-backend, "
        "--loss-chunk-size, --gradient-checkpointing, --save-every, --save-total-limit, --log-every, --val-every, --report-to, --max-store-bytes, --epoch-policy, --extract-from, --layers, --engine, "
        "--context, --device, --storage-dtype, --stream-timeout-s, --grad-accum (keeping "
        "--grad-accum × processes)). --max-steps cannot "
        "change on resume: it is the length of the cosine learning-rate schedule, so the resumed run would no "
        "longer be the saved run continued; to train longer, start a new run (a new --output, or --force)").split())
    import shutil

    shutil.rmtree(out / "final"), shutil.rmtree(out / "checkpoint-5")  # as if stopped after checkpoint-4
    res = CliRunner().invoke(main, ["--config", str(saved), "--resume", "--log-every", "1"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["steps"] == 5 and summary["resumed_from"].endswith("checkpoint-4")


@pytest.mark.parametrize("family, given, want", [("qwen3", None, "qwen3"), ("qwen3", "llama", "llama"),
                                                 ("qwen3_moe", None, "qwen3"), ("mistral", None, "llama"),
                                                 ("llama", None, "llama"), ("llama", "qwen3", "qwen3")])
def test_the_drafter_layer_is_the_verifiers_family_unless_given_and_is_recorded(tmp_path, verifier_dir, family,
                                                                                given, want):
    """Without --drafter-layer a Qwen3 verifier gets a qwen3 drafter layer, a Llama one a llama layer; the run
    records the layer in train_config.json and the checkpoint, and a --resume keeps it."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from families import save_family

    verifier = verifier_dir if family == "llama" else save_family(family, tmp_path / family, vocab_size=V)
    store = _store(tmp_path / "s.zarr", verifier, n_blocks=2)
    out = tmp_path / "out"
    run_train(_cfg(store, out, max_steps=2, save_every=1, mask_token_id=3, drafter_layer=given))
    assert json.loads((out / "train_config.json").read_text())["model"]["drafter_layer"] == want
    final = json.loads((out / "final" / "config.json").read_text())
    assert final["transformer_layer_config"]["model_type"] == want
    assert load_drafter(out / "final").config.layer_type == want
    if given is None:
        other = {"llama": "qwen3", "qwen3": "llama"}[want]
        with pytest.raises(InputError, match=f"--drafter-layer: saved '{want}', given '{other}'"):
            run_train(_cfg(store, out, max_steps=2, save_every=1, mask_token_id=3, drafter_layer=other, resume=True))


def test_a_qwen3_drafter_trains_alike_on_the_sdpa_and_split_backends(tmp_path, verifier_dir):
    """Four steps of a 2-layer qwen3 drafter: the same blocks and elements and, step by step, the same loss on
    both CPU backends (flex trains on CUDA only: tests/peagle_train/model/test_flex_attention.py)."""
    store = _store(tmp_path / "s.zarr", verifier_dir, n_blocks=3)
    rows = {}
    for backend in ("sdpa", "split"):
        run_train(_cfg(store, tmp_path / backend, max_steps=4, attention_backend=backend, drafter_layer="qwen3",
                       num_layers=2))
        rows[backend] = _rows(tmp_path / backend)
        assert load_drafter(tmp_path / backend / "final").config.layer_type == "qwen3"
    a, b = rows["sdpa"], rows["split"]
    assert [r["blocks"] for r in a] == [r["blocks"] for r in b] and len(a) == 4
    assert [r["n_elements"] for r in a] == [r["n_elements"] for r in b]
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), (x["step"], x["loss"], y["loss"])
    assert a[-1]["loss"] != a[0]["loss"]
