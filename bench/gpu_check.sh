#!/usr/bin/env bash
# The GPU checks, as one script for a lent GPU machine (not CI): the engine's tests on CUDA, then the
# frontend benchmark on a model of realistic shape (Llama-3.2-1B's, random bfloat16 weights, drawn on the GPU).
#
# The machine has python3 with torch/transformers but no network: the other wheels travel in .whl/, which
# bench/gpu_wheels.sh fills here before the lease (carry [".whl"]); our packages are used from the source
# tree. Every stage logs to $OUT and a failing stage does not stop the next one.
#
# Usage: OUT=/tmp/out bench/gpu_check.sh [tests] [steps] [bench]      (default: all three)
#   steps: engine step times on $SPEC as shipped (Triton decode kernel, CUDA graphs for decode steps), without
#          the graphs (ENGINE_CUDA_GRAPHS=0) and without either (ENGINE_TRITON_DECODE=0)
# A 15-minute lease holds the machine's start, the model's build and about two stages: the CUDA tests passed on
# 2026-12-04; what no GPU has timed yet is `steps` (the Triton decode kernel, CUDA graphs), then `bench`
# (CONCURRENCY=64,256 fits beside it).
# Env: DEVICE (cuda), SPEC (bench-llama-1b), CONCURRENCY (1,16,64,256), SERVERS (grpc,grpc-ids,sse,inproc),
#      SERVER_CORES (0,1), CLIENT_CORE (2), WHEELS (.whl)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to a folder for the logs and results}
DEVICE=${DEVICE:-cuda}
SPEC=${SPEC:-bench-llama-1b}
STAGES=${*:-tests steps bench}
export PYTHONUNBUFFERED=1
export ENGINE_CACHE_DIR=${ENGINE_CACHE_DIR:-/tmp/engine-cache}
site=/tmp/engine-site
wheels=${WHEELS:-.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$wheels"/*.whl || exit 1
fi
export PYTHONPATH=$site:$PWD/gen/python:$PWD/server:$PWD/clients/python/src:$PWD/tests
mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
"transformers", transformers.__version__)'; nproc; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

if [[ " $STAGES " == *" tests "* ]]; then
  echo "== engine tests on $DEVICE"
  # The embedding test needs a model from PyPI (not on the machine); the kernel tests are CPU code.
  ENGINE_TEST_DEVICE=$DEVICE timeout 240 python3 -m pytest tests/engine -q -p no:cacheprovider \
    -k "not kernel and not fused and not embedding" 2>&1 | tee "$OUT/engine-tests.txt" | tail -15
fi

models=/tmp/engine-models
if [[ " $STAGES " == *" steps "* || " $STAGES " == *" bench "* ]]; then
  echo "== building $SPEC on $DEVICE"
  [[ -f $models/$SPEC/engine_test_model.json ]] \
    || timeout 180 python3 scripts/build_test_models.py "$models" --only "$SPEC" --device "$DEVICE" 2>&1 | tail -3
fi

if [[ " $STAGES " == *" steps "* ]]; then
  for variant in "1 1" "1 0" "0 0"; do
    read -r triton graphs <<< "$variant"
    echo "== engine steps on $DEVICE, ENGINE_TRITON_DECODE=$triton ENGINE_CUDA_GRAPHS=$graphs"
    ENGINE_TRITON_DECODE=$triton ENGINE_CUDA_GRAPHS=$graphs timeout 150 python3 bench/engine_steps.py \
      --model "$models/$SPEC" --device "$DEVICE" --seqs 1,16,64,256 --output 32 2>&1 \
      | tee "$OUT/steps-triton$triton-graphs$graphs.txt" | tail -8
  done
fi

if [[ " $STAGES " == *" bench "* ]]; then
  echo "== frontend benchmark"
  set -o pipefail
  timeout 420 python3 bench/frontend.py --engines model --model "$models/$SPEC" --device "$DEVICE" \
    --servers "${SERVERS:-grpc,grpc-ids,sse,inproc}" --concurrency "${CONCURRENCY:-1,16,64,256}" \
    --server-cores "${SERVER_CORES:-0,1}" --client-core "${CLIENT_CORE:-2}" --section gpu --markdown "$OUT/BENCHMARKS-gpu.md" --plots "$OUT" \
    --json "$OUT/frontend-gpu.json" 2>&1 | tee "$OUT/frontend.txt" | tail -40
  echo "frontend rc=$?"
fi
