# Sourced by tools/sglang_cpu/build_env.sh and tools/vllm_cpu/build_env.sh: the steps every inference engine's CPU
# environment shares. An engine's script sets ENV_DIR, PYTHON and TORCH_VERSION, then calls, in order:
#   env_begin               stop here if the stamp matches the recipe; else a fresh venv with the CPU torch,
#                           pinned for every later install by $ENV_DIR/torch-constraint.txt
#   env_requirements D S    install distribution D's requirements (extras left out) less those whose normalised
#                           name matches a glob in S, under that constraint
#   env_megarl_requirements install setup.py's install_requires (megarl itself is not installed: the tests put the
#                           checkout first on PYTHONPATH)
#   env_finish              check pip left the CPU torch, write the stamp
# The recipe (the stamp's content) hashes the engine's script, this file, setup.py, the interpreter and the torch
# version: a change to any of them rebuilds the environment.

env_begin() {
  RECIPE="$( { cat "${BASH_SOURCE[1]}" "${BASH_SOURCE[0]}" setup.py; echo "$PYTHON $TORCH_VERSION"; } \
    | sha256sum | cut -c1-16)"
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
  echo "== $(cat "$ENV_DIR/torch-constraint.txt")"
}

env_requirements() {
  local dist=$1 skip=$2 out="$ENV_DIR/$1-requirements.txt"
  DIST="$dist" SKIP="$skip" "$PY" - > "$out" <<'PY'
import fnmatch, os, re
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement

skip = os.environ["SKIP"].split()
for line in requires(os.environ["DIST"]) or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    if any(fnmatch.fnmatch(name, pattern) for pattern in skip):
        continue
    print(str(req).split(";")[0].strip())
PY
  echo "== $(wc -l < "$out") of $dist's requirements"
  "${PIP[@]}" -c "$ENV_DIR/torch-constraint.txt" -r "$out"
}

env_megarl_requirements() {
  "$PY" - > "$ENV_DIR/megarl-requirements.txt" <<'PY'
import ast, pathlib
tree = ast.parse(pathlib.Path("setup.py").read_text())
for node in ast.walk(tree):
    if isinstance(node, ast.keyword) and node.arg == "install_requires":
        print("\n".join(ast.literal_eval(node.value)))
PY
  "${PIP[@]}" -c "$ENV_DIR/torch-constraint.txt" -r "$ENV_DIR/megarl-requirements.txt"
}

env_finish() {
  "$PY" -W ignore -c 'import torch, sys; sys.exit(f"pip replaced the CPU torch: {torch.__version__}" if torch.version.cuda else 0)'
  echo "$RECIPE" > "$STAMP"
  echo "== built $ENV_DIR in $(( $(date +%s) - START )) s, $(du -sh "$ENV_DIR" | cut -f1) on disk"
}
