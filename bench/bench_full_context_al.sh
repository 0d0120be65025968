#!/usr/bin/env bash
# Window context against full context (issue 21, "Does it pay?"): two drafters trained with the same
# settings and steps on the same long ShareGPT conversations, one on window-context features
# (`peagle-data extract --context window`: every window run alone, positions from 0) and one on
# full-context features (`--context full`: every conversation run once, windows are views of it),
# then both evaluated on held-out prompts whose history is longer than one window.
#
# Stages (each skipped when its output exists, so a run can be resumed or extended; OUT/NAME.log
# holds each command's output and `time`):
#   data     peagle-data tokenize sharegpt -> OUT/sg_tok (the ids and n_tokens of the rows it keeps)
#            bench/full_context_data.py select -> OUT/train.jsonl (CTX_TRAIN conversations of
#              1,025-8,192 tokens), OUT/prompts.jsonl (CTX_PROMPTS held-out prompts: a held-out
#              conversation cut after its last user turn with more than 1,024 history tokens),
#              OUT/held_out.jsonl (the same cut plus the reference answer); split by sha256 of the
#              ShareGPT base id, 1/8 held out (the helper's docstring)
#            peagle-data tokenize OUT/train.jsonl + full_context_data.py check (the JSONL round
#              trip keeps every conversation's tokens)
#            peagle-data pack OUT/train.jsonl --max-seq-len 1024 --block-size 1024 -> OUT/packed
#            peagle-data pack OUT/held_out.jsonl (same sizes) -> OUT/held_packed
#   extract  peagle-data extract OUT/packed --layers 2,15,27 --context window -> OUT/store_window
#            peagle-data extract OUT/packed --layers 2,15,27 --context full   -> OUT/store_full
#            peagle-data extract OUT/held_packed ... --context full          -> OUT/held_full
#              (serving-exact features of the held-out conversations, for offline AL)
#   train    peagle-train --store OUT/store_SIDE --max-steps CTX_STEPS --num-depths 4
#              --draft-vocab-size 4096 --lr 1e-3 --seed 0 -> OUT/drafter_SIDE (identical settings)
#   eval     peagle-eval --store OUT/held_full (offline)                     -> OUT/drafter_SIDE/offline.json
#            peagle-eval --prompts OUT/prompts.jsonl --engine vllm --vllm-loading speculators
#              (.venv-vllm, 128 new tokens, greedy, concurrency 1)            -> OUT/drafter_SIDE/vllm.json
#            peagle-eval --prompts OUT/prompts.jsonl (peagle's engine)       -> OUT/drafter_SIDE/online.json
#            then the table (full_context_data.py table OUT)
#
# Usage: bash bench/bench_full_context_al.sh OUT [STAGES] [SIDES]
#   STAGES: comma list of data,extract,train,eval (default all); SIDES: window,full (default both).
#   Env: CTX_TRAIN (160), CTX_PROMPTS (24), CTX_STEPS (training steps, 400), CTX_THREADS (torch
#   threads of tokenize, pack, extract, offline eval: 2), CTX_TRAIN_THREADS (of training: 1),
#   PEAGLE_VLLM_PYTHON (default .venv-vllm/bin/python).
# Time on the 2-core CI machine kind, shared with other jobs at load 4-9 (2026-12-01, docs/benchmarks.md
# "Window context against full context: drafters on long-history prompts"): data 1 min; extract window
# 37 min (519K tokens), full 56 min (311K tokens in 4,378-slot context blocks), held-out 9 min; train
# 18-37 min per side (400 steps, 2.7-5.5 s a step); eval offline 7-8 min and vLLM 12-14 min per side;
# peagle's own engine about 100 s per prompt under that load (40 min per side; quiet machine: less).
set -euo pipefail
OUT=$(mkdir -p "$1" && realpath "$1")
STAGES=${2:-data,extract,train,eval}
SIDES=${3:-window,full}
N_TRAIN=${CTX_TRAIN:-160}
N_PROMPTS=${CTX_PROMPTS:-24}
STEPS=${CTX_STEPS:-400}
export OMP_NUM_THREADS=${CTX_THREADS:-2}
TRAIN_THREADS=${CTX_TRAIN_THREADS:-1}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VLLM_PY=${PEAGLE_VLLM_PYTHON:-$ROOT/.venv-vllm/bin/python}
LAYERS=2,15,27
cd "$ROOT"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}   # the vLLM engine process imports peagle from here

