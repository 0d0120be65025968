"""A streaming run (``peagle-train --extract-from --max-store-bytes``) killed with SIGKILL, then the same command
with ``--resume``: the final weights equal an offline run's, bit for bit. The trainer killed after a step (its
extraction dies with it), the extraction killed while the trainer waits on it (the trainer stops naming the
extraction's log). Slow: several processes that each load torch."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peagle_train.train.config import TrainConfig
from peagle_train.train.run import run_train
from stores.errors import InputError
from stores.features.feature_store import FeatureStore
from stores.stream.session import StreamSession
from tests.peagle_train.train.test_stream import FULL_OPTS, OPTS, _budget, _full_budget, _weights

REPO = Path(__file__).resolve().parents[3]
STEPS = 12  # two epochs of 6 training blocks
pytestmark = pytest.mark.slow

# `python -m cli.train ARGS`, except that the process SIGKILLs itself right after the metrics line of step KILL_AT
KILLED_CLI = """
import os, signal, sys
import peagle_train.train.metrics as m
write = m.write_metrics
def write_then_die(path, rows):
    write(path, rows)
    if any(r.get("step") == int(os.environ["KILL_AT"]) for r in rows):
        os.kill(os.getpid(), signal.SIGKILL)
m.write_metrics = write_then_die
from cli.train import main
sys.argv[0] = "peagle-train"
main()
"""


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}  # the threads of the offline store's extraction


def _args(store: Path, out: Path, packed_dir: Path, verifier: Path, budget: int, policy: str) -> list[str]:
    args = ["--store", str(store), "--output", str(out), "--verifier", str(verifier), "--extract-from",
            str(packed_dir), "--max-store-bytes", str(budget), "--epoch-policy", policy, "--device", "cpu",
            "--context", "window",
            "--max-steps", str(STEPS), "--save-every", "3"]  # keep saves only these; reextract also for the stream
    for k, v in OPTS.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def _offline(tmp_path: Path, offline_store: str, verifier: Path) -> dict:
    """The offline run, in a process like the streaming one."""
    out = tmp_path / "offline"
    args = ["--store", offline_store, "--output", str(out), "--verifier", str(verifier), "--max-steps", str(STEPS)]
    for k, v in OPTS.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    res = subprocess.run([sys.executable, "-m", "cli.train", *args], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return _weights(out)


@pytest.fixture(scope="module")
def offline_weights(tmp_path_factory, offline_store, tiny_verifier_dir) -> dict:
    """The offline run of STEPS steps (in a process like the streaming ones), trained once: the weights every
    killed-then-resumed window-context run must end with."""
    return _offline(tmp_path_factory.mktemp("offline_process"), offline_store, tiny_verifier_dir)


def _assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].tobytes() == b[name].tobytes(), name


def _extraction_pids(store: Path) -> list[int]:
    """Pids of the extraction processes of ``store`` (started by this test's runs: the store path is unique)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"cli.data_extract" in cmd and b"--stream" in cmd and str(store).encode() in cmd:
            pids.append(int(d.name))
    return pids


# the two policies crossed with the two kill points (after checkpoint-3; in epoch 2 after checkpoint-6), not the
# full 2 x 2 grid: each policy and each point once, epoch 2 under re-extraction (two processes a case)
@pytest.mark.parametrize("policy, kill_at", [("keep", 4), ("reextract", 7)])
def test_trainer_killed_then_resumed_equals_offline(tmp_path, packed, offline_store, offline_weights, tiny_verifier_dir,
                                                    policy, kill_at):
    store, out = tmp_path / "stream.zarr", tmp_path / "stream"
    args = _args(store, out, packed, tiny_verifier_dir, _budget(offline_store, window=3 if policy == "reextract" else 6),
                 policy)
    res = subprocess.run([sys.executable, "-c", KILLED_CLI, *args], cwd=REPO, env=_env(KILL_AT=str(kill_at)),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    deadline = time.monotonic() + 30
    while _extraction_pids(store) and time.monotonic() < deadline:  # it dies with its parent (PR_SET_PDEATHSIG)
        time.sleep(0.2)
    assert not _extraction_pids(store)
    res = subprocess.run([sys.executable, "-m", "cli.train", *args, "--resume"], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout[res.stdout.index("{"):])
    assert summary["resumed_from"] is not None and summary["steps"] == STEPS
    _assert_same(offline_weights, _weights(out))
    assert StreamSession(FeatureStore.open(store)).consumed() == STEPS


def test_extraction_killed_then_resumed_equals_offline(tmp_path, packed, offline_store, offline_weights,
                                                       tiny_verifier_dir):
    store, out = tmp_path / "stream.zarr", tmp_path / "stream"
    args = _args(store, out, packed, tiny_verifier_dir, _budget(offline_store, window=3), "reextract")
    proc = subprocess.Popen([sys.executable, "-m", "cli.train", *args], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # kill it once the trainer has consumed a few entries
            cursor = store / "stream" / "consumed.json"
            if cursor.is_file() and StreamSession(FeatureStore.open(store)).consumed() >= 2:
                break
            time.sleep(0.1)
        pids = _extraction_pids(store)
        assert len(pids) == 1
        os.kill(pids[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode not in (0, None), err[-3000:]
    assert "extraction" in err and f"{store}.extract.log" in err  # the trainer names the extraction's log
    res = subprocess.run([sys.executable, "-m", "cli.train", *args, "--resume"], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    _assert_same(offline_weights, _weights(out))


def test_a_resume_keeps_the_plan_and_refuses_another(tmp_path, packed, offline_store, tiny_verifier_dir, one_thread):
    """A finished streaming run resumed with another policy is refused before the weights load."""
    store, out = tmp_path / "stream.zarr", tmp_path / "stream"
    budget = str(_budget(offline_store, window=6))
    cfg = dict(store=str(store), output=str(out), verifier=str(tiny_verifier_dir), max_steps=2, extract_from=str(packed),
               max_store_bytes=budget, device="cpu", context="window", **OPTS)
    run_train(TrainConfig.from_flat(**cfg))
    with pytest.raises(InputError, match="epoch_policy|stream plan is not this run's"):
        run_train(TrainConfig.from_flat(**{**cfg, "epoch_policy": "keep"}, resume=True))


def test_a_resume_onto_a_store_without_its_plan_starts_at_the_checkpoint(tmp_path, packed, offline_store,
                                                                         tiny_verifier_dir, one_thread):
    """``--resume`` of a run whose store lost its plan (deleted and extracted again, or killed while the plan was
    rewritten): the new plan's consumed cursor is the checkpoint's, so the extraction writes the entries the
    trainer reads next. It once restarted at 0: the extraction filled the window with entries already trained
    and waited for the trainer, which waited for its next block, until both timed out."""
    store, out = tmp_path / "stream.zarr", tmp_path / "stream"
    cfg = dict(store=str(store), output=str(out), verifier=str(tiny_verifier_dir), max_steps=6, save_every=3,
               extract_from=str(packed), max_store_bytes=str(_budget(offline_store, window=3)), device="cpu",
               stream_timeout_s=120, context="window", **OPTS)  # the regression: both waited until timed out
    # (120 s: the extraction child says nothing while it imports, which took over 20 s in a loaded CI run)
    run_train(TrainConfig.from_flat(**cfg))
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoint-6")  # latest: checkpoint-3, cursor 3, a whole window past entry 0
    shutil.rmtree(store)
    Path(f"{store}.extract.log").unlink()
    summary = run_train(TrainConfig.from_flat(**cfg, resume=True))
    assert summary["resumed_step"] == 3 and summary["steps"] == 6
    run_train(TrainConfig.from_flat(store=offline_store, output=str(tmp_path / "offline"),
                                    verifier=str(tiny_verifier_dir), max_steps=6, **OPTS))
    _assert_same(_weights(tmp_path / "offline"), _weights(out))
    assert StreamSession(FeatureStore.open(store)).consumed() == 6
    log = Path(summary["extraction_log"]).read_text()
    assert json.loads(log[log.index("{"):])["stream"]["extractions"] == 2 + 3  # the validation blocks, entries 3..5


def test_full_context_trainer_killed_then_resumed_equals_offline(tmp_path, packed_full, offline_full,
                                                                 tiny_verifier_dir):
    """--context full, reextract, a window of a few context blocks: killed after step 9 of 2 epochs of 13 (context
    blocks evicted and some extracted again by then), resumed: the offline run's weights."""
    steps = 26
    store, out = tmp_path / "stream.zarr", tmp_path / "stream"
    args = ["--store", str(store), "--output", str(out), "--verifier", str(tiny_verifier_dir), "--extract-from",
            str(packed_full), "--max-store-bytes", str(_full_budget(offline_full, 6, steps)), "--context", "full",
            "--device", "cpu", "--max-steps", str(steps), "--save-every", "4"]
    offline_args = ["--store", offline_full, "--output", str(tmp_path / "offline"), "--verifier",
                    str(tiny_verifier_dir), "--max-steps", str(steps)]
    for k, v in FULL_OPTS.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
        offline_args += [f"--{k.replace('_', '-')}", str(v)]
    res = subprocess.run([sys.executable, "-c", KILLED_CLI, *args], cwd=REPO, env=_env(KILL_AT="9"),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == -signal.SIGKILL, res.stderr[-3000:]
    deadline = time.monotonic() + 30
    while _extraction_pids(store) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _extraction_pids(store)
    res = subprocess.run([sys.executable, "-m", "cli.train", *args, "--resume"], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout[res.stdout.index("{"):])["resumed_from"] is not None
    res = subprocess.run([sys.executable, "-m", "cli.train", *offline_args], cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    _assert_same(_weights(tmp_path / "offline"), _weights(out))
    assert StreamSession(FeatureStore.open(store)).consumed() == steps
