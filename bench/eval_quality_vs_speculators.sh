#!/usr/bin/env bash
# Evaluate every drafter bench/bench_quality_vs_speculators.py trained, each by the same code (peagle-eval):
#   offline per-depth acceptance of every checkpoint on the held-out store -> DRAFTER/checkpoint-N/held_out.json
#   online AL of the last checkpoint (peagle's engine, greedy, checked token for token) -> DRAFTER/online.json
#   AL of the last checkpoint served by vLLM (.venv-vllm)                             -> DRAFTER/vllm.json
# then prints the side-by-side table (bench/quality_vs_speculators_table.py).
# Usage: bash bench/eval_quality_vs_speculators.sh OUT HELD_OUT_STORE [NUM_PROMPTS] [STAGES]
#   OUT: the bench's --out; HELD_OUT_STORE: e.g. quality/mt_bench.zarr; NUM_PROMPTS: MT-Bench questions
#   (both turns, 128 new tokens each; default 10); STAGES: any of offline,online,vllm (default all three).
set -euo pipefail
OUT=$(realpath "$1")
HELD=$(realpath "$2")
N=${3:-10}
STAGES=${4:-offline,online,vllm}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PROMPTS=${PEAGLE_MT_BENCH:-$ROOT/../shared/data/mt_bench_question.jsonl}
[[ -f $PROMPTS ]] || { echo "eval_quality_vs_speculators.sh: no MT-Bench prompts at $PROMPTS (set PEAGLE_MT_BENCH)" >&2; exit 1; }
VLLM_PY=${PEAGLE_VLLM_PYTHON:-$ROOT/.venv-vllm/bin/python}
cd "$ROOT"
for drafter in "$OUT"/*/; do
  drafter=${drafter%/}
  ls -d "$drafter"/checkpoint-* >/dev/null 2>&1 || continue
  last=$(cd "$drafter" && ls -d checkpoint-* | sed 's/^checkpoint-//' | sort -n | tail -1)
  if [[ ,$STAGES, == *,offline,* ]]; then
    for ckpt in "$drafter"/checkpoint-*; do
      python -m cli.eval --drafter "$ckpt" --store "$HELD" --all-anchor --output "$ckpt/held_out.json" --force > /dev/null
    done
  fi
  if [[ ,$STAGES, == *,online,* ]]; then
    OMP_NUM_THREADS=1 python -m cli.eval --drafter "$drafter/checkpoint-$last" --verifier smollm2-135m \
      --prompts "$PROMPTS" --num-prompts "$N" --output "$drafter/online.json" --force > /dev/null
  fi
  if [[ ,$STAGES, == *,vllm,* ]]; then
    VLLM_CPU_KVCACHE_SPACE=2 "$VLLM_PY" -m cli.eval --drafter "$drafter/checkpoint-$last" --verifier smollm2-135m \
      --prompts "$PROMPTS" --num-prompts "$N" --engine vllm --concurrency 1 --vllm-loading speculators \
      --output "$drafter/vllm.json" --force > /dev/null
  fi
  echo "evaluated $drafter" >&2
done
python "$ROOT/bench/quality_vs_speculators_table.py" "$OUT"