has() { [[ ,$2, == *,$1,* ]]; }
# step NAME OUTPUT CMD...: run CMD (logged to OUT/NAME.log with its wall time) unless OUTPUT exists
step() {
  local name=$1 output=$2; shift 2
  if [[ -e $output ]]; then echo "skip $name: $output exists" >&2; return; fi
  echo "run  $name: $*" >&2
  { echo "+ $*"; /usr/bin/time -f "wall %e s, peak RSS %M KiB" "$@"; } > "$OUT/$name.log" 2>&1 \
    || { tail -20 "$OUT/$name.log" >&2; echo "stage $name failed: $OUT/$name.log" >&2; exit 1; }
  tail -1 "$OUT/$name.log" >&2
}

if has data "$STAGES"; then
  step tokenize_sharegpt "$OUT/sg_tok" peagle-data tokenize sharegpt --tokenizer smollm2-135m --output "$OUT/sg_tok"
  step select "$OUT/prompts.jsonl" python bench/full_context_data.py select --tokenized "$OUT/sg_tok" \
    --tokenizer smollm2-135m --train-conversations "$N_TRAIN" --held-out-prompts "$N_PROMPTS" \
    --min-tokens 1024 --max-tokens 8192 --min-history 1024 --max-new-tokens 128 \
    --train-out "$OUT/train.jsonl" --prompts-out "$OUT/prompts.jsonl" --held-out-out "$OUT/held_out.jsonl"
  step tokenize_train "$OUT/train_tok" peagle-data tokenize "$OUT/train.jsonl" --tokenizer smollm2-135m \
    --output "$OUT/train_tok"
  python bench/full_context_data.py check --tokenized "$OUT/sg_tok" --train-tokenized "$OUT/train_tok" \
    --train-jsonl "$OUT/train.jsonl"
  step pack "$OUT/packed" peagle-data pack "$OUT/train.jsonl" --tokenizer smollm2-135m --output "$OUT/packed" \
    --max-seq-len 1024 --block-size 1024
  step pack_held_out "$OUT/held_packed" peagle-data pack "$OUT/held_out.jsonl" --tokenizer smollm2-135m \
    --output "$OUT/held_packed" --max-seq-len 1024 --block-size 1024
fi

if has extract "$STAGES"; then
  for side in ${SIDES//,/ }; do
    step "extract_$side" "$OUT/store_$side" peagle-data extract "$OUT/packed" --verifier smollm2-135m \
      --layers $LAYERS --context "$side" --output "$OUT/store_$side"
  done
  step extract_held_out "$OUT/held_full" peagle-data extract "$OUT/held_packed" --verifier smollm2-135m \
    --layers $LAYERS --context full --output "$OUT/held_full"
fi

if has train "$STAGES"; then
  for side in ${SIDES//,/ }; do
    step "train_$side" "$OUT/drafter_$side" env OMP_NUM_THREADS="$TRAIN_THREADS" peagle-train --store "$OUT/store_$side" --output "$OUT/drafter_$side" \
      --max-steps "$STEPS" --num-depths 4 --draft-vocab-size 4096 --lr 1e-3 --seed 0
  done
fi

if has eval "$STAGES"; then
  for side in ${SIDES//,/ }; do
    d=$OUT/drafter_$side
    step "offline_$side" "$d/offline.json" peagle-eval --drafter "$d/final" --store "$OUT/held_full" \
      --all-anchor --output "$d/offline.json" --no-measure-costs
    step "vllm_$side" "$d/vllm.json" env VLLM_CPU_KVCACHE_SPACE=2 "$VLLM_PY" -m cli.eval --drafter "$d/final" \
      --verifier smollm2-135m --prompts "$OUT/prompts.jsonl" --max-new-tokens 128 --engine vllm \
      --concurrency 1 --vllm-loading speculators --output "$d/vllm.json"
    step "online_$side" "$d/online.json" env OMP_NUM_THREADS=1 peagle-eval --drafter "$d/final" \
      --verifier smollm2-135m --prompts "$OUT/prompts.jsonl" --max-new-tokens 128 --output "$d/online.json"
  done
  python bench/full_context_data.py table "$OUT"
fi
