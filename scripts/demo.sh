#!/usr/bin/env bash
# The main job on the embedded defaults, end to end on a CPU:
#   ShareGPT conversations -> pack -> extract (SmolLM2-135M) -> train a drafter -> evaluate.
# Sizes are chosen for a few minutes per stage on 2 CPU cores (measured wall times, with the
# machine load, are in docs/guide-setup.md; yours depend on your machine). Override them with the environment
# variables below (checked before anything runs: a bad value stops the script naming the variable).
# Re-running over an existing DEMO_DIR replaces its outputs: every stage passes --force on purpose,
# so the demo can be repeated with other settings; do not point DEMO_DIR at results you want to keep.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${DEMO_DIR:-demo}
CONVERSATIONS=${DEMO_CONVERSATIONS:-100}
MAX_SEQ_LEN=${DEMO_MAX_SEQ_LEN:-512}
MAX_WINDOWS=${DEMO_MAX_WINDOWS:-1}
STEPS=${DEMO_STEPS:-300}
LR=${DEMO_LR:-1e-3}
DRAFT_VOCAB=${DEMO_DRAFT_VOCAB:-4096}
NUM_DEPTHS=${DEMO_NUM_DEPTHS:-4}
PROMPTS=${DEMO_PROMPTS:-examples/prompts.jsonl}
NUM_PROMPTS=${DEMO_NUM_PROMPTS:-2}
MAX_NEW_TOKENS=${DEMO_MAX_NEW_TOKENS:-32}
MEASURE_COSTS=${DEMO_MEASURE_COSTS:-1}   # 0: skip the cost model's timing after the online eval (--no-measure-costs)

PREFIX=demo.sh; . scripts/checks.sh
check_positive_ints DEMO_CONVERSATIONS DEMO_MAX_SEQ_LEN DEMO_MAX_WINDOWS DEMO_STEPS DEMO_DRAFT_VOCAB \
  DEMO_NUM_DEPTHS DEMO_NUM_PROMPTS DEMO_MAX_NEW_TOKENS
check_positive_number DEMO_LR "$LR"
(( MAX_SEQ_LEN >= 2 )) || bad "DEMO_MAX_SEQ_LEN=$MAX_SEQ_LEN: expected at least 2 tokens"
[[ -f $PROMPTS ]] || bad "DEMO_PROMPTS=$PROMPTS: no such file"
[[ $MEASURE_COSTS == 0 || $MEASURE_COSTS == 1 ]] || bad "DEMO_MEASURE_COSTS=$MEASURE_COSTS: expected 0 or 1"
COSTS=--measure-costs; [[ $MEASURE_COSTS == 1 ]] || COSTS=--no-measure-costs
[[ ! -e $OUT || -d $OUT ]] || bad "DEMO_DIR=$OUT: exists and is not a directory"

bash scripts/setup_env.sh
. .venv/bin/activate
mkdir -p "$OUT"
t0=$(date +%s)

echo "== 1/4 pack $CONVERSATIONS ShareGPT conversations (first $MAX_WINDOWS window(s) of $MAX_SEQ_LEN tokens each)"
peagle-data pack sharegpt --tokenizer smollm2-135m --output "$OUT/packed" \
  --limit "$CONVERSATIONS" --max-seq-len "$MAX_SEQ_LEN" --max-windows "$MAX_WINDOWS" --force

echo "== 2/4 extract hidden states with SmolLM2-135M-Instruct"
peagle-data extract "$OUT/packed" --verifier smollm2-135m --output "$OUT/features.zarr" --force \
  > "$OUT/extract_summary.json"
peagle-data verify "$OUT/features.zarr" > "$OUT/verify.json"

echo "== 3/4 train the P-EAGLE drafter ($STEPS steps, K=$NUM_DEPTHS, draft vocab $DRAFT_VOCAB)"
peagle-train --store "$OUT/features.zarr" --output "$OUT/drafter" --max-steps "$STEPS" --lr "$LR" \
  --num-depths "$NUM_DEPTHS" --draft-vocab-size "$DRAFT_VOCAB" --force > "$OUT/train_summary.json"

echo "== 4/4 evaluate offline (held-out blocks) and online (speculative decoding, $NUM_PROMPTS prompts of $PROMPTS)"
peagle-eval --drafter "$OUT/drafter/final" --verifier smollm2-135m --store "$OUT/features.zarr" --all-anchor \
  --prompts "$PROMPTS" --num-prompts "$NUM_PROMPTS" --max-new-tokens "$MAX_NEW_TOKENS" \
  "$COSTS" \
  --output "$OUT/eval.json" --force > /dev/null

python - "$OUT" "$t0" <<'PY'
import json, os, sys, time
out, t0 = os.path.abspath(sys.argv[1]), int(sys.argv[2])
r = json.load(open(f"{out}/eval.json"))
print()
print(f"acceptance length (online, greedy): {r['acceptance_length']:.3f}")
print(f"acceptance rate: {r['acceptance_rate']:.3f}   identical to greedy: {r['identical_to_greedy']}")
print(f"tokens/s: {r['tokens_per_second']:.1f} speculative vs {r['baseline_tokens_per_second']:.1f} plain")
steps = json.load(open(f"{out}/train_summary.json"))["steps"]
ratio = r["tokens_per_second"] / r["baseline_tokens_per_second"]
if ratio < 1:
    print(f"In plain words: speculative decoding was {1 / ratio:.1f}x SLOWER than plain decoding here, "
          f"because this demo drafter, trained for only {steps} steps, gets few drafts accepted "
          f"(acceptance length {r['acceptance_length']:.2f}), while this run's own figures put the "
          f"break-even at an acceptance length of about {r['acceptance_length'] / ratio:.1f} "
          "(acceptance length / speed ratio; about 2 on an idle CPU, docs/benchmarks.md); a drafter "
          "worth using needs far more data and steps (docs/guide-training.md, 'A drafter that pays? The quality "
          "recipe').")
else:
    print(f"In plain words: speculative decoding was {ratio:.1f}x faster than plain decoding here, with "
          "the same output; more data and steps give a better drafter (README, 'Your own verifier and data').")
if "offline" in r:
    replay = r["offline"].get("replay") or {}
    if "acceptance_length" in replay:
        print(f"acceptance length (offline, replayed on the store's turns): {replay['acceptance_length']:.3f}")
    print(f"acceptance length (offline, all-anchor mean: a diagnostic; the demo packs windows, which the replay "
          f"cannot walk): {r['offline']['simulated_acceptance_length']:.3f}")
print("artifacts:")
for name, path in [("packed dataset", "packed"), ("feature store", "features.zarr"),
                   ("drafter checkpoint", "drafter/final"), ("training metrics", "drafter/metrics.jsonl"),
                   ("training plot", "drafter/training.png"), ("evaluation report", "eval.json"),
                   ("evaluation plot", "eval.png")]:
    print(f"  {name:<20} {out}/{path}")
print(f"wall time of the pipeline: {time.time() - t0:.0f} s")
PY
