"""Session fixtures of the streaming tests (test_stream*.py): the tiny packed tables, their offline stores and the
offline runs the streaming runs are compared with, built once per session instead of once per module.

- ``packed``: the tiny packed table of test_stream.py (N_BLOCKS blocks of C slots, random SmolLM2 ids).
- ``offline_store``: its whole store, extracted first by the command in its own process (tiny Llama verifier).
- ``packed_full`` / ``offline_full``: the full-context table (FULL_SHAPES conversations) and its store, its
  conversations grouped as a streaming extraction groups them (``--context-packing training_blocks``);
  ``offline_full_defaults``: the same table extracted with the command's defaults.
- ``offline_run(store, steps, **opts)``: ``run_train`` of that offline store, in this process, once per
  (store, steps, opts) in the session; its summary and output directory. The caller's torch threads apply
  (every test here holds one: tests/peagle_train/conftest.py), so the shared run is the one each test made.

Tests that use them take the fixture by name; a test module must not import these names from another (an
imported fixture is a fixture of that module again, built once more).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from peagle_train.train.config import TrainConfig
from peagle_train.train.run import run_train
from tests.peagle_data.extract.test_full_context import synthetic_conversations, write_packed_conversations
from tests.peagle_data.extract.test_run import write_packed
from tests.peagle_train.train.test_stream import C, FULL_SHAPES, N_BLOCKS

REPO = Path(__file__).resolve().parents[3]


def _extract(packed: Path, out: Path, verifier: Path, *options: str) -> str:
    res = subprocess.run([sys.executable, "-m", "cli.data", "extract", str(packed), "--output", str(out),
                          "--verifier", str(verifier), *options, "--device", "cpu"],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return str(out)


@pytest.fixture(scope="session")
def packed(tmp_path_factory) -> Path:
    return write_packed(tmp_path_factory.mktemp("packed") / "packed", n_blocks=N_BLOCKS, block_size=C)


@pytest.fixture(scope="session")
def offline_store(tmp_path_factory, packed, tiny_verifier_dir) -> str:
    """The whole store, extracted first (as a user would: the command, in its own process)."""
    return _extract(packed, tmp_path_factory.mktemp("offline") / "s.zarr", tiny_verifier_dir, "--context", "window")


@pytest.fixture(scope="session")
def packed_full(tmp_path_factory) -> Path:
    return write_packed_conversations(tmp_path_factory.mktemp("packed_full") / "packed",
                                      synthetic_conversations(49152, shapes=FULL_SHAPES), 16, 32, "smollm2-135m")


@pytest.fixture(scope="session")
def offline_full(tmp_path_factory, packed_full, tiny_verifier_dir) -> str:
    """The whole full-context store, extracted first (the command, in its own process), its conversations grouped
    as a streaming extraction groups them (its default, --context-packing training_blocks)."""
    return _extract(packed_full, tmp_path_factory.mktemp("offline_full") / "s.zarr", tiny_verifier_dir,
                    "--context", "full", "--context-packing", "training_blocks")


@pytest.fixture(scope="session")
def offline_full_defaults(tmp_path_factory, packed_full, tiny_verifier_dir) -> str:
    """The whole full-context table extracted with ``peagle-data extract``'s defaults (full context, best-fit
    packing of the context blocks)."""
    return _extract(packed_full, tmp_path_factory.mktemp("offline_full_defaults") / "s.zarr", tiny_verifier_dir)


@pytest.fixture(scope="session")
def offline_run(tmp_path_factory, tiny_verifier_dir):
    """``run(store, steps, **opts) -> (summary, output dir)``: the offline run, trained on its first use."""
    runs: dict[tuple, tuple[dict, Path]] = {}

    def run(store: str, steps: int, **opts) -> tuple[dict, Path]:
        key = (store, steps, tuple(sorted(opts.items())))
        if key not in runs:
            out = tmp_path_factory.mktemp("offline_run") / "run"
            summary = run_train(TrainConfig.from_flat(store=store, output=str(out), verifier=str(tiny_verifier_dir),
                                                      max_steps=steps, **opts))
            runs[key] = (summary, out)
        return runs[key]

    return run
