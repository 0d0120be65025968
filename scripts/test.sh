#!/usr/bin/env bash
# Create the environment if needed, then run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
. .venv/bin/activate
python -m pytest -q "$@"
