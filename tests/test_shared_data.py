"""Tests that need data files the repository does not ship say what is missing and how to get it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.conftest import SHARED_DATA, TEST_DATA_ENV, shared_data_dir, shared_file


def test_missing_file_skip_names_the_file_its_source_and_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(TEST_DATA_ENV, str(tmp_path))
    with pytest.raises(pytest.skip.Exception) as info:
        shared_file("mt_bench_question.jsonl")
    reason = str(info.value)
    assert reason.startswith("needs the MT-Bench questions (80 two-turn prompts), file mt_bench_question.jsonl")
    assert f"{TEST_DATA_ENV}={tmp_path}" in reason
    url = "https://raw.githubusercontent.com/lm-sys/FastChat/main/fastchat/llm_judge/data/mt_bench/question.jsonl"
    assert reason.endswith(f": download {url} as mt_bench_question.jsonl into a directory and set "
                           f"{TEST_DATA_ENV} to that directory")


def test_unset_variable_falls_back_to_the_developers_directory(monkeypatch):
    monkeypatch.delenv(TEST_DATA_ENV, raising=False)
    assert shared_data_dir() == SHARED_DATA
    with pytest.raises(pytest.skip.Exception, match=re.escape(f"{TEST_DATA_ENV} is unset, so the default {SHARED_DATA}")):
        shared_file("no_such_file.jsonl")


def test_file_in_the_named_directory_is_found(tmp_path, monkeypatch):
    (tmp_path / "glaive_toolcall_en_demo.json").write_text("[]")
    monkeypatch.setenv(TEST_DATA_ENV, str(tmp_path))
    assert shared_file("glaive_toolcall_en_demo.json") == tmp_path / "glaive_toolcall_en_demo.json"


def _reads_shared_data(tree: ast.Module) -> set[str]:
    """The module-level functions of ``tree`` that call :func:`shared_file`, themselves or through another
    module-level function of it that does (``_turns`` in test_identity.py)."""
    calls = {f.name: {n.func.id for n in ast.walk(f) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
             for f in tree.body if isinstance(f, ast.FunctionDef)}
    found = {name for name, called in calls.items() if "shared_file" in called}
    while True:
        more = {name for name, called in calls.items() if called & found} - found
        if not more:
            return found
        found |= more


def _mark(decorator: ast.expr) -> str | None:
    """``shared_data`` of ``@pytest.mark.shared_data``, ``parametrize`` of ``@pytest.mark.parametrize(...)``."""
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    text = ast.unparse(node)
    return text.removeprefix("pytest.mark.") if text.startswith("pytest.mark.") else None


def _cases(function: ast.FunctionDef) -> int:
    """The tests pytest collects of ``function``: the product of its ``parametrize`` lists' lengths."""
    n = 1
    for d in function.decorator_list:
        if _mark(d) == "parametrize":
            values = d.args[1]
            assert isinstance(values, (ast.List, ast.Tuple)), f"{function.name}: parametrize over a literal list"
            n *= len(values.elts)
    return n


def test_the_setup_guide_counts_the_tests_that_read_shared_data():
    """docs/guide-setup.md says how many tests read public data files (``shared_file``): every such test is
    marked ``shared_data`` (so ``pytest -m shared_data --collect-only -q`` lists them), every test so marked
    reads one, and the guide's count is theirs, parametrized cases counted as pytest collects them."""
    tests_dir = Path(__file__).resolve().parent
    reading, marked, cases = set(), set(), 0
    for path in sorted(tests_dir.rglob("test_*.py")):
        if path == Path(__file__).resolve():  # this module calls shared_file on files it writes
            continue
        tree = ast.parse(path.read_text())
        readers = _reads_shared_data(tree)
        for f in tree.body:
            if not (isinstance(f, ast.FunctionDef) and f.name.startswith("test_")):
                continue
            where = f"{path.relative_to(tests_dir)}::{f.name}"
            if f.name in readers:
                reading.add(where)
                cases += _cases(f)
            if any(_mark(d) == "shared_data" for d in f.decorator_list):
                marked.add(where)
    assert reading and marked == reading
    guide = " ".join((tests_dir.parent / "docs" / "guide-setup.md").read_text().split())
    assert f"{cases} tests (marked `shared_data`" in guide
