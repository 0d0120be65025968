"""Tests that need data files the repository does not ship say what is missing and how to get it."""

from __future__ import annotations

import re

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
