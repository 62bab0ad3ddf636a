#!/usr/bin/env bash
# `make gpu-wheels`: fetch, on this machine (with its package index), the wheels `make gpu-check` installs on a GPU
# machine without network: each package of tools/gpu_wheels.txt at its pinned version, for CPython 3.12 on manylinux
# x86_64, binary only, without its dependencies (the list is the closure; `tools/gpu_carry.py closure` checks it).
# They go to .cache/gpu-wheels (ignored by git; the device tool carries it by name). A wheel already there is kept.
#
#   tools/gpu_wheels.sh                     # uses .venv/bin/python's pip (or python3's)
#   GPU_WHEELS_FROM=DIR tools/gpu_wheels.sh # take a wheel from DIR when DIR has it (e.g. megatron-core, einops)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=${PYTHON:-}
if [[ -z $PY ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=$(command -v python3); fi
fi
OUT=${GPU_WHEELS_DIR:-.cache/gpu-wheels}
PYVER=${GPU_WHEELS_PYTHON:-3.12}
mkdir -p "$OUT"
# manylinux_2_28 (the platform asked for) and the older tags such a machine also takes (pip does not widen an
# explicit --platform by itself)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
mapfile -t REQS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' tools/gpu_wheels.txt | grep -v '^$')
fetched=0 kept=0
for req in "${REQS[@]}"; do
  name=${req%%==*} version=${req##*==}
  file=$(echo "$name" | tr '-' '_')
  if compgen -G "$OUT/${file}-${version}-*.whl" >/dev/null || compgen -G "$OUT/${name}-${version}-*.whl" >/dev/null; then
    kept=$((kept + 1)); continue
  fi
  if [[ -n ${GPU_WHEELS_FROM:-} ]]; then  # a pure-Python wheel, or one for this CPython
    for whl in "$GPU_WHEELS_FROM/${file}-${version}-"{py3,cp${PYVER/./}-}*.whl; do
      [[ -e $whl ]] && cp "$whl" "$OUT/"
    done
  fi
  if ! compgen -G "$OUT/${file}-${version}-*.whl" >/dev/null; then
    if ! timeout 300 "$PY" -m pip download --quiet --disable-pip-version-check --only-binary :all: \
        --python-version "$PYVER" "${PLATFORMS[@]}" --no-deps -d "$OUT" "$req"; then
      echo "gpu-wheels: FAIL: pip download of $req (Python $PYVER, manylinux x86_64) failed or took over 300 s" >&2
      exit 1
    fi
  fi
  fetched=$((fetched + 1))
done
echo "gpu-wheels: ${#REQS[@]} packages in $OUT ($fetched fetched, $kept already there), $(du -sh "$OUT" | cut -f1)"
"$PY" tools/gpu_carry.py closure "$OUT" --python-version "$PYVER"
