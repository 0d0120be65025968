#!/usr/bin/env bash
# Create the environment if needed, then run the test suite.
# PEAGLE_VLLM=1 also creates .venv-vllm and runs the tests marked `vllm` there, against a real vLLM
# engine; in that run a vLLM test that cannot run fails instead of skipping (CI sets PEAGLE_VLLM=1). Without
# test arguments it then runs the transformers-facing tests there too, on transformers' lower bound.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -m pytest -q "$@"
if [ "${PEAGLE_VLLM:-0}" = 1 ]; then
  PEAGLE_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -q -m vllm "$@"
  if [ $# -eq 0 ]; then
    # .venv-vllm holds transformers 5.19, pyproject's lower bound (.venv has 5.24): the code that calls
    # transformers' internals (packed-segment masks, the model families, chat templates) is tested on it too
    .venv-vllm/bin/python -m pytest -q -m "not vllm" tests/peagle_data/extract/test_hf_forward.py \
      tests/peagle_data/extract/test_families.py tests/peagle_train/evaluate/test_families_speculative.py \
      tests/peagle_data/chat/test_template_families.py tests/e2e/test_pipeline.py
  fi
fi
