"""``peagle-train`` as a process: SIGKILL in epoch 2 then ``--resume``; two data-parallel CPU ranks;
bad input refused before any training. Tiny store (blocks of 48 tokens, hidden 64, vocab 256)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from peagle_train.train.config import TrainConfig
from peagle_train.train.run import run_train
from stores.errors import InputError
from tests.processes import launch_two_ranks

REPO = Path(__file__).resolve().parents[3]
H, V, LAYERS, C = 64, 256, [1, 2], 48


@pytest.fixture(scope="module")
def verifier_dir(tmp_path_factory, make_tiny_llama):
    return make_tiny_llama(tmp_path_factory.mktemp("verifier"), hidden=H, vocab=V)


def _store(path, verifier_dir, n_blocks, done=None):
    """Block b: random tokens and features from seed b; segments of 20 + 28 tokens, 3 unsupervised each."""
    from stores.features.feature_store import FeatureStore

    store = FeatureStore.create(
        path, n_blocks=n_blocks, block_size=C, max_segments=2, layers=LAYERS, hidden_size=H, vocab_size=V,
        verifier={"name_or_path": str(verifier_dir), "architecture": "LlamaForCausalLM", "num_hidden_layers": 3,
                  "hidden_size": H, "vocab_size": V, "dtype": "bfloat16"},
        tokenizer={"name_or_path": str(verifier_dir)}, source="sha")
    mask = np.array([0, 0, 0] + [1] * 17 + [0, 0, 0] + [1] * 25, dtype=np.uint8)
    pos = np.concatenate([np.arange(20), np.arange(28)])
    for b in range(n_blocks):
        g = torch.Generator().manual_seed(b)
        store.write_tokens(b, torch.randint(0, V, (C,), generator=g).numpy(), mask, pos, np.array([0, 20, 48]))
        store.write_features(b, torch.randn(C, len(LAYERS), H, generator=g).to(torch.bfloat16),
                             (3 * torch.randn(C, H, generator=g)).to(torch.bfloat16))
        if done is None or b in done:
            store.mark_done(b)
    store.write_all_n_tokens(np.full(n_blocks, C))
    freq = np.arange(V)[::-1].copy()
    freq[3] = 0  # the tiny verifier's pad token (it has no tokenizer): never supervised, the mask token
    store.set_token_freq(freq)
    return str(path)


def _rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by SIGKILL
            pass
    return [r for r in rows if r.get("split") == "train"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


N_BLOCKS, EPOCH, STEPS, KILL_AT = 6, 6, 15, 10  # val_fraction 0: epoch 2 is steps 7..12
OPTS = dict(num_depths=3, lr=3e-3, warmup_steps=2, val_fraction=0.0, max_steps=STEPS, save_every=3,
            loss_chunk_size=32, seed=7)

# `python -m cli.train ARGS`, except that the process SIGKILLs itself right after writing the metrics
# line of step KILL_AT (a deterministic point in epoch 2, between checkpoint-9 and checkpoint-12)
KILLED_CLI = f"""
import os, signal, sys
import peagle_train.train.metrics as m
write = m.write_metrics
def write_then_die(path, rows):
    write(path, rows)
    if any(r.get("step") == {KILL_AT} for r in rows):
        os.kill(os.getpid(), signal.SIGKILL)
