#!/usr/bin/env bash
# The wheels bench/gpu_check.sh needs on a lent GPU machine, fetched here ahead of the lease (that machine
# reaches no registry, and its device minutes are few): for its Python (3.12, manylinux x86_64), at the
# versions .venv pins, into .whl/ (git-ignored). Its image already has torch, transformers, tokenizers,
# safetensors, jinja2, numpy, grpcio, prometheus-client, uvloop, anyio, h11, click and pytest
# (/work/.library/device/KINDS.md); this brings the rest of what the server, the benchmark's SSE server and
# load generator, and the engine tests import.
#
# Usage: bench/gpu_wheels.sh            then a device run with carry [".whl"]: OUT=... bench/gpu_check.sh
# Env: PY (.venv/bin/python), DEST (.whl), PYTHON_VERSION (3.12)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEST=${DEST:-.whl}
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
PACKAGES=(protobuf grpclib h2 hpack hyperframe multidict smg-grpc-proto httptools starlette uvicorn
          pytest-asyncio setproctitle)

frozen=$("$PY" -m pip freeze --all)
pins=()
for package in "${PACKAGES[@]}"; do
  # pip freeze spells names as they were published; compare them normalized (PEP 503)
  pin=$(printf '%s\n' "$frozen" | awk -F'==' -v want="$package" '
    { name = tolower($1); gsub(/[-_.]+/, "-", name) } name == want { print $1 "==" $2; exit }')
  [[ -n $pin ]] || { echo "gpu_wheels: $package is not installed in $PY's environment" >&2; exit 1; }
  pins+=("$pin")
done
abi="cp${PYTHON_VERSION/./}"
rm -rf "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$DEST" \
  --python-version "$PYTHON_VERSION" --implementation cp --abi "$abi" --abi abi3 --abi none \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any "${pins[@]}"
ls "$DEST"
