#!/usr/bin/env bash
# `make sglang-env`: SGLang 0.5.23 on the CPU torch, in an environment of its own ($MEGARL_SGLANG_ENV, default
# .cache/sglang-env), for the tests that run megarl's SGLang adapter against the real engine (tests/sglang_cpu).
#
# SGLang's metadata pins a CUDA torch (2.14.1), its CUDA kernels and transformers 5.19.0, so a plain
# `pip install sglang` cannot give a CPU engine. The recipe (shared/notes: "SGLang 0.5.23 on a CPU-only machine"):
#   1. torch==$TORCH_VERSION, the CPU build pip's configuration gives on this project's machines;
#   2. sglang==0.5.23 with --no-deps;
#   3. sglang's own requirements, less the CUDA-only ones (CUDA_ONLY below), under a constraint pinning that torch;
#   4. torchvision with --no-deps (SGLang imports torchvision.transforms at import time; the only build on PyPI is
#      a CUDA one, which imports beside the CPU torch once tests/sglang_cpu/standins defines its operator schemas);
#   5. megarl's own requirements (setup.py's install_requires), the same torch pinned; megarl itself is not
#      installed: the tests put the checkout first on PYTHONPATH.
# Then the stamp, which holds the recipe's hash: an unchanged recipe is not rebuilt (tools/engine_env/common.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

ENV_DIR="${MEGARL_SGLANG_ENV:-.cache/sglang-env}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
SGLANG_VERSION=0.5.23
TORCHVISION_VERSION=0.28.0
# sglang 0.5.23's requirements that are CUDA-only (or pull a CUDA torch), by normalised name or name prefix.
CUDA_ONLY="torch torchaudio torchcodec torchvision timm flashinfer* flash-attn-4 sglang-kernel sgl-deep-ep
sgl-deep-gemm sgl-flash-mla nvidia-* cuda-python nvshmem4py* quack-kernels tilelang humming-kernels
torch-memory-saver deepseek-recipe tml-renderers"

source tools/engine_env/common.sh
env_begin
echo "== sglang==$SGLANG_VERSION, torchvision==$TORCHVISION_VERSION (no deps)"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION" "torchvision==$TORCHVISION_VERSION"
env_requirements sglang "$CUDA_ONLY"
env_megarl_requirements
"$PY" -m pip check > "$ENV_DIR/pip-check.txt" || echo "== pip check: $(wc -l < "$ENV_DIR/pip-check.txt") unmet requirements, all sglang's CUDA-only ones (pip-check.txt)"
# The import check runs with the tests' stand-ins (tests/sglang_cpu/standins), as the tests do.
PYTHONPATH=tests/sglang_cpu/standins SGLANG_USE_CPU_ENGINE=1 "$PY" -W ignore -c '
import torch, sglang, sglang.srt.entrypoints.engine, megatron.core, transformers
print("== ready: torch", torch.__version__, "sglang", sglang.__version__, "transformers", transformers.__version__)'
env_finish
