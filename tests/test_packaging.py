"""The wheel (pyproject.toml; issue 22 item 1): what ``pip wheel .`` builds installs into a clean
virtualenv and works there, with no source tree to fall back on.

The editable install of ``scripts/setup_env.sh`` imports the packages from the source tree, so a
subpackage the wheel lacks (``peagle_data.readers``, ``peagle_train.evaluate``) goes unnoticed there.
Here the wheel is built from a copy of the working tree (ignored paths left out, so a stale ``build/``
cannot hide a missing module), its file list is compared with the source tree's modules, and the wheel
is installed into a new virtualenv (torch 2.13.0 first, then the wheel and its dependencies) and run
from a directory outside the repository: every command's ``--help``, then tokenize -> pack -> extract ->
train 3 steps -> offline eval on the tiny random Llama, whose packed table must equal the one the source
tree makes. A pytest test (marked slow, so ``.ci/run`` runs it) rather than a step of ``scripts/test.sh``:
it reuses the tiny-model fixture and the in-process reference run, and names what is missing.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from cli.data import COMMANDS
from cli.data import main as data_main
from stores.features.feature_store import FeatureStore
from tests.e2e.test_pipeline import CONVERSATIONS

REPO = Path(__file__).resolve().parents[1]
COPY_IGNORE = shutil.ignore_patterns(".git", ".venv", ".venv-*", "build", "dist", "*.egg-info", "__pycache__",
                                     ".pytest_cache", ".hypothesis", "runs", "demo", "quality", "shared")
"""What the source copy leaves out: the .gitignore entries (virtualenvs, build outputs, run outputs)."""


def source_packages() -> list[str]:
    """The top-level packages of the repository: its directories holding an ``__init__.py``."""
    return sorted(p.parent.name for p in REPO.glob("*/__init__.py"))


def source_modules() -> set[str]:
    """Every ``.py`` file under the packages, as a path relative to the repository (``cli/data.py``)."""
    return {p.relative_to(REPO).as_posix() for pkg in source_packages() for p in (REPO / pkg).rglob("*.py")
            if "__pycache__" not in p.parts}


def test_the_packages_are_the_library_and_not_the_tests():
    """The source tree's packages are the five the wheel ships; tests, bench and scripts are none."""
    assert source_packages() == ["cli", "peagle_data", "peagle_train", "runtime", "stores"]
    assert {"peagle_data/readers/__init__.py", "peagle_train/evaluate/__init__.py"} <= source_modules()


def _clock() -> tuple[float, float]:
    """(wall seconds, CPU seconds of the finished subprocesses): the CPU time does not grow with the
    machine's load, the wall time does."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.perf_counter(), children.ru_utime + children.ru_stime


def _since(start: tuple[float, float]) -> str:
    wall, cpu = _clock()
    return f"{wall - start[0]:.1f} s ({cpu - start[1]:.1f} s CPU)"


def _run(args, *, env, cwd, timeout=300) -> str:
    result = subprocess.run([str(a) for a in args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(map(str, args))} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result.stdout


BUILD_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
"""The environment of the build and install: no source tree on PYTHONPATH, no active virtualenv."""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel --no-deps`` builds from a copy of the working tree."""
    tmp, start = tmp_path_factory.mktemp("wheel"), _clock()
    shutil.copytree(REPO, tmp / "src", ignore=COPY_IGNORE)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp / "dist", tmp / "src"],
         env=BUILD_ENV, cwd=tmp)
    (built,) = (tmp / "dist").glob("peagle-*.whl")
    print(f"wheel built in {_since(start)}: {built.name}")
    return built


@pytest.mark.slow  # builds the wheel (about 20 s)
def test_the_wheel_holds_every_module_of_the_source_tree_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n for n in names if n.endswith(".py")}
    assert sorted(source_modules() - shipped) == [], "modules of the source tree missing from the wheel"
    assert sorted(shipped - source_modules()) == [], "modules in the wheel that the source tree does not have"
    assert {n.split("/")[0] for n in names} == {*source_packages(), "peagle-0.1.0.dist-info"}
    entry_points = zipfile.ZipFile(wheel).read("peagle-0.1.0.dist-info/entry_points.txt").decode()
    for line in ("peagle-data = cli.data:main", "peagle-train = cli.train:main", "peagle-eval = cli.eval:main"):
        assert line in entry_points


