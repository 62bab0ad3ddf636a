#!/usr/bin/env bash
# `make openenv-env`: openenv-core 0.3.0 beside megarl's requirements on the CPU torch, in an environment of its own
# ($MEGARL_OPENENV_ENV, default .cache/openenv-env), for tests/openenv_cpu (the tests build it when it is absent).
#
# openenv-core cannot join the test venv: it needs httpx>=0.28.1 and the `dev` extra's leptonai<0.47 (for nemo-run)
# pins httpx==0.27.2. The recipe:
#   1. torch==$TORCH_VERSION, the CPU build pip's configuration gives on this project's machines;
#   2. openenv-core==0.3.0 with its requirements, under a constraint pinning that torch;
#   3. megarl's own requirements (setup.py's install_requires), the same torch pinned, and pytest with
#      pytest-timeout (the checks in tests/openenv_cpu/openenv_checks.py run in it); megarl itself is not
#      installed: the tests put the checkout first on PYTHONPATH.
# pip check must be clean. Then the stamp, which holds the recipe's hash: an unchanged recipe is not rebuilt
# (tools/engine_env/common.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

ENV_DIR="${MEGARL_OPENENV_ENV:-.cache/openenv-env}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
OPENENV_VERSION=0.3.0

source tools/engine_env/common.sh
env_begin
echo "== openenv-core==$OPENENV_VERSION"
"${PIP[@]}" -c "$ENV_DIR/torch-constraint.txt" "openenv-core==$OPENENV_VERSION"
env_megarl_requirements
"${PIP[@]}" -c "$ENV_DIR/torch-constraint.txt" "pytest>=8,<9" pytest-timeout
"$PY" -m pip check
"$PY" -W ignore -c '
import torch, openenv, openenv.core.env_server, megatron.core, transformers
print("== ready: torch", torch.__version__, "openenv", openenv.__version__, "transformers", transformers.__version__)'
env_finish
