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

# In CI (PEAGLE_VLLM=1, no test arguments) the suites run side by side: each is about one core's work (the
# tests hold one torch thread; a vLLM engine start is three Python processes importing vLLM one after another),
# so on 2 cores the whole takes about the longest suite's time instead of their sum. The vLLM suite runs as two
# pytest processes, split by module (VLLM_A: the serving modules; the rest), and the transformers-5.19 set beside
# them. Each suite's output is printed after the main suite's, in this order, then its line.
parallel=0
if [ "${PEAGLE_VLLM:-0}" = 1 ] && [ $# -eq 0 ]; then parallel=1; fi
VLLM_A=(tests/peagle_train/evaluate/test_vllm_serving.py
        tests/peagle_train/generate/test_inference.py tests/peagle_train/evaluate/test_vllm_serve_documented.py
        tests/bench/test_vllm_judge.py tests/peagle_train/generate/test_vllm_sampling.py)
logs=$(mktemp -d "${TMPDIR:-/tmp}/peagle-test.XXXXXX")
pids=() names=()

# beside NAME COMMAND...: run COMMAND in the background, its output and exit status and wall time under $logs
beside() {
  local name=$1 key=${#pids[@]}
  shift
  ( start=$SECONDS; "$@" > "$logs/$key.log" 2>&1; echo "$? $((SECONDS - start))" > "$logs/$key.rc" ) &
  pids+=($!) names+=("$name")
}

if [ "$parallel" = 1 ]; then
  # the embedded verifier is converted once, before the suites that read it start together
  .venv/bin/python -c "from runtime.model_cache import resolve_model; resolve_model('smollm2-135m')" \
    || { echo "test.sh: converting the embedded verifier failed" >&2; exit 1; }
  # .venv-vllm holds transformers 5.19, pyproject's lower bound (.venv has 5.24): the code that calls
  # transformers' internals (packed-segment masks, the model families, chat templates) is tested on it too.
  beside "transformers-5.19 set (.venv-vllm)" env OMP_NUM_THREADS=1 .venv-vllm/bin/python -m pytest -q \
    -p no:cacheprovider -m "not vllm" tests/peagle_data/extract/test_hf_forward.py \
    tests/peagle_data/extract/test_families.py tests/peagle_train/generate/test_families_speculative.py \
    tests/peagle_data/chat/test_template_families.py tests/e2e/test_pipeline.py
  ignore=()
  for f in "${VLLM_A[@]}"; do ignore+=("--ignore=$f"); done
  # vLLM's CPU worker binds its OpenMP threads by default ('auto') to every core of the node but the last, which
  # it leaves to other processes: core 0 here, so the two vLLM processes' engines would all compute on core 0.
  # Each process's engines get a core of their own (a test that sets the variable itself keeps its own).
  bind_a=0 bind_b=0
  if [ "$(nproc)" -ge 2 ]; then bind_b=1; fi
  beside "vllm: serving modules (.venv-vllm)" env PEAGLE_REQUIRE_VLLM=1 VLLM_CPU_OMP_THREADS_BIND=$bind_a \
    .venv-vllm/bin/python -m pytest -q -p no:cacheprovider -m vllm "${durations[@]}" "${VLLM_A[@]}"
  beside "vllm: the other modules (.venv-vllm)" env PEAGLE_REQUIRE_VLLM=1 VLLM_CPU_OMP_THREADS_BIND=$bind_b \
    .venv-vllm/bin/python -m pytest -q -p no:cacheprovider -m vllm "${durations[@]}" "${ignore[@]}" tests
fi

# In CI the main suite runs as two processes too, split by package (MAIN_B: training, evaluation, end to end and the
# benches' tests; the rest in the first): one process left alone at the end kept a core idle for minutes.
main_args=("$@")
if [ "$parallel" = 1 ]; then
  MAIN_B=(tests/peagle_train tests/e2e tests/bench)
  beside "main, part 2: ${MAIN_B[*]} (.venv)" .venv/bin/python -m pytest -q -p no:cacheprovider "${durations[@]}" \
    "${MAIN_B[@]}"
  main_args=()
  for f in "${MAIN_B[@]}"; do main_args+=("--ignore=$f"); done
fi
start=$SECONDS
.venv/bin/python -m pytest -q "${durations[@]}" "${main_args[@]}"
report "main (.venv)" $? "$start" 0

for key in "${!pids[@]}"; do
  wait "${pids[$key]}"
  cat "$logs/$key.log"
  read -r rc wall < "$logs/$key.rc" || { rc=1; wall=0; }
  report "${names[$key]}, beside the main suite" "$rc" $((SECONDS - wall)) 0
done
rm -rf "$logs"

if [ "${PEAGLE_VLLM:-0}" = 1 ] && [ "$parallel" = 0 ]; then
  start=$SECONDS
  PEAGLE_REQUIRE_VLLM=1 .venv-vllm/bin/python -m pytest -q -m vllm "${durations[@]}" "$@"
  report "vllm (.venv-vllm)" $? "$start" $(($# > 0))
fi

if [ ${#failed[@]} -gt 0 ]; then
  printf 'test.sh: FAILED suites: %s\n' "$(IFS=,; echo "${failed[*]}")" >&2
  exit 1
fi
