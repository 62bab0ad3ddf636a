#!/usr/bin/env bash
# `make verifiers-env`: verifiers 0.4.0 in an environment of its own ($MEGARL_VERIFIERS_ENV, default
# .cache/verifiers-env), for the `verifiers` rollout function (megarl/rollout/verifiers_env.py) and its tests.
#
# verifiers needs openai>=2.54 and transformers 5.25; SGLang 0.5.23 pins openai 2.8.0 and megarl's venv has its own
# transformers, so verifiers runs in this environment, in a process of its own (megarl/rollout/verifiers_worker.py),
# and talks to megarl's token endpoint over HTTP. verifiers does not need torch, and this environment must never
# get one: pip is told the torch it may not install (a constraint no release satisfies), and the last step checks.
# megarl itself is not installed: the worker is a single file run with this environment's interpreter, which
# imports nothing of megarl.
# The stamp holds the recipe's hash (this script, the interpreter): an unchanged recipe is not rebuilt.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

ENV_DIR="${MEGARL_VERIFIERS_ENV:-.cache/verifiers-env}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
VERIFIERS_VERSION=0.4.0

RECIPE="$( { cat "${BASH_SOURCE[0]}"; echo "$PYTHON $("$PYTHON" --version 2>&1)"; } | sha256sum | cut -c1-16)"
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
# torch<0 matches no release: a requirement that pulls torch in fails the install instead of downloading it.
printf 'torch<0\n' > "$ENV_DIR/no-torch-constraint.txt"
"$PY" -m pip install --quiet --disable-pip-version-check --no-warn-conflicts \
  -c "$ENV_DIR/no-torch-constraint.txt" "verifiers==$VERIFIERS_VERSION"
"$PY" -W ignore -c '
import importlib.util, sys
if importlib.util.find_spec("torch") is not None:
    sys.exit("torch is installed in the verifiers environment")
import verifiers, openai, transformers
print("== ready: verifiers", verifiers.__version__, "openai", openai.__version__, "transformers", transformers.__version__)'
echo "$RECIPE" > "$STAMP"
echo "== built $ENV_DIR in $(( $(date +%s) - START )) s, $(du -sh "$ENV_DIR" | cut -f1) on disk"