m.write_metrics = write_then_die
from cli.train import main
sys.argv[0] = "peagle-train"
main()
"""


def _args(store, out, **extra) -> list[str]:
    opts = {**OPTS, **extra}
    args = ["--store", store, "--output", str(out)]
    for k, v in opts.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def test_sigkill_in_epoch_2_then_resume_equals_an_uninterrupted_run(tmp_path, verifier_dir):
    store = _store(tmp_path / "s.zarr", verifier_dir, N_BLOCKS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_train(TrainConfig.from_flat(store=store, output=str(tmp_path / "full"), **OPTS))
    finally:
        torch.set_num_threads(threads)
    full = _rows(tmp_path / "full")

    out = tmp_path / "killed"
    res = subprocess.run([sys.executable, "-c", KILLED_CLI, *_args(store, out)], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == -signal.SIGKILL, res.stderr[-2000:]
    assert _rows(out)[-1]["step"] == KILL_AT and not (out / "final").exists()
    assert (out / "checkpoint-9").is_dir() and not (out / "checkpoint-12").exists()

    res = subprocess.run([sys.executable, "-m", "cli.train", *_args(store, out), "--resume"], cwd=REPO,
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["resumed_from"].endswith("checkpoint-9") and summary["steps"] == STEPS
    again = _rows(out)
    assert [r["step"] for r in again] == list(range(1, STEPS + 1))
    assert [r["blocks"] for r in again] == [r["blocks"] for r in full]  # the same blocks in the same order
    assert sorted(b for r in full[:EPOCH] for b in r["blocks"]) == list(range(N_BLOCKS))  # each once per epoch
    assert [r["blocks"] for r in full[:EPOCH]] != [r["blocks"] for r in full[EPOCH:2 * EPOCH]]  # reshuffled
    assert [r["n_elements"] for r in again] == [r["n_elements"] for r in full]  # the same COD samples
    np.testing.assert_allclose([r["loss"] for r in again], [r["loss"] for r in full], rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # two ranks each import transformers and torch.distributed: ~45 s on the shared 2-core CI box
def test_two_data_parallel_cpu_ranks(tmp_path, verifier_dir):
    store = _store(tmp_path / "s.zarr", verifier_dir, 8)
    out = tmp_path / "ddp"
    res = launch_two_ranks(_args(store, out, max_steps=4, save_every=2), _env(), REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["steps"] == 4 and summary["train_blocks"] == 8
    assert (summary["rank"], summary["world_size"]) == (0, 2)  # one summary, from rank 0 of two
    rows = _rows(out)
    # blocks gathered rank-major each step: rank r reads flat index 2 * step + r of the epoch order
    from peagle_train.data.loader import epoch_order

    order = epoch_order(np.arange(8), OPTS["seed"], 0).tolist()
    assert [r["blocks"] for r in rows] == [order[2 * s:2 * s + 2] for s in range(4)]  # rank 1 did its half
    from peagle_train.model.checkpoint import load_drafter

    assert load_drafter(out / "final").config.num_depths == 3
    # one process with --grad-accum 2 reads the same blocks (flat indices 2s, 2s+1) with the same COD
    # seeds; the pooled objective makes its steps those of the two ranks
    one = run_train(TrainConfig.from_flat(store=store, output=str(tmp_path / "one"), **{**OPTS, "max_steps": 4,
                                                                               "save_every": 2, "grad_accum": 2}))
    assert one["world_size"] == 1
    single = _rows(tmp_path / "one")
    assert [r["blocks"] for r in single] == [r["blocks"] for r in rows]
    assert [r["weight"] for r in single] == [r["weight"] for r in rows]
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in single], rtol=1e-5)
    a, b = load_drafter(out / "final").state_dict(), load_drafter(tmp_path / "one" / "final").state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)


def _stopped_at(full: Path, dest: Path, step: int) -> Path:
    """A copy of the run ``full`` as if it had been killed right after ``checkpoint-<step>``."""
    import shutil

    shutil.copytree(full, dest)
    for d in dest.glob("checkpoint-*"):
        if int(d.name.split("-")[1]) > step:
            shutil.rmtree(d)
    shutil.rmtree(dest / "final")
    return dest


@pytest.mark.slow  # one two-rank launch (~45 s on the shared 2-core CI box)
def test_resume_on_another_number_of_ranks_trains_exactly_the_uninterrupted_epoch(tmp_path, verifier_dir):
    """Issue 22 item 6: 16 blocks, 2 per optimizer step. One process (--grad-accum 2) to step 4, resumed on
    two gloo ranks (--grad-accum 1) to step 8; that run's checkpoint-6 (two ranks) resumed on one process.
    Each trains the 16 blocks of the epoch in the uninterrupted run's order, each once, with its losses; a
    resume that would change the blocks of a step is refused naming both world sizes."""
    from peagle_train.model.checkpoint import load_drafter
    from peagle_train.data.loader import epoch_order

    store = _store(tmp_path / "s.zarr", verifier_dir, 16)
    opts = {**OPTS, "max_steps": 8, "save_every": 2}
    ref = run_train(TrainConfig.from_flat(store=store, output=str(tmp_path / "ref"), grad_accum=2, **opts))
    assert (ref["world_size"], ref["steps"]) == (1, 8)
    full = _rows(tmp_path / "ref")
    epoch = epoch_order(np.arange(16), OPTS["seed"], 0).tolist()
    assert [r["blocks"] for r in full] == [epoch[2 * s:2 * s + 2] for s in range(8)]  # the whole epoch, each once

    def same_run(out: Path) -> None:
        rows = _rows(out)
        assert [r["step"] for r in rows] == list(range(1, 9))
        assert [r["blocks"] for r in rows] == [r["blocks"] for r in full]  # none skipped, none repeated
        assert [b for r in rows for b in r["blocks"]] == epoch
        assert [r["n_elements"] for r in rows] == [r["n_elements"] for r in full]  # the same COD samples
        assert [r["weight"] for r in rows] == [r["weight"] for r in full]
        np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in full], rtol=1e-5, atol=1e-7)
        a, b = load_drafter(tmp_path / "ref" / "final").state_dict(), load_drafter(out / "final").state_dict()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6, msg=k)

    # 1 -> 2: two ranks of one block each continue the one-process run of two blocks per step
    two = _stopped_at(tmp_path / "ref", tmp_path / "two", 4)
    res = launch_two_ranks([*_args(store, two, **{**opts, "grad_accum": 1}), "--resume"], _env(), REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["resumed_from"].endswith("checkpoint-4") and (summary["world_size"], summary["steps"]) == (2, 8)
    same_run(two)
    state = torch.load(two / "checkpoint-6" / "training_state.pt", weights_only=False)["data"]
    assert {k: state[k] for k in ("cursor", "blocks_per_step", "world_size", "grad_accum")} == {
        "cursor": 12, "blocks_per_step": 2, "world_size": 2, "grad_accum": 1}

    # 2 -> 1: the two-rank checkpoint-6 on one process; one block per step would be another run: refused
    one = _stopped_at(two, tmp_path / "one", 6)
    with pytest.raises(InputError) as refused:
        run_train(TrainConfig.from_flat(store=store, output=str(one), grad_accum=1, resume=True, **opts))
    assert str(refused.value) == (
        f"field '--grad-accum': {one / 'checkpoint-6'} was trained on 2 process(es) with --grad-accum 1, 2 block(s) "
        "per optimizer step; this launch has 1 process(es) with --grad-accum 1, 1 per step: every step would pool "
        "other blocks, and the run would not be the saved one continued; resume with --grad-accum 2 on these 1 "
        "process(es), or on 2 with --grad-accum 1")
    assert [r["step"] for r in _rows(one)] == list(range(1, 9))  # refused before anything was written
    resumed = run_train(TrainConfig.from_flat(store=store, output=str(one), grad_accum=2, resume=True, **opts))
    assert resumed["resumed_from"].endswith("checkpoint-6") and resumed["world_size"] == 1
    same_run(one)


@pytest.mark.parametrize("option, value", [
    ("--max-steps", "0"), ("--num-depths", "0"), ("--max-anchors", "0"), ("--down-sample-ratio", "0"),
    ("--down-sample-ratio-min", "1.5"), ("--draft-vocab-size", "0"), ("--save-every", "0"),
    ("--grad-accum", "0"), ("--loss-chunk-size", "0"), ("--num-layers", "0"), ("--grad-clip", "0"),
])
def test_zero_or_out_of_range_options_are_refused_not_defaulted(tmp_path, option, value):
    from cli.train import main

    res = CliRunner().invoke(main, ["--store", str(tmp_path / "none.zarr"), "--output", str(tmp_path / "o"),
                                    option, value])
    assert res.exit_code == 2 and option in res.output, res.output
    assert not (tmp_path / "o").exists()


def test_bad_stores_and_verifiers_fail_before_training(tmp_path, verifier_dir, make_tiny_llama):
    from cli.train import main

    def run(store, out, *extra):
        res = CliRunner().invoke(main, ["--store", store, "--output", str(tmp_path / out), *extra])
        assert res.exit_code == 2, res.output
        assert not (tmp_path / out).exists() or not (tmp_path / out / "metrics.jsonl").exists()
        return res.output

    assert "no feature store" in run(str(tmp_path / "missing.zarr"), "o1")
    store = _store(tmp_path / "s.zarr", verifier_dir, 3, done={0, 2})
    assert "--allow-incomplete" in run(store, "o2")
    narrow = make_tiny_llama(tmp_path / "narrow", hidden=32)
    assert "hidden_size 32" in run(store, "o3", "--allow-incomplete", "--verifier", str(narrow))
    wide = make_tiny_llama(tmp_path / "wide", vocab=300)
    assert "vocab_size 300" in run(store, "o4", "--allow-incomplete", "--verifier", str(wide))