@pytest.fixture
def venv(tmp_path):
    """A new virtualenv (about 2 GB with torch), removed after the test."""
    path = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", path], env=BUILD_ENV, cwd=tmp_path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow  # installs the wheel and its dependencies into a new virtualenv, then runs the pipeline
def test_the_wheel_installs_into_a_clean_virtualenv_and_runs_the_pipeline(wheel, venv, tmp_path, tiny_verifier_dir):
    timings, start = {}, _clock()
    py, bin_dir = venv / "bin" / "python", venv / "bin"
    t = _clock()
    for what in ("torch==2.13.0", wheel):  # torch first: the CPU wheel (docs/guide-setup.md, "Disk space and the torch wheel")
        _run([py, "-m", "pip", "install", "-q", what], env=BUILD_ENV, cwd=tmp_path, timeout=900)
    timings["install"] = _since(t)

    work = tmp_path / "work"  # outside the repository: no source tree on sys.path
    work.mkdir()
    env = {**BUILD_ENV, "PATH": f"{bin_dir}{os.pathsep}{BUILD_ENV.get('PATH', '')}", "VIRTUAL_ENV": str(venv),
           "PEAGLE_HOME": str(tmp_path / "peagle_home"), "HF_HUB_OFFLINE": "1"}
    where = json.loads(_run([py, "-c", "import json, cli, peagle_data.readers, peagle_train.evaluate, stores; "
                             "print(json.dumps([m.__file__ for m in (cli, peagle_data.readers, "
                             "peagle_train.evaluate, stores)]))"], env=env, cwd=work))
    site = str(venv / "lib")
    assert all(f.startswith(site) for f in where), where

    t = _clock()
    for args in (["peagle-data", "--help"], *(["peagle-data", name, "--help"] for name in sorted(COMMANDS)),
                 ["peagle-train", "--help"], ["peagle-eval", "--help"]):
        out = _run([bin_dir / args[0], *args[1:]], env=env, cwd=work)
        assert out.startswith(f"Usage: {' '.join(args[:-1])}"), out
    timings["help"] = _since(t)

    t = _clock()
    model = str(tiny_verifier_dir)
    (work / "convs.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    out = _run([bin_dir / "peagle-data", "tokenize", "convs.jsonl", "--tokenizer", model, "--output", "tok"],
               env=env, cwd=work)
    assert "read 11  used 11  rejected 0" in out, out
    _run([bin_dir / "peagle-data", "pack", "tok", "--tokenizer", model, "--output", "packed", "--max-seq-len", 128],
         env=env, cwd=work)
    _run([bin_dir / "peagle-data", "extract", "packed", "--verifier", model, "--output", "f.zarr", "--layers",
          "1,2,3"], env=env, cwd=work)
    summary = json.loads(_run([bin_dir / "peagle-train", "--store", "f.zarr", "--output", "drafter", "--max-steps", 3,
                               "--num-depths", 2, "--draft-vocab-size", 64], env=env, cwd=work))
    report = json.loads(_run([bin_dir / "peagle-eval", "--drafter", "drafter", "--store", "f.zarr", "--all-anchor",
                              "--output", "eval.json"], env=env, cwd=work))
    timings["pipeline"] = _since(t)

    # the source tree's pack of the same input: the wheel's table is the same table
    ref = CliRunner().invoke(data_main, ["pack", str(work / "tok"), "--tokenizer", model, "--output",
                                         str(tmp_path / "packed_ref"), "--max-seq-len", "128"], catch_exceptions=False)
    assert ref.exit_code == 0, ref.output
    parts = sorted(p.name for p in (work / "packed").glob("*.parquet"))
    assert parts == sorted(p.name for p in (tmp_path / "packed_ref").glob("*.parquet")) and parts
    for part in parts:
        assert pq.read_table(work / "packed" / part).equals(pq.read_table(tmp_path / "packed_ref" / part))
    manifest = json.loads((work / "packed" / "manifest.json").read_text())
    store = FeatureStore.open(work / "f.zarr")
    assert store.is_complete() and store.n_blocks == manifest["counts"]["n_blocks"] > 1 and store.layers == [1, 2, 3]
    assert summary["steps"] == 3 and len(summary["per_depth_accuracy_last_steps"]) == 2
    assert (work / "drafter" / "final" / "model.safetensors").is_file()
    assert report["positions_scored"] > 0 and json.loads((work / "eval.json").read_text()) == report
    timings["total"] = _since(start)
    print("wheel install:", "; ".join(f"{k} {v}" for k, v in timings.items()))
