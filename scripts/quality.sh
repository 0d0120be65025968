#!/usr/bin/env bash
# The quality recipe (docs/guide-training.md, "A drafter that pays"): a drafter trained on the verifier's own answers,
# evaluated on prompts it never saw, on the embedded defaults, in about an hour on 2 CPU cores.
#
#   1. regenerate  the first turn of QUALITY_ROWS ShareGPT conversations, answered by SmolLM2 itself
#   2. pack        into 512-token blocks (cu_seqlens), loss on the regenerated answers
#   3. extract     the verifier's hidden states into a feature store
#   4. held out    SmolLM2's own greedy answers to the 80 MT-Bench questions (both turns), as a
#                  second store: never trained on, scored offline (simulated acceptance length)
#   5. train       the drafter, with checkpoints for the learning curve
#   6. evaluate    offline on the held-out store (every checkpoint: the learning curve), and online:
#                  speculative decoding of the first QUALITY_ONLINE_QUESTIONS MT-Bench questions, checked
#                  token for token against greedy decoding, speculative vs greedy tokens/s
#
# Stage 1 resumes (re-running continues an unfinished regeneration; with other QUALITY_ROWS or
# QUALITY_MAX_NEW_TOKENS use a new QUALITY_DIR); the others start over (--force). Relative paths in
# QUALITY_DIR and QUALITY_MT_BENCH are taken from the repository root.
# Measured wall times and results are in docs/guide-training.md and docs/benchmarks.md. Override the sizes with the
# environment variables below (checked before anything runs).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${QUALITY_DIR:-quality}
ROWS=${QUALITY_ROWS:-1600}
MAX_NEW_TOKENS=${QUALITY_MAX_NEW_TOKENS:-192}
STEPS=${QUALITY_STEPS:-2400}
LR=${QUALITY_LR:-1e-3}
NUM_DEPTHS=${QUALITY_NUM_DEPTHS:-4}
DRAFT_TOKENS=${QUALITY_DRAFT_TOKENS:-4}
DRAFT_VOCAB=${QUALITY_DRAFT_VOCAB:-4096}
ONLINE_QUESTIONS=${QUALITY_ONLINE_QUESTIONS:-10}
HELD_OUT_QUESTIONS=${QUALITY_HELD_OUT_QUESTIONS:-80}
MT_BENCH=${QUALITY_MT_BENCH:-../shared/data/mt_bench_question.jsonl}
THREADS=${QUALITY_THREADS:-2}

PREFIX=quality.sh; . scripts/checks.sh
check_positive_ints QUALITY_ROWS QUALITY_MAX_NEW_TOKENS QUALITY_STEPS QUALITY_NUM_DEPTHS QUALITY_DRAFT_TOKENS \
  QUALITY_DRAFT_VOCAB QUALITY_ONLINE_QUESTIONS QUALITY_HELD_OUT_QUESTIONS QUALITY_THREADS
check_positive_number QUALITY_LR "$LR"
(( DRAFT_TOKENS <= NUM_DEPTHS )) || bad "QUALITY_DRAFT_TOKENS=$DRAFT_TOKENS: at most QUALITY_NUM_DEPTHS=$NUM_DEPTHS"
(( STEPS >= 4 )) || bad "QUALITY_STEPS=$STEPS: expected at least 4 (four checkpoints make the learning curve)"
[[ -f $MT_BENCH ]] || bad "QUALITY_MT_BENCH=$MT_BENCH: no such file; download FastChat's MT-Bench questions:
  curl --create-dirs -o $MT_BENCH https://raw.githubusercontent.com/lm-sys/FastChat/main/fastchat/llm_judge/data/mt_bench/question.jsonl"
[[ ! -e $OUT || -d $OUT ]] || bad "QUALITY_DIR=$OUT: exists and is not a directory"

bash scripts/setup_env.sh
. .venv/bin/activate
export OMP_NUM_THREADS=$THREADS
mkdir -p "$OUT"
t0=$(date +%s)
stamp() { echo "$1 $(( $(date +%s) - t0 ))" >> "$OUT/stage_seconds.txt"; }
: > "$OUT/stage_seconds.txt"

