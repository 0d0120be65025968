#!/usr/bin/env bash
# Create the environment if needed, then run the test suite.
# PEAGLE_VLLM=1 also creates .venv-vllm and runs the tests marked `vllm` there, against a real vLLM
# engine; in that run a vLLM test that cannot run fails instead of skipping (CI sets PEAGLE_VLLM=1).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/python -m pytest -q "$@"
if [ "${PEAGLE_VLLM:-0}" = 1 ]; then
  PEAGLE_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -q -m vllm "$@"
fi
