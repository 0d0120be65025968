#!/usr/bin/env bash
# The checks of issues 4 and 5 that need a CUDA device, in one short run (about 5 minutes on one
# GPU with the SmolLM2 cache warm; the first run converts SmolLM2 from its GGUF, about 1 minute).
#   1. every test marked `cuda` (extraction with SDPA block masks and FlashAttention varlen against
#      segments run alone and against the CPU store; exact side-stream copies; flex_attention vs
#      SDPA loss and gradients in training);
#      hybrid verifiers (test_cuda_hybrid_features_equal_each_conversation_alone) with their CUDA kernels;
#   2. bench/bench_extract.py on CUDA: whole extract vs the forward alone with features left on the
#      GPU (the GPU's busy time), so extract_vs_on_device ~ 1.0 means the writer leaves it no idle time.
#   3. where vLLM is installed: hybrid verifiers through `extract --engine vllm` against hf (Qwen3-Next and Qwen3.5;
#      tests/peagle_data/extract/test_vllm.py -k hybrid), and a drafter trained on Qwen3-Next / Qwen3.5 served by
#      vLLM identical to greedy with vLLM's accepted drafts peagle's step by step (tests/e2e/test_families_pipeline.py
#      -k served_by_vllm; the CPU suite runs both too, in bf16 and with prefix caching off); the served P-EAGLE
#      drafters only where the installed vLLM serves P-EAGLE (up to 0.33).
#   4. where vLLM is installed: DFlash (vLLM's `method: dflash`, the parallel drafter every vLLM from 0.32 serves,
#      P-EAGLE included only up to 0.33): a store extracted on the GPU from the packed data, a DFlash drafter trained
#      on it for a few steps on the GPU (`peagle-train --method dflash`), served by this GPU's vLLM through
#      `peagle-eval --engine vllm` at T = 0; its output must be identical to vLLM's greedy decoding without the
#      drafter (peagle-eval exits 1 on a mismatch; the check below also requires `identical_to_greedy` true).
# Results go to ${OUT:-gpu_check}/ (pytest logs, the benchmark's JSON, the DFlash drafter and its vLLM report).
# Run it with a Python that has a CUDA build of torch and peagle's dependencies (not the CPU .venv
# that scripts/setup_env.sh makes): e.g. `pip install -e ".[test]"` into the GPU machine's Python,
# or PYTHONPATH pointing at them. PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
PEAGLE_SLOW_TESTS=1 $PY -m pytest -m cuda -v tests 2>&1 | tee "$OUT/pytest_cuda.log"
if [ ! -d "${PACKED:-demo/packed}" ]; then
  $PY -m cli.data pack sharegpt --tokenizer smollm2-135m --output demo/packed --limit 400 --max-seq-len 2048 --force
fi
$PY bench/bench_extract.py --packed "${PACKED:-demo/packed}" --blocks 64 --repeats 3 --device cuda \
  | tee "$OUT/bench_extract_cuda.json"
if $PY -c "import vllm" 2>/dev/null; then
  # the served P-EAGLE drafters only where this vLLM serves P-EAGLE (up to 0.33; from 0.34 peagle refuses them)
  select="hybrid or served_by_vllm"
  if ! $PY -c "import sys; from runtime.vllm_runtime import installed_vllm_version, peagle_vllm_refusal; \
sys.exit(1 if peagle_vllm_refusal(installed_vllm_version()) else 0)"; then
    select="hybrid and not served_by_vllm"
    echo "gpu_check: this vLLM does not serve P-EAGLE drafters: the served hybrid drafters are skipped" >&2
  fi
  PEAGLE_REQUIRE_VLLM=1 PEAGLE_SLOW_TESTS=1 $PY -m pytest -m vllm -v -s -k "$select" \
    tests/peagle_data/extract/test_vllm.py tests/e2e/test_families_pipeline.py 2>&1 | tee "$OUT/pytest_vllm_hybrid.log"
fi
if $PY -c "import vllm" 2>/dev/null; then
  D="$OUT/dflash"; mkdir -p "$D"
  $PY -m cli.data extract "${PACKED:-demo/packed}" --verifier smollm2-135m --output "$D/features.zarr" --force \
    > "$D.extract.json"
  $PY -m cli.train --store "$D/features.zarr" --output "$D/drafter" --method dflash --block-size 5 \
    --draft-vocab-size 4096 --max-steps 60 --force 2>&1 | tail -n 5
  $PY -m cli.eval --drafter "$D/drafter/final" --prompts examples/prompts.jsonl --num-prompts 8 --max-new-tokens 128 \
    --engine vllm > "$OUT/dflash_vllm.json"
  $PY - "$OUT/dflash_vllm.json" <<'PYEOF'
import json, sys
report = json.load(open(sys.argv[1]))
print(f"DFlash served by vLLM {report.get('vllm_version')}: identical to greedy {report['identical_to_greedy']}, "
      f"AL {report.get('acceptance_length')}")
assert report["identical_to_greedy"] is True, f"DFlash output differs from greedy: {report.get('mismatches')}"
PYEOF
fi