echo "== 1/6 regenerate: SmolLM2 answers the first turn of $ROWS ShareGPT conversations (<= $MAX_NEW_TOKENS tokens)"
peagle-data regenerate sharegpt --verifier smollm2-135m --turns first --max-prompt-tokens 192 \
  --max-new-tokens "$MAX_NEW_TOKENS" --batch-size 64 --limit "$ROWS" --output "$OUT/regenerated.jsonl" --resume
stamp regenerate

echo "== 2/6 pack the regenerated conversations"
peagle-data pack "$OUT/regenerated.jsonl" --tokenizer smollm2-135m --output "$OUT/packed" --max-seq-len 512 --force
stamp pack

echo "== 3/6 extract hidden states with SmolLM2-135M-Instruct"
peagle-data extract "$OUT/packed" --verifier smollm2-135m --output "$OUT/features.zarr" --force \
  > "$OUT/extract_summary.json"
stamp extract

echo "== 4/6 held-out store: SmolLM2's greedy answers to $HELD_OUT_QUESTIONS MT-Bench questions (never trained on)"
python - "$MT_BENCH" "$OUT/mt_bench_prompts.jsonl" <<'PY'
import json, sys
# each question's turns, with a placeholder answer after each: regenerate --turns all replaces every
# answer by the verifier's greedy one given its own earlier answers, as peagle-eval's online turns do
with open(sys.argv[1]) as f, open(sys.argv[2], "w") as out:
    for line in f:
        if line.strip():
            q = json.loads(line)
            msgs = [m for t in q["turns"] for m in ({"role": "user", "content": t}, {"role": "assistant", "content": "-"})]
            out.write(json.dumps({"id": f"mt_bench:{q['question_id']}", "messages": msgs}) + "\n")
PY
peagle-data regenerate "$OUT/mt_bench_prompts.jsonl" --verifier smollm2-135m --turns all --max-new-tokens 128 \
  --batch-size 80 --limit "$HELD_OUT_QUESTIONS" --output "$OUT/mt_bench_greedy.jsonl" --resume
peagle-data pack "$OUT/mt_bench_greedy.jsonl" --tokenizer smollm2-135m --output "$OUT/mt_bench_packed" \
  --max-seq-len 1024 --force
peagle-data extract "$OUT/mt_bench_packed" --verifier smollm2-135m --output "$OUT/mt_bench.zarr" --force \
  > "$OUT/mt_bench_extract_summary.json"
stamp held_out

echo "== 5/6 train the drafter ($STEPS steps, K=$NUM_DEPTHS, lr $LR, draft vocab $DRAFT_VOCAB; the other options are peagle-train's defaults)"
peagle-train --store "$OUT/features.zarr" --output "$OUT/drafter" --max-steps "$STEPS" --lr "$LR" \
  --num-depths "$NUM_DEPTHS" --draft-vocab-size "$DRAFT_VOCAB" --save-every $(( STEPS / 4 )) --force \
  > "$OUT/train_summary.json"
stamp train

echo "== 6/6 evaluate: offline on the held-out store (each checkpoint), online on $ONLINE_QUESTIONS MT-Bench questions"
steps=$(cd "$OUT/drafter" && ls -d checkpoint-* | sed 's/^checkpoint-//' | sort -n)
[[ -n $steps ]] || { echo "quality.sh: no checkpoint in $OUT/drafter" >&2; exit 1; }
for step in $steps; do
  peagle-eval --drafter "$OUT/drafter/checkpoint-$step" --store "$OUT/mt_bench.zarr" --all-anchor --num-draft-tokens "$DRAFT_TOKENS" \
    --output "$OUT/drafter/checkpoint-$step/held_out.json" --force > /dev/null
done
OMP_NUM_THREADS=1 peagle-eval --drafter "$OUT/drafter/final" --verifier smollm2-135m --prompts "$MT_BENCH" \
  --num-prompts "$ONLINE_QUESTIONS" --num-draft-tokens "$DRAFT_TOKENS" --output "$OUT/online.json" --force > /dev/null
stamp evaluate

python scripts/quality_report.py "$OUT" | tee "$OUT/report.txt"
