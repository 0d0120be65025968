"""Shared fixtures: the real SmolLM2 tokenizer, a tiny random Llama verifier, shared data paths.

The tokenizer is converted once from the embedded GGUF into ``$PEAGLE_HOME`` (about 10 s); the
tiny verifier (4 layers, hidden 64) is built in code with that tokenizer's vocabulary.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
"""Where developers of peagle keep the test data files: ``../shared/data`` beside the repository."""

TEST_DATA_ENV = "PEAGLE_TEST_DATA"
"""Environment variable naming a directory that holds the files of :data:`TEST_DATA_FILES`."""

TEST_DATA_FILES = {
    "mt_bench_question.jsonl": (
        "the MT-Bench questions (80 two-turn prompts)",
        "https://raw.githubusercontent.com/lm-sys/FastChat/main/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "glaive_toolcall_en_demo.json": (
        "the Glaive tool-calling sample (300 ShareGPT-style conversations)",
        "https://raw.githubusercontent.com/hiyouga/LLaMA-Factory/main/data/glaive_toolcall_en_demo.json"),
}
"""Public data files some tests read but the repository does not ship: name -> (what it is, where to get it)."""


VLLM_SETUP = "PEAGLE_VLLM=1 bash scripts/setup_env.sh (creates .venv-vllm); run them with .venv-vllm/bin/python -m pytest -m vllm"
"""How a user gets the environment the tests marked ``vllm`` run in."""


def vllm_missing_reason() -> str | None:
    """Why vLLM cannot be imported in this interpreter, or None when it can."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return f"needs vLLM, which this environment lacks: {VLLM_SETUP}"
    return None


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run in CI (.ci/run sets PEAGLE_SLOW_TESTS=1) and are skipped otherwise.

    Tests marked ``vllm`` need vLLM importable (``.venv-vllm``); without it they skip naming the set-up
    command, except under ``PEAGLE_REQUIRE_VLLM=1`` (the vLLM run of ``scripts/test.sh``, so CI), where
    a vLLM test that cannot run is a failure.
    """
    if os.environ.get("PEAGLE_SLOW_TESTS") != "1":
        skip = pytest.mark.skip(reason="slow: set PEAGLE_SLOW_TESTS=1 (CI does) to run it")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    missing = vllm_missing_reason()
    if missing is None:
        return
    if os.environ.get("PEAGLE_REQUIRE_VLLM") == "1":
        raise pytest.UsageError(f"PEAGLE_REQUIRE_VLLM=1 but vLLM cannot run here: {missing}")
    skip_vllm = pytest.mark.skip(reason=missing)
    for item in items:
        if "vllm" in item.keywords:
            item.add_marker(skip_vllm)


def shared_data_dir() -> Path:
    """The directory of test data files: ``$PEAGLE_TEST_DATA``, default ``../shared/data``."""
    value = os.environ.get(TEST_DATA_ENV)
    return Path(value).expanduser() if value else SHARED_DATA


def shared_file(name: str) -> Path:
    """Path of the test data file ``name`` (one of :data:`TEST_DATA_FILES`), or skip the test.

    The skip reason says which file is missing, what it is, where to download it and how to point
    the tests at it, so a user of the repository (who has no ``../shared/data``) can run the test.
    """
    path = shared_data_dir() / name
    if not path.is_file():
        what, url = TEST_DATA_FILES.get(name, ("a test data file", None))
        source = f"download {url} " if url else "put it "
        where = (f"{TEST_DATA_ENV}={os.environ[TEST_DATA_ENV]}" if os.environ.get(TEST_DATA_ENV)
                 else f"{TEST_DATA_ENV} is unset, so the default {SHARED_DATA}")
        pytest.skip(f"needs {what}, file {name}, not found ({where}): {source}as {name} into a "
                    f"directory and set {TEST_DATA_ENV} to that directory")
    return path


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir() -> Path:
    """Directory of the real SmolLM2-135M-Instruct tokenizer (converted once into the cache)."""
    from runtime.model_cache import resolve_model

    return resolve_model("smollm2-135m", need_weights=False)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_dir)


@pytest.fixture(scope="session")
def copy_smollm2_tokenizer(smollm2_tokenizer_dir):
    """``copy(out)``: copy the SmolLM2 tokenizer files (not its config or weights) into model dir ``out``."""
    import shutil

    def copy(out: Path) -> Path:
        for f in Path(smollm2_tokenizer_dir).iterdir():
            if f.is_file() and not f.name.startswith(".") and f.suffix != ".safetensors" \
                    and f.name not in ("config.json", "generation_config.json"):
                shutil.copy(f, out / f.name)
        return out

    return copy


@pytest.fixture(scope="session")
def tiny_verifier_dir(tmp_path_factory, copy_smollm2_tokenizer) -> Path:
    """A random 4-layer Llama (hidden 64, the SmolLM2 vocab) saved with the SmolLM2 tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_verifier")
    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    copy_smollm2_tokenizer(out)
    return out


@pytest.fixture(scope="session")
def tiny_verifier(tiny_verifier_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_verifier_dir).eval()


@pytest.fixture
def one_thread():
    """One torch thread for the test: tiny models gain nothing from threads, and multi-threaded small
    GEMMs stall on a busy 2-core box."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
