#!/usr/bin/env bash
# Create the environment if needed, then run the test suite.
# PEAGLE_VLLM=1 also creates .venv-vllm and runs the tests marked `vllm` there, against a real vLLM
# engine; in that run a vLLM test that cannot run fails instead of skipping (CI sets PEAGLE_VLLM=1). Without
# test arguments it then runs the transformers-facing tests there too, on transformers' lower bound.
#
# Every suite runs even when an earlier one fails; each ends with one line on stderr,
#   test.sh: suite NAME: WALL s (M min S s), exit RC (passed|FAILED|no tests collected)
# and the script exits non-zero when any suite failed. pytest's exit 5 (no test collected) fails the main
# suite and the transformers-5.19 set, and is a pass for the vLLM suite only when test arguments were given
# (a subset of the tests may hold no vLLM test). .ci/run adds the whole run's time and its 45-min budget.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh || { echo "test.sh: setting up the environment failed" >&2; exit 1; }

failed=()
# PEAGLE_TEST_DURATIONS=N (.ci/run sets 25): each suite also lists its N slowest tests
durations=()
if [ -n "${PEAGLE_TEST_DURATIONS:-}" ]; then durations=("--durations=$PEAGLE_TEST_DURATIONS"); fi

# report NAME RC START_SECONDS ALLOW_EMPTY: the suite's line on stderr; a failed suite joins $failed
report() {
  local name=$1 rc=$2 wall=$((SECONDS - $3)) allow_empty=$4 verdict
  if [ "$rc" -eq 0 ]; then
    verdict=passed
  elif [ "$rc" -eq 5 ] && [ "$allow_empty" = 1 ]; then
    verdict="no tests collected; none selected by the arguments"
  elif [ "$rc" -eq 5 ]; then
    verdict="FAILED: no tests collected"
    failed+=("$name")
  else
    verdict=FAILED
    failed+=("$name")
  fi
  printf 'test.sh: suite %s: %d s (%d min %02d s), exit %d (%s)\n' "$name" "$wall" $((wall / 60)) $((wall % 60)) \
    "$rc" "$verdict" >&2
}

lower_bound_pid=""
if [ "${PEAGLE_VLLM:-0}" = 1 ] && [ $# -eq 0 ]; then
  # .venv-vllm holds transformers 5.19, pyproject's lower bound (.venv has 5.24): the code that calls
  # transformers' internals (packed-segment masks, the model families, chat templates) is tested on it too.
  # A short CPU-bound set (about 25 s): it runs beside the main suite, whose tests hold one torch thread,
  # and its output is printed after the main suite's.
  lower_bound_log=$(mktemp "${TMPDIR:-/tmp}/peagle-lower-bound.XXXXXX")
  (
    start=$SECONDS
    OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest -q -p no:cacheprovider -m "not vllm" \
      tests/peagle_data/extract/test_hf_forward.py tests/peagle_data/extract/test_families.py \
      tests/peagle_train/evaluate/test_families_speculative.py tests/peagle_data/chat/test_template_families.py \
      tests/e2e/test_pipeline.py
    rc=$?
    echo "$rc $((SECONDS - start))" > "$lower_bound_log.rc"
  ) > "$lower_bound_log" 2>&1 &
  lower_bound_pid=$!
fi

start=$SECONDS
.venv/bin/python -m pytest -q "${durations[@]}" "$@"
report "main (.venv)" $? "$start" 0

if [ -n "$lower_bound_pid" ]; then
  wait "$lower_bound_pid"
  cat "$lower_bound_log"
  read -r rc wall < "$lower_bound_log.rc" || { rc=1; wall=0; }
  rm -f "$lower_bound_log" "$lower_bound_log.rc"
  report "transformers-5.19 set (.venv-vllm, beside the main suite)" "$rc" $((SECONDS - wall)) 0
fi

if [ "${PEAGLE_VLLM:-0}" = 1 ]; then
  start=$SECONDS
  PEAGLE_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -q -m vllm "${durations[@]}" "$@"
  report "vllm (.venv-vllm)" $? "$start" $(($# > 0))
fi

if [ ${#failed[@]} -gt 0 ]; then
  printf 'test.sh: FAILED suites: %s\n' "$(IFS=,; echo "${failed[*]}")" >&2
  exit 1
fi
