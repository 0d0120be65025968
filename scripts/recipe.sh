#!/usr/bin/env bash
# The recipe for your own verifier (README, "Your own verifier and data"; docs/guide-training.md): sets up .venv
# (scripts/setup_env.sh, its output on stderr) and runs scripts/recipe.py with it; every argument goes to
# recipe.py (--help lists them). Relative paths are taken from the directory you run it in.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/setup_env.sh" >&2
# usage and messages name this script as you ran it, not recipe.py
PEAGLE_RECIPE_PROG="$0" exec "$here/../.venv/bin/python" "$here/recipe.py" "$@"
